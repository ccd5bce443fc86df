//! Serving client connections: hyper's HTTP/1 server with its header-read timeout (slowloris),
//! an idle keep-alive timeout, a cap on open connections, `catch_unwind` at the request
//! boundary (a panicking handler is answered 500, the process keeps serving), TCP_NODELAY and
//! graceful shutdown. One timer per connection (hyper's own header timer and the idle one,
//! re-armed only when it fires), none per request or frame.
//!
//! When a client does not complete its headers in time, hyper closes the connection without an
//! answer (it has no request to answer). hyper arms that timer whenever it waits for a request
//! head, so it also bounds a keep-alive connection's idle time.

use std::any::Any;
use std::convert::Infallible;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::Body;
use axum::http::{HeaderValue, Request, Response};
use axum::Router;
use futures_util::FutureExt;
use hyper::body::{Frame, Incoming, SizeHint};
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use pdgate_core::{GatewayConfig, GatewayError};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, Semaphore};
use tokio::task::JoinSet;
use tokio::time::Instant;
use tower_service::Service;

use super::threads::{self, ConnThreads};
use crate::observe::log_limit::{truncate, MAX_VALUE_CHARS};
use crate::observe::metrics::EdgeMetrics;
use crate::observe::scope::{self, RequestScope};
use crate::render::error_response;

/// How long accepting pauses after an accept error other than a client's reset (e.g. out of
/// file descriptors), so the loop does not spin.
const ACCEPT_ERROR_PAUSE: Duration = Duration::from_millis(100);

#[derive(Clone, Copy, Debug)]
pub struct Limits {
    pub header_read: Duration,
    pub idle: Duration,
    pub max_connections: usize,
}

impl Limits {
    pub fn from_config(c: &GatewayConfig) -> Self {
        Limits { header_read: Duration::from_secs(c.header_read_timeout_secs), idle: Duration::from_secs(c.idle_timeout_secs), max_connections: c.max_connections }
    }
}

/// Accepts and serves until `shutdown` turns true, then lets open connections finish their
/// requests (idle ones close at once) and returns when all are gone. With `threads`, each
/// connection is served on one of those threads (edge/threads.rs); without, on this runtime.
pub async fn serve(listener: TcpListener, app: Router, limits: Limits, metrics: Arc<EdgeMetrics>, mut shutdown: watch::Receiver<bool>, mut threads: Option<ConnThreads>) {
    let mut builder = http1::Builder::new();
    // `writev(false)`: hyper copies each body frame into its write buffer and sends it with one
    // plain write, instead of queueing the head, chunk sizes and frames as separate buffers for
    // `writev`. A relayed frame is a few small SSE events, so the copy is cheaper than the
    // vectored bookkeeping (docs/performance.md, run 7: less CPU per stream in interleaved pairs,
    // gateway and worker; within the noise on the quietest run).
    builder.timer(TokioTimer::new()).header_read_timeout(limits.header_read).keep_alive(true).writev(false);
    let builder = Arc::new(builder);
    let permits = Arc::new(Semaphore::new(limits.max_connections));
    let mut conns = JoinSet::new();
    loop {
        let accepted = tokio::select! {
            biased;
            _ = shutdown.wait_for(|s| *s) => break,
            Some(_) = conns.join_next(), if !conns.is_empty() => continue,
            a = listener.accept() => a,
        };
        let stream = match accepted {
            Ok((stream, _)) => stream,
            Err(e) => {
                if !matches!(e.kind(), std::io::ErrorKind::ConnectionAborted | std::io::ErrorKind::ConnectionReset) {
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(ACCEPT_ERROR_PAUSE).await;
                }
                continue;
            }
        };
        let Ok(permit) = permits.clone().try_acquire_owned() else {
            // Closing at once (rather than leaving it in the backlog) tells the client now.
            metrics.connections_rejected.inc();
            drop(stream);
            continue;
        };
        // A peer gateway without TCP_NODELAY loses 40 ms per streamed response to Nagle + delayed ACK.
        let _ = stream.set_nodelay(true);
        let (app, builder, metrics, shutdown) = (app.clone(), builder.clone(), metrics.clone(), shutdown.clone());
        let serve = move |stream: TcpStream| async move {
            let _open = OpenGuard::new(&metrics);
            serve_one(stream, app, &builder, limits.idle, &metrics, shutdown).await;
            drop(permit);
        };
        match threads.as_mut() {
            Some(threads) => threads.spawn(stream, serve),
            None => {
                conns.spawn(serve(stream));
            }
        }
    }
    drop(listener);
    while conns.join_next().await.is_some() {}
    if let Some(threads) = &threads {
        threads.wait().await;
    }
}

