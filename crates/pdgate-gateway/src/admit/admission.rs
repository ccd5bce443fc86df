//! Admission: a plain concurrency limit with a bounded FIFO queue, as SMG's
//! `--max-concurrent-requests`, `--queue-size` and `--queue-timeout-secs`.
//!
//! A request takes one of `limit` permits and holds it until its response body ends (a stream
//! holds it for the whole stream). Without a free permit it waits in line, by its
//! `x-pdgate-priority` header (an integer, higher first, default 0), then first come first
//! served; when `queue_size` requests already wait it is answered 429 at once, unless it
//! outranks the lowest waiter, which is then shed (429) in its place; one that waited
//! `queue_timeout` is answered 408, as SMG answers both. The line is `queue.rs`
//! (tower's `ConcurrencyLimit` cannot order by priority). Early rejection by predicted TTFT and
//! the wait for decode KV room happen later, in the transaction (exec/placement.rs,
//! exec/kv_room.rs).

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::extract::{Request, State};
use axum::middleware::Next;
use axum::response::Response;
use hyper::body::{Frame, SizeHint};
use pdgate_core::{GatewayConfig, GatewayError};

use crate::admit::queue::{Denied, Permit, PriorityQueue};

use crate::observe::goodput::Goodput;
use crate::observe::metrics::Metrics;
use crate::render::error_response;

/// What the admission layer is handed (by `app`, when there is a limit): the limit and its
/// queue, and where a refusal is reported.
pub struct Admit {
    pub admission: Admission,
    pub config: Arc<GatewayConfig>,
    pub metrics: Arc<Metrics>,
    pub goodput: Arc<Goodput>,
}

/// The limit, its queue and their counters.
pub struct Admission {
    queue: PriorityQueue,
    limit: usize,
    queue_size: usize,
    queue_timeout: Duration,
}

/// The request header that orders the admission queue (an integer; higher goes first).
pub const PRIORITY_HEADER: &str = "x-pdgate-priority";

/// Why a request was not admitted.
#[derive(Debug, PartialEq, Eq)]
pub enum Refusal {
    QueueFull,
    /// A higher-priority request took this one's place in the full queue.
    Shed,
    QueueTimeout,
}

impl Refusal {
    pub fn as_str(&self) -> &'static str {
        match self {
            Refusal::QueueFull => "queue_full",
            Refusal::Shed => "shed",
            Refusal::QueueTimeout => "queue_timeout",
        }
    }
}

impl Admission {
    pub fn from_config(c: &GatewayConfig) -> Option<Self> {
        let limit = c.concurrency_limit()?;
        Some(Self::new(limit, c.queue_size, Duration::from_secs(c.queue_timeout_secs)))
    }

    pub fn new(limit: usize, queue_size: usize, queue_timeout: Duration) -> Self {
        Admission { queue: PriorityQueue::new(limit, queue_size), limit, queue_size, queue_timeout }
    }

    /// A permit now, after a wait in line, or the reason there is none.
    pub async fn admit(&self, priority: i64) -> Result<Permit, Refusal> {
        self.queue.acquire(priority, self.queue_timeout).await.map_err(|d| match d {
            Denied::Full => Refusal::QueueFull,
            Denied::Shed => Refusal::Shed,
            Denied::TimedOut => Refusal::QueueTimeout,
        })
    }

    /// Requests waiting for a permit now.
    pub fn waiting(&self) -> usize {
        self.queue.waiting()
    }

    /// Requests holding a permit now.
    #[cfg(test)]
    pub fn running(&self) -> usize {
        self.queue.running()
    }
}

/// The request's `x-pdgate-priority`: 0 when absent, an error when not an integer.
pub fn priority_of(req: &Request) -> Result<i64, GatewayError> {
    header_priority(req.headers()).map(|p| p.unwrap_or(0))
}

fn header_priority(headers: &axum::http::HeaderMap) -> Result<Option<i64>, GatewayError> {
    match headers.get(PRIORITY_HEADER) {
        None => Ok(None),
        Some(v) => v
            .to_str()
            .ok()
            .and_then(|s| s.trim().parse::<i64>().ok())
            .map(Some)
            .ok_or_else(|| GatewayError::invalid(None, format!("header {PRIORITY_HEADER} must be an integer (higher is served first)"))),
    }
}

/// A request's priority for placement and early rejection: the header, else SGLang's body
/// field `priority` (an integer, higher first as SGLang schedules by default; forwarded
/// unchanged), else 0. A `priority` that is not an integer is refused (400), as SGLang does.
pub fn request_priority(headers: &axum::http::HeaderMap, body: &serde_json::Map<String, serde_json::Value>) -> Result<i64, GatewayError> {
    if let Some(p) = header_priority(headers)? {
        return Ok(p);
    }
    match body.get("priority") {
        None | Some(serde_json::Value::Null) => Ok(0),
        Some(v) => v.as_i64().ok_or_else(|| GatewayError::invalid(Some("priority"), "'priority' must be an integer (higher is served first)")),
    }
}

