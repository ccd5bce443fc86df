//! The OpenAI Responses API: `POST /v1/responses`, `GET` and `DELETE /v1/responses/{id}`,
//! `POST /v1/responses/{id}/cancel`.
//!
//! Translated at the gateway (docs/protocols.md, "Responses API"): the body becomes the
//! equivalent chat completion (`pdgate_protocol::responses`), which runs the ordinary
//! transaction under the route name `/v1/responses` (PD placement, rendezvous, retries, resume,
//! decision header, accounting, request log all unchanged), and the chat answer is translated
//! back: whole, or chunk by chunk into the Responses event stream. Kept responses live in a
//! [`store::ResponseStore`] (in memory by default).

mod body;
pub mod items;
pub mod store;

use std::ops::Range;
use std::sync::{Arc, Mutex};

use axum::body::{Body, Bytes};
use axum::extract::{Path, Query, Request, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use pdgate_core::error::{ErrorKind, Source};
use pdgate_core::GatewayError;
use pdgate_protocol::openai::error_body;
use pdgate_protocol::responses::{parse_responses, response_json_from_chat, ResponseMeta, ResponsesRequest, StreamTranslator};
use pdgate_protocol::{Endpoint, InvalidRequest};
use serde_json::{json, Value};

use crate::app::intake::{admit_with, Prepared};
use crate::app::state::AppState;
use crate::render::error_response;
use store::{Bounds, MemoryStore, ResponseStore, StoredResponse};

/// The route name in metrics, the access log and the request log.
pub const ROUTE: &str = "/v1/responses";

/// The routes' state: the gateway's, and the store.
pub struct Responses {
    state: Arc<AppState>,
    store: Arc<dyn ResponseStore>,
}

impl Responses {
    /// With the in-memory store bounded by the config.
    pub fn new(state: Arc<AppState>) -> Arc<Self> {
        let c = &state.config;
        let bounds = Bounds { max_entries: c.responses_store_max_entries, max_bytes: c.responses_store_max_bytes, ttl: std::time::Duration::from_secs(c.responses_store_ttl_secs) };
        Self::with_store(state, Arc::new(MemoryStore::new(bounds)))
    }

    pub fn with_store(state: Arc<AppState>, store: Arc<dyn ResponseStore>) -> Arc<Self> {
        Arc::new(Responses { state, store })
    }

    /// `POST /v1/responses`: an inference route (admission applies).
    pub fn create_route<S: Clone + Send + Sync + 'static>(self: &Arc<Self>) -> Router<S> {
        Router::new().route(ROUTE, post(create)).with_state(self.clone())
    }

    /// The kept responses: `GET`/`DELETE /v1/responses/{id}`, `POST .../cancel`.
    pub fn stored_routes<S: Clone + Send + Sync + 'static>(self: &Arc<Self>) -> Router<S> {
        Router::new()
            .route("/v1/responses/{id}", axum::routing::get(retrieve).delete(delete))
            .route("/v1/responses/{id}/cancel", post(cancel))
            .route("/v1/responses/{id}/input_items", axum::routing::get(input_items))
            .with_state(self.clone())
    }
}

fn not_found(id: &str) -> GatewayError {
    GatewayError { kind: ErrorKind::NotFound, source: Source::Client, leg: None, message: format!("Response with id '{id}' not found."), not_sent: false }
}

/// An OpenAI error with its own `code` (the shared renderer names codes by kind).
fn coded_error(status: StatusCode, message: &str, code: &str, param: Option<&str>) -> Response {
    (status, Json(error_body(message, "invalid_request_error", code, param))).into_response()
}

