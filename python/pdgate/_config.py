"""The gateway's options in Python: the schema (declared once, in Rust) and checking options
against it, with errors that name the option and the value and suggest what was meant."""

from __future__ import annotations

import difflib
import json
from functools import lru_cache
from typing import Any, Mapping

from pdgate._native import core
from pdgate.errors import OptionError, UnknownOptionError

__all__ = ["config_schema", "normalize_options"]


@lru_cache(maxsize=1)
def _schema() -> tuple[dict[str, Any], ...]:
    return tuple(json.loads(core().config_schema())["options"])


def config_schema() -> list[dict[str, Any]]:
    """Every gateway option: ``name``, ``flag``, ``help``, ``default``, ``choices``,
    ``json_schema`` (the type of its value), ``takes_value``, ``repeated``."""
    return [dict(option) for option in _schema()]


def _option_names() -> frozenset[str]:
    return frozenset(option["name"] for option in _schema())


def _unknown_option(name: str, value: Any) -> UnknownOptionError:
    close = difflib.get_close_matches(name, sorted(_option_names()), n=3, cutoff=0.6)
    hint = f"did you mean {' or '.join(repr(c) for c in close)}?" if close else \
        "pdgate.config_schema() and `pdgate launch --help` list the options"
    return UnknownOptionError(f"unknown gateway option {name!r}; {hint}", name, value, close)


def _with_choice_hint(exc: OptionError) -> OptionError:
    """A wrong choice (``policy="cache-aware"``) gets the closest choice as a suggestion."""
    option = next((o for o in _schema() if o["name"] == exc.option), None)
    if option is None or not option["choices"] or not isinstance(exc.value, str):
        return exc
    close = difflib.get_close_matches(exc.value, option["choices"], n=1, cutoff=0.5)
    if not close:
        return exc
    return OptionError(f"{exc} (did you mean {close[0]!r}?)", exc.option, exc.value)


def _as_json(options: Mapping[str, Any]) -> str:
    """The options as JSON for the Rust parser; a value JSON cannot carry is named here."""
    for name in sorted(options):
        if name not in _option_names():
            raise _unknown_option(name, options[name])
    for name, value in options.items():
        try:
            # NaN and infinities are no JSON; serde would reject them with a text position.
            json.dumps(value, allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise OptionError(f"option {name} = {value!r}: not a JSON value ({exc})", name, value) from None
    return json.dumps(options)


def normalize_options(options: Mapping[str, Any]) -> dict[str, Any]:
    """The complete configuration for ``options`` (defaults filled in), validated by Rust.

    Raises :class:`pdgate.UnknownOptionError` (with "did you mean"), :class:`pdgate.OptionError`
    (one option's value, named with it) or :class:`pdgate.ConfigError` (options that contradict).
    """
    try:
        config: dict[str, Any] = json.loads(core().normalize_config(_as_json(options)))
    except OptionError as exc:
        hinted = _with_choice_hint(exc)
        if hinted is exc:
            raise
        raise hinted from None
    return config
