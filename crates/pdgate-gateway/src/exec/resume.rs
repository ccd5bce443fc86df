//! Resume after decode death: a stream whose decode (or only worker) dies after tokens reached
//! the client is continued on a new pair, in the same client stream.
//!
//! Before the legs are built, [`Resumer::prepare`] decides whether the request could be
//! continued exactly (`pdgate_protocol::resume::refusal`); if so the decode is asked for token
//! ids (`return_token_ids`) and the relay feeds every chunk through a
//! [`ResumeTracker`], which learns the prompt's and the generated ids and hides the ids from a
//! client that did not ask for them (scanning each event's bytes, not parsing them: the relay
//! stays a byte relay). When the relayed leg breaks (connection lost, or the end
//! without `[DONE]`), the relay calls [`Resumer::resume`]: the prompt ids plus every generated
//! id go as a `/v1/completions` request with `max_tokens` reduced by what was generated, through
//! a normal attempt (`transaction::attempt`: select, plan, new room or transfer id, both legs)
//! that avoids the workers that failed this request, within the request's deadline. The
//! transaction hands that attempt in ([`Continue`]), so this file does not import it back. Its stream
//! is rewritten to read as the rest of the first one (same id, choice index, usage of the
//! whole answer). At most `--max-resumes` continuations; what happened is counted in
//! `pdgate_resumes_total{result,reason}` and logged.

use std::future::Future;
use std::pin::Pin;

use bytes::Bytes;
use pdgate_core::breaker::Outcome;
use pdgate_core::GatewayError;
use pdgate_protocol::resume::{refusal, refusal_given, ResumeTracker, TokenLedger};
use pdgate_protocol::{Endpoint, ParsedRequest};
use serde_json::Value;
use tokio::time::Instant;

use super::relay::StreamRelay;
use super::{AttemptFailure, Ctx};
use crate::observe::record::Record;

/// Runs a continuation as one normal attempt, avoiding the workers given; `Ok(None)` when it
/// answered whole instead of as a stream. Handed in by the transaction (`transaction.rs`).
pub type Continue = for<'a> fn(&'a Ctx, &'a [String], &'a mut Record) -> Continuing<'a>;

/// A continuation's attempt, running.
pub type Continuing<'a> = Pin<Box<dyn Future<Output = Result<Option<StreamRelay>, AttemptFailure>> + Send + 'a>>;

/// What a stream needs to be resumed; attached to its relay at commit.
pub struct Resumer {
    /// The request's context (a copy bound at commit: state, request, deadline, ids).
    ctx: Option<Box<Ctx>>,
    /// Why this request will not be resumed, decided before it was sent.
    refused: Option<&'static str>,
    tracker: Option<ResumeTracker>,
    left: u32,
    /// Workers that failed this stream: no continuation goes to them.
    failed: Vec<String>,
    /// The decision the stream started with, for the log.
    first_route: Record,
    /// Why the last death was not resumed, for the stream's error event.
    why_not: Option<String>,
    /// How a continuation runs (the transaction's attempt).
    run: Continue,
}

impl Resumer {
    /// `None` when nothing can be resumed: `--max-resumes 0`, or a whole (non-stream) answer,
    /// which the retry loop already re-sends before any byte reached the client. For a request
    /// that can be continued exactly, the decode is asked for token ids.
    pub fn prepare(ctx: &mut Ctx, run: Continue) -> Option<Resumer> {
        let left = ctx.state.config.max_resumes;
        if left == 0 || !ctx.req.stream {
            return None;
        }
        let mut refused = refusal(&ctx.req);
        // A `/generate` text prompt: its stream never gives the prompt's ids, the gateway's
        // tokenizer (`--model-path`) can. Checked against the engine's count on the first event.
        let text_ids = if refused == Some("generate_text") { ctx.routing_ids().map(<[u32]>::to_vec) } else { None };
        if text_ids.is_some() {
            refused = refusal_given(&ctx.req, true);
        }
        // EPD: a continuation is a completions request of token ids; the images' embeddings
        // would not be in it.
        if refused.is_none() && !ctx.images.is_empty() {
            refused = Some("images");
        }
        let tracker = refused.is_none().then(|| match &text_ids {
            Some(ids) => ResumeTracker::with_prompt_ids(&ctx.req, ids),
            None => ResumeTracker::new(&ctx.req),
        });
        // `/generate` streams give `output_ids` anyway; the OpenAI routes are asked for them.
        let openai = ctx.req.endpoint != Endpoint::Generate;
        if tracker.is_some() && openai && ctx.req.body.get("return_token_ids") != Some(&Value::Bool(true)) {
            ctx.req.add_field("return_token_ids", Value::Bool(true));
            ctx.ids_to_ledger = true;
        }
        Some(Resumer { ctx: None, refused, tracker, left, failed: Vec::new(), first_route: Record::default(), why_not: None, run })
    }

