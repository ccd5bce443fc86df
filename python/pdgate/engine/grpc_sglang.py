"""SGLang's gRPC scheduler service (`sglang.grpc.scheduler.SglangScheduler`, smg-grpc-proto)
over the reference engine: what `sglang --smg-grpc-mode` serves to SMG and pdgate.

Token ids in, token ids out. Streams carry each step's new ids (`GenerateStreamChunk`, then a
`GenerateComplete` after the last chunk); a non-streaming call answers one `GenerateComplete`
per choice with all ids. n>1 choices are `{request_id}-{i}` inside the engine, so `Abort` with
the request id ends all of them. Failures end the call with a gRPC status, never a Complete.
SubscribeKvEvents streams the engine's KV events when it publishes them (`grpc_kv_events.py`).
Not served (UNIMPLEMENTED): Embed, profiling, LoRA.
"""

from __future__ import annotations

import json
import logging
import time
import uuid

import grpc
from google.protobuf.json_format import MessageToDict
from google.protobuf.struct_pb2 import Struct
from google.protobuf.timestamp_pb2 import Timestamp
from smg_grpc_proto.generated import common_pb2
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc

from .grpc_kv_events import feed_of, subscribe
from .grpc_common import (TokenizerBundle, deltas, fault_point, faults_on, finish_reason, flush_cache, health_probe,
                          pairing_keys, status_of)
from .items import GenItem
from .sampling import BadRequest, params_from_dict
from .sequence import EngineError, Seq

log = logging.getLogger("pdgate.engine.grpc")
DEFAULT_MAX_NEW_TOKENS = 128


def _struct(d: dict) -> Struct:
    s = Struct()
    s.update(json.loads(json.dumps(d, default=str)))
    return s


def sampling_dict(sp: pb.SamplingParams) -> dict:
    """The engine's sampling dict from SGLang's proto (proto3 zeros of top_p/top_k mean unset)."""
    if sp.WhichOneof("constraint"):
        raise BadRequest("constrained decoding (regex, json_schema, ebnf, structural_tag) is not supported "
                         "by the reference engine", sp.WhichOneof("constraint"))
    custom = MessageToDict(sp.custom_params) if sp.HasField("custom_params") else {}
    d = {"max_new_tokens": sp.max_new_tokens if sp.HasField("max_new_tokens") else DEFAULT_MAX_NEW_TOKENS,
         "temperature": sp.temperature, "top_p": sp.top_p or 1.0, "top_k": sp.top_k or -1, "min_p": sp.min_p,
         "stop": list(sp.stop), "stop_token_ids": [int(t) for t in sp.stop_token_ids],
         "ignore_eos": sp.ignore_eos, "skip_special_tokens": sp.skip_special_tokens}
    seed = custom.get("seed", custom.get("sampling_seed"))
    if seed is not None:
        if not isinstance(seed, (int, float)) or int(seed) != seed:
            raise BadRequest("custom_params.seed must be an integer", "seed")
        d["seed"] = int(seed)
    return d


def generate_items(req: pb.GenerateRequest) -> list[GenItem]:
    """One GenItem per choice, PD fields included."""
    ids = [int(t) for t in req.tokenized.input_ids]
    if req.mm_inputs.ByteSize() or len(req.input_embeds):
        raise BadRequest("multimodal inputs and input_embeds are not supported", "mm_inputs")
    if not 0 <= req.top_logprobs_num <= 20:
        raise BadRequest("top_logprobs_num must be in [0, 20]", "top_logprobs_num")
    n = req.sampling_params.n or 1
    if not 1 <= n <= 64:
        raise BadRequest("n must be in [1, 64]", "n")
    base = dict(sampling_dict(req.sampling_params))
    pd = {}
    if req.HasField("disaggregated_params"):
        dp = req.disaggregated_params
        if dp.bootstrap_room < 0:
            raise BadRequest("bootstrap_room must be non-negative", "bootstrap_room")
        if n != 1:
            raise BadRequest("disaggregated requests take n=1", "n")
        pd = {"bootstrap_host": dp.bootstrap_host or None, "bootstrap_port": dp.bootstrap_port or None,
              "bootstrap_room": dp.bootstrap_room}
    rid = req.request_id or f"grpc-{uuid.uuid4().hex}"
    items = []
    for i in range(n):
        d = dict(base)
        if i and isinstance(d.get("seed"), int):
            d["seed"] += i  # each choice its own draw, as the HTTP surfaces do
        items.append(GenItem(rid=rid if n == 1 else f"{rid}-{i}", input_ids=ids, params=params_from_dict(d),
                             return_logprob=req.return_logprob, top_logprobs_num=req.top_logprobs_num, **pd))
    return items


