"""The params schema: which dataclass types each section of params.yaml (and of every profile).

SECTIONS is the one place that maps a section to its dataclass; a new stage adds one line here.
Classes are named as "module:Class" and imported only when asked for, so this module imports no
stage (stages import stages.params, and some of them pull torch or vLLM helpers).
"""
from __future__ import annotations

import dataclasses
import importlib
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


def check_section(section: str, raw: Any, source: str) -> None:
    """A complete section: every field present (no silent defaults), none unknown, each of its type."""
    cls = section_class(section, source)
    section_from_dict(section, raw, cls, source)  # not a mapping, unknown or required keys, types
    for field in dataclasses.fields(cls):
        if field.name not in raw:
            raise ParamsError(f"{source}: {section}.{field.name}: missing key (a profile sets every key)")


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
