"""Real vLLM's disaggregated encoder (EPD) behind pdgate: one E/P/D fleet for the directory.

The model is a tiny random-weight LLaVA (`tiny_vlm.py`, written with the vLLM venv's
transformers on top of the reference engine's byte tokenizer). The fleet: one encoder
(`ec_producer` of vLLM's `ECExampleConnector`: it runs the vision tower and stores each image's
embedding under a shared directory), one NIXL prefill that is the encoder cache's consumer
(`ec_consumer`: it loads a stored embedding instead of running the tower), one NIXL decode
without an encoder-cache connector, and pdgate in front with `--epd-disaggregation
--kv-connector nixl`. Every PD worker has `kv_role` kv_both, so a request sent straight to one
is an ordinary colocated vLLM request (the decode: the expected answers). Opt-in as
tests/real_vllm: PDGATE_REAL_VLLM=1 or =require.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.real_vllm.conftest import DEADLINE_S, _need_vllm, wait_until

MODEL = "tiny-llava"
HERE = Path(__file__).parent


@pytest.fixture(scope="session")
def vlm_dir(tmp_path_factory) -> Path:
    python = _need_vllm()
    tok = tmp_path_factory.mktemp("tiny64-tokenizer")
    subprocess.run([sys.executable, "-m", "pdgate.engine", "--model", "tiny64", "--export-model", str(tok)],
                   check=True, capture_output=True, timeout=120)
    out = tmp_path_factory.mktemp("tiny-llava")
    subprocess.run([python, str(HERE / "tiny_vlm.py"), str(tok), str(out)], check=True, capture_output=True, timeout=300)
    return out


@dataclass
class Epd:
    encoder: object
    prefill: object
    decode: object
    gateway: object
    store: Path

    @property
    def url(self) -> str:
        return self.gateway.url

    def all(self) -> list:
        return [self.encoder, self.prefill, self.decode]


def ec_config(role: str, store: Path) -> dict:
    return {"ec_connector": "ECExampleConnector", "ec_role": role,
            "ec_connector_extra_config": {"shared_storage_path": str(store)}}


@pytest.fixture(scope="package")
def epd(vlm_dir, tmp_path_factory) -> Iterator[Epd]:
    import pdgate
    from pdgate.workers import VllmWorker

    store = tmp_path_factory.mktemp("ec-store")
    encoder = VllmWorker(str(vlm_dir), "null", served_model_name=MODEL, ec_transfer_config=ec_config("ec_producer", store),
                         extra_args=["--no-enable-prefix-caching"])
    prefill = VllmWorker(str(vlm_dir), "prefill", served_model_name=MODEL, ec_transfer_config=ec_config("ec_consumer", store))
    decode = VllmWorker(str(vlm_dir), "decode", served_model_name=MODEL)
    f = Epd(encoder, prefill, decode, None, store)
    try:
        with ThreadPoolExecutor(2) as ex:
            list(ex.map(lambda w: w.start(300), f.all()))
        f.gateway = pdgate.Gateway(
            epd_disaggregation=True, kv_connector="nixl", port=0, encode=[(encoder.url, None)],
            prefill=[(prefill.url, None)], decode=[decode.url], admin_api_open=True,
            request_timeout_secs=DEADLINE_S, health_check_interval_secs=2, health_check_timeout_secs=5,
            health_failure_threshold=2,
        )
        f.gateway.start()
        wait_until(lambda: httpx.get(f.url + "/readiness", timeout=5).status_code == 200, 60, "gateway ready")
        yield f
    finally:
        if f.gateway is not None:
            f.gateway.stop()
        for w in f.all():
            w.stop()
