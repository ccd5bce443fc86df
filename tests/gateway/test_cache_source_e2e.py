"""`cache_aware --cache-source` end to end: four reference engines that publish KV events, pdgate
in front, 200 requests of seeded multi-turn conversations sharing prefixes (groups share a
system prompt; each turn extends its conversation's previous prompt). The prefix-hit rate is the
engines' own (cached_tokens / prompt_tokens from the answers' usage).

Two effects, each where it shows (measured; docs/performance.md, "Prefix-cache routing"):

- Small caches (the engines evict): with one replica, routing on the engines' events beats the
  text tree (which keeps sending a conversation to a worker that evicted it) and round robin.
- Larger caches: with two replicas and requests alternating between them, the events keep the
  one-replica figure (both replicas read the same engines), and the text tree's drops (each
  replica knows only the prompts it sent). With one replica and these caches, the text tree is
  at best as good as the events: little was evicted for it to be wrong about.

The workload is seeded; the text tree's miss placement is random (SMG's rule), hence the
margins. The events break miss ties by the engines' shared view and score within a few
hundredths run to run.
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
# 40 pages of 16 tokens each: a worker holds about two conversations, so the caches evict.
SMALL_CACHE = 640
# 96 pages; with short system prompts and long turns most of a prompt is its own conversation,
# what a replica's text tree misses when the previous turn went through the other replica.
LARGE_CACHE = 1536
LONG_TURNS = {"system_words": 14, "turn_words": 10, "live": 6}


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return export_tokenizer(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture
def small_engines() -> Iterator[Engines]:
    e = start_engines(WORKERS, SMALL_CACHE)
    try:
        yield e
    finally:
        e.stop()


@pytest.fixture
def large_engines() -> Iterator[Engines]:
    e = start_engines(WORKERS, LARGE_CACHE)
    try:
        yield e
    finally:
        e.stop()


def hit_rates(processes, engines: Engines, tokenizer_dir: Path, configs, workload: dict, seeds=(16,)) -> dict:
    """Each configuration's hit rate over the workloads of `seeds` (tokens summed), each run
    from empty engine caches."""
    rates = {}
    for policy, source, replicas in configs:
        prompt = cached = 0
        for seed in seeds:
            engines.reset_caches()
            gws = [launch_replica(processes, engines, policy, source, tokenizer_dir) for _ in range(replicas)]
            try:
                for gw in gws:
                    wait_subscribed(gw, WORKERS)
                r = run(gws, conversations(seed=seed, **workload))
                prompt, cached = prompt + r.prompt_tokens, cached + r.cached_tokens
            finally:
                for gw in gws:
                    gw.stop()
        rates[(policy, source, replicas)] = cached / prompt
    print("hit rates:", ", ".join(f"{p}/{s}/{n}: {r:.3f}" for (p, s, n), r in rates.items()))
    return rates


@pytest.mark.timeout(420)
def test_with_evicting_caches_events_beat_the_text_tree_and_round_robin(processes, small_engines, tokenizer_dir):
    configs = [("round_robin", "text", 1), ("cache_aware", "text", 1), ("cache_aware", "events", 1)]
    # Four seeds summed: the text tree's figure swings with its random first placement (below).
    rate = hit_rates(processes, small_engines, tokenizer_dir, configs, {}, seeds=(16, 17, 18, 19))
    events, text, rr = (rate[c] for c in [("cache_aware", "events", 1), ("cache_aware", "text", 1), ("round_robin", "text", 1)])
    # Measured per seed (docs/performance.md, "Prefix-cache routing"): events 0.67-0.74 in 24
    # runs; round robin 0.24-0.26; text 0.39-0.73 by run: the text tree is as good as its
    # first, random placement of the groups (two groups on one worker thrash its cache, and the
    # tree keeps them there). The events place a miss on the emptiest of the idle workers and
    # know what each evicted. (Before the events did so, CI saw events 0.624 against text 0.629.)
    assert events > 0.66, rate
    assert events > text and events > rr + 0.3, rate


@pytest.mark.timeout(420)
def test_replicas_keep_the_hit_rate_with_events_and_lose_it_with_text(processes, large_engines, tokenizer_dir):
    # No one-replica text run: its figure swings too much to be compared with (below).
    configs = [("cache_aware", "text", 2), ("cache_aware", "events", 1), ("cache_aware", "events", 2)]
    rate = hit_rates(processes, large_engines, tokenizer_dir, configs, LONG_TURNS, seeds=(16, 17))
    text2 = rate[("cache_aware", "text", 2)]
    events1, events2 = rate[("cache_aware", "events", 1)], rate[("cache_aware", "events", 2)]
    # Measured (seed 16): text 0.66 -> 0.50, 0.70 -> 0.47 and 0.52 -> 0.47; events 0.67 -> 0.68,
    # 0.69 -> 0.65 and 0.67 -> 0.64; seeds 16+17 in CI: text 0.48 -> 0.51, events 0.66 -> 0.66;
    # since the events break miss ties by the shared view: events 0.695 -> 0.695, text2 0.50-0.51.
    # Two replicas' text figure is steady; the one-replica text figure is not (it is as good as
    # its first, random placement of the groups, and can fall below the two-replica one), so the
    # drop is judged against the one-replica figure of the events, which is steady.
    assert text2 < events1 - 0.08, rate
    assert events2 > events1 - 0.08, rate
    assert events2 > text2 + 0.08, rate


def test_without_a_tokenizer_start_up_says_text_serves_requests_without_ids(processes):
    gw = launch(processes, ["--policy", "cache_aware", "--cache-source", "events"])
    try:
        assert any("no tokenizer" in line and "text tree" in line for line in gw.output), "".join(gw.output)
    finally:
        gw.stop()
