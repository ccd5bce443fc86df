"""Continuous batching.

Each step runs, in one forward pass: prefill chunks for waiting sequences up to the token
budget (`--chunked-prefill-size`), plus one new token for every decoding sequence. New
sequences join and finished ones leave between steps. The numpy work runs on one worker thread
so the event loop keeps serving HTTP and moving KV while a step computes.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from .kv import KVPool
from .model import Model, Segment
from .sampling import log_softmax, sample, top_logprobs
from .sequence import EngineError, Seq

log = logging.getLogger("pdgate.engine")


class Scheduler:
    def __init__(self, model: Model, pool: KVPool, tokenizer, chunk_size: int | None,
                 max_running: int = 256, hold_at: int = 0):
        self.model, self.pool, self.tok = model, pool, tokenizer
        self.chunk = chunk_size if chunk_size and chunk_size > 0 else 1 << 30
        self.max_running = max_running
        # Fault injection only (`--fault-*-after-tokens N`): a sequence is not decoded past N
        # output tokens, so the fault, which fires once a request's N-th token is out, always
        # comes mid-answer. Without it the engine could run ahead of a slow stream and finish
        # the answer before the fault's check ran. 0: off.
        self.hold_at = hold_at
        self.prefilling: deque[Seq] = deque()
        self.running: list[Seq] = []
        self.wake = asyncio.Event()
        self.exec = ThreadPoolExecutor(1, thread_name_prefix="forward")
        self.on_step = None  # metrics hook: (num_prefill_tokens, num_decode, seconds)
        self.tokens_prefilled = 0
        self.tokens_decoded = 0

    # ---- entry points ------------------------------------------------------------------
    def add(self, seq: Seq) -> None:
        """Hand a sequence with its pages to the scheduler. It computes tokens[computed:], then
        decodes; the pages are freed when it finishes, except for prefill-only sequences, whose
        pages pass to the transfer (see `Seq.prefill_only`)."""
        if seq.computed < len(seq.tokens) - (1 if seq.output_ids else 0):
            self.prefilling.append(seq)
        else:
            self.running.append(seq)
        self.wake.set()

    def abort(self, seq: Seq, err: EngineError) -> None:
        seq.aborted = True
        seq.fail(err)
        self.wake.set()

    @property
    def num_waiting(self) -> int:
        return len(self.prefilling)

    @property
    def waiting_prompt_tokens(self) -> int:
        """Prompt tokens still to prefill (SGLang's `num_waiting_uncached_tokens`)."""
        return sum(max(0, len(s.tokens) - s.computed) for s in self.prefilling)

    # ---- the loop ----------------------------------------------------------------------
    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            self._drop_aborted()
            if not self.prefilling and not self.running:
                self.wake.clear()
                await self.wake.wait()
                continue
            plan = self._plan()
            if not plan:  # every sequence held (hold_at): nothing to do until one is aborted
                self.wake.clear()
                await self.wake.wait()
                continue
            t0 = loop.time()
            try:
                logits = await loop.run_in_executor(self.exec, self.model.forward, self.pool,
                                                    [s for _, s in plan])
            except Exception as e:  # a bug must fail its requests, not stop the engine
                log.exception("forward failed")
                for seq, _ in plan:
                    self._release(seq)
                    seq.fail(EngineError(f"forward failed: {e}"))
                self.prefilling = deque(s for s in self.prefilling if not s.finished)
                self.running = [s for s in self.running if not s.finished]
                continue
            n_pre = sum(len(s.tokens) for seq, s in plan if seq not in self.running)
            for (seq, seg), lg in zip(plan, logits):
                self._apply(seq, seg, lg)
            if self.on_step:
                self.on_step(n_pre, len(plan), loop.time() - t0)
            await asyncio.sleep(0)

    def _plan(self) -> list[tuple[Seq, Segment]]:
        plan, budget = [], self.chunk
        for seq in self.running:
            if self.hold_at and len(seq.output_ids) >= self.hold_at:
                continue
            plan.append((seq, Segment(seq.pages, len(seq.tokens) - 1, [seq.tokens[-1]])))
        moved = []
        for seq in self.prefilling:
            if budget <= 0 or len(self.running) + len(moved) >= self.max_running:
                break
            n = min(len(seq.tokens) - seq.computed, budget)
            budget -= n
            plan.append((seq, Segment(seq.pages, seq.computed, seq.tokens[seq.computed:seq.computed + n],
                                      all_logits=seq.wants_input_logprobs and seq.computed < seq.prompt_len,
                                      embeds=seq.mm_slice(seq.computed, n))))
            if seq.computed + n == len(seq.tokens):
                moved.append(seq)
        return plan

    def _apply(self, seq: Seq, seg: Segment, logits: np.ndarray) -> None:
        was_prefill = seq in self.prefilling
        seq.computed = seg.start + len(seg.tokens)
        self._commit(seq)
        if was_prefill:
            self.tokens_prefilled += len(seg.tokens)
            self._input_logprobs(seq, seg, logits)
            if seq.computed < len(seq.tokens):
                return  # more chunks to go
            self.prefilling.remove(seq)
        else:
            self.tokens_decoded += 1
        if seq.aborted or seq.finished:
            self._finish(seq)
            return
        if seq.params.max_new_tokens == 0 and not seq.prefill_only:
            seq.finish({"type": "length", "length": 0})
            self._finish(seq)
            return
        tok, lp, full = sample(logits[-1], seq.params, len(seq.output_ids))
        seq.push_token(tok, lp, top_logprobs(full, seq.top_logprobs_num))
        if seq.prefill_only:
            self._finish(seq)
            if not seq.prefilled.done():
                seq.prefilled.set_result(None)
            return
        reason = self.stop_reason(seq)
        if reason is not None:
            seq.finish(reason)
            self._finish(seq)
        else:
            if was_prefill:
                self.running.append(seq)
            seq.notify()

    def _input_logprobs(self, seq: Seq, seg: Segment, logits: np.ndarray) -> None:
        if not seg.all_logits:
            return
        lp = log_softmax(logits)
        for row, p in enumerate(range(seg.start, seg.start + len(seg.tokens))):
            if p + 1 < seq.prompt_len:
                nxt = seq.tokens[p + 1]
                seq.input_logprobs.append(float(lp[row, nxt]))
                seq.input_top.append(top_logprobs(lp[row], seq.top_logprobs_num))

    def stop_reason(self, seq: Seq) -> dict | None:
        p, tok = seq.params, seq.output_ids[-1]
        if tok in self.tok.eos_ids and not p.ignore_eos:
            return {"type": "stop", "matched": tok}
        if tok in p.stop_token_ids:
            return {"type": "stop", "matched": tok}
        if p.stop:
            text = self.tok.decode(seq.output_ids[-64:])
            for s in p.stop:
                if s and s in text:
                    return {"type": "stop", "matched": s}
        if len(seq.output_ids) >= p.max_new_tokens:
            return {"type": "length", "length": p.max_new_tokens}
        if len(seq.tokens) >= self.model.cfg.max_position or len(seq.tokens) >= len(seq.pages) * self.pool.page_size:
            return {"type": "length", "length": len(seq.output_ids)}
        return None

    def _commit(self, seq: Seq) -> None:
        n = self.pool.pages_for(seq.computed)
        if n > seq.committed:
            self.pool.commit(seq.pages[seq.committed:n])
            seq.committed = n
        if self.pool.cache is not None and not seq.images:  # the cache names pages by token ids only
            self.pool.cache.fill(seq.tokens, seq.pages, seq.block_digests, seq.computed)

    def _finish(self, seq: Seq) -> None:
        if seq in self.running:
            self.running.remove(seq)
        if not seq.prefill_only or seq.aborted or seq.error:
            self._release(seq)

    def owns(self, seq: Seq) -> bool:
        return seq in self.running or seq in self.prefilling

    def _release(self, seq: Seq) -> None:
        if seq.pages:
            self.pool.free(seq.pages, seq)
            seq.pages = []

    def _drop_aborted(self) -> None:
        for seq in [s for s in self.prefilling if s.aborted]:
            self.prefilling.remove(seq)
            self._release(seq)
        for seq in [s for s in self.running if s.aborted]:
            self.running.remove(seq)
            self._release(seq)
