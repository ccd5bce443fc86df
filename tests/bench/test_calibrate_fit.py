"""`pdgate bench --calibrate`'s fitting on recorded samples: known lines come back, outliers of a
loaded machine do not move the fit, slopes never go negative, the transfer comes out of the
engines' per-transfer reports (and of the difference of two TTFT tables without them), the
shared cores out of a decode stream's slowdown, and the written file is one `pdgate simulate`
reads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdgate.bench.calibrate_fit import (
    MAX_LINK_GIB_PER_S,
    fit_engine_transfer,
    fit_line,
    fit_transfer,
    handoff_overhead_ms,
    kv_bytes_per_token,
    service_model_fields,
    shared_cores_estimate,
)
from pdgate.simulate.model import GIB, ServiceModel

# Samples as `--calibrate` records them, (x, ms): three repeats per size, one of them hit by
# another process's burst (the machine is shared), as happens on a loaded host.
PREFILL = [(16, 20.56), (16, 20.60), (16, 95.0),
           (256, 28.96), (256, 29.10), (256, 28.96),
           (1024, 55.84), (1024, 240.0), (1024, 55.84),
           (2048, 91.68), (2048, 91.68), (2048, 91.70)]
LOCAL_MEDIANS = {16: 20.60, 256: 28.96, 1024: 55.84, 2048: 91.68}


def test_line_through_per_size_medians_ignores_one_sided_outliers() -> None:
    fit = fit_line(PREFILL)
    assert fit.intercept == pytest.approx(20.0, abs=0.05)
    assert fit.slope == pytest.approx(0.035, abs=1e-4)
    assert [p[0] for p in fit.points] == [16, 256, 1024, 2048]
    assert [p[2] for p in fit.points] == [3, 3, 3, 3]
    assert fit.max_rel_error < 0.01
    assert fit.at(6000) == pytest.approx(230.0, abs=0.5)


def test_negative_slope_is_clamped_to_a_flat_line() -> None:
    fit = fit_line([(1, 10.0), (2, 9.0), (4, 8.0)])
    assert fit.slope == 0.0
    assert fit.intercept == 9.0


def test_negative_intercept_is_clamped_and_the_slope_refit() -> None:
    # y = -5 + 2x would fit exactly; the clamp keeps the intercept at 0, slope by least squares.
    samples = [(10, 15.0), (20, 35.0), (30, 55.0)]
    fit = fit_line(samples, relative=False)
    assert fit.intercept == 0.0
    assert fit.slope == pytest.approx((10 * 15 + 20 * 35 + 30 * 55) / (100 + 400 + 900))
    assert fit_line(samples, min_intercept=None, relative=False).intercept == pytest.approx(-5.0)
    assert fit_line(samples, min_intercept=None).intercept == pytest.approx(-5.0)  # exact either way


def test_relative_fit_keeps_short_prompts_right_on_a_superlinear_engine() -> None:
    # Recorded on the reference engine (`small`, one regular worker, idle TTFT medians, ms): the
    # prefill grows faster than linearly. An absolute fit runs through the long prompts and puts
    # the fixed cost at 0 (the 17-token prompt predicted at half its time); the relative fit
    # keeps every point within 25 %.
    recorded = [(17, 36.9), (129, 103.9), (257, 249.3), (513, 463.8), (1025, 1161.3)]
    absolute = fit_line(recorded, relative=False)
    relative = fit_line(recorded)
    assert absolute.intercept == 0.0 and absolute.max_rel_error > 0.4
    assert relative.intercept > 10.0
    assert relative.max_rel_error < 0.25


def test_one_size_gives_a_flat_line_and_no_samples_is_an_error() -> None:
    fit = fit_line([(4, 3.0), (4, 5.0), (4, 4.0)])
    assert (fit.intercept, fit.slope) == (4.0, 0.0)
    with pytest.raises(ValueError):
        fit_line([])


def test_kv_bytes_per_token() -> None:
    # small preset: 8 layers x K,V x 4 KV heads x 64 dims x 4 bytes = 16 KiB per token.
    assert kv_bytes_per_token(16384 * 3000, 3000) == 16384
    with pytest.raises(ValueError):
        kv_bytes_per_token(0, 100)
    with pytest.raises(ValueError):
        kv_bytes_per_token(1000, 0)


def test_transfer_is_the_difference_of_pd_and_colocated_ttft() -> None:
    # PD TTFT = the colocated median at the same length (not the prefill fit) + link + one step.
    bpt, step = 320 * 1024, 45.0
    link = lambda tokens: 12.0 + tokens * bpt / (22 * GIB) * 1000.0  # noqa: E731
    pd = [(n, LOCAL_MEDIANS[n] + link(n) + step) for n in LOCAL_MEDIANS for _ in range(2)]
    setup, gib, fit = fit_transfer(pd, PREFILL, step, bpt)
    assert setup == pytest.approx(12.0, abs=1e-6)
    assert gib == pytest.approx(22.0, rel=1e-6)
    assert fit.max_rel_error < 1e-9


def test_transfer_needs_shared_prompt_lengths() -> None:
    with pytest.raises(ValueError, match="share no prompt length"):
        fit_transfer([(100, 50.0)], [(200, 40.0)], 1.0, 16384)


def test_unresolvable_transfer_gets_the_bandwidth_cap() -> None:
    pd = [(n, LOCAL_MEDIANS[n] + 5.0) for n in LOCAL_MEDIANS]  # no growth with bytes
    setup, gib, _ = fit_transfer(pd, PREFILL, 3.0, 16384)
    assert setup == pytest.approx(2.0)
    assert gib == MAX_LINK_GIB_PER_S


def test_fields_make_a_service_model_that_simulate_reads(tmp_path: Path) -> None:
    prefill = fit_line(PREFILL)
    decode = fit_line([(1, 6.0), (2, 6.5), (4, 7.5), (8, 9.5)])
    fields = service_model_fields(prefill, decode, kv_bpt=16384, link_setup_ms=3.0, link_gib_per_s=0.5,
                                  prefill_chunk_tokens=512, max_batch=256)
    model = ServiceModel(**fields)
    assert model.decode_step(4) == pytest.approx(7.5)
    assert model.send_chunk_tokens == 0 and model.prefill_chunk_tokens == 512
    path = tmp_path / "service_model.json"
    path.write_text(json.dumps({**fields, "calibration": {"samples": {"pd_ttft_ms": [[16, 25.0]]}}}))
    loaded = ServiceModel.from_json(str(path))
    assert loaded == model
    with pytest.raises(ValueError, match="unknown service-model fields"):
        path.write_text(json.dumps({**fields, "prefil_a_ms": 1.0}))
        ServiceModel.from_json(str(path))


def test_a_flat_decode_fit_of_zero_keeps_a_valid_model() -> None:
    decode = fit_line([(1, 0.0), (2, 0.0)])
    fields = service_model_fields(fit_line(PREFILL), decode, kv_bpt=1, link_setup_ms=-1.0, link_gib_per_s=1.0,
                                  prefill_chunk_tokens=0, max_batch=1)
    assert fields["decode_step_ms"] == 0.1 and fields["link_setup_ms"] == 0.0
    ServiceModel(**fields)


def test_decode_gaps_count_only_while_the_whole_batch_runs() -> None:
    from pdgate.bench.calibrate import _full_batch_gaps
    from pdgate.bench.client import RequestOutput

    # A starts at 0 (first token at 0.1 s, gaps of 10 ms, ends at 0.205); B starts at 0.053 (first
    # token at 0.153: its prefill waited behind A's), gaps of 20 ms, ends at 0.253. Both decode
    # in (0.153, 0.205]: A's gaps ending at 0.16 ... 0.20 and B's ending at 0.173 and 0.193.
    a = RequestOutput(True, 10, 11, 0.1, [0.01] * 10, 0.205, 0.0, 200)
    b = RequestOutput(True, 10, 6, 0.1, [0.02] * 5, 0.2, 0.053, 200)
    gaps = _full_batch_gaps([a, b])
    assert sorted(round(g, 6) for g in gaps) == [10.0] * 5 + [20.0] * 2


def test_prefill_fit_takes_the_quadratic_share_of_a_superlinear_engine() -> None:
    from pdgate.bench.calibrate_fit import fit_prefill

    # Recorded at load 17 (idle TTFT medians, ms): the line is 32 % under the longest prompt.
    recorded = [(17, 151.9), (129, 385.0), (257, 742.6), (513, 1632.1), (1025, 4405.4)]
    line, curve = fit_line(recorded), fit_prefill(recorded)
    assert line.max_rel_error > 0.3
    assert curve.curvature > 0 and curve.intercept >= 0 and curve.slope >= 0
    assert curve.max_rel_error < 0.2
    assert curve.at(1025) == pytest.approx(4405.4, rel=0.2)
    # A straight line stays a line (no curvature invented), and two sizes are too few for one.
    assert fit_prefill(PREFILL).curvature == pytest.approx(0.0, abs=1e-6)
    assert fit_prefill([(16, 20.0), (1024, 60.0)]).curvature == 0.0


def test_chunked_prefill_adds_up_to_the_whole_prompt() -> None:
    model = ServiceModel(prefill_a_ms=10.0, prefill_b_ms=0.5, prefill_c_ms=0.001)
    chunks = [model.prefill_chunk_ms(start, 256) for start in range(0, 1024, 256)]
    assert sum(chunks) == pytest.approx(model.prefill_ms(1024))
    assert chunks == sorted(chunks)   # later chunks attend to more tokens


# Engine-reported transfers as `--calibrate` records them, (bytes, ms) per PD request: the same
# prompt length moves the same page-rounded bytes; truth 4 ms + bytes at 0.08 GiB/s, one repeat
# per size hit by a burst.
_TRUE_GIB = 0.08


def _ms(nbytes: float) -> float:
    return 4.0 + nbytes / (_TRUE_GIB * GIB) * 1000.0


ENGINE_TRANSFERS = [(b, _ms(b) * k) for b in (272_272.0, 2_178_176.0, 4_356_352.0, 17_425_408.0)
                    for k in (1.0, 1.0, 3.0)]


def test_engine_reported_transfers_give_setup_and_bandwidth() -> None:
    setup, gib, fit = fit_engine_transfer(ENGINE_TRANSFERS)
    assert setup == pytest.approx(4.0, abs=1e-6)
    assert gib == pytest.approx(_TRUE_GIB, rel=1e-6)
    assert [p[2] for p in fit.points] == [3, 3, 3, 3]
    with pytest.raises(ValueError, match="no per-transfer"):
        fit_engine_transfer([])


def test_handoff_overhead_is_the_median_over_paired_samples() -> None:
    # PD = colocated + one 50 ms step + the transfer + 30 ms of hand-off, one pair hit by a burst
    # on the PD side and one on the colocated side; the pairs are taken back to back.
    bpt = 17_017.0
    local = [(float(n), 100.0 + n) for n in (16, 256, 1024) for _ in range(3)]
    pd = [(x, y + 50.0 + _ms(x * bpt) + 30.0) for x, y in local]
    pd[1] = (pd[1][0], pd[1][1] + 900.0)
    local[5] = (local[5][0], local[5][1] + 700.0)
    overhead, diffs = handoff_overhead_ms(pd, local, 50.0, lambda tokens: _ms(tokens * bpt))
    assert overhead == pytest.approx(30.0)
    assert len(diffs) == 9 and max(diffs) == pytest.approx(930.0) and min(diffs) == pytest.approx(-670.0)
    # A PD path faster than colocated + step + transfer (noise) is no negative overhead.
    assert handoff_overhead_ms(local, local, 50.0, lambda tokens: 0.0)[0] == 0.0
    with pytest.raises(ValueError, match="paired"):
        handoff_overhead_ms(pd[:1], [(99.0, 1.0)], 50.0, lambda tokens: 0.0)


def test_shared_cores_from_a_decode_stream_beside_a_busy_prefill() -> None:
    # Alone the stream's steps take 70 ms (one slow outlier); beside a computing prefill 140 ms:
    # two busy workers run at half speed, so they share one core.
    alone = [70.0, 70.0, 71.0, 69.0, 400.0]
    beside = [140.0, 139.0, 141.0, 140.0]
    cores, slowdown = shared_cores_estimate(alone, beside)
    assert slowdown == pytest.approx(2.0) and cores == pytest.approx(1.0)
    # 1.6x slower: 2 / 1.6 = 1.25 cores between the two.
    assert shared_cores_estimate(alone, [112.0])[0] == pytest.approx(1.25)
    # Not slower (noise): not shared, the simulator's default.
    assert shared_cores_estimate(alone, [65.0]) == (0.0, pytest.approx(65 / 70))
    with pytest.raises(ValueError, match="no decode gaps"):
        shared_cores_estimate(alone, [])
