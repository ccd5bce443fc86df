"""Resume after decode death, end to end with reference engines (issue 12 item 2).

One prefill and two decodes, in each PD mode (SGLang bootstrap, vLLM NIXL, vLLM Mooncake;
`/generate` is SGLang's and runs in the bootstrap mode only); one decode runs with the fault hook
`--fault-kill-after-tokens 5`: it SIGKILLs itself right after sending the chunk with a
sequence's 5th token (a whole answer: after generating it), so the death is mid-answer on every
run, not a matter of timing. The gateway continues the stream on the other decode from the
prompt's and the generated token ids; with greedy decoding the client must get exactly the
uninterrupted answer, which a third engine (no PD) computes directly.

The tiny preset is byte-level: its output is mostly not valid UTF-8, which is why the resume
must go by token ids (the text is compared as the engines render it, U+FFFD included).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterator

import httpx
import pytest

import pdgate
from pdgate.workers import ReferenceWorker
from tests.gateway.harness import wait_status
from tests.gateway.test_aborts_free_memory import IDLE_WITHIN_S, wait_idle

pytestmark = pytest.mark.timeout(240)
KILL_AFTER = 5
MAX_TOKENS = 24
COMPLETION = {"model": "tiny", "prompt": "resume me, please", "max_tokens": MAX_TOKENS, "temperature": 0,
              "ignore_eos": True}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "resume this chat"}], "max_tokens": MAX_TOKENS,
        "temperature": 0, "ignore_eos": True}


# The gateway's --kv-connector and the engines' vLLM connector, per PD mode.
CONNECTORS = {"bootstrap": None, "nixl": "NixlConnector", "mooncake": "MooncakeConnector"}
PATHS = [("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)]


def start(workers: list[ReferenceWorker]) -> None:
    with ThreadPoolExecutor(len(workers)) as pool:
        list(pool.map(lambda w: w.start(timeout=90), workers))


@pytest.fixture(scope="module")
def reference() -> Iterator[ReferenceWorker]:
    """A plain engine with the same weights: the uninterrupted greedy answers."""
    w = ReferenceWorker(mode="null", model="tiny")
    start([w])
    yield w
    w.stop()


@pytest.fixture(scope="module")
def vllm_reference() -> Iterator[ReferenceWorker]:
    """The same engine in the vLLM flavour, which the NIXL and Mooncake decodes are: vLLM sends no
    tail that ends inside a character (docs/grpc-workers.md, "Real vLLM over gRPC")."""
    w = ReferenceWorker(mode="null", model="tiny", extra_args=["--api-flavor", "vllm"])
    start([w])
    yield w
    w.stop()


def flavour_of(connector: str, reference: ReferenceWorker, vllm_reference: ReferenceWorker) -> ReferenceWorker:
    """The uninterrupted engine of the decodes' flavour: SGLang's for bootstrap, else vLLM's."""
    return reference if connector == "bootstrap" else vllm_reference


class Fleet:
    def __init__(self, max_resumes: int | None, connector: str = "bootstrap", model_path: str | None = None):
        kc = CONNECTORS[connector]
        self.prefill = ReferenceWorker(mode="prefill", model="tiny", kv_connector=kc)
        self.dying = ReferenceWorker(mode="decode", model="tiny", kv_connector=kc,
                                     extra_args=["--fault-kill-after-tokens", str(KILL_AFTER)])
        self.healthy = ReferenceWorker(mode="decode", model="tiny", kv_connector=kc)
        self.max_resumes = max_resumes
        self.connector = connector
        self.model_path = model_path

    def __enter__(self) -> "Fleet":
        start([self.prefill, self.dying, self.healthy])
        options: dict[str, Any] = dict(
            pd_disaggregation=True, kv_connector=self.connector, port=0, request_timeout_secs=60, retry_max_retries=3,
            prefill=[[self.prefill.url, self.prefill.bootstrap_port]], decode=[self.dying.url, self.healthy.url],
            decode_policy="round_robin", health_check_interval_secs=1, health_success_threshold=1)
        if self.max_resumes is not None:
            options["max_resumes"] = self.max_resumes
        if self.model_path is not None:
            options["model_path"] = self.model_path
        self.gw = pdgate.Gateway(**options)
        self.gw.__enter__()
        assert wait_status(self.gw.url + "/readiness", 200) == 200
        return self

    def __exit__(self, *exc: object) -> None:
        self.gw.__exit__(None, None, None)
        for w in (self.prefill, self.dying, self.healthy):
            w.stop()

    def survivors_idle(self) -> None:
        """Every page of the engines that outlived the death (the prefill, the other decode) is
        back within 5 s: the dead pair's legs and the continuation's left nothing held."""
        wait_idle([self.prefill, self.healthy], IDLE_WITHIN_S)

    def dead(self, within_s: float = 3.0) -> bool:
        """Whether the dying decode has exited. It kills itself right after a chunk, and the
        gateway can see its socket close (and answer the client) before the process is gone,
        so give it a moment (a loaded machine made an immediate poll miss it)."""
        end = time.monotonic() + within_s
        while True:
            if self.dying.proc is not None and self.dying.proc.poll() is not None:
                return True
            if time.monotonic() >= end:
                return False
            time.sleep(0.05)

    def metric(self, line: str) -> float | None:
        text = httpx.get(self.gw.url + "/metrics", timeout=10).text
        for row in text.splitlines():
            if row.startswith(line + " "):
                return float(row.split()[-1])
        return None


