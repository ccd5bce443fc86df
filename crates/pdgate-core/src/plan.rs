//! The plan of one attempt: which legs run, in which order, what each carries, what is relayed.
//!
//! Built purely from the snapshot, the selection, the parsed request, the attempt's request id
//! and an injected rng, so every protocol's legs are unit-tested without a socket. The gateway's
//! transaction runs a plan over any worker client (`exec/transaction.rs`).
//!
//! | mode      | order         | prefill leg                               | decode leg (relayed)                        |
//! |-----------|---------------|-------------------------------------------|---------------------------------------------|
//! | regular   | one leg       | -                                         | the client's body as received               |
//! | bootstrap | concurrent    | the decode's body (streams: `stream` false) | body + `bootstrap_host/port/room`         |
//! | nixl      | prefill first | max_tokens 1, no stream, remote decode    | body + the prefill's `kv_transfer_params`   |
//! | mooncake  | concurrent    | max_tokens 1, no stream, `transfer_id`    | body + transfer id, P's engine id and addr  |

use rand::{Rng, RngCore};
use serde_json::{Map, Value};

use pdgate_protocol::bootstrap::{self, Rooms, MAX_ROOM};
use pdgate_protocol::kv_transfer;
use pdgate_protocol::{Endpoint, ParsedRequest};

use crate::error::{GatewayError, Leg};
use crate::policy::Selection;
use crate::snapshot::PoolSnapshot;
use crate::worker::{KvConnector, WorkerSpec, DEFAULT_BOOTSTRAP_PORT};

/// How the request is served.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// One worker, no split.
    Regular,
    /// Prefill/decode with the given KV connector.
    Pd(KvConnector),
}

impl Mode {
    pub fn as_str(self) -> &'static str {
        match self {
            Mode::Regular => "regular",
            Mode::Pd(c) => c.as_str(),
        }
    }
}

/// When the legs are sent.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Order {
    /// Regular mode: the relayed leg only.
    One,
    /// Both legs at once (SGLang bootstrap: the prefill blocks until the decode reserved KV;
    /// Mooncake: the prefill pushes to the decode).
    Concurrent,
    /// The prefill's whole answer first, then the decode (NIXL: the decode needs its params).
    PrefillFirst,
}

/// How the legs of an attempt find each other (also the decision record's rendezvous).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Rendezvous {
    /// SGLang bootstrap rooms.
    Rooms(Rooms),
    /// Mooncake `transfer_id`.
    TransferId(String),
    /// NIXL: the `X-Request-Id` both legs carry.
    RequestId(String),
}

/// What a leg sends.
#[derive(Clone, Debug, PartialEq)]
pub enum LegBody {
    /// The client's body as received (nothing to rewrite).
    Forward,
    /// A body the plan built.
    Json(Map<String, Value>),
    /// The relayed leg's bytes, unchanged (SGLang bootstrap: the same body to P and D).
    SameAsRelayed,
    /// NIXL decode: the client's body plus the params in the prefill's answer
    /// ([`nixl_decode`]), known only once the prefill answered.
    FromPrefillAnswer,
    /// Mooncake decode: needs the prefill's engine id, learned from its bootstrap server
    /// ([`mooncake_decode`]).
    NeedsEngineId { transfer_id: String, bootstrap_addr: String },
}

/// How the gateway tells an engine it gave a leg up (client gone, other leg failed, deadline).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum AbortStyle {
    /// SGLang: `POST /abort_request {"rid": ...}`, off the request path. The rid is the attempt's
    /// gateway-minted id, which the bootstrap plan puts in both legs' bodies (`rid`) and headers
    /// (`X-Request-Id`); for vLLM-style legs it is the `X-Request-Id` the engine derives its
    /// request id from.
    AbortRequest { rid: String },
    /// vLLM-style servers abort a request when its connection closes: dropping it is enough.
    CloseConnection,
}

/// One leg of the plan.
#[derive(Clone, Debug, PartialEq)]
pub struct LegPlan {
    pub leg: Leg,
    /// Index into the snapshot the plan was built from.
    pub worker: usize,
    pub url: String,
    pub body: LegBody,
    /// Whether the leg's answer is a stream (the relayed leg of a streaming request).
    pub stream: bool,
    pub abort: AbortStyle,
}

/// One attempt, decided.
#[derive(Clone, Debug, PartialEq)]
pub struct PdPlan {
    pub mode: Mode,
    pub order: Order,
    /// The attempt's request id: `X-Request-Id` on every leg.
    pub request_id: String,
    pub prefill: Option<LegPlan>,
    /// The leg whose answer the client gets: the decode, or the only worker.
    pub relayed: LegPlan,
    pub rendezvous: Option<Rendezvous>,
    /// Put the prefill's input logprobs into the relayed answer (SGLang `/generate` with
    /// `return_logprob`: only the prefill has them).
    pub merge_input_logprobs: bool,
    /// Read the relayed answer's usage to detect a decode that recomputed the prompt.
    pub scan_usage: bool,
    /// What the prefill holds for the decode after its own answer, released if the decode
    /// fails before it committed (NIXL: blocks pinned until pulled or a long lease expires).
    pub release_prefill: Option<AbortStyle>,
}

