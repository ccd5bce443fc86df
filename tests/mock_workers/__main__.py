"""`python -m tests.mock_workers KIND [--knob NAME=JSON ...]`: one mock worker as a process.

Prints one JSON line (`{"kind", "url", ...ports}`) once serving; stops on SIGINT/SIGTERM.
Knobs can also be changed later with `POST /_mock/config`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys

from . import KINDS


async def main(kind: str, knobs: dict[str, object]) -> None:
    worker = KINDS[kind](**knobs)
    await worker.start()
    print(json.dumps(worker.describe()), flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await worker.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m tests.mock_workers")
    parser.add_argument("kind", choices=sorted(KINDS))
    parser.add_argument("--knob", action="append", default=[], metavar="NAME=JSON")
    args = parser.parse_args()
    knobs = {}
    for spec in args.knob:
        name, _, value = spec.partition("=")
        knobs[name] = json.loads(value)
    asyncio.run(main(args.kind, knobs))
    sys.exit(0)
