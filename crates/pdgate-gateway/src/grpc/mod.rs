//! gRPC workers (`grpc://HOST:PORT`): the SMG contract's SGLang `SglangScheduler` and vLLM
//! `VllmEngine` services, as a second [`WorkerClient`] under the same transaction.
//!
//! A leg arrives as the HTTP client gets it (route path + JSON body). The gateway tokenizes it
//! (chat template for chat) with its tokenizer, sends a `GenerateRequest`, and writes the token
//! answer back as the bytes the engine's HTTP surface would have written (`response.rs`), so
//! relay, accounting, retries, resume and the decision record work unchanged.
//!
//! - `pb`:       the generated messages and clients (scripts/gen_grpc_protos);
//! - `request`:  JSON body → prompt ids, sampling, answer shape;
//! - `response`: token events → JSON / SSE;
//! - `wire`:     the two services behind one interface (which one from `GetModelInfo`).

pub mod pb;
pub mod request;
pub mod response;
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
use pdgate_tokenizer::ModelTokenizer;
use tokio::sync::mpsc;
use tokio::time::{timeout_at, Instant};

use crate::exec::client::{LegAnswer, LegEvent, LegFuture, LegHead, LegRequest, WorkerClient};
use crate::exec::leg::{answering_deadline_error, deadline_error, whose};
use crate::registry::EngineInfo;
use request::Route;
use response::Writer;
pub use wire::Wire;

/// Longest wait for a connection, and for a management call (info, health, loads, abort).
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
const ABORT_TIMEOUT: Duration = Duration::from_secs(2);
/// Stream events buffered between the engine's stream and the relay.
const EVENT_BUFFER: usize = 32;

/// The gRPC [`WorkerClient`], and the management calls health and load polling make.
#[derive(Default)]
pub struct GrpcClient {
    /// `--model-path` / `--tokenizer-path`'s tokenizer, set at start-up.
    tokenizer: OnceLock<Arc<ModelTokenizer>>,
    /// One connection (HTTP/2, multiplexed) and service kind per worker URL.
    workers: Mutex<HashMap<String, Arc<Wire>>>,
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
        let wire = Arc::new(Wire::detect(url, leg).await?);
        self.workers.lock().unwrap_or_else(|p| p.into_inner()).insert(url.to_string(), wire.clone());
        Ok(wire)
    }

    /// Forgets a worker's connection (it was removed, or its service may have changed).
    pub fn forget(&self, url: &str) {
        self.workers.lock().unwrap_or_else(|p| p.into_inner()).remove(url);
    }

    fn tokenizer(&self, leg: Leg) -> Result<Arc<ModelTokenizer>, GatewayError> {
        // Fetching the tokenizer from the worker's GetTokenizer is not built yet: say what to do.
        self.tokenizer.get().cloned().ok_or_else(|| {
            GatewayError::bad_worker_response(
                leg,
                "gRPC workers take token ids: start the gateway with --model-path or --tokenizer-path (fetching the tokenizer over GetTokenizer is not supported yet)",
            )
        })
    }

    /// Health: the service's `HealthCheck`, within `limit`.
    pub async fn health(&self, url: &str, limit: Duration) -> Result<(), String> {
        let check = async {
            let wire = self.wire(url, Leg::Regular).await.map_err(|e| e.message)?;
            let out = wire.health().await;
            if out.is_err() {
                // A worker that restarted may serve another service: detect it again next time.
                self.forget(url);
            }
            out
        };
        tokio::time::timeout(limit, check).await.unwrap_or_else(|_| Err(format!("gRPC HealthCheck: no answer within {} s", limit.as_secs())))
    }

    /// Models, mode, runtime, KV layout and context length, from `GetModelInfo`/`GetServerInfo`.
    pub async fn engine_info(&self, url: &str, limit: Duration) -> EngineInfo {
        let info = async { self.wire(url, Leg::Regular).await.ok()?.engine_info().await };
        tokio::time::timeout(limit, info).await.ok().flatten().unwrap_or_default()
    }

    /// The worker's load, from `GetLoads`.
    pub async fn loads(&self, url: &str, limit: Duration) -> Option<EngineLoad> {
        let loads = async { self.wire(url, Leg::Regular).await.ok()?.loads().await };
        tokio::time::timeout(limit, loads).await.ok().flatten()
    }

    /// Sends a leg: tokenize, `Generate`, and a task that writes the answer as the route's
    /// bytes. Resolves when the engine accepted the call (its response head).
    async fn start(&self, r: LegRequest) -> Result<(LegHead, mpsc::Receiver<LegEvent>), GatewayError> {
        let route = Route::of_path(r.path).ok_or_else(|| GatewayError::invalid(None, format!("{} is not served by gRPC workers", r.path)))?;
        let tok = self.tokenizer(r.leg)?;
        let parsed = request::parse(&tok, route, &r.body, &r.request_id)?;
        let wire = timeout_at(r.deadline, self.wire(&r.url, r.leg)).await.map_err(|_| deadline_error(r.leg))??;
        let stream = timeout_at(r.deadline, wire.generate(&parsed, r.leg)).await.map_err(|_| deadline_error(r.leg))??;
        let stream_mode = parsed.shape.stream;
        let ct = if stream_mode { "text/event-stream" } else { "application/json" };
        let head = LegHead { status: StatusCode::OK, content_type: Some(HeaderValue::from_static(ct)) };
        let (tx, rx) = mpsc::channel(EVENT_BUFFER);
        let served = wire.served_model().to_string();
        tokio::spawn(pump(tok, parsed.shape, served, stream, tx, r.leg));
        Ok((head, rx))
    }
}

/// Reads the engine's stream and writes the route's bytes, until the end, an error, or the
/// relay dropping its side (then the call is dropped, which cancels it at the engine).
async fn pump(tok: Arc<ModelTokenizer>, shape: request::Shape, served: String, mut stream: wire::GenStream, tx: mpsc::Sender<LegEvent>, leg: Leg) {
    let mut writer = Writer::new(shape, &tok, &served);
    loop {
        let next = tokio::select! {
            _ = tx.closed() => return,
            next = stream.next() => next,
        };
        let event = match next {
            None if writer.all_done() => LegEvent::Chunk(if writer.stream() { writer.end_stream() } else { writer.whole() }),
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

fn events(rx: mpsc::Receiver<LegEvent>) -> crate::exec::client::LegEvents {
    Box::pin(futures_util::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|e| (e, rx)) }))
}

impl WorkerClient for Arc<GrpcClient> {
    fn send(&self, r: LegRequest) -> LegFuture<LegAnswer> {
        let this = self.clone();
        Box::pin(async move {
            let (head, rx) = this.start(r).await?;
            Ok(LegAnswer { head, events: events(rx) })
        })
    }

    fn call(&self, r: LegRequest, limit: usize) -> LegFuture<Bytes> {
        let this = self.clone();
        Box::pin(async move {
            let (leg, deadline) = (r.leg, r.deadline);
            let (_, mut rx) = this.start(r).await?;
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

    fn engine_id(&self, _prefill_url: &str, _bootstrap_base: &str, _deadline: Instant) -> LegFuture<String> {
        Box::pin(async { Err(GatewayError::protocol(Leg::Prefill, "Mooncake over gRPC workers is not supported yet")) })
    }
}
