//! A fast gRPC mock engine for the gRPC benchmark (`bench/gateway/grpc_bench.sh`): serves SGLang's
//! scheduler service (`sglang.grpc.scheduler.SglangScheduler`, the SMG contract) as fast as tonic
//! allows, so that what the benchmark measures through a gateway in gRPC mode (pdgate's or
//! SMG's) is the gateway: its tokenizing, detokenizing and JSON writing. Not a product, not a
//! test fixture.
//!
//!   cargo build --release -p pdgate-gateway --example grpc_mock
//!   target/release/examples/grpc_mock PORT [regular|prefill|decode] MODEL_DIR
//!
//! MODEL_DIR is a Hugging Face style directory (`pdgate engine --model tiny --export-tokenizer
//! DIR`); the mock encodes a fixed English sentence with its tokenizer, so every answer is token
//! ids that a gateway detokenizes to real text.
//!
//! - `Generate`: `STREAM_CHUNKS` (default 8) tokens per choice (`n` choices), whatever the
//!   sampling asks (stop strings and max tokens are not applied; finish reason `length`). A
//!   stream is one `GenerateStreamChunk` per token, each its own write (the stream yields to the
//!   runtime between messages, as an engine emitting tokens does), then a `GenerateComplete`
//!   repeating the last chunk's ids (as SGLang's servicer and the reference engine do). A whole
//!   answer is one `GenerateComplete` per choice with every id. Usage: the prompt's length,
//!   the whole prompt reported cached.
//! - `prefill`: one token per answer (what an SGLang prefill returns after sending its KV).
//! - `GetModelInfo`, `GetServerInfo` (server args with `disaggregation_mode`), `HealthCheck`,
//!   `GetLoads` (in-flight calls as running requests), `Abort`. Everything else: UNIMPLEMENTED.
//! - Per-RPC call counts go to stderr when the process gets SIGINT/SIGTERM (what a gateway asks
//!   of its workers at start-up and per request); `GRPC_MOCK_LOG=1` also logs every call.
#![allow(clippy::unwrap_used, clippy::expect_used)] // bench code: a panic is the failure report

use std::collections::BTreeMap;
use std::pin::Pin;
use std::sync::atomic::{AtomicI32, AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};

use futures_util::Stream;
use pdgate_gateway::grpc::pb::sglang_pb::sglang_scheduler_server::{SglangScheduler, SglangSchedulerServer};
use pdgate_gateway::grpc::pb::sglang_pb::{self as pb, generate_response::Response as Answer};
use prost_types::value::Kind;
use tonic::{Request, Response, Status};

const SERVED_MODEL: &str = "mock-model";
/// What the answers say, before the tokenizer turns it into ids.
const TEXT: &str = " The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs.";
const RPCS: [&str; 6] = ["Generate", "GetModelInfo", "GetServerInfo", "HealthCheck", "GetLoads", "Abort"];

struct Mock {
    mode: String,
    model_dir: String,
    /// The ids one choice answers (the first `STREAM_CHUNKS` of `TEXT`, or one for a prefill).
    ids: Vec<u32>,
    in_flight: Arc<AtomicI32>,
    calls: Arc<[AtomicU64; RPCS.len()]>,
    log: bool,
}

impl Mock {
    fn count(&self, rpc: usize, detail: impl FnOnce() -> String) {
        self.calls[rpc].fetch_add(1, Ordering::Relaxed);
        if self.log {
            eprintln!("grpc_mock: {} {}", RPCS[rpc], detail());
        }
    }
}

/// Messages sent one per poll, pending once between them (so each is its own write), and the
/// in-flight count held until the stream ends or is dropped.
struct Messages {
    items: std::vec::IntoIter<pb::GenerateResponse>,
    yielded: bool,
    in_flight: Arc<AtomicI32>,
}

impl Stream for Messages {
    type Item = Result<pb::GenerateResponse, Status>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        if !self.yielded {
            self.yielded = true;
            cx.waker().wake_by_ref();
            return Poll::Pending;
        }
        self.yielded = false;
        Poll::Ready(self.items.next().map(Ok))
    }
}

