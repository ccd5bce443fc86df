"""The Anthropic Messages API (issue 29), driven with the official `anthropic` SDK against pdgate in
PD mode in front of reference engines: bootstrap (SGLang flavour), NIXL and Mooncake (vLLM
flavour) over HTTP, and bootstrap over gRPC workers. pdgate runs a Messages request as the equivalent chat
completions request, so every answer's text must equal the same conversation sent to
`/v1/chat/completions` with the `openai` SDK, on greedy decoding; bad input is refused in
Anthropic's error shape before any worker sees it; a decode killed mid-stream leaves a valid
Anthropic event stream whose text is the uninterrupted one.

The tiny preset is byte-level and its weights are random: texts are compared as the engines
render them (U+FFFD included), never read.
"""

from __future__ import annotations

import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterator

import anthropic
import httpx
import openai
import pytest

import pdgate
from pdgate.workers import ReferenceWorker
from tests.gateway.grpc_stacks import export_model_dir
from tests.gateway.harness import scrape, wait_status

pytestmark = pytest.mark.timeout(300)
MODEL = "tiny"
MAX_TOKENS = 16
LIMIT = 64 * 1024
# The SDK (2.17) has no sampling parameters of its own; the API still takes them.
GREEDY = {"temperature": 0}

SYSTEM = "You answer briefly."
CONVERSATIONS = {
    "one_turn": (None, [{"role": "user", "content": "Hello there"}]),
    "system_multi_turn": (SYSTEM, [
        {"role": "user", "content": "What is PD disaggregation?"},
        {"role": "assistant", "content": "Prefill and decode on different workers."},
        {"role": "user", "content": "Why?"},
    ]),
}


class Fleet:
    """One prefill, one decode, a gateway in PD mode; `kind` picks the PD protocol and the worker
    kind. `regular`: one worker and no PD, for the regular mode."""

    def __init__(self, kind: str, model_dir: str, log_dir: str):
        grpc = kind == "grpc-bootstrap"
        connector = kind if kind in ("nixl", "mooncake") else "bootstrap"
        kc = {"nixl": "NixlConnector", "mooncake": "MooncakeConnector"}.get(connector)
        service = {"grpc_service": "sglang"} if grpc else {}
        self.request_log = os.path.join(log_dir, "requests.jsonl")
        self.pd = kind != "regular"
        if self.pd:
            self.workers = [ReferenceWorker(mode="prefill", model=MODEL, kv_connector=kc, **service),
                            ReferenceWorker(mode="decode", model=MODEL, kv_connector=kc, **service)]
        else:
            self.workers = [ReferenceWorker(mode="null", model=MODEL)]
        with ThreadPoolExecutor(len(self.workers)) as pool:
            list(pool.map(lambda w: w.start(timeout=90), self.workers))
        urls = [w.grpc_url if grpc else w.url for w in self.workers]
        options: dict[str, Any] = dict(port=0, request_timeout_secs=60, max_payload_size=LIMIT, health_check_interval_secs=1,
                                       health_success_threshold=1, request_log=self.request_log)
        if self.pd:
            options.update(pd_disaggregation=True, kv_connector=connector, prefill=[[urls[0], self.workers[0].bootstrap_port]],
                           decode=[urls[1]])
        else:
            options.update(worker_urls=urls)
        # The gRPC fleet's gateway has the model's tokenizer (gRPC workers need it), so it
        # counts tokens itself; the HTTP fleets' ask a worker.
        self.tokenizes = grpc
        if grpc:
            options["model_path"] = model_dir
        self.gw = pdgate.Gateway(**options)
        self.gw.__enter__()
        assert wait_status(self.gw.url + "/readiness", 200, timeout=60) == 200

    @property
    def url(self) -> str:
        return self.gw.url

    def close(self) -> None:
        self.gw.__exit__(None, None, None)
        for w in self.workers:
            w.stop()

    def anthropic(self) -> anthropic.Anthropic:
        return anthropic.Anthropic(base_url=self.url, api_key="x", max_retries=0, timeout=60)

    def openai(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="x", max_retries=0, timeout=60)

    def engine_requests(self) -> float:
        """Generation items the two engines accepted (their own counter)."""
        return sum(scrape(w.url, "pdgate_engine_requests_total") for w in self.workers)

    def gateway_metric(self, line: str) -> float:
        return scrape(self.url, line)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return export_model_dir(str(tmp_path_factory.mktemp("tiny-model")))