def output_logprobs(seq: Seq, start: int, end: int) -> pb.OutputLogProbs | None:
    if not seq.return_logprob:
        return None
    top = [pb.TopLogProbs(values=[lp for lp, _ in t], token_ids=[tid for _, tid in t])
           for t in seq.output_top[start:end]] if seq.top_logprobs_num else []
    return pb.OutputLogProbs(token_logprobs=seq.output_logprobs[start:end], token_ids=seq.output_ids[start:end],
                             top_logprobs=top)


def input_logprobs(seq: Seq) -> pb.InputLogProbs | None:
    if not seq.return_logprob:
        return None
    vals = [pb.InputTokenLogProb() if v is None else pb.InputTokenLogProb(value=v) for v in seq.input_logprobs]
    top = [pb.TopLogProbs(values=[lp for lp, _ in t], token_ids=[tid for _, tid in t])
           for t in seq.input_top] if seq.top_logprobs_num else []
    return pb.InputLogProbs(token_logprobs=vals, token_ids=seq.tokens[:len(vals)], top_logprobs=top)


def complete(rid: str, seq: Seq, index: int, ids: list[int], start: int) -> pb.GenerateResponse:
    reason, matched = finish_reason(seq)
    return pb.GenerateResponse(request_id=rid, complete=pb.GenerateComplete(
        output_ids=ids, finish_reason=reason, prompt_tokens=seq.prompt_len, completion_tokens=len(seq.output_ids),
        cached_tokens=seq.cached_tokens, output_logprobs=output_logprobs(seq, start, start + len(ids)),
        input_logprobs=input_logprobs(seq), index=index, **matched))


def chunk(rid: str, seq: Seq, index: int, ids: list[int], start: int) -> pb.GenerateResponse:
    return pb.GenerateResponse(request_id=rid, chunk=pb.GenerateStreamChunk(
        token_ids=ids, prompt_tokens=seq.prompt_len, completion_tokens=start + len(ids),
        cached_tokens=seq.cached_tokens, output_logprobs=output_logprobs(seq, start, start + len(ids)),
        input_logprobs=input_logprobs(seq) if start == 0 else None, index=index))


