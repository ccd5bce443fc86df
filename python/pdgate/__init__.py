"""pdgate: a gateway for prefill/decode disaggregated LLM serving.

The gateway itself is Rust (``pdgate._core``, loaded on first use so that the pure-Python parts,
e.g. the reference engine, import without the compiled extension)::

    import pdgate

    with pdgate.Gateway(worker_urls=["http://127.0.0.1:8000"], port=0) as gw:
        print(gw.url)
        gw.add_worker("http://127.0.0.1:8001")   # the fleet: add_worker, remove_worker, list_workers

    async with pdgate.AsyncGateway(worker_urls=["http://127.0.0.1:8000"], port=0) as gw:
        await gw.add_worker("http://127.0.0.1:8001")   # the same, never blocking the event loop

The options are typed (``pdgate.GatewayOptions``, generated from the Rust config schema), and
every exception derives from ``pdgate.PdgateError`` (docs/python.md).
"""

from __future__ import annotations

import importlib.metadata as _metadata

from pdgate._async_gateway import AsyncGateway
from pdgate._options import DecodeWorker, EncodeWorker, GatewayOptions, PrefillWorker
from pdgate.errors import (
    CommandLineError,
    ConfigError,
    GatewayError,
    GatewayStartError,
    GatewayStateError,
    OptionError,
    PdgateError,
    UnknownOptionError,
    WorkerError,
    WorkerStartError,
)
from pdgate.gateway import Gateway, config_schema

try:
    __version__ = _metadata.version("pdgate")
except _metadata.PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0+unknown"

__all__ = [
    "AsyncGateway",
    "CommandLineError",
    "ConfigError",
    "DecodeWorker",
    "EncodeWorker",
    "Gateway",
    "GatewayError",
    "GatewayOptions",
    "GatewayStartError",
    "GatewayStateError",
    "OptionError",
    "PdgateError",
    "PrefillWorker",
    "UnknownOptionError",
    "WorkerError",
    "WorkerStartError",
    "__version__",
    "config_schema",
]
