"""The option schema is declared once (Rust); the Python API, `pdgate launch` and the Rust
binary must all be views of it."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

import pdgate
from pdgate import _core

SCHEMA = pdgate.config_schema()
REPO = pathlib.Path(__file__).resolve().parents[2]


# Flags an option needs beside it to form a valid configuration.
CONTEXT = {
    "prefill": ["--pd-disaggregation"],
    "decode": ["--pd-disaggregation"],
    "encode": ["--epd-disaggregation"],
    "allowed_media_domains": ["--epd-disaggregation"],
    "service_discovery": ["--selector", "app=llm"],
    "selector": ["--service-discovery"],
    "prefill_selector": ["--service-discovery", "--pd-disaggregation", "--decode-selector", "role=decode"],
    "decode_selector": ["--service-discovery", "--pd-disaggregation", "--prefill-selector", "role=prefill"],
    "encode_selector": ["--service-discovery", "--epd-disaggregation", "--prefill-selector", "role=prefill", "--decode-selector",
                        "role=decode"],
}
SAMPLE_VALUES = {
    "worker_urls": "http://127.0.0.1:9",
    "prefill": "http://127.0.0.1:9",
    "decode": "http://127.0.0.1:9",
    "encode": "http://127.0.0.1:9",
    "selector": "app=llm",
    "prefill_selector": "role=prefill",
    "decode_selector": "role=decode",
    "encode_selector": "role=encode",
    "allowed_media_domains": "images.example.com",
    "log_level": "debug",
    "cache_threshold": "0.5",
    "retry_jitter_factor": "0.5",
    "placement_forgetting": "0.5",
    "request_id_headers": "x-my-id",
    "control_plane_api_keys": "k1:ops:admin:secret",
    "seed": "7",
}


def sample_argv(option: dict) -> list[str]:
    """A valid command line that sets this option to a non-default value."""
    flag, name, default = option["flag"], option["name"], option["default"]
    context = CONTEXT.get(name, [])
    if not option["takes_value"]:
        return [*context, flag]
    if option["choices"]:
        spelled = lambda c: c.replace("-", "_")  # noqa: E731 - compare across the two spellings
        return [*context, flag, next(c for c in option["choices"] if spelled(c) != default)]
    if name in SAMPLE_VALUES:
        value = SAMPLE_VALUES[name]
    elif isinstance(default, (int, float)) and not isinstance(default, bool):
        value = str(default + 1)
    elif default is None and ("port" in name or name.endswith(("_secs", "_ms"))):
        value = "7"
    else:
        value = "/x"
    return [*context, flag, value]


def test_exported_names_are_sorted_and_real() -> None:
    assert pdgate.__all__ == sorted(pdgate.__all__)
    for name in pdgate.__all__:
        assert hasattr(pdgate, name)


def test_error_hierarchy() -> None:
    assert issubclass(pdgate.ConfigError, ValueError) and issubclass(pdgate.ConfigError, pdgate.PdgateError)
    assert issubclass(pdgate.CommandLineError, pdgate.ConfigError)
    assert issubclass(pdgate.GatewayStartError, pdgate.GatewayError)
    assert issubclass(pdgate.GatewayStateError, pdgate.GatewayError)
    assert issubclass(pdgate.WorkerError, pdgate.GatewayError)


def test_schema_names_and_flags_correspond() -> None:
    assert SCHEMA, "empty schema"
    for option in SCHEMA:
        assert option["flag"] == "--" + option["name"].replace("_", "-")
        assert option["help"], f"{option['flag']} has no help text"


@pytest.mark.parametrize("option", SCHEMA, ids=[o["name"] for o in SCHEMA])
def test_every_flag_parses_and_maps_to_its_kwarg(option: dict) -> None:
    argv = sample_argv(option)
    from_cli = pdgate.Gateway.from_cli_args(argv).config
    assert from_cli[option["name"]] != option["default"], f"{argv} did not change {option['name']}"
    # The same value given as a keyword builds the same configuration.
    from_kwargs = pdgate.Gateway(**{k: v for k, v in from_cli.items()}).config
    assert from_kwargs == from_cli


CHOICE_OPTIONS = [o for o in SCHEMA if o["choices"] and o["takes_value"]]


@pytest.mark.parametrize("option", CHOICE_OPTIONS, ids=[o["name"] for o in CHOICE_OPTIONS])
def test_choices_are_spelled_the_same_everywhere(option: dict) -> None:
    for choice in option["choices"]:
        from_cli = pdgate.Gateway.from_cli_args(sample_argv(option)[:-1] + [choice]).config
        from_kwargs = pdgate.Gateway(**{option["name"]: choice}).config
        assert from_cli[option["name"]] == from_kwargs[option["name"]] == choice


def test_launch_help_lists_every_flag() -> None:
    with pytest.raises(pdgate.CommandLineError) as info:
        _core.parse_cli(["--help"])
    assert info.value.exit_code == 0
    for option in SCHEMA:
        assert option["flag"] in info.value.text


def test_bad_flag_is_a_command_line_error() -> None:
    with pytest.raises(pdgate.CommandLineError) as info:
        pdgate.Gateway.from_cli_args(["--no-such-flag"])
    assert info.value.exit_code == 2 and "--no-such-flag" in info.value.text


def test_pdgate_launch_help_exits_zero() -> None:
    out = subprocess.run([sys.executable, "-m", "pdgate.cli", "launch", "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "--pd-disaggregation" in out.stdout
    bad = subprocess.run([sys.executable, "-m", "pdgate.cli", "launch", "--port", "x"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--port" in bad.stderr


def rust_binary() -> pathlib.Path | None:
    target = pathlib.Path(os.environ.get("CARGO_TARGET_DIR", REPO / "target"))
    found = [p for p in (target / "release" / "pdgate-gateway", target / "debug" / "pdgate-gateway") if p.exists()]
    return max(found, key=lambda p: p.stat().st_mtime) if found else None


def test_rust_binary_takes_the_same_flags() -> None:
    binary = rust_binary()
    if binary is None:
        pytest.skip("pdgate-gateway binary not built (cargo build -p pdgate-gateway)")
    out = subprocess.run([str(binary), "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0
    flags = set(re.findall(r"--[a-z][a-z0-9-]+", out.stdout)) - {"--help", "--version"}
    assert flags == {o["flag"] for o in SCHEMA} | {a for o in SCHEMA for a in o["aliases"]}


def test_the_schema_and_the_python_api_read_no_environment() -> None:
    """An API key in the environment reaches neither `config_schema()` nor `pdgate.Gateway`
    (the core reads no environment); only the command line (`pdgate launch`) applies it."""
    code = (
        "import json, pdgate\n"
        "from pdgate import _core\n"
        "schema = {o['name']: o['default'] for o in pdgate.config_schema()}\n"
        "embedded = pdgate.Gateway(port=0).config\n"
        "cli = json.loads(_core.parse_cli(['--port', '0']))\n"
        "print(json.dumps([schema['api_key'], schema['admin_api_key'], embedded['api_key'], cli['api_key'], cli['admin_api_key']]))\n"
    )
    env = {**os.environ, "PDGATE_API_KEY": "from-env", "PDGATE_ADMIN_API_KEY": "admin-env"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip().splitlines()[-1] == '[null, null, null, "from-env", "admin-env"]', out.stdout + out.stderr


def test_smg_aliases_set_the_pdgate_option() -> None:
    aliased = [o for o in SCHEMA if o["aliases"]]
    assert {a for o in aliased for a in o["aliases"]} >= {"--cb-failure-threshold", "--cb-success-threshold",
                                                          "--cb-timeout-duration-secs", "--cb-window-duration-secs"}
    for option in aliased:
        for alias in option["aliases"]:
            argv = sample_argv(option)
            by_alias = pdgate.Gateway.from_cli_args([alias if a == option["flag"] else a for a in argv]).config
            assert by_alias == pdgate.Gateway.from_cli_args(argv).config, alias
