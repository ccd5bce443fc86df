"""vLLM's gRPC engine service (`vllm.grpc.engine.VllmEngine`, smg-grpc-proto) over the reference
engine: what `python -m vllm.entrypoints.grpc_server` serves to SMG and pdgate.

The same engine path as the HTTP surfaces: NIXL and Mooncake PD ride in `kv_transfer_params_json`
(the prefill's params come back in `GenerateComplete.kv_transfer_params_json`), and the pairing
keys are GetServerInfo's fields. Streams carry deltas and a Complete per choice, as vLLM's do.
SubscribeKvEvents streams the engine's KV events when it publishes them (`grpc_kv_events.py`).
Not served (UNIMPLEMENTED): Embed, profiling.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid

import grpc
from smg_grpc_proto.generated import common_pb2
from smg_grpc_proto.generated import vllm_engine_pb2 as pb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as pb_grpc

from .grpc_kv_events import feed_of, subscribe
from .grpc_common import (TokenizerBundle, deltas, fault_point, faults_on, finish_reason, flush_cache, health_probe,
                          pairing_keys, status_of)
from .items import GenItem, kv_params
from .sampling import BadRequest, params_from_dict
from .sequence import EngineError, Seq

log = logging.getLogger("pdgate.engine.grpc")
VLLM_DEFAULT_MAX_TOKENS = 16  # vLLM SamplingParams' default
MAX_LOGPROBS = 20


def _logprob_count(sp: pb.SamplingParams, name: str) -> int | None:
    if not sp.HasField(name):
        return None
    k = getattr(sp, name)
    if not 0 <= k <= MAX_LOGPROBS:
        raise BadRequest(f"{name} must be in [0, {MAX_LOGPROBS}]", name)
    return k


def sampling_dict(sp: pb.SamplingParams) -> dict:
    if sp.WhichOneof("constraint"):
        raise BadRequest("constrained decoding is not supported by the reference engine", sp.WhichOneof("constraint"))
    d = {"max_new_tokens": sp.max_tokens if sp.HasField("max_tokens") else VLLM_DEFAULT_MAX_TOKENS,
         "temperature": sp.temperature if sp.HasField("temperature") else 1.0,
         "top_p": sp.top_p or 1.0, "top_k": sp.top_k or -1, "min_p": sp.min_p, "stop": list(sp.stop),
         "stop_token_ids": [int(t) for t in sp.stop_token_ids], "ignore_eos": sp.ignore_eos,
         "skip_special_tokens": sp.skip_special_tokens}
    if sp.HasField("seed"):
        d["seed"] = sp.seed
    return d


def transfer_params(req: pb.GenerateRequest) -> dict | None:
    """kv_transfer_params_json first, the legacy typed field second (smg-grpc-servicer's rule)."""
    if req.HasField("kv_transfer_params_json"):
        try:
            p = json.loads(req.kv_transfer_params_json)
        except json.JSONDecodeError as e:
            raise BadRequest(f"kv_transfer_params_json is not JSON: {e}", "kv_transfer_params_json") from None
        if not isinstance(p, dict):
            raise BadRequest("kv_transfer_params_json must be a JSON object", "kv_transfer_params_json")
        return p
    if req.HasField("kv_transfer_params"):
        t = req.kv_transfer_params
        if not t.remote_host or not 1 <= t.remote_port <= 65535:
            raise BadRequest("kv_transfer_params needs remote_host and a remote_port in [1, 65535]",
                             "kv_transfer_params")
        return {"remote_host": t.remote_host, "remote_port": t.remote_port}
    return None


def generate_items(req: pb.GenerateRequest, tokenizer) -> tuple[list[GenItem], int | None, int | None]:
    """GenItems per choice, and the output / prompt logprob counts asked for."""
    kind = req.WhichOneof("input")
    if kind == "text":
        ids = tokenizer.encode(req.text)
    elif kind == "tokenized":
        ids = [int(t) for t in req.tokenized.input_ids]
    else:
        raise BadRequest("one of tokenized or text is required", "input")
    if req.mm_inputs.ByteSize() or len(req.extra_mm_inputs) or req.media_refs.ByteSize():
        raise BadRequest("multimodal inputs are not supported", "mm_inputs")
    sp = req.sampling_params
    out_k, in_k = _logprob_count(sp, "logprobs"), _logprob_count(sp, "prompt_logprobs")
    n = sp.n or 1
    if not 1 <= n <= 64:
        raise BadRequest("n must be in [1, 64]", "n")
    kvp = kv_params({"kv_transfer_params": transfer_params(req)}, n)
    base = sampling_dict(sp)
    rid = req.request_id or f"grpc-{uuid.uuid4().hex}"
    top = max(out_k or 0, in_k or 0)
    items = []
    for i in range(n):
        d = dict(base)
        if i and isinstance(d.get("seed"), int):
            d["seed"] += i
        items.append(GenItem(rid=rid if n == 1 else f"{rid}-{i}", input_ids=ids, params=params_from_dict(d),
                             return_logprob=out_k is not None or in_k is not None, top_logprobs_num=top,
                             kv_transfer_params=kvp))
    return items, out_k, in_k


def _top(rows, k: int) -> list[pb.TopLogProbs]:
    return [pb.TopLogProbs(values=[lp for lp, _ in t[:k]], token_ids=[tid for _, tid in t[:k]]) for t in rows] if k else []


def output_logprobs(seq: Seq, k: int | None, start: int, end: int) -> pb.OutputLogProbs | None:
    if k is None:
        return None
    return pb.OutputLogProbs(token_logprobs=seq.output_logprobs[start:end], token_ids=seq.output_ids[start:end],
                             top_logprobs=_top(seq.output_top[start:end], k))


def input_logprobs(seq: Seq, k: int | None) -> pb.InputLogProbs | None:
    if k is None:
        return None
    vals = [pb.InputTokenLogProb() if v is None else pb.InputTokenLogProb(value=v) for v in seq.input_logprobs]
    return pb.InputLogProbs(token_logprobs=vals, token_ids=seq.tokens[:len(vals)], top_logprobs=_top(seq.input_top, k))


class VllmEngine(pb_grpc.VllmEngineServicer):
    def __init__(self, engine):
        self.e = engine
        self.bundle = TokenizerBundle(engine.config.model)
        feed_of(engine)  # from now on the KV event history is kept for SubscribeKvEvents
        self.started = time.time()
        self.last_receive = 0.0

    def _chunk(self, s: Seq, i: int, ids: list[int], start: int, ks) -> pb.GenerateResponse:
        return pb.GenerateResponse(chunk=pb.GenerateStreamChunk(
            token_ids=ids, prompt_tokens=s.prompt_len, completion_tokens=len(ids), cached_tokens=s.cached_tokens,
            output_logprobs=output_logprobs(s, ks[0], start, start + len(ids)),
            input_logprobs=input_logprobs(s, ks[1]) if start == 0 else None, index=i))

    def _complete(self, s: Seq, i: int, ids: list[int], start: int, ks) -> pb.GenerateResponse:
        reason, matched = finish_reason(s)
        extra = {}
        if s.kv_transfer_params is not None:
            extra["kv_transfer_params_json"] = json.dumps(s.kv_transfer_params)
            host, port = s.kv_transfer_params.get("remote_host"), s.kv_transfer_params.get("remote_port")
            if isinstance(host, str) and host and isinstance(port, int) and 1 <= port <= 65535:
                extra["kv_transfer_params"] = pb.KvTransferParams(remote_host=host, remote_port=port)
        return pb.GenerateResponse(complete=pb.GenerateComplete(
            output_ids=ids, finish_reason=reason, prompt_tokens=s.prompt_len, completion_tokens=len(ids),
            cached_tokens=s.cached_tokens, output_logprobs=output_logprobs(s, ks[0], start, start + len(ids)),
            input_logprobs=input_logprobs(s, ks[1]), index=i, **matched, **extra))

    async def Generate(self, request, context):
        self.last_receive = time.time()
        seqs: list[Seq] = []
        try:
            items, out_k, in_k = generate_items(request, self.e.tokenizer)
            log.debug("Generate %s stream=%s n=%d kv=%s", request.request_id, request.stream, len(items),
                      items[0].kv_transfer_params)
            ks = (out_k, in_k)
            seqs = [self.e.submit(it) for it in items]
            kvp = items[0].kv_transfer_params or {}
            if kvp.get("do_remote_decode") and kvp.get("transfer_id"):
                async for r in self._mooncake_prefill(seqs[0], request.stream, kvp, ks):
                    yield r
                seqs = []  # detached: the push goes on after the answer, bounded by the engine's timeouts
                return
            completed: set[int] = set()
            async for i, ids, start in deltas(seqs):
                s = seqs[i]
                if request.stream and i not in completed:
                    # Complete only once every id went out (see grpc_sglang.Generate).
                    last = s.finished and start + len(ids) == len(s.output_ids)
                    yield self._chunk(s, i, ids, start, ks)
                    if last:
                        completed.add(i)
                        yield self._complete(s, i, ids, start, ks)
                if faults_on(self.e):
                    await fault_point(self.e, start + len(ids) if request.stream else len(s.output_ids), context)
            if not request.stream:
                for i, s in enumerate(seqs):
                    yield self._complete(s, i, list(s.output_ids), 0, ks)
        except (BadRequest, EngineError) as err:
            await context.abort(status_of(err), str(err))
        finally:
            for s in seqs:
                self.e.abort(s, "the gRPC call ended")

    async def _mooncake_prefill(self, seq: Seq, stream: bool, kvp: dict, ks):
        """vLLM's Mooncake prefill answers once its KV is computed (SMG sends the decode only after
        that answer); the push to the decode, which registers later, runs on in the engine and is
        bounded by --bootstrap-timeout / --transfer-timeout like any other push."""
        await asyncio.wait({seq.prefilled, seq.done}, return_when=asyncio.FIRST_COMPLETED)
        if seq.error is not None:
            raise seq.error
        params = {"do_remote_prefill": True, "do_remote_decode": False, "transfer_id": kvp["transfer_id"],
                  "remote_engine_id": self.e.engine_id}
        ids = list(seq.output_ids)
        if stream:
            yield self._chunk(seq, 0, ids, 0, ks)
        lp = output_logprobs(seq, ks[0], 0, len(ids))
        yield pb.GenerateResponse(complete=pb.GenerateComplete(
            output_ids=ids, finish_reason="length", prompt_tokens=seq.prompt_len,
            completion_tokens=len(ids), cached_tokens=0, output_logprobs=lp, input_logprobs=input_logprobs(seq, ks[1]),
            index=0, kv_transfer_params_json=json.dumps(params)))

    async def HealthCheck(self, request, context):
        healthy, message = await health_probe(self.e)
        return pb.HealthCheckResponse(healthy=healthy, message=message)

    async def Abort(self, request, context):
        for rid in request.request_ids:
            if rid:
                self.e.abort_matching(rid)
        return pb.AbortResponse()

    async def GetModelInfo(self, request, context):
        e, c = self.e, self.e.cfg
        return pb.GetModelInfoResponse(
            model_path=e.config.model, is_generation=True, max_context_length=c.max_position, vocab_size=c.vocab_size,
            supports_vision=False, served_model_name=e.served_name, tokenizer_path=e.config.model, model_type="llama",
            architectures=["LlamaForCausalLM"], eos_token_ids=list(e.tokenizer.eos_ids), pad_token_id=0,
            bos_token_id=e.tokenizer.bos_id if e.tokenizer.bos_id is not None else -1,
            max_req_input_len=c.max_position - 1)

    async def GetServerInfo(self, request, context):
        e = self.e
        k = pairing_keys(e)
        return pb.GetServerInfoResponse(
            active_requests=len(e.live), is_paused=False, last_receive_timestamp=self.last_receive,
            uptime_seconds=time.time() - self.started, server_type="vllm-grpc",
            kv_connector=k["kv_connector"] if e.kv_transfer_config else "",
            kv_role=k["kv_role"] if e.kv_transfer_config else "", kv_engine_id=e.engine_id,
            data_parallel_size=1, kv_cache_dtype=k["kv_cache_dtype"], block_size=k["block_size"],
            attention_backend=k["attention_backend"], model_dtype="float32",
            max_num_seqs=e.config.max_running_requests)

    async def GetLoads(self, request, context):
        from .server import loads_dict

        if request.HasField("dp_rank") and request.dp_rank != 0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"dp_rank {request.dp_rank} does not exist")
        d = loads_dict(self.e)["loads"][0]
        load = pb.SchedulerLoad(
            dp_rank=0, num_running_reqs=d["num_running_reqs"], num_waiting_reqs=d["num_waiting_reqs"],
            num_total_reqs=d["num_live_reqs"], num_used_tokens=d["num_used_tokens"],
            max_total_num_tokens=d["max_total_num_tokens"], token_usage=d["token_usage"],
            max_running_requests=self.e.config.max_running_requests)
        return pb.GetLoadsResponse(timestamp=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                                   version="pdgate-reference-0.1.0", dp_rank_count=1, loads=[load])

    async def FlushCache(self, request, context):
        return flush_cache(self.e)

    async def GetTokenizer(self, request, context):
        async for c in self.bundle.chunks(common_pb2.GetTokenizerChunk):
            yield c

    async def SubscribeKvEvents(self, request, context):
        async for b in subscribe(self.e, request, context):
            yield b
