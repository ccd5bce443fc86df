"""Drive one load level: send each request at its offset, at most `max_concurrency` in flight,
with a progress bar, and return the outputs and the measured duration."""

from __future__ import annotations

import asyncio
import time
from typing import Sequence

import httpx

from .client import RequestOutput, RequestSpec, send_request
from .dataset import SampleRequest

__all__ = ["run_level"]


def _progress(total: int, enabled: bool, desc: str):  # type: ignore[no-untyped-def]
    from tqdm import tqdm

    return tqdm(total=total, disable=not enabled, desc=desc, unit="req", leave=False)


async def run_level(spec: RequestSpec, requests: Sequence[SampleRequest], offsets: Sequence[float], *,
                    max_concurrency: int | None, timeout_s: float, progress: bool = True,
                    desc: str = "") -> tuple[list[RequestOutput], float]:
    """Offsets are seconds after the level's start. Every request has its own deadline
    (`timeout_s`), so the level ends by the last offset + timeout at the latest."""
    if len(offsets) != len(requests):
        raise ValueError("one offset per request")
    limit = max_concurrency or max(1, len(requests))
    semaphore = asyncio.Semaphore(limit)
    limits = httpx.Limits(max_connections=limit, max_keepalive_connections=limit)
    bar = _progress(len(requests), progress, desc)

    async with httpx.AsyncClient(limits=limits, timeout=timeout_s) as client:
        async def one(req: SampleRequest) -> RequestOutput:
            async with semaphore:
                out = await send_request(client, spec, req, timeout_s)
            bar.update(1)
            return out

        start = time.perf_counter()
        tasks = []
        for req, offset in zip(requests, offsets):
            delay = start + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(req)))
        outputs = list(await asyncio.gather(*tasks))
        duration = time.perf_counter() - start
    bar.close()
    return outputs, duration
