//! The two gRPC services behind one interface: SGLang's `SglangScheduler` and vLLM's
//! `VllmEngine`. Which one a worker speaks is found as SMG finds it: the first whose
//! `GetModelInfo` answers (the other answers `UNIMPLEMENTED`).

use std::collections::BTreeMap;
use std::pin::Pin;

use futures_util::{Stream, StreamExt};
use pdgate_core::{GatewayError, KvLayout, Leg};
use pdgate_protocol::engine_load::{self, EngineLoad};
use prost_types::value::Kind;
use serde_json::{json, Value};
use tonic::transport::{Channel, Endpoint};
use tonic::{Code, Status};

use super::pb::{sglang_pb, vllm_pb};
use super::request::{Parsed, Sampling};
use super::response::{Counts, Gen, Matched};
use super::CONNECT_TIMEOUT;
use crate::exec::leg::whose;
use crate::registry::EngineInfo;

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
pub fn status_error(leg: Leg, s: &Status) -> GatewayError {
    let http = match s.code() {
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
        ..Default::default()
    }
}

fn counts(prompt: u32, completion: u32, cached: u32) -> Counts {
    Counts { prompt, completion, cached }
}

fn sglang_gen(r: sglang_pb::GenerateResponse) -> Option<Gen> {
    use sglang_pb::generate_complete::MatchedStop;
    use sglang_pb::generate_response::Response;
    Some(match r.response? {
        Response::Chunk(c) => Gen::Chunk { index: c.index, ids: c.token_ids, counts: counts(c.prompt_tokens, c.completion_tokens, c.cached_tokens) },
        Response::Complete(c) => Gen::Complete {
            index: c.index,
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

fn vllm_gen(r: vllm_pb::GenerateResponse) -> Option<Gen> {
    use vllm_pb::generate_complete::MatchedStop;
    use vllm_pb::generate_response::Response;
    Some(match r.response? {
        Response::Chunk(c) => Gen::Chunk { index: c.index, ids: c.token_ids, counts: counts(c.prompt_tokens, c.completion_tokens, c.cached_tokens) },
        Response::Complete(c) => Gen::Complete {
            index: c.index,
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

    pub fn service(&self) -> Service {
        self.service
    }

    pub fn served_model(&self) -> &str {
        &self.served_model
    }

    /// `Generate`, resolved at the engine's response head.
    pub async fn generate(&self, p: &Parsed, leg: Leg) -> Result<GenStream, GatewayError> {
        let shape = &p.shape;
        match self.service {
            Service::Sglang => {
                let req = sglang_pb::GenerateRequest {
                    request_id: p.request_id.clone(),
                    tokenized: Some(sglang_pb::TokenizedInput { original_text: String::new(), input_ids: shape.prompt_ids.clone() }),
                    sampling_params: Some(sglang_sampling(&shape.sampling)),
                    disaggregated_params: p.bootstrap.as_ref().map(|(host, port, room)| sglang_pb::DisaggregatedParams {
                        bootstrap_host: host.clone(),
                        bootstrap_port: *port,
                        bootstrap_room: *room,
                    }),
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
                if p.bootstrap.is_some() {
                    return Err(GatewayError::protocol(leg, "SGLang bootstrap fields sent to a vLLM gRPC worker"));
                }
                let req = vllm_pb::GenerateRequest {
                    request_id: p.request_id.clone(),
                    input: Some(vllm_pb::generate_request::Input::Tokenized(vllm_pb::TokenizedInput { original_text: String::new(), input_ids: shape.prompt_ids.clone() })),
                    sampling_params: Some(vllm_sampling(&shape.sampling)),
                    stream: shape.stream,
                    ..Default::default()
                };
                let stream = vllm(&self.channel).generate(req).await.map_err(|s| status_error(leg, &s))?.into_inner();
                Ok(Box::pin(stream.filter_map(move |r| async move {
                    match r {
                        Ok(r) => vllm_gen(r).map(Ok),
                        Err(s) => Some(Err(status_error(leg, &s))),
                    }
                })))
            }
        }
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
                let facts = crate::health::server_info_facts(&args);
                let context = u64::try_from(model.max_context_length).ok().filter(|n| *n > 0);
                Some(EngineInfo { models: vec![model.served_model_name], context_length: context.or(facts.context_length), ..facts })
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
                Some(EngineInfo {
                    models: vec![model.served_model_name],
                    mode,
                    runtime: Some("vllm".into()),
                    kv_layout: KvLayout { page_size, kv_dtype, tp_size: None },
                    context_length: Some(u64::from(model.max_context_length)).filter(|n| *n > 0),
                })
            }
        }
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
