"""`cache_aware --cache-source` end to end: four reference engines with small prefix caches that
publish KV events, pdgate in front, 200 requests of seeded multi-turn conversations sharing
prefixes. The prefix-hit rate is the engines' own (cached_tokens / prompt_tokens from the
answers' usage).

- One replica: routing on the engines' events beats the text tree and round robin.
- Two replicas, requests alternating between them: with events each replica sees every
  engine's cache, so the hit rate holds; with the text tree each replica knows only the
  prompts it sent, and the hit rate drops.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest

from tests.gateway.harness import launch
from tests.gateway.prefix_routing import Engines, conversations, export_tokenizer, launch_replica, run, start_engines, wait_subscribed

pytest.importorskip("zmq")
pytestmark = pytest.mark.timeout(240)

WORKERS = 4
# 40 pages of 16 tokens: a worker holds a few conversations, so the caches evict.
CACHE_TOKENS = 640


@pytest.fixture(scope="module")
def engines() -> Iterator[Engines]:
    e = start_engines(WORKERS, CACHE_TOKENS)
    try:
        yield e
    finally:
        e.stop()


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return export_tokenizer(tmp_path_factory.mktemp("tokenizer"))


def hit_rate(processes, engines: Engines, tokenizer_dir: Path, policy: str, source: str, replicas: int) -> float:
    engines.reset_caches()
    gws = [launch_replica(processes, engines, policy, source, tokenizer_dir) for _ in range(replicas)]
    try:
        for gw in gws:
            wait_subscribed(gw, WORKERS)
        return run(gws, conversations(seed=16)).hit_rate
    finally:
        for gw in gws:
            gw.stop()


def test_events_beat_text_and_round_robin_and_hold_across_replicas(processes, engines, tokenizer_dir):
    rate = {
        (policy, source, n): hit_rate(processes, engines, tokenizer_dir, policy, source, n)
        for policy, source, n in [
            ("round_robin", "text", 1),
            ("cache_aware", "text", 1),
            ("cache_aware", "events", 1),
            ("cache_aware", "text", 2),
            ("cache_aware", "events", 2),
        ]
    }
    report = ", ".join(f"{p}/{s}/{n}: {r:.3f}" for (p, s, n), r in rate.items())
    events1, text1, rr1 = rate[("cache_aware", "events", 1)], rate[("cache_aware", "text", 1)], rate[("round_robin", "text", 1)]
    events2, text2 = rate[("cache_aware", "events", 2)], rate[("cache_aware", "text", 2)]
    assert events1 > text1 and events1 > rr1, report
    # Replicas share the engines' view: the same figure up to a few borderline decisions.
    assert abs(events2 - events1) < 0.03, report
    assert text2 < text1 - 0.05, report
    assert events2 > text2, report


def test_without_a_tokenizer_start_up_says_text_serves_requests_without_ids(processes):
    gw = launch(processes, ["--policy", "cache_aware", "--cache-source", "events"])
    try:
        assert any("no tokenizer" in line and "text tree" in line for line in gw.output), "".join(gw.output)
    finally:
        gw.stop()
