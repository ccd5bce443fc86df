"""pdgate in front of gRPC workers, the parts issue 15 left for later: the tokenizer fetched
over `GetTokenizer` (no `--model-path`), logprobs, batched prompts (colocated and in SGLang
bootstrap PD), and a removed worker's connection dropped.

The reference is always the colocated HTTP engine's answer to the same request (the engine of
the gRPC service's flavour: `http_of`): same texts and
ids, same token strings, logprobs equal within float tolerance (they cross the gRPC wire as
float32). The official `openai` client is the client where the route is OpenAI's.
"""

from __future__ import annotations

import json
import math
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

pytest.importorskip("smg_grpc_proto", reason="smg-grpc-proto (a pdgate dependency on Python 3.10+) is not installed")
openai = pytest.importorskip("openai")

from pdgate.workers import ReferenceWorker  # noqa: E402
from tests.gateway.harness import launch  # noqa: E402
# The model directory, the three-worker fleet and `start` are test_grpc_workers.py's.
from tests.gateway.test_grpc_workers import fleet, http_of, model_dir, start  # noqa: E402,F401

pytestmark = pytest.mark.timeout(300)
PROMPT = "The quick brown fox"
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say something"}]
MAX = 8
TOL = 1e-4
FETCH_LOG = "tokenizer fetched from the worker's GetTokenizer"


def gateway(processes, *args: str):
    gw = launch(processes, [*args, "--health-check-interval-secs", "1"])
    gw.wait_ready(60)
    return gw


def client(url: str) -> Any:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)


def post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=60)


def events(r: httpx.Response) -> list[dict]:
    return [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ") and line != "data: [DONE]"]


def close(a: Any, b: Any, path: str = "") -> None:
    """Equal JSON, numbers within TOL (float32 on the gRPC wire)."""
    if isinstance(a, float) or isinstance(b, float):
        assert a is not None and b is not None and math.isclose(a, b, abs_tol=TOL), f"{path}: {a} != {b}"
    elif isinstance(a, list) and isinstance(b, list):
        assert len(a) == len(b), f"{path}: {len(a)} entries != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            close(x, y, f"{path}[{i}]")
    elif isinstance(a, dict) and isinstance(b, dict):
        assert a.keys() == b.keys(), f"{path}: keys {sorted(a)} != {sorted(b)}"
        for k in a:
            close(a[k], b[k], f"{path}.{k}")
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


# -- the tokenizer over GetTokenizer ----------------------------------------------------------

@pytest.mark.parametrize("service", ["sglang", "vllm"])
def test_without_model_path_the_tokenizer_is_fetched_once_from_the_worker(processes, fleet, service):
    gw = gateway(processes, "--worker-urls", fleet[service].grpc_url)
    assert any("fetched over GetTokenizer" in line for line in gw.output), "start-up does not say which tokenizer"
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": MAX, "temperature": 0}
    want = post(fleet[http_of(service)].url, "/v1/completions", body).json()["choices"][0]["text"]
    # Concurrent first requests share one fetch.
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda _: post(gw.url, "/v1/completions", body), range(8)))
    assert [r.status_code for r in answers] == [200] * 8, [r.text for r in answers if r.status_code != 200]
    assert {r.json()["choices"][0]["text"] for r in answers} == {want}
    # The bundle's chat template is the engine's: chat answers equal the HTTP engine's.
    chat = {"model": "tiny", "messages": CHAT, "max_tokens": MAX, "temperature": 0}
    got = client(gw.url).chat.completions.create(**chat)
    ref = client(fleet[http_of(service)].url).chat.completions.create(**chat)
    assert got.choices[0].message.content == ref.choices[0].message.content
    assert got.usage.prompt_tokens == ref.usage.prompt_tokens
    deadline = time.monotonic() + 5
    while not any(FETCH_LOG in line for line in gw.output) and time.monotonic() < deadline:
        time.sleep(0.05)
    fetched = [line for line in gw.output if FETCH_LOG in line]
    assert len(fetched) == 1, fetched


