"""Per-transfer poll states, as SGLang numbers them, and a table of live and recent transfers."""

from __future__ import annotations

import enum
import time
from collections import OrderedDict


class KVPoll(enum.IntEnum):
    Failed = 0
    Bootstrapping = 1
    WaitingForInput = 2
    Transferring = 3
    Success = 4


_RECENT = 1024


class TransferTable:
    """Current state of each transfer, keyed by (protocol, key, attempt).

    Failed and Success are terminal: a late update from an attempt that already ended is
    ignored, so a duplicate completion can never resurrect a room.
    """

    def __init__(self) -> None:
        self._rows: OrderedDict[tuple, dict] = OrderedDict()
        self.totals = {"Failed": 0, "Success": 0}

    def set(self, key: tuple, state: KVPoll, **info) -> bool:
        row = self._rows.get(key)
        if row is not None and row["state"] in (KVPoll.Failed, KVPoll.Success):
            return False
        if row is None:
            row = self._rows[key] = {"state": state, "since": time.time()}
            while len(self._rows) > _RECENT:
                self._rows.popitem(last=False)
        row["state"] = state
        row.update(info)
        if state in (KVPoll.Failed, KVPoll.Success):
            self.totals[state.name] += 1
        return True

    def get(self, key: tuple) -> KVPoll | None:
        row = self._rows.get(key)
        return None if row is None else row["state"]

    def live_counts(self) -> dict[str, int]:
        counts = {s.name: 0 for s in KVPoll if s not in (KVPoll.Failed, KVPoll.Success)}
        for row in self._rows.values():
            if row["state"] not in (KVPoll.Failed, KVPoll.Success):
                counts[row["state"].name] += 1
        return counts

    def snapshot(self) -> list[dict]:
        out = []
        for (proto, key, attempt), row in self._rows.items():
            item = {"protocol": proto, "key": key, "attempt": attempt}
            item.update({k: (v.name if isinstance(v, KVPoll) else v) for k, v in row.items()})
            out.append(item)
        return out
