//! The worker client: how the transaction talks to an engine, whatever the wire.
//!
//! The transaction (`transaction.rs`) runs a plan's legs over a [`WorkerClient`]: a streaming
//! call that resolves at the answer's head and then yields [`LegEvent`]s, a whole-response call,
//! an engine abort, and the Mooncake engine-id lookup. HTTP (`http_client.rs`) is the first
//! implementation; a gRPC client (token ids in, typed events out) is meant to be the second.
//!
//! Events carry the worker's bytes as they came (`Chunk`): the relay parses a chunk only when a
//! rewrite needs it (usage, logprobs, the cached-token report) and passes the rest through, so
//! streaming costs no per-chunk parse. Usage and logprobs are typed values the relay derives
//! from chunks (`pdgate_protocol::usage`, `logprobs`).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use axum::http::{HeaderValue, StatusCode};
use bytes::Bytes;
use futures_util::Stream;
use pdgate_core::plan::AbortStyle;
use pdgate_core::{GatewayError, Leg};
use pdgate_protocol::resume::TokenLedger;
use tokio::time::Instant;

/// A boxed leg future: owned, so a leg can outlive the function that sent it (a prefill is
/// drained after the decode's answer went out).
pub type LegFuture<T> = Pin<Box<dyn Future<Output = Result<T, GatewayError>> + Send>>;

/// The events of a leg's answer after its head; `None` at the worker's end of the answer.
pub type LegEvents = Pin<Box<dyn Stream<Item = LegEvent> + Send>>;

/// One leg as sent: to `url` + `path`, with the attempt's request id (`X-Request-Id`).
#[derive(Clone, Debug)]
pub struct LegRequest {
    pub url: String,
    pub path: &'static str,
    pub body: Bytes,
    pub request_id: String,
    pub leg: Leg,
    pub deadline: Instant,
    /// The prompt's last ids that are the answer's own (a resume's continuation, see
    /// `ParsedRequest::resumed_ids`); HTTP workers detokenize themselves and ignore it.
    pub resumed_ids: usize,
    /// The resume tracker, not the client, wants the answer's token ids: a client that writes
    /// the answer from ids (gRPC) keeps them in the answer's [`TokenLedger`] instead of writing
    /// them into its bytes; HTTP workers are asked for them in the body and ignore this.
    pub ids_to_ledger: bool,
    /// The request's prompts as its first tokenized leg found them (`Ctx::prompt_memo`): a client
    /// that tokenizes (gRPC) does so once per request, not once per leg.
    pub prompts: crate::clients::grpc::PromptMemo,
}

/// A worker accepted the leg (a 2xx head): the status and content type to relay.
#[derive(Clone, Debug)]
pub struct LegHead {
    pub status: StatusCode,
    pub content_type: Option<HeaderValue>,
}

/// What a leg's answer yields after its head.
#[derive(Debug)]
pub enum LegEvent {
    /// Answer bytes as the worker framed them (SSE text for a stream, JSON otherwise).
    Chunk(Bytes),
    /// The answer broke off; the error names the leg.
    Error(GatewayError),
}

/// A leg's answer: its head and the events that follow.
pub struct LegAnswer {
    pub head: LegHead,
    pub events: LegEvents,
    /// The ids the answer's chunks carry, when the client keeps them aside (`ids_to_ledger`).
    pub ledger: Option<Arc<TokenLedger>>,
}

/// How the transaction reaches workers.
pub trait WorkerClient: Send + Sync {
    /// The streaming call: sends the leg and resolves at a 2xx head (with the events to come),
    /// or with the leg's error (unreachable, a worker status with its body, a refused encoding,
    /// no head by the deadline).
    fn send(&self, req: LegRequest) -> LegFuture<LegAnswer>;
    /// The whole-response call: the leg's complete answer, at most `limit` bytes, by the
    /// request's deadline.
    fn call(&self, req: LegRequest, limit: usize) -> LegFuture<Bytes>;
    /// Tells the engine a leg was given up, off the request path (fire-and-forget, bounded).
    fn abort(&self, url: &str, how: &AbortStyle);
    /// A Mooncake prefill's engine id, from its bootstrap server (`bootstrap_base`/query);
    /// `prefill_url` is the prefill's own address (its scheme decides what may be sent there).
    fn engine_id(&self, prefill_url: &str, bootstrap_base: &str, deadline: Instant) -> LegFuture<String>;
}

/// Aborts a leg at the engine when dropped while armed: a leg the transaction gives up for any
/// reason (client gone, the other leg failed, the deadline, an error) is told so.
pub struct AbortGuard {
    target: Option<(Arc<dyn WorkerClient>, String, AbortStyle)>,
}

impl AbortGuard {
    /// Armed for legs whose engine needs to be told; inert for those that close by themselves
    /// when their connection is dropped.
    pub fn new(client: &Arc<dyn WorkerClient>, url: &str, how: &AbortStyle) -> Self {
        let target = match how {
            AbortStyle::CloseConnection => None,
            AbortStyle::AbortRequest { .. } => Some((client.clone(), url.to_string(), how.clone())),
        };
        AbortGuard { target }
    }

    /// The leg ended on its own (answered or failed at the worker): nothing to abort.
    pub fn disarm(&mut self) {
        self.target = None;
    }
}

impl Drop for AbortGuard {
    fn drop(&mut self) {
        if let Some((client, url, how)) = self.target.take() {
            client.abort(&url, &how);
        }
    }
}
