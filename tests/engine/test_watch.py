"""`http_common.watch` under a slow consumer: a sequence that finishes while the consumer is
still writing its previous update (a slow HTTP stream: the write awaits the socket) must be
yielded once more, so its last tokens and its finish reach the client."""

from __future__ import annotations

import asyncio

from pdgate.engine.http_common import watch


class FakeSeq:
    """The part of `Seq` that `watch` reads: `changed`, `finished` (set by `finish`, which
    notifies as `Seq._resolve` does)."""

    def __init__(self) -> None:
        self.changed = asyncio.Event()
        self.output_ids: list[int] = []
        self.finished = False

    def push(self, tok: int) -> None:
        self.output_ids.append(tok)
        self.changed.set()

    def finish(self) -> None:
        self.finished = True
        self.changed.set()


def test_a_sequence_finishing_during_a_slow_write_is_seen_finished() -> None:
    async def run() -> list[tuple[list[int], bool]]:
        seq = FakeSeq()
        seen: list[tuple[list[int], bool]] = []
        seq.push(1)
        async for _ in watch([seq]):
            # What the consumer sends: the state as it reads it now.
            seen.append((list(seq.output_ids), seq.finished))
            if len(seen) == 1:
                # The write of this update is slow; meanwhile the engine ends the sequence.
                seq.push(2)
                seq.finish()
                await asyncio.sleep(0)
        return seen

    seen = asyncio.run(asyncio.wait_for(run(), 5))
    assert seen[-1] == ([1, 2], True), f"the last update was dropped: {seen}"


def test_every_sequence_is_yielded_until_it_was_seen_finished() -> None:
    async def run() -> dict[int, tuple[int, bool]]:
        seqs = [FakeSeq(), FakeSeq()]
        last: dict[int, tuple[int, bool]] = {}
        for s in seqs:
            s.push(0)
        async for i in watch(seqs):
            last[i] = (len(seqs[i].output_ids), seqs[i].finished)
            other = seqs[1 - i]
            if not other.finished and len(other.output_ids) < 3:
                other.push(len(other.output_ids))
                if len(other.output_ids) == 3:
                    other.finish()
            await asyncio.sleep(0)
            if not seqs[i].finished and len(seqs[i].output_ids) >= 3:
                seqs[i].finish()
        return last

    last = asyncio.run(asyncio.wait_for(run(), 5))
    assert last == {0: (3, True), 1: (3, True)}, last
