//! The two gRPC services behind one interface: SGLang's `SglangScheduler` and vLLM's
//! `VllmEngine`. Which one a worker speaks is found as SMG finds it: the first whose
//! `GetModelInfo` answers (the other answers `UNIMPLEMENTED`).

use std::collections::BTreeMap;
use std::pin::Pin;

use futures_util::{Stream, StreamExt};
use pdgate_core::{GatewayError, KvConnector, KvLayout, Leg};
use pdgate_protocol::engine_load::{self, EngineLoad};
use prost_types::value::Kind;
use serde_json::{json, Value};
use tonic::transport::{Channel, Endpoint};
use tonic::{Code, Status};

use super::logprobs::{zip_positions, LpPart};
use super::pb::smg::grpc::common::{KvEventBatch, SubscribeKvEventsRequest};
use super::pb::{sglang_pb, vllm_pb};
use super::request::{Call, Sampling, Shape};
use super::response::{Counts, Gen, Matched};
use super::CONNECT_TIMEOUT;
use crate::clients::engine_info::EngineInfo;
use crate::clients::leg::whose;

/// A `Generate` answer as wire-neutral events.
pub type GenStream = Pin<Box<dyn Stream<Item = Result<Gen, GatewayError>> + Send>>;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Service {
    Sglang,
    Vllm,
}

/// A worker's connection and service.
pub struct Wire {
    channel: Channel,
    service: Service,
    served_model: String,
}

fn sglang(ch: &Channel) -> sglang_pb::sglang_scheduler_client::SglangSchedulerClient<Channel> {
    sglang_pb::sglang_scheduler_client::SglangSchedulerClient::new(ch.clone())
}

fn vllm(ch: &Channel) -> vllm_pb::vllm_engine_client::VllmEngineClient<Channel> {
    vllm_pb::vllm_engine_client::VllmEngineClient::new(ch.clone())
}

/// A gRPC status as the gateway's error for `leg`: the engine's refusals of the request keep
/// their HTTP meaning (and message) for the client; an unreachable worker is unreachable.
///
/// A status tonic made from a transport error (it has a `source`; the engine sent none) means
/// the connection or stream broke, whatever code tonic picked for it: a worker SIGKILLed
/// mid-stream reads `UNKNOWN`/`INTERNAL` "h2 protocol error". It is unreachable, as a broken
/// HTTP body is, so retries and resume treat it as the death it is, not as the engine's answer.
pub fn status_error(leg: Leg, s: &Status) -> GatewayError {
    let transport = std::error::Error::source(s).is_some();
    let http = match s.code() {
        _ if transport => return GatewayError::unreachable(leg, format!("{} gRPC stream broke off: {}", whose(leg), s.message())),
        Code::Unavailable => return GatewayError::unreachable(leg, format!("{} gRPC call failed: {}", whose(leg), s.message())),
        Code::InvalidArgument | Code::OutOfRange | Code::FailedPrecondition => 400,
        Code::NotFound => 404,
        Code::AlreadyExists => 409,
        Code::ResourceExhausted => 429,
        Code::Cancelled => 499,
        Code::Unimplemented => 501,
        Code::DeadlineExceeded => 504,
        _ => 500,
    };
    let body = json!({"error": {"message": s.message(), "type": if http < 500 { "invalid_request_error" } else { "server_error" }, "code": http}});
    GatewayError::worker_status(leg, http, Some(body.to_string()))
}

fn seed_params(seed: Option<i64>) -> Option<prost_types::Struct> {
    let seed = seed?;
    let mut fields = BTreeMap::new();
    fields.insert("seed".to_string(), prost_types::Value { kind: Some(Kind::NumberValue(seed as f64)) });
    Some(prost_types::Struct { fields })
}

fn sglang_sampling(s: &Sampling) -> sglang_pb::SamplingParams {
    sglang_pb::SamplingParams {
        temperature: s.temperature,
        top_p: s.top_p,
        top_k: s.top_k,
        min_p: s.min_p,
        frequency_penalty: s.frequency_penalty,
        presence_penalty: s.presence_penalty,
        repetition_penalty: s.repetition_penalty,
        max_new_tokens: Some(s.max_new_tokens),
        stop: s.stop.clone(),
        stop_token_ids: s.stop_token_ids.clone(),
        skip_special_tokens: s.skip_special_tokens,
        n: s.n,
        ignore_eos: s.ignore_eos,
        custom_params: seed_params(s.seed),
        ..Default::default()
    }
}

