"""`pdgate bench` statistics against values computed by hand on a small recorded trace."""

from __future__ import annotations

import pytest

from pdgate.bench.client import RequestOutput
from pdgate.bench.metrics import compute_metrics, parse_goodput, percentile_key

# A recorded trace, in seconds. Hand-computed below:
#   A: 3 tokens, TTFT 0.1, gaps 0.02 0.04, E2E 0.16 -> TPOT (0.16-0.1)/2 = 0.03
#   B: 5 tokens, TTFT 0.3, gaps 4 x 0.05, E2E 0.5   -> TPOT 0.2/4 = 0.05
#   C: 1 token,  TTFT 0.2, no gap,      E2E 0.2     -> no TPOT (goodput counts it as 0)
#   D: HTTP 429 overloaded; E: timeout
TRACE = [
    RequestOutput(True, 10, 3, 0.1, [0.02, 0.04], 0.16, 0.0, 200),
    RequestOutput(True, 20, 5, 0.3, [0.05] * 4, 0.5, 0.1, 200),
    RequestOutput(True, 30, 1, 0.2, [], 0.2, 0.2, 200),
    RequestOutput(False, 40, 0, 0.0, [], 0.01, 0.3, 429, "http_429:overloaded", "http_429:overloaded"),
    RequestOutput(False, 50, 0, 0.0, [], 5.0, 0.4, None, "timeout", "timeout"),
]


@pytest.fixture
def result() -> dict:
    return compute_metrics(TRACE, 2.0, {"ttft": 250.0, "tpot": 40.0}, percentiles=[50, 99, 99.9])


def test_counts_and_throughputs(result: dict) -> None:
    assert (result["completed"], result["failed"]) == (3, 2)
    assert (result["total_input_tokens"], result["total_output_tokens"]) == (60, 9)
    assert result["request_throughput"] == pytest.approx(1.5)
    assert result["output_throughput"] == pytest.approx(4.5)
    assert result["total_token_throughput"] == pytest.approx(34.5)
    assert result["errors_by_kind"] == {"http_429:overloaded": 1, "timeout": 1}
    assert result["output_lens"] == [3, 5, 1, 0, 0]


def test_goodput_needs_every_objective(result: dict) -> None:
    # A meets both; B misses TTFT (300 > 250); C meets TTFT and its TPOT counts as 0.
    assert result["request_goodput"] == pytest.approx(2 / 2.0)
    assert compute_metrics(TRACE, 2.0, {})["request_goodput"] is None
    assert compute_metrics(TRACE, 2.0, {"tpot": 29.0})["request_goodput"] == pytest.approx(1 / 2.0)  # only C
    assert compute_metrics(TRACE, 2.0, {"e2el": 200.0})["request_goodput"] == pytest.approx(2 / 2.0)  # A, C


def test_latency_statistics(result: dict) -> None:
    expected = {
        # TTFT 100, 300, 200 ms: numpy's linear percentile at 99 -> 200 + 0.98 * 100
        "mean_ttft_ms": 200.0, "median_ttft_ms": 200.0, "std_ttft_ms": (20000 / 3) ** 0.5, "p99_ttft_ms": 298.0,
        # TPOT 30, 50 ms (C has one token, so none)
        "mean_tpot_ms": 40.0, "median_tpot_ms": 40.0, "std_tpot_ms": 10.0, "p99_tpot_ms": 49.8,
        # ITL 20, 40, 50, 50, 50, 50 ms
        "mean_itl_ms": 260 / 6, "median_itl_ms": 50.0, "p50_itl_ms": 50.0, "p99_itl_ms": 50.0,
        # E2EL 160, 500, 200 ms
        "mean_e2el_ms": 860 / 3, "median_e2el_ms": 200.0, "p99_e2el_ms": 494.0,
    }
    for key, value in expected.items():
        assert result[key] == pytest.approx(value), key
    assert "p99.9_ttft_ms" in result


def test_detailed_lists_are_seconds(result: dict) -> None:
    assert result["ttfts"][:3] == [0.1, 0.3, 0.2]
    assert result["itls"][0] == [0.02, 0.04]
    assert result["errors"][3] == "http_429:overloaded"
    assert result["statuses"] == [200, 200, 200, 429, None]


def test_empty_run_reports_zeros() -> None:
    r = compute_metrics([], 1.0, {"ttft": 1.0})
    assert r["completed"] == 0 and r["mean_ttft_ms"] == 0.0 and r["request_goodput"] == 0.0


def test_goodput_and_percentile_parsing() -> None:
    assert parse_goodput(["ttft:500", "tpot:50", "e2el:1e4"]) == {"ttft": 500.0, "tpot": 50.0, "e2el": 10000.0}
    for bad in (["ttft"], ["itl:5"], ["ttft:-1"], ["ttft:x"]):
        with pytest.raises(ValueError):
            parse_goodput(bad)
    assert percentile_key(99.0, "ttft") == "p99_ttft_ms"
    assert percentile_key(99.9, "itl") == "p99.9_itl_ms"


def test_image_and_text_ttft_apart() -> None:
    outs = [RequestOutput(success=True, prompt_len=5, output_tokens=2, ttft=t, latency=t + 0.1, images=k)
            for t, k in ((0.5, 2), (0.7, 1), (0.1, 0), (0.3, 0))]
    r = compute_metrics(outs, 1.0, {}, [50])
    assert r["epd"]["image_requests"] == 2 and r["epd"]["images"] == 3
    assert r["epd"]["median_image_ttft_ms"] == pytest.approx(600.0)
    assert r["epd"]["median_text_ttft_ms"] == pytest.approx(200.0)
    assert "epd" not in compute_metrics([RequestOutput(success=True, ttft=0.1, latency=0.2)], 1.0, {}, [50])
