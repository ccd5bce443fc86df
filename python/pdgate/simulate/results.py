"""A finished simulation as JSON, with `pdgate bench`'s key names where they mean the same."""

from __future__ import annotations

from typing import Any, Sequence

from pdgate.bench.metrics import latency_stats, meets_goodput

from .engine import Simulator

__all__ = ["simulation_result"]


def simulation_result(sim: Simulator, goodput: dict[str, float], percentiles: Sequence[float],
                      request_rate: float | None) -> dict[str, Any]:
    reqs = sim.requests
    ok = [r for r in reqs if not r.failed and r.finish is not None and r.first_token is not None]
    end_ms = max((r.finish for r in ok), default=0.0)
    start_ms = min((r.arrival for r in reqs), default=0.0)
    duration_s = max(end_ms - start_ms, 1e-9) / 1000.0
    ttft = [(r.first_token - r.arrival) / 1000.0 for r in ok]  # type: ignore[operator]
    e2el = [(r.finish - r.arrival) / 1000.0 for r in ok]  # type: ignore[operator]
    tpot_all = [((r.finish - r.first_token) / (r.output - 1) / 1000.0) if r.output > 1 else 0.0  # type: ignore[operator]
                for r in ok]
    tpot = [v for v, r in zip(tpot_all, ok) if r.output > 1]
    good = sum(1 for a, b, c in zip(ttft, tpot_all, e2el) if meets_goodput(goodput, a, b, c))
    total_in = sum(r.prompt for r in ok)
    total_out = sum(r.output for r in ok)
    gaps = sorted(sim.itl.counts.items())
    result: dict[str, Any] = {
        "placement": sim.config.placement,
        "request_rate": request_rate if request_rate is not None else "trace",
        "num_prompts": len(reqs),
        "duration": duration_s,
        "completed": len(ok),
        "failed": len(reqs) - len(ok),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration_s,
        "request_goodput": good / duration_s if goodput else None,
        "output_throughput": total_out / duration_s,
        "total_token_throughput": (total_in + total_out) / duration_s,
        "goodput_config": goodput,
    }
    result.update(latency_stats("ttft", ttft, percentiles))
    result.update(latency_stats("tpot", tpot, percentiles))
    result.update(latency_stats("itl", [g / 1000.0 for g, _ in gaps], percentiles, [c for _, c in gaps]))
    result.update(latency_stats("e2el", e2el, percentiles))
    end = sim.now
    result["queues"] = {name: {"mean": c.mean(end), "max": c.peak} for name, c in sim.stage.items()}
    result["mean_prefill_wait_ms"] = sum(r.prefill_wait for r in reqs) / len(reqs) if reqs else 0.0
    result["transferred_bytes"] = sim.transferred_bytes
    result["idle_fraction"] = sim.idle_fraction(end)
    result["failures"] = {**sim.failures, "reservations_held_at_end": sim.reserved_at_end()}
    result["decisions"] = dict(sorted(sim.decisions.items()))
    result["config"] = {**sim.config.__dict__, "model": sim.model.to_dict()}
    if any(r.images for r in reqs):
        # EPD: image requests and text requests apart (an image request's TTFT includes its tower)
        epd: dict[str, Any] = {"image_requests": sum(1 for r in reqs if r.images),
                               "images": sum(r.images for r in reqs)}
        for name, want in (("image_ttft", True), ("text_ttft", False)):
            epd.update(latency_stats(name, [(r.first_token - r.arrival) / 1000.0 for r in ok  # type: ignore[operator]
                                            if bool(r.images) == want], percentiles))
        result["epd"] = epd
    return result


def queue_series(sim: Simulator) -> dict[str, list[tuple[float, int]]]:
    """Each stage's count sampled every `sample_interval_ms` (for plots and --save-detailed)."""
    return {name: c.samples for name, c in sim.stage.items()}
