"""The OpenAI Responses API (`/v1/responses`, issue 29) through PD, driven by the official
`openai` SDK, in front of reference engines: SGLang-style bootstrap, vLLM-style NIXL and
Mooncake, and one regular worker (no PD); a gRPC PD pair; resume after a decode's death.

pdgate translates a Responses request into the equivalent chat completion and back
(docs/protocols.md, "Responses API"), so every answer's text must equal the same conversation
through `/v1/chat/completions` on greedy decoding, with the same usage. One fleet per placement,
shared by the module's tests (module-scoped, parametrized).
"""

from __future__ import annotations

import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterator

import httpx
import openai
import pytest

import pdgate
from pdgate.workers import ReferenceWorker
from tests.gateway.harness import scrape, wait_status

pytestmark = pytest.mark.timeout(300)

# The gateway's --kv-connector and the engines' vLLM connector per PD mode; "regular": one
# worker, no PD.
CONNECTORS = {"bootstrap": None, "nixl": "NixlConnector", "mooncake": "MooncakeConnector", "regular": None}
MODEL = "tiny"
MAX = 12
PAYLOAD_LIMIT = 256 * 1024


def start(workers: list[ReferenceWorker]) -> None:
    with ThreadPoolExecutor(len(workers)) as pool:
        list(pool.map(lambda w: w.start(timeout=90), workers))


class PdFleet:
    def __init__(self, connector: str):
        kc = CONNECTORS[connector]
        self.connector = connector
        self.pd = connector != "regular"
        self.prefill = ReferenceWorker(mode="prefill" if self.pd else "null", model=MODEL, kv_connector=kc)
        self.decode = ReferenceWorker(mode="decode", model=MODEL, kv_connector=kc) if self.pd else self.prefill

    @property
    def workers(self) -> list[ReferenceWorker]:
        return [self.prefill, self.decode] if self.pd else [self.prefill]

    def __enter__(self) -> "PdFleet":
        start(self.workers)
        import tempfile

        self.request_log = os.path.join(tempfile.mkdtemp(prefix="responses-"), "requests.jsonl")
        common: dict[str, Any] = dict(port=0, request_timeout_secs=60, health_check_interval_secs=1,
                                      health_success_threshold=1, max_payload_size=PAYLOAD_LIMIT,
                                      request_log=self.request_log)
        if self.pd:
            self.gw = pdgate.Gateway(pd_disaggregation=True, kv_connector=self.connector,
                                     prefill=[[self.prefill.url, self.prefill.bootstrap_port]],
                                     decode=[self.decode.url], **common)
        else:
            self.gw = pdgate.Gateway(worker_urls=[self.prefill.url], **common)
        self.gw.__enter__()
        assert wait_status(self.gw.url + "/readiness", 200) == 200
        return self

    def __exit__(self, *exc: object) -> None:
        self.gw.__exit__(None, None, None)
        for w in self.workers:
            w.stop()

    @property
    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.gw.url + "/v1", api_key="unused", max_retries=0, timeout=60)

    def engine_requests(self) -> float:
        """Requests the engines accepted (their own counter): unchanged means nothing reached them."""
        return sum(scrape(w.url, "pdgate_engine_requests_total") for w in self.workers)

    def metric(self, line: str) -> float:
        return scrape(self.gw.url, line)


@pytest.fixture(scope="module", params=sorted(CONNECTORS))
def fleet(request: pytest.FixtureRequest) -> Iterator[PdFleet]:
    with PdFleet(request.param) as f:
        yield f


def chat(fleet: PdFleet, messages: list[dict], **kw: Any) -> Any:
    return fleet.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX, temperature=0, **kw)


def assert_same_as_chat(resp: Any, want: Any) -> None:
    assert resp.output_text == want.choices[0].message.content
    assert resp.status == ("incomplete" if want.choices[0].finish_reason == "length" else "completed")
    if resp.status == "incomplete":
        assert resp.incomplete_details.reason == "max_output_tokens"
    assert resp.usage.input_tokens == want.usage.prompt_tokens
    assert resp.usage.output_tokens == want.usage.completion_tokens
    assert resp.usage.total_tokens == want.usage.total_tokens
    assert resp.usage.output_tokens_details.reasoning_tokens == 0