    /// The stream committed: keep what a continuation will need (`Ctx::for_resume`).
    pub fn bind(mut self, ctx: Ctx, record: &Record) -> Resumer {
        self.ctx = Some(Box::new(ctx));
        self.first_route = record.clone();
        self
    }

    /// Whether the relay must pass its chunks through [`Resumer::process`] (and so holds
    /// partial events back).
    pub fn tracking(&self) -> bool {
        self.tracker.is_some()
    }

    /// Tokens of the answer generated so far (before the running continuation, once one began).
    pub fn generated(&self) -> u64 {
        self.tracker.as_ref().map_or(0, |t| t.progress.generated() as u64)
    }

    /// The prompt's and the answer's token counts, from the ids the tracker read.
    pub fn counted(&self) -> Option<(u64, u64)> {
        self.tracker.as_ref()?.progress.counts()
    }

    /// Whether the first stream's engine sent token ids (see `ResumeTracker::gave_ids`).
    pub fn gave_ids(&self) -> Option<bool> {
        self.tracker.as_ref()?.gave_ids()
    }

    /// Learns the running stream's ids from its worker client's ledger (gRPC legs keep them
    /// there instead of in the bytes).
    pub fn absorb(&mut self, ledger: &TokenLedger) {
        if let Some(t) = self.tracker.as_mut() {
            t.progress.absorb(ledger);
        }
    }

    /// Whether chunks must pass [`Resumer::process`]: yes unless their ids are in a ledger and
    /// no continuation runs (a continuation's chunks are rewritten to read as the first's).
    pub fn reads_bytes(&self, ledger: bool) -> bool {
        self.tracker.as_ref().is_some_and(|t| !ledger || t.continuing())
    }

    /// One relayed chunk as the client is to see it.
    pub fn process(&mut self, chunk: Bytes) -> Bytes {
        match self.tracker.as_mut() {
            // Mostly the chunk itself: the tracker reads events in place and re-frames none.
            Some(t) => t.process_raw(&chunk).map_or(chunk, Bytes::from),
            None => chunk,
        }
    }

    /// Whether `err` is a relayed leg that died (not the deadline, not a refused answer, not
    /// a worker that was never reached: that one never started, a plain retry).
    pub fn is_death(err: &GatewayError) -> bool {
        use pdgate_core::{ErrorKind, Leg};
        matches!(err.leg, Some(Leg::Decode | Leg::Regular)) && matches!(err.kind, ErrorKind::WorkerUnreachable | ErrorKind::StreamTruncated) && !err.not_sent
    }

    /// Why the stream was not continued after its relayed leg died (for its error event).
    pub fn why_not(&self) -> Option<&str> {
        self.why_not.as_deref()
    }

    fn refuse(&mut self, reason: &'static str, err: &GatewayError) -> Option<StreamRelay> {
        self.why_not = Some(reason.to_string());
        if let Some(ctx) = &self.ctx {
            ctx.state.metrics.resumes.with_label_values(&["refused", reason]).inc();
            tracing::warn!(request_id = %ctx.request_id, reason, error = %err, route = %self.first_route.full(), "stream not resumed after its decode died");
        }
        None
    }

