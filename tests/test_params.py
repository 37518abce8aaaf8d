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