def test_create_equals_chat_with_instructions(fleet: PdFleet) -> None:
    raw = fleet.client.responses.with_raw_response.create(model=MODEL, input="name a colour", instructions="be brief",
                                                          max_output_tokens=MAX, temperature=0)
    resp = raw.parse()
    assert resp.id.startswith("resp_") and resp.object == "response" and resp.created_at > 0
    assert resp.instructions == "be brief" and resp.max_output_tokens == MAX and resp.temperature == 0
    message = resp.output[0]
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert message.content[0].type == "output_text"
    want = chat(fleet, [{"role": "system", "content": "be brief"}, {"role": "user", "content": "name a colour"}])
    assert_same_as_chat(resp, want)
    # The PD transaction ran: the decision header names the placement, the KV moved.
    assert f"protocol={fleet.connector}" in raw.headers["x-pdgate-route"]
    if fleet.pd:
        assert resp.usage.input_tokens_details.cached_tokens > 0
    assert fleet.metric('pdgate_requests_total{route="/v1/responses",status="200"}') >= 1
    # The request log names the route (and counts the request's tokens).
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        with open(fleet.request_log) as f:
            rows = [json.loads(line) for line in f if line.strip()]
        mine = [r for r in rows if r["route"] == "/v1/responses" and r["request_id"] == raw.headers["x-request-id"]]
        if mine:
            break
        time.sleep(0.1)
    assert mine and mine[0]["prompt_tokens"] == resp.usage.input_tokens and mine[0]["status"] == 200, rows


def test_stream_is_a_valid_event_sequence_equal_to_chat(fleet: PdFleet) -> None:
    events = list(fleet.client.responses.create(model=MODEL, input=[{"role": "user", "content": "stream me"}],
                                                max_output_tokens=MAX, temperature=0, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:-1] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert sum(k in ("response.completed", "response.incomplete", "response.failed") for k in kinds) == 1
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert deltas == final.output_text == events[-4].text
    assert_same_as_chat(final, chat(fleet, [{"role": "user", "content": "stream me"}]))


def test_stream_helper_of_the_sdk(fleet: PdFleet) -> None:
    with fleet.client.responses.stream(model=MODEL, input="helper", max_output_tokens=MAX, temperature=0) as stream:
        events = list(stream)
        final = events[-1].response
        # The SDK's helper keeps a final response only for `response.completed` (not for
        # `response.incomplete`, OpenAI's terminal event at max_output_tokens).
        if events[-1].type == "response.completed":
            assert stream.get_final_response().output_text == final.output_text
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == final.output_text
    assert_same_as_chat(final, chat(fleet, [{"role": "user", "content": "helper"}]))


def test_multi_turn_retrieve_delete_cancel(fleet: PdFleet) -> None:
    c = fleet.client
    first = c.responses.create(model=MODEL, input="first turn", max_output_tokens=MAX, temperature=0)
    second = c.responses.create(model=MODEL, input="second turn", previous_response_id=first.id,
                                max_output_tokens=MAX, temperature=0, stream=False)
    assert second.previous_response_id == first.id
    want = chat(fleet, [{"role": "user", "content": "first turn"}, {"role": "assistant", "content": first.output_text},
                        {"role": "user", "content": "second turn"}])
    assert_same_as_chat(second, want)
    # A streamed third turn continues the conversation too.
    events = list(c.responses.create(model=MODEL, input="third", previous_response_id=second.id,
                                     max_output_tokens=MAX, temperature=0, stream=True))
    third = events[-1].response
    want3 = chat(fleet, [{"role": "user", "content": "first turn"}, {"role": "assistant", "content": first.output_text},
                         {"role": "user", "content": "second turn"},
                         {"role": "assistant", "content": second.output_text}, {"role": "user", "content": "third"}])
    assert third.output_text == want3.choices[0].message.content
    got = c.responses.retrieve(third.id)
    assert got.id == third.id and got.output_text == third.output_text
    assert c.responses.retrieve(first.id).output_text == first.output_text
    # The items used to generate the third response: the conversation before its output.
    items = list(c.responses.input_items.list(third.id, order="asc"))
    texts = [(i.type, i.role, i.content[0].text) for i in items]
    assert texts == [("message", "user", "first turn"), ("message", "assistant", first.output_text),
                     ("message", "user", "second turn"), ("message", "assistant", second.output_text),
                     ("message", "user", "third")], texts
    assert items[1].id == first.output[0].id and items[3].id == second.output[0].id, "earlier outputs keep their ids"
    assert len({i.id for i in items}) == 5
    # Newest first by default; pages of 2 follow `after` to the end (the SDK's auto-paging).
    page = c.responses.input_items.list(third.id, limit=2)
    assert [i.id for i in page.data] == [items[4].id, items[3].id] and page.has_more
    assert (page.first_id, page.last_id) == (items[4].id, items[3].id)
    assert [i.id for i in c.responses.input_items.list(third.id, limit=2)] == [i.id for i in reversed(items)]
    last = c.responses.input_items.list(third.id, order="asc", after=items[2].id, limit=100)
    assert [i.id for i in last.data] == [items[3].id, items[4].id] and not last.has_more
    with pytest.raises(openai.BadRequestError) as bad:
        c.responses.input_items.list(third.id, limit=101)
    assert bad.value.body["param"] == "limit"
    with pytest.raises(openai.NotFoundError):
        c.responses.input_items.list("resp_unknown")
    with pytest.raises(openai.BadRequestError):
        c.responses.cancel(first.id)
    c.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError):
        c.responses.delete(first.id)
    # An unknown previous response: OpenAI's 400 (code previous_response_not_found), no worker asked.
    before = fleet.engine_requests()
    with pytest.raises(openai.BadRequestError) as unknown:
        c.responses.create(model=MODEL, input="x", previous_response_id=first.id)
    assert unknown.value.body["code"] == "previous_response_not_found" and unknown.value.body["type"] == "invalid_request_error"
    assert unknown.value.body["param"] == "previous_response_id"
    assert unknown.value.body["message"] == f"Previous response with id '{first.id}' not found."
    assert fleet.engine_requests() == before


