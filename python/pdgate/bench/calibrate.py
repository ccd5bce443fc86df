"""`pdgate bench --calibrate`: measure an engine's service-time tables through pdgate and write
the service-time file `pdgate simulate --service-model` reads.

What is measured, every request through the gateway(s), one at a time unless said otherwise:

- prefill time against prompt tokens: the idle TTFT of a colocated path (`--colocated-base-url`,
  a gateway over regular workers of the same engine), whose first token is the prefill's last
  step; fitted as a + b·tokens. Without a colocated gateway the PD gateway's TTFT is used, and the
  fitted prefill then holds the transfer too (said in the file);
- the decode step against the batch: B requests at once through the PD gateway (`--base-url`),
  the median inter-token gap at each B; fitted as base + per_seq·B;
- KV bytes per token: what the prefill workers (found by the gateway's `GET /workers`) report in
  `/v1/loads` (`disaggregation.kv_bytes_sent`), over the prompt tokens sent through them;
- the transfer: by difference, TTFT(PD) − prefill − one decode step at each prompt length on the
  idle pipeline, fitted as setup + bytes / bandwidth (calibrate_fit.fit_transfer). This is the
  *exposed* hand-off as the client sees it (second leg, transfer, pick-up), which is what the
  simulator's TTFT adds; the engines' own per-transfer seconds are not read yet.

The file holds the `ServiceModel` fields plus a `calibration` block (samples, fits, sources).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Sequence

import httpx
import numpy as np

from .calibrate_fit import LinearFit, fit_line, fit_prefill, fit_transfer, kv_bytes_per_token, service_model_fields
from .client import RequestOutput, RequestSpec, send_request
from .dataset import SampleRequest, random_text

__all__ = ["CalibrationPlan", "calibrate"]


@dataclass
class CalibrationPlan:
    base_url: str                        # the PD gateway
    model: str
    colocated_base_url: str | None = None
    prompt_lens: Sequence[int] = (16, 256, 512, 1024, 2048)
    batch_sizes: Sequence[int] = (1, 2, 4, 8, 16)
    repeats: int = 3
    decode_prompt_len: int = 64
    decode_output_len: int = 64
    endpoint: str = "/v1/completions"
    timeout_s: float = 120.0
    seed: int = 0
    admin_api_key: str | None = None     # GET /workers is an admin endpoint
    log: Any = print
    notes: list[str] = field(default_factory=list)


def _spec(base_url: str, plan: CalibrationPlan) -> RequestSpec:
    return RequestSpec(url=base_url.rstrip("/") + plan.endpoint, model=plan.model,
                       chat=plan.endpoint.endswith("chat/completions"), stream=True, ignore_eos=True)


def _check(outputs: Sequence[RequestOutput], what: str) -> None:
    failed = [o.error for o in outputs if not o.success]
    if failed:
        raise ValueError(f"calibration {what}: {len(failed)} of {len(outputs)} requests failed, e.g. {failed[0]}")


async def _ttft_tables(client: httpx.AsyncClient, urls: Sequence[str], plan: CalibrationPlan,
                       rng: np.random.Generator) -> tuple[list[list[tuple[float, float]]], list[int]]:
    """(prompt tokens, TTFT ms) on each idle path, one request at a time; fresh random text each
    time so no prefix cache helps. The paths take turns at each length, so on a machine whose
    load changes by the minute their difference (the transfer) compares like with like.
    Returns the samples and the prompt tokens sent, per path."""
    specs = [_spec(url, plan) for url in urls]
    samples: list[list[tuple[float, float]]] = [[] for _ in urls]
    tokens = [0 for _ in urls]
    for _ in range(plan.repeats):
        for n in plan.prompt_lens:
            for i, (url, spec) in enumerate(zip(urls, specs)):
                out = await send_request(client, spec, SampleRequest(random_text(n, rng), n, 2), plan.timeout_s)
                _check([out], f"TTFT at {n} tokens via {url}")
                samples[i].append((float(out.prompt_len), out.ttft * 1000.0))
                tokens[i] += out.prompt_len
    return samples, tokens


async def _decode_table(client: httpx.AsyncClient, plan: CalibrationPlan,
                        rng: np.random.Generator) -> list[tuple[float, float]]:
    """(batch, inter-token gap ms): B requests sent together, `repeats` times; only the gaps that
    end while all B are decoding count (after the last one's first token, before the first one
    finishes), so neither a prefill nor a smaller batch is in them."""
    spec = _spec(plan.base_url, plan)
    samples: list[tuple[float, float]] = []
    for _ in range(plan.repeats):
        for batch in plan.batch_sizes:
            reqs = [SampleRequest(random_text(plan.decode_prompt_len, rng), plan.decode_prompt_len,
                                  plan.decode_output_len) for _ in range(batch)]
            outs = await asyncio.gather(*(send_request(client, spec, r, plan.timeout_s) for r in reqs))
            _check(outs, f"decode steps at batch {batch}")
            samples.extend((float(batch), gap) for gap in _full_batch_gaps(outs))
    if not {b for b, _ in samples} >= set(map(float, plan.batch_sizes)):
        plan.notes.append("some batch sizes never ran full (prefills slower than the decodes): "
                          "raise --calibrate-decode-output-len")
    return samples


def _full_batch_gaps(outs: Sequence[RequestOutput]) -> list[float]:
    """Gaps (ms) whose end lies between the last first token and the first finish."""
    first = max(o.start_time + o.ttft for o in outs)
    end = min(o.start_time + o.latency for o in outs)
    gaps = []
    for o in outs:
        t = o.start_time + o.ttft
        for g in o.itl:
            t += g
            if first < t <= end:
                gaps.append(g * 1000.0)
    return gaps


async def _workers(client: httpx.AsyncClient, base_url: str, key: str | None) -> list[dict[str, Any]]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    resp = await client.get(base_url.rstrip("/") + "/workers", headers=headers)
    if resp.status_code in (401, 403):
        raise ValueError(f"{base_url}/workers answered {resp.status_code}: calibration lists the gateway's workers "
                         "through its admin API; pass --admin-api-key (or set PDGATE_ADMIN_API_KEY)")
    resp.raise_for_status()
    return list(resp.json().get("workers") or [])


async def _kv_bytes_sent(client: httpx.AsyncClient, prefills: Sequence[str]) -> float:
    total = 0.0
    for url in prefills:
        resp = await client.get(url.rstrip("/") + "/v1/loads")
        resp.raise_for_status()
        for load in resp.json().get("loads") or []:
            total += float((load.get("disaggregation") or {}).get("kv_bytes_sent") or 0)
    return total


async def _server_info(client: httpx.AsyncClient, urls: Sequence[str]) -> dict[str, Any]:
    for url in urls:
        try:
            resp = await client.get(url.rstrip("/") + "/server_info")
            if resp.status_code == 200:
                return dict(resp.json())
        except httpx.HTTPError:
            continue
    return {}


async def _run(plan: CalibrationPlan) -> dict[str, Any]:
    rng = np.random.default_rng(plan.seed)
    async with httpx.AsyncClient(timeout=plan.timeout_s) as client:
        pd_workers = await _workers(client, plan.base_url, plan.admin_api_key)
        prefills = [w["url"] for w in pd_workers if w.get("worker_type") == "prefill"]
        decodes = [w["url"] for w in pd_workers if w.get("worker_type") == "decode"]
        if not prefills or not decodes:
            raise ValueError(f"{plan.base_url} is not a PD gateway (GET /workers lists no prefill or no decode)")
        local = plan.colocated_base_url
        local_workers = [w["url"] for w in await _workers(client, local, plan.admin_api_key)] if local else []
        # Warm-up: the first requests pay connection set-up and the engines' first-call costs.
        warm = SampleRequest(random_text(64, rng), 64, 4)
        for url in filter(None, (plan.base_url, local)):
            for _ in range(2):
                _check([await send_request(client, _spec(url, plan), warm, plan.timeout_s)], f"warm-up via {url}")

        plan.log("calibrate: decode step against batch size ...")
        decode_samples = await _decode_table(client, plan, rng)
        decode = fit_line(decode_samples)
        plan.log("calibrate: TTFT against prompt tokens through the gateway(s) ...")
        before = await _kv_bytes_sent(client, prefills)
        tables, sent_tokens = await _ttft_tables(client, [plan.base_url, *([local] if local else [])], plan, rng)
        sent = await _kv_bytes_sent(client, prefills) - before
        pd_samples, pd_tokens = tables[0], sent_tokens[0]
        kv_bpt = kv_bytes_per_token(sent, pd_tokens)
        if local:
            local_samples = tables[1]
            prefill = fit_prefill(local_samples)
            setup, gib, transfer = fit_transfer(pd_samples, local_samples, decode.at(1), kv_bpt)
            transfer_source = ("TTFT(PD) - TTFT(colocated) - one decode step, idle, the two paths taking turns "
                               "at each prompt length")
        else:
            local_samples, transfer = [], None
            prefill = fit_prefill(pd_samples)
            setup, gib = 0.0, 1000.0
            transfer_source = "not measured (no --colocated-base-url): the prefill fit includes the hand-off"
            plan.notes.append(transfer_source)
        if transfer is not None and transfer.slope <= 0:
            plan.notes.append("the transfer did not grow with the bytes beyond the noise: link_gib_per_s is the "
                              "cap (1000); on a loaded machine, rerun with more --calibrate-repeats")
        info = await _server_info(client, local_workers or decodes)
        fields = service_model_fields(
            prefill, decode, kv_bpt=kv_bpt, link_setup_ms=setup, link_gib_per_s=gib,
            prefill_chunk_tokens=int(info.get("chunked_prefill_size") or 0) if local else 2048,
            max_batch=int((await _server_info(client, decodes)).get("max_running_requests") or 32))
    if fields["prefill_chunk_tokens"] < 0:  # -1: whole prompts in one step
        fields["prefill_chunk_tokens"] = 0

    def fit(f: LinearFit | None) -> dict[str, Any] | None:
        return f.to_dict() if f is not None else None

    return {**fields, "calibration": {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "base_url": plan.base_url, "colocated_base_url": local, "model": plan.model,
        "prefill_workers": prefills, "decode_workers": decodes, "colocated_workers": local_workers,
        "kv_bytes_sent": sent, "kv_prompt_tokens": pd_tokens,
        "fits": {"prefill_ms_vs_tokens": fit(prefill), "decode_step_ms_vs_batch": fit(decode),
                 "transfer_ms_vs_bytes": fit(transfer)},
        "samples": {"colocated_ttft_ms": local_samples, "pd_ttft_ms": pd_samples, "decode_itl_ms": decode_samples},
        "sources": {"prefill": "idle TTFT via " + (local or plan.base_url),
                    "decode_step": "median inter-token gap, B concurrent requests via " + plan.base_url,
                    "kv_bytes_per_token": "prefill workers' /v1/loads kv_bytes_sent / prompt tokens",
                    "transfer": transfer_source},
        "notes": plan.notes,
    }}


def calibrate(plan: CalibrationPlan, out_path: str) -> dict[str, Any]:
    """Measure, fit, write `out_path` (the service-time file) and return its contents."""
    started = time.perf_counter()
    try:
        data = asyncio.run(_run(plan))
    except httpx.HTTPError as exc:  # a gateway or worker API that did not answer as expected
        raise ValueError(f"calibration: {type(exc).__name__}: {exc}") from None
    data["calibration"]["wall_seconds"] = round(time.perf_counter() - started, 1)
    with open(out_path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2)
    return data
