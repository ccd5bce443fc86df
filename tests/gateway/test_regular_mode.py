"""`pdgate launch --worker-urls ...` in front of one regular mock worker."""

from __future__ import annotations

import concurrent.futures

import httpx
import pytest

from tests.conftest import Processes
from tests.gateway.stacks import Stack, regular_stack
from tests.mock_workers import MockHost
from tests.mock_workers.model import expected_text

PROMPT = "Once upon a time in a small town"


@pytest.fixture
def stack(mocks: MockHost, processes: Processes) -> Stack:
    return regular_stack(mocks, processes)


def test_completions_and_chat_through_openai_client(stack: Stack) -> None:
    client = stack.client()
    out = client.completions.create(model="mock-model", prompt=PROMPT, max_tokens=6)
    assert out.choices[0].text == expected_text("completions", {"prompt": PROMPT, "max_tokens": 6})[0]
    messages = [{"role": "user", "content": "hello there"}]
    chat = client.chat.completions.create(model="mock-model", messages=messages, max_tokens=4)
    assert chat.choices[0].message.content == expected_text("chat", {"messages": messages, "max_tokens": 4})[0]


def test_streams_are_relayed_chunk_by_chunk(stack: Stack) -> None:
    client = stack.client()
    chunks = list(client.completions.create(model="mock-model", prompt=PROMPT, max_tokens=5, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == expected_text("completions", {"prompt": PROMPT, "max_tokens": 5})[0]
    assert len(chunks) == 5
    messages = [{"role": "user", "content": "hi"}]
    stream = client.chat.completions.create(model="mock-model", messages=messages, max_tokens=3, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected_text("chat", {"messages": messages, "max_tokens": 3})[0]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 3


def test_done_marker_is_preserved(stack: Stack) -> None:
    body = {"model": "mock-model", "prompt": PROMPT, "max_tokens": 2, "stream": True}
    with httpx.stream("POST", stack.url + "/v1/completions", json=body, timeout=10) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        events = [line for line in resp.iter_lines() if line.startswith("data:")]
    assert events[-1] == "data: [DONE]"


def test_generate_single_and_batch(stack: Stack) -> None:
    one = httpx.post(stack.url + "/generate", json={"text": PROMPT, "sampling_params": {"max_new_tokens": 3}}, timeout=10)
    assert one.status_code == 200
    assert one.json()["text"] == expected_text("generate", {"text": PROMPT, "sampling_params": {"max_new_tokens": 3}})[0]
    batch = {"text": ["first prompt", "second prompt here"], "sampling_params": {"max_new_tokens": 2}}
    many = httpx.post(stack.url + "/generate", json=batch, timeout=10)
    assert many.status_code == 200
    assert [o["text"] for o in many.json()] == expected_text("generate", batch)


def test_models_health_metrics_and_route_header(stack: Stack) -> None:
    models = httpx.get(stack.url + "/v1/models", timeout=5).json()
    assert "mock-model" in [m["id"] for m in models["data"]]
    assert httpx.get(stack.url + "/health", timeout=5).status_code == 200
    assert httpx.get(stack.url + "/liveness", timeout=5).status_code == 200
    resp = httpx.post(stack.url + "/v1/completions", json={"model": "mock-model", "prompt": "x", "max_tokens": 1}, timeout=10)
    worker = stack.workers["regular"][0]
    assert str(worker.port) in resp.headers["x-pdgate-route"]
    metrics = httpx.get(stack.url + "/metrics", timeout=5)
    assert metrics.status_code == 200
    assert "# TYPE" in metrics.text


def test_sigterm_stops_cleanly_and_lets_requests_finish(stack: Stack, mocks: MockHost) -> None:
    mocks.set_knobs(stack.workers["regular"][0], delay_s=1.0)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        body = {"model": "mock-model", "prompt": PROMPT, "max_tokens": 2}
        in_flight = pool.submit(httpx.post, stack.url + "/v1/completions", json=body, timeout=15)
        assert mocks.wait_pending(stack.workers["regular"][0], 1, timeout=10)  # it reached the worker
        assert stack.gateway.stop() == 0
        assert in_flight.result().status_code == 200
    assert "stopped" in "".join(stack.gateway.output)
