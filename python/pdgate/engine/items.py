"""A generation item: one prompt, one choice, with its PD fields (the unit the engine runs)."""

from __future__ import annotations

from dataclasses import dataclass, field

from .sampling import BadRequest, SamplingParams

FAKE_BOOTSTRAP_HOST = "2.2.2.2"  # SGLang's reserved host: health checks, no transfer


@dataclass
class GenItem:
    rid: str
    input_ids: list[int]
    params: SamplingParams
    return_logprob: bool = False
    top_logprobs_num: int = 0
    input_logprobs: bool = True  # with return_logprob: the prompt's too (native); OpenAI: outputs only
    bootstrap_host: str | None = None
    bootstrap_port: int | None = None
    bootstrap_room: int | None = None
    kv_transfer_params: dict | None = None
    images: list = field(default_factory=list)   # multimodal.ImageItem, in prompt order
    encode_items: dict | None = None             # EPD: item index -> encode_bootstrap_info item

    @property
    def has_bootstrap(self) -> bool:
        return self.bootstrap_room is not None and self.bootstrap_host is not None


def pick(value, i: int, n: int, name: str, step_room: bool = False):
    """The i-th of n items' value of a bootstrap field: lists index, scalars broadcast.

    A scalar room R for a batch of N gives R+i to item i (SGLang's rule)."""
    if isinstance(value, list):
        if len(value) != n:
            raise BadRequest(f"{name} has {len(value)} entries for {n} items", name)
        return value[i]
    if step_room and value is not None:
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise BadRequest(f"{name} must be a non-negative integer", name)
        return value + i
    return value


def bootstrap_fields(body: dict, i: int, n: int) -> dict:
    host = pick(body.get("bootstrap_host"), i, n, "bootstrap_host")
    port = pick(body.get("bootstrap_port"), i, n, "bootstrap_port")
    room = pick(body.get("bootstrap_room"), i, n, "bootstrap_room", step_room=True)
    if host is not None and not isinstance(host, str):
        raise BadRequest("bootstrap_host must be a string", "bootstrap_host")
    if port is not None and (not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536):
        raise BadRequest("bootstrap_port must be a port number or null", "bootstrap_port")
    if room is not None and (not isinstance(room, int) or isinstance(room, bool) or room < 0):
        raise BadRequest("bootstrap_room must be a non-negative integer", "bootstrap_room")
    return {"bootstrap_host": host, "bootstrap_port": port, "bootstrap_room": room}


def kv_params(body: dict, n: int) -> dict | None:
    p = body.get("kv_transfer_params")
    if p is None:
        return None
    if not isinstance(p, dict):
        raise BadRequest("kv_transfer_params must be an object", "kv_transfer_params")
    if n != 1 and (p.get("do_remote_decode") or p.get("do_remote_prefill")):
        raise BadRequest("kv_transfer_params supports a single prompt and n=1", "kv_transfer_params")
    return p


def ec_params(body: dict) -> dict | None:
    """vLLM's `ec_transfer_params` (the encoder's answer, relayed by the proxy): checked for its
    type and otherwise unused, since the shared-storage connector finds files by hash alone."""
    p = body.get("ec_transfer_params")
    if p is not None and not isinstance(p, dict):
        raise BadRequest("ec_transfer_params must be an object or null", "ec_transfer_params")
    return p


def item_rid(rid: str | None, base: str, i: int, n: int) -> str:
    """The i-th of n items' request id. A client's `rid` names a single item as is and a batch's
    items `{rid}_{i}` (SGLang's rule), so `/abort_request` with the rid, a prefix of each,
    aborts them all. Without one the engine mints `{base}-{i}`."""
    if rid is not None:
        return rid if n == 1 else f"{rid}_{i}"
    return base if n == 1 else f"{base}-{i}"
