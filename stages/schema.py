"""The params schema: which dataclass types each section of params.yaml (and of every profile).

SECTIONS is the one place that maps a section to its dataclass; a new stage adds one line here.
Classes are named as "module:Class" and imported only when asked for, so this module imports no
stage (stages import stages.params, and some of them pull torch or vLLM helpers).
"""
from __future__ import annotations

import dataclasses
import importlib
import types
import typing
from pathlib import Path
from typing import Any

from stages.params import ParamsError, read_params, section_from_dict

SECTIONS: dict[str, str] = {
    "target": "stages.target:TargetParams",
    "prompts": "stages.prompts:PromptsParams",
    "serve": "stages.server:ServeParams",
    "generate": "stages.generate:GenerateParams",
    "vocab": "stages.vocab:VocabParams",
    "extract": "stages.extract:ExtractParams",
    "train": "stages.train:TrainParams",
    "evaluate": "stages.evaluate:EvaluateParams",
}


def section_class(section: str, source: str = "params.yaml") -> type:
    if section not in SECTIONS:
        raise ParamsError(f"{source}: section '{section}' has no schema (add it to SECTIONS in stages/schema.py)")
    module, name = SECTIONS[section].split(":")
    return getattr(importlib.import_module(module), name)


def _matches(value: Any, hint: Any) -> bool:
    """Whether a YAML value fits a dataclass annotation (str, int, float, bool, list[X], X | None)."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, arg) for arg in typing.get_args(hint))
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


def check_section(section: str, raw: Any, source: str) -> None:
    """A complete section: every field present (no silent defaults), none unknown, each of its type."""
    cls = section_class(section, source)
    section_from_dict(section, raw, cls, source)  # unknown keys, required keys, not a mapping
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        if field.name not in raw:
            raise ParamsError(f"{source}: {section}.{field.name}: missing key (a profile sets every key)")
        if not _matches(raw[field.name], hints[field.name]):
            # PyYAML reads 1e-4 as a string (it wants 1.0e-4); this is where such a value is caught.
            raise ParamsError(f"{source}: {section}.{field.name}: {raw[field.name]!r} is not of type "
                              f"{getattr(hints[field.name], '__name__', hints[field.name])}")


def check_params_file(path: Path, sections: set[str]) -> None:
    """A whole params file: exactly `sections` (those of params.yaml), each complete and typed."""
    data = read_params(path)
    extra, missing = sorted(set(data) - sections), sorted(sections - set(data))
    if extra:
        raise ParamsError(f"{path}: section(s) {', '.join(extra)} not in params.yaml")
    if missing:
        raise ParamsError(f"{path}: section(s) {', '.join(missing)} missing (params.yaml has them)")
    for name in sorted(sections):
        check_section(name, data[name], str(path))
