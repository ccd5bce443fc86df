"""The engine: model, KV pool, scheduler and transfer wired together, and the per-item driver
that picks the path (colocated, SGLang bootstrap, vLLM NIXL pull, vLLM Mooncake push)."""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid

import aiohttp
import numpy as np

from .config import PRESETS
from .ec_connector import ECExampleConnector, transfer_params
from .engine_config import EngineConfig
from .errors import EngineConfigError
from .items import FAKE_BOOTSTRAP_HOST, GenItem
from .kv import KVPool, OutOfPages
from .kv_events import KVEventPublisher
from .model import Model
from .multimodal import ImageEncoder
from .pd import PDDriver
from .prefix_cache import PrefixCache
from .scheduler import Scheduler
from .sequence import EngineError, Seq
from .tokenizer import ByteTokenizer, HFTokenizer, load_hf_ids
from .transfer.bootstrap import BootstrapServer
from .transfer.context import Timeouts, TransferContext
from .transfer.embed import EmbedSource, embed_receive
from .transfer.pull import PullSource
from .transfer.push import PushSource
from .transfer.server import TransferServer
from .weights import hf_config, hf_weights, random_weights

log = logging.getLogger("pdgate.engine")


def load_model(name: str, seed: int):
    """`tiny` / `small` presets (weights from `seed`) or a local Hugging Face Llama directory."""
    if name in PRESETS:
        cfg = PRESETS[name]
        return cfg, random_weights(cfg, seed), ByteTokenizer(), f"seed={seed}"
    if os.path.isdir(name):
        cfg = hf_config(name)
        bos, eos = load_hf_ids(name)
        return cfg, hf_weights(name, cfg), HFTokenizer(name, bos, eos), os.path.abspath(name)
    raise EngineConfigError(f"--model {name!r}: not a preset ({', '.join(PRESETS)}) nor a directory")


# The prefixes the vLLM-style endpoints put before the X-Request-Id in a request id.
VLLM_ID_PREFIXES = ("cmpl", "chatcmpl")