fn vllm_sampling(s: &Sampling) -> vllm_pb::SamplingParams {
    vllm_pb::SamplingParams {
        temperature: Some(s.temperature),
        top_p: s.top_p,
        top_k: u32::try_from(s.top_k).unwrap_or(0),
        min_p: s.min_p,
        frequency_penalty: s.frequency_penalty,
        presence_penalty: s.presence_penalty,
        repetition_penalty: s.repetition_penalty,
        max_tokens: Some(s.max_new_tokens),
        stop: s.stop.clone(),
        stop_token_ids: s.stop_token_ids.clone(),
        skip_special_tokens: s.skip_special_tokens,
        ignore_eos: s.ignore_eos,
        n: s.n,
        seed: s.seed.and_then(|v| i32::try_from(v).ok()),
        logprobs: s.logprobs.and_then(|k| i32::try_from(k).ok()),
        prompt_logprobs: if s.prompt_logprobs { s.logprobs.and_then(|k| i32::try_from(k).ok()) } else { None },
        ..Default::default()
    }
}

fn counts(prompt: u32, completion: u32, cached: u32) -> Counts {
    Counts { prompt, completion, cached }
}

/// The wire's logprob messages (the same fields on both services) as [`LpPart`].
macro_rules! lp_part {
    ($output:expr, $input:expr) => {
        LpPart {
            output: $output
                .map(|o| zip_positions(o.token_ids, o.token_logprobs.into_iter().map(Some), o.top_logprobs.into_iter().map(|t| (t.values, t.token_ids))))
                .unwrap_or_default(),
            input: $input.map(|i| zip_positions(i.token_ids, i.token_logprobs.into_iter().map(|v| v.value), i.top_logprobs.into_iter().map(|t| (t.values, t.token_ids)))),
        }
    };
}

fn sglang_gen(r: sglang_pb::GenerateResponse) -> Option<Gen> {
    use sglang_pb::generate_complete::MatchedStop;
    use sglang_pb::generate_response::Response;
    Some(match r.response? {
        Response::Chunk(c) => Gen::Chunk {
            index: c.index,
            counts: counts(c.prompt_tokens, c.completion_tokens, c.cached_tokens),
            lp: lp_part!(c.output_logprobs, c.input_logprobs),
            ids: c.token_ids,
        },
        Response::Complete(c) => Gen::Complete {
            index: c.index,
            lp: lp_part!(c.output_logprobs, c.input_logprobs),
            ids: c.output_ids,
            finish_reason: c.finish_reason,
            matched: c.matched_stop.map(|m| match m {
                MatchedStop::MatchedTokenId(t) => Matched::TokenId(t),
                MatchedStop::MatchedStopStr(s) => Matched::Text(s),
            }),
            counts: counts(c.prompt_tokens, c.completion_tokens, c.cached_tokens),
        },
    })
}

/// vLLM's messages as events. A `GenerateComplete` that returns `kv_transfer_params_json` (a
/// NIXL or Mooncake prefill's) gives those first, verbatim; the deprecated typed field is not
/// read (it holds only a host and port, not a NIXL pull handle).
fn vllm_gen(r: vllm_pb::GenerateResponse, leg: Leg) -> Vec<Result<Gen, GatewayError>> {
    use vllm_pb::generate_complete::MatchedStop;
    use vllm_pb::generate_response::Response;
    let Some(response) = r.response else { return vec![] };
    match response {
        Response::Chunk(c) => vec![Ok(Gen::Chunk {
            index: c.index,
            counts: counts(c.prompt_tokens, c.completion_tokens, c.cached_tokens),
            lp: lp_part!(c.output_logprobs, c.input_logprobs),
            ids: c.token_ids,
        })],
        Response::Complete(c) => {
            let mut out = Vec::with_capacity(2);
            if let Some(text) = c.kv_transfer_params_json.as_deref().filter(|t| !t.is_empty()) {
                out.push(returned_params(text, leg).map(Gen::KvTransferParams));
            }
            out.push(Ok(Gen::Complete {
                index: c.index,
                lp: lp_part!(c.output_logprobs, c.input_logprobs),
                ids: c.output_ids,
                finish_reason: c.finish_reason,
                matched: c.matched_stop.map(|m| match m {
                    MatchedStop::MatchedTokenId(t) => Matched::TokenId(t),
                    MatchedStop::MatchedStopStr(s) => Matched::Text(s),
                }),
                counts: counts(c.prompt_tokens, c.completion_tokens, c.cached_tokens),
            }));
            out
        }
    }
}

