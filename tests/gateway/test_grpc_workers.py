"""pdgate in front of gRPC workers (issue 15): `grpc://` URLs, the gateway tokenizing with
`--model-path DIR` (DIR from `pdgate engine --model tiny --export-tokenizer DIR`) and writing the
token answers back as the engine's HTTP surface writes them.

Greedy output through pdgate to the reference engine's gRPC services (SGLang's scheduler, vLLM's
engine) must equal the colocated HTTP engine's, for completions, chat and /generate, stream and
not; SGLang bootstrap PD over gRPC too, with the whole prompt reported cached, and a fleet that
mixes an HTTP and a gRPC decode. Faults end bounded, as over HTTP.

The tiny preset is byte-level: its output is mostly not valid UTF-8, so texts are compared as
the engines render them (U+FFFD included).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterator

import httpx
import pytest

pytest.importorskip("smg_grpc_proto", reason="smg-grpc-proto (a pdgate dependency on Python 3.10+) is not installed")

from pdgate.workers import ReferenceWorker  # noqa: E402
from tests.gateway.harness import launch  # noqa: E402

pytestmark = pytest.mark.timeout(300)
SRC = os.path.join(os.path.dirname(__file__), "..", "..", "python")
MAX = 12
PROMPT = "The quick brown fox"
GEN_IDS = [256, *b"jumps over"]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say something"}]


def start(*workers: ReferenceWorker) -> None:
    with ThreadPoolExecutor(len(workers)) as pool:
        list(pool.map(lambda w: w.start(timeout=90), workers))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    d = tmp_path_factory.mktemp("tiny-model")
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
    subprocess.run([sys.executable, "-m", "pdgate.engine", "--model", "tiny", "--export-tokenizer", str(d)],
                   check=True, timeout=60, env=env, capture_output=True)
    return str(d)


@pytest.fixture(scope="module")
def fleet() -> Iterator[dict[str, ReferenceWorker]]:
    # An HTTP engine per flavour: a gRPC service's answers through pdgate equal its own flavour's
    # HTTP answers (vLLM sends no tail that ends inside a character; SGLang writes it as U+FFFD).
    ws = {"http": ReferenceWorker(mode="null"), "http_vllm": ReferenceWorker(mode="null", extra_args=["--api-flavor", "vllm"]),
          "sglang": ReferenceWorker(mode="null", grpc_service="sglang"), "vllm": ReferenceWorker(mode="null", grpc_service="vllm")}
    try:
        start(*ws.values())
        yield ws
    finally:
        for w in ws.values():
            w.stop()


def events(r: httpx.Response) -> list[Any]:
    out: list[Any] = []
    for line in r.text.splitlines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def stream_text(evs: list[Any]) -> str:
    parts = []
    for e in evs:
        if isinstance(e, dict):
            for c in e.get("choices", []):
                parts.append(c.get("text") if "text" in c else (c.get("delta") or {}).get("content") or "")
    return "".join(p for p in parts if p)


def post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=60)


CASES = {
    "completions": ("/v1/completions", {"model": "tiny", "prompt": PROMPT, "max_tokens": MAX, "temperature": 0}),
    "chat": ("/v1/chat/completions", {"model": "tiny", "messages": CHAT, "max_tokens": MAX, "temperature": 0}),
    "generate_ids": ("/generate", {"input_ids": GEN_IDS, "sampling_params": {"max_new_tokens": MAX, "temperature": 0}}),
    "generate_text": ("/generate", {"text": PROMPT, "sampling_params": {"max_new_tokens": MAX, "temperature": 0}}),
}


def answer(url: str, case: str, stream: bool, **extra: Any) -> dict:
    """What the client sees: text (and ids for /generate), finish reason, usage."""
    path, body = CASES[case]
    r = post(url, path, {**body, **extra, "stream": stream} if stream or extra else body)
    assert r.status_code == 200, r.text
    if path == "/generate":
        if stream:
            evs = [e for e in events(r) if isinstance(e, dict)]
            assert events(r)[-1] == "[DONE]"
            last = evs[-1]
        else:
            last = r.json()
        return {"text": last["text"], "ids": last["output_ids"], "reason": last["meta_info"]["finish_reason"]["type"],
                "prompt": last["meta_info"]["prompt_tokens"]}
    if stream:
        evs = events(r)
        assert evs[-1] == "[DONE]", evs[-3:]
        reasons = [c["finish_reason"] for e in evs if isinstance(e, dict) for c in e.get("choices", []) if c.get("finish_reason")]
        return {"text": stream_text(evs), "reason": reasons[-1] if reasons else None}
    out = r.json()
    c = out["choices"][0]
    return {"text": c["text"] if "text" in c else c["message"]["content"], "reason": c["finish_reason"],
            "prompt": out["usage"]["prompt_tokens"], "completion": out["usage"]["completion_tokens"]}


def same(got: dict, want: dict, stream: bool) -> None:
    """`want` is the HTTP engine's whole answer: a stream must add up to it exactly. (The engine's
    own chat stream may leave out a trailing U+FFFD that its whole answer shows; the gateway's
    stream ends as the whole answer does.)"""
    keys = ["text", "reason"] + (["ids"] if "ids" in want else [])
    if not stream:
        keys += [k for k in ("prompt", "completion") if k in want]
    assert {k: got[k] for k in keys} == {k: want[k] for k in keys}


def http_of(service: str) -> str:
    """The fleet's HTTP engine of a gRPC service's flavour: the answers it must equal."""
    return "http_vllm" if service == "vllm" else "http"


@pytest.fixture(scope="module")
def reference(fleet) -> dict[tuple[str, bool], dict]:
    return {(case, stream): answer(fleet["http"].url, case, stream) for case in CASES for stream in (False, True)}


@pytest.fixture(scope="module")
def vllm_reference(fleet) -> dict[tuple[str, bool], dict]:
    return {(case, stream): answer(fleet[http_of("vllm")].url, case, stream) for case in CASES for stream in (False, True)}


@pytest.mark.parametrize("service", ["sglang", "vllm"])
def test_regular_grpc_worker_equals_the_http_engine(processes, model_dir, fleet, reference, vllm_reference, service):
    reference = vllm_reference if service == "vllm" else reference
    gw = launch(processes, ["--worker-urls", fleet[service].grpc_url, "--model-path", model_dir,
                            "--health-check-interval-secs", "1"])
    gw.wait_ready(60)
    for case in CASES:
        for stream in (False, True):
            same(answer(gw.url, case, stream), reference[(case, False)], stream)
    # n>1: every greedy choice is the one answer; usage counts the prompt once.
    r = post(gw.url, "/v1/completions", {**CASES["completions"][1], "n": 2})
    assert r.status_code == 200, r.text
    out = r.json()
    assert [c["text"] for c in out["choices"]] == [reference[("completions", False)]["text"]] * 2
    assert out["usage"]["prompt_tokens"] == reference[("completions", False)]["prompt"]
    assert out["usage"]["completion_tokens"] == 2 * reference[("completions", False)]["completion"]
    # Stream usage when asked for, with the cached-token detail.
    r = post(gw.url, "/v1/completions", {**CASES["completions"][1], "stream": True, "stream_options": {"include_usage": True}})
    usage = [e["usage"] for e in events(r) if isinstance(e, dict) and e.get("usage")]
    assert usage and usage[-1]["prompt_tokens"] == reference[("completions", False)]["prompt"]
    assert "cached_tokens" in usage[-1]["prompt_tokens_details"]


def test_stop_strings_are_cut_as_the_engine_cuts_them(processes, model_dir, fleet, reference):
    text = reference[("completions", False)]["text"]
    stop = next((text[i:i + 2] for i in range(2, len(text) - 2) if "\ufffd" not in text[i:i + 2]), None)
    if stop is None:
        pytest.skip(f"the greedy answer {text!r} has no printable pair to stop on")
    want = {s: answer(fleet["http"].url, "completions", s, stop=[stop]) for s in (False, True)}
    gw = launch(processes, ["--worker-urls", fleet["sglang"].grpc_url, "--model-path", model_dir])
    gw.wait_ready(60)
    for s in (False, True):
        got = answer(gw.url, "completions", s, stop=[stop])
        assert got["text"] == want[s]["text"] and got["reason"] == "stop"
        assert stop not in got["text"]


def test_bad_input_is_a_400_not_a_worker_error(processes, model_dir, fleet):
    gw = launch(processes, ["--worker-urls", fleet["sglang"].grpc_url, "--model-path", model_dir])
    gw.wait_ready(60)
    for path, body, param in [("/v1/completions", {"model": "tiny", "prompt": "x", "n": 0}, "n"),
                              ("/generate", {"text": "x", "input_ids": [1]}, "text"),
                              ("/v1/completions", {"model": "tiny", "prompt": "x", "stop": 5}, "stop")]:
        r = post(gw.url, path, body)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param


def test_pd_bootstrap_over_grpc_and_a_mixed_fleet(processes, model_dir, reference):
    p = ReferenceWorker(mode="prefill", grpc_service="sglang")
    d_grpc = ReferenceWorker(mode="decode", grpc_service="sglang")
    d_http = ReferenceWorker(mode="decode")
    try:
        start(p, d_grpc, d_http)
        gw = launch(processes, ["--pd-disaggregation", "--prefill", p.grpc_url, str(p.bootstrap_port),
                                "--decode", d_grpc.grpc_url, "--decode", d_http.url, "--decode-policy", "round_robin",
                                "--model-path", model_dir, "--health-check-interval-secs", "1"])
        gw.wait_ready(60)
        for _ in range(2):  # round robin: the gRPC decode and the HTTP one
            for case in CASES:
                for stream in (False, True):
                    same(answer(gw.url, case, stream), reference[(case, False)], stream)
            r = post(gw.url, "/v1/completions", CASES["completions"][1])
            usage = r.json()["usage"]
            assert usage["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"]
        sent = httpx.get(p.url + "/v1/loads", timeout=10).json()["loads"][0]["disaggregation"]["kv_bytes_sent"]
        assert sent > 0
    finally:
        for w in (p, d_grpc, d_http):
            w.stop()


def test_killed_grpc_worker_mid_stream_ends_bounded(processes, model_dir):
    w = ReferenceWorker(mode="null", grpc_service="sglang")
    try:
        start(w)
        gw = launch(processes, ["--worker-urls", w.grpc_url, "--model-path", model_dir, "--request-timeout-secs", "30"])
        gw.wait_ready(60)
        body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 4000, "temperature": 0, "ignore_eos": True, "stream": True}
        t0 = time.monotonic()
        got: list[str] = []
        with httpx.stream("POST", gw.url + "/v1/completions", json=body, timeout=60) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                got.append(line)
                if len([x for x in got if x.startswith("data: ")]) == 2 and w.proc is not None:
                    os.kill(w.proc.pid, signal.SIGKILL)
        assert time.monotonic() - t0 < 30
        data = [x[6:] for x in got if x.startswith("data: ")]
        assert data[-1] != "[DONE]"
        assert "error" in json.loads(data[-1])
        # Afterwards: a dead worker answers 5xx, never a hang.
        r = post(gw.url, "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 2})
        assert 500 <= r.status_code < 600
    finally:
        w.stop()


def test_never_answering_grpc_worker_times_out(processes, model_dir):
    """A listener that accepts and never speaks HTTP/2: the request ends at its deadline."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        srv.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(srv.accept()[0])
            except OSError:
                continue

    threading.Thread(target=accept, daemon=True).start()
    try:
        port = srv.getsockname()[1]
        gw = launch(processes, ["--worker-urls", f"grpc://127.0.0.1:{port}", "--model-path", model_dir,
                                "--disable-health-check", "--request-timeout-secs", "3", "--retry-max-retries", "1"])
        t0 = time.monotonic()
        r = post(gw.url, "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 2})
        assert r.status_code == 504, r.text
        assert time.monotonic() - t0 < 20
    finally:
        stop.set()
        for s in held:
            s.close()
        srv.close()