/// The middleware on the inference routes (inside the API-key check, so an unauthenticated
/// request never takes a place).
pub async fn limit(State(state): State<Arc<Admit>>, req: Request, next: Next) -> Response {
    let admission = &state.admission;
    let started = Instant::now();
    let arrival_unix_s = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64());
    let priority = match priority_of(&req) {
        Ok(p) => p,
        Err(err) => return error_response(&err),
    };
    let admitted = admission.admit(priority).await;
    let m = &state.metrics;
    m.queue_wait.observe(started.elapsed().as_secs_f64());
    match admitted {
        Ok(permit) => {
            m.admission_running.inc();
            let resp = next.run(req).await;
            let admission_running = m.admission_running.clone();
            resp.map(|inner| Body::new(Permitted { inner, permit: Some(permit), on_release: Some(Box::new(move || admission_running.dec())) }))
        }
        Err(why) => {
            m.admission_refused.with_label_values(&[why.as_str()]).inc();
            let err = match why {
                Refusal::QueueFull => GatewayError::overloaded(format!(
                    "too many requests: {} running and {} waiting (--max-concurrent-requests, --queue-size)",
                    admission.limit, admission.queue_size
                )),
                Refusal::Shed => GatewayError::overloaded(format!("shed from the full admission queue for a request of higher {PRIORITY_HEADER}")),
                Refusal::QueueTimeout => {
                    GatewayError::queue_timeout(format!("the request waited {} s in the admission queue (--queue-timeout-secs)", admission.queue_timeout.as_secs()))
                }
            };
            let route = req.uri().path().to_string();
            let resp = crate::render::refusal_response(&err, why.as_str());
            crate::observe::access_log::refused(&route, resp.status().as_u16(), err.code().as_str(), started);
            m.requests.with_label_values(&[crate::observe::access_log::route_label(&route), resp.status().as_str()]).inc();
            // A refusal is a request that failed its objectives: counted and logged as one.
            let headers = req.headers();
            let slo = state.config.slo_targets();
            let refused = crate::observe::goodput::Refused {
                route: crate::observe::access_log::route_label(&route),
                status: resp.status().as_u16(),
                error: err.code(),
                slo: slo.with_headers(|name| headers.get(name).map(|v| v.as_bytes())).unwrap_or(slo),
                started,
                arrival_unix_s,
                client_request_id: crate::request_id::client_id(headers, &state.config.request_id_headers),
            };
            state.goodput.refused(&m.slo, refused);
            resp
        }
    }
}

/// A response body that holds its request's permit until it ends or is dropped.
struct Permitted {
    inner: Body,
    permit: Option<Permit>,
    on_release: Option<Box<dyn FnOnce() + Send>>,
}

impl Permitted {
    fn release(&mut self) {
        if self.permit.take().is_some() {
            if let Some(f) = self.on_release.take() {
                f();
            }
        }
    }
}

impl Drop for Permitted {
    fn drop(&mut self) {
        self.release();
    }
}

impl hyper::body::Body for Permitted {
    type Data = bytes::Bytes;
    type Error = axum::Error;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.inner).poll_frame(cx);
        if matches!(polled, Poll::Ready(None)) {
            this.release();
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_full_queue_refuses_at_once_and_a_long_wait_times_out() {
        let a = Arc::new(Admission::new(1, 1, Duration::from_secs(5)));
        let held = a.admit(0).await.unwrap();
        assert_eq!(a.running(), 1);
        let waiter = tokio::spawn({
            let a = a.clone();
            async move { a.admit(0).await.map(|_| ()) }
        });
        tokio::task::yield_now().await;
        assert_eq!(a.waiting(), 1);
        assert_eq!(a.admit(0).await.unwrap_err(), Refusal::QueueFull, "one place in line, taken");
        tokio::time::advance(Duration::from_secs(6)).await;
        assert_eq!(waiter.await.unwrap(), Err(Refusal::QueueTimeout));
        assert_eq!(a.waiting(), 0);
        drop(held);
        assert!(a.admit(0).await.is_ok());
    }

    #[tokio::test(start_paused = true)]
    async fn waiters_are_admitted_in_arrival_order_when_permits_free_up() {
        let a = Arc::new(Admission::new(1, 10, Duration::from_secs(60)));
        let held = a.admit(0).await.unwrap();
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        for i in 0..3 {
            let (a, tx) = (a.clone(), tx.clone());
            tokio::spawn(async move {
                let p = a.admit(0).await.unwrap();
                tx.send(i).unwrap();
                tokio::time::sleep(Duration::from_millis(10)).await;
                drop(p);
            });
            tokio::task::yield_now().await;
        }
        drop(held);
        let order: Vec<i32> = [rx.recv().await, rx.recv().await, rx.recv().await].into_iter().flatten().collect();
        assert_eq!(order, [0, 1, 2]);
    }

    #[tokio::test(start_paused = true)]
    async fn no_queue_means_429_as_soon_as_the_limit_is_reached() {
        let a = Admission::new(2, 0, Duration::from_secs(60));
        let _p1 = a.admit(0).await.unwrap();
        let _p2 = a.admit(0).await.unwrap();
        assert_eq!(a.admit(0).await.unwrap_err(), Refusal::QueueFull);
    }
}
