//! gRPC workers (`grpc://HOST:PORT`): the SMG contract's SGLang `SglangScheduler` and vLLM
//! `VllmEngine` services, as a second [`WorkerClient`] under the same transaction.
//!
//! A leg arrives as the HTTP client gets it (route path + JSON body). The gateway tokenizes it
//! (chat template for chat) with its tokenizer, sends a `GenerateRequest`, and writes the token
//! answer back as the bytes the engine's HTTP surface would have written (`response.rs`), so
//! relay, accounting, retries, resume and the decision record work unchanged.
//!
//! - `pb`:       the generated messages and clients (scripts/gen_grpc_protos);
//! - `request`:  JSON body → sampling, logprob ask, answer shape (`prompts`: the prompt ids,
//!   batches included; `calls`: the `GenerateRequest`s a leg is sent as; `shape`: those types);
//! - `response`: token events → JSON / SSE (`logprobs`: their JSON shapes);
//! - `wire`:     the two services behind one interface (which one from `GetModelInfo`);
//! - `fetched`, `tokenizer_zip`: the tokenizer from the worker's `GetTokenizer` when the
//!   gateway has no `--model-path` / `--tokenizer-path`.

mod calls;
mod fetched;
pub mod logprobs;
pub mod pb;
mod prompts;
pub mod request;
pub mod response;
pub mod shape;
mod sse_chunk;
mod tokenizer_zip;
mod wire;

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use axum::http::{HeaderValue, StatusCode};
use bytes::{Bytes, BytesMut};
use futures_util::StreamExt;
use pdgate_core::plan::AbortStyle;
use pdgate_core::{GatewayError, Leg};
use pdgate_protocol::engine_load::EngineLoad;
use pdgate_protocol::resume::TokenLedger;
use pdgate_tokenizer::{ModelTokenizer, ReplacementTail};
use tokio::sync::mpsc;
use tokio::time::{timeout_at, Instant};

use crate::clients::client::{LegAnswer, LegEvent, LegFuture, LegHead, LegRequest, WorkerClient};
use crate::clients::engine_info::EngineInfo;
use crate::clients::leg::{answering_deadline_error, deadline_error, whose};
pub use prompts::PromptMemo;
use request::Route;
use response::Writer;
pub use wire::Wire;

/// Longest wait for a connection, and for a management call (info, health, loads, abort).
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
const ABORT_TIMEOUT: Duration = Duration::from_secs(2);
/// Stream events buffered between the engine's stream and the relay.
const EVENT_BUFFER: usize = 32;
/// Longest a `GetTokenizer` fetch (download and load) may take.
const TOKENIZER_FETCH_TIMEOUT: Duration = Duration::from_secs(60);

/// The gRPC [`WorkerClient`], and the management calls health and load polling make.
#[derive(Default)]
pub struct GrpcClient {
    /// `--model-path` / `--tokenizer-path`'s tokenizer, set at start-up.
    tokenizer: OnceLock<Arc<ModelTokenizer>>,
    /// One connection (HTTP/2, multiplexed) and service kind per worker URL.
    workers: Mutex<HashMap<String, Arc<Wire>>>,
    /// Without a configured tokenizer: each model's, fetched from its first worker.
    fetched: fetched::FetchedTokenizers,
    /// Counts `forget`s: a connection made while one happened is used but not cached, so a
    /// check in flight when its worker was removed cannot put the worker's channel back.
    forgets: std::sync::atomic::AtomicU64,
}

impl GrpcClient {
    pub fn new() -> Self {
        Self::default()
    }

    /// The gateway's tokenizer (the one legs are tokenized with).
    pub fn set_tokenizer(&self, tok: Arc<ModelTokenizer>) {
        let _ = self.tokenizer.set(tok);
    }

    /// The worker's connection and service, found once (`GetModelInfo` on each service).
    async fn wire(&self, url: &str, leg: Leg) -> Result<Arc<Wire>, GatewayError> {
        if let Some(w) = self.workers.lock().unwrap_or_else(|p| p.into_inner()).get(url) {
            return Ok(w.clone());
        }
        let forgets = self.forgets.load(std::sync::atomic::Ordering::Acquire);
        let wire = Arc::new(Wire::detect(url, leg).await?);
        let mut workers = self.workers.lock().unwrap_or_else(|p| p.into_inner());
        if self.forgets.load(std::sync::atomic::Ordering::Acquire) == forgets {
            workers.insert(url.to_string(), wire.clone());
        }
        Ok(wire)
    }

