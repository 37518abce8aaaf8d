from __future__ import annotations

from dataclasses import dataclass

import pytest

from stages.params import ParamsError, section_from_dict


@dataclass
class Example:
    required: int
    optional: str = "x"


def test_section_accepts_known_keys_and_defaults():
    assert section_from_dict("ex", {"required": 3}, Example) == Example(3, "x")


def test_unknown_key_is_named():
    with pytest.raises(ParamsError, match=r"ex\.requird: unknown key \(expected: required, optional\)"):
        section_from_dict("ex", {"required": 1, "requird": 2}, Example)


def test_missing_key_is_named():
    with pytest.raises(ParamsError, match=r"ex\.required: missing key"):
        section_from_dict("ex", {"optional": "y"}, Example)


def test_missing_section_is_named():
    with pytest.raises(ParamsError, match="section 'ex' missing"):
        section_from_dict("ex", None, Example)


@dataclass
class Typed:
    count: int = 1
    rate: float = 0.5
    name: str | None = None
    ids: list[int] | None = None
    on: bool = False


@pytest.mark.parametrize("key, value", [
    ("count", "384# a comment"),  # YAML's comment needs a space before '#': the value is one string
    ("count", True),
    ("count", 1.5),
    ("rate", "1e-4"),  # PyYAML reads 1e-4 (no dot) as a string
    ("name", 3),
    ("ids", [1, "2"]),
    ("on", "yes please"),
])
def test_value_of_the_wrong_type_is_named(key, value):
    with pytest.raises(ParamsError, match=rf"ex\.{key}: .* is not of type"):
        section_from_dict("ex", {key: value}, Typed)


def test_values_of_the_declared_types_pass():
    raw = {"count": 2, "rate": 3, "name": None, "ids": [2, 15, 27], "on": True}
    assert section_from_dict("ex", raw, Typed) == Typed(**raw)
