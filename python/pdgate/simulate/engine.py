"""The discrete-event loop and the request's path through the pools.

Placements, with the same number of workers in each (`prefill_workers + decode_workers`):
- colocated: every worker is a step worker with chunked prefill;
- disaggregated: prefill workers, then a KV transfer, then decode workers;
- conditional: prefill and decode workers as disaggregated, and per request the decision sends it
  remote, or runs its prefill on a decode worker (chunked, like vLLM's kv_both).

EPD (`encode_workers` > 0): a request's images first go to the encode workers (each image to
the one with the least work queued), and the request is placed when the last is encoded;
without encode workers the worker that prefills runs the tower first (`tower_ms`).

A failed transfer (injected at `transfer_failure_rate`) releases its decode reservation at once,
then the failure policy retries on a fresh pair (up to `max_retries`), recomputes on the decode
worker, or fails the request.

Shared cores (`shared_cores` N > 0, off by default): the workers' compute shares N cores by
processor sharing, each busy worker running at min(1, N / busy workers) of its calibrated
speed, as reference-engine processes on one CPU host do (on GPUs, one per worker, this term
does not exist). All busy workers then progress at the same rate, so their work is scheduled in
*virtual time* V, with dV/dt = that rate: a worker's step or prefill of w ms ends when V has
advanced by w, whatever the busy count does meanwhile. Arrivals and KV transfers (the link, not
the cores) stay in real time; first-token stamps, set in V when a step is planned, are mapped
back to real time at the end of the run.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from .model import ServiceModel
from .placement import COLOCATED, DISAGGREGATED, Decide, PlacementView, conditional
from .stats import SimRequest, StageCounter
from .workers import EncodeWorker, PrefillWorker, StepWorker

__all__ = ["FAILURE_POLICIES", "PLACEMENTS", "SimConfig", "Simulator", "ItlHistogram"]

PLACEMENTS = ("colocated", "disaggregated", "conditional")
FAILURE_POLICIES = ("retry", "recompute", "fail")
STAGES = ("encode_queue", "prefill_queue", "prefill_running", "transfer", "decode_queue", "decode_running")


@dataclass(frozen=True)
class SimConfig:
    placement: str = "disaggregated"
    prefill_workers: int = 1
    decode_workers: int = 2
    slo_ttft_ms: float = 1000.0
    slo_tpot_ms: float = 50.0
    transfer_failure_rate: float = 0.0
    failure_policy: str = "retry"
    max_retries: int = 2
    sample_interval_ms: float = 1000.0
    seed: int = 0
    shared_cores: float = 0.0   # processor sharing between busy workers over N cores; 0: off
    encode_workers: int = 0     # EPD: workers that run the vision tower (0: the prefilling worker does)


class ItlHistogram:
    """Inter-token gaps as (gap → count): a run has too many gaps to keep one by one."""

    def __init__(self) -> None:
        self.counts: dict[float, int] = {}

    def add(self, gap_ms: float, count: int) -> None:
        if count > 0:
            key = round(gap_ms, 6)
            self.counts[key] = self.counts.get(key, 0) + count


class Simulator:
    def __init__(self, model: ServiceModel, config: SimConfig, decide: Decide = conditional):
        if config.placement not in PLACEMENTS:
            raise ValueError(f"unknown placement {config.placement!r}")
        if config.failure_policy not in FAILURE_POLICIES:
            raise ValueError(f"unknown failure policy {config.failure_policy!r}")
        self.model, self.config, self.decide = model, config, decide
        self.rng = np.random.default_rng(config.seed)
        self.events: list[tuple[float, int, Callable[..., None], Any]] = []
        self.seq = 0
        self.now = 0.0
        self.stage = {name: StageCounter(name) for name in STAGES}
        self.itl = ItlHistogram()
        self.requests: list[SimRequest] = []
        self.decisions: dict[str, int] = {}
        self.transferred_bytes = 0.0
        self.failures = {"transfer_failures": 0, "retries": 0, "recomputed": 0, "failed": 0}
        total = config.prefill_workers + config.decode_workers
        if config.placement == "colocated":
            self.prefill: list[PrefillWorker] = []
            self.decode = [StepWorker(self, i, "colocated") for i in range(total)]
        else:
            if config.prefill_workers < 1 or config.decode_workers < 1:
                raise ValueError("disaggregated placements need at least one prefill and one decode worker")
            self.prefill = [PrefillWorker(self, i) for i in range(config.prefill_workers)]
            self.decode = [StepWorker(self, i, "decode") for i in range(config.decode_workers)]
        if config.encode_workers < 0:
            raise ValueError(f"encode_workers must not be negative, got {config.encode_workers}")
        self.encode = [EncodeWorker(self, i) for i in range(config.encode_workers)]
        self.typical_output = 1
        if config.shared_cores < 0:
            raise ValueError(f"shared_cores must not be negative, got {config.shared_cores}")
        self.shared = config.shared_cores > 0
        self.vnow = 0.0        # virtual time (equal to `now` when cores are not shared)
        self.work: list[tuple[float, int, Callable[..., None], Any]] = []  # worker events, in virtual time
        self.busy = 0          # workers computing now
        self.speed = 1.0       # dV/dt
        self.vmap: list[tuple[float, float]] = [(0.0, 0.0)]  # (t, V) wherever the speed changed

    def schedule(self, t: float, fn: Callable[..., None], arg: Any) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, fn, arg))

    def schedule_work(self, v: float, fn: Callable[..., None], arg: Any) -> None:
        """A worker's event at virtual time `v` (real time when cores are not shared)."""
        if not self.shared:
            self.schedule(v, fn, arg)
            return
        self.seq += 1
        heapq.heappush(self.work, (v, self.seq, fn, arg))

    def set_busy(self, delta: int) -> None:
        """A worker started (+1) or stopped (-1) computing: the shared cores' rate changes."""
        self.busy += delta
        if not self.shared:
            return
        speed = min(1.0, self.config.shared_cores / self.busy) if self.busy > 0 else 1.0
        if speed != self.speed:
            self.vmap.append((self.now, self.vnow))
            self.speed = speed

    def real_time(self, v: float) -> float:
        """The real time at which virtual time reached `v` (after the run, or up to now)."""
        ts, vs = zip(*self.vmap, (self.now, self.vnow))
        return float(np.interp(v, vs, ts))

    def _next(self) -> tuple[float, float, Callable[..., None], Any]:
        """Pop the earliest event, real or virtual: (t, V, fn, arg)."""
        events, work = self.events, self.work
        if work:
            tw = self.now + (work[0][0] - self.vnow) / self.speed
            if not events or tw < events[0][0]:
                v, _, fn, arg = heapq.heappop(work)
                return tw, v, fn, arg
        t, _, fn, arg = heapq.heappop(events)
        return t, self.vnow + (t - self.now) * self.speed, fn, arg

    def run(self, arrivals_ms: Sequence[float], prompts: Sequence[int], outputs: Sequence[int],
            images: Sequence[int] | None = None) -> None:
        self.typical_output = max(1, int(np.median(outputs))) if len(outputs) else 1
        for rid, (t, p, o) in enumerate(zip(arrivals_ms, prompts, outputs)):
            req = SimRequest(rid, float(t), int(p), int(o))
            req.images = int(images[rid]) if images is not None else 0
            if not self.encode:
                req.tower_ms = req.images * self.model.encode_image_ms
            self.requests.append(req)
            self.schedule(req.arrival, self.on_arrival, req)
        next_sample = 0.0
        interval = self.config.sample_interval_ms
        events, work, shared = self.events, self.work, self.shared
        while events or work:
            if shared:
                t, v, fn, arg = self._next()
            else:
                t, _, fn, arg = heapq.heappop(events)
                v = t
            while next_sample <= t:
                for counter in self.stage.values():
                    counter.samples.append((next_sample, counter.value))
                next_sample += interval
            self.now, self.vnow = t, v
            fn(t, arg)
        if shared:  # first tokens were stamped in virtual time
            stamped = [r for r in self.requests if r.first_token is not None]
            ts, vs = zip(*self.vmap, (self.now, self.vnow))
            real = np.interp([r.first_token for r in stamped], vs, ts)
            for r, ft in zip(stamped, real):
                r.first_token = float(ft)

    # The request's path.
    def on_arrival(self, t: float, req: SimRequest) -> None:
        if req.images and self.encode:
            req.encode_pending = req.images
            for _ in range(req.images):
                min(self.encode, key=lambda w: w.queued_ms).submit(t, req)
            return
        self._place(t, req)

    def on_image_encoded(self, t: float, req: SimRequest) -> None:
        req.encode_pending -= 1
        if req.encode_pending == 0:
            self._place(t, req)

    def _place(self, t: float, req: SimRequest) -> None:
        if self.config.placement == "colocated":
            self._local(t, req, "placement_colocated")
            return
        if self.config.placement == "disaggregated":
            self._remote(t, req, "placement_disaggregated")
            return
        p = min(self.prefill, key=lambda w: w.queued_ms)
        d = min(self.decode, key=lambda w: w.decode_load())
        local = min(self.decode, key=lambda w: (w.local_ms, len(w.running)))
        view = PlacementView(req.prompt, req.output, p.queued_ms, d.decode_wait_ms(self.typical_output),
                             len(d.running), local.local_ms, len(local.running),
                             self.config.slo_ttft_ms, self.config.slo_tpot_ms)
        decision = self.decide(view, self.model)
        if decision.placement == COLOCATED:
            self._local(t, req, decision.reason, local)
        elif decision.placement == DISAGGREGATED:
            self._remote(t, req, decision.reason)
        else:
            raise ValueError(f"the decision returned an unknown placement {decision.placement!r}")

    def _count(self, placement: str, reason: str) -> None:
        key = f"{placement}:{reason}"
        self.decisions[key] = self.decisions.get(key, 0) + 1

    def _local(self, t: float, req: SimRequest, reason: str, worker: StepWorker | None = None) -> None:
        req.placement, req.reason = COLOCATED, reason
        self._count(COLOCATED, reason)
        target = worker or min(self.decode, key=lambda w: (w.local_ms, w.decode_load()))
        target.add_prefill(t, req)

    def _remote(self, t: float, req: SimRequest, reason: str) -> None:
        req.placement, req.reason = DISAGGREGATED, reason
        self._count(DISAGGREGATED, reason)
        self._dispatch_pair(t, req)

    def _dispatch_pair(self, t: float, req: SimRequest) -> None:
        # Both legs are chosen at once; the decode reserves room for the KV before it moves.
        p = min(self.prefill, key=lambda w: w.queued_ms)
        d = min(self.decode, key=lambda w: w.decode_load())
        d.reserved += 1
        req.decode = d
        req.attempts += 1
        req.remaining = req.output
        p.submit(t, req)

    def on_prefill_done(self, t: float, arg: tuple[PrefillWorker, SimRequest]) -> None:
        worker, req = arg
        worker.prefill_done(t, req)
        self.stage["transfer"].add(t, 1)

    def on_transfer_done(self, t: float, req: SimRequest) -> None:
        self.stage["transfer"].add(t, -1)
        self.transferred_bytes += self.model.kv_bytes(req.prompt)
        d: StepWorker = req.decode
        d.reserved -= 1           # released on success and on failure alike
        req.decode = None
        if self.config.transfer_failure_rate and self.rng.random() < self.config.transfer_failure_rate:
            self._transfer_failed(t, req, d)
            return
        d.add_decode(t, req)

    def _transfer_failed(self, t: float, req: SimRequest, d: StepWorker) -> None:
        self.failures["transfer_failures"] += 1
        policy = self.config.failure_policy
        if policy == "retry" and req.attempts <= self.config.max_retries:
            self.failures["retries"] += 1
            self._dispatch_pair(t, req)
        elif policy == "recompute":
            self.failures["recomputed"] += 1
            d.add_prefill(t, req)
        else:
            self.failures["failed"] += 1
            req.failed = True
            req.finish = t

    def finish(self, t: float, req: SimRequest) -> None:
        req.finish = t

    def reserved_at_end(self) -> int:
        return sum(w.reserved for w in self.decode)

    def idle_fraction(self, end_ms: float) -> dict[str, float]:
        """Idle capacity per pool: prefill workers by time not prefilling; step workers by decode
        slots left empty (a step worker with one sequence is busy, but has 31 slots to give)."""
        out = {}
        if self.encode and end_ms > 0:
            out["encode"] = 1.0 - sum(w.busy_ms for w in self.encode) / (len(self.encode) * end_ms)
        if self.prefill and end_ms > 0:
            out["prefill"] = 1.0 - sum(w.busy_ms for w in self.prefill) / (len(self.prefill) * end_ms)
        if self.decode and end_ms > 0:
            slots = len(self.decode) * self.model.max_batch
            out[f"{self.decode[0].pool}_slots"] = 1.0 - self.stage["decode_running"].mean(end_ms) / slots
            out[f"{self.decode[0].pool}_time"] = 1.0 - sum(w.busy_ms for w in self.decode) / (len(self.decode) * end_ms)
        return out