@pytest.fixture(scope="module", params=["bootstrap", "nixl", "mooncake", "grpc-bootstrap", "regular"])
def fleet(request: pytest.FixtureRequest, model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    f = Fleet(request.param, model_dir, str(tmp_path_factory.mktemp("log")))
    yield f
    f.close()


def chat_messages(system: str | None, messages: list[dict]) -> list[dict]:
    return ([{"role": "system", "content": system}] if system else []) + messages


def chat_answer(f: Fleet, system: str | None, messages: list[dict], **kw: Any) -> Any:
    return f.openai().chat.completions.create(model=MODEL, messages=chat_messages(system, messages), max_tokens=MAX_TOKENS,
                                              temperature=0, **kw)


def system_kw(system: str | None) -> dict:
    return {"system": system} if system else {}


@pytest.mark.parametrize("case", sorted(CONVERSATIONS))
def test_an_answer_equals_the_chat_answer(fleet: Fleet, case: str) -> None:
    system, messages = CONVERSATIONS[case]
    want = chat_answer(fleet, system, messages)
    got = fleet.anthropic().messages.create(model=MODEL, max_tokens=MAX_TOKENS, extra_body=GREEDY, messages=messages, **system_kw(system))
    assert got.type == "message" and got.role == "assistant" and got.model == MODEL and got.id.startswith("msg_")
    assert [b.type for b in got.content] == ["text"]
    assert got.content[0].text == want.choices[0].message.content
    assert got.stop_reason == {"stop": "end_turn", "length": "max_tokens"}[want.choices[0].finish_reason]
    assert got.usage.output_tokens == want.usage.completion_tokens
    cached = got.usage.cache_read_input_tokens or 0
    assert got.usage.input_tokens + cached == want.usage.prompt_tokens


@pytest.mark.parametrize("case", sorted(CONVERSATIONS))
def test_a_stream_is_anthropics_event_sequence_with_the_chat_text(fleet: Fleet, case: str) -> None:
    system, messages = CONVERSATIONS[case]
    want = chat_answer(fleet, system, messages)
    with fleet.anthropic().messages.stream(model=MODEL, max_tokens=MAX_TOKENS, extra_body=GREEDY, messages=messages,
                                           **system_kw(system)) as s:
        events = [e.type for e in s if e.type in {"message_start", "content_block_start", "content_block_delta",
                                                     "content_block_stop", "message_delta", "message_stop"}]
        final = s.get_final_message()
    assert events[0] == "message_start" and events[1] == "content_block_start"
    assert events[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(events[2:-3]) <= {"content_block_delta"}
    assert final.content[0].text == want.choices[0].message.content
    assert final.stop_reason == {"stop": "end_turn", "length": "max_tokens"}[want.choices[0].finish_reason]
    assert final.usage.output_tokens == want.usage.completion_tokens
    assert final.usage.input_tokens + (final.usage.cache_read_input_tokens or 0) == want.usage.prompt_tokens


def test_raw_stream_has_event_lines_and_a_ping(fleet: Fleet) -> None:
    body = {"model": MODEL, "max_tokens": 4, "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    with httpx.stream("POST", fleet.url + "/v1/messages", json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        assert "x-pdgate-route" in r.headers
        names = [line[len("event: "):] for line in r.iter_lines() if line.startswith("event: ")]
    assert names[:3] == ["message_start", "content_block_start", "ping"] and names[-1] == "message_stop"


def test_sampling_and_metadata_reach_the_worker(fleet: Fleet) -> None:
    """top_p / top_k (sent as the API takes them; the SDK has no arguments for them) and
    metadata.user_id (chat's `user`) give the chat answer with the same fields."""
    messages = [{"role": "user", "content": "sample me"}]
    sampling = {"temperature": 0, "top_p": 0.5, "top_k": 3}
    want = fleet.openai().chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_TOKENS, user="u-1",
                                                  temperature=0, top_p=0.5, extra_body={"top_k": 3})
    got = fleet.anthropic().messages.create(model=MODEL, max_tokens=MAX_TOKENS, messages=messages, metadata={"user_id": "u-1"},
                                            extra_body=sampling)
    assert got.content[0].text == want.choices[0].message.content


def test_metrics_and_the_request_log_name_the_messages_route(fleet: Fleet) -> None:
    before = fleet.gateway_metric('pdgate_requests_total{route="/v1/messages",status="200"}')
    with fleet.anthropic().messages.stream(model=MODEL, max_tokens=MAX_TOKENS, extra_body=GREEDY, messages=[{"role": "user", "content": "log me"}],
                                           extra_headers={"x-request-id": "msg-log-1"}) as s:
        final = s.get_final_message()
    assert fleet.gateway_metric('pdgate_requests_total{route="/v1/messages",status="200"}') == before + 1
    deadline = time.monotonic() + 10
    line = None
    while line is None and time.monotonic() < deadline:
        lines = [json.loads(x) for x in open(fleet.request_log).read().splitlines()] if os.path.exists(fleet.request_log) else []
        line = next((x for x in lines if x.get("client_request_id") == "msg-log-1"), None)
        time.sleep(0.05)
    assert line is not None, "no request log line"
    assert line["route"] == "/v1/messages" and line["stream"] is True and line["status"] == 200, line
    assert line["output_tokens"] == final.usage.output_tokens and line["ttft_ms"] is not None, line
    assert line["placement"] == ("disaggregated" if fleet.pd else "colocated"), line


def test_stop_sequences_stop_the_answer_as_they_stop_chat(fleet: Fleet) -> None:
    messages = [{"role": "user", "content": "Say something long"}]
    free = chat_answer(fleet, None, messages).choices[0].message.content
    printable = [c for c in free[2:] if c.isprintable() and c != "\ufffd"]
    if not printable:
        pytest.skip("the tiny model's answer has no printable character to stop on")
    stop = printable[0]
    want = chat_answer(fleet, None, messages, stop=[stop])
    got = fleet.anthropic().messages.create(model=MODEL, max_tokens=MAX_TOKENS, extra_body=GREEDY, messages=messages, stop_sequences=[stop])
    assert got.content[0].text == want.choices[0].message.content
    assert stop not in got.content[0].text
    # The reference engine does not report which stop string matched (vLLM's `stop_reason`):
    # the answer then says end_turn (docs/protocols.md, "Messages API").
    assert got.stop_reason in {"stop_sequence", "end_turn"}


def test_count_tokens_is_the_chat_prompt_count(fleet: Fleet) -> None:
    system, messages = CONVERSATIONS["system_multi_turn"]
    want = chat_answer(fleet, system, messages).usage.prompt_tokens
    before = fleet.engine_requests()
    got = fleet.anthropic().messages.count_tokens(model=MODEL, system=system, messages=messages)
    assert got.input_tokens == want
    asked = fleet.engine_requests() - before
    assert asked == (0 if fleet.tokenizes else len(fleet.workers)), "count_tokens: the gateway's tokenizer, else one run"


def test_tools_and_tool_turns_reach_the_worker_as_chat_tools(fleet: Fleet) -> None:
    """The reference engine has no tool calling (its template ignores tools): what is proven here
    is that the translated conversation is the chat one, turn for turn (the mapping itself is
    unit-tested in pdgate-protocol)."""
    tools = [{"name": "get_weather", "description": "weather of a city",
              "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"}]},
    ]
    got = fleet.anthropic().messages.create(model=MODEL, max_tokens=MAX_TOKENS, extra_body=GREEDY, messages=messages, tools=tools,
                                            tool_choice={"type": "auto"})
    chat = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "toolu_1", "type": "function",
                                                              "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris"}, separators=(",", ":"))}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"},
    ]
    want = fleet.openai().chat.completions.create(
        model=MODEL, messages=chat, max_tokens=MAX_TOKENS, temperature=0, tool_choice="auto",
        tools=[{"type": "function", "function": {"name": "get_weather", "description": "weather of a city", "parameters": tools[0]["input_schema"]}}])
    assert got.content[0].text == want.choices[0].message.content


