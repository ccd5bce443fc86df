"""`pdgate`'s public surface: `__all__` is sorted and is exactly what the package exports, and every
exception is a `PdgateError` (httpx's tests/test_exported_members.py is the model)."""

from __future__ import annotations

import inspect
import types

import pdgate
import pdgate.errors


def test_all_is_sorted_and_complete() -> None:
    assert pdgate.__all__ == sorted(pdgate.__all__)
    exported = {
        name for name, value in vars(pdgate).items()
        if not name.startswith("_") and not isinstance(value, types.ModuleType) and name != "annotations"
    } | {"__version__"}
    assert set(pdgate.__all__) == exported, "a public name is missing from __all__, or __all__ names a private one"
    for name in pdgate.__all__:
        assert hasattr(pdgate, name)


def test_exported_classes_say_they_are_pdgate_s() -> None:
    for name in pdgate.__all__:
        value = getattr(pdgate, name)
        if inspect.isclass(value):
            assert value.__module__.startswith("pdgate"), name


def test_every_exception_is_exported_and_a_pdgate_error() -> None:
    errors = [v for v in vars(pdgate.errors).values() if inspect.isclass(v) and issubclass(v, BaseException)
              and v.__module__ == "pdgate.errors"]
    assert errors
    assert sorted(e.__name__ for e in errors) == sorted(pdgate.errors.__all__)
    for error in errors:
        assert issubclass(error, pdgate.PdgateError), error
        assert getattr(pdgate, error.__name__) is error, f"{error.__name__} is not exported from pdgate"


def test_the_documented_hierarchy() -> None:
    assert issubclass(pdgate.ConfigError, ValueError)
    assert issubclass(pdgate.OptionError, pdgate.ConfigError)
    assert issubclass(pdgate.UnknownOptionError, pdgate.OptionError)
    assert issubclass(pdgate.CommandLineError, pdgate.ConfigError)
    assert issubclass(pdgate.GatewayError, RuntimeError)
    for error in (pdgate.GatewayStartError, pdgate.GatewayStateError, pdgate.WorkerError):
        assert issubclass(error, pdgate.GatewayError)
    assert issubclass(pdgate.WorkerStartError, RuntimeError)
    assert not issubclass(pdgate.WorkerStartError, pdgate.GatewayError)


def test_the_docs_show_every_exception() -> None:
    import pathlib

    text = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "python.md").read_text()
    for name in pdgate.errors.__all__:
        assert name in text, f"docs/python.md does not document {name}"
