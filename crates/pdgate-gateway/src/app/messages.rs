//! The Anthropic Messages API (`POST /v1/messages`, `POST /v1/messages/count_tokens`), served by
//! translation: the body becomes the equivalent chat completions request
//! (`pdgate_protocol::anthropic::request`), which is admitted and executed like any other
//! (`intake::admit_with`: PD placement, rendezvous, retries, resume, accounting), and its answer is
//! translated back (a whole one here, a stream chunk by chunk as the client reads it). Errors,
//! ours and the layers' (key, admission), are rewritten into Anthropic's shape by
//! [`anthropic_errors`]. docs/protocols.md, "Messages API", says why translate, not forward.

use std::sync::{Arc, Mutex};

use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use pdgate_core::GatewayError;
use pdgate_protocol::anthropic::request::{to_chat, Kind, Translated};
use pdgate_protocol::anthropic::{answer, error, stream::MessagesStream};
use pdgate_protocol::Endpoint;
use serde_json::{json, Value};

use crate::app::intake::{admit_with, client_error, read_body, Prepared};
use crate::app::messages_body::MessagesBody;
use crate::app::state::AppState;
use crate::prompt_ids::{prompt_token_ids, PromptKind};

pub const MESSAGES: &str = "/v1/messages";
pub const COUNT_TOKENS: &str = "/v1/messages/count_tokens";

/// Adds the two routes to `router`; `front.rs` puts them under the admission and key layers and
/// [`anthropic_errors`].
pub fn routes(router: Router<Arc<AppState>>) -> Router<Arc<AppState>> {
    router.route(MESSAGES, post(messages)).route(COUNT_TOKENS, post(count_tokens))
}

/// Translates the body in `admit_with`'s prepare step, keeping what the answer's translation
/// needs.
fn translate(kind: Kind, slot: &Mutex<Option<Translated>>) -> impl FnOnce(Bytes) -> std::future::Ready<Result<Prepared, GatewayError>> + '_ {
    move |raw| std::future::ready(translate_now(raw, kind, slot))
}

fn translate_now(raw: Bytes, kind: Kind, slot: &Mutex<Option<Translated>>) -> Result<Prepared, GatewayError> {
    let mut t = to_chat(&raw, kind).map_err(|e| GatewayError::invalid(e.param.as_deref(), e.message))?;
    if kind == Kind::CountTokens {
        // Counted by the worker that runs it: one token is the least it can generate.
        t.chat.insert("max_tokens".into(), json!(1));
    }
    let chat = std::mem::take(&mut t.chat);
    if let Ok(mut s) = slot.lock() {
        *s = Some(t);
    }
    Prepared::built(chat)
}

async fn messages(State(state): State<Arc<AppState>>, req: Request) -> Response {
    let slot = Mutex::new(None);
    let resp = admit_with(state.clone(), Endpoint::ChatCompletions, MESSAGES, req, translate(Kind::Create, &slot)).await;
    let Some(t) = slot.lock().ok().and_then(|mut s| s.take()) else { return resp };
    if !resp.status().is_success() {
        return resp;
    }
    let (mut parts, body) = resp.into_parts();
    parts.headers.remove(header::CONTENT_LENGTH);
    let is_stream = parts.headers.get(header::CONTENT_TYPE).and_then(|v| v.to_str().ok()).is_some_and(|v| v.starts_with("text/event-stream"));
    if is_stream {
        return Response::from_parts(parts, Body::new(MessagesBody::new(body, MessagesStream::new(t.model, t.stop_sequences))));
    }
    let bytes = match axum::body::to_bytes(body, state.config.max_response_bytes).await {
        Ok(b) => b,
        Err(e) => return error_response(StatusCode::BAD_GATEWAY, &format!("the worker's answer could not be read: {e}")),
    };
    let chat: Value = match serde_json::from_slice(&bytes) {
        Ok(v) => v,
        Err(e) => return error_response(StatusCode::BAD_GATEWAY, &format!("the worker's answer is not JSON: {e}")),
    };
    let out = answer::from_chat(&chat, &t.model, &t.stop_sequences);
    parts.headers.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
    Response::from_parts(parts, Body::from(out.to_string()))
}