/// A prefill's `kv_transfer_params_json`: a JSON object, or the worker broke the contract.
fn returned_params(text: &str, leg: Leg) -> Result<Value, GatewayError> {
    match serde_json::from_str::<Value>(text) {
        Ok(v @ Value::Object(_)) => Ok(v),
        Ok(_) => Err(GatewayError::bad_worker_response(leg, format!("{} kv_transfer_params_json is not a JSON object", whose(leg)))),
        Err(e) => Err(GatewayError::bad_worker_response(leg, format!("{} kv_transfer_params_json is not JSON: {e}", whose(leg)))),
    }
}

/// vLLM's `kv_connector` as the PD protocol the gateway speaks with it.
fn vllm_connector(name: &str) -> Option<KvConnector> {
    match name {
        "NixlConnector" => Some(KvConnector::Nixl),
        "MooncakeConnector" => Some(KvConnector::Mooncake),
        _ => None,
    }
}

/// vLLM streams count deltas: each chunk's `completion_tokens` is its own ids, and the Complete
/// repeats the last chunk (its ids and count), as the vLLM servicer writes them (SMG's router
/// accumulates). `Counts` are cumulative, as SGLang's are: this adds the chunks up per choice.
#[derive(Default)]
struct DeltaCounts(Vec<u32>);

impl DeltaCounts {
    fn cumulative(&mut self, gen: Gen) -> Gen {
        match gen {
            Gen::Chunk { index, ids, mut counts, lp } => {
                let i = index as usize;
                if self.0.len() <= i {
                    self.0.resize(i + 1, 0);
                }
                self.0[i] += ids.len() as u32;
                counts.completion = self.0[i];
                Gen::Chunk { index, ids, counts, lp }
            }
            Gen::Complete { index, ids, finish_reason, matched, mut counts, lp } => {
                // A Complete without chunks before it (nothing generated) keeps its own count.
                if let Some(&sent) = self.0.get(index as usize) {
                    counts.completion = sent.max(counts.completion);
                }
                Gen::Complete { index, ids, finish_reason, matched, counts, lp }
            }
            other @ Gen::KvTransferParams(_) => other,
        }
    }
}

/// A protobuf `Struct` as JSON (SGLang's `server_args`).
fn struct_json(s: &prost_types::Struct) -> Value {
    Value::Object(s.fields.iter().map(|(k, v)| (k.clone(), value_json(v))).collect())
}

fn value_json(v: &prost_types::Value) -> Value {
    match &v.kind {
        None | Some(Kind::NullValue(_)) => Value::Null,
        Some(Kind::NumberValue(n)) if n.fract() == 0.0 && n.abs() < 9e15 => json!(*n as i64),
        Some(Kind::NumberValue(n)) => json!(n),
        Some(Kind::StringValue(s)) => json!(s),
        Some(Kind::BoolValue(b)) => json!(b),
        Some(Kind::StructValue(s)) => struct_json(s),
        Some(Kind::ListValue(l)) => Value::Array(l.values.iter().map(value_json).collect()),
    }
}

