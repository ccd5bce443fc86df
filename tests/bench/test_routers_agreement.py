"""`bench/real_vllm/routers.py`'s agreement table (issue 27 item 7): how far apart the two clients'
figures are per router, paired per round and of the medians over rounds. Pure: rows in, table out."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def load_routers():
    spec = importlib.util.spec_from_file_location("routers_bench", ROOT / "bench/real_vllm/routers.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def row(router: str, client: str, rnd: int, ttft: float, itl: float | None) -> dict:
    return {"scenario": "nixl", "router": router, "client": client, "round": rnd, "completed": 10,
            "p50_ttft_ms": ttft, "p99_ttft_ms": 3 * ttft, "p50_itl_ms": itl, "p99_itl_ms": None if itl is None else 2 * itl}


def cells(table: str, router: str) -> list[str]:
    line = next(l for l in table.splitlines() if l.startswith(f"| nixl | {router} |"))
    return [c.strip() for c in line.strip("|").split("|")]


def test_pairs_per_round_and_the_medians_are_told_apart() -> None:
    m = load_routers()
    rows = [
        # TTFT: pdgate's client reads 10 % above vLLM's in round 0 and 5 % below in round 1
        # (per-round median 7.5 %), while the medians over rounds (150 and 150) agree exactly.
        row("pdgate", "vllm", 0, 100.0, 10.0), row("pdgate", "pdgate", 0, 110.0, 10.0),
        row("pdgate", "vllm", 1, 200.0, 20.0), row("pdgate", "pdgate", 1, 190.0, 20.0),
        # A round where one client failed pairs nothing; a missing ITL leaves its cell out.
        row("smg", "vllm", 0, 100.0, None), row("smg", "pdgate", 0, 105.0, None),
        {"scenario": "nixl", "router": "smg", "client": "pdgate", "round": 1, "error": "client failed"},
        row("smg", "vllm", 1, 400.0, None),
    ]
    table = m.agreement(rows)
    pdgate = cells(table, "pdgate")
    assert pdgate[2] == "2", pdgate  # paired rounds
    assert pdgate[3] == "7.5 % / 0.0 %", pdgate  # TTFT p50
    assert pdgate[5] == "0.0 % / 0.0 %", pdgate  # ITL p50: equal in both rounds
    smg = cells(table, "smg")
    assert smg[2] == "1" and smg[3] == "5.0 % / 5.0 %" and smg[5] == "-", smg
