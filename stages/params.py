"""Typed access to params.yaml: each stage declares a dataclass for its section.

Unknown and missing keys are errors that name the key, so a typo in a profile never
silently falls back to a default.
"""
from __future__ import annotations

import dataclasses
import os
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
    return cls(**raw)


def load_section(section: str, cls: type[T], path: Path = PARAMS_FILE) -> T:
    return section_from_dict(section, read_params(path).get(section), cls, str(path))