impl Wire {
    /// Connects (lazily: the first call dials) and asks each service's `GetModelInfo`.
    pub async fn detect(url: &str, leg: Leg) -> Result<Wire, GatewayError> {
        let authority = url.strip_prefix("grpc://").unwrap_or(url);
        let endpoint = Endpoint::from_shared(format!("http://{authority}")).map_err(|e| GatewayError::unreachable(leg, format!("{url}: {e}")))?;
        let channel = endpoint.connect_timeout(CONNECT_TIMEOUT).tcp_nodelay(true).http2_keep_alive_interval(std::time::Duration::from_secs(30)).connect_lazy();
        match sglang(&channel).get_model_info(sglang_pb::GetModelInfoRequest {}).await {
            Ok(info) => return Ok(Wire { channel, service: Service::Sglang, served_model: info.into_inner().served_model_name }),
            Err(s) if s.code() == Code::Unimplemented => {}
            Err(s) => return Err(status_error(leg, &s)),
        }
        match vllm(&channel).get_model_info(vllm_pb::GetModelInfoRequest {}).await {
            Ok(info) => Ok(Wire { channel, service: Service::Vllm, served_model: info.into_inner().served_model_name }),
            Err(s) if s.code() == Code::Unimplemented => Err(GatewayError::protocol(leg, format!("{url} serves neither SglangScheduler nor VllmEngine"))),
            Err(s) => Err(status_error(leg, &s)),
        }
    }

    /// A wire that has not dialled (tests of the connection cache).
    #[cfg(test)]
    pub fn unconnected(url: &str) -> Wire {
        let authority = url.strip_prefix("grpc://").unwrap_or(url);
        let channel = Endpoint::from_shared(format!("http://{authority}")).map(|e| e.connect_lazy()).unwrap_or_else(|_| unreachable!("test URLs are valid"));
        Wire { channel, service: Service::Sglang, served_model: "m".into() }
    }

    pub fn service(&self) -> Service {
        self.service
    }

    pub fn served_model(&self) -> &str {
        &self.served_model
    }

    /// `Generate` for one call of a leg, resolved at the engine's response head.
    pub async fn generate(&self, call: &Call, shape: &Shape, leg: Leg) -> Result<GenStream, GatewayError> {
        let prompt = shape.prompts[call.prompt].clone();
        let s = &call.sampling;
        match self.service {
            Service::Sglang => {
                let req = sglang_pb::GenerateRequest {
                    request_id: call.request_id.clone(),
                    tokenized: Some(sglang_pb::TokenizedInput { original_text: String::new(), input_ids: prompt }),
                    sampling_params: Some(sglang_sampling(s)),
                    disaggregated_params: call.bootstrap.as_ref().map(|(host, port, room)| sglang_pb::DisaggregatedParams {
                        bootstrap_host: host.clone(),
                        bootstrap_port: *port,
                        bootstrap_room: *room,
                    }),
                    return_logprob: s.logprobs.is_some(),
                    top_logprobs_num: s.logprobs.and_then(|k| i32::try_from(k).ok()).unwrap_or(0),
                    logprob_start_len: s.logprob_start_len,
                    stream: shape.stream,
                    ..Default::default()
                };
                let stream = sglang(&self.channel).generate(req).await.map_err(|s| status_error(leg, &s))?.into_inner();
                Ok(Box::pin(stream.filter_map(move |r| async move {
                    match r {
                        Ok(r) => sglang_gen(r).map(Ok),
                        Err(s) => Some(Err(status_error(leg, &s))),
                    }
                })))
            }
            Service::Vllm => {
                if call.bootstrap.is_some() {
                    return Err(GatewayError::protocol(leg, "SGLang bootstrap fields sent to a vLLM gRPC worker"));
                }
                let req = vllm_pb::GenerateRequest {
                    request_id: call.request_id.clone(),
                    input: Some(vllm_pb::generate_request::Input::Tokenized(vllm_pb::TokenizedInput { original_text: String::new(), input_ids: prompt })),
                    sampling_params: Some(vllm_sampling(s)),
                    stream: shape.stream,
                    // NIXL / Mooncake: the plan's params, verbatim (the prefill's own, for a NIXL decode).
                    kv_transfer_params_json: call.kv_transfer_params.clone(),
                    ..Default::default()
                };
                let stream = vllm(&self.channel).generate(req).await.map_err(|s| status_error(leg, &s))?.into_inner();
                let mut deltas = shape.stream.then(DeltaCounts::default);
                Ok(Box::pin(stream.flat_map(move |r| {
                    let gens: Vec<Result<Gen, GatewayError>> = match r {
                        Ok(r) => vllm_gen(r, leg)
                            .into_iter()
                            .map(|g| {
                                g.map(|g| match deltas.as_mut() {
                                    Some(d) => d.cumulative(g),
                                    None => g,
                                })
                            })
                            .collect(),
                        Err(s) => vec![Err(status_error(leg, &s))],
                    };
                    futures_util::stream::iter(gens)
                })))
            }
        }
    }