    /// Continues the stream on a new pair after `dead` (the relayed worker) failed with `err`:
    /// the continuation's relay, its first chunk not yet read, or `None` (then the stream ends
    /// with the error event, as without resuming).
    pub async fn resume(&mut self, dead: &str, err: &GatewayError) -> Option<StreamRelay> {
        if let Some(reason) = self.refused {
            return self.refuse(reason, err);
        }
        if self.left == 0 {
            return self.refuse("max_resumes", err);
        }
        let ctx = self.ctx.as_deref()?;
        if Instant::now() >= ctx.deadline {
            return self.refuse("deadline", err);
        }
        let limit = ctx.state.fleet.registry.routing().snapshot.context_limit(ctx.req.model.as_deref());
        let progress = &self.tracker.as_ref()?.progress;
        let generated = progress.generated();
        let endpoint = if progress.native() { Endpoint::Generate } else { Endpoint::Completions };
        let body = match progress.continuation(&ctx.req, limit) {
            Ok(b) => b,
            Err(reason) => return self.refuse(reason, err),
        };
        self.left -= 1;
        self.failed.push(dead.to_string());
        let left = body.get("max_tokens").or_else(|| body.get("sampling_params")?.get("max_new_tokens")).and_then(Value::as_u64);
        let req = ParsedRequest {
            endpoint,
            body,
            stream: true,
            batch_items: None,
            wants_input_logprobs: false,
            model: ctx.req.model.clone(),
            max_tokens: left.map(|n| (n, "max_tokens")),
            // The continuation's prompt is the original prompt plus what was generated.
            prompt_tokens: ctx.req.prompt_tokens + generated as u64,
            rewritten: true,
            added: Vec::new(),
            resumed_ids: generated,
        };
        // A new rendezvous: the dead pair may still hold the old id.
        let request_id = crate::request_id::mint(ctx.client_request_id.as_deref());
        let cont = Ctx { req, raw: Bytes::new(), request_id, prompt_ids: Default::default(), prompt_memo: Default::default(), ..ctx.clone() };
        let mut record = Record::default();
        let metrics = &ctx.state.metrics;
        match (self.run)(&cont, &self.failed, &mut record).await {
            Ok(Some(relay)) => {
                metrics.resumes.with_label_values(&["resumed", "decode_died"]).inc();
                tracing::info!(request_id = %ctx.request_id, continuation_id = %cont.request_id, dead, generated, error = %err,
                    from = %self.first_route.full(), to = %record.full(), "stream resumed on a new pair after its decode died");
                if let Some(t) = self.tracker.as_mut() {
                    t.begin_continuation();
                }
                Some(relay)
            }
            Ok(None) => {
                metrics.resumes.with_label_values(&["failed", "not_a_stream"]).inc();
                self.why_not = Some("the continuation was not a stream".into());
                None
            }
            Err(f) => {
                if let Some(url) = &f.worker {
                    ctx.state.fleet.record_outcome(url, Outcome::of_attempt(&f.error, ctx.started));
                    ctx.state.fleet.note_worker_error(url, &f.error);
                    self.failed.push(url.clone());
                }
                metrics.resumes.with_label_values(&["failed", f.error.reason()]).inc();
                self.why_not = Some(format!("the continuation failed ({})", f.error.code()));
                tracing::warn!(request_id = %ctx.request_id, dead, error = %err, continuation_error = %f.error, "resuming the stream failed");
                None
            }
        }
    }
}

/// A non-streamed request whose decode died (nothing reached the client: its answer comes
/// whole) is sent again on a new pair, avoiding the dead decode, when the retry loop would not
/// (retries off or over budget): at most `--max-resumes` times, within the deadline. `used`
/// counts this request's resumes.
pub fn resume_whole(ctx: &Ctx, err: &GatewayError, used: &mut u32) -> bool {
    // Only a PD decode that had the request: a regular worker that fails a whole answer, or a
    // decode that refused the connection (or failed the TLS handshake), never started: that is
    // a plain retry, which the operator may have turned off (`is_death`).
    if ctx.req.stream || err.leg != Some(pdgate_core::Leg::Decode) || !Resumer::is_death(err) || *used >= ctx.state.config.max_resumes || Instant::now() >= ctx.deadline {
        return false;
    }
    *used += 1;
    ctx.state.metrics.resumes.with_label_values(&["resumed", "decode_died_whole"]).inc();
    tracing::info!(request_id = %ctx.request_id, error = %err, "non-streamed request resumed on a new pair after its decode died");
    true
}
