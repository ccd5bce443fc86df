"""One generation: its tokens, pages, outputs and how it finished.

A sequence has one owner of its pages at a time: the PD orchestration while KV is in flight,
the scheduler while it computes, the transfer again while a prefill's pages are pinned.
"""

from __future__ import annotations

import asyncio
import time

from .sampling import SamplingParams


class EngineError(Exception):
    """A request failed inside the engine (transfer, peer, timeout). `status` is the HTTP one."""

    def __init__(self, message: str, status: int = 500, code: str = "engine_error", param: str | None = None):
        super().__init__(message)
        self.status = status
        self.code = code
        self.param = param  # the request field at fault, when one is (an image's encode_bootstrap_info item)


class Seq:
    def __init__(self, rid: str, prompt_ids: list[int], params: SamplingParams, *,
                 return_logprob: bool = False, top_logprobs_num: int = 0,
                 prefill_only: bool = False, input_logprobs: bool = True):
        self.rid = rid
        self.tokens = list(prompt_ids)
        self.prompt_len = len(prompt_ids)
        self.params = params
        self.return_logprob = return_logprob
        self.top_logprobs_num = top_logprobs_num
        self.prefill_only = prefill_only
        self.wants_input_logprobs = return_logprob and input_logprobs  # every prompt position's
        self.pages: list[int] = []
        self.committed = 0            # pages known to hold KV
        self.block_digests: list[bytes] = []  # prefix-cache digests of its full pages so far
        self.computed = 0             # tokens whose KV is in the pages
        self.output_ids: list[int] = []
        self.output_logprobs: list[float] = []
        self.output_top: list[list[tuple[float, int]]] = []
        self.input_logprobs: list[float | None] = [None] if return_logprob else []
        self.input_top: list[list[tuple[float, int]]] = [[]] if return_logprob else []
        self.cached_tokens = 0
        self.finish_reason: dict | None = None
        self.error: EngineError | None = None
        self.aborted = False
        self.kv_transfer_params: dict | None = None
        self.meta_extra: dict = {}
        # Multimodal: the prompt's images (multimodal.ImageItem) and, once a worker that computes
        # the prompt has them, their embeddings as (prompt positions, rows).
        self.images: list = []
        self.encode_items: dict | None = None
        self.mm_rows: tuple | None = None
        self.created = time.monotonic()
        self.changed = asyncio.Event()
        self.done = asyncio.get_running_loop().create_future()
        # prefill-only sequences: set when the first token is sampled; the PD code finishes the
        # sequence itself, after the KV has moved
        self.prefilled = asyncio.get_running_loop().create_future()

    def mm_slice(self, start: int, n: int):
        """The image embeddings of prompt positions [start, start+n): (offsets in the run, rows)."""
        if self.mm_rows is None:
            return None
        pos, rows = self.mm_rows
        sel = (pos >= start) & (pos < start + n)
        return (pos[sel] - start, rows[sel]) if sel.any() else None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None or self.error is not None

    def notify(self) -> None:
        self.changed.set()

    def finish(self, reason: dict) -> None:
        if not self.finished:
            self.finish_reason = reason
            self._resolve()

    def fail(self, err: EngineError) -> None:
        if not self.finished:
            self.error = err
            self._resolve()

    def _resolve(self) -> None:
        if not self.done.done():
            self.done.set_result(None)
        self.notify()

    def push_token(self, tok: int, logprob: float, top: list[tuple[float, int]]) -> None:
        self.tokens.append(tok)
        self.output_ids.append(tok)
        self.output_logprobs.append(logprob)
        self.output_top.append(top)