    /// `GetTokenizer`: the chunks' bytes concatenated (at most `MAX_BUNDLE_BYTES`) and checked
    /// against the last chunk's `sha256`. Errors say what went wrong, for the client's 502.
    pub async fn fetch_tokenizer_bundle(&self) -> Result<Vec<u8>, String> {
        use super::pb::smg::grpc::common::GetTokenizerRequest;
        let call = match self.service {
            Service::Sglang => sglang(&self.channel).get_tokenizer(GetTokenizerRequest {}).await,
            Service::Vllm => vllm(&self.channel).get_tokenizer(GetTokenizerRequest {}).await,
        };
        let mut chunks = call.map_err(|s| format!("GetTokenizer: {} ({:?})", s.message(), s.code()))?.into_inner();
        let (mut data, mut sha256) = (Vec::new(), String::new());
        while let Some(chunk) = chunks.message().await.map_err(|s| format!("GetTokenizer stream: {} ({:?})", s.message(), s.code()))? {
            if data.len() + chunk.data.len() > super::tokenizer_zip::MAX_BUNDLE_BYTES {
                return Err(format!("GetTokenizer bundle exceeds {} bytes", super::tokenizer_zip::MAX_BUNDLE_BYTES));
            }
            data.extend_from_slice(&chunk.data);
            if !chunk.sha256.is_empty() {
                sha256 = chunk.sha256;
            }
        }
        super::tokenizer_zip::verify_sha256(&data, &sha256)?;
        Ok(data)
    }

    pub async fn health(&self) -> Result<(), String> {
        let (healthy, message) = match self.service {
            Service::Sglang => sglang(&self.channel).health_check(sglang_pb::HealthCheckRequest {}).await.map(|r| r.into_inner()).map(|r| (r.healthy, r.message)),
            Service::Vllm => vllm(&self.channel).health_check(vllm_pb::HealthCheckRequest {}).await.map(|r| r.into_inner()).map(|r| (r.healthy, r.message)),
        }
        .map_err(|s| format!("gRPC HealthCheck: {} ({:?})", s.message(), s.code()))?;
        if healthy {
            Ok(())
        } else {
            Err(format!("gRPC HealthCheck: unhealthy: {message}"))
        }
    }

    /// `SubscribeKvEvents` from `start`; resolves when the engine accepted the call.
    pub async fn subscribe_kv_events(&self, start: u64) -> Result<tonic::Streaming<KvEventBatch>, Status> {
        let req = SubscribeKvEventsRequest { start_sequence_number: start, load_records_before_first_batch: false };
        match self.service {
            Service::Sglang => sglang(&self.channel).subscribe_kv_events(req).await.map(|r| r.into_inner()),
            Service::Vllm => vllm(&self.channel).subscribe_kv_events(req).await.map(|r| r.into_inner()),
        }
    }

    pub async fn abort(&self, rid: &str) -> Result<(), Status> {
        match self.service {
            Service::Sglang => sglang(&self.channel).abort(sglang_pb::AbortRequest { request_id: rid.to_string(), reason: "the gateway gave up the leg".into() }).await.map(drop),
            Service::Vllm => vllm(&self.channel).abort(vllm_pb::AbortRequest { request_ids: vec![rid.to_string()] }).await.map(drop),
        }
    }