BAD = {
    "missing_max_tokens": {"model": MODEL, "messages": [{"role": "user", "content": "x"}]},
    "unknown_block": {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "hologram", "text": "x"}]}]},
    # (A `url` image source is not bad input: it becomes a chat image_url part with that URL, which
    # the worker fetches or refuses outside EPD, and the gateway fetches or refuses under EPD:
    # tests/gateway/test_epd_remote_images.py.)
    "remote_image_not_http": {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "url", "url": "file:///etc/passwd"}}]}]},
    "document_block": {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "document", "source": {"type": "base64", "media_type": "application/pdf", "data": "JVBERi0="}}]}]},
    "orphan_tool_result": {"model": MODEL, "max_tokens": 4, "messages": [
        {"role": "user", "content": "x"}, {"role": "assistant", "content": "no tool here"},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_404", "content": "r"}]}]},
    "assistant_first": {"model": MODEL, "max_tokens": 4, "messages": [{"role": "assistant", "content": "x"}]},
    "system_role_in_messages": {"model": MODEL, "max_tokens": 4, "messages": [{"role": "system", "content": "x"}]},
    "huge_input": {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "x" * (2 * LIMIT)}]},
}


def test_bad_input_is_refused_in_anthropics_shape_and_reaches_no_worker(fleet: Fleet) -> None:
    before = fleet.engine_requests()
    for case, body in BAD.items():
        r = httpx.post(fleet.url + "/v1/messages", json=body, timeout=10)
        want = (413, "request_too_large") if case == "huge_input" else (400, "invalid_request_error")
        assert (r.status_code, r.json()["error"]["type"]) == want, (case, r.text)
        assert r.json()["type"] == "error" and r.json()["error"]["message"], (case, r.text)
    # The SDK reads these as its own exception types.
    client = fleet.anthropic()
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model=MODEL, max_tokens=4, messages=BAD["unknown_block"]["messages"])
    assert "hologram" in str(e.value)
    with pytest.raises(anthropic.BadRequestError):
        client.messages.create(model=MODEL, max_tokens=4, messages=BAD["orphan_tool_result"]["messages"])
    with pytest.raises(anthropic.APIStatusError) as big:
        client.messages.create(model=MODEL, max_tokens=4, messages=BAD["huge_input"]["messages"])
    assert big.value.status_code == 413
    assert fleet.engine_requests() == before, "a refused request reached a worker"
    assert fleet.gateway_metric('pdgate_requests_total{route="/v1/messages",status="400"}') >= len(BAD) - 1


