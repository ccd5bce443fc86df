//! Executing a request: the transaction (`transaction.rs`, open it first: admit → place →
//! select → prepare → send → commit → relay → finish) run over a worker client
//! (`crate::clients`), with the plan of each attempt decided in core (`pdgate_core::plan`).
//!
//! - `transaction`: the phases and the retry loop (before commit only);
//! - `placement`:   PD mode: disaggregated, colocated or rejected early, and the cost model;
//! - `kv_room`:     a disaggregated request waits for a decode with KV room;
//! - `commit`:      the relayed leg from send to its first byte, and the non-stream answer;
//! - `relay`:       the stream after commit, the prefill drain, the accounting at the end;
//! - `accounting`:  usage, TTFT/TPOT, the finished request's record for goodput;
//! - `resume`:      continuing a stream on a new pair after its decode died;
//! - `encode`:      EPD: a request's images, and the encode legs sent with the prefill;
//! - `spans`:       the phase spans for `--enable-trace`;
//! - `policy_rng`:  the routing rng (`--seed`).
//!
//! May use `fleet` (the snapshot, runtime counters, breakers), `clients`, `observe` and the
//! leaves; never `admit`, `edge` or `app`.

pub mod accounting;
mod commit;
mod encode;
pub mod kv_room;
mod media_fetch;
pub mod placement;
pub mod policy_rng;
pub mod relay;
mod resume;
pub mod spans;
mod transaction;

pub use transaction::execute;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use bytes::Bytes;
use pdgate_core::retry::RetryPolicy;
use pdgate_core::retry_budget::RetryBudget;
use pdgate_core::{GatewayConfig, GatewayError, KvMatch, Policy, RouteInput};
use pdgate_protocol::ParsedRequest;
use tokio::time::Instant;

use crate::clients::client::WorkerClient;
use crate::fleet::registry::Routing;
use crate::fleet::Fleet;
use crate::observe::goodput::Goodput;
use crate::observe::log_limit::LogLimiter;
use crate::observe::metrics::Metrics;

/// The most tokens one request adds to a worker's counters (2^40): far beyond any context
/// length, small enough that no sum of requests overflows.
const MAX_COUNTED_TOKENS: u64 = 1 << 40;

/// What the transaction uses, one per gateway: the fleet it reads and reports outcomes to,
/// the worker client it runs legs over, the policies, the retry budget, the placement model,
/// and what it reports to (metrics, goodput, the log limiter). Built by `app`.
pub struct Exec {
    pub config: Arc<GatewayConfig>,
    pub fleet: Arc<Fleet>,
    /// The worker client the transaction runs its legs over (HTTP, or gRPC by URL scheme).
    pub client: Arc<dyn WorkerClient>,
    pub regular_policy: Box<dyn Policy>,
    pub prefill_policy: Box<dyn Policy>,
    pub decode_policy: Box<dyn Policy>,
    /// EPD: which encode worker gets each image (`--encode-policy`).
    pub encode_policy: Box<dyn Policy>,
    pub retry: RetryPolicy,
    /// Retries across all requests stay within this budget (see `pdgate_core::retry_budget`).
    pub retry_budget: Mutex<RetryBudget>,
    /// The round-robin sequence.
    pub sequence: AtomicU64,
    /// The routing rng (`--seed`, policy_rng.rs).
    pub policy_rng: policy_rng::PolicyRng,
    /// `--pd-placement`, early rejection and the cost model (placement.rs).
    pub placer: Arc<placement::Placer>,
    /// `--model-path` / `--tokenizer-path`'s tokenizer, loaded at start-up (prompt_ids.rs).
    pub tokenizer: Option<Arc<pdgate_tokenizer::ModelTokenizer>>,
    pub metrics: Arc<Metrics>,
    pub goodput: Arc<Goodput>,
    pub log: Arc<LogLimiter>,
}

impl Exec {
    /// A request's first attempt: it earns its share of retries for everyone.
    pub fn retry_budget_deposit(&self) {
        self.retry_budget.lock().unwrap_or_else(|p| p.into_inner()).deposit(tokio::time::Instant::now().into_std());
    }

    /// Whether the shared budget allows one more retry now (and spends it if so).
    pub fn retry_budget_withdraw(&self) -> bool {
        self.retry_budget.lock().unwrap_or_else(|p| p.into_inner()).try_withdraw(tokio::time::Instant::now().into_std())
    }

    /// One step of the round-robin sequence.
    pub fn next_sequence(&self) -> u64 {
        self.sequence.fetch_add(1, Ordering::Relaxed)
    }
}

