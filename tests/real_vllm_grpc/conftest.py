"""Real vLLM over gRPC (the SMG contract, `smg-grpc-servicer[vllm]`) behind pdgate's `grpc://`
client: one fleet for this directory, started after tests/real_vllm's HTTP fleet is stopped (a
package of its own, since six vLLM process trees do not fit this machine's 24 GB at once).

Workers: a gRPC prefill and a gRPC decode (NixlConnector, `kv_role` kv_both, so a request with no
`kv_transfer_params` is an ordinary colocated one), and a plain HTTP vLLM OpenAI server on the same
weights: vLLM's own text, the answer every request through pdgate is compared with. Opt-in like
tests/real_vllm (PDGATE_REAL_VLLM=1 or =require)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.real_vllm.conftest import MODEL, _need_vllm

# vLLM logs its KV connector's stats every VLLM_LOG_STATS_INTERVAL seconds; a gRPC worker has no
# /metrics, so the decode's log is where the transfers are counted.
TRANSFERS = re.compile(r"KV Transfer metrics: Num successful transfers=(\d+)")


@dataclass
class GrpcFleet:
    prefill: object
    decode: object
    http: object
    model_dir: Path

    def transfers(self) -> int:
        """NIXL transfers the decode's periodic stats lines have reported so far (not every
        transfer reaches a line: a lower bound)."""
        return sum(int(n) for n in TRANSFERS.findall(self.decode.log_text()))


@pytest.fixture(scope="package")
def grpc_fleet(tmp_path_factory) -> Iterator[GrpcFleet]:
    import subprocess
    import sys

    _need_vllm()
    pytest.importorskip("smg_grpc_proto", reason="smg-grpc-proto (a pdgate dependency on Python 3.10+)")
    from pdgate.workers import VllmWorker

    model_dir = tmp_path_factory.mktemp("tiny64-grpc")
    subprocess.run([sys.executable, "-m", "pdgate.engine", "--model", MODEL, "--export-model", str(model_dir)],
                   check=True, capture_output=True, timeout=120)
    stats = {"VLLM_LOG_STATS_INTERVAL": "1"}
    fleet = GrpcFleet(
        prefill=VllmWorker(str(model_dir), "prefill", served_model_name=MODEL, grpc=True, env=stats),
        decode=VllmWorker(str(model_dir), "decode", served_model_name=MODEL, grpc=True, env=stats),
        http=VllmWorker(str(model_dir), "null", served_model_name=MODEL),
        model_dir=model_dir,
    )
    workers = [fleet.prefill, fleet.decode, fleet.http]
    try:
        with ThreadPoolExecutor(2) as ex:
            list(ex.map(lambda w: w.start(400), workers))
        yield fleet
    finally:
        for w in workers:
            w.stop()
