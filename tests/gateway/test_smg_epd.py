"""Issue 31 item 4, beside SMG: SMG 1.13's `--epd-disaggregation` in front of the reference
engine's HTTP E/P/D workers. SMG refuses the set-up before it routes anything: its EPD needs gRPC
workers of the TokenSpeed runtime (docs/migrating-from-smg.md). This test pins that fact, so a
release of SMG that accepts HTTP encode workers fails here and the interop test can be written.
"""

from __future__ import annotations

import subprocess

from pdgate.workers import free_port
from tests.gateway.test_smg_grpc_interop import smg  # noqa: F401 (the fixture: skips without smg)


def test_smg_refuses_epd_over_http_workers(smg: str) -> None:  # noqa: F811
    # Nothing listens at these URLs: SMG refuses on its mode, before it looks at a worker.
    urls = [f"http://127.0.0.1:{free_port()}" for _ in range(3)]
    cmd = [smg, "launch", "--epd-disaggregation", "--encode", urls[0], "8990", "--prefill", urls[1], "8998",
           "--decode", urls[2], "--host", "127.0.0.1", "--port", str(free_port())]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert out.returncode != 0, out.stdout[-2000:]
    assert "EPD mode requires gRPC connection_mode and TokenSpeed" in out.stdout + out.stderr, (out.stdout + out.stderr)[-2000:]