/// The load poller's transfer counters teach the placement cost model (fleet/load.rs).
impl crate::fleet::load::TransferSink for Exec {
    fn observe_transfers(&self, worker: &str, totals: pdgate_protocol::engine_load::TransferTotals) {
        if self.placer.observe_transfer_totals(worker, totals) {
            self.metrics.placement.publish(&self.placer.fitted());
        }
    }
}

/// One client request on its way through the gateway.
#[derive(Clone)]
pub struct Ctx {
    pub state: Arc<Exec>,
    pub req: ParsedRequest,
    /// The client's body as received; forwarded unchanged where no rewrite is needed.
    pub raw: Bytes,
    /// The id of the current attempt, sent to the workers as `X-Request-Id` (the id the legs
    /// rendezvous on): minted by the gateway, fresh for every attempt (see `request_id`).
    pub request_id: String,
    /// The client's own `X-Request-Id`, validated; for the logs and `x-client-request-id`.
    pub client_request_id: Option<String>,
    /// Affinity key for consistent hashing: `x-session-id` header, else the body's `user`.
    pub session_key: Option<String>,
    pub deadline: Instant,
    /// Arrival at the gateway (TTFT and E2E count from here), and the same instant as unix
    /// seconds for the request log.
    pub started: std::time::Instant,
    pub arrival_unix_s: f64,
    pub route: &'static str,
    /// The objectives this request is judged by (`--slo-*-ms`, or its own headers).
    pub slo: pdgate_core::slo::SloTargets,
    /// `x-pdgate-priority`, else the body's `priority` (SGLang's field), else 0; higher is
    /// served first and shed last (the admission queue, early rejection).
    pub priority: i64,
    /// How the stream's token counts are learned, and whether a usage chunk is the gateway's
    /// (then the relay strips it); decided once the resumer is prepared (`transaction.rs`).
    pub usage: accounting::UsageAsk,
    /// The prompt's token ids, computed once on first use (KV-event routing); `Default` for a
    /// new prompt.
    pub prompt_ids: Arc<OnceLock<Option<Vec<u32>>>>,
    /// The resumer asked for the stream's token ids, the client did not: a worker client that
    /// writes the answer from ids keeps them in a ledger instead of the bytes (`LegRequest`).
    pub ids_to_ledger: bool,
    /// The prompts as the first leg to a tokenizing worker client found them, for the other leg
    /// and retries; `Default` for a new prompt (a resume's continuation).
    pub prompt_memo: crate::clients::grpc::PromptMemo,
    /// EPD: the request's images, found at admission (`encode.rs`); empty for text-only
    /// requests and outside `--epd-disaggregation`.
    pub images: Arc<[pdgate_core::epd::Image]>,
}

impl Ctx {
    /// The client's body for a leg that forwards it as it came: the received bytes, with the
    /// fields the gateway added appended (token ids, usage), unless the parser removed
    /// gateway-owned fields or the gateway changed one the client sent (then the body is
    /// encoded).
    pub fn forward_body(&self) -> Result<Bytes, GatewayError> {
        match self.req.forward_bytes(&self.raw) {
            Ok(None) => Ok(self.raw.clone()),
            Ok(Some(bytes)) => Ok(Bytes::from(bytes)),
            Err(e) => Err(GatewayError::internal(format!("cannot encode request: {e}"))),
        }
    }

    /// What a stream's resumer keeps after commit (`resume.rs`): this context with the parsed
    /// body moved out, not copied (nothing here reads it after commit: the legs' bytes are
    /// sent), and without the received bytes, so they are freed when the request's handler
    /// returns instead of living as long as the stream.
    pub fn for_resume(&mut self) -> Ctx {
        let body = std::mem::take(&mut self.req.body);
        Ctx { req: ParsedRequest { body, ..self.req.clone() }, raw: Bytes::new(), ..self.clone() }
    }

    /// The prompt text, only when a policy reads it (copying it for the others would be waste).
    pub fn routing_text(&self) -> Option<String> {
        if self.state.fleet.uses_tree {
            self.req.routing_text()
        } else {
            None
        }
    }

    /// The prompt's token ids for routing (the request's own, else the tokenizer's), computed
    /// on the first call only.
    pub fn routing_ids(&self) -> Option<&[u32]> {
        let tokenizer = self.state.tokenizer.as_deref();
        self.prompt_ids.get_or_init(|| crate::prompt_ids::routing_ids(tokenizer, self.req.endpoint, &self.req.body)).as_deref()
    }

