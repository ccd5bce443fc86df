"""SMG 1.13 in gRPC mode in front of the reference engine's gRPC workers: the engine speaks the
real contract (smg-grpc-proto) and SMG, tokenizing with the directory `pdgate engine
--export-tokenizer` writes, gets the tokens the engine's own HTTP surface gives for the same
prompt ids.

`/v1/completions` text prompts (issue 27): SMG tokenizes them without special tokens (no BOS),
where SGLang's and vLLM's HTTP servers (and the engine's) add them, and SMG drops a trailing run
of U+FFFD from the text; the engine is not at fault (docs/grpc-workers.md, "SMG and text
prompts"). The completions test therefore reads the ids SMG sent and got through a tap in front
of the decode (`grpc_tap.py`) and compares them with the colocated engine's for those ids.

Skips when `smg` is not installed. CI: pip install smg==1.13.0 (grpcio, protobuf and
smg-grpc-proto come with pdgate itself)."""

from __future__ import annotations

import contextlib
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
from typing import Iterator

import httpx
import pytest

pytest.importorskip("smg_grpc_proto", reason="smg-grpc-proto (a pdgate dependency on Python 3.10+) is not installed")

from pdgate.workers import ReferenceWorker, free_port  # noqa: E402
from tests.gateway.grpc_tap import GrpcTap  # noqa: E402
from tests.gateway.harness import wait_status  # noqa: E402

pytestmark = pytest.mark.timeout(240)
SRC = str(pathlib.Path(__file__).resolve().parents[2] / "python")
MAX_NEW = 10
GEN_IDS = [256, *b"The quick brown fox"]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say something"}]


def smg_binary() -> str | None:
    beside = pathlib.Path(sys.executable).parent / "smg"
    return str(beside) if beside.exists() else shutil.which("smg")


@pytest.fixture(scope="module")
def smg() -> str:
    path = smg_binary()
    if path is None:
        pytest.skip("smg is not installed (pip install smg==1.13.0)")
    return path


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    d = tmp_path_factory.mktemp("tiny-model")
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
    subprocess.run([sys.executable, "-m", "pdgate.engine", "--model", "tiny", "--export-tokenizer", str(d)],
                   check=True, timeout=60, env=env, capture_output=True)
    return str(d)


@contextlib.contextmanager
def workers(*ws: ReferenceWorker) -> Iterator[tuple[ReferenceWorker, ...]]:
    try:
        for w in ws:
            w.start(90)
        yield ws
    finally:
        for w in ws:
            w.stop()


@contextlib.contextmanager
def smg_router(smg: str, model_dir: str, flags: list[str]) -> Iterator[str]:
    port = free_port()
    log = tempfile.NamedTemporaryFile(prefix="smg-", suffix=".log", delete=False)
    cmd = [smg, "launch", "--host", "127.0.0.1", "--port", str(port), "--prometheus-port", str(free_port()),
           "--model-path", model_dir, "--policy", "round_robin", *flags]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        if wait_status(url + "/readiness", 200, timeout=90) != 200:
            raise AssertionError(f"smg did not become ready: {pathlib.Path(log.name).read_text()[-3000:]}")
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        log.close()
        os.unlink(log.name)


def engine_reference(http_worker: ReferenceWorker) -> dict:
    """The HTTP engine's answers: /generate ids, chat text and prompt size."""
    g = httpx.post(http_worker.url + "/generate", json={"input_ids": GEN_IDS, "sampling_params": {
        "max_new_tokens": MAX_NEW, "temperature": 0}}, timeout=60).json()
    chat = httpx.post(http_worker.url + "/v1/chat/completions", json={
        "model": "tiny", "messages": CHAT, "max_tokens": MAX_NEW, "temperature": 0}, timeout=60).json()
    return {"ids": g["output_ids"], "chat": chat}


