from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import pytest

from eagle3.params import SECTIONS, ParamsError, section_class, section_from_dict


@dataclass
class Example:
    required: int
    optional: str = "x"


def test_every_key_is_required_even_one_with_a_dataclass_default():
    assert section_from_dict("ex", {"required": 3, "optional": "y"}, Example) == Example(3, "y")
    with pytest.raises(ParamsError, match=r"ex\.optional: missing key \(expected a value of type str"):
        section_from_dict("ex", {"required": 3}, Example)


def test_unknown_key_is_named():
    with pytest.raises(ParamsError, match=r"ex\.requird: unknown key \(expected: required, optional\)"):
        section_from_dict("ex", {"required": 1, "optional": "x", "requird": 2}, Example)


def test_missing_key_is_named():
    with pytest.raises(ParamsError, match=r"ex\.required: missing key"):
        section_from_dict("ex", {"optional": "y"}, Example)


def test_params_sections_have_no_defaults_of_their_own():
    """params.yaml is the one source of values: a dataclass default could only ever disagree with it."""
    for section in SECTIONS:
        cls = section_class(section)
        defaults = [f.name for f in dataclasses.fields(cls)
                    if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING]
        assert not defaults, f"{cls.__name__} has defaults for {defaults}: params.yaml sets every key"


def test_missing_section_is_named():
    with pytest.raises(ParamsError, match="section 'ex' missing"):
        section_from_dict("ex", None, Example)


@dataclass
class Typed:
    count: int
    rate: float
    name: str | None
    ids: list[int] | None
    on: bool


VALID = {"count": 2, "rate": 3, "name": None, "ids": [2, 15, 27], "on": True}


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
        section_from_dict("ex", {**VALID, key: value}, Typed)


def test_values_of_the_declared_types_pass():
    assert section_from_dict("ex", VALID, Typed) == Typed(**VALID)
