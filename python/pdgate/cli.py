"""The ``pdgate`` command.

``pdgate launch ...``      the gateway; its flags come from the Rust config schema (clap parses them)
``pdgate quickstart ...``  reference prefill + decode workers with the gateway in front
``pdgate engine ...``      one reference engine worker
``pdgate bench ...``       load generator with goodput under SLOs (vLLM ``bench serve`` dialect)
``pdgate simulate ...``    discrete-event model of the three placements
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from typing import Callable, Sequence

from pdgate.errors import CommandLineError, PdgateError

__all__ = ["main"]


def wait_for_shutdown_signal() -> None:
    """Block until SIGINT or SIGTERM; the handlers are restored afterwards."""
    stop = threading.Event()

    def handler(signum: int, frame: object) -> None:
        stop.set()

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        # A timed wait lets the main thread run the Python signal handler promptly.
        while not stop.wait(0.2):
            pass
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


WORKER_API_KEY_ENV = "PDGATE_WORKER_API_KEY"


def _with_worker_key_from_env(argv: Sequence[str]) -> list[str]:
    """``--worker-api-key`` from PDGATE_WORKER_API_KEY when the command line has none (as the
    ``pdgate-gateway`` binary does): a key in the environment stays out of ``ps`` output."""
    argv = list(argv)
    key = os.environ.get(WORKER_API_KEY_ENV)
    given = any(a == "--worker-api-key" or a.startswith("--worker-api-key=") for a in argv)
    if key and not given:
        # The `=` form, so that a key starting with '-' is not taken for a flag.
        argv = [f"--worker-api-key={key}", *argv]
    return argv


def _launch(argv: Sequence[str]) -> int:
    from pdgate.gateway import Gateway

    try:
        gateway = Gateway.from_cli_args(_with_worker_key_from_env(argv))
    except CommandLineError as exc:
        # clap renders help, version and usage errors; we only print them.
        stream = sys.stdout if exc.exit_code == 0 else sys.stderr
        stream.write(exc.text if exc.text.endswith("\n") else exc.text + "\n")
        return exc.exit_code
    gateway.start()
    try:
        # Tests and scripts read this line to learn the port (with --port 0). One write, so the
        # gateway's log lines (stderr, often the same pipe) cannot land inside it: print() writes
        # the text and the newline separately when stdout is unbuffered.
        sys.stdout.write(f"pdgate gateway listening on {gateway.url}\n")
        sys.stdout.flush()
        wait_for_shutdown_signal()
    finally:
        gateway.stop()
    print("pdgate gateway stopped", flush=True)
    return 0


def _engine(argv: Sequence[str]) -> int:
    try:
        from pdgate.engine import cli as engine_cli
    except ImportError as exc:
        print(f"pdgate engine: the reference engine is not available ({exc})", file=sys.stderr)
        return 1
    parser = argparse.ArgumentParser(prog="pdgate engine", description="Run one reference engine worker.")
    engine_cli.add_arguments(parser)
    return int(engine_cli.run(parser.parse_args(argv)) or 0)


def _bench(argv: Sequence[str]) -> int:
    from pdgate.bench import main as bench_main

    return bench_main(argv)


def _simulate(argv: Sequence[str]) -> int:
    from pdgate.simulate import main as simulate_main

    return simulate_main(argv)


def _quickstart(argv: Sequence[str]) -> int:
    from pdgate.quickstart import build_parser, run

    return run(build_parser().parse_args(argv))


COMMANDS: dict[str, tuple[Callable[[Sequence[str]], int], str]] = {
    "launch": (_launch, "run the gateway (flags: pdgate launch --help)"),
    "quickstart": (_quickstart, "reference prefill + decode workers behind a gateway, on one machine"),
    "engine": (_engine, "run one reference engine worker (prefill, decode or colocated)"),
    "bench": (_bench, "load an OpenAI-compatible endpoint; TTFT/TPOT/ITL and goodput (vLLM bench serve dialect)"),
    "simulate": (_simulate, "discrete-event model of colocated, disaggregated and conditional placement"),
}


def _usage() -> str:
    lines = ["usage: pdgate {" + ",".join(COMMANDS) + "} ...", "", "commands:"]
    lines += [f"  {name:<12} {text}" for name, (_, text) in COMMANDS.items()]
    lines += ["", "Run `pdgate COMMAND --help` for a command's options."]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``pdgate`` console script."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(_usage())
        return 0 if args else 2
    if args[0] == "--version":
        from pdgate import __version__

        print(f"pdgate {__version__}")
        return 0
    command = COMMANDS.get(args[0])
    if command is None:
        print(f"pdgate: unknown command {args[0]!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    try:
        return command[0](args[1:])
    except PdgateError as exc:
        print(f"pdgate {args[0]}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