def test_gateway_errors_are_anthropic_errors() -> None:
    """No healthy worker: pdgate's 503 reaches the SDK as Anthropic's overloaded error, and an
    API key (sent as the SDK sends it, `x-api-key`) is checked like a bearer one."""
    with pdgate.Gateway(pd_disaggregation=True, port=0, prefill=[["http://127.0.0.1:9", None]], decode=["http://127.0.0.1:10"], api_key="k",
                        request_timeout_secs=5) as gw:
        # pdgate's key check: a wrong key is 403 (permission_error), a missing one 401.
        with pytest.raises(anthropic.PermissionDeniedError):
            anthropic.Anthropic(base_url=gw.url, api_key="wrong", max_retries=0).messages.create(
                model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "x"}])
        body = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "x"}]}
        r = httpx.post(gw.url + "/v1/messages", json=body, timeout=30)
        assert (r.status_code, r.json()["error"]["type"]) == (401, "authentication_error"), r.text
        r = httpx.post(gw.url + "/v1/messages", json=body, headers={"x-api-key": "k"}, timeout=30)
        assert r.status_code == 503, r.text
        assert r.json()["type"] == "error" and r.json()["error"]["type"] == "overloaded_error", r.text
        with pytest.raises(anthropic.APIStatusError) as e:
            anthropic.Anthropic(base_url=gw.url, api_key="k", max_retries=0).messages.create(
                model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "x"}])
        assert e.value.status_code == 503


def anthropic_events(url: str, body: dict) -> list[tuple[str, dict]]:
    """A raw Messages stream as (event name, data); checks every data line is JSON."""
    out: list[tuple[str, dict]] = []
    name = None
    with httpx.stream("POST", url + "/v1/messages", json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[len("event: "):]
            elif line.startswith("data: "):
                assert name is not None, line
                out.append((name, json.loads(line[len("data: "):])))
                name = None
    return out


@pytest.mark.parametrize("connector", ["bootstrap", "nixl", "mooncake"])
def test_a_stream_whose_decode_is_killed_stays_a_valid_messages_stream(connector: str) -> None:
    """The decode SIGKILLs itself after its 5th token (test_resume.py's fault hook); the gateway
    resumes the chat stream on the other decode, and the client reads one valid Anthropic event
    sequence whose text is the uninterrupted answer (a plain engine's of the decodes' flavour,
    on greedy decoding), over each PD protocol."""
    from tests.gateway.test_resume import Fleet as ResumeFleet, until_killed

    messages = [{"role": "user", "content": "resume this chat"}]
    body = {"model": MODEL, "max_tokens": 24, "temperature": 0, "messages": messages}
    # NIXL and Mooncake decodes are vLLM-flavoured (test_resume.py's `flavour_of`).
    plain = ReferenceWorker(mode="null", model=MODEL, extra_args=[] if connector == "bootstrap" else ["--api-flavor", "vllm"])
    plain.start(timeout=90)
    try:
        want = httpx.post(plain.url + "/v1/chat/completions", timeout=60, json={
            "model": MODEL, "max_tokens": 24, "temperature": 0, "messages": messages}).json()
    finally:
        plain.stop()
    assert want["usage"]["completion_tokens"] > 5, "the answer must outlive the kill point"
    with ResumeFleet(max_resumes=None, connector=connector) as fleet:
        for got in until_killed(fleet, lambda: anthropic_events(fleet.gw.url, body)):
            names = [n for n, _ in got]
            assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"], names
            assert "error" not in names, got
            assert names.count("content_block_start") == names.count("content_block_stop") == 1, names
            text = "".join(d["delta"]["text"] for n, d in got if n == "content_block_delta")
            assert text == want["choices"][0]["message"]["content"]
            delta = got[-2][1]
            assert delta["usage"]["output_tokens"] == want["usage"]["completion_tokens"]
            assert delta["usage"]["input_tokens"] + delta["usage"].get("cache_read_input_tokens", 0) == want["usage"]["prompt_tokens"]
        assert fleet.metric('pdgate_resumes_total{reason="decode_died",result="resumed"}') == 1.0