    /// Forgets a worker's connection (it was removed, or its service may have changed). The
    /// channel closes once the calls still running on it end.
    pub fn forget(&self, url: &str) {
        let mut workers = self.workers.lock().unwrap_or_else(|p| p.into_inner());
        self.forgets.fetch_add(1, std::sync::atomic::Ordering::AcqRel);
        workers.remove(url);
    }

    /// Tests: caches a connection to `url` that was never made.
    #[cfg(test)]
    pub fn cache_unconnected(&self, url: &str) {
        self.workers.lock().unwrap_or_else(|p| p.into_inner()).insert(url.to_string(), Arc::new(Wire::unconnected(url)));
    }

    /// Whether a connection to `url` is cached.
    pub fn has_connection(&self, url: &str) -> bool {
        self.workers.lock().unwrap_or_else(|p| p.into_inner()).contains_key(url)
    }

    /// The tokenizer legs to this worker are tokenized with: the configured one, else the
    /// worker's model's, fetched once over `GetTokenizer` (fetched.rs).
    async fn tokenizer(&self, wire: &Arc<Wire>, url: &str, leg: Leg) -> Result<Arc<ModelTokenizer>, GatewayError> {
        if let Some(t) = self.tokenizer.get() {
            return Ok(t.clone());
        }
        let model = wire.served_model().to_string();
        let (w, url, name) = (wire.clone(), url.to_string(), model.clone());
        let fetch = || async move {
            let load = async {
                let zip = w.fetch_tokenizer_bundle().await?;
                let bytes = zip.len();
                // Parsing a real tokenizer.json takes a while: off the runtime's threads.
                let tok = tokio::task::spawn_blocking(move || tokenizer_zip::load_bundle(&zip)).await.map_err(|e| format!("loading the bundle: {e}"))??;
                tracing::info!(model = %name, worker = %url, bytes, chat_template = tok.has_chat_template(), "tokenizer fetched from the worker's GetTokenizer");
                Ok::<_, String>(tok)
            };
            tokio::time::timeout(TOKENIZER_FETCH_TIMEOUT, load).await.map_err(|_| format!("GetTokenizer took over {} s", TOKENIZER_FETCH_TIMEOUT.as_secs()))?
        };
        self.fetched.get_or_fetch(&model, fetch).await.map_err(|e| {
            GatewayError::bad_worker_response(
                leg,
                format!("no tokenizer for model '{model}': {e} (gRPC workers take token ids; --model-path or --tokenizer-path gives the gateway one)"),
            )
        })
    }

    /// Health: the service's `HealthCheck`, within `limit`.
    /// The worker's HealthCheck within `limit`; `Err((reason, unanswered))`, `unanswered` when
    /// no answer came in time (a busy worker, not a refusal: health.rs).
    pub async fn health(&self, url: &str, limit: Duration) -> Result<(), (String, bool)> {
        let check = async {
            let wire = self.wire(url, Leg::Regular).await.map_err(|e| (e.message, false))?;
            let out = wire.health().await.map_err(|e| (e, false));
            if out.is_err() {
                // A worker that restarted may serve another service: detect it again next time.
                self.forget(url);
            }
            out
        };
        tokio::time::timeout(limit, check).await.unwrap_or_else(|_| Err((format!("gRPC HealthCheck: no answer within {} s", limit.as_secs()), true)))
    }

    /// Models, mode, runtime, KV layout and context length, from `GetModelInfo`/`GetServerInfo`.
    pub async fn engine_info(&self, url: &str, limit: Duration) -> EngineInfo {
        let info = async { self.wire(url, Leg::Regular).await.ok()?.engine_info().await };
        tokio::time::timeout(limit, info).await.ok().flatten().unwrap_or_default()
    }

    /// The worker's KV event stream (`SubscribeKvEvents`) from `start`, opened within `limit`
    /// (finding the service included). `UNIMPLEMENTED`: the worker does not offer it.
    pub async fn kv_events(&self, url: &str, start: u64, limit: Duration) -> Result<tonic::Streaming<pb::smg::grpc::common::KvEventBatch>, tonic::Status> {
        let open = async {
            let wire = self.wire(url, Leg::Regular).await.map_err(|e| tonic::Status::unavailable(e.message))?;
            wire.subscribe_kv_events(start).await
        };
        tokio::time::timeout(limit, open).await.unwrap_or_else(|_| Err(tonic::Status::deadline_exceeded(format!("SubscribeKvEvents: no answer within {} s", limit.as_secs()))))
    }