def check_through(url: str, ref: dict) -> None:
    g = httpx.post(url + "/generate", json={"model": "tiny", "input_ids": GEN_IDS, "sampling_params": {
        "max_new_tokens": MAX_NEW, "temperature": 0}}, timeout=60)
    assert g.status_code == 200, g.text
    out = g.json()
    if isinstance(out, list):  # SMG's gRPC /generate answers a one-item batch for a single prompt
        assert len(out) == 1, out
        out = out[0]
    assert out["output_ids"] == ref["ids"], out
    for stream in (False, True):
        r = httpx.post(url + "/v1/chat/completions", json={"model": "tiny", "messages": CHAT, "max_tokens": MAX_NEW,
                                                           "temperature": 0, "stream": stream}, timeout=60)
        assert r.status_code == 200, r.text
        text = stream_text(r.text) if stream else r.json()["choices"][0]["message"]["content"]
        want = ref["chat"]["choices"][0]["message"]["content"]
        # SMG holds back a trailing incomplete UTF-8 sequence; the engine shows it as U+FFFD
        assert text.rstrip("\ufffd") == want.rstrip("\ufffd")
        if not stream:
            assert r.json()["usage"]["prompt_tokens"] == ref["chat"]["usage"]["prompt_tokens"]


def stream_text(body: str) -> str:
    import json

    out = []
    for line in body.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            for c in json.loads(line[6:]).get("choices", []):
                out.append((c.get("delta") or {}).get("content") or "")
    return "".join(out)


def test_regular_grpc_workers(smg, model_dir):
    with workers(ReferenceWorker(mode="null", grpc_service="sglang"), ReferenceWorker(mode="null", grpc_service="vllm")) as ws:
        ref = engine_reference(ws[0])
        with smg_router(smg, model_dir, ["--worker-urls", *(w.grpc_url for w in ws)]) as url:
            for _ in range(2):  # round robin: both workers
                check_through(url, ref)


def test_pd_bootstrap_over_grpc(smg, model_dir):
    with workers(ReferenceWorker(mode="prefill", grpc_service="sglang"),
                 ReferenceWorker(mode="decode", grpc_service="sglang"), ReferenceWorker(mode="null")) as (p, d, n):
        ref = engine_reference(n)
        flags = ["--pd-disaggregation", "--prefill", p.grpc_url, str(p.bootstrap_port), "--decode", d.grpc_url]
        with smg_router(smg, model_dir, flags) as url:
            check_through(url, ref)
        sent = httpx.get(p.url + "/v1/loads", timeout=10).json()["loads"][0]["disaggregation"]["kv_bytes_sent"]
        assert sent > 0


def test_pd_nixl_over_grpc(smg, model_dir):
    with workers(ReferenceWorker(mode="prefill", kv_connector="NixlConnector", grpc_service="vllm"),
                 ReferenceWorker(mode="decode", kv_connector="NixlConnector", grpc_service="vllm"),
                 ReferenceWorker(mode="null")) as (p, d, n):
        ref = engine_reference(n)
        with smg_router(smg, model_dir, ["--pd-disaggregation", "--prefill", p.grpc_url, "--decode", d.grpc_url]) as url:
            check_through(url, ref)
        dis = httpx.get(d.url + "/v1/loads", timeout=10).json()["loads"][0]["disaggregation"]
        assert dis["kv_bytes_received"] > 0 and dis["local_recompute"] == 0


def test_pd_mooncake_over_grpc(smg, model_dir):
    with workers(ReferenceWorker(mode="prefill", kv_connector="MooncakeConnector", grpc_service="vllm"),
                 ReferenceWorker(mode="decode", kv_connector="MooncakeConnector", grpc_service="vllm"),
                 ReferenceWorker(mode="null")) as (p, d, n):
        ref = engine_reference(n)
        flags = ["--pd-disaggregation", "--prefill", p.grpc_url, str(p.bootstrap_port), "--decode", d.grpc_url]
        with smg_router(smg, model_dir, flags) as url:
            check_through(url, ref)
        dis = httpx.get(d.url + "/v1/loads", timeout=10).json()["loads"][0]["disaggregation"]
        assert dis["kv_bytes_received"] > 0 and dis["local_recompute"] == 0


# Varied text: ASCII, code, multi-byte UTF-8, whitespace, one character, prompts of one to four
# KV pages (16 tokens a page).
TEXT_PROMPTS = [
    "Hello", "The quick brown fox", "Once upon a time", "a", "1 2 3 4", "What is the capital of France?",
    "def f(x):\n    return x * 2", "Zebra", "  spaces around  ", "naïve café", "x" * 40,
    "Hello world, this is a longer prompt that spans several pages of the KV cache.", "\n", "SELECT * FROM t;",
    "日本語のテキスト", "ab", "The", "Paris is", "42", "Ein Satz auf Deutsch, mit Umlauten: äöü ß." * 2,
]
PD_STYLES = {  # style: (gRPC service, kv_connector, whether SMG needs the bootstrap port)
    "bootstrap": ("sglang", None, True),
    "nixl": ("vllm", "NixlConnector", False),
    "mooncake": ("vllm", "MooncakeConnector", True),
}


