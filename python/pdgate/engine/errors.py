"""The exceptions the reference engine raises while it is configured and started.

Both belong to pdgate's hierarchy (docs/python.md, "Exceptions")::

    PdgateError
    ├── ConfigError
    │   └── EngineConfigError   an EngineConfig that cannot run (a field, or fields that contradict)
    └── EngineStartError        the engine could not start (a port, a KV transfer backend)

A request's own failure inside a running engine is `sequence.EngineError`, answered to the
client with an HTTP or gRPC status; it never reaches the caller of the library.
The CLI turns these two into its exit status 1 with the message, as `SystemExit` did before.
"""

from __future__ import annotations

from ..errors import ConfigError, PdgateError

__all__ = ["EngineConfigError", "EngineStartError"]


class EngineConfigError(ConfigError):
    """The configuration cannot run. The message names the CLI flag (the field's name with
    dashes), so the CLI prints it unchanged."""


class EngineStartError(PdgateError, RuntimeError):
    """A valid configuration that could not start here: a port that cannot be bound, a KV
    transfer backend that is not installed or fails to initialize."""
