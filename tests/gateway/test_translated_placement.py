"""The Messages and Responses APIs (issue 29 item 4) through colocated and conditional placement
(`--pd-placement`), driven by the official `anthropic` and `openai` SDKs, in front of reference
engines: a prefill/decode pair (SGLang bootstrap) and one colocated worker, the fleet of
test_placement_e2e.py with its pinned cost model.

Both APIs run as the equivalent chat completion, so the placement decides for them as for chat:
the decision header says where each ran, and on greedy decoding each answer's text equals the
same conversation's chat answer from the colocated engine directly (PD output equals colocated
output, token for token)."""

from __future__ import annotations

from typing import Any

import anthropic
import httpx
import openai
import pytest

from tests.conftest import Processes
from tests.gateway.harness import scrape
from tests.gateway.test_placement_e2e import _gateway, engines  # noqa: F401 (the fixture)

pytestmark = pytest.mark.timeout(300)
MAX = 12


def _clients(url: str) -> tuple[anthropic.Anthropic, openai.OpenAI]:
    return (anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0, timeout=60),
            openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60))


def _chat_text(url: str, text: str) -> str:
    """The chat answer of the one-user-turn conversation, from `url` (an engine) directly."""
    body = {"model": "m", "messages": [{"role": "user", "content": text}], "max_tokens": MAX, "temperature": 0}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def _messages(client: anthropic.Anthropic, text: str, stream: bool) -> tuple[str, str, Any]:
    """(route header, text, usage) of a Messages request, streamed or not."""
    # The SDK (2.17) has no sampling arguments: `temperature` goes as `extra_body`.
    kw: dict[str, Any] = dict(model="m", max_tokens=MAX, extra_body={"temperature": 0}, messages=[{"role": "user", "content": text}])
    if stream:
        with client.messages.with_streaming_response.create(stream=True, **kw) as raw:
            route = raw.headers["x-pdgate-route"]
            events = list(raw.parse())
        names = [e.type for e in events]
        assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"], names
        assert "error" not in names, names
        got = "".join(e.delta.text for e in events if e.type == "content_block_delta")
        return route, got, events[-2].usage
    raw = client.messages.with_raw_response.create(**kw)
    msg = raw.parse()
    assert msg.type == "message" and msg.content[0].type == "text"
    return raw.headers["x-pdgate-route"], msg.content[0].text, msg.usage


def _responses(client: openai.OpenAI, text: str, stream: bool) -> tuple[str, str, Any]:
    """(route header, text, usage) of a Responses request, streamed or not."""
    kw: dict[str, Any] = dict(model="m", input=text, max_output_tokens=MAX, temperature=0)
    if stream:
        with client.responses.with_streaming_response.create(stream=True, **kw) as raw:
            route = raw.headers["x-pdgate-route"]
            events = list(raw.parse())
        assert [e.sequence_number for e in events] == list(range(len(events)))
        assert events[-1].type in ("response.completed", "response.incomplete"), [e.type for e in events]
        got = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        assert got == events[-1].response.output_text
        return route, got, events[-1].response.usage
    raw = client.responses.with_raw_response.create(**kw)
    resp = raw.parse()
    return raw.headers["x-pdgate-route"], resp.output_text, resp.usage


CALLS = [("messages", False), ("messages", True), ("responses", False), ("responses", True)]


def _call(url: str, api: str, text: str, stream: bool) -> tuple[str, str, Any]:
    messages, responses = _clients(url)
    return _messages(messages, text, stream) if api == "messages" else _responses(responses, text, stream)


def test_colocated_placement_runs_both_apis_on_the_colocated_worker(processes: Processes, engines: Any) -> None:
    gw = _gateway(processes, engines, "--pd-placement", "colocated")
    colocated = engines["colocated"]
    pair_before = sum(scrape(engines[k].url, "pdgate_engine_requests_total") for k in ("prefill", "decode"))
    for api, stream in CALLS:
        text = f"colocated {api} {'stream' if stream else 'whole'}"
        route, got, _ = _call(gw.url, api, text, stream)
        assert route.startswith("protocol=regular") and colocated.url in route, (api, stream, route)
        assert "placement=colocated" in route, route
        assert got == _chat_text(colocated.url, text), (api, stream)
    assert sum(scrape(engines[k].url, "pdgate_engine_requests_total") for k in ("prefill", "decode")) == pair_before, \
        "the pair served nothing"
    assert scrape(gw.url, 'pdgate_requests_total{route="/v1/messages",status="200"}') == 2
    assert scrape(gw.url, 'pdgate_requests_total{route="/v1/responses",status="200"}') == 2


def test_conditional_placement_decides_for_both_apis_as_for_chat(processes: Processes, engines: Any) -> None:
    gw = _gateway(processes, engines, "--pd-placement", "conditional")
    colocated = engines["colocated"]
    long_text = "a" * 3000
    answers = []
    with httpx.Client(timeout=120) as client:
        # A long stream on the colocated worker, left unread so it stays in flight: the running
        # decode a long local prefill would stall (as in test_placement_e2e.py).
        body = {"prompt": "hold", "max_tokens": 4000, "ignore_eos": True, "stream": True}
        with client.stream("POST", gw.url + "/v1/completions", json=body) as held:
            assert held.status_code == 200
            for api, stream in CALLS:
                short_text = f"short {api} {'stream' if stream else 'whole'}"
                answers.append((api, stream, short_text, _call(gw.url, api, short_text, stream), _call(gw.url, api, long_text, stream)))
    want_long = _chat_text(colocated.url, long_text)
    for api, stream, short_text, (short_route, short_got, _), (long_route, long_got, long_usage) in answers:
        case = (api, stream)
        assert short_route.startswith("protocol=regular") and colocated.url in short_route, (case, short_route)
        assert "placement=colocated; reason=local_ttft_lower" in short_route, (case, short_route)
        assert long_route.startswith("protocol=bootstrap"), (case, long_route)
        assert "placement=disaggregated; reason=local_stall_breaks_tpot" in long_route, (case, long_route)
        assert short_got == _chat_text(colocated.url, short_text), case
        assert long_got == want_long, case
        # The pair really moved the KV: the decode reports the prompt as cached.
        cached = long_usage.cache_read_input_tokens if api == "messages" else long_usage.input_tokens_details.cached_tokens
        assert (cached or 0) > 0, (case, long_usage)