impl Drop for Messages {
    fn drop(&mut self) {
        self.in_flight.fetch_sub(1, Ordering::Relaxed);
    }
}

fn json_struct(fields: &[(&str, Kind)]) -> prost_types::Struct {
    prost_types::Struct { fields: fields.iter().map(|(k, v)| (k.to_string(), prost_types::Value { kind: Some(v.clone()) })).collect::<BTreeMap<_, _>>() }
}

#[tonic::async_trait]
impl SglangScheduler for Mock {
    async fn generate(&self, request: Request<pb::GenerateRequest>) -> Result<Response<Pin<Box<dyn Stream<Item = Result<pb::GenerateResponse, Status>> + Send>>>, Status> {
        let req = request.into_inner();
        self.count(0, || {
            format!("rid={} stream={} prompt_ids={} disagg={:?}", req.request_id, req.stream, req.tokenized.as_ref().map_or(0, |t| t.input_ids.len()), req.disaggregated_params)
        });
        let prompt = req.tokenized.as_ref().map_or(0, |t| t.input_ids.len()) as u32;
        if prompt == 0 {
            return Err(Status::invalid_argument("tokenized.input_ids is empty"));
        }
        let n = req.sampling_params.as_ref().map_or(1, |s| s.n.max(1));
        let total = self.ids.len() as u32;
        let complete = |index: u32, ids: Vec<u32>| pb::GenerateResponse {
            request_id: req.request_id.clone(),
            response: Some(Answer::Complete(pb::GenerateComplete {
                output_ids: ids,
                finish_reason: "length".into(),
                prompt_tokens: prompt,
                completion_tokens: total,
                cached_tokens: prompt,
                index,
                ..Default::default()
            })),
        };
        let mut items = Vec::new();
        for index in 0..n {
            if !req.stream {
                items.push(complete(index, self.ids.clone()));
                continue;
            }
            for (k, id) in self.ids.iter().enumerate() {
                items.push(pb::GenerateResponse {
                    request_id: req.request_id.clone(),
                    response: Some(Answer::Chunk(pb::GenerateStreamChunk {
                        token_ids: vec![*id],
                        prompt_tokens: prompt,
                        completion_tokens: k as u32 + 1,
                        cached_tokens: prompt,
                        index,
                        ..Default::default()
                    })),
                });
            }
            items.push(complete(index, self.ids.last().map(|id| vec![*id]).unwrap_or_default()));
        }
        self.in_flight.fetch_add(1, Ordering::Relaxed);
        Ok(Response::new(Box::pin(Messages { items: items.into_iter(), yielded: false, in_flight: self.in_flight.clone() })))
    }

    async fn health_check(&self, _: Request<pb::HealthCheckRequest>) -> Result<Response<pb::HealthCheckResponse>, Status> {
        self.count(3, String::new);
        Ok(Response::new(pb::HealthCheckResponse { healthy: true, message: "ok".into() }))
    }

    async fn abort(&self, request: Request<pb::AbortRequest>) -> Result<Response<pb::AbortResponse>, Status> {
        let req = request.into_inner();
        self.count(5, || format!("rid={}", req.request_id));
        Ok(Response::new(pb::AbortResponse { success: false, message: format!("Request {} not found", req.request_id) }))
    }

    async fn get_model_info(&self, _: Request<pb::GetModelInfoRequest>) -> Result<Response<pb::GetModelInfoResponse>, Status> {
        self.count(1, String::new);
        Ok(Response::new(pb::GetModelInfoResponse {
            model_path: self.model_dir.clone(),
            tokenizer_path: self.model_dir.clone(),
            is_generation: true,
            served_model_name: SERVED_MODEL.into(),
            max_context_length: 4096,
            vocab_size: 258,
            model_type: "llama".into(),
            eos_token_ids: vec![257],
            bos_token_id: 256,
            max_req_input_len: 4095,
            architectures: vec!["LlamaForCausalLM".into()],
            ..Default::default()
        }))
    }

