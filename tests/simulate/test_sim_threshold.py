"""The conditional split threshold: monotone in the load on each path."""

from __future__ import annotations

from dataclasses import replace

from pdgate.simulate import ServiceModel, split_threshold

MODEL = replace(ServiceModel(), decode_step_per_seq_ms=0.5)


def _non_decreasing(values: list[int | None]) -> bool:
    big = [float("inf") if v is None else v for v in values]
    return all(a <= b for a, b in zip(big, big[1:]))


def test_threshold_grows_with_prefill_load() -> None:
    # More queued prefill work makes the remote path slower: the split moves to longer prompts.
    values = [split_threshold(MODEL, prefill_wait_ms=w, local_batch=2, step=64) for w in range(0, 1001, 100)]
    assert _non_decreasing(values)
    assert values[0] is not None and values[-1] is not None and values[0] < values[-1]


def test_threshold_shrinks_with_decode_load() -> None:
    # More running decodes on the colocated target make a local prefill cost more (longer fused
    # steps, more sequences stalled): the split moves to shorter prompts.
    values = [split_threshold(MODEL, prefill_wait_ms=300.0, local_batch=b, step=64) for b in (1, 4, 8, 16, 32)]
    assert _non_decreasing(values[::-1])
    assert values[0] is not None and values[-1] is not None and values[-1] < values[0]


def test_idle_colocated_target_keeps_every_prompt_local() -> None:
    # No running decodes: nothing to stall and no transfer, so remote never pays.
    assert split_threshold(MODEL, local_batch=0, step=256) is None
