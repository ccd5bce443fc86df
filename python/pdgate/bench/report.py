"""Print one load level's result as vLLM's `bench serve` does (same labels, same order)."""

from __future__ import annotations

from typing import Any, Sequence

from .metrics import percentile_key

__all__ = ["print_report"]

_NAMES = {"ttft": ("TTFT", "Time to First Token"), "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
          "itl": ("ITL", "Inter-token Latency"), "e2el": ("E2EL", "End-to-end Latency")}


def print_report(result: dict[str, Any], metrics: Sequence[str], percentiles: Sequence[float]) -> None:
    row = "{:<40} {:<10}".format
    print("{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="="))
    print(row("Successful requests:", result["completed"]))
    print(row("Failed requests:", result["failed"]))
    for kind, count in sorted(result.get("errors_by_kind", {}).items()):
        print(row(f"  {kind}:", count))
    print(row("Request rate configured (RPS):", result["request_rate"]))
    print(row("Benchmark duration (s):", f"{result['duration']:.2f}"))
    print(row("Total input tokens:", result["total_input_tokens"]))
    print(row("Total generated tokens:", result["total_output_tokens"]))
    print(row("Request throughput (req/s):", f"{result['request_throughput']:.2f}"))
    if result.get("request_goodput") is not None:
        print(row("Request goodput (req/s):", f"{result['request_goodput']:.2f}"))
    print(row("Output token throughput (tok/s):", f"{result['output_throughput']:.2f}"))
    print(row("Total Token throughput (tok/s):", f"{result['total_token_throughput']:.2f}"))
    for metric in metrics:
        short, header = _NAMES[metric]
        print("{s:{c}^{n}}".format(s=header, n=50, c="-"))
        print(row(f"Mean {short} (ms):", f"{result[f'mean_{metric}_ms']:.2f}"))
        print(row(f"Median {short} (ms):", f"{result[f'median_{metric}_ms']:.2f}"))
        for p in percentiles:
            key = percentile_key(p, metric)
            print(row(f"{key.split('_')[0].upper()} {short} (ms):", f"{result[key]:.2f}"))
    epd = result.get("epd")
    if epd:
        print("{s:{c}^{n}}".format(s="TTFT by kind (EPD)", n=50, c="-"))
        print(row("Requests with images:", f"{epd['image_requests']} ({epd['images']} images)"))
        for kind in ("image", "text"):
            print(row(f"Median TTFT, {kind} requests (ms):", f"{epd[f'median_{kind}_ttft_ms']:.2f}"))
            for p in percentiles:
                key = percentile_key(p, f"{kind}_ttft")
                print(row(f"{key.split('_')[0].upper()} TTFT, {kind} requests (ms):", f"{epd[key]:.2f}"))
    print("=" * 50, flush=True)
