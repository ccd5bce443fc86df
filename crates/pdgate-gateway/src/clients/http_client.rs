//! The HTTP [`WorkerClient`]: JSON bodies over the pooled hyper client (`upstream.rs`), answers
//! relayed as the worker's bytes, SGLang's `POST /abort_request` for aborts.

use std::pin::Pin;
use std::task::{ready, Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use futures_util::Stream;
use http_body_util::BodyExt;
use hyper::body::Body;
use pdgate_core::plan::AbortStyle;
use pdgate_core::{GatewayError, Leg};
use pdgate_protocol::kv_transfer;
use serde_json::Value;
use tokio::time::{timeout_at, Instant};

use super::client::{LegAnswer, LegEvent, LegEvents, LegFuture, LegHead, LegRequest, WorkerClient};
use super::leg::{self, deadline_error, whose, RESPONSE_LIMIT};
use crate::clients::upstream::{Upstream, WorkerBody};

/// Longest an abort may take: it runs off the request path and is best effort.
const ABORT_TIMEOUT: Duration = Duration::from_secs(2);
/// Longest wait for a Mooncake bootstrap `/query`.
const QUERY_TIMEOUT: Duration = Duration::from_secs(5);

pub struct HttpClient {
    upstream: Upstream,
}

impl HttpClient {
    pub fn new(upstream: Upstream) -> Self {
        HttpClient { upstream }
    }
}

/// A response body as leg events: data frames pass through as they came, without a copy.
fn events(body: WorkerBody, leg: Leg) -> LegEvents {
    Box::pin(Events { body: Some(body), leg })
}

/// The body's frames as [`LegEvent`]s, polled in place (no future per frame).
struct Events {
    body: Option<WorkerBody>,
    leg: Leg,
}

impl Stream for Events {
    type Item = LegEvent;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<LegEvent>> {
        let leg = self.leg;
        loop {
            let Some(body) = self.body.as_mut() else { return Poll::Ready(None) };
            match ready!(Pin::new(body).poll_frame(cx)) {
                None => {
                    self.body = None;
                    return Poll::Ready(None);
                }
                Some(Err(e)) => {
                    self.body = None;
                    let err = GatewayError::unreachable(leg, format!("{} stream broke off: {e}", whose(leg)));
                    return Poll::Ready(Some(LegEvent::Error(err)));
                }
                Some(Ok(frame)) => {
                    // Trailers carry nothing the relay needs.
                    if let Ok(data) = frame.into_data() {
                        return Poll::Ready(Some(LegEvent::Chunk(data)));
                    }
                }
            }
        }
    }
}

impl WorkerClient for HttpClient {
    fn send(&self, r: LegRequest) -> LegFuture<LegAnswer> {
        let upstream = self.upstream.clone();
        Box::pin(async move {
            let resp = leg::send(&upstream, &r.url, r.path, r.body, &r.request_id, r.leg, r.deadline).await?;
            leg::check_head_encoding(&resp, r.leg)?;
            let head = LegHead { status: resp.status(), content_type: resp.headers().get(hyper::header::CONTENT_TYPE).cloned() };
            Ok(LegAnswer { head, events: events(resp.into_body(), r.leg), ledger: None })
        })
    }

    fn call(&self, r: LegRequest, limit: usize) -> LegFuture<Bytes> {
        let upstream = self.upstream.clone();
        Box::pin(async move {
            let resp = leg::send(&upstream, &r.url, r.path, r.body, &r.request_id, r.leg, r.deadline).await?;
            leg::check_head_encoding(&resp, r.leg)?;
            leg::read_limited(resp.into_body(), limit, r.leg, r.deadline).await
        })
    }

    fn abort(&self, url: &str, how: &AbortStyle) {
        let AbortStyle::AbortRequest { rid } = how else { return };
        // Outside a runtime (the process is shutting down) there is nobody left to tell.
        let Ok(rt) = tokio::runtime::Handle::try_current() else { return };
        let (upstream, url, rid) = (self.upstream.clone(), url.to_string(), rid.clone());
        rt.spawn(async move {
            let body = Bytes::from(serde_json::json!({ "rid": rid }).to_string());
            let sent = tokio::time::timeout(ABORT_TIMEOUT, upstream.post_json(&url, "/abort_request", body, &rid, Leg::Regular)).await;
            match sent {
                Ok(Ok(resp)) => tracing::debug!(worker = %url, rid = %rid, status = resp.status().as_u16(), "abort sent"),
                Ok(Err(e)) => tracing::debug!(worker = %url, rid = %rid, error = %e, "abort not delivered"),
                Err(_) => tracing::debug!(worker = %url, rid = %rid, "abort timed out"),
            }
        });
    }

    fn engine_id(&self, prefill_url: &str, base: &str, deadline: Instant) -> LegFuture<String> {
        let upstream = self.upstream.clone();
        let url = format!("{base}/query");
        // The bootstrap server speaks plain HTTP (engines serve it without TLS): the worker key
        // goes there only when the worker itself is plain HTTP, never in clear past a TLS worker.
        let send_key = !prefill_url.starts_with("https://");
        Box::pin(async move {
            let deadline = deadline.min(Instant::now() + QUERY_TIMEOUT);
            let query = upstream.get_keyed(&url, Leg::Prefill, send_key);
            let resp = timeout_at(deadline, query).await.map_err(|_| deadline_error(Leg::Prefill))??;
            if !resp.status().is_success() {
                return Err(GatewayError::unreachable(Leg::Prefill, format!("{url} answered HTTP {}", resp.status().as_u16())));
            }
            let body = timeout_at(deadline, resp.into_body().collect()).await.map_err(|_| deadline_error(Leg::Prefill))?;
            let body = body.map_err(|e| GatewayError::unreachable(Leg::Prefill, format!("{url}: {e}")))?.to_bytes();
            if body.len() > RESPONSE_LIMIT {
                return Err(GatewayError::protocol(Leg::Prefill, format!("{url}: answer too large")));
            }
            let v: Value = serde_json::from_slice(&body).map_err(|e| GatewayError::protocol(Leg::Prefill, format!("{url}: not JSON: {e}")))?;
            kv_transfer::mooncake_engine_id(&v).ok_or_else(|| GatewayError::protocol(Leg::Prefill, format!("{url}: no engine_id in {v}")))
        })
    }
}
