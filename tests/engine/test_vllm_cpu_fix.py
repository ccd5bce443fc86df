"""The NIXL progress-delay patch of scripts/vllm_cpu/pdgate_vllm_cpu_fix.py (loaded into the real
vLLM venv by a .pth line), on a stand-in for nixl's `_api` module: the agent config gets the
delay asked for, and nothing changes when none is asked for. No vLLM or nixl needed; on the real
venv, `bench/vllm_idle_threads.py` shows the effect (docs/engine.md, "In CI")."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import SimpleNamespace

import pytest

FIX = Path(__file__).resolve().parents[2] / "scripts" / "vllm_cpu" / "pdgate_vllm_cpu_fix.py"


@pytest.fixture
def fix():
    spec = importlib.util.spec_from_file_location("pdgate_vllm_cpu_fix_under_test", FIX)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _api():
    """What the patch sees of `nixl_cu12._api`: `nixlBind.nixlAgent(name, config)`."""
    built = []

    def nixl_agent(name, config):
        built.append((name, config.pthrDelay))
        return name

    return SimpleNamespace(nixlBind=SimpleNamespace(nixlAgent=nixl_agent)), built


def _build(api) -> None:
    # What nixl_agent.__init__ does: a config with pthrDelay = 0, then the bindings' constructor.
    api.nixlBind.nixlAgent("agent", SimpleNamespace(pthrDelay=0))


def test_the_agent_is_built_with_the_delay_asked_for(fix, monkeypatch) -> None:
    monkeypatch.setenv("PDGATE_NIXL_PROGRESS_DELAY_US", "1000")
    api, built = _api()
    fix._patch_nixl_api(api)
    fix._patch_nixl_api(api)  # a second import hook call wraps nothing twice
    _build(api)
    assert built == [("agent", 1000)]


@pytest.mark.parametrize("value", [None, "0", "", "not a number"])
def test_no_delay_asked_keeps_nixls_busy_loop(fix, monkeypatch, value) -> None:
    if value is None:
        monkeypatch.delenv("PDGATE_NIXL_PROGRESS_DELAY_US", raising=False)
    else:
        monkeypatch.setenv("PDGATE_NIXL_PROGRESS_DELAY_US", value)
    api, built = _api()
    original = api.nixlBind.nixlAgent
    fix._patch_nixl_api(api)
    assert api.nixlBind.nixlAgent is original
    _build(api)
    assert built == [("agent", 0)]


def test_the_patch_is_hooked_to_both_nixl_builds(fix) -> None:
    assert fix._PATCHES["nixl_cu12._api"] is fix._patch_nixl_api
    assert fix._PATCHES["nixl_cu13._api"] is fix._patch_nixl_api


def test_vllm_workers_ask_for_a_delay() -> None:
    from pdgate.workers._vllm import CPU_ENV

    assert int(CPU_ENV["PDGATE_NIXL_PROGRESS_DELAY_US"]) > 0
