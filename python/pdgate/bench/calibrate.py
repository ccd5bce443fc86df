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
- the transfer: from the engines' own reports. The decode workers' `/v1/loads`
  `disaggregation.kv_transfer_totals` (count, bytes, seconds of whole transfers received) are
  read before and after each PD request of the TTFT table (one request at a time, so the change
  is that request's transfer); setup + bytes / bandwidth is fitted over those (bytes, ms)
  (calibrate_fit.fit_engine_transfer). What the client waits for beyond it (the gateway's second
  leg, the hand-shake, the pick-up) is the median of TTFT(PD) − TTFT(colocated) − one decode
  step − the transfer over the paired samples (calibrate_fit.handoff_overhead_ms), added to the
  setup: the simulator's TTFT adds setup + bytes / bandwidth as the exposed hand-off. Engines
  that report no transfers fall back to the difference alone (calibrate_fit.fit_transfer).

- EPD, when the gateway has encode workers (`--epd-disaggregation`): the vision tower's time per
  image, the median time of `POST /encode {"mm_items": [one new image]}` on the first encode
  worker (no room: it only encodes), each image a new random `--image-size` PNG so no cache
  answers; recorded as `encode_image_ms` (it includes the call's HTTP and the PNG's decoding,
  which an encode leg pays too).

- shared cores (a CPU host's workers slow each other down; GPUs do not): one decode stream's
  inter-token gaps alone, then while long prompts keep the prefill worker computing beside it;
  their slowdown gives the cores the two effectively share (calibrate_fit.shared_cores_estimate),
  recorded in the `calibration` block as `shared_cores` for `pdgate simulate --shared-cores`.

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

from .calibrate_fit import (LinearFit, fit_engine_transfer, fit_line, fit_prefill, fit_transfer, handoff_overhead_ms,
                            kv_bytes_per_token, service_model_fields, shared_cores_estimate)
from .client import RequestOutput, RequestSpec, send_request
from .dataset import SampleRequest, random_text, with_images

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
    contention_prompt_len: int = 1024    # the long prompts that keep the prefill worker busy; 0: skip
    endpoint: str = "/v1/completions"
    timeout_s: float = 120.0
    seed: int = 0
    admin_api_key: str | None = None     # GET /workers is an admin endpoint
    image_size: int = 32                 # EPD: the calibration images' side in pixels
    log: Any = print
    notes: list[str] = field(default_factory=list)


def _spec(base_url: str, plan: CalibrationPlan) -> RequestSpec:
    return RequestSpec(url=base_url.rstrip("/") + plan.endpoint, model=plan.model,
                       chat=plan.endpoint.endswith("chat/completions"), stream=True, ignore_eos=True)


def _check(outputs: Sequence[RequestOutput], what: str) -> None:
    failed = [o.error for o in outputs if not o.success]
    if failed:
        raise ValueError(f"calibration {what}: {len(failed)} of {len(outputs)} requests failed, e.g. {failed[0]}")


@dataclass
class TtftTables:
    samples: list[list[tuple[float, float]]]   # per path: (prompt tokens, TTFT ms)
    tokens: list[int]                          # per path: prompt tokens sent
    transfers: list[tuple[float, float]]       # PD path: (bytes, ms) per engine-reported transfer
    unreported: int = 0                        # PD requests with no single transfer reported


async def _ttft_tables(client: httpx.AsyncClient, urls: Sequence[str], plan: CalibrationPlan,
                       rng: np.random.Generator, decodes: Sequence[str]) -> TtftTables:
    """(prompt tokens, TTFT ms) on each idle path (urls[0] the PD gateway), one request at a
    time; fresh random text each time so no prefix cache helps. The paths take turns at each
    length, so on a machine whose load changes by the minute their difference compares like
    with like. Around each PD request the decode workers' transfer totals are read: their
    change is that request's transfer as the engine timed it."""
    specs = [_spec(url, plan) for url in urls]
    tables = TtftTables([[] for _ in urls], [0 for _ in urls], [])
    totals = await _transfer_totals(client, decodes)
    for _ in range(plan.repeats):
        for n in plan.prompt_lens:
            for i, (url, spec) in enumerate(zip(urls, specs)):
                out = await send_request(client, spec, SampleRequest(random_text(n, rng), n, 2), plan.timeout_s)
                _check([out], f"TTFT at {n} tokens via {url}")
                tables.samples[i].append((float(out.prompt_len), out.ttft * 1000.0))
                tables.tokens[i] += out.prompt_len
                if i == 0:
                    after = await _transfer_totals(client, decodes)
                    count, nbytes, seconds = (a - b for a, b in zip(after, totals))
                    totals = after
                    if count == 1 and nbytes > 0:
                        tables.transfers.append((nbytes, seconds * 1000.0))
                    else:  # an engine that does not report, or a transfer still being counted
                        tables.unreported += 1
    return tables


async def _transfer_totals(client: httpx.AsyncClient, decodes: Sequence[str]) -> tuple[float, float, float]:
    """(transfers, bytes, seconds) received so far, summed over the decode workers' reports
    (`/v1/loads` `disaggregation.kv_transfer_totals`); zeros where an engine has none."""
    count = nbytes = seconds = 0.0
    for url in decodes:
        resp = await client.get(url.rstrip("/") + "/v1/loads")
        if resp.status_code != 200:
            continue
        for load in resp.json().get("loads") or []:
            t = (load.get("disaggregation") or {}).get("kv_transfer_totals") or {}
            count += float(t.get("count") or 0)
            nbytes += float(t.get("bytes") or 0)
            seconds += float(t.get("seconds") or 0)
    return count, nbytes, seconds


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


async def _contention_table(client: httpx.AsyncClient, plan: CalibrationPlan, rng: np.random.Generator,
                            prefill_ms: Any) -> tuple[list[float], list[float]]:
    """Decode gaps (ms) of one stream alone, and while the prefill worker computes long prompts
    beside it: per repeat, a stream alone, then the same stream with long prompts sent one after
    another through the PD gateway. A contended gap is one that ends inside a long prompt's
    prefill, taken as [sent + 10 %, sent + its idle prefill time `prefill_ms(tokens)`] so that
    neither its hand-off nor its own decode is in it."""
    spec = _spec(plan.base_url, plan)
    n, out_len = plan.contention_prompt_len, max(plan.decode_output_len, 32)
    alone: list[float] = []
    contended: list[float] = []
    for _ in range(plan.repeats):
        stream = SampleRequest(random_text(plan.decode_prompt_len, rng), plan.decode_prompt_len, out_len)
        out = await send_request(client, spec, stream, plan.timeout_s)
        _check([out], "a decode stream alone")
        alone.extend(g * 1000.0 for g in out.itl)
        task = asyncio.ensure_future(send_request(client, spec, SampleRequest(
            random_text(plan.decode_prompt_len, rng), plan.decode_prompt_len, out_len), plan.timeout_s))
        windows = []
        while not task.done():
            long = SampleRequest(random_text(n, rng), n, 1)
            sent = time.perf_counter()
            res = await send_request(client, spec, long, plan.timeout_s)
            _check([res], f"a {n}-token prompt beside a decode stream")
            busy = prefill_ms(res.prompt_len) / 1000.0
            windows.append((sent + 0.1 * busy, sent + busy))
        out = await task
        _check([out], "a decode stream beside long prompts")
        t = out.start_time + out.ttft
        for g in out.itl:
            t += g
            if any(a < t <= b for a, b in windows):
                contended.append(g * 1000.0)
    return alone, contended


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


async def _encode_ms(client: httpx.AsyncClient, encoder: str, plan: CalibrationPlan) -> list[float]:
    """EPD: the time of `POST /encode` with one new image, `repeats` + 2 times (the first is a
    warm-up and dropped)."""
    times = []
    for i in range(plan.repeats + 3):
        url = with_images([SampleRequest("", 0, 1)], 1.0, 1, plan.image_size, plan.seed * 1000 + i)[0].images[0]
        t = time.perf_counter()
        resp = await client.post(encoder.rstrip("/") + "/encode", json={"req_id": f"calibrate-{i}", "mm_items": [url]})
        if resp.status_code != 200 or any(it.get("cached") for it in resp.json().get("items") or []):
            raise ValueError(f"calibration: {encoder}/encode answered {resp.status_code}: {resp.text[:200]}")
        times.append((time.perf_counter() - t) * 1000.0)
    return times[1:]


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
        encoders = [w["url"] for w in pd_workers if w.get("worker_type") == "encode"]
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
        tables = await _ttft_tables(client, [plan.base_url, *([local] if local else [])], plan, rng, decodes)
        sent = await _kv_bytes_sent(client, prefills) - before
        pd_samples, pd_tokens = tables.samples[0], tables.tokens[0]
        kv_bpt = kv_bytes_per_token(sent, pd_tokens)
        local_samples = tables.samples[1] if local else []
        prefill = fit_prefill(local_samples or pd_samples)
        transfer, engine_transfer, handoff = _fit_transfer(plan, pd_samples, local_samples, tables, decode.at(1),
                                                           kv_bpt)
        setup, gib, transfer_source = handoff.pop("setup_ms"), handoff.pop("gib_per_s"), handoff.pop("source")
        shared: dict[str, Any] = {"cores": None}
        if plan.contention_prompt_len > 0:
            plan.log("calibrate: decode steps beside a busy prefill worker (shared cores) ...")
            alone, contended = await _contention_table(client, plan, rng, prefill.at)
            shared.update(alone_gap_ms=[round(g, 3) for g in alone], contended_gap_ms=[round(g, 3) for g in contended])
            if alone and contended:
                cores, slowdown = shared_cores_estimate(alone, contended)
                shared.update(cores=round(cores, 3), slowdown=round(slowdown, 4))
            else:
                plan.notes.append("no decode gap fell inside a long prefill: shared cores not measured")
        encode_samples: list[float] = []
        if encoders:
            plan.log("calibrate: the vision tower's time per image on an encode worker ...")
            encode_samples = await _encode_ms(client, encoders[0], plan)
        info = await _server_info(client, local_workers or decodes)
        fields = service_model_fields(
            prefill, decode, kv_bpt=kv_bpt, link_setup_ms=setup, link_gib_per_s=gib,
            prefill_chunk_tokens=int(info.get("chunked_prefill_size") or 0) if local else 2048,
            max_batch=int((await _server_info(client, decodes)).get("max_running_requests") or 32))
    if fields["prefill_chunk_tokens"] < 0:  # -1: whole prompts in one step
        fields["prefill_chunk_tokens"] = 0
    if encode_samples:
        fields["encode_image_ms"] = round(float(np.median(encode_samples)), 4)

    def fit(f: LinearFit | None) -> dict[str, Any] | None:
        return f.to_dict() if f is not None else None

    return {**fields, "calibration": {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "base_url": plan.base_url, "colocated_base_url": local, "model": plan.model,
        "prefill_workers": prefills, "decode_workers": decodes, "colocated_workers": local_workers,
        "encode_workers": encoders,
        "kv_bytes_sent": sent, "kv_prompt_tokens": pd_tokens,
        "fits": {"prefill_ms_vs_tokens": fit(prefill), "decode_step_ms_vs_batch": fit(decode),
                 "transfer_ms_vs_bytes": fit(transfer), "engine_transfer_ms_vs_bytes": fit(engine_transfer)},
        "handoff": handoff,
        "shared_cores": shared,
        "samples": {"colocated_ttft_ms": local_samples, "pd_ttft_ms": pd_samples, "decode_itl_ms": decode_samples,
                    "engine_transfer_ms": tables.transfers, "encode_image_ms": encode_samples},
        "sources": {"prefill": "idle TTFT via " + (local or plan.base_url),
                    "decode_step": "median inter-token gap, B concurrent requests via " + plan.base_url,
                    "kv_bytes_per_token": "prefill workers' /v1/loads kv_bytes_sent / prompt tokens",
                    "transfer": transfer_source},
        "notes": plan.notes,
    }}


def _fit_transfer(plan: CalibrationPlan, pd_samples: list[tuple[float, float]],
                  local_samples: list[tuple[float, float]], tables: TtftTables, first_step_ms: float,
                  kv_bpt: float) -> tuple[LinearFit | None, LinearFit | None, dict[str, Any]]:
    """The link: (difference fit, engine-report fit, the hand-off record with setup_ms,
    gib_per_s and source). Engine reports first; the TTFT difference for what they miss."""
    transfer = engine = None
    out: dict[str, Any] = {"unreported_requests": tables.unreported}
    if local_samples:
        _, diff_gib, transfer = fit_transfer(pd_samples, local_samples, first_step_ms, kv_bpt)
        out["difference_gib_per_s"] = round(diff_gib, 6)
    if tables.transfers:
        setup, gib, engine = fit_engine_transfer(tables.transfers)
        out.update(engine_setup_ms=round(setup, 4), gib_per_s=gib)
        if local_samples:
            overhead, diffs = handoff_overhead_ms(pd_samples, local_samples, first_step_ms,
                                                  lambda tokens: engine.at(tokens * kv_bpt))  # type: ignore[union-attr]
            out.update(overhead_ms=round(overhead, 4), overhead_per_pair_ms=[round(d, 3) for d in diffs])
            setup += overhead
            out["source"] = ("decode workers' kv_transfer_totals per PD request (setup + bytes / bandwidth), plus "
                             "the median of TTFT(PD) - TTFT(colocated) - one decode step - that transfer over "
                             "the paired samples as extra setup")
        else:
            out["source"] = ("decode workers' kv_transfer_totals per PD request (no colocated path: "
                             "no hand-off overhead)")
            plan.notes.append("no --colocated-base-url: the prefill fit includes the hand-off")
        out["setup_ms"] = setup
        return transfer, engine, out
    if transfer is None:
        out.update(setup_ms=0.0, gib_per_s=1000.0,
                   source=("not measured (no --colocated-base-url, no engine reports): the prefill fit "
                           "includes the hand-off"))
        plan.notes.append(out["source"])
        return None, None, out
    plan.notes.append("the decode workers reported no per-transfer totals: the transfer is TTFT(PD) - TTFT(colocated) "
                      "- one decode step, noisy on a loaded machine")
    out.update(setup_ms=transfer.intercept, gib_per_s=out["difference_gib_per_s"],
               source="TTFT(PD) - TTFT(colocated) - one decode step, idle, the two paths taking turns at each length")
    if transfer.slope <= 0:
        plan.notes.append("the transfer did not grow with the bytes beyond the noise: link_gib_per_s is the "
                          "cap (1000); on a loaded machine, rerun with more --calibrate-repeats")
    return transfer, None, out


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
