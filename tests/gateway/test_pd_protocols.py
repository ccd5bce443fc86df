"""PD mode in front of mocks that enforce each protocol: the output must equal what one regular
worker produces, the KV must have moved (cached tokens), and no protocol rule may be broken."""

from __future__ import annotations

import httpx
import pytest

from tests.conftest import Processes
from tests.gateway.stacks import PD_KINDS, Stack, pd_stack
from tests.mock_workers import MockHost
from tests.mock_workers.model import expected_text

PROMPT = "The capital of France is a city called"
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "name a colour"}]


@pytest.fixture(params=sorted(PD_KINDS))
def stack(request: pytest.FixtureRequest, mocks: MockHost, processes: Processes) -> Stack:
    return pd_stack(mocks, processes, request.param)


def assert_clean(mocks: MockHost, stack: Stack) -> None:
    for worker in stack.workers["prefill"] + stack.workers["decode"]:
        state = mocks.state(worker)
        assert state["violations"] == [], state["violations"]
        assert mocks.wait_idle(worker, timeout=5)


def test_completions(stack: Stack, mocks: MockHost) -> None:
    client = stack.client()
    resp = client.completions.with_raw_response.create(model="mock-model", prompt=PROMPT, max_tokens=7)
    out = resp.parse()
    assert out.choices[0].text == expected_text("completions", {"prompt": PROMPT, "max_tokens": 7})[0]
    assert out.usage.prompt_tokens_details.cached_tokens == out.usage.prompt_tokens  # the KV moved
    route = resp.headers["x-pdgate-route"]
    assert str(stack.prefill.port) in route and str(stack.decode.port) in route
    assert_clean(mocks, stack)


def test_completions_stream(stack: Stack, mocks: MockHost) -> None:
    chunks = list(stack.client().completions.create(model="mock-model", prompt=PROMPT, max_tokens=6, stream=True))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == expected_text("completions", {"prompt": PROMPT, "max_tokens": 6})[0]
    assert_clean(mocks, stack)


def test_chat(stack: Stack, mocks: MockHost) -> None:
    out = stack.client().chat.completions.create(model="mock-model", messages=MESSAGES, max_tokens=5)
    assert out.choices[0].message.content == expected_text("chat", {"messages": MESSAGES, "max_tokens": 5})[0]
    assert_clean(mocks, stack)