def test_store_false_is_not_kept(fleet: PdFleet) -> None:
    c = fleet.client
    r = c.responses.create(model=MODEL, input="forget me", store=False, max_output_tokens=4, temperature=0)
    assert r.store is False
    before = fleet.engine_requests()
    with pytest.raises(openai.BadRequestError) as err:
        c.responses.create(model=MODEL, input="again", previous_response_id=r.id)
    assert err.value.body["code"] == "previous_response_not_found"
    assert err.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(r.id)
    assert fleet.engine_requests() == before


def test_function_tools_and_items_map_to_chat(fleet: PdFleet) -> None:
    """The reference engine does no tool calling; the mapping of tools and of function_call /
    function_call_output items is what is checked: the same conversation through chat."""
    tool = {"type": "function", "name": "weather", "description": "the weather", "parameters": {"type": "object"}}
    items = [{"role": "user", "content": "weather?"},
             {"type": "function_call", "call_id": "call_1", "name": "weather", "arguments": "{}"},
             {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}]
    resp = fleet.client.responses.create(model=MODEL, input=items, tools=[tool], tool_choice="auto",
                                         max_output_tokens=MAX, temperature=0)
    assert resp.tools[0].name == "weather"
    want = chat(fleet, [{"role": "user", "content": "weather?"},
                        {"role": "assistant", "content": None, "tool_calls": [
                            {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": "{}"}}]},
                        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}],
                tools=[{"type": "function", "function": {"name": "weather", "description": "the weather",
                                                         "parameters": {"type": "object"}}}], tool_choice="auto")
    assert_same_as_chat(resp, want)


BAD = [
    ({"input": [{"type": "bogus_item"}]}, "input[0].type"),
    ({"input": [{"type": "function_call_output", "call_id": "nope", "output": "x"}]}, "input[0].call_id"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": "x", "background": True}, "background"),
    ({}, "input"),
]


@pytest.mark.parametrize("body,param", BAD, ids=[p for _, p in BAD])
def test_bad_input_is_a_400_and_reaches_no_worker(fleet: PdFleet, body: dict, param: str) -> None:
    before = fleet.engine_requests()
    with pytest.raises(openai.BadRequestError) as err:
        fleet.client.responses.create(model=MODEL, **body)
    assert err.value.body["param"] == param, err.value.body
    assert err.value.body["type"] == "invalid_request_error"
    assert fleet.engine_requests() == before


def test_huge_input_is_a_413_and_reaches_no_worker(fleet: PdFleet) -> None:
    before = fleet.engine_requests()
    with pytest.raises(openai.APIStatusError) as err:
        fleet.client.responses.create(model=MODEL, input="x" * (PAYLOAD_LIMIT + 1))
    assert err.value.status_code == 413
    assert fleet.engine_requests() == before


def responses_events(url: str, body: dict) -> list[tuple[str, dict]]:
    """The raw Responses stream: (event line, data) pairs, every event with both lines."""
    out: list[tuple[str, dict]] = []
    kind = None
    with httpx.stream("POST", url + "/v1/responses", json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("event: "):
                kind = line[len("event: "):]
            elif line.startswith("data: "):
                data = json.loads(line[len("data: "):])
                assert kind == data["type"], (kind, data)
                out.append((kind, data))
                kind = None
    return out


@pytest.mark.parametrize("connector", ["bootstrap", "nixl", "mooncake"])
def test_a_stream_whose_decode_is_killed_stays_a_valid_responses_stream(connector: str) -> None:
    """Resume after decode death, over each PD protocol: the continued stream is one valid
    Responses stream (consecutive sequence numbers, one terminal event, completed) whose text is
    the uninterrupted answer's, which a plain engine of the decodes' flavour computes directly."""
    from tests.gateway.test_resume import KILL_AFTER, MAX_TOKENS, Fleet, until_killed

    # NIXL and Mooncake decodes are vLLM-flavoured (test_resume.py's `flavour_of`).
    reference = ReferenceWorker(mode="null", model=MODEL, extra_args=[] if connector == "bootstrap" else ["--api-flavor", "vllm"])
    start([reference])
    try:
        body = {"model": MODEL, "input": "resume this response", "max_output_tokens": MAX_TOKENS, "temperature": 0,
                "ignore_eos": True}
        plain = openai.OpenAI(base_url=reference.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        want = plain.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": body["input"]}],
                                             max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True})
        with Fleet(max_resumes=None, connector=connector) as fleet:
            for got in until_killed(fleet, lambda: responses_events(fleet.gw.url, body)):
                assert [d["sequence_number"] for _, d in got] == list(range(len(got)))
                kinds = [k for k, _ in got]
                terminal = [k for k in kinds if k in ("response.completed", "response.incomplete", "response.failed")]
                assert terminal == [kinds[-1]] and kinds[-1] in ("response.completed", "response.incomplete"), kinds
                text = "".join(d["delta"] for k, d in got if k == "response.output_text.delta")
                assert text == want.choices[0].message.content
                final = got[-1][1]["response"]
                assert final["output"][0]["content"][0]["text"] == text
                assert final["usage"]["output_tokens"] == MAX_TOKENS
                assert final["usage"]["input_tokens"] == want.usage.prompt_tokens
            assert fleet.metric('pdgate_resumes_total{reason="decode_died",result="resumed"}') == 1.0
            assert KILL_AFTER < MAX_TOKENS
    finally:
        reference.stop()


def test_over_grpc_workers_in_pd(tmp_path_factory: pytest.TempPathFactory) -> None:
    """gRPC workers take token ids only: the translated chat request is tokenized by the gateway
    and split over a gRPC prefill and decode (SGLang bootstrap); the answers equal chat's."""
    from tests.gateway.grpc_stacks import export_model_dir, gateway

    model_dir = export_model_dir(str(tmp_path_factory.mktemp("responses-tokenizer")))
    p = ReferenceWorker(mode="prefill", model=MODEL, grpc_service="sglang")
    d = ReferenceWorker(mode="decode", model=MODEL, grpc_service="sglang")
    start([p, d])
    try:
        gw = gateway(model_dir, pd_disaggregation=True, prefill=[[p.grpc_url, p.bootstrap_port]], decode=[d.grpc_url],
                     request_timeout_secs=60)
        try:
            c = openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0, timeout=60)
            resp = c.responses.create(model=MODEL, input="over grpc", instructions="sys", max_output_tokens=MAX,
                                      temperature=0)
            want = c.chat.completions.create(model=MODEL, messages=[{"role": "system", "content": "sys"},
                                                                    {"role": "user", "content": "over grpc"}],
                                             max_tokens=MAX, temperature=0)
            assert_same_as_chat(resp, want)
            events = list(c.responses.create(model=MODEL, input="over grpc", instructions="sys",
                                             max_output_tokens=MAX, temperature=0, stream=True))
            assert [e.sequence_number for e in events] == list(range(len(events)))
            assert events[-1].response.output_text == resp.output_text
            assert events[-1].response.usage.output_tokens == resp.usage.output_tokens
            follow = c.responses.create(model=MODEL, input="next", previous_response_id=resp.id,
                                        max_output_tokens=MAX, temperature=0)
            want2 = c.chat.completions.create(
                model=MODEL, max_tokens=MAX, temperature=0,
                messages=[{"role": "user", "content": "over grpc"}, {"role": "assistant", "content": resp.output_text},
                          {"role": "user", "content": "next"}])
            assert follow.output_text == want2.choices[0].message.content
        finally:
            gw.__exit__(None, None, None)
    finally:
        for w in (p, d):
            w.stop()


def test_a_decode_death_without_resume_ends_the_stream_with_response_failed() -> None:
    """With resuming off, a decode that dies mid-answer ends the Responses stream with one
    `response.failed` (naming the decode), still a valid stream: no `response.completed`."""
    from tests.gateway.test_resume import MAX_TOKENS, Fleet, until_killed

    # The prompt of test_resume.py's max_resumes=0 chat case. Some prompts ("fail this response")
    # leave the fault decode stalled instead of dead with resuming off, through plain
    # /v1/chat/completions too (the engine's fault hook runs only after a chunk with visible
    # text, and without return_token_ids such a chunk may not come): an engine test-hook matter.
    body = {"model": MODEL, "input": "resume this chat", "max_output_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True}
    with Fleet(max_resumes=0, connector="bootstrap") as fleet:
        answers = until_killed(fleet, lambda: responses_events(fleet.gw.url, body))
    for got in answers:
        assert [d["sequence_number"] for _, d in got] == list(range(len(got)))
        kinds = [k for k, _ in got]
        terminal = [k for k in kinds if k in ("response.completed", "response.incomplete", "response.failed")]
        assert terminal == [kinds[-1]], kinds
    killed = answers[-1]
    assert killed[-1][0] == "response.failed", [k for k, _ in killed]
    failed = killed[-1][1]["response"]
    assert failed["status"] == "failed" and "decode" in failed["error"]["code"], failed["error"]
    assert any(k == "response.output_text.delta" for k, _ in killed), "tokens went out before the death"


def test_beside_smg(tmp_path_factory: pytest.TempPathFactory) -> None:
    """The same Responses requests through SMG 1.13 and pdgate, in front of the same reference
    engines (docs/migrating-from-smg.md, "Responses API"). Over gRPC workers SMG translates as
    pdgate does, and the greedy answers are the same text with the same usage; over HTTP workers
    SMG forwards /v1/responses to the engines, which the reference engine (like SGLang) does not
    serve, while pdgate translates. The error differences are asserted as found."""
    from tests.gateway.grpc_stacks import export_model_dir, gateway
    from tests.gateway.test_smg_compat import smg_binary
    from tests.gateway.test_smg_grpc_interop import smg_router

    smg = smg_binary()
    if smg is None:
        pytest.skip("smg is not installed (pip install smg==1.13.0)")
    model_dir = export_model_dir(str(tmp_path_factory.mktemp("smg-tokenizer")))
    p = ReferenceWorker(mode="prefill", model=MODEL, grpc_service="sglang")
    d = ReferenceWorker(mode="decode", model=MODEL, grpc_service="sglang")
    start([p, d])
    body = {"model": MODEL, "input": "name a colour", "instructions": "be brief", "max_output_tokens": MAX,
            "temperature": 0}
    orphan = {**body, "input": [{"type": "function_call_output", "call_id": "nope", "output": "x"}]}
    try:
        answers: dict[str, dict[str, Any]] = {}
        gw = gateway(model_dir, pd_disaggregation=True, prefill=[[p.grpc_url, p.bootstrap_port]], decode=[d.grpc_url],
                     request_timeout_secs=60)
        try:
            answers["pdgate"] = ask_both_ways(gw.url, body, orphan)
        finally:
            gw.__exit__(None, None, None)
        flags = ["--pd-disaggregation", "--prefill", p.grpc_url, str(p.bootstrap_port), "--decode", d.grpc_url]
        with smg_router(smg, model_dir, flags) as url:
            answers["smg"] = ask_both_ways(url, body, orphan)
        mine, theirs = answers["pdgate"], answers["smg"]
        # SMG drops a trailing run of U+FFFD (an answer ending in invalid UTF-8) that pdgate
        # writes, as over chat (docs/grpc-workers.md, "SMG and text prompts").
        cut = lambda t: t.rstrip("\ufffd")  # noqa: E731
        assert mine["stream_text"] == mine["text"] and theirs["stream_text"] == theirs["text"]
        assert cut(mine["text"]) == cut(theirs["text"]) and theirs["text"] == cut(theirs["text"])
        assert cut(mine["next_text"]) == cut(theirs["next_text"])
        assert mine["usage"] == theirs["usage"]
        assert mine["stream_kinds"] == theirs["stream_kinds"]
        # An unknown previous response is OpenAI's 400 in both; an orphan function_call_output
        # is refused here and answered by SMG (docs/migrating-from-smg.md).
        assert mine["unknown_previous"] == theirs["unknown_previous"] == (400, "previous_response_not_found")
        assert (mine["orphan"], theirs["orphan"]) == (400, 200)
        # SMG in front of the same engines' HTTP side forwards the Responses request itself.
        flags = ["--pd-disaggregation", "--prefill", p.url, str(p.bootstrap_port), "--decode", d.url]
        with smg_router(smg, model_dir, flags) as url:
            r = httpx.post(url + "/v1/responses", json=body, timeout=60)
            # Both legs get the request at once; whichever 404 SMG reads first names the leg.
            assert r.status_code == 404 and r.json()["error"]["code"] in ("prefill_not_found", "decode_not_found"), r.text
    finally:
        for w in (p, d):
            w.stop()


def ask_both_ways(url: str, body: dict, orphan: dict) -> dict[str, Any]:
    c = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
    resp = c.responses.create(**body)
    events = list(c.responses.create(**body, stream=True))
    follow = c.responses.create(**{**body, "input": "more", "previous_response_id": resp.id})
    unknown = httpx.post(url + "/v1/responses", json={**body, "previous_response_id": "resp_unknown"}, timeout=60)
    return {
        "text": resp.output_text,
        "usage": (resp.usage.input_tokens, resp.usage.output_tokens, resp.usage.total_tokens),
        "stream_text": "".join(e.delta for e in events if e.type == "response.output_text.delta"),
        "stream_kinds": [e.type for e in events if e.type != "response.output_text.delta"],
        "next_text": follow.output_text,
        "unknown_previous": (unknown.status_code, unknown.json()["error"]["code"]),
        "orphan": httpx.post(url + "/v1/responses", json=orphan, timeout=60).status_code,
    }


# -- function calls coming back: a worker with a tool parser, stood in for by a small server --------

TOOL_CALL = {"id": "call_abc", "type": "function", "function": {"name": "weather", "arguments": '{"city":"Paris"}'}}


class ToolWorker:
    """A minimal OpenAI-compatible worker whose chat answers are one tool call (as vLLM or SGLang
    with a tool parser answer), whole or streamed; it records the bodies it was sent."""

    def __init__(self) -> None:
        import http.server
        import threading

        bodies: list[dict] = []
        self.bodies = bodies

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.0"

            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                ok = self.path == "/health"
                self.send_response(200 if ok else 404)
                self.send_header("content-length", "0")
                self.end_headers()

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["content-length"])))
                bodies.append(body)
                usage = {"prompt_tokens": 9, "completion_tokens": 7, "total_tokens": 16}
                if not body.get("stream"):
                    out = json.dumps({"id": "chatcmpl-1", "object": "chat.completion", "model": "tool-model",
                                      "choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
                                          "role": "assistant", "content": None, "tool_calls": [TOOL_CALL]}}],
                                      "usage": usage}).encode()
                    self.send_response(200)
                    self.send_header("content-type", "application/json")
                    self.send_header("content-length", str(len(out)))
                    self.end_headers()
                    self.wfile.write(out)
                    return
                self.send_response(200)
                self.send_header("content-type", "text/event-stream")
                self.end_headers()
                args = TOOL_CALL["function"]["arguments"]
                deltas = [{"role": "assistant", "content": ""},
                          {"tool_calls": [{"index": 0, "id": "call_abc", "type": "function",
                                           "function": {"name": "weather", "arguments": ""}}]},
                          {"tool_calls": [{"index": 0, "function": {"arguments": args[:7]}}]},
                          {"tool_calls": [{"index": 0, "function": {"arguments": args[7:]}}]}]
                for i, delta in enumerate(deltas):
                    finish = "tool_calls" if i == len(deltas) - 1 else None
                    self.event({"id": "chatcmpl-1", "object": "chat.completion.chunk", "model": "tool-model",
                                "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})
                self.event({"id": "chatcmpl-1", "object": "chat.completion.chunk", "model": "tool-model",
                            "choices": [], "usage": usage})
                self.wfile.write(b"data: [DONE]\n\n")

            def event(self, data: dict) -> None:
                self.wfile.write(b"data: " + json.dumps(data).encode() + b"\n\n")
                self.wfile.flush()

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_worker_tool_calls_become_function_call_items_and_the_next_turn_sends_them_back() -> None:
    worker = ToolWorker()
    try:
        with pdgate.Gateway(worker_urls=[worker.url], port=0, health_check_interval_secs=1,
                            health_success_threshold=1) as gw:
            assert wait_status(gw.url + "/readiness", 200) == 200
            c = openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0, timeout=30)
            tool = {"type": "function", "name": "weather", "parameters": {"type": "object"}}
            resp = c.responses.create(model="tool-model", input="weather in Paris?", tools=[tool],
                                      tool_choice={"type": "function", "name": "weather"})
            assert worker.bodies[-1]["tools"] == [{"type": "function", "function": {"name": "weather",
                                                                                   "parameters": {"type": "object"}}}]
            assert worker.bodies[-1]["tool_choice"] == {"type": "function", "function": {"name": "weather"}}
            [call] = resp.output
            assert (call.type, call.call_id, call.name, call.arguments, call.status) == (
                "function_call", "call_abc", "weather", '{"city":"Paris"}', "completed")
            assert resp.status == "completed" and resp.usage.output_tokens == 7

            events = list(c.responses.create(model="tool-model", input="weather in Paris?", tools=[tool],
                                             stream=True))
            assert [e.sequence_number for e in events] == list(range(len(events)))
            kinds = [e.type for e in events]
            assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                             "response.function_call_arguments.delta", "response.function_call_arguments.delta",
                             "response.function_call_arguments.done", "response.output_item.done",
                             "response.completed"], kinds
            assert events[5].arguments == '{"city":"Paris"}'
            assert events[-1].response.output[0].call_id == "call_abc"

            # The next turn: the call's output, after the stored response with its call.
            c.responses.create(model="tool-model", previous_response_id=resp.id, tools=[tool],
                               input=[{"type": "function_call_output", "call_id": "call_abc", "output": "sunny"}])
            assert worker.bodies[-1]["messages"] == [
                {"role": "user", "content": "weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [TOOL_CALL]},
                {"role": "tool", "tool_call_id": "call_abc", "content": "sunny"}]
    finally:
        worker.close()