/// One connection: hyper drives it; the idle timer and the shutdown signal only ask it to close
/// once its request in flight (if any) is answered.
async fn serve_one(stream: TcpStream, app: Router, builder: &http1::Builder, idle: Duration, metrics: &Arc<EdgeMetrics>, mut shutdown: watch::Receiver<bool>) {
    let activity = Arc::new(Activity::new());
    let svc = {
        let activity = activity.clone();
        let metrics = metrics.clone();
        hyper::service::service_fn(move |req: Request<Incoming>| handle(app.clone(), req, activity.clone(), metrics.clone()))
    };
    let conn = builder.serve_connection(TokioIo::new(stream), svc);
    tokio::pin!(conn);
    let timer = tokio::time::sleep(idle);
    tokio::pin!(timer);
    let mut closing = false;
    let result = loop {
        tokio::select! {
            r = conn.as_mut() => break r,
            () = &mut timer, if !closing => match activity.idle_until(idle) {
                Some(at) => timer.as_mut().reset(at),
                None => {
                    metrics.client_timeouts.with_label_values(&["idle"]).inc();
                    conn.as_mut().graceful_shutdown();
                    closing = true;
                }
            },
            _ = shutdown.wait_for(|s| *s), if !closing => {
                conn.as_mut().graceful_shutdown();
                closing = true;
            }
        }
    };
    if let Err(e) = result {
        if e.is_timeout() {
            metrics.client_timeouts.with_label_values(&["header"]).inc();
        } else {
            tracing::debug!(error = %e, "client connection ended with an error");
        }
    }
}

/// One request: the router under `catch_unwind`, the response body tracked for the idle timer.
async fn handle(mut app: Router, req: Request<Incoming>, activity: Arc<Activity>, metrics: Arc<EdgeMetrics>) -> Result<Response<Tracked>, Infallible> {
    let busy = Busy::new(activity, &metrics.requests_in_flight);
    // Kept for the panic report only (cheap clones: shared bytes).
    let client_id = req.headers().get("x-request-id").cloned();
    let path = req.uri().clone();
    let mut resp = match AssertUnwindSafe(app.call(req.map(Body::new))).catch_unwind().await {
        Ok(Ok(resp)) => resp,
        Ok(Err(never)) => match never {},
        Err(payload) => panic_response(&metrics, client_id.as_ref(), path.path(), payload.as_ref()),
    };
    let scope = resp.extensions_mut().remove::<Arc<RequestScope>>();
    // A busy connection thread moves this connection: the client reconnects for its next
    // request and is placed again (edge/lanes.rs). hyper closes after this response.
    if threads::shed_one() {
        resp.headers_mut().insert(axum::http::header::CONNECTION, HeaderValue::from_static("close"));
        metrics.connections_shed.inc();
    }
    Ok(resp.map(|inner| Tracked { inner, scope, _busy: busy }))
}

/// The 500 for a panicked handler, logged with the request id the client sent (when it is
/// printable) or a fresh one, which the response carries too.
fn panic_response(metrics: &EdgeMetrics, client_id: Option<&HeaderValue>, path: &str, payload: &(dyn Any + Send)) -> Response<Body> {
    metrics.panics.inc();
    let what = payload.downcast_ref::<&str>().copied().or_else(|| payload.downcast_ref::<String>().map(String::as_str)).unwrap_or("(no message)");
    let request_id = client_id
        .and_then(|v| v.to_str().ok())
        .filter(|v| !v.is_empty() && v.len() <= 128 && v.bytes().all(|b| b.is_ascii_alphanumeric() || b"-_.:".contains(&b)))
        .map(str::to_string)
        .unwrap_or_else(|| format!("pdgate-{:032x}", rand::random::<u128>()));
    tracing::error!(request_id = %request_id, path = %truncate(path, MAX_VALUE_CHARS), panic = %truncate(what, MAX_VALUE_CHARS), "request handler panicked; answered 500");
    let mut resp = error_response(&GatewayError::internal(format!("the gateway failed on this request (request id {request_id}); it has been logged")));
    if let Ok(v) = HeaderValue::from_str(&request_id) {
        resp.headers_mut().insert("x-request-id", v);
    }
    resp
}