/// `{"input_tokens": N}`: the gateway's tokenizer through the model's chat template when it has
/// both (no worker is asked), else the prompt count of a one-token run of the same request on
/// the fleet (the engine's own template and tokenizer: a prefill and, in PD mode, a decode step).
async fn count_tokens(State(state): State<Arc<AppState>>, req: Request) -> Response {
    if let Some(tok) = state.exec.tokenizer.clone().filter(|t| t.has_chat_template()) {
        return count_with_tokenizer(&state, &tok, req).await;
    }
    let slot = Mutex::new(None);
    let resp = admit_with(state.clone(), Endpoint::ChatCompletions, COUNT_TOKENS, req, translate(Kind::CountTokens, &slot)).await;
    if !resp.status().is_success() {
        return resp;
    }
    let (mut parts, body) = resp.into_parts();
    parts.headers.remove(header::CONTENT_LENGTH);
    let chat: Option<Value> = axum::body::to_bytes(body, state.config.max_response_bytes).await.ok().and_then(|b| serde_json::from_slice(&b).ok());
    let Some(n) = chat.as_ref().and_then(|c| c.get("usage")).and_then(|u| u.get("prompt_tokens")).and_then(Value::as_u64) else {
        return error_response(StatusCode::BAD_GATEWAY, "the worker's answer has no usage.prompt_tokens");
    };
    Response::from_parts(parts, Body::from(json!({"input_tokens": n}).to_string()))
}

async fn count_with_tokenizer(state: &AppState, tok: &pdgate_tokenizer::ModelTokenizer, req: Request) -> Response {
    let started = std::time::Instant::now();
    if state.is_draining() {
        return client_error(state, COUNT_TOKENS, &GatewayError::shutting_down(), started);
    }
    // The body under the same size limit and read deadline as every other route's.
    let (parts, body) = req.into_parts();
    let deadline = tokio::time::Instant::now() + state.request_timeout();
    let raw = match read_body(state, COUNT_TOKENS, &parts.headers, body, deadline, started).await {
        Ok(b) => b,
        Err(resp) => return resp,
    };
    let t = match to_chat(&raw, Kind::CountTokens) {
        Ok(t) => t,
        Err(e) => return client_error(state, COUNT_TOKENS, &GatewayError::invalid(e.param.as_deref(), e.message), started),
    };
    match prompt_token_ids(tok, PromptKind::Chat, &Value::Object(t.chat)) {
        Ok(Some(ids)) => {
            state.metrics.requests.with_label_values(&[COUNT_TOKENS, "200"]).inc();
            Json(json!({"input_tokens": ids.len()})).into_response()
        }
        Ok(None) => client_error(state, COUNT_TOKENS, &GatewayError::invalid(Some("messages"), "the messages could not be tokenized"), started),
        Err(e) => client_error(state, COUNT_TOKENS, &GatewayError::invalid(Some("messages"), format!("the chat template failed for these messages: {e}")), started),
    }
}

fn error_response(status: StatusCode, message: &str) -> Response {
    let body = error::body_of(error::error_type(status.as_u16()), message);
    (status, Json(body)).into_response()
}

/// Rewrites the error responses of the Messages routes (pdgate's OpenAI shape, from any layer
/// under it: key, admission, the handler) into Anthropic's `{"type": "error", "error": {"type",
/// "message"}}`. `front.rs` puts it on these routes only.
pub async fn anthropic_errors(req: Request, next: Next) -> Response {
    let resp = next.run(req).await;
    if resp.status().is_success() {
        return resp;
    }
    let status = resp.status();
    let (mut parts, body) = resp.into_parts();
    if parts.headers.get(header::CONTENT_TYPE).and_then(|v| v.to_str().ok()).is_some_and(|v| v.starts_with("text/event-stream")) {
        return Response::from_parts(parts, body);
    }
    let bytes = axum::body::to_bytes(body, 1 << 20).await.unwrap_or_default();
    let request_id = parts.headers.get("x-request-id").and_then(|v| v.to_str().ok());
    let out = match serde_json::from_slice::<Value>(&bytes) {
        // Already Anthropic's (ours).
        Ok(v) if v.get("type") == Some(&json!("error")) => v,
        _ => error::from_openai(status.as_u16(), &bytes),
    };
    let out = error::with_request_id(out, request_id);
    parts.headers.remove(header::CONTENT_LENGTH);
    parts.headers.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
    Response::from_parts(parts, Body::from(out.to_string()))
}
