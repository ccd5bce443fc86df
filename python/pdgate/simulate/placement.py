"""Where one request runs: the decision as a pluggable pure function.

`Decide` is `(PlacementView, ServiceModel) -> Decision`. The simulator calls whatever it is
given. The default, `conditional`, is this package's cost comparison; issue 13 puts the gateway's
real decision in pdgate-core as a pure function with the model state passed in. When that lands,
a wrapper that converts the view to its input and calls it through the bindings is passed here
instead (`pdgate simulate --decision module:function`), so there is one decision, not two.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable

from .model import ServiceModel

__all__ = ["COLOCATED", "DISAGGREGATED", "Decide", "Decision", "PlacementView", "always_colocated",
           "always_disaggregated", "conditional", "load_decision", "predicted_local_ttft_ms",
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


def _stall_tpot_ms(v: PlacementView, m: ServiceModel) -> float:
    """Predicted TPOT of the running decodes on the local target if this prefill runs there.
    The prefill (and the local work queued before it) delays each of them once. In steady state
    each of the n running decodes also shares its lifetime with about n such arrivals, so the
    delay is counted n times over an output of this request's length."""
    stall = (v.local_wait_ms + m.prefill_ms(v.prompt_tokens)) * max(1, v.local_batch)
    return m.decode_step(v.local_batch) + stall / max(v.output_tokens, 1)


def conditional(v: PlacementView, m: ServiceModel) -> Decision:
    remote = predicted_remote_ttft_ms(v, m)
    local = predicted_local_ttft_ms(v, m)
    if v.local_batch > 0 and _stall_tpot_ms(v, m) > v.slo_tpot_ms:
        return Decision(DISAGGREGATED, "local_stall_breaks_tpot")
    if remote < local:
        reason = "remote_ttft_lower" if remote <= v.slo_ttft_ms else "both_miss_ttft_remote_lower"
        return Decision(DISAGGREGATED, reason)
    reason = "local_ttft_lower" if local <= v.slo_ttft_ms else "both_miss_ttft_local_lower"
    return Decision(COLOCATED, reason)


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