def smg_visible(text: str) -> str:
    """What SMG writes for a decoded answer: it holds back text that ends in U+FFFD (an
    incomplete UTF-8 sequence that a later token may complete) and never flushes it, so a
    trailing run of invalid bytes is dropped."""
    return text.rstrip("\ufffd")


def completion(url: str, prompt: str, stream: bool) -> tuple[str, dict, str]:
    """SMG's answer as (text, usage, finish_reason), stream or not."""
    import json

    body = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_NEW, "temperature": 0, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    r = httpx.post(url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    if not stream:
        c = r.json()["choices"][0]
        return c["text"], r.json()["usage"], c["finish_reason"]
    text, usage, finish = [], None, None
    for line in r.text.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            event = json.loads(line[6:])
            for c in event.get("choices", []):
                text.append(c.get("text") or "")
                finish = c.get("finish_reason") or finish
            usage = event.get("usage") or usage
    return "".join(text), usage, finish


@pytest.mark.parametrize("style", list(PD_STYLES))
def test_pd_completions_text_prompts(smg, model_dir, style):
    """20 text prompts through SMG in gRPC PD mode, stream and not in turn: the decode's ids equal
    the colocated engine's for the ids SMG sent, SMG's text is those ids decoded, and the decode
    received the prompt's KV (it reports the prompt cached, its byte counter grows, nothing was
    recomputed)."""
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer.from_file(str(pathlib.Path(model_dir) / "tokenizer.json"))
    service, connector, bootstrap = PD_STYLES[style]
    kw = {"grpc_service": service, "kv_connector": connector} if connector else {"grpc_service": service}
    with workers(ReferenceWorker(mode="prefill", **kw), ReferenceWorker(mode="decode", **kw),
                 ReferenceWorker(mode="null")) as (p, d, n):
        tap = GrpcTap(d.grpc_url.removeprefix("grpc://"), free_port())
        try:
            prefill = ["--prefill", p.grpc_url, *([str(p.bootstrap_port)] if bootstrap else [])]
            with smg_router(smg, model_dir, ["--pd-disaggregation", *prefill, "--decode", tap.grpc_url]) as url:
                for i, prompt in enumerate(TEXT_PROMPTS):
                    check_text_prompt(url, tap, d, n, tok, prompt, stream=i % 2 == 1, vllm=service == "vllm")
        finally:
            tap.stop()
        assert decode_transfers(d)["local_recompute"] == 0


def decode_transfers(d: ReferenceWorker) -> dict:
    return httpx.get(d.url + "/v1/loads", timeout=10).json()["loads"][0]["disaggregation"]


def check_text_prompt(url, tap, d, n, tok, prompt: str, stream: bool, vllm: bool) -> None:
    received = decode_transfers(d)["kv_bytes_received"]
    seen = len(tap.generate_calls())
    text, usage, finish = completion(url, prompt, stream)
    calls = tap.generate_calls()[seen:]
    assert len(calls) == 1, f"{prompt!r}: {len(calls)} decode calls"
    call = calls[0]
    sent = [int(t) for t in call.request.tokenized.input_ids]
    # SMG 1.13 tokenizes a completions prompt without special tokens: no BOS, unlike the
    # engine's (and SGLang's, vLLM's) HTTP /v1/completions.
    assert sent == tok.encode(prompt, add_special_tokens=False).ids, prompt
    ref = httpx.post(n.url + "/generate", json={"input_ids": sent, "sampling_params": {
        "max_new_tokens": MAX_NEW, "temperature": 0}}, timeout=60).json()
    got = call.output_ids()
    assert got == ref["output_ids"], f"{prompt!r} stream={stream}"
    assert text == smg_visible(tok.decode(got, skip_special_tokens=True)), f"{prompt!r} stream={stream}"
    assert finish == "length" and usage["completion_tokens"] == len(got) == MAX_NEW
    assert usage["prompt_tokens"] == len(sent)
    # The KV moved: the decode reports the prompt as arrived (vLLM styles recompute the last
    # token) and its received bytes grew. SMG's own usage.cached_tokens is the prefill's
    # prefix-cache hit, so it says nothing about the transfer.
    assert call.completes[0].cached_tokens == len(sent) - (1 if vllm else 0), prompt
    assert decode_transfers(d)["kv_bytes_received"] > received, prompt