    /// What health.rs learns of an HTTP worker from `/v1/models` and `/server_info`.
    pub async fn engine_info(&self) -> Option<EngineInfo> {
        match self.service {
            Service::Sglang => {
                let model = sglang(&self.channel).get_model_info(sglang_pb::GetModelInfoRequest {}).await.ok()?.into_inner();
                let server = sglang(&self.channel).get_server_info(sglang_pb::GetServerInfoRequest {}).await.ok()?.into_inner();
                let args = server.server_args.as_ref().map(struct_json).unwrap_or(Value::Null);
                let facts = crate::clients::engine_info::server_info_facts(&args);
                let context = u64::try_from(model.max_context_length).ok().filter(|n| *n > 0);
                // An SGLang PD worker speaks the bootstrap protocol, whatever its transfer backend.
                let pd = matches!(facts.mode.as_deref(), Some("prefill" | "decode"));
                let kv_connector = pd.then_some(KvConnector::Bootstrap);
                Some(EngineInfo { models: vec![model.served_model_name], context_length: context.or(facts.context_length), kv_connector, ..facts })
            }
            Service::Vllm => {
                let model = vllm(&self.channel).get_model_info(vllm_pb::GetModelInfoRequest {}).await.ok()?.into_inner();
                let server = vllm(&self.channel).get_server_info(vllm_pb::GetServerInfoRequest {}).await.ok()?.into_inner();
                let mode = match server.kv_role.as_str() {
                    "kv_producer" => Some("prefill".to_string()),
                    "kv_consumer" => Some("decode".to_string()),
                    _ => None,
                };
                let kv_dtype = Some(server.kv_cache_dtype).filter(|d| !d.is_empty() && d != "auto");
                let page_size = u32::try_from(server.block_size).ok().filter(|b| *b > 0);
                let attention_backend = Some(server.attention_backend).filter(|b| !b.is_empty());
                Some(EngineInfo {
                    models: vec![model.served_model_name],
                    mode,
                    runtime: Some("vllm".into()),
                    kv_layout: KvLayout { page_size, kv_dtype, tp_size: None, attention_backend },
                    kv_connector: vllm_connector(&server.kv_connector),
                    context_length: Some(u64::from(model.max_context_length)).filter(|n| *n > 0),
                })
            }
        }
    }

    /// A Mooncake prefill's engine id: vLLM's `GetServerInfo.kv_engine_id` (over HTTP it comes
    /// from the bootstrap server's `/query`).
    pub async fn kv_engine_id(&self, leg: Leg) -> Result<String, GatewayError> {
        let Service::Vllm = self.service else {
            return Err(GatewayError::protocol(leg, "a Mooncake prefill must be a vLLM worker: this gRPC worker serves SGLang's scheduler"));
        };
        let info = vllm(&self.channel).get_server_info(vllm_pb::GetServerInfoRequest {}).await.map_err(|s| status_error(leg, &s))?.into_inner();
        Some(info.kv_engine_id)
            .filter(|id| !id.is_empty())
            .ok_or_else(|| GatewayError::protocol(leg, "the prefill's GetServerInfo gives no kv_engine_id (is it a Mooncake kv_producer?)"))
    }