/// Requests in flight on one connection and when the last one ended, for the idle timer.
struct Activity {
    opened: Instant,
    in_flight: AtomicUsize,
    served: AtomicUsize,
    /// Milliseconds after `opened` when the last response ended.
    last_done_ms: AtomicU64,
}

impl Activity {
    fn new() -> Self {
        Activity { opened: Instant::now(), in_flight: AtomicUsize::new(0), served: AtomicUsize::new(0), last_done_ms: AtomicU64::new(0) }
    }

    /// When the connection will have been idle for `idle`, or `None` if it has been already.
    /// Before its first request the header-read timeout is the one that applies.
    fn idle_until(&self, idle: Duration) -> Option<Instant> {
        let now = Instant::now();
        if self.in_flight.load(Ordering::Acquire) > 0 || self.served.load(Ordering::Acquire) == 0 {
            return Some(now + idle);
        }
        let since = self.opened + Duration::from_millis(self.last_done_ms.load(Ordering::Acquire));
        let at = since + idle;
        (at > now).then_some(at)
    }
}

/// A request in flight, until its response body is dropped (sent or abandoned). Counted per
/// connection (idle timer) and gateway-wide (`requests_in_flight`, what a graceful shutdown
/// waits for).
struct Busy(Arc<Activity>, prometheus::IntGauge);

