"""The pdgate reference engine: a small Llama-architecture model on numpy with a paged KV
cache, serving the SGLang and vLLM worker HTTP surfaces and their PD protocols, moving real KV
pages between processes. See docs/engine.md.

Run one with `python -m pdgate.engine --model tiny --port 30000 --disaggregation-mode prefill`,
or from Python::

    import asyncio
    from pdgate.engine import EngineConfig, serve

    asyncio.run(serve(EngineConfig(model="tiny", port=30000, disaggregation_mode="prefill")))

Importing this package reads no environment variable and loads neither numpy nor aiohttp:
`Engine` and `serve` load them when first used.
"""

from __future__ import annotations

from typing import Any

from .engine_config import EngineConfig
from .errors import EngineConfigError, EngineStartError

__all__ = ["Engine", "EngineConfig", "EngineConfigError", "EngineStartError", "serve"]


def __getattr__(name: str) -> Any:
    if name == "Engine":
        from .engine import Engine

        return Engine
    if name == "serve":
        from .server import serve

        return serve
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