def stream(url: str, path: str, body: dict, strict: bool = True) -> list[Any]:
    """The stream's events (`[DONE]` as the string). Not `strict`: an event the dying engine
    sent only part of (the gateway closes it before its error event) is kept as its text."""
    out: list[Any] = []
    with httpx.stream("POST", url + path, json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: "):
                data = line[len("data: "):]
                if data == "[DONE]":
                    out.append(data)
                    continue
                try:
                    out.append(json.loads(data))
                except ValueError:
                    if strict:
                        raise
                    out.append(data)
    return out


def text_of(events: list[Any]) -> str:
    parts = []
    for e in events:
        if isinstance(e, dict):
            for c in e.get("choices", []):
                parts.append(c.get("text") if "text" in c else (c.get("delta") or {}).get("content") or "")
    return "".join(p for p in parts if p)


def until_killed(fleet: Fleet, send) -> list[Any]:
    """Round robin puts the dying decode first or second: send until it died, return the
    answers (each must be whole and right, killed or not)."""
    answers = []
    for _ in range(2):
        answers.append(send())
        if fleet.dead():
            return answers
    raise AssertionError("the fault decode never served a request")


@pytest.mark.parametrize("connector", sorted(CONNECTORS))
@pytest.mark.parametrize("path,body", PATHS, ids=["completions", "chat"])
def test_a_stream_whose_decode_is_killed_completes_as_if_uninterrupted(reference: ReferenceWorker, vllm_reference: ReferenceWorker,
                                                                       path: str, body: dict, connector: str) -> None:
    body = {**body, "stream_options": {"include_usage": True}}
    want = stream(flavour_of(connector, reference, vllm_reference).url, path, body)
    with Fleet(max_resumes=None, connector=connector) as fleet:
        for got in until_killed(fleet, lambda: stream(fleet.gw.url, path, body)):
            assert got[-1] == "[DONE]" and not any(isinstance(e, dict) and "error" in e for e in got), got
            assert text_of(got) == text_of(want)
            ids = {e["id"] for e in got if isinstance(e, dict)}
            assert len(ids) == 1, ids
            assert all(c["index"] == 0 for e in got if isinstance(e, dict) for c in e["choices"])
            usage = [e["usage"] for e in got if isinstance(e, dict) and e.get("usage")]
            assert usage[-1]["prompt_tokens"] == want[-2]["usage"]["prompt_tokens"]
            assert usage[-1]["completion_tokens"] == MAX_TOKENS
        assert fleet.metric('pdgate_resumes_total{reason="decode_died",result="resumed"}') == 1.0
        fleet.survivors_idle()


# Its 5th token leaves the text ending in U+FFFD (a lone continuation byte): the engine holds it.
HELD = {**COMPLETION, "prompt": "resume me, please 4", "return_token_ids": True, "stream_options": {"include_usage": True}}


@pytest.mark.parametrize("connector", ["bootstrap", "nixl"])
def test_a_death_while_the_engine_holds_text_is_continued_without_sending_anything_twice(
        reference: ReferenceWorker, vllm_reference: ReferenceWorker, connector: str) -> None:
    """Continued from every id, a vLLM decode would send the whole prompt's text again (its
    detokenizer, primed with ids whose text ends in U+FFFD, holds all of them); the gateway
    continues from the last id whose text the client has and drops what is regenerated."""
    want = stream(flavour_of(connector, reference, vllm_reference).url, "/v1/completions", HELD)
    want_ids = [i for e in want if isinstance(e, dict) for c in e["choices"] for i in c.get("token_ids", [])]
    assert bytes(want_ids[:KILL_AFTER]).decode("utf-8", "replace").endswith("\ufffd"), "the prompt no longer holds text at the kill"
    with Fleet(max_resumes=None, connector=connector) as fleet:
        for got in until_killed(fleet, lambda: stream(fleet.gw.url, "/v1/completions", HELD)):
            assert got[-1] == "[DONE]" and not any(isinstance(e, dict) and "error" in e for e in got), got
            assert text_of(got) == text_of(want)
            assert [i for e in got if isinstance(e, dict) for c in e["choices"] for i in c.get("token_ids", [])] == want_ids
            usage = [e["usage"] for e in got if isinstance(e, dict) and e.get("usage")]
            assert usage[-1]["completion_tokens"] == MAX_TOKENS
        assert fleet.metric('pdgate_resumes_total{reason="decode_died",result="resumed"}') == 1.0


def test_token_ids_asked_by_the_client_are_the_uninterrupted_ones(reference: ReferenceWorker) -> None:
    body = {**COMPLETION, "return_token_ids": True}
    want = [i for e in stream(reference.url, "/v1/completions", body) if isinstance(e, dict) for c in e["choices"] for i in c.get("token_ids", [])]
    with Fleet(max_resumes=None) as fleet:
        for got in until_killed(fleet, lambda: stream(fleet.gw.url, "/v1/completions", body)):
            ids = [i for e in got if isinstance(e, dict) for c in e["choices"] for i in c.get("token_ids", [])]
            assert ids == want and len(ids) == MAX_TOKENS


def answer_text(answer: dict) -> str:
    c = answer["choices"][0]
    return c["message"]["content"] if "message" in c else c["text"]


@pytest.mark.parametrize("connector", sorted(CONNECTORS))
@pytest.mark.parametrize("path,body", PATHS, ids=["completions", "chat"])
def test_a_non_stream_answer_whose_decode_is_killed_is_whole(reference: ReferenceWorker, vllm_reference: ReferenceWorker,
                                                             path: str, body: dict, connector: str) -> None:
    want = httpx.post(flavour_of(connector, reference, vllm_reference).url + path, json=body, timeout=60).json()
    with Fleet(max_resumes=None, connector=connector) as fleet:
        for _ in range(2):  # round robin: the fault decode serves one of the two
            r = httpx.post(fleet.gw.url + path, json=body, timeout=60)
            assert r.status_code == 200, r.text
            got = r.json()
            assert answer_text(got) == answer_text(want)
            assert got["usage"]["completion_tokens"] == MAX_TOKENS
            assert got["usage"]["prompt_tokens"] == want["usage"]["prompt_tokens"]
        assert fleet.dead(), "the fault decode never served a request"
        fleet.survivors_idle()


@pytest.mark.parametrize("prompt", [{"input_ids": [256, *b"whole by ids"]}, {"text": "whole by text"}], ids=["input_ids", "text"])
def test_a_non_stream_generate_whose_decode_is_killed_is_whole(reference: ReferenceWorker, prompt: dict) -> None:
    body = {**prompt, "sampling_params": {"max_new_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}}
    want = httpx.post(reference.url + "/generate", json=body, timeout=60).json()
    with Fleet(max_resumes=None) as fleet:
        for _ in range(2):
            r = httpx.post(fleet.gw.url + "/generate", json=body, timeout=60)
            assert r.status_code == 200, r.text
            got = r.json()
            assert (got["text"], got["output_ids"]) == (want["text"], want["output_ids"])
            assert got["meta_info"]["completion_tokens"] == MAX_TOKENS
        assert fleet.dead(), "the fault decode never served a request"


def test_with_max_resumes_0_the_stream_ends_with_the_error_event(reference: ReferenceWorker) -> None:
    with Fleet(max_resumes=0) as fleet:
        answers = until_killed(fleet, lambda: stream(fleet.gw.url, "/v1/completions", COMPLETION, strict=False))
        killed = answers[-1]
        assert "[DONE]" not in killed and "error" in killed[-1], killed
        assert fleet.metric('pdgate_resumes_total{reason="decode_died",result="resumed"}') == 0.0


def test_a_generate_stream_from_input_ids_is_continued(reference: ReferenceWorker) -> None:
    body = {"input_ids": [256, *b"resume by ids"],
            "sampling_params": {"max_new_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}}
    want = stream(reference.url, "/generate", body)[-2]
    with Fleet(max_resumes=None) as fleet:
        for got in until_killed(fleet, lambda: stream(fleet.gw.url, "/generate", body)):
            assert got[-1] == "[DONE]" and not any(isinstance(e, dict) and "error" in e for e in got), got
            texts = [e["text"] for e in got if isinstance(e, dict)]
            assert all(b.startswith(a) for a, b in zip(texts, texts[1:])), "one cumulative answer"
            last = got[-2]
            assert last["text"] == want["text"] and last["output_ids"] == want["output_ids"]
            assert last["meta_info"]["completion_tokens"] == MAX_TOKENS
            assert last["meta_info"]["prompt_tokens"] == want["meta_info"]["prompt_tokens"]
            assert len({e["meta_info"]["id"] for e in got if isinstance(e, dict)}) == 1


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    """The tiny preset's tokenizer as a model directory, for the gateway's --model-path."""
    d = tmp_path_factory.mktemp("tiny-model")
    subprocess.run([sys.executable, "-m", "pdgate.engine", "--model", "tiny", "--export-tokenizer", str(d)],
                   check=True, timeout=60, capture_output=True)
    return str(d)


GENERATE_TEXT = {"text": "resume by text", "sampling_params": {"max_new_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}}


def test_a_generate_stream_from_text_is_continued_from_the_gateways_tokenizer(reference: ReferenceWorker,
                                                                            model_dir: str) -> None:
    """SGLang's stream gives no prompt ids for a text prompt; with --model-path the gateway
    tokenizes it (checked against the engine's prompt_tokens) and continues from the ids."""
    want = stream(reference.url, "/generate", GENERATE_TEXT)[-2]
    with Fleet(max_resumes=None, model_path=model_dir) as fleet:
        for got in until_killed(fleet, lambda: stream(fleet.gw.url, "/generate", GENERATE_TEXT)):
            assert got[-1] == "[DONE]" and not any(isinstance(e, dict) and "error" in e for e in got), got
            last = got[-2]
            assert last["text"] == want["text"] and last["output_ids"] == want["output_ids"]
            assert last["meta_info"]["completion_tokens"] == MAX_TOKENS
            assert last["meta_info"]["prompt_tokens"] == want["meta_info"]["prompt_tokens"]
        assert fleet.metric('pdgate_resumes_total{reason="decode_died",result="resumed"}') == 1.0


def test_without_a_tokenizer_a_generate_text_stream_ends_with_the_error_event_saying_why(reference: ReferenceWorker) -> None:
    with Fleet(max_resumes=None) as fleet:
        killed = until_killed(fleet, lambda: stream(fleet.gw.url, "/generate", GENERATE_TEXT, strict=False))[-1]
        assert "[DONE]" not in killed and "error" in killed[-1], killed
        assert "not resumed: generate_text" in killed[-1]["error"]["message"], killed[-1]
        assert fleet.metric('pdgate_resumes_total{reason="generate_text",result="refused"}') == 1.0


def test_a_decode_that_dies_on_every_stream_leaves_rotation_and_resumed_streams_go_elsewhere(reference: ReferenceWorker) -> None:
    """Breaker e2e: a decode that drops its connection after its first token on EVERY request
    (`--fault-drop-after-tokens 1`: the process lives on and stays healthy) is taken out by its
    breaker after two deaths; every stream still completes whole (the dead ones resumed on the
    other decode), and once the breaker is open no stream goes to it."""
    want = text_of(stream(reference.url, "/v1/completions", COMPLETION))
    prefill = ReferenceWorker(mode="prefill", model="tiny")
    bad = ReferenceWorker(mode="decode", model="tiny", extra_args=["--fault-drop-after-tokens", "1"])
    good = ReferenceWorker(mode="decode", model="tiny")
    start([prefill, bad, good])
    try:
        options = dict(pd_disaggregation=True, port=0, request_timeout_secs=60, retry_max_retries=3,
                       prefill=[[prefill.url, prefill.bootstrap_port]], decode=[bad.url, good.url],
                       decode_policy="round_robin", health_check_interval_secs=1, health_success_threshold=1,
                       breaker_failure_threshold=2, breaker_cooldown_secs=600)
        with pdgate.Gateway(**options) as gw:
            assert wait_status(gw.url + "/readiness", 200) == 200

            def metric(row: str) -> float:
                text = httpx.get(gw.url + "/metrics", timeout=10).text
                return next(float(r.split()[-1]) for r in text.splitlines() if r.startswith(row + " "))

            for _ in range(8):
                got = stream(gw.url, "/v1/completions", COMPLETION)
                assert got[-1] == "[DONE]" and not any(isinstance(e, dict) and "error" in e for e in got), got
                assert text_of(got) == want
            assert metric(f'pdgate_worker_breaker_state{{worker="{bad.url}"}}') == 1.0, "open"
            assert metric(f'pdgate_worker_healthy{{role="decode",worker="{bad.url}"}}') == 1.0, \
                "taken out by its breaker, not by a health check"
            assert metric('pdgate_resumes_total{reason="decode_died",result="resumed"}') == 2.0, \
                "two deaths opened the breaker; no stream went to the bad decode after"
            assert bad.proc is not None and bad.proc.poll() is None, "the fault decode is alive"
    finally:
        for w in (prefill, bad, good):
            w.stop()