impl Busy {
    fn new(a: Arc<Activity>, gateway_wide: &prometheus::IntGauge) -> Self {
        a.in_flight.fetch_add(1, Ordering::AcqRel);
        gateway_wide.inc();
        Busy(a, gateway_wide.clone())
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        self.1.dec();
        let ms = u64::try_from(self.0.opened.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.0.last_done_ms.store(ms, Ordering::Release);
        self.0.served.fetch_add(1, Ordering::AcqRel);
        self.0.in_flight.fetch_sub(1, Ordering::AcqRel);
    }
}

/// The response body, unchanged, with the request's scope set while hyper polls it (so the
/// relay's warnings name the request) and the connection's activity updated when it ends.
pub struct Tracked {
    inner: Body,
    scope: Option<Arc<RequestScope>>,
    _busy: Busy,
}

impl hyper::body::Body for Tracked {
    type Data = bytes::Bytes;
    type Error = axum::Error;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        let this = self.get_mut();
        let inner = Pin::new(&mut this.inner);
        match &this.scope {
            Some(s) => scope::sync(s, || inner.poll_frame(cx)),
            None => inner.poll_frame(cx),
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// Counts an open connection in `pdgate_client_connections` for as long as it lives.
struct OpenGuard(Arc<EdgeMetrics>);

impl OpenGuard {
    fn new(m: &Arc<EdgeMetrics>) -> Self {
        m.connections_open.inc();
        OpenGuard(m.clone())
    }
}

impl Drop for OpenGuard {
    fn drop(&mut self) {
        self.0.connections_open.dec();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::routing::get;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    async fn get_raw(addr: std::net::SocketAddr, path: &str, request_id: Option<&str>) -> String {
        let mut s = TcpStream::connect(addr).await.unwrap();
        let id = request_id.map(|i| format!("x-request-id: {i}\r\n")).unwrap_or_default();
        s.write_all(format!("GET {path} HTTP/1.1\r\nHost: t\r\n{id}Connection: close\r\n\r\n").as_bytes()).await.unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).await.unwrap();
        out
    }

    async fn boom() -> &'static str {
        panic!("handler bug for the test")
    }

    #[tokio::test]
    async fn a_panicking_handler_is_answered_500_and_the_server_keeps_serving() {
        panics_are_answered_500(0).await;
    }

    #[tokio::test]
    async fn a_panicking_handler_on_a_connection_thread_is_answered_500_and_that_thread_keeps_serving() {
        panics_are_answered_500(2).await;
    }

    async fn panics_are_answered_500(threads: usize) {
        let app = Router::new().route("/panic", get(boom)).route("/ok", get(|| async { "fine" }));
        let metrics = crate::observe::metrics::Metrics::new().edge;
        let threads = (threads > 0).then(|| ConnThreads::start(threads, metrics.clone()).unwrap());
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (_stop, rx) = watch::channel(false);
        let limits = Limits { header_read: Duration::from_secs(10), idle: Duration::from_secs(5), max_connections: 16 };
        tokio::spawn(serve(listener, app, limits, metrics.clone(), rx, threads));
        for i in 0..3 {
            let answer = get_raw(addr, "/panic", Some(&format!("req-{i}"))).await;
            assert!(answer.starts_with("HTTP/1.1 500"), "{answer}");
            assert!(answer.contains(&format!("x-request-id: req-{i}")), "{answer}");
            let body: serde_json::Value = serde_json::from_str(answer.split("\r\n\r\n").nth(1).unwrap()).unwrap();
            assert_eq!(body["error"]["code"], "internal_error");
            assert!(body["error"]["message"].as_str().unwrap().contains(&format!("req-{i}")));
        }
        // An id the client made up badly is replaced.
        let answer = get_raw(addr, "/panic", Some("../etc;x")).await;
        assert!(answer.contains("x-request-id: pdgate-"), "{answer}");
        assert_eq!(metrics.panics.get(), 4);
        assert!(get_raw(addr, "/ok", None).await.ends_with("fine"));
    }

    /// Sends one keep-alive GET on `s`; the response head and body, read to the body's end.
    async fn get_keep_alive(s: &mut TcpStream) -> String {
        s.write_all(b"GET /ok HTTP/1.1\r\nHost: t\r\n\r\n").await.unwrap();
        let mut out = Vec::new();
        let mut buf = [0u8; 1024];
        while !out.ends_with(b"fine") {
            let n = s.read(&mut buf).await.unwrap();
            assert!(n > 0, "closed before the response ended: {}", String::from_utf8_lossy(&out));
            out.extend_from_slice(&buf[..n]);
        }
        String::from_utf8(out).unwrap().to_ascii_lowercase()
    }

    #[tokio::test]
    async fn a_shedding_thread_says_connection_close_in_a_response_then_closes_after_it() {
        let app = Router::new().route("/ok", get(|| async { "fine" }));
        let metrics = crate::observe::metrics::Metrics::new().edge;
        let threads = ConnThreads::start(1, metrics.clone()).unwrap();
        let shed = threads.shedder();
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (_stop, rx) = watch::channel(false);
        let limits = Limits { header_read: Duration::from_secs(10), idle: Duration::from_secs(5), max_connections: 16 };
        tokio::spawn(serve(listener, app, limits, metrics.clone(), rx, Some(threads)));

        let mut first = TcpStream::connect(addr).await.unwrap();
        assert!(!get_keep_alive(&mut first).await.contains("connection: close"), "nothing to shed yet");
        shed(0, 1);
        let answer = get_keep_alive(&mut first).await;
        assert!(answer.starts_with("http/1.1 200") && answer.contains("connection: close"), "{answer}");
        let mut rest = Vec::new();
        let n = tokio::time::timeout(Duration::from_secs(5), first.read_to_end(&mut rest)).await.expect("closed after the response").unwrap();
        assert_eq!(n, 0, "nothing after the shed response");
        assert_eq!(metrics.connections_shed.get(), 1);

        // The budget was one connection: the next keeps its keep-alive.
        let mut second = TcpStream::connect(addr).await.unwrap();
        for _ in 0..2 {
            assert!(!get_keep_alive(&mut second).await.contains("connection: close"));
        }
        assert_eq!(metrics.connections_shed.get(), 1);
    }
}