fn invalid(e: InvalidRequest) -> GatewayError {
    GatewayError::invalid(e.param.as_deref(), e.message)
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// What the body said, kept for the answer's translation: this turn.
struct Turn {
    req: ResponsesRequest,
    /// The conversation before this turn (`previous_response_id`'s items).
    history: Vec<Value>,
}

async fn create(State(r): State<Arc<Responses>>, req: Request) -> Response {
    let prepared: Arc<Mutex<Option<Turn>>> = Arc::default();
    // An unknown previous response is answered here as OpenAI answers it: 400 with its own code
    // (the front counts and logs the refusal by its `GatewayError`).
    let unknown_previous: Arc<Mutex<Option<String>>> = Arc::default();
    let (slot, previous_slot) = (prepared.clone(), unknown_previous.clone());
    let store = r.store.clone();
    let prepare = move |raw: Bytes| async move {
        let mut req = parse_responses(&raw).map_err(invalid)?;
        let history = match &req.previous_response_id {
            Some(id) => match store.get(id).await {
                Some(kept) => kept.items(),
                None => {
                    *lock(&previous_slot) = Some(id.clone());
                    return Err(GatewayError::invalid(Some("previous_response_id"), format!("Previous response with id '{id}' not found.")));
                }
            },
            None => Vec::new(),
        };
        let chat = req.chat_body(&history).map_err(invalid)?;
        *lock(&slot) = Some(Turn { req, history });
        Prepared::built(chat)
    };
    let resp = admit_with(r.state.clone(), Endpoint::ChatCompletions, ROUTE, req, prepare).await;
    if let Some(id) = lock(&unknown_previous).take() {
        return coded_error(StatusCode::BAD_REQUEST, &format!("Previous response with id '{id}' not found."), "previous_response_not_found", Some("previous_response_id"));
    }
    let taken = lock(&prepared).take();
    // Refused before or by the translation, or failed before any answer: the error is already
    // in OpenAI's shape.
    let Some(mut p) = taken else { return resp };
    if !resp.status().is_success() {
        return resp;
    }
    let created_at = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
    let meta = ResponseMeta { id: response_id(rand::random()), created_at, echo: std::mem::take(&mut p.req.echo) };
    if p.req.stream {
        stream_answer(resp, meta, p, r.store.clone())
    } else {
        whole_answer(&r.state, resp, meta, p, r.store.as_ref()).await
    }
}

/// `resp_` and 32 hex digits (not `format!`: its machinery cost more than the digits).
fn response_id(n: u128) -> String {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let mut id = String::with_capacity(37);
    id.push_str("resp_");
    for shift in (0..32).rev() {
        id.push(char::from(HEX[((n >> (shift * 4)) & 0xf) as usize]));
    }
    id
}

/// Keeps a finished response (`store: true`, completed or incomplete) with the conversation
/// before its output: the history, then this input (each item with an id, for `input_items`'
/// cursors). Its output stays in its JSON, read only by a turn that continues it.
async fn keep(store: &dyn ResponseStore, id: &str, p: Turn, json: Bytes, output: Range<usize>, status: &str) {
    if p.req.store && matches!(status, "completed" | "incomplete") {
        let mut input = p.history;
        input.extend(items::with_ids(p.req.input, id));
        store.put(id.to_string(), StoredResponse { response: json, output, input }).await;
    }
}

async fn whole_answer(state: &AppState, resp: Response, meta: ResponseMeta, p: Turn, store: &dyn ResponseStore) -> Response {
    let (mut parts, body) = resp.into_parts();
    let chat = match axum::body::to_bytes(body, state.config.max_response_bytes).await {
        Ok(b) => serde_json::from_slice::<Value>(&b).ok(),
        Err(_) => None,
    };
    let Some(chat) = chat else {
        return error_response(&GatewayError::bad_worker_response(pdgate_core::Leg::Decode, "the chat answer could not be read as JSON for /v1/responses"));
    };
    let (json, output, status) = response_json_from_chat(&chat, &meta);
    let body = Bytes::from(json);
    // The store keeps the same bytes (shared, not copied).
    keep(store, &meta.id, p, body.clone(), output, status).await;
    parts.headers.remove(header::CONTENT_LENGTH);
    parts.headers.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
    Response::from_parts(parts, Body::from(body))
}

/// The chat stream's body, translated event by event ([`body::ResponsesBody`]).
fn stream_answer(resp: Response, meta: ResponseMeta, p: Turn, store: Arc<dyn ResponseStore>) -> Response {
    let (mut parts, body) = resp.into_parts();
    parts.headers.remove(header::CONTENT_LENGTH);
    let id = meta.id.clone();
    Response::from_parts(parts, Body::new(body::ResponsesBody::new(body, StreamTranslator::new(meta), id, p, store)))
}

async fn retrieve(State(r): State<Arc<Responses>>, Path(id): Path<String>) -> Response {
    match r.store.get(&id).await {
        Some(kept) => ([(header::CONTENT_TYPE, HeaderValue::from_static("application/json"))], kept.response.clone()).into_response(),
        None => error_response(&not_found(&id)),
    }
}

async fn delete(State(r): State<Arc<Responses>>, Path(id): Path<String>) -> Response {
    if r.store.delete(&id).await {
        Json(json!({"id": id, "object": "response", "deleted": true})).into_response()
    } else {
        error_response(&not_found(&id))
    }
}

/// `GET /v1/responses/{id}/input_items` (see [`items`]).
async fn input_items(State(r): State<Arc<Responses>>, Path(id): Path<String>, Query(q): Query<items::ListQuery>) -> Response {
    let Some(kept) = r.store.get(&id).await else { return error_response(&not_found(&id)) };
    match items::page(items::input_items(&kept), &q) {
        Ok(list) => Json(list).into_response(),
        Err(bad) => error_response(&GatewayError::invalid(Some(bad.param), bad.message)),
    }
}

/// Only background responses can be cancelled (OpenAI); pdgate runs none, so a kept response
/// is finished and the answer is OpenAI's 400 for it.
async fn cancel(State(r): State<Arc<Responses>>, Path(id): Path<String>) -> Response {
    match r.store.get(&id).await {
        Some(_) => coded_error(
            StatusCode::BAD_REQUEST,
            "Cannot cancel a completed response: only background responses can be cancelled, and pdgate runs none",
            "response_already_completed",
            None,
        ),
        None => error_response(&not_found(&id)),
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_response_id_is_resp_and_32_hex_digits() {
        for n in [0u128, 1, 0xabc, u128::MAX, 0x0123_4567_89ab_cdef_0fed_cba9_8765_4321] {
            assert_eq!(super::response_id(n), format!("resp_{n:032x}"));
        }
    }
}
