"""The exceptions pdgate raises.

Every exception derives from :class:`PdgateError`, so ``except pdgate.PdgateError`` catches
anything this package raises on purpose::

    PdgateError
    ├── ConfigError (also a ValueError)      an option's value or a combination is invalid
    │   └── CommandLineError                 clap rejected or answered a ``pdgate launch`` line
    └── GatewayError (also a RuntimeError)   the running gateway
        ├── GatewayStartError                it could not start (port in use, bad address, ...)
        ├── GatewayStateError                the call does not fit its state (start() twice, ...)
        └── WorkerError                      the worker API refused a call (.status, .code)
    WorkerStartError (pdgate.workers; also a RuntimeError)  a reference worker did not start

The compiled extension (``pdgate._core``) raises these same classes; they are defined only here.
"""

from __future__ import annotations

__all__ = [
    "CommandLineError",
    "ConfigError",
    "GatewayError",
    "GatewayStartError",
    "GatewayStateError",
    "PdgateError",
    "WorkerError",
]


class PdgateError(Exception):
    """Base class of every exception raised by pdgate."""


class ConfigError(PdgateError, ValueError):
    """An invalid option: unknown name, wrong type or value, or options that contradict."""


class CommandLineError(ConfigError):
    """The ``pdgate launch`` command line was rejected, or it asked for ``--help``/``--version``.

    ``text`` is what the command line parser rendered (usage and message, or the help text);
    ``exit_code`` is what a CLI should exit with: 0 for ``--help``/``--version``, 2 otherwise.
    """

    def __init__(self, text: str, exit_code: int = 2) -> None:
        super().__init__(text.rstrip())
        self.text = text
        self.exit_code = exit_code


class GatewayError(PdgateError, RuntimeError):
    """A failure of the running gateway."""


class GatewayStartError(GatewayError):
    """The gateway could not start, e.g. its port is taken or the host cannot be bound."""


class GatewayStateError(GatewayError):
    """A call that does not fit the gateway's state, e.g. ``start()`` while already running."""


class WorkerError(GatewayError):
    """The gateway's worker API refused a call (``add_worker``, ``remove_worker``, ...).

    ``status`` is the HTTP status (``None`` when no answer carried one, e.g. a drain that did not
    end in time) and ``code`` the gateway's machine-readable error code: ``invalid_request`` (400,
    e.g. a worker whose ``/server_info`` contradicts ``worker_type``), ``missing_api_key`` (401),
    ``invalid_api_key`` (403), ``not_found`` (404), ``conflict`` (409, the URL is registered),
    ``drain_timeout``.
    """

    def __init__(self, message: str, status: int | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