    async fn get_server_info(&self, _: Request<pb::GetServerInfoRequest>) -> Result<Response<pb::GetServerInfoResponse>, Status> {
        self.count(2, String::new);
        let s = |v: &str| Kind::StringValue(v.to_string());
        let args = json_struct(&[
            ("model_path", s(&self.model_dir)),
            ("tokenizer_path", s(&self.model_dir)),
            ("served_model_name", s(SERVED_MODEL)),
            ("disaggregation_mode", s(&self.mode)),
            ("disaggregation_bootstrap_port", Kind::NumberValue(8998.0)),
            ("page_size", Kind::NumberValue(16.0)),
            ("context_length", Kind::NumberValue(4096.0)),
            ("tp_size", Kind::NumberValue(1.0)),
            ("dp_size", Kind::NumberValue(1.0)),
            ("max_total_num_tokens", Kind::NumberValue(1_048_576.0)),
        ]);
        Ok(Response::new(pb::GetServerInfoResponse {
            server_args: Some(args),
            scheduler_info: Some(json_struct(&[("max_total_num_tokens", Kind::NumberValue(1_048_576.0))])),
            active_requests: self.in_flight.load(Ordering::Relaxed),
            sglang_version: "grpc-mock".into(),
            server_type: "grpc".into(),
            max_total_num_tokens: 1_048_576,
            ..Default::default()
        }))
    }

    async fn get_loads(&self, _: Request<pb::GetLoadsRequest>) -> Result<Response<pb::GetLoadsResponse>, Status> {
        self.count(4, String::new);
        let running = self.in_flight.load(Ordering::Relaxed);
        let load = pb::SchedulerLoad { num_running_reqs: running, num_total_reqs: running, max_total_num_tokens: 1_048_576, max_running_requests: 1024, ..Default::default() };
        Ok(Response::new(pb::GetLoadsResponse {
            version: "grpc-mock".into(),
            dp_rank_count: 1,
            loads: vec![load],
            aggregate: Some(pb::AggregateMetrics { total_running_reqs: running, total_reqs: running, ..Default::default() }),
            ..Default::default()
        }))
    }
}

/// Waits for SIGINT/SIGTERM, then reports the call counts (before the graceful shutdown, which
/// waits for the gateways' connections).
async fn shutdown_signal(calls: Arc<[AtomicU64; RPCS.len()]>) {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).unwrap();
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
    let counts: Vec<String> = RPCS.iter().zip(calls.iter()).map(|(name, c)| format!("{name}={}", c.load(Ordering::Relaxed))).collect();
    eprintln!("grpc_mock calls: {}", counts.join(" "));
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let usage = "usage: grpc_mock PORT [regular|prefill|decode] MODEL_DIR";
    let port: u16 = args.get(1).ok_or(usage)?.parse()?;
    let mode = args.get(2).ok_or(usage)?.clone();
    let model_dir = args.get(3).ok_or(usage)?.clone();
    let chunks: usize = std::env::var("STREAM_CHUNKS").ok().and_then(|s| s.parse().ok()).unwrap_or(8);
    let tok = pdgate_tokenizer::ModelTokenizer::from_path(std::path::Path::new(&model_dir))?;
    let mut ids = Vec::new();
    while ids.len() < chunks {
        ids.extend(tok.encode(TEXT, false)?);
    }
    ids.truncate(if mode == "prefill" { 1 } else { chunks });
    let calls = Arc::new(std::array::from_fn(|_| AtomicU64::new(0)));
    let mode = if mode == "regular" { "null".to_string() } else { mode };
    let mock = Mock { mode, model_dir, ids, in_flight: Arc::new(AtomicI32::new(0)), calls: calls.clone(), log: std::env::var_os("GRPC_MOCK_LOG").is_some() };
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", port)).await?;
    let incoming = tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true));
    tonic::transport::Server::builder().add_service(SglangSchedulerServer::new(mock)).serve_with_incoming_shutdown(incoming, shutdown_signal(calls)).await?;
    Ok(())
}