def test_chat_stream(stack: Stack, mocks: MockHost) -> None:
    stream = stack.client().chat.completions.create(model="mock-model", messages=MESSAGES, max_tokens=5, stream=True,
                                                    stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected_text("chat", {"messages": MESSAGES, "max_tokens": 5})[0]
    assert_clean(mocks, stack)


def test_generate(stack: Stack, mocks: MockHost) -> None:
    body = {"text": PROMPT, "sampling_params": {"max_new_tokens": 4}}
    resp = httpx.post(stack.url + "/generate", json=body, timeout=10)
    if stack.decode.native_generate:
        assert resp.status_code == 200, resp.text
        assert resp.json()["text"] == expected_text("generate", body)[0]
    else:  # vLLM workers have no /generate: a clear error, not a hang or a half-done transfer
        assert resp.status_code >= 400 and resp.json()["error"]["message"], resp.text
    assert_clean(mocks, stack)


def test_bootstrap_room_is_shared_and_recorded(mocks: MockHost, processes: Processes) -> None:
    stack = pd_stack(mocks, processes, "bootstrap")
    resp = httpx.post(stack.url + "/generate", json={"text": PROMPT, "sampling_params": {"max_new_tokens": 2}}, timeout=10)
    assert resp.status_code == 200
    p_body = mocks.state(stack.prefill)["received"][-1]["body"]
    d_body = mocks.state(stack.decode)["received"][-1]["body"]
    assert p_body == d_body  # the same body to both legs
    assert p_body["bootstrap_host"] == stack.prefill.host
    assert p_body["bootstrap_port"] == stack.prefill.bootstrap_port
    assert str(p_body["bootstrap_room"]) in resp.headers["x-pdgate-route"]


def test_bootstrap_generate_batch_gets_one_room_per_item(mocks: MockHost, processes: Processes) -> None:
    stack = pd_stack(mocks, processes, "bootstrap")
    body = {"text": ["one two three", "four five", "six"], "sampling_params": {"max_new_tokens": 3}}
    resp = httpx.post(stack.url + "/generate", json=body, timeout=10)
    assert resp.status_code == 200, resp.text
    assert [o["text"] for o in resp.json()] == expected_text("generate", body)
    rooms = mocks.state(stack.decode)["received"][-1]["body"]["bootstrap_room"]
    assert isinstance(rooms, list) and len(set(rooms)) == 3
    assert_clean(mocks, stack)


@pytest.mark.parametrize("stream", [False, True])
def test_bootstrap_merges_input_logprobs(stream: bool, mocks: MockHost, processes: Processes) -> None:
    from tests.mock_workers.model import input_logprobs, parse_items

    stack = pd_stack(mocks, processes, "bootstrap")
    body = {"text": PROMPT, "sampling_params": {"max_new_tokens": 3}, "return_logprob": True, "stream": stream}
    item = parse_items("generate", body)[0]
    merged = input_logprobs(item, "prefill") + input_logprobs(item, "decode")
    if stream:
        with httpx.stream("POST", stack.url + "/generate", json=body, timeout=10) as resp:
            assert resp.status_code == 200
            events = [line[len("data: "):] for line in resp.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        import json

        objs = [json.loads(e) for e in events[:-1]]
        assert objs and all(o["meta_info"]["input_token_logprobs"] == merged for o in objs)
    else:
        resp = httpx.post(stack.url + "/generate", json=body, timeout=10)
        assert resp.status_code == 200
        assert resp.json()["meta_info"]["input_token_logprobs"] == merged
    assert_clean(mocks, stack)


def test_nixl_legs_share_request_id_and_decode_gets_original(mocks: MockHost, processes: Processes) -> None:
    stack = pd_stack(mocks, processes, "nixl")
    out = stack.client().completions.create(model="mock-model", prompt=PROMPT, max_tokens=5, stream=False)
    assert len(out.choices[0].text.split()) == 5
    p = mocks.state(stack.prefill)["received"][-1]
    d = mocks.state(stack.decode)["received"][-1]
    assert p["headers"]["x-request-id"] == d["headers"]["x-request-id"]
    assert d["body"]["max_tokens"] == 5
    assert mocks.state(stack.prefill)["held"] == 0  # the decode pulled the blocks
    assert_clean(mocks, stack)


def test_mooncake_engine_id_comes_from_query(mocks: MockHost, processes: Processes) -> None:
    stack = pd_stack(mocks, processes, "mooncake")
    stack.client().completions.create(model="mock-model", prompt=PROMPT, max_tokens=2)
    p = mocks.state(stack.prefill)["received"][-1]["body"]["kv_transfer_params"]
    d = mocks.state(stack.decode)["received"][-1]["body"]["kv_transfer_params"]
    assert p["transfer_id"] == d["transfer_id"] and p["transfer_id"].startswith("xfer-")
    assert d["remote_engine_id"] == stack.prefill.engine_id
    assert d["remote_bootstrap_addr"] == f"http://{stack.prefill.host}:{stack.prefill.bootstrap_port}"
    assert_clean(mocks, stack)


@pytest.mark.parametrize("shape", ["n", "prompt_list"])
def test_bootstrap_completions_batches_get_one_room_per_item(shape: str, mocks: MockHost, processes: Processes) -> None:
    stack = pd_stack(mocks, processes, "bootstrap")
    body = {"model": "mock-model", "max_tokens": 3}
    body.update({"prompt": PROMPT, "n": 2} if shape == "n" else {"prompt": ["first one", "second one", "third"]})
    resp = httpx.post(stack.url + "/v1/completions", json=body, timeout=10)
    assert resp.status_code == 200, resp.text
    choices = sorted(resp.json()["choices"], key=lambda c: c["index"])
    assert [c["text"] for c in choices] == expected_text("completions", body)
    rooms = mocks.state(stack.decode)["received"][-1]["body"]["bootstrap_room"]
    assert isinstance(rooms, list) and len(set(rooms)) == len(choices)
    assert_clean(mocks, stack)