/// Refuses a request the chosen mode cannot serve, before any leg is sent.
pub fn check_compatible(mode: Mode, endpoint: Endpoint) -> Result<(), GatewayError> {
    match (mode, endpoint) {
        (Mode::Pd(c @ (KvConnector::Nixl | KvConnector::Mooncake)), Endpoint::Generate) => Err(GatewayError::invalid(
            None,
            format!("/generate is SGLang's native API; the {} workers speak vLLM's OpenAI API: use /v1/completions or /v1/chat/completions", c.as_str()),
        )),
        _ => Ok(()),
    }
}

/// Rooms for one request: uniform in [0, 2^63 - 1], one per item of a batch (or n>1).
/// `batch_items` is bounded by `--max-batch-size` in the parser.
pub fn mint_rooms(rng: &mut dyn RngCore, batch_items: Option<usize>) -> Rooms {
    mint_rooms_upto(rng, batch_items, MAX_ROOM)
}

/// The most a room may be when a leg is a gRPC worker's: the contract's `bootstrap_room` is int32.
pub const MAX_GRPC_ROOM: u64 = i32::MAX as u64;

/// Rooms uniform in [0, max].
pub fn mint_rooms_upto(rng: &mut dyn RngCore, batch_items: Option<usize>, max: u64) -> Rooms {
    match batch_items {
        None => Rooms::Single(rng.random_range(0..=max)),
        Some(n) => Rooms::Batch((0..n).map(|_| rng.random_range(0..=max)).collect()),
    }
}

/// A Mooncake transfer id, `xfer-<uuid v4>`, from the injected rng.
pub fn mint_transfer_id(rng: &mut dyn RngCore) -> String {
    let mut b: [u8; 16] = rng.random();
    b[6] = (b[6] & 0x0f) | 0x40;
    b[8] = (b[8] & 0x3f) | 0x80;
    let h: String = b.iter().map(|x| format!("{x:02x}")).collect();
    kv_transfer::mooncake_transfer_id(&format!("{}-{}-{}-{}-{}", &h[0..8], &h[8..12], &h[12..16], &h[16..20], &h[20..32]))
}

/// `http://<P host>:<bootstrap port>`: where a Mooncake decode (and the gateway's `/query`)
/// reach the prefill's bootstrap server.
pub fn bootstrap_base(p: &WorkerSpec) -> String {
    let port = p.bootstrap_port.unwrap_or(DEFAULT_BOOTSTRAP_PORT);
    if p.host.contains(':') {
        format!("http://[{}]:{port}", p.host)
    } else {
        format!("http://{}:{port}", p.host)
    }
}

fn leg_plan(snap: &PoolSnapshot, worker: usize, leg: Leg, body: LegBody, stream: bool, abort: AbortStyle) -> LegPlan {
    LegPlan { leg, worker, url: snap.worker(worker).spec.url.clone(), body, stream, abort }
}

/// The regular mode's plan: the client's body to one worker. A worker closes a request whose
/// connection closes (SGLang and vLLM both), so giving it up is dropping the connection.
pub fn regular(snap: &PoolSnapshot, chosen: &Selection, req: &ParsedRequest, request_id: &str) -> PdPlan {
    let body = if req.rewritten { LegBody::Json(req.body.clone()) } else { LegBody::Forward };
    PdPlan {
        mode: Mode::Regular,
        order: Order::One,
        request_id: request_id.to_string(),
        prefill: None,
        relayed: leg_plan(snap, chosen.worker, Leg::Regular, body, req.stream, AbortStyle::CloseConnection),
        rendezvous: None,
        merge_input_logprobs: false,
        scan_usage: false,
        release_prefill: None,
    }
}

