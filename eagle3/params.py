"""params.yaml: typed sections, and the schema of the whole file.

Each section is a dataclass without defaults (SECTIONS names it), so params.yaml is the one source
of every value: an unknown or missing key, or a value of the wrong type, is an error naming the
file and the key, and a typo in a profile never falls back to a default or reaches a stage as a
string. The classes are named as "module:Class" and imported only when asked for, so this module
imports no library part (stages import it, and some parts pull torch or vLLM helpers).
"""
from __future__ import annotations

import dataclasses
import importlib
import os
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

import yaml

from eagle3.errors import PipelineError

T = TypeVar("T")

PARAMS_FILE = Path(os.environ.get("EAGLE3_PARAMS", "params.yaml"))


SECTIONS: dict[str, str] = {
    "target": "eagle3.target.build:TargetParams",
    "prompts": "eagle3.data.prompts:PromptsParams",
    "serve": "eagle3.engine.server:ServeParams",
    "generate": "eagle3.generation.requests:GenerateParams",
    "vocab": "eagle3.vocab:VocabParams",
    "extract": "eagle3.extraction.params:ExtractParams",
    "train": "eagle3.training.params:TrainParams",
    "evaluate": "eagle3.evaluation.params:EvaluateParams",
}


class ParamsError(PipelineError, ValueError):
    pass


def read_params(path: Path = PARAMS_FILE) -> dict[str, Any]:
    if not Path(path).is_file():
        raise ParamsError(f"{path}: not found (run from the repository root)")
    with open(path, encoding="utf-8") as f:
        data = yaml.safe_load(f) or {}
    if not isinstance(data, dict):
        raise ParamsError(f"{path}: expected a mapping of stage sections, got {type(data).__name__}")
    return data


def section_from_dict(section: str, raw: Any, cls: type[T], source: str = str(PARAMS_FILE)) -> T:
    if not isinstance(raw, dict):
        raise ParamsError(f"{source}: section '{section}' missing or not a mapping")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        raise ParamsError(f"{source}: {section}.{unknown[0]}: unknown key (expected: {', '.join(fields)})")
    hints = typing.get_type_hints(cls)
    missing = [name for name in fields if name not in raw]
    if missing:
        raise ParamsError(f"{source}: {section}.{missing[0]}: missing key (expected a value of type "
                          f"{_type_name(hints[missing[0]])}: every key is required, there are no defaults; "
                          "profiles/embedded.yaml has them all)")
    for name, value in raw.items():
        if not _matches(value, hints[name]):
            # PyYAML reads 1e-4 as a string (it wants 1.0e-4), and `384# note` is one string too.
            raise ParamsError(f"{source}: {section}.{name}: {value!r} is not of type {_type_name(hints[name])}")
    return cls(**raw)


def _type_name(hint: Any) -> str:
    return hint.__name__ if isinstance(hint, type) else str(hint)  # int, or list[int] | None


def _matches(value: Any, hint: Any) -> bool:
    """Whether a YAML value fits a dataclass annotation (str, int, float, bool, list[X], dict[K, V], X | None)."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, arg) for arg in typing.get_args(hint))
    if origin is dict:
        key, item = typing.get_args(hint)
        return isinstance(value, dict) and all(_matches(k, key) and _matches(v, item) for k, v in value.items())
    if origin is list:
        (item,) = typing.get_args(hint)
        return isinstance(value, list) and all(_matches(v, item) for v in value)
    if hint is type(None):
        return value is None
    if hint is float:  # YAML writes 2 for 2.0; bool is an int in Python but never a number here
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, hint)


def load_section(section: str, cls: type[T], path: Path = PARAMS_FILE) -> T:
    return section_from_dict(section, read_params(path).get(section), cls, str(path))


def section_class(section: str, source: str = "params.yaml") -> type:
    if section not in SECTIONS:
        raise ParamsError(f"{source}: section '{section}' has no schema (add it to SECTIONS in eagle3/params.py)")
    module, name = SECTIONS[section].split(":")
    return getattr(importlib.import_module(module), name)


def check_params_file(path: Path, sections: set[str]) -> None:
    """A whole params file: exactly `sections` (those of params.yaml), each complete and typed."""
    data = read_params(path)
    extra, missing = sorted(set(data) - sections), sorted(sections - set(data))
    if extra:
        raise ParamsError(f"{path}: section(s) {', '.join(extra)} not in params.yaml")
    if missing:
        raise ParamsError(f"{path}: section(s) {', '.join(missing)} missing (params.yaml has them)")
    for name in sorted(sections):
        section_from_dict(name, data[name], section_class(name, str(path)), str(path))