    /// `GetLoads` as the load poller's report (SGLang's `/v1/loads` fields, same names).
    pub async fn loads(&self) -> Option<EngineLoad> {
        let ranks: Vec<Value> = match self.service {
            Service::Sglang => {
                let r = sglang(&self.channel).get_loads(sglang_pb::GetLoadsRequest { dp_rank: None, include: vec!["all".into()] }).await.ok()?.into_inner();
                r.loads.iter().map(|l| json!({"num_running_reqs": l.num_running_reqs, "num_waiting_reqs": l.num_waiting_reqs, "num_used_tokens": l.num_used_tokens, "max_total_num_tokens": l.max_total_num_tokens, "num_waiting_uncached_tokens": l.num_waiting_uncached_tokens})).collect()
            }
            Service::Vllm => {
                let r = vllm(&self.channel).get_loads(vllm_pb::GetLoadsRequest { dp_rank: None, include: vec![] }).await.ok()?.into_inner();
                r.loads.iter().map(|l| json!({"num_running_reqs": l.num_running_reqs, "num_waiting_reqs": l.num_waiting_reqs, "num_used_tokens": l.num_used_tokens, "max_total_num_tokens": l.max_total_num_tokens, "num_waiting_uncached_tokens": l.num_waiting_uncached_tokens})).collect()
            }
        };
        engine_load::from_sglang_loads(&json!({ "loads": ranks }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pdgate_core::ErrorKind;

    fn complete(params: Option<&str>) -> vllm_pb::GenerateResponse {
        let c = vllm_pb::GenerateComplete {
            output_ids: vec![7],
            finish_reason: "length".into(),
            completion_tokens: 1,
            kv_transfer_params_json: params.map(str::to_string),
            ..Default::default()
        };
        vllm_pb::GenerateResponse { response: Some(vllm_pb::generate_response::Response::Complete(c)) }
    }

    #[test]
    fn a_vllm_prefills_returned_params_come_before_its_complete_verbatim() {
        let text = r#"{"do_remote_prefill":true,"remote_block_ids":[1,2],"remote_engine_id":"e","extra":{"k":null}}"#;
        let events = vllm_gen(complete(Some(text)), Leg::Prefill);
        assert_eq!(events.len(), 2);
        let want: Value = serde_json::from_str(text).unwrap();
        assert_eq!(events[0].as_ref().unwrap(), &Gen::KvTransferParams(want));
        assert!(matches!(events[1], Ok(Gen::Complete { index: 0, .. })));
        // No params (a plain answer, or an empty string): only the Complete.
        assert_eq!(vllm_gen(complete(None), Leg::Prefill).len(), 1);
        assert_eq!(vllm_gen(complete(Some("")), Leg::Prefill).len(), 1);
    }

    #[test]
    fn params_that_are_not_a_json_object_fail_the_leg() {
        for bad in ["{not json", "[1,2]", "\"x\""] {
            let events = vllm_gen(complete(Some(bad)), Leg::Prefill);
            let err = events[0].as_ref().unwrap_err();
            assert_eq!(err.leg, Some(Leg::Prefill), "{bad}");
            assert!(err.message.contains("kv_transfer_params_json"), "{bad}: {}", err.message);
        }
    }

    #[test]
    fn vllm_connector_names_map_to_the_gateways_protocols() {
        assert_eq!(vllm_connector("NixlConnector"), Some(KvConnector::Nixl));
        assert_eq!(vllm_connector("MooncakeConnector"), Some(KvConnector::Mooncake));
        assert_eq!(vllm_connector(""), None);
        assert_eq!(vllm_connector("LMCacheConnectorV1"), None);
    }

    #[test]
    fn grpcfault_vllm_stream_counts_add_up_and_the_repeating_complete_adds_nothing() {
        let c = |completion| Counts { prompt: 4, completion, cached: 0 };
        let mut d = DeltaCounts::default();
        let mut last = |g| match d.cumulative(g) {
            Gen::Chunk { counts, .. } | Gen::Complete { counts, .. } => counts.completion,
            Gen::KvTransferParams(_) => unreachable!("no params in this test"),
        };
        assert_eq!(last(Gen::Chunk { index: 0, ids: vec![1, 2], counts: c(2), lp: LpPart::default() }), 2);
        assert_eq!(last(Gen::Chunk { index: 1, ids: vec![9], counts: c(1), lp: LpPart::default() }), 1, "each choice its own count");
        assert_eq!(last(Gen::Chunk { index: 0, ids: vec![3], counts: c(1), lp: LpPart::default() }), 3);
        let done = Gen::Complete { index: 0, ids: vec![3], finish_reason: "length".into(), matched: None, counts: c(1), lp: LpPart::default() };
        assert_eq!(last(done), 3, "the Complete repeats the last chunk");
        let nothing = Gen::Complete { index: 2, ids: vec![], finish_reason: "stop".into(), matched: None, counts: c(0), lp: LpPart::default() };
        assert_eq!(last(nothing), 0);
    }

    #[test]
    fn grpcfault_a_broken_transport_is_unreachable_whatever_its_code() {
        // What tonic reports for a worker SIGKILLed mid-stream: a status made from the
        // transport error (it carries it as its source), with a code of tonic's choosing.
        let broken = Status::from_error(Box::new(std::io::Error::new(std::io::ErrorKind::ConnectionReset, "connection reset")));
        assert_eq!(broken.code(), Code::Unknown);
        let err = status_error(Leg::Decode, &broken);
        assert_eq!(err.kind, ErrorKind::WorkerUnreachable);
        assert_eq!(err.leg, Some(Leg::Decode));
        // The engine's own statuses keep their meaning.
        let engine_internal = status_error(Leg::Decode, &Status::internal("engine failed"));
        assert!(matches!(engine_internal.kind, ErrorKind::WorkerStatus { .. }), "{:?}", engine_internal.kind);
        assert_eq!(status_error(Leg::Prefill, &Status::unavailable("gone")).kind, ErrorKind::WorkerUnreachable);
        let bad = status_error(Leg::Regular, &Status::invalid_argument("no"));
        assert_eq!(bad.status(), 400);
    }
}