/// The plan for a chosen pair. The connector is the prefill's (pairing made the decode match).
pub fn pd(snap: &PoolSnapshot, prefill: &Selection, decode: &Selection, req: &ParsedRequest, request_id: &str, rng: &mut dyn RngCore) -> Result<PdPlan, GatewayError> {
    let connector = snap.connector_of(prefill.worker);
    check_compatible(Mode::Pd(connector), req.endpoint)?;
    let (p, d, stream) = (prefill.worker, decode.worker, req.stream);
    let close = AbortStyle::CloseConnection;
    let (order, p_leg, d_leg, rendezvous) = match connector {
        KvConnector::Bootstrap => {
            let grpc = snap.worker(p).spec.is_grpc() || snap.worker(d).spec.is_grpc();
            let rooms = mint_rooms_upto(rng, req.batch_items, if grpc { MAX_GRPC_ROOM } else { MAX_ROOM });
            let spec = &snap.worker(p).spec;
            let mut body = req.body.clone();
            bootstrap::inject(&mut body, &spec.host, spec.bootstrap_port, &rooms);
            // SGLang matches `/abort_request` on the body's `rid` (a batch's items become
            // `{rid}_{i}`), so both legs carry the attempt's id there too. The parser removed any
            // client `rid`, so this is always the gateway's.
            body.insert("rid".into(), Value::from(request_id));
            let abort = AbortStyle::AbortRequest { rid: request_id.to_string() };
            // A streamed request's prefill is asked for a whole answer: the gateway only drains
            // it (or reads its input logprobs), and streaming it costs the engine SSE framing
            // for nothing. SMG 1.13.0 does not stream its prefill either (measured:
            // docs/performance.md, "Streaming"). Otherwise the same bytes as the decode's.
            let p_body = if stream { LegBody::Json(bootstrap::whole_prefill_body(&body)) } else { LegBody::SameAsRelayed };
            let p_leg = leg_plan(snap, p, Leg::Prefill, p_body, false, abort.clone());
            let d_leg = leg_plan(snap, d, Leg::Decode, LegBody::Json(body), stream, abort);
            (Order::Concurrent, p_leg, d_leg, Rendezvous::Rooms(rooms))
        }
        KvConnector::Nixl => {
            let p_leg = leg_plan(snap, p, Leg::Prefill, LegBody::Json(kv_transfer::nixl_prefill_body(&req.body)), false, close.clone());
            let d_leg = leg_plan(snap, d, Leg::Decode, LegBody::FromPrefillAnswer, stream, close);
            (Order::PrefillFirst, p_leg, d_leg, Rendezvous::RequestId(request_id.to_string()))
        }
        KvConnector::Mooncake => {
            let transfer_id = mint_transfer_id(rng);
            let p_body = LegBody::Json(kv_transfer::mooncake_prefill_body(&req.body, &transfer_id));
            let d_body = LegBody::NeedsEngineId { transfer_id: transfer_id.clone(), bootstrap_addr: bootstrap_base(&snap.worker(p).spec) };
            let p_leg = leg_plan(snap, p, Leg::Prefill, p_body, false, close.clone());
            let d_leg = leg_plan(snap, d, Leg::Decode, d_body, stream, close);
            (Order::Concurrent, p_leg, d_leg, Rendezvous::TransferId(transfer_id))
        }
    };
    Ok(PdPlan {
        mode: Mode::Pd(connector),
        order,
        request_id: request_id.to_string(),
        prefill: Some(p_leg),
        relayed: d_leg,
        rendezvous: Some(rendezvous),
        merge_input_logprobs: connector == KvConnector::Bootstrap && req.wants_input_logprobs,
        scan_usage: true,
        // The reference engine's `/abort_request` frees a NIXL hold by request id; a vLLM
        // prefill has no such endpoint (the abort gets a 404) and keeps its lease.
        release_prefill: (connector == KvConnector::Nixl).then(|| AbortStyle::AbortRequest { rid: request_id.to_string() }),
    })
}

/// A NIXL decode's body, decided from the prefill's answer.
#[derive(Clone, Debug, PartialEq)]
pub struct NixlDecode {
    pub body: Map<String, Value>,
    /// Why the decode will recompute the prompt (a silent failure of PD, counted), if it will:
    /// `no_params` or `incomplete_params`.
    pub recompute: Option<&'static str>,
    /// The pull fields the prefill left out.
    pub missing: Vec<&'static str>,
    /// The prefill put `remote_prefill_cached_tokens` in its params (vLLM 0.32 and later): the
    /// decode then reports that number, the prefill's own prefix-cache hits, as its
    /// `cached_tokens`, not what arrived over NIXL, so its report says nothing of the transfer.
    pub decode_reports_prefill_cache: bool,
}

/// The NIXL decode body: the client's body with the prefill's `kv_transfer_params` verbatim;
/// with none from the prefill, none at all (never a client's own).
pub fn nixl_decode(req: &ParsedRequest, prefill_answer: &Value) -> NixlDecode {
    match kv_transfer::returned_params(prefill_answer) {
        Some(params) => {
            let missing = kv_transfer::nixl_missing_fields(params);
            let recompute = (!missing.is_empty()).then_some("incomplete_params");
            let decode_reports_prefill_cache = params.get("remote_prefill_cached_tokens").is_some();
            NixlDecode { body: kv_transfer::nixl_decode_body(&req.body, params.clone()), recompute, missing, decode_reports_prefill_cache }
        }
        None => NixlDecode { body: kv_transfer::nixl_decode_without_params(&req.body), recompute: Some("no_params"), missing: Vec::new(), decode_reports_prefill_cache: false },
    }
}

/// The Mooncake decode body, once the prefill's engine id is known.
pub fn mooncake_decode(req: &ParsedRequest, transfer_id: &str, engine_id: &str, bootstrap_addr: &str) -> Map<String, Value> {
    kv_transfer::mooncake_decode_body(&req.body, transfer_id, engine_id, bootstrap_addr)
}

#[cfg(test)]
#[path = "plan_tests.rs"]
mod tests;
