"""Prompts and lengths: the random dataset (fixed, uniform, lognormal, shared prefixes) and
JSONL traces, including a line in the request-log format."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from pdgate.bench.dataset import draw_lengths, random_requests, trace_requests
from pdgate.bench.trace import TraceError, parse_trace_line


def test_random_prompts_have_their_token_counts_and_shared_prefixes() -> None:
    reqs = random_requests(40, 50, 8, range_ratio=0.5, prefix_len=16, num_prefixes=2, rng=np.random.default_rng(0))
    for r in reqs:
        assert len(r.prompt.encode()) == r.prompt_len  # byte tokenizer: one character, one token
        assert 16 + 25 <= r.prompt_len <= 16 + 75 and 4 <= r.output_len <= 12
    assert {r.prompt[:16] for r in reqs[0::2]} == {reqs[0].prompt[:16]}
    assert reqs[0].prompt[:16] != reqs[1].prompt[:16]
    again = random_requests(40, 50, 8, range_ratio=0.5, prefix_len=16, num_prefixes=2, rng=np.random.default_rng(0))
    assert again == reqs


def test_length_distributions() -> None:
    rng = np.random.default_rng(3)
    assert set(draw_lengths(100, 50, "fixed", 0.9, 0.5, rng)) == {100}
    uniform = draw_lengths(100, 20000, "uniform", 0.2, 0.5, rng)
    assert uniform.min() == 80 and uniform.max() == 120
    logn = draw_lengths(1000, 20000, "lognormal", 0.0, 0.5, rng)
    assert np.median(logn) == pytest.approx(1000, rel=0.03)
    assert np.std(np.log(logn)) == pytest.approx(0.5, rel=0.03)
    with pytest.raises(ValueError):
        draw_lengths(100, 5, "uniform", 1.5, 0.5, rng)


def test_trace_lines_in_each_accepted_shape(tmp_path: Path) -> None:
    # A --request-log line as the gateway writes it (docs/goodput.md), and one of a request that
    # failed before the engine reported its prompt: not replayable, skipped.
    log_line = {"arrival_unix_s": 1_700_000_000.5, "request_id": "r-1", "client_request_id": None,
                "route": "/v1/completions", "model": "m", "stream": True, "placement": "disaggregated",
                "protocol": "bootstrap", "worker": None, "prefill": "http://p", "decode": "http://d",
                "prompt_tokens": 120, "output_tokens": 30, "cached_tokens": 0, "ttft_ms": 80.0,
                "tpot_ms": 9.0, "e2e_ms": 350.0, "slo_ttft_ms": 1000.0, "slo_tpot_ms": 50.0,
                "slo_result": "met", "status": 200, "error": None, "attempts": 1}
    failed = {**log_line, "prompt_tokens": None, "output_tokens": None, "slo_result": "failed",
              "status": 502, "error": "worker_status"}
    lines = [log_line, failed, {**log_line, "arrival_unix_s": 1_700_000_002.0, "prompt_tokens": 7},
             {"prompt": "hello there", "output_len": 3, "timestamp": 0.25}]
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    reqs = trace_requests(str(path), None, 256, np.random.default_rng(0))
    assert [r.prompt_len for r in reqs] == [120, 7, 11]
    assert [r.output_len for r in reqs] == [30, 30, 3]
    assert len(reqs[0].prompt) == 120
    assert reqs[0].arrival_s == pytest.approx(1_700_000_000.5)
    assert reqs[2].arrival_s == 0.25
    assert parse_trace_line('{"messages": [{"role": "user", "content": "hi"}]}').prompt == "hi"
    for bad in ('[1]', '{"output_tokens": 3}', '{"prompt_tokens": -1}', '{"prompt": 5}'):
        with pytest.raises(TraceError):
            parse_trace_line(bad)


def test_sharegpt_first_human_turn_and_reply_length(tmp_path: Path) -> None:
    from pdgate.bench.dataset import sharegpt_requests

    data = [{"conversations": [{"from": "human", "value": "abc"}, {"from": "gpt", "value": "12345"}]},
            {"conversations": [{"from": "human", "value": "only one turn"}]},
            {"conversations": [{"from": "human", "value": "hello"}, {"from": "gpt", "value": "hi"}]}]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    reqs = sharegpt_requests(str(path), 10, None, np.random.default_rng(0))
    assert sorted((r.prompt, r.prompt_len, r.output_len) for r in reqs) == [("abc", 3, 5), ("hello", 5, 2)]
    fixed = sharegpt_requests(str(path), 1, 7, np.random.default_rng(0))
    assert len(fixed) == 1 and fixed[0].output_len == 7


def test_images_go_to_a_share_of_requests_and_leave_the_text_alone() -> None:
    """EPD: `with_images` gives a fraction of the requests K distinct PNG data URLs, from its own
    generator (the prompts are those of the run without images), and the chat body carries them
    as image_url parts after the text."""
    import base64
    import io

    from PIL import Image

    from pdgate.bench.client import RequestSpec, build_body
    from pdgate.bench.dataset import with_images

    plain = random_requests(200, 20, 4, rng=np.random.default_rng(1))
    mixed = with_images(plain, 0.25, 2, 24, seed=1)
    assert [r.prompt for r in mixed] == [r.prompt for r in plain]
    picked = [r for r in mixed if r.images]
    assert 30 <= len(picked) <= 70 and all(len(r.images) == 2 for r in picked)
    urls = [u for r in picked for u in r.images]
    assert len(set(urls)) == len(urls)  # every image different: no embedding cache hit
    img = Image.open(io.BytesIO(base64.b64decode(urls[0].split(",", 1)[1])))
    assert (img.format, img.size) == ("PNG", (24, 24))
    assert with_images(plain, 0.25, 2, 24, seed=1) == mixed
    body = build_body(RequestSpec(url="u", model="m", chat=True, stream=True), picked[0])
    parts = body["messages"][0]["content"]
    assert parts[0] == {"type": "text", "text": picked[0].prompt}
    assert [p["image_url"]["url"] for p in parts[1:]] == list(picked[0].images)
    with pytest.raises(ValueError):
        build_body(RequestSpec(url="u", model="m", chat=False, stream=True), picked[0])