class SglangScheduler(pb_grpc.SglangSchedulerServicer):
    def __init__(self, engine):
        self.e = engine
        self.bundle = TokenizerBundle(engine.config.model)
        feed_of(engine)  # from now on the KV event history is kept for SubscribeKvEvents
        self.started = time.time()
        self.last_receive = 0.0

    async def Generate(self, request, context):
        self.last_receive = time.time()
        seqs: list[Seq] = []
        try:
            items = generate_items(request)
            seqs = [self.e.submit(it) for it in items]
            rid = request.request_id
            completed: set[int] = set()
            async for i, ids, start in deltas(seqs):
                s = seqs[i]
                if request.stream and i not in completed:
                    # Complete only once every id went out: the sequence may have finished (in
                    # the engine) after these ids were read, with more still to come.
                    last = s.finished and start + len(ids) == len(s.output_ids)
                    if ids or not last:
                        yield chunk(rid, s, i, ids, start)
                    if last:
                        completed.add(i)
                        yield complete(rid, s, i, ids, start)
                if faults_on(self.e):
                    await fault_point(self.e, start + len(ids) if request.stream else len(s.output_ids), context)
            if not request.stream:
                for i, s in enumerate(seqs):
                    yield complete(rid, s, i, list(s.output_ids), 0)
        except (BadRequest, EngineError) as err:
            await context.abort(status_of(err), str(err))
        finally:
            for s in seqs:
                self.e.abort(s, "the gRPC call ended")

    async def HealthCheck(self, request, context):
        healthy, message = await health_probe(self.e)
        return pb.HealthCheckResponse(healthy=healthy, message=message)

    async def Abort(self, request, context):
        if not request.request_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id is required")
        n = self.e.abort_matching(request.request_id)
        return pb.AbortResponse(success=n > 0, message=f"Request {request.request_id} "
                                                       f"{'aborted' if n else 'not found'}")

    async def GetModelInfo(self, request, context):
        e, c = self.e, self.e.cfg
        return pb.GetModelInfoResponse(
            model_path=e.config.model, tokenizer_path=e.config.model, is_generation=True,
            weight_version=e.ctx.layout["fingerprint"], served_model_name=e.served_name,
            max_context_length=c.max_position, vocab_size=c.vocab_size, supports_vision=False, model_type="llama",
            eos_token_ids=list(e.tokenizer.eos_ids), pad_token_id=0,
            bos_token_id=e.tokenizer.bos_id if e.tokenizer.bos_id is not None else -1,
            max_req_input_len=c.max_position - 1, architectures=["LlamaForCausalLM"])

    async def GetServerInfo(self, request, context):
        from .server import info_dict  # aiohttp-free at import time of this module's users

        e = self.e
        args = info_dict(e)
        args.update(pairing_keys(e))
        args["max_running_requests"] = e.config.max_running_requests
        total = e.pool.num_pages * e.pool.page_size
        start = Timestamp()
        start.FromSeconds(int(self.started))
        return pb.GetServerInfoResponse(
            server_args=_struct(args),
            scheduler_info=_struct({"max_total_num_tokens": total, "max_req_input_len": e.cfg.max_position - 1,
                                    "is_generation": True}),
            active_requests=len(e.live), is_paused=False, last_receive_timestamp=self.last_receive,
            uptime_seconds=time.time() - self.started, sglang_version="pdgate-reference-0.1.0",
            server_type="grpc", start_time=start, max_total_num_tokens=total)

    async def GetLoads(self, request, context):
        if request.HasField("dp_rank") and request.dp_rank != 0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"dp_rank {request.dp_rank} does not exist")
        load = scheduler_load(self.e)
        return pb.GetLoadsResponse(
            timestamp=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), version="pdgate-reference-0.1.0",
            dp_rank_count=1, loads=[load],
            aggregate=pb.AggregateMetrics(total_running_reqs=load.num_running_reqs,
                                          total_waiting_reqs=load.num_waiting_reqs, total_reqs=load.num_total_reqs,
                                          avg_token_usage=load.token_usage))

    async def FlushCache(self, request, context):
        return flush_cache(self.e)

    async def GetTokenizer(self, request, context):
        async for c in self.bundle.chunks(common_pb2.GetTokenizerChunk):
            yield c

    async def SubscribeKvEvents(self, request, context):
        async for b in subscribe(self.e, request, context):
            yield b


def scheduler_load(e) -> pb.SchedulerLoad:
    """SGLang's per-rank load; the PD queues from the transfer table (in flight = transfer queue)."""
    from .server import loads_dict

    d = loads_dict(e)["loads"][0]
    dis = d["disaggregation"]
    in_flight = sum(dis["transfers_in_flight"].values())
    running, waiting = d["num_running_reqs"], d["num_waiting_reqs"]
    return pb.SchedulerLoad(
        dp_rank=0, num_running_reqs=running, num_waiting_reqs=waiting, num_total_reqs=d["num_live_reqs"],
        num_used_tokens=d["num_used_tokens"], max_total_num_tokens=d["max_total_num_tokens"],
        token_usage=d["token_usage"], max_running_requests=e.config.max_running_requests,
        disaggregation=pb.DisaggregationMetrics(
            mode=e.mode,
            prefill_inflight_queue_reqs=(in_flight + dis["held_for_pull"]) if e.mode == "prefill" else 0,
            decode_prealloc_queue_reqs=dis["pending_registrations"] if e.mode == "decode" else 0,
            decode_transfer_queue_reqs=in_flight if e.mode == "decode" else 0),
        queues=pb.QueueMetrics(waiting=waiting))
