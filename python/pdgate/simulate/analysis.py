"""Closed-form answers from the service-time model: the design's worked example, the
conditional split threshold at a given load, and the P:D ratio for a target rate and SLOs."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

from .model import ServiceModel
from .placement import DISAGGREGATED, Decide, PlacementView, conditional

__all__ = ["WORKED_PROMPT_TOKENS", "WORKED_OUTPUT_TOKENS", "encode_workers", "pd_ratio", "split_threshold",
           "worked_example"]

WORKED_PROMPT_TOKENS = 6000
WORKED_OUTPUT_TOKENS = 400


def split_threshold(model: ServiceModel, *, prefill_wait_ms: float = 0.0, local_batch: int = 0,
                    output_tokens: int = WORKED_OUTPUT_TOKENS, slo_ttft_ms: float = 1000.0,
                    slo_tpot_ms: float = 50.0, max_tokens: int = 131072, step: int = 16,
                    decide: Decide = conditional) -> int | None:
    """The smallest prompt length from which `decide` sends every longer prompt (up to
    `max_tokens`, on a grid of `step` tokens) remote, at the given load: queued prefill work on
    the remote path and running decodes on the local one. None when some prompt at the top of the
    range still stays local. Defined this way (not "the first length that goes remote") it can
    only grow when the remote path gets slower, whatever the shape of the decision."""
    threshold: int | None = None
    for tokens in range(max_tokens - (max_tokens % step or step), 0, -step):
        view = PlacementView(tokens, output_tokens, prefill_wait_ms, 0.0, 0, 0.0, local_batch,
                             slo_ttft_ms, slo_tpot_ms)
        if decide(view, model).placement != DISAGGREGATED:
            break
        threshold = tokens
    return threshold


def pd_ratio(model: ServiceModel, *, prompt_tokens: int, output_tokens: int, slo_ttft_ms: float,
             slo_tpot_ms: float, target_rate: float | None = None) -> dict[str, Any]:
    """Per-worker capacities and the decode:prefill ratio. A prefill worker runs one prompt at a
    time; its usable utilisation is the highest at which the M/D/1 queueing wait still leaves the
    TTFT SLO met. A decode worker holds as many sequences as fit both `max_batch` and the TPOT
    SLO; by Little's law it finishes batch / (output tokens × step) requests per second."""
    service = model.prefill_ms(prompt_tokens)
    budget = slo_ttft_ms - service - model.exposed_transfer_ms(prompt_tokens) - model.decode_step(1)
    # M/D/1: Wq = rho·S / (2(1-rho)) <= budget  <=>  rho <= 2B / (S + 2B).
    rho_max = max(0.0, min(0.95, 2 * budget / (service + 2 * budget))) if budget > 0 else 0.0
    prefill_rps = 1000.0 / service
    batch = max((b for b in range(1, model.max_batch + 1) if model.decode_step(b) <= slo_tpot_ms), default=0)
    decode_rps = batch * 1000.0 / (output_tokens * model.decode_step(batch)) if batch else 0.0
    out: dict[str, Any] = {
        "prompt_tokens": prompt_tokens, "output_tokens": output_tokens,
        "prefill_requests_per_s": prefill_rps, "prefill_max_utilisation": rho_max,
        "decode_batch": batch, "decode_requests_per_s": decode_rps,
        "decodes_per_prefill": prefill_rps / decode_rps if decode_rps else None,
    }
    if target_rate:
        usable = prefill_rps * rho_max
        out["target_rate"] = target_rate
        out["prefill_workers"] = math.ceil(target_rate / usable) if usable else None
        out["decode_workers"] = math.ceil(target_rate / decode_rps) if decode_rps else None
    return out


def encode_workers(model: ServiceModel, *, images_per_s: float, max_utilisation: float = 0.8) -> dict[str, Any]:
    """EPD: encode workers for a rate of images. An encode worker runs one image at a time, so it
    encodes 1000 / encode_image_ms images per second; kept at `max_utilisation` (the queueing
    wait grows without bound near 1), the count is the rate over that. The TTFT an image request
    pays for its images is then about one encode_image_ms plus that wait, off the prefill's time."""
    if model.encode_image_ms <= 0:
        return {"images_per_s": images_per_s, "encode_image_ms": model.encode_image_ms, "encode_workers": 0}
    per_worker = 1000.0 / model.encode_image_ms
    return {"images_per_s": images_per_s, "encode_image_ms": model.encode_image_ms,
            "images_per_s_per_worker": per_worker, "max_utilisation": max_utilisation,
            "encode_workers": math.ceil(images_per_s / (per_worker * max_utilisation)) if images_per_s > 0 else 0}


def worked_example(model: ServiceModel | None = None, decide: Decide = conditional) -> dict[str, Any]:
    """The design's example: one 6,000-token prompt on an idle pipeline, and what follows."""
    m = model or ServiceModel()
    n = WORKED_PROMPT_TOKENS
    prefill = m.prefill_ms(n)
    transfer = m.transfer_ms(n)
    thresholds = [{"prefill_wait_ms": w, "local_batch": b,
                   "split_threshold_tokens": split_threshold(m, prefill_wait_ms=w, local_batch=b, decide=decide)}
                  for b in (0, 1, 16, m.max_batch) for w in (0.0, 200.0)]
    return {
        "prompt_tokens": n,
        "prefill_ms": prefill,
        "transfer_ms": transfer,
        "ttft_ms": prefill + transfer + m.decode_step(1),
        "ttft_chunked_ms": m.chunked_sends_done_ms(n) + m.decode_step(1),
        "kv_bytes": m.kv_bytes(n),
        "split_thresholds": thresholds,
        "pd_ratio": pd_ratio(replace(m), prompt_tokens=n, output_tokens=WORKED_OUTPUT_TOKENS,
                             slo_ttft_ms=1000.0, slo_tpot_ms=50.0),
        "model": m.to_dict(),
    }
