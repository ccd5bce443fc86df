"""`pdgate.GatewayOptions` (python/pdgate/_options.py) is generated from the one config schema;
these tests regenerate it and fail when the committed file and the schema differ."""

from __future__ import annotations

import copy
import importlib.util
import pathlib
import typing
from types import ModuleType

import pytest

import pdgate

REPO = pathlib.Path(__file__).resolve().parents[2]


def generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_gateway_options", REPO / "scripts" / "gen_gateway_options.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_committed_types_match_the_schema() -> None:
    gen = generator()
    committed = (REPO / "python" / "pdgate" / "_options.py").read_text()
    assert gen.render(pdgate.config_schema()) == committed, (
        "python/pdgate/_options.py is out of date: run `python scripts/gen_gateway_options.py`")


def test_the_installed_types_are_the_committed_ones() -> None:
    """The package under test carries the same GatewayOptions (one key per option)."""
    names = [option["name"] for option in pdgate.config_schema()]
    assert list(typing.get_type_hints(pdgate.GatewayOptions)) == names
    assert pdgate.GatewayOptions.__required_keys__ == frozenset()
    assert pdgate.PrefillWorker.__required_keys__ == frozenset({"url"})


def test_a_new_option_changes_the_generated_types() -> None:
    """The sync test above can fail: an option added to the schema shows up in the output."""
    schema = pdgate.config_schema()
    grown = copy.deepcopy(schema) + [{
        "name": "brand_new_secs", "flag": "--brand-new-secs", "help": "A new option.", "default": 5,
        "choices": [], "takes_value": True, "repeated": False,
        "json_schema": {"type": "integer", "minimum": 0, "maximum": 65535},
    }]
    gen = generator()
    assert gen.render(grown) != gen.render(schema)
    assert "    brand_new_secs: int\n" in gen.render(grown)


@pytest.mark.parametrize(
    ("json_schema", "python"),
    [
        ({"type": "boolean"}, "bool"),
        ({"type": ["string", "null"]}, "str | None"),
        ({"enum": ["a", "b", None]}, 'Literal["a", "b"] | None'),
        ({"type": "array", "items": {"type": "string"}}, "list[str] | tuple[str, ...]"),
        ({"type": "array", "items": {"type": ["string", "integer"]}}, "list[str | int] | tuple[str | int, ...]"),
    ],
)
def test_json_schema_to_python_types(json_schema: dict, python: str) -> None:
    assert generator().Types().of(json_schema) == python


def test_an_undescribed_type_is_refused() -> None:
    with pytest.raises(ValueError, match="describe the option"):
        generator().Types().of({})
