"""Prefix-hit rate and TTFT of `round_robin`, `cache_aware --cache-source text` and
`--cache-source events`, with one and two pdgate replicas, in one run (docs/performance.md,
"Prefix-cache routing").

Four tiny reference engines (colocated, small prefix caches, KV events on) behind the gateway;
the seeded multi-turn workload of tests/gateway/test_cache_source_e2e.py (shared prefixes),
requests sent one at a time, request i to replica i mod N. Each configuration starts from empty
engine caches. The hit rate is the engines' own: sum cached_tokens / sum prompt_tokens.

Usage (from the repository root, with the gateway installed in the Python environment):
  python bench/cache_source.py [--conversations 40] [--turns 5] [--cache-tokens 640] [--seeds 16,17,18]
      [--system-words 28] [--turn-words 5] [--live 6]
The two settings of docs/performance.md: the defaults (small caches that evict), and
  --cache-tokens 1536 --system-words 14 --turn-words 10 (larger caches, longer turns).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.conftest import Processes  # noqa: E402
from tests.gateway.prefix_routing import conversations, export_tokenizer, launch_replica, run, start_engines, wait_subscribed  # noqa: E402

CONFIGS = [("round_robin", "text", 1), ("cache_aware", "text", 1), ("cache_aware", "events", 1),
           ("round_robin", "text", 2), ("cache_aware", "text", 2), ("cache_aware", "events", 2)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--conversations", type=int, default=40)
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--cache-tokens", type=int, default=640, help="each engine's KV pool (--max-total-tokens)")
    p.add_argument("--seeds", default="16,17,18", help="workload seeds; each configuration runs every seed")
    p.add_argument("--system-words", type=int, default=28, help="words of each group's system prompt")
    p.add_argument("--turn-words", type=int, default=5, help="words of each user and assistant message")
    p.add_argument("--live", type=int, default=6, help="conversations in progress at a time")
    p.add_argument("--json", default=None, help="also write the rows here")
    p.add_argument("--gateway-seed", type=int, default=None,
                   help="the gateways' --seed (routing rng: tie-breaks, random first placements); default random")
    args = p.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    engines = start_engines(args.workers, args.cache_tokens)
    processes = Processes()
    rows = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            tok = export_tokenizer(Path(tmp))
            for policy, source, n in CONFIGS:
                prompt = cached = 0
                ttft: list[float] = []
                for seed in seeds:
                    engines.reset_caches()
                    gws = [launch_replica(processes, engines, policy, source, tok, args.gateway_seed) for _ in range(n)]
                    for gw in gws:
                        wait_subscribed(gw, args.workers)
                    r = run(gws, conversations(seed, n_conversations=args.conversations, turns=args.turns, system_words=args.system_words,
                                                      turn_words=args.turn_words, live=args.live))
                    for gw in gws:
                        gw.stop()
                    prompt, cached, ttft = prompt + r.prompt_tokens, cached + r.cached_tokens, ttft + r.ttft_s
                ttft.sort()
                row = {"policy": policy, "cache_source": source if policy == "cache_aware" else "-", "replicas": n,
                       "requests": len(ttft), "hit_rate": cached / max(1, prompt),
                       "ttft_p50_ms": ttft[len(ttft) // 2] * 1000, "ttft_p90_ms": ttft[int(len(ttft) * 0.9)] * 1000,
                       "ttft_mean_ms": sum(ttft) / len(ttft) * 1000}
                rows.append(row)
                print(f"{policy:12s} {row['cache_source']:6s} replicas={n}  hit={row['hit_rate']:.3f}  "
                      f"ttft p50={row['ttft_p50_ms']:.1f} ms p90={row['ttft_p90_ms']:.1f} ms mean={row['ttft_mean_ms']:.1f} ms", flush=True)
    finally:
        processes.kill_all()
        engines.stop()
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
