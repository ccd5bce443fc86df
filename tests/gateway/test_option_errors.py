"""Bad options to `pdgate.Gateway` / `pdgate.AsyncGateway`: the error names the option and the
value (never a position in JSON the user did not write) and suggests the name or choice meant."""

from __future__ import annotations

import re
from typing import Any

import pytest

import pdgate

JSON_POSITION = re.compile(r"line \d+|column \d+")


def refused(**options: Any) -> pdgate.ConfigError:
    with pytest.raises(pdgate.ConfigError) as info:
        pdgate.Gateway(**options)
    assert not JSON_POSITION.search(str(info.value)), f"a JSON position leaked: {info.value}"
    return info.value


@pytest.mark.parametrize(
    ("options", "option", "value", "expected"),
    [
        ({"port": "eighty"}, "port", "eighty", "expected an integer from 0 to 65535"),
        ({"port": 70000}, "port", 70000, "expected an integer from 0 to 65535"),
        ({"port": 80.5}, "port", 80.5, "expected an integer"),
        ({"pd_disaggregation": "yes"}, "pd_disaggregation", "yes", "expected true or false"),
        ({"cache_threshold": "high"}, "cache_threshold", "high", "expected a number"),
        ({"worker_urls": "http://127.0.0.1:9"}, "worker_urls", "http://127.0.0.1:9", "expected a list"),
        ({"worker_urls": [9]}, "worker_urls", [9], "each item a string"),
        ({"api_key": 12}, "api_key", 12, "expected a string or null"),
    ],
)
def test_a_wrong_type_names_the_option_and_the_value(options: dict, option: str, value: Any, expected: str) -> None:
    error = refused(**options)
    assert isinstance(error, pdgate.OptionError) and not isinstance(error, pdgate.UnknownOptionError)
    assert (error.option, error.value) == (option, value)
    assert str(error).startswith(f"option {option} = "), str(error)
    assert expected in str(error)


def test_the_option_at_fault_is_found_among_good_ones() -> None:
    error = refused(host="127.0.0.1", port=0, request_timeout_secs="soon", policy="random")
    assert isinstance(error, pdgate.OptionError)
    assert (error.option, error.value) == ("request_timeout_secs", "soon")


def test_a_wrong_choice_lists_the_choices_and_suggests_one() -> None:
    error = refused(policy="cache-aware")
    assert isinstance(error, pdgate.OptionError) and (error.option, error.value) == ("policy", "cache-aware")
    assert '"round_robin"' in str(error) and "did you mean 'cache_aware'?" in str(error)
    # Nothing close: the choices, no guess.
    error = refused(kv_connector="carrier-pigeon")
    assert '"nixl"' in str(error) and "did you mean" not in str(error)


def test_a_bad_worker_entry_says_what_is_wrong_with_it() -> None:
    error = refused(pd_disaggregation=True, prefill=[["http://127.0.0.1:9", "eighty"]])
    assert isinstance(error, pdgate.OptionError) and error.option == "prefill"
    assert error.value == [["http://127.0.0.1:9", "eighty"]]
    assert 'invalid bootstrap port "eighty"' in str(error)
    error = refused(pd_disaggregation=True, decode=[{"url": "http://127.0.0.1:9", "kv_connector": "lmcache"}])
    assert error.option == "decode" and 'unknown kv_connector "lmcache"' in str(error)


@pytest.mark.parametrize(
    ("name", "suggestions"),
    [
        ("prefil_policy", ["prefill_policy"]),
        ("worker_url", ["worker_urls"]),
        ("requests_timeout_secs", ["request_timeout_secs"]),
        ("zzzzzz", []),
    ],
)
def test_an_unknown_option_gets_a_did_you_mean(name: str, suggestions: list[str]) -> None:
    error = refused(**{name: 1})
    assert isinstance(error, pdgate.UnknownOptionError) and isinstance(error, pdgate.OptionError)
    assert (error.option, error.value) == (name, 1)
    assert error.suggestions[: len(suggestions)] == suggestions
    assert repr(name) in str(error)
    if suggestions:
        assert f"did you mean {suggestions[0]!r}" in str(error)
    else:
        assert "did you mean" not in str(error) and "config_schema" in str(error)


def test_values_json_cannot_carry_are_named() -> None:
    error = refused(cache_threshold=float("nan"))
    assert isinstance(error, pdgate.OptionError) and error.option == "cache_threshold"
    assert "nan" in str(error)
    marker = object()
    error = refused(host=marker)
    assert isinstance(error, pdgate.OptionError) and error.option == "host" and error.value is marker


def test_contradicting_options_are_a_config_error_naming_them() -> None:
    error = refused(prefill=[["http://127.0.0.1:9", 8998]])  # needs pd_disaggregation
    assert not isinstance(error, pdgate.OptionError)
    assert "--pd-disaggregation" in str(error)


def test_async_gateway_validates_the_same_way() -> None:
    with pytest.raises(pdgate.UnknownOptionError, match="did you mean 'prefill_policy'"):
        pdgate.AsyncGateway(prefil_policy="random")  # type: ignore[call-arg]
    with pytest.raises(pdgate.OptionError, match=r'^option port = "x": expected an integer'):
        pdgate.AsyncGateway(port="x")  # type: ignore[typeddict-item]


def test_every_pdgate_exception_is_a_pdgate_error() -> None:
    for error in (pdgate.OptionError, pdgate.UnknownOptionError, pdgate.WorkerStartError):
        assert issubclass(error, pdgate.PdgateError)
    assert issubclass(pdgate.OptionError, pdgate.ConfigError) and issubclass(pdgate.OptionError, ValueError)
    from pdgate.workers import WorkerStartError

    assert WorkerStartError is pdgate.WorkerStartError and issubclass(WorkerStartError, RuntimeError)
