"""Where one request runs: the decision as a pluggable pure function.

`Decide` is `(PlacementView, ServiceModel) -> Decision`. The simulator calls whatever it is
given. The default, `conditional`, is the gateway's own decision: pdgate-core's
`placement::decide`, called through the bindings (`pdgate._core.PlacementModel`), so the
simulator and the gateway share one decision. `--decision module:function` plugs in another
for experiments. The prediction helpers below restate the model's formulas for the
simulator's analysis; `tests/simulate/test_core_decision.py` checks they agree with core's.
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass
from typing import Any, Callable

from .._native import core
from .model import ServiceModel

__all__ = ["COLOCATED", "DISAGGREGATED", "Decide", "Decision", "PlacementView", "always_colocated",
           "always_disaggregated", "conditional", "core_decide", "load_decision", "predicted_local_ttft_ms",
           "predicted_remote_ttft_ms"]

COLOCATED = "colocated"
DISAGGREGATED = "disaggregated"


@dataclass(frozen=True)
class PlacementView:
    """What the decision may look at: the request and the load it would meet on each path."""
    prompt_tokens: int
    output_tokens: int
    prefill_wait_ms: float      # queued prefill work ahead of it on the best prefill worker
    decode_wait_ms: float       # predicted wait for a decode slot on the best decode worker
    remote_decode_batch: int    # running sequences on that decode worker
    local_wait_ms: float        # queued local prefill work on the best colocated target
    local_batch: int            # running decodes there (the ones a local prefill stalls)
    slo_ttft_ms: float
    slo_tpot_ms: float


@dataclass(frozen=True)
class Decision:
    placement: str
    reason: str


Decide = Callable[[PlacementView, ServiceModel], Decision]


def predicted_remote_ttft_ms(v: PlacementView, m: ServiceModel) -> float:
    return (v.prefill_wait_ms + m.prefill_ms(v.prompt_tokens) + m.exposed_transfer_ms(v.prompt_tokens)
            + v.decode_wait_ms + m.decode_step(v.remote_decode_batch + 1))


def predicted_local_ttft_ms(v: PlacementView, m: ServiceModel) -> float:
    # Each prefill chunk rides in one step with the running decodes.
    return (v.local_wait_ms + m.prefill_ms(v.prompt_tokens)
            + m.prefill_chunks(v.prompt_tokens) * m.decode_step(v.local_batch))


@functools.lru_cache(maxsize=16)
def _core_model(m: ServiceModel) -> Any:
    return core().PlacementModel(
        prefill_base_ms=m.prefill_a_ms, prefill_ms_per_token=m.prefill_b_ms, decode_step_ms=m.decode_step_ms,
        decode_step_per_seq_ms=m.decode_step_per_seq_ms, kv_bytes_per_token=m.kv_bytes_per_token,
        link_setup_ms=m.link_setup_ms, link_gib_per_s=m.link_gib_per_s, send_chunk_tokens=m.send_chunk_tokens,
        prefill_chunk_tokens=m.prefill_chunk_tokens)


def core_decide(v: PlacementView, m: ServiceModel, mode: str = "conditional", slack: float = 0.0) -> tuple:
    """pdgate-core's decision: (placement, reason, remote TTFT, local TTFT, local stall TPOT).
    The simulator never rejects (slack 0): a simulated request always runs somewhere."""
    return _core_model(m).decide(
        mode, v.prompt_tokens, v.output_tokens, (v.prefill_wait_ms, v.decode_wait_ms, v.remote_decode_batch),
        (v.local_wait_ms, v.local_batch, 0), v.slo_ttft_ms, v.slo_tpot_ms, slack)


def conditional(v: PlacementView, m: ServiceModel) -> Decision:
    """The gateway's conditional placement (pdgate-core), for one simulated request."""
    placement, reason, *_ = core_decide(v, m)
    return Decision(COLOCATED if placement == COLOCATED else DISAGGREGATED, reason)


def always_colocated(v: PlacementView, m: ServiceModel) -> Decision:
    return Decision(COLOCATED, "placement_colocated")


def always_disaggregated(v: PlacementView, m: ServiceModel) -> Decision:
    return Decision(DISAGGREGATED, "placement_disaggregated")


def load_decision(spec: str) -> Decide:
    """`module:function` → the function (for plugging in another decision)."""
    module, sep, name = spec.partition(":")
    if not sep:
        raise ValueError(f"--decision takes module:function, got {spec!r}")
    fn = getattr(importlib.import_module(module), name, None)
    if not callable(fn):
        raise ValueError(f"--decision {spec}: no callable {name!r} in {module}")
    return fn
