"""Simulated workers. A prefill worker runs one prompt at a time and sends its KV in chunks over
its own link. A step worker (decode, or colocated) runs continuous batching: every step advances
each running sequence by one token; when it has local prefill work, each step also carries one
prefill chunk (chunked prefill), which stalls the running decodes for that step.

A step worker does not simulate steps one by one while its batch is steady: it jumps to the step
at which the next sequence finishes, and is woken at the next step boundary when work arrives.

Workers schedule their own compute in the simulator's virtual time (`sim.vnow`, `schedule_work`),
which is real time unless the simulator shares cores between busy workers (engine.py); they
tell it when they start and stop computing (`set_busy`).
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from typing import TYPE_CHECKING

from .stats import SimRequest

if TYPE_CHECKING:
    from .engine import Simulator

__all__ = ["EncodeWorker", "PrefillWorker", "StepWorker"]


class EncodeWorker:
    """EPD: runs the vision tower one image at a time (as the reference engine's encode worker
    does); a request goes on to placement when its last image is encoded. The embeddings' move
    to the prefill is not modelled (16 x 64 floats per image on the reference engine)."""

    def __init__(self, sim: "Simulator", index: int):
        self.sim, self.index = sim, index
        self.queue: deque[SimRequest] = deque()   # one entry per image
        self.busy = False
        self.queued_ms = 0.0
        self.busy_ms = 0.0

    def submit(self, t: float, req: SimRequest) -> None:
        self.queued_ms += self.sim.model.encode_image_ms
        self.queue.append(req)
        self.sim.stage["encode_queue"].add(t, 1)
        if not self.busy:
            self.busy = True
            self.sim.set_busy(1)
            self._start()

    def _start(self) -> None:
        sim = self.sim
        req = self.queue[0]
        self.busy_ms += sim.model.encode_image_ms
        sim.schedule_work(sim.vnow + sim.model.encode_image_ms, self.done, req)

    def done(self, t: float, req: SimRequest) -> None:
        self.queue.popleft()
        self.queued_ms -= self.sim.model.encode_image_ms
        self.sim.stage["encode_queue"].add(t, -1)
        if self.queue:
            self._start()
        else:
            self.busy = False
            self.sim.set_busy(-1)
        self.sim.on_image_encoded(t, req)


class PrefillWorker:
    def __init__(self, sim: "Simulator", index: int):
        self.sim, self.index = sim, index
        self.queue: deque[SimRequest] = deque()
        self.busy = False
        self.queued_ms = 0.0    # prefill work queued or running here (routing and the decision)
        self.link_free = 0.0
        self.busy_ms = 0.0

    def submit(self, t: float, req: SimRequest) -> None:
        req.queued_at = t
        self.queued_ms += self.sim.model.prefill_ms(req.prompt) + req.tower_ms
        self.queue.append(req)
        self.sim.stage["prefill_queue"].add(t, 1)
        if not self.busy:
            self._start(t)

    def _start(self, t: float) -> None:
        sim = self.sim
        req = self.queue.popleft()
        sim.stage["prefill_queue"].add(t, -1)
        sim.stage["prefill_running"].add(t, 1)
        req.prefill_wait += t - req.queued_at
        if not self.busy:
            self.busy = True
            sim.set_busy(1)
        m = sim.model
        service = m.prefill_ms(req.prompt) + req.tower_ms
        self.busy_ms += service
        sim.schedule_work(sim.vnow + service, sim.on_prefill_done, (self, req))
        if not sim.shared:  # the sends' timing is known now: chunks leave as the prefill makes them
            # the tower (images without encode workers) runs first; the sends follow the prefill
            done = t + req.tower_ms + m.chunked_sends_done_ms(req.prompt, link_free_ms=max(0.0, self.link_free - t - req.tower_ms))
            self.link_free = done
            sim.schedule(done, sim.on_transfer_done, req)

    def prefill_done(self, t: float, req: SimRequest) -> None:
        sim = self.sim
        m = sim.model
        self.queued_ms -= m.prefill_ms(req.prompt) + req.tower_ms
        sim.stage["prefill_running"].add(t, -1)
        if sim.shared:
            # The prefill's end is known only now; the link still exposes what chunked sends
            # do not hide, after any send still on it.
            done = max(t, self.link_free) + m.exposed_transfer_ms(req.prompt)
            self.link_free = done
            sim.schedule(done, sim.on_transfer_done, req)
        if self.queue:
            self._start(t)
        else:
            self.busy = False
            sim.set_busy(-1)


class StepWorker:
    def __init__(self, sim: "Simulator", index: int, pool: str):
        self.sim, self.index, self.pool = sim, index, pool
        self.running: list[tuple[int, int, SimRequest]] = []   # (finish step, rid, request)
        self.waiting: deque[SimRequest] = deque()              # KV ready, no slot yet
        self.prefills: deque[SimRequest] = deque()             # local (chunked) prefills
        self.reserved = 0        # KV reservations of in-flight transfers aimed here
        self.local_ms = 0.0      # local prefill work queued here
        self.steps = 0
        self.seg_t = 0.0         # time of the last step boundary
        self.seg_v = 0.0         # ... in virtual time (engine.py: shared cores)
        self.seg_dt = 0.0        # step length of the current segment
        self.seg_batch = 0
        self.seg_fresh = 0       # sequences whose first token is the segment's first step
        self.chunk: tuple[SimRequest, int] | None = None
        self.version = 0
        self.active = False
        self.busy_ms = 0.0

    # Load seen by routing and the decision.
    def decode_load(self) -> int:
        return len(self.running) + len(self.waiting) + self.reserved

    def decode_wait_ms(self, typical_output: int) -> float:
        over = self.decode_load() + 1 - self.sim.model.max_batch
        if over <= 0:
            return 0.0
        step = self.sim.model.decode_step(self.sim.model.max_batch)
        return over * typical_output * step / self.sim.model.max_batch

    def add_decode(self, t: float, req: SimRequest) -> None:
        self.waiting.append(req)
        self.sim.stage["decode_queue"].add(t, 1)
        self._wake(t)

    def add_prefill(self, t: float, req: SimRequest) -> None:
        req.queued_at = t
        req.left = req.prompt
        self.local_ms += self.sim.model.prefill_ms(req.prompt) + req.tower_ms
        self.prefills.append(req)
        self.sim.stage["prefill_queue"].add(t, 1)
        self._wake(t)

    def _wake(self, t: float) -> None:
        if not self.active:
            self.seg_t, self.seg_v, self.seg_batch, self.seg_fresh, self.seg_dt = t, self.sim.vnow, 0, 0, 0.0
            self.boundary(t, (self.version, self.steps))
        elif self.chunk is None:
            # Mid-segment of plain decode steps: take the new work at the next step boundary.
            v = self.sim.vnow
            k = math.floor((v - self.seg_v) / self.seg_dt) + 1
            if self.running and self.steps + k >= self.running[0][0]:
                return  # the pending boundary comes first; it will admit the new work
            self.version += 1
            self.sim.schedule_work(max(v, self.seg_v + k * self.seg_dt), self.boundary, (self.version, self.steps + k))

    def boundary(self, t: float, token: tuple[int, int]) -> None:
        version, steps = token
        if version != self.version:
            return
        sim = self.sim
        k = steps - self.steps
        if self.active and k > 0:
            # Shared cores stretch steps unevenly within a segment: each gets the mean.
            gap = round((t - self.seg_t) / k, 3) if sim.shared else self.seg_dt
            sim.itl.add(gap, self.seg_batch * k - self.seg_fresh)
            self.busy_ms += t - self.seg_t
        self.steps, self.seg_t, self.seg_v = steps, t, sim.vnow
        if self.chunk is not None:
            self._finish_chunk(t)
        while self.running and self.running[0][0] <= steps:
            _, _, req = heapq.heappop(self.running)
            sim.stage["decode_running"].add(t, -1)
            sim.finish(t, req)
        self._admit(t)
        self._plan(t)

    def _finish_chunk(self, t: float) -> None:
        req, size = self.chunk  # type: ignore[misc]
        self.chunk = None
        req.left -= size
        if req.left > 0:
            return
        self.prefills.popleft()
        self.local_ms -= self.sim.model.prefill_ms(req.prompt) + req.tower_ms
        self.sim.stage["prefill_running"].add(t, -1)
        req.first_token = self.sim.vnow  # the prefill's last chunk yields the first token (virtual time)
        req.remaining = req.output - 1
        if req.remaining <= 0:
            self.sim.finish(t, req)
        else:
            self.add_decode_now(t, req)

    def add_decode_now(self, t: float, req: SimRequest) -> None:
        self.waiting.append(req)
        self.sim.stage["decode_queue"].add(t, 1)

    def _admit(self, t: float) -> None:
        stage = self.sim.stage
        while self.waiting and len(self.running) < self.sim.model.max_batch:
            req = self.waiting.popleft()
            stage["decode_queue"].add(t, -1)
            stage["decode_running"].add(t, 1)
            heapq.heappush(self.running, (self.steps + req.remaining, req.rid, req))

    def _plan(self, t: float) -> None:
        m = self.sim.model
        batch = len(self.running)
        fresh = [r for _, _, r in self.running if r.first_token is None]
        if self.prefills:
            head = self.prefills[0]
            if head.left == head.prompt:
                head.prefill_wait += t - head.queued_at
                self.sim.stage["prefill_queue"].add(t, -1)
                self.sim.stage["prefill_running"].add(t, 1)
            size = min(head.left, m.prefill_chunk_tokens or head.left)
            dt = m.decode_step(batch) + m.prefill_chunk_ms(head.prompt - head.left, size)
            if head.left == head.prompt:
                dt += head.tower_ms  # the images' tower rides with the first chunk
            self.chunk = (head, size)
            k = 1
        elif batch:
            dt = m.decode_step(batch)
            k = self.running[0][0] - self.steps
        else:
            if self.active:
                self.active = False
                self.sim.set_busy(-1)
            return
        v = self.sim.vnow
        for r in fresh:
            r.first_token = v + dt   # virtual time; the simulator maps it back after the run
        if not self.active:
            self.active = True
            self.sim.set_busy(1)
        self.seg_dt, self.seg_batch, self.seg_fresh = dt, batch, len(fresh)
        self.version += 1
        self.sim.schedule_work(v + k * dt, self.boundary, (self.version, self.steps + k))