class FlakyTokenizerWorker:
    """A gRPC SGLang scheduler that serves no Generate, only its info, health and GetTokenizer; its first
    GetTokenizer answer carries a wrong sha256 (a corrupt download), later ones are right."""

    def __init__(self) -> None:
        import grpc
        from smg_grpc_proto.generated import common_pb2
        from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb
        from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc

        from pdgate.engine.grpc_common import CHUNK_SIZE, TokenizerBundle

        data, digest = TokenizerBundle("tiny").build()
        self.calls = 0
        outer = self

        class Servicer(pb_grpc.SglangSchedulerServicer):
            def GetModelInfo(self, request, context):
                return pb.GetModelInfoResponse(served_model_name="tiny", is_generation=True)

            def GetServerInfo(self, request, context):
                return pb.GetServerInfoResponse(server_type="grpc")

            def HealthCheck(self, request, context):
                return pb.HealthCheckResponse(healthy=True, message="ready")

            def GetTokenizer(self, request, context):
                outer.calls += 1
                sha = "0" * 64 if outer.calls == 1 else digest
                for off in range(0, len(data), CHUNK_SIZE):
                    end = min(off + CHUNK_SIZE, len(data))
                    yield common_pb2.GetTokenizerChunk(data=data[off:end], sha256=sha if end == len(data) else "")

        self.server = grpc.server(ThreadPoolExecutor(4))
        pb_grpc.add_SglangSchedulerServicer_to_server(Servicer(), self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    def stop(self) -> None:
        self.server.stop(0)


def test_a_failed_fetch_is_a_clear_error_and_is_retried_by_the_next_request(processes):
    w = FlakyTokenizerWorker()
    try:
        gw = launch(processes, ["--worker-urls", f"grpc://127.0.0.1:{w.port}", "--disable-health-check",
                                "--request-timeout-secs", "20", "--retry-max-retries", "0"])
        body = {"model": "tiny", "prompt": "x", "max_tokens": 2}
        first = post(gw.url, "/v1/completions", body)
        assert first.status_code == 502, first.text
        assert "sha256" in first.json()["error"]["message"] and "GetTokenizer" in first.json()["error"]["message"]
        assert w.calls == 1
        # Not remembered as a failure: the next request fetches again, and that fetch is kept
        # (this worker serves no Generate, so the request then fails there, not on the tokenizer).
        for _ in range(2):
            r = post(gw.url, "/v1/completions", body)
            assert "GetTokenizer" not in r.text, r.text
        assert w.calls == 2
    finally:
        w.stop()


# -- logprobs ---------------------------------------------------------------------------------

def completions_logprobs(c: Any, stream: bool) -> dict:
    kw = dict(model="tiny", prompt=PROMPT, max_tokens=MAX, temperature=0, logprobs=3)
    if not stream:
        lp = c.completions.create(**kw).choices[0].logprobs
        return {"tokens": lp.tokens, "token_logprobs": lp.token_logprobs, "top_logprobs": lp.top_logprobs}
    out: dict = {"tokens": [], "token_logprobs": [], "top_logprobs": []}
    for chunk in c.completions.create(**kw, stream=True):
        for ch in chunk.choices:
            if ch.logprobs is not None:
                out["tokens"] += ch.logprobs.tokens
                out["token_logprobs"] += ch.logprobs.token_logprobs
                out["top_logprobs"] += ch.logprobs.top_logprobs or []
    return out


def chat_logprobs(c: Any, stream: bool) -> list[dict]:
    kw = dict(model="tiny", messages=CHAT, max_tokens=MAX, temperature=0, logprobs=True, top_logprobs=2)
    if not stream:
        return [e.model_dump() for e in c.chat.completions.create(**kw).choices[0].logprobs.content]
    out: list[dict] = []
    for chunk in c.chat.completions.create(**kw, stream=True):
        for ch in chunk.choices:
            if ch.logprobs is not None and ch.logprobs.content:
                out += [e.model_dump() for e in ch.logprobs.content]
    return out


GEN_LP = {"text": PROMPT, "sampling_params": {"max_new_tokens": MAX, "temperature": 0}, "return_logprob": True,
          "top_logprobs_num": 2, "return_text_in_logprobs": True}
LP_KEYS = ("input_token_logprobs", "output_token_logprobs", "input_top_logprobs", "output_top_logprobs")


def generate_logprobs(url: str, stream: bool, body: dict = GEN_LP) -> dict:
    r = post(url, "/generate", {**body, "stream": stream})
    assert r.status_code == 200, r.text
    last = events(r)[-1] if stream else r.json()
    return {k: last["meta_info"].get(k) for k in LP_KEYS} | {"output_ids": last["output_ids"]}


@pytest.mark.parametrize("service", ["sglang", "vllm"])
def test_logprobs_are_written_as_the_http_engine_writes_them(processes, model_dir, fleet, service):
    gw = gateway(processes, "--worker-urls", fleet[service].grpc_url, "--model-path", model_dir)
    ref, got = client(fleet[http_of(service)].url), client(gw.url)
    want = completions_logprobs(ref, False)
    assert len(want["tokens"]) == MAX and want["top_logprobs"]
    for stream in (False, True):
        close(completions_logprobs(got, stream), want, f"completions stream={stream}")
    want_chat = chat_logprobs(ref, False)
    assert want_chat and want_chat[0]["top_logprobs"]
    for stream in (False, True):
        close(chat_logprobs(got, stream), want_chat, f"chat stream={stream}")
    want_gen = generate_logprobs(fleet[http_of(service)].url, False)
    assert want_gen["input_token_logprobs"][0][0] is None and want_gen["output_top_logprobs"]
    for stream in (False, True):
        close(generate_logprobs(gw.url, stream), want_gen, f"generate stream={stream}")


# -- batched prompts --------------------------------------------------------------------------

BATCH_TEXTS = ["Hello there", "The quick brown fox", "1 2 3"]


def completions_batch(url: str, stream: bool) -> dict:
    c = client(url)
    kw = dict(model="tiny", prompt=BATCH_TEXTS, n=2, max_tokens=MAX, temperature=0)
    if not stream:
        out = c.completions.create(**kw)
        return {"texts": {ch.index: ch.text for ch in out.choices}, "usage": out.usage.model_dump()}
    texts: dict[int, str] = {}
    usage = None
    for chunk in c.completions.create(**kw, stream=True, stream_options={"include_usage": True}):
        for ch in chunk.choices:
            texts[ch.index] = texts.get(ch.index, "") + ch.text
        usage = chunk.usage.model_dump() if chunk.usage else usage
    return {"texts": texts, "usage": usage}


def generate_batch(url: str, body: dict, stream: bool) -> list[dict]:
    r = post(url, "/generate", {**body, "stream": stream})
    assert r.status_code == 200, r.text
    if stream:
        last: dict[int, dict] = {}
        for e in events(r):
            last[e["index"]] = e
        items = [last[i] for i in sorted(last)]
    else:
        items = r.json()
        assert isinstance(items, list), items
    return [{"text": x["text"], "output_ids": x["output_ids"], "prompt_tokens": x["meta_info"]["prompt_tokens"],
             "reason": x["meta_info"]["finish_reason"]["type"]} for x in items]


GEN_BATCHES = [
    {"text": BATCH_TEXTS, "sampling_params": {"max_new_tokens": MAX, "temperature": 0}},
    {"input_ids": [[256, *b"ab"], [256, *b"xyz"]], "sampling_params": {"max_new_tokens": MAX, "temperature": 0, "n": 2}},
    {"text": ["only one"], "sampling_params": {"max_new_tokens": MAX, "temperature": 0}},
]


def check_batches(gw_url: str, http_url: str) -> None:
    want = completions_batch(http_url, False)
    assert sorted(want["texts"]) == list(range(2 * len(BATCH_TEXTS)))
    for stream in (False, True):
        got = completions_batch(gw_url, stream)
        assert got["texts"] == want["texts"], f"stream={stream}"
        keys = ("prompt_tokens", "completion_tokens", "total_tokens")
        assert {k: got["usage"][k] for k in keys} == {k: want["usage"][k] for k in keys}, f"stream={stream}"
    for body in GEN_BATCHES:
        ref = generate_batch(http_url, body, False)
        for stream in (False, True):
            assert generate_batch(gw_url, body, stream) == ref, f"{body} stream={stream}"


@pytest.mark.parametrize("service", ["sglang", "vllm"])
def test_batched_prompts_answer_in_order_as_the_http_engine(processes, model_dir, fleet, service):
    gw = gateway(processes, "--worker-urls", fleet[service].grpc_url, "--model-path", model_dir)
    check_batches(gw.url, fleet[http_of(service)].url)


def test_pd_bootstrap_batches_and_input_logprobs_over_grpc(processes, model_dir, fleet):
    p = ReferenceWorker(mode="prefill", grpc_service="sglang")
    d = ReferenceWorker(mode="decode", grpc_service="sglang")
    try:
        start(p, d)
        gw = gateway(processes, "--pd-disaggregation", "--prefill", p.grpc_url, str(p.bootstrap_port),
                     "--decode", d.grpc_url, "--model-path", model_dir)
        check_batches(gw.url, fleet["http"].url)
        # The prompt's logprobs come from the prefill, merged in front of the decode's as the
        # HTTP relay merges them: `input_token_logprobs` only (not `input_top_logprobs`).
        want = generate_logprobs(fleet["http"].url, False)
        want.pop("input_top_logprobs")
        for stream in (False, True):
            got = generate_logprobs(gw.url, stream)
            got.pop("input_top_logprobs")
            close(got, want, f"PD generate stream={stream}")
    finally:
        for w in (p, d):
            w.stop()


# -- a removed worker's connection ------------------------------------------------------------

def established_to(port: int) -> int:
    """Established IPv4 TCP connections whose remote end is 127.0.0.1:port (the gateway's)."""
    n = 0
    with open("/proc/net/tcp") as f:
        for line in f.readlines()[1:]:
            cols = line.split()
            rem_ip, rem_port = cols[2].split(":")
            if cols[3] == "01" and int(rem_port, 16) == port and rem_ip == "0100007F":
                n += 1
    return n


@pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="reads Linux's /proc/net/tcp")
def test_deleting_a_grpc_worker_closes_the_gateways_connection(processes, model_dir):
    w = ReferenceWorker(mode="null", grpc_service="sglang")
    try:
        start(w)
        gw = launch(processes, ["--model-path", model_dir, "--admin-api-key", "adm", "--health-check-interval-secs", "1"])
        admin = {"Authorization": "Bearer adm"}
        port = int(w.grpc_url.rsplit(":", 1)[1])
        r = httpx.post(gw.url + "/workers", json={"url": w.grpc_url}, headers=admin, timeout=30)
        assert r.status_code == 201, r.text
        wid = r.json()["id"]
        assert post(gw.url, "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 2}).status_code == 200
        assert established_to(port) >= 1
        assert httpx.delete(f"{gw.url}/workers/{wid}", headers=admin, timeout=30).status_code == 202
        deadline = time.monotonic() + 15
        while established_to(port) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert established_to(port) == 0, "the gateway still holds a connection to the removed worker"
        assert httpx.get(gw.url + "/workers", headers=admin, timeout=10).json()["total"] == 0
    finally:
        w.stop()
