"""How pdgate's Python API is meant to be used, type-checked with `mypy --strict` by
tests/gateway/test_typing.py (never run: the workers it names do not exist)."""

from __future__ import annotations

import asyncio
from typing import Any

import pdgate


def options_for(prefill_url: str, decode_url: str) -> pdgate.GatewayOptions:
    """Options can be built and passed around as a typed dict."""
    prefill: pdgate.PrefillWorker = {"url": prefill_url, "bootstrap_port": 8998, "kv_connector": "bootstrap"}
    return {
        "pd_disaggregation": True,
        "prefill": [prefill, [prefill_url, 8998], (prefill_url, None)],
        "decode": [decode_url, {"url": decode_url}],
        "policy": "cache_aware",
        "prefill_policy": None,
        "cache_threshold": 0.5,
        "port": 0,
        "api_key": None,
    }


def blocking() -> list[dict[str, Any]]:
    options = options_for("http://127.0.0.1:30001", "http://127.0.0.1:30002")
    with pdgate.Gateway(**options) as gw:
        url: str | None = gw.url
        print(url, gw.port, gw.running, gw.config["port"])
        gw.add_worker("http://127.0.0.1:30003", "decode", labels={"zone": "a"})
        gw.set_worker_enabled("http://127.0.0.1:30003", False)
        gw.remove_worker("http://127.0.0.1:30003", wait=True, timeout=30.0)
        return gw.list_workers()


async def non_blocking() -> dict[str, Any]:
    async with pdgate.AsyncGateway(worker_urls=["http://127.0.0.1:8000"], port=0, request_timeout_secs=30,
                                   log_level="info") as gw:
        added = await gw.add_worker("http://127.0.0.1:8001")
        await gw.set_worker_enabled(added["id"], True)
        workers: list[dict[str, Any]] = await gw.list_workers()
        print(workers, await gw.get_worker(added["id"]))
        return await gw.remove_worker(added["id"], wait=True)


def errors() -> None:
    try:
        pdgate.Gateway(port=0).start()
    except pdgate.UnknownOptionError as exc:
        print(exc.option, exc.suggestions)
    except pdgate.OptionError as exc:
        print(exc.option, exc.value)
    except pdgate.WorkerError as exc:
        status: int | None = exc.status
        print(status, exc.code)
    except pdgate.PdgateError as exc:
        print(exc)


if __name__ == "__main__":
    print(blocking(), asyncio.run(non_blocking()))
    errors()