    /// The worker's load, from `GetLoads`.
    pub async fn loads(&self, url: &str, limit: Duration) -> Option<EngineLoad> {
        let loads = async { self.wire(url, Leg::Regular).await.ok()?.loads().await };
        tokio::time::timeout(limit, loads).await.ok().flatten()
    }

    /// Sends a leg: tokenize, `Generate`, and a task that writes the answer as the route's
    /// bytes. Resolves when the engine accepted the call (its response head).
    async fn start(&self, r: LegRequest) -> Result<(LegHead, mpsc::Receiver<LegEvent>, Option<Arc<TokenLedger>>), GatewayError> {
        let route = Route::of_path(r.path).ok_or_else(|| GatewayError::invalid(None, format!("{} is not served by gRPC workers", r.path)))?;
        let wire = timeout_at(r.deadline, self.wire(&r.url, r.leg)).await.map_err(|_| deadline_error(r.leg))??;
        let tok = timeout_at(r.deadline, self.tokenizer(&wire, &r.url, r.leg)).await.map_err(|_| deadline_error(r.leg))??;
        let mut parsed = request::parse_shared(&tok, route, &r.body, &r.request_id, &r.prompts)?;
        parsed.shape.resumed_ids = r.resumed_ids;
        // Every call of the leg at once; their events merged, numbered answer-wide.
        let started = futures_util::future::try_join_all(parsed.calls.iter().map(|c| wire.generate(c, &parsed.shape, r.leg)));
        let streams = timeout_at(r.deadline, started).await.map_err(|_| deadline_error(r.leg))??;
        let stream: wire::GenStream = Box::pin(futures_util::stream::select_all(streams.into_iter().zip(&parsed.calls).map(|(s, c)| {
            let first = c.first;
            s.map(move |e| e.map(|g| g.offset(first))).boxed()
        })));
        let stream_mode = parsed.shape.stream;
        let ct = if stream_mode { "text/event-stream" } else { "application/json" };
        let head = LegHead { status: StatusCode::OK, content_type: Some(HeaderValue::from_static(ct)) };
        let (tx, rx) = mpsc::channel(EVENT_BUFFER);
        let served = wire.served_model().to_string();
        // The relay skips reading the bytes for ids only when the writer really keeps them aside.
        let ledger = (r.ids_to_ledger && parsed.shape.ledger_fits()).then(|| Arc::new(TokenLedger::default()));
        // The text the engine's own HTTP surface would send: vLLM never sends a tail that ends
        // inside a character (docs/grpc-workers.md, "Real vLLM over gRPC"); SGLang writes it.
        let tail = match wire.service() {
            wire::Service::Vllm => ReplacementTail::Dropped,
            wire::Service::Sglang => ReplacementTail::Lossy,
        };
        tokio::spawn(pump(tok, Answer { shape: parsed.shape, served, tail }, stream, tx, r.leg, ledger.clone()));
        Ok((head, rx, ledger))
    }
}

/// Reads the engine's stream and writes the route's bytes, until the end, an error, or the
/// relay dropping its side (then the call is dropped, which cancels it at the engine).
/// What the pump writes: the route's shape, the model name it answers with, and the engine's
/// rule for a tail that ends inside a character.
struct Answer {
    shape: request::Shape,
    served: String,
    tail: ReplacementTail,
}