class Engine:
    """One worker's engine, built from an `EngineConfig` (resolved here: a raw one is fine).

    Raises `EngineConfigError` for a config that cannot run (an unknown model, contradicting
    fields) and `EngineStartError` for a KV transfer backend that cannot start; it reads no
    environment variable. `start()` binds the side channel (and the bootstrap server of a
    prefill); `server.serve(config)` runs one with its HTTP (and gRPC) surface."""

    def __init__(self, config: EngineConfig):
        self.config = args = config.resolved()
        cfg, weights, self.tokenizer, weights_id = load_model(args.model, args.seed)
        self.cfg = cfg
        self.model = Model(cfg, weights)
        num_pages = max(2, args.max_total_tokens // args.page_size)
        events = args.kv_events_config
        self.kv_events = KVEventPublisher(events) if events is not None and events.active else None
        # A decode worker's prompts arrive as KV: it neither looks the cache up nor fills it.
        cache = None
        if args.enable_prefix_caching and args.disaggregation_mode != "decode":
            cache = PrefixCache(args.page_size, self.kv_events.add if self.kv_events else None)
        self.pool = KVPool(num_pages, args.page_size, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, cache)
        faults = [n for n in (args.fault_kill_after_tokens, args.fault_drop_after_tokens) if n]
        self.scheduler = Scheduler(self.model, self.pool, self.tokenizer, args.chunked_prefill_size,
                                   args.max_running_requests, hold_at=min(faults, default=0))
        self.mode = args.disaggregation_mode
        self.kv_transfer_config = args.kv_transfer_config
        self.served_name = args.served_model_name or args.model
        self.owned_by = "vllm" if self.kv_transfer_config or args.ec_transfer_config else "sglang"
        self.started_at = time.time()
        self.engine_id = args.engine_id or uuid.uuid4().hex
        layout = {"fingerprint": cfg.fingerprint(weights_id), "page_size": args.page_size,
                  "num_layers": cfg.num_layers, "num_kv_heads": cfg.num_kv_heads,
                  "head_dim": cfg.head_dim, "dtype": "float32"}
        timeouts = Timeouts(args.bootstrap_timeout, args.waiting_timeout, args.transfer_timeout,
                            args.kv_lease_timeout)
        self.ctx = TransferContext(self.pool, layout, self.engine_id, args.advertise_host, timeouts,
                                   self.reserve, self.run_prefill, self.release,
                                   fault_send_delay=args.fault_send_delay, fault_frame_pages=args.fault_frame_pages)
        if args.disaggregation_transfer_backend == "mooncake":
            from .transfer.mooncake_te import MooncakeBackend

            self.ctx.backend = MooncakeBackend(self.pool, args.advertise_host)
        elif args.disaggregation_transfer_backend == "nixl":
            from .transfer.nixl_dp import NixlBackend

            # a prefill only writes into decodes: no progress thread (see nixl_dp)
            self.ctx.backend = NixlBackend(self.pool, f"pdgate-{self.engine_id}", args.transfer_timeout,
                                           progress_thread=self.mode != "prefill")
        self.push = PushSource(self.ctx)
        self.pull = PullSource(self.ctx)
        # Multimodal presets: the vision tower with its embedding cache; an encode worker
        # (--encoder-only) offers embeddings to prefills by room (transfer/embed.py).
        self.images = (ImageEncoder(cfg, args.seed, args.mm_embedding_cache_items)
                       if cfg.vision is not None else None)
        self.encoder_only = args.encoder_only
        if self.encoder_only and self.images is None:
            raise EngineConfigError(f"--encoder-only needs a multimodal model (tiny-mm), not {args.model!r}")
        # With Mooncake TE the rows are written into a staging area registered once here
        # (transfer/embed_plane.py): a prefill receives into it, an encode worker writes from it.
        self.embed_plane = None
        if (self.images is not None and self.mode != "decode" and args.mm_embedding_staging_slots > 0
                and args.disaggregation_transfer_backend == "mooncake"):
            from .transfer.embed_plane import MooncakeEmbedPlane

            self.embed_plane = MooncakeEmbedPlane(self.ctx.backend, args.mm_embedding_staging_slots,
                                                  self.images.tokens_per_image * cfg.hidden_size * 4,
                                                  args.transfer_timeout)
        self.embeds = (EmbedSource(self.ctx, self.images.counts, self.images.bytes, self.embed_plane)
                       if self.images else None)
        # vLLM's disaggregated encoder (--ec-transfer-config): embeddings through a shared folder.
        self.ec: ECExampleConnector | None = None
        if args.ec_transfer_config is not None:
            if self.images is None:
                raise EngineConfigError(f"--ec-transfer-config needs a multimodal model (tiny-mm), not {args.model!r}")
            self.ec = ECExampleConnector(args.ec_transfer_config, (self.images.tokens_per_image, cfg.hidden_size))
        handlers = {"register": self.push.on_register, "pull": self.pull.on_pull,
                    "release": self.pull.on_release}
        if self.embeds is not None:
            handlers["embed_register"] = self.embeds.on_register
        self.tserver = TransferServer(handlers)
        # The data source runs the bootstrap server: a prefill for KV, an encode worker for embeddings.
        self.bootstrap = (BootstrapServer(args.page_size)
                          if self.mode == "prefill" or self.encoder_only else None)
        self.pd = PDDriver(self)
        self.live: dict[str, tuple[Seq, asyncio.Task]] = {}
        self.ready = False
        self.http: aiohttp.ClientSession | None = None
        self.counters = {"requests": 0, "prompt_tokens": 0, "generation_tokens": 0,
                         "local_recompute": 0, "aborted": 0}
        self._tasks: list[asyncio.Task] = []

    # ---- lifecycle ---------------------------------------------------------------------
    async def start(self) -> None:
        self.http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10))
        if self.kv_events is not None:
            self.kv_events.start()
        self.ctx.port = await self.tserver.start(self.config.host, self.config.transfer_port)
        self._tasks.append(asyncio.create_task(self.scheduler.run(), name="scheduler"))
        if self.bootstrap is not None:
            await self.bootstrap.start(self.config.host, self.config.disaggregation_bootstrap_port)
            host = self.config.advertise_host
            self.bootstrap.ranks[(0, 0, 0)] = {"role": "Encode" if self.encoder_only else "Prefill", "rank_ip": host,
                                               "rank_port": self.ctx.port}
            self.bootstrap.engines["0"] = {"engine_id": self.engine_id, "worker_addr": {
                "host": host, "port": self.ctx.port, "transport": "tcp"}}
        self.ready = True
        log.info("engine ready: mode=%s side channel=%s:%d", self.mode, self.config.host, self.ctx.port)

    async def stop(self) -> None:
        self.ready = False
        for seq, task in list(self.live.values()):
            task.cancel()
        await self.tserver.stop()
        if self.bootstrap is not None:
            await self.bootstrap.stop()
        for t in self._tasks:
            t.cancel()
        if self.http is not None:
            await self.http.close()
        if self.kv_events is not None:
            self.kv_events.stop()

    # ---- pages -------------------------------------------------------------------------
    async def reserve(self, n: int, timeout: float, total: int | None = None) -> list[int]:
        """Reserve n pages, waiting (FIFO by polling) up to `timeout` for others to free some.
        `total`: all the pages the request needs (n plus those it already holds)."""
        if (total or n) > self.pool.num_pages:
            raise EngineError(f"request needs {total or n} KV pages, the pool has {self.pool.num_pages}",
                              400, "context_length_exceeded")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            try:
                return self.pool.reserve(n)
            except OutOfPages:
                if loop.time() >= deadline:
                    raise EngineError(f"no KV memory for {n} pages within {timeout:g}s", 503,
                                      "kv_cache_full") from None
                await asyncio.sleep(0.005)

    async def acquire(self, seq: Seq, n: int, timeout: float) -> None:
        """Give a sequence that computes its own prompt its n pages: the cached pages of the
        longest cached prefix of its prompt (short of its last token, which is always computed),
        then new ones. Requests for input logprobs skip the lookup (they need every
        position's logits), as vLLM skips it for prompt logprobs."""
        cache, hit, digests = self.pool.cache, [], []
        if cache is not None and not seq.wants_input_logprobs and not seq.images:
            hit, digests = cache.match(seq.tokens[:seq.prompt_len], seq.prompt_len - 1)
            self.pool.share(hit)
        try:
            new = await self.reserve(n - len(hit), timeout, total=n)
        except BaseException:
            if hit:
                self.pool.free(hit, seq)
            raise
        seq.pages, seq.block_digests, seq.committed = hit + new, digests, len(hit)
        seq.computed = seq.cached_tokens = len(hit) * self.pool.page_size

    def flush_cache(self) -> bool:
        """Empty the prefix cache (SGLang's /flush_cache, vLLM's /reset_prefix_cache). Like
        the engines, only when no request holds a page; publishes AllBlocksCleared."""
        c = self.pool.counters()
        if self.pool.cache is None or c["reserved"] + c["in_use"] + c["pinned"] > 0:
            return self.pool.cache is None
        self.pool.forget(self.pool.cache.clear())
        return True

    def prefix_cache_stats(self) -> dict:
        out = self.pool.cache.stats() if self.pool.cache is not None else {"enabled": False}
        out["kv_events"] = self.kv_events.stats() if self.kv_events is not None else {"enabled": False}
        return out

    def release(self, seq: Seq) -> None:
        """Free `seq`'s pages unless the scheduler still holds it (then it frees them itself)."""
        if seq.pages and not self.scheduler.owns(seq):
            self.pool.free(seq.pages, seq)
            seq.pages = []

    def pages_for_generation(self, seq: Seq) -> int:
        return self.pool.pages_for(min(seq.prompt_len + seq.params.max_new_tokens + 1,
                                       self.cfg.max_position))

    @property
    def ec_encode_only(self) -> bool:
        """vLLM's encoder-only instance (`ec_role` ec_producer): embeds, never generates."""
        return self.ec is not None and self.ec.encode_only

    def local_embedding(self, img) -> np.ndarray:
        """An image's rows made on this worker: from the embedding cache, else (an EC consumer)
        from the shared storage, else from the tower. An EC producer writes the file the shared
        storage lacks."""
        ec = self.ec
        rows, _ = self.images.embed(img, ec.load if ec is not None and ec.consumer else None)
        if ec is not None and ec.producer and not ec.exists(img.content_hash):
            ec.save(img.content_hash, rows)
        return rows

    def encode_only(self, items: list[GenItem]) -> dict | None:
        """An EC producer's request: every image's rows written to the shared storage, nothing
        generated (vLLM's encoder instance stops once the prompt is consumed). Returns the
        answer's `ec_transfer_params` (None without images). The items of one request share its
        images (only chat carries images, one prompt)."""
        for item in items:
            self._check_prompt(item)
        images = items[0].images if items else []
        for img in images:
            self.local_embedding(img)
            if not self.ec.exists(img.content_hash):
                raise EngineError(f"could not write image {img.index}'s embedding to {self.ec.path} "
                                  "(ec_transfer_config shared_storage_path)", 500, "ec_cache_save_failed")
        self.counters["requests"] += len(items)
        self.counters["prompt_tokens"] += sum(len(it.input_ids) for it in items)
        return transfer_params(images)

    async def prepare_images(self, seq: Seq) -> None:
        """Before a sequence computes its prompt: its images' embeddings, received from the
        encode workers `encode_bootstrap_info` names (not on a decode, which only computes when
        it recomputes, and then on its own), else made here (`local_embedding`: cache, EC
        shared storage, tower)."""
        if not seq.images or seq.mm_rows is not None:
            return
        embeds: dict[int, object] = {}
        wanted = seq.encode_items if self.mode != "decode" else None
        if wanted:
            shape = (self.images.tokens_per_image, self.cfg.hidden_size)

            async def one(img):
                it = wanted[img.index]
                try:
                    addr = await self.pd.route(it["bootstrap_host"], it["bootstrap_port"])
                    emb, backend = await embed_receive(self.ctx, addr, it["bootstrap_room"], img.content_hash,
                                                       shape, self.embed_plane)
                except EngineError as e:
                    # names the image, so a router can blame its encode worker, not this prefill
                    e.param = f"encode_bootstrap_info.items[{img.index}]"
                    raise
                self.images.counts["received"] += 1
                self.images.bytes[backend]["received"] += emb.nbytes
                embeds[img.index] = emb
            await asyncio.gather(*(one(img) for img in seq.images if img.index in wanted))
        for img in seq.images:
            if img.index not in embeds:
                embeds[img.index] = self.local_embedding(img)
        pos = np.concatenate([np.arange(img.offset, img.offset + img.length) for img in seq.images])
        seq.mm_rows = (pos, np.concatenate([embeds[img.index] for img in seq.images]))

    async def run_prefill(self, seq: Seq) -> None:
        """Compute a prefill-only sequence (prompt plus its first token); keep its pages."""
        await self.prepare_images(seq)
        await self.acquire(seq, self.pool.pages_for(seq.prompt_len), self.config.queue_timeout)
        self.scheduler.add(seq)
        try:
            await asyncio.wait({seq.prefilled, seq.done}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            self.scheduler.abort(seq, EngineError("cancelled", 499, "cancelled"))
            raise
        if seq.error is not None:
            raise seq.error

    async def start_local(self, seq: Seq) -> None:
        await self.prepare_images(seq)
        await self.acquire(seq, self.pages_for_generation(seq), self.config.queue_timeout)
        self.scheduler.add(seq)

    # ---- requests ----------------------------------------------------------------------
    def submit(self, item: GenItem) -> Seq:
        if self.encoder_only:
            raise EngineError("this is an encode worker (--encoder-only): it serves POST /encode, "
                              "not generation", 400, "encoder_only")
        if self.ec_encode_only:
            raise EngineError("this is an encoder-only instance (--ec-transfer-config ec_role ec_producer): "
                              "it answers the OpenAI endpoints without generating", 400, "encoder_only")
        self._check_prompt(item)
        prefill_only = self.pd.is_prefill_leg(item)
        seq = Seq(item.rid, item.input_ids, item.params, return_logprob=item.return_logprob,
                  top_logprobs_num=item.top_logprobs_num, prefill_only=prefill_only,
                  input_logprobs=item.input_logprobs)
        seq.images, seq.encode_items = item.images, item.encode_items
        task = asyncio.create_task(self._drive(item, seq))
        self.live[seq.rid] = (seq, task)
        # Live until both have ended: the answer, and the task that drives its transfers (an
        # aborted request still unwinding holds its registration or pages until then).
        seq.done.add_done_callback(lambda _f: self._done(seq))
        task.add_done_callback(lambda _t: self._forget(seq))
        self.counters["requests"] += 1
        self.counters["prompt_tokens"] += seq.prompt_len
        return seq

    def _check_prompt(self, item: GenItem) -> None:
        if len(item.input_ids) == 0:
            raise EngineError("the prompt is empty", 400, "empty_prompt")
        if len(item.input_ids) >= self.cfg.max_position:
            raise EngineError(f"prompt of {len(item.input_ids)} tokens exceeds the context "
                              f"({self.cfg.max_position})", 400, "context_length_exceeded")
        if any((not isinstance(t, int)) or t < 0 or t >= self.cfg.vocab_size for t in item.input_ids):
            raise EngineError(f"input_ids must be integers in [0, {self.cfg.vocab_size})", 400,
                              "invalid_input_ids")

    def _done(self, seq: Seq) -> None:
        self.counters["generation_tokens"] += len(seq.output_ids)
        self._forget(seq)

    def _forget(self, seq: Seq) -> None:
        entry = self.live.get(seq.rid)
        if entry is not None and entry[0] is seq and seq.done.done() and entry[1].done():
            del self.live[seq.rid]

    async def _drive(self, item: GenItem, seq: Seq) -> None:
        try:
            await self.pd.drive(item, seq)
        except EngineError as e:
            seq.fail(e)
        except asyncio.CancelledError:
            seq.fail(EngineError("request aborted", 499, "aborted"))
        except Exception as e:  # a bug must end the request, not hang it
            log.exception("request %s failed", seq.rid)
            seq.fail(EngineError(f"internal error: {e}"))

    def abort(self, seq: Seq, why: str = "aborted by client") -> None:
        if seq.finished:
            return
        self.counters["aborted"] += 1
        entry = self.live.get(seq.rid)
        if entry is not None and entry[0] is seq and not entry[1].done():
            entry[1].cancel()
        self.scheduler.abort(seq, EngineError(why, 499, "aborted"))

    def abort_rid(self, rid: str) -> bool:
        return self.abort_matching(rid) > 0

    def abort_matching(self, rid: str, abort_all: bool = False) -> int:
        """SGLang's `/abort_request`: abort every request whose rid starts with `rid` (a batch's
        items are `{rid}_{i}`, so its rid aborts all of them), or all with `abort_all`.

        Besides live requests this frees NIXL holds: a prefill whose answer has been sent keeps
        its pages pinned for the decode's pull, and when the gateway knows that pull will never
        come (the decode died or gave up) this is how it says so instead of waiting for the
        lease. Returns how many requests and holds were aborted.

        The vLLM-style surfaces name a request `{cmpl|chatcmpl}-{X-Request-Id}-{i}` (there is no
        body rid in vLLM's API), so a rid also matches after that prefix: the gateway aborts a
        NIXL prefill's hold by the X-Request-Id it sent."""
        if not rid and not abort_all:
            return 0

        def hit(key: str) -> bool:
            prefix, _, rest = key.partition("-")
            return abort_all or key.startswith(rid) or (prefix in VLLM_ID_PREFIXES and rest.startswith(rid))

        seqs = [seq for key, (seq, _t) in list(self.live.items()) if hit(key)]
        for seq in seqs:
            self.abort(seq)
        # An encode worker also keeps the rid, so an /encode that this abort overtook is refused.
        late = rid if self.encoder_only and not abort_all else None
        rooms = self.embeds.abort(hit, late) if self.embeds is not None else 0
        return len(seqs) + rooms + self.pull.release(hit, "aborted by /abort_request")

    def is_fake_host(self, item: GenItem) -> bool:
        return item.bootstrap_host == FAKE_BOOTSTRAP_HOST
