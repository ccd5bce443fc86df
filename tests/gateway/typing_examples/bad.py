"""Mistakes `mypy --strict` must reject: each line whose comment starts with "error:" must get an
error, and no other line may (tests/gateway/test_typing.py)."""

from __future__ import annotations

import pdgate


async def mistakes() -> None:
    pdgate.Gateway(prefil_policy="random")  # error: misspelled option
    pdgate.Gateway(port="8080")  # error: a string for an integer option
    pdgate.Gateway(policy="cache-aware")  # error: not one of the choices
    pdgate.Gateway(worker_urls="http://127.0.0.1:8000")  # error: one URL, not a list of them
    pdgate.Gateway(pd_disaggregation=1.5)  # error: a float for a flag
    pdgate.Gateway(prefill=[{"url": "http://p", "bootstrap_port": "8998"}])  # error: port as a string
    pdgate.Gateway(decode=[{"uri": "http://d"}])  # error: a worker entry without "url"
    async with pdgate.AsyncGateway(port=0) as gw:
        await gw.add_worker("http://127.0.0.1:8001", "both")  # error: not a worker type
        gw.add_worker("http://127.0.0.1:8001")  # error: an async call not awaited
    with pdgate.AsyncGateway(port=0):  # error: the async gateway in a plain `with`
        pass