    /// What the workers' KV event views hold of this prompt, by snapshot index; `None` unless
    /// a cache_aware pool routes on events, some worker publishes them, and the prompt has ids.
    fn kv_held(&self, routing: &Routing) -> Option<Held> {
        if !self.state.fleet.routes_on_events || !self.state.fleet.kv_view.any_watched() {
            return None;
        }
        let ids = self.routing_ids().filter(|ids| !ids.is_empty())?;
        // Fixed keys: every replica computes the same key for the same prompt.
        let mut h = std::collections::hash_map::DefaultHasher::new();
        std::hash::Hash::hash(ids, &mut h);
        let (held, subscribed) = self.state.fleet.kv_view.held_in(&routing.snapshot, ids);
        Some(Held { prompt_tokens: ids.len(), held, key: std::hash::Hasher::finish(&h), subscribed })
    }

    /// Runs one policy decision with everything a policy may read: the load view, the affinity
    /// key, the text, the KV event match and, when a policy reads it, the radix tree (locked
    /// for the decision only).
    pub fn decide<T>(&self, routing: &Routing, text: Option<&str>, select: impl FnOnce(&RouteInput<'_>) -> T) -> T {
        let loads = self.state.fleet.loads(&routing.runtime);
        let held = self.kv_held(routing);
        let blocks = crate::fleet::kv_sub::SnapshotBlocks { view: &self.state.fleet.kv_view, snap: &routing.snapshot };
        let input = RouteInput {
            kv: held.as_ref().map(|h| KvMatch { prompt_tokens: h.prompt_tokens, held: &h.held, key: h.key, subscribed: &h.subscribed, blocks: &blocks }),
            text,
            key: self.session_key.as_deref(),
            sequence: self.state.next_sequence(),
            loads: &loads,
            prompt_tokens: self.req.prompt_tokens,
            output_tokens: self.output_tokens(),
            ..RouteInput::default()
        };
        if !self.state.fleet.uses_tree {
            return select(&input);
        }
        let tree = self.state.fleet.tree.lock().unwrap_or_else(|p| p.into_inner());
        select(&RouteInput { tree: Some(&tree), ..input })
    }

    /// Output tokens the request may generate over all its items (`max_tokens` × prompts × n;
    /// 0 when it gave no `max_tokens`: the engine's default is not known here), bounded so
    /// that a client's huge number cannot overflow the counters.
    pub fn output_tokens(&self) -> u64 {
        let per_item = self.req.max_tokens.map_or(0, |(v, _)| v);
        per_item.saturating_mul(self.req.batch_items.unwrap_or(1) as u64).min(MAX_COUNTED_TOKENS)
    }

    /// KV tokens the request holds on its decode (or regular) worker: prompt + output.
    pub fn kv_tokens(&self) -> u64 {
        self.req.prompt_tokens.min(MAX_COUNTED_TOKENS) + self.output_tokens()
    }

    /// Records that the request's text went to `url`, for the cache-aware policies.
    pub fn remember(&self, text: Option<&str>, url: &str) {
        if let Some(text) = text {
            let mut tree = self.state.fleet.tree.lock().unwrap_or_else(|p| p.into_inner());
            self.state.fleet.remember(&mut tree, text, url);
        }
    }
}

/// The owned parts of a [`KvMatch`], built before a decision.
struct Held {
    prompt_tokens: usize,
    held: Vec<(usize, usize)>,
    key: u64,
    /// gRPC workers whose `SubscribeKvEvents` stream feeds the index, by snapshot index.
    subscribed: Vec<usize>,
}

/// An attempt's failure and the worker to avoid on the next attempt.
pub struct AttemptFailure {
    pub error: GatewayError,
    pub worker: Option<String>,
}

impl From<GatewayError> for AttemptFailure {
    fn from(error: GatewayError) -> Self {
        AttemptFailure { error, worker: None }
    }
}

/// Asks the breakers of the chosen workers to admit this request, in order; `None` when all
/// did, else the first that refused (a half-open worker whose one probe is in flight: the
/// choice was made on a view from before that probe began). Probe slots taken by the earlier
/// workers are given back, since this choice is not sent.
pub(crate) fn admit_all(ctx: &Ctx, snap: &pdgate_core::PoolSnapshot, workers: &[usize]) -> Option<usize> {
    for (k, &w) in workers.iter().enumerate() {
        if !ctx.state.fleet.admit(&snap.worker(w).spec.url) {
            end_probes(ctx, snap, &workers[..k]);
            return Some(w);
        }
    }
    None
}

/// Gives back the probe slots [`admit_all`] may have taken for `workers`: the choice they were
/// admitted for is not sent (a later stage of the same decision failed).
pub(crate) fn end_probes(ctx: &Ctx, snap: &pdgate_core::PoolSnapshot, workers: &[usize]) {
    for &w in workers {
        ctx.state.fleet.registry.end_probe(&snap.worker(w).spec.url);
    }
}
