"""Typed access to params.yaml: each stage declares a dataclass for its section.

Unknown and missing keys and values of the wrong type are errors that name the key, so a typo
in a profile never silently falls back to a default or reaches a stage as a string.
"""
from __future__ import annotations

import dataclasses
import os
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

import yaml

T = TypeVar("T")

PARAMS_FILE = Path(os.environ.get("EAGLE3_PARAMS", "params.yaml"))


class ParamsError(ValueError):
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
    missing = [name for name, f in fields.items() if name not in raw
               and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if missing:
        raise ParamsError(f"{source}: {section}.{missing[0]}: missing key")
    hints = typing.get_type_hints(cls)
    for name, value in raw.items():
        if not _matches(value, hints[name]):
            # PyYAML reads 1e-4 as a string (it wants 1.0e-4), and `384# note` is one string too.
            raise ParamsError(f"{source}: {section}.{name}: {value!r} is not of type "
                              f"{getattr(hints[name], '__name__', hints[name])}")
    return cls(**raw)


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


def load_section(section: str, cls: type[T], path: Path = PARAMS_FILE) -> T:
    return section_from_dict(section, read_params(path).get(section), cls, str(path))