async fn pump(tok: Arc<ModelTokenizer>, answer: Answer, mut stream: wire::GenStream, tx: mpsc::Sender<LegEvent>, leg: Leg, ledger: Option<Arc<TokenLedger>>) {
    let mut writer = Writer::with_tail(answer.shape, &tok, &answer.served, answer.tail).with_ledger(ledger);
    loop {
        let next = tokio::select! {
            _ = tx.closed() => return,
            next = stream.next() => next,
        };
        let event = match next {
            // Every choice completed: the answer is whole, whatever status ends the call (an
            // engine that drops the call right after its last message must not cost the client
            // its answer, nor be resumed).
            end @ (None | Some(Err(_))) if writer.all_done() => {
                if let Some(Err(e)) = end {
                    tracing::debug!(leg = ?leg, error = %e, "gRPC call ended by an error after every choice completed");
                }
                LegEvent::Chunk(if writer.stream() { writer.end_stream() } else { writer.whole() })
            }
            None => LegEvent::Error(GatewayError::unreachable(leg, format!("{} gRPC stream ended before every choice completed", whose(leg)))),
            Some(Err(e)) => LegEvent::Error(e),
            Some(Ok(gen)) => match writer.on_event(gen) {
                Ok(Some(bytes)) if writer.stream() => {
                    if tx.send(LegEvent::Chunk(bytes)).await.is_err() {
                        return;
                    }
                    continue;
                }
                Ok(_) => continue,
                Err(e) => LegEvent::Error(e.on(leg)),
            },
        };
        let _ = tx.send(event).await;
        return;
    }
}

fn events(rx: mpsc::Receiver<LegEvent>) -> crate::clients::client::LegEvents {
    Box::pin(futures_util::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|e| (e, rx)) }))
}

impl WorkerClient for Arc<GrpcClient> {
    fn send(&self, r: LegRequest) -> LegFuture<LegAnswer> {
        let this = self.clone();
        Box::pin(async move {
            let (head, rx, ledger) = this.start(r).await?;
            Ok(LegAnswer { head, events: events(rx), ledger })
        })
    }

    fn call(&self, r: LegRequest, limit: usize) -> LegFuture<Bytes> {
        let this = self.clone();
        Box::pin(async move {
            let (leg, deadline) = (r.leg, r.deadline);
            let (_, mut rx, _) = this.start(r).await?;
            let read = async {
                let mut buf = BytesMut::new();
                while let Some(event) = rx.recv().await {
                    match event {
                        LegEvent::Chunk(b) if buf.len() + b.len() > limit => {
                            return Err(GatewayError::bad_worker_response(leg, format!("{} answer exceeds {limit} bytes", whose(leg))));
                        }
                        LegEvent::Chunk(b) => buf.extend_from_slice(&b),
                        LegEvent::Error(e) => return Err(e),
                    }
                }
                Ok(buf.freeze())
            };
            timeout_at(deadline, read).await.map_err(|_| answering_deadline_error(leg))?
        })
    }

    fn abort(&self, url: &str, how: &AbortStyle) {
        // Dropping the call already cancels it at the engine; an explicit Abort also reaches a
        // prefill whose own call has ended (its KV held for a decode that will not come).
        let AbortStyle::AbortRequest { rid } = how else { return };
        let Ok(rt) = tokio::runtime::Handle::try_current() else { return };
        let Some(wire) = self.workers.lock().unwrap_or_else(|p| p.into_inner()).get(url).cloned() else { return };
        let rid = rid.clone();
        let url = url.to_string();
        rt.spawn(async move {
            match tokio::time::timeout(ABORT_TIMEOUT, wire.abort(&rid)).await {
                Ok(Ok(())) => tracing::debug!(worker = %url, rid = %rid, "gRPC abort sent"),
                Ok(Err(e)) => tracing::debug!(worker = %url, rid = %rid, error = %e, "gRPC abort not delivered"),
                Err(_) => tracing::debug!(worker = %url, rid = %rid, "gRPC abort timed out"),
            }
        });
    }

    /// A gRPC prefill's Mooncake engine id comes from its `GetServerInfo.kv_engine_id` (the
    /// bootstrap server is still where the decode pushes from: `bootstrap_base` is the plan's).
    fn engine_id(&self, prefill_url: &str, _bootstrap_base: &str, deadline: Instant) -> LegFuture<String> {
        let (this, url) = (self.clone(), prefill_url.to_string());
        Box::pin(async move {
            let ask = async {
                let wire = this.wire(&url, Leg::Prefill).await?;
                wire.kv_engine_id(Leg::Prefill).await
            };
            // Bounded like the HTTP `/query`: a prefill that does not say is not waited on.
            timeout_at(deadline.min(Instant::now() + CONNECT_TIMEOUT), ask).await.map_err(|_| deadline_error(Leg::Prefill))?
        })
    }
}

#[cfg(test)]
#[path = "eviction_tests.rs"]
mod eviction_tests;

#[cfg(test)]
#[path = "pump_tests.rs"]
mod pump_tests;
