"""pdgate: a gateway for prefill/decode disaggregated LLM serving.

The gateway itself is Rust (``pdgate._core``, loaded on first use so that the pure-Python parts,
e.g. the reference engine, import without the compiled extension)::

    import pdgate

    with pdgate.Gateway(worker_urls=["http://127.0.0.1:8000"], port=0) as gw:
        print(gw.url)
        gw.add_worker("http://127.0.0.1:8001")   # the fleet: add_worker, remove_worker, list_workers
"""

from __future__ import annotations

from pdgate.errors import (
    CommandLineError,
    ConfigError,
    GatewayError,
    GatewayStartError,
    GatewayStateError,
    PdgateError,
    WorkerError,
)
from pdgate.gateway import Gateway, config_schema

try:
    from importlib.metadata import PackageNotFoundError, version

    __version__ = version("pdgate")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0+unknown"

__all__ = [
    "CommandLineError",
    "ConfigError",
    "Gateway",
    "GatewayError",
    "GatewayStartError",
    "GatewayStateError",
    "PdgateError",
    "WorkerError",
    "config_schema",
]
