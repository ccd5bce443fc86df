"""The exceptions pdgate raises.

Every exception derives from :class:`PdgateError`, so ``except pdgate.PdgateError`` catches
anything this package raises on purpose::

    PdgateError
    ├── ConfigError (also a ValueError)      an option's value or a combination is invalid
    │   ├── OptionError                      one option's value: wrong type or choice (.option, .value)
    │   │   └── UnknownOptionError           no option of that name (.suggestions: did you mean)
    │   └── CommandLineError                 clap rejected or answered a ``pdgate launch`` line
    ├── GatewayError (also a RuntimeError)   the running gateway
    │   ├── GatewayStartError                it could not start (port in use, bad address, ...)
    │   ├── GatewayStateError                the call does not fit its state (start() twice, ...)
    │   └── WorkerError                      the worker API refused a call (.status, .code)
    └── WorkerStartError (also a RuntimeError)  a reference worker (pdgate.workers) did not start

The compiled extension (``pdgate._core``) raises these same classes; they are defined only here.
"""

from __future__ import annotations

from typing import Any, Sequence

__all__ = [
    "CommandLineError",
    "ConfigError",
    "GatewayError",
    "GatewayStartError",
    "GatewayStateError",
    "OptionError",
    "PdgateError",
    "UnknownOptionError",
    "WorkerError",
    "WorkerStartError",
]


class PdgateError(Exception):
    """Base class of every exception raised by pdgate."""


class ConfigError(PdgateError, ValueError):
    """An invalid option: unknown name, wrong type or value, or options that contradict."""


class OptionError(ConfigError):
    """One option is at fault: ``option`` is its name, ``value`` the value given.

    The message names both, e.g. ``option port = "eighty": expected an integer from 0 to 65535``.
    """

    def __init__(self, message: str, option: str, value: Any = None) -> None:
        super().__init__(message)
        self.option = option
        self.value = value


class UnknownOptionError(OptionError):
    """No option has this name; ``suggestions`` are the close names (``did you mean``)."""

    def __init__(self, message: str, option: str, value: Any = None,
                 suggestions: Sequence[str] = ()) -> None:
        super().__init__(message, option, value)
        self.suggestions = list(suggestions)


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


class WorkerStartError(PdgateError, RuntimeError):
    """A reference worker (``pdgate.workers``) exited or did not become healthy in time; the
    message ends with its log."""
