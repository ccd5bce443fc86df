//! The HTTP clients that talk to workers: the gateway's own HTTP/1.1 client for POSTs to
//! `http://` workers (`h1_client`: the relay reads the worker's socket itself), and one pooled
//! hyper client for `https://` workers (rustls, see worker_tls.rs) and for GETs; both with
//! TCP_NODELAY, the connect timeout and the worker key.
//!
//! Every request to a worker is built here from scratch: nothing of the client's request but
//! the body is forwarded, so the client's `Authorization` never reaches a worker; the worker
//! key (`--worker-api-key`) does.

use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper::body::{Body, Frame, Incoming, SizeHint};
use hyper::header::HeaderValue;
use hyper::{header, Method, Request, Response};
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;

use pdgate_core::{GatewayConfig, GatewayError, Leg};

use crate::clients::h1_client::{H1Body, H1Client, H1Error};

/// How long an idle worker connection is kept, and how many per worker.
const POOL_IDLE_TIMEOUT: Duration = Duration::from_secs(60);
const POOL_MAX_IDLE_PER_HOST: usize = 256;

#[derive(Clone)]
pub struct Upstream {
    /// Bounds on what a worker may send back (`--max-response-bytes`, `--max-sse-event-bytes`).
    pub limits: AnswerLimits,
    client: Client<HttpsConnector<HttpConnector>, Full<Bytes>>,
    /// POSTs to `http://` workers.
    h1: H1Client,
    /// `Bearer KEY` from `--worker-api-key`, marked sensitive (kept out of debug output).
    worker_key: Option<HeaderValue>,
}

/// Bounds on workers' answers: workers are not trusted to bound them themselves.
#[derive(Clone, Copy, Debug)]
pub struct AnswerLimits {
    pub max_response_bytes: usize,
    pub max_sse_event_bytes: usize,
}

impl AnswerLimits {
    pub fn from_config(c: &pdgate_core::GatewayConfig) -> Self {
        AnswerLimits { max_response_bytes: c.max_response_bytes, max_sse_event_bytes: c.max_sse_event_bytes }
    }
}

impl Upstream {
    /// The client for `config`: its connect timeout, answer bounds, worker CA and worker key.
    /// Fails on an unusable `--worker-ca-cert` or `--worker-api-key`.
    pub fn from_config(config: &GatewayConfig) -> Result<Self, String> {
        let tls = crate::clients::worker_tls::client_config(config.worker_ca_cert.as_deref())?;
        let worker_key = match config.worker_api_key.as_deref().filter(|k| !k.is_empty()) {
            None => None,
            Some(key) => {
                let mut value =
                    HeaderValue::from_str(&format!("Bearer {key}")).map_err(|_| "--worker-api-key: only visible ASCII characters can go in an Authorization header".to_string())?;
                value.set_sensitive(true);
                Some(value)
            }
        };
        let connect_timeout = Duration::from_millis(config.worker_connect_timeout_ms);
        let client = client(connect_timeout, tls);
        let h1 = H1Client::new(connect_timeout, POOL_MAX_IDLE_PER_HOST, POOL_IDLE_TIMEOUT);
        Ok(Upstream { limits: AnswerLimits::from_config(config), client, h1, worker_key })
    }

    /// POSTs a JSON body to `base` + `path`; returns once the response head arrived.
    pub async fn post_json(&self, base: &str, path: &str, body: Bytes, request_id: &str, leg: Leg) -> Result<Response<WorkerBody>, GatewayError> {
        let url = format!("{base}{path}");
        let headers = self.post_headers(request_id).map_err(|e| GatewayError::internal(format!("cannot build request to {url}: {e}")))?;
        if base.starts_with("http://") {
            let headers: Vec<(&'static str, &HeaderValue)> = headers.iter().map(|(n, v)| (*n, v)).collect();
            return match self.h1.post(&url, &headers, body).await {
                Ok(resp) => Ok(resp.map(WorkerBody::Own)),
                Err(e) => {
                    let err = GatewayError::unreachable(leg, format!("{} worker {base} unreachable: {e}", leg.as_str()));
                    // A refused or failed connect: the worker never saw the request.
                    Err(if e.is_connect() { err.not_sent() } else { err })
                }
            };
        }
        let mut req = Request::builder().method(Method::POST).uri(&url);
        for (name, value) in headers {
            req = req.header(name, value);
        }
        let req = req.body(Full::new(body)).map_err(|e| GatewayError::internal(format!("cannot build request to {url}: {e}")))?;
        let resp = self.client.request(req).await.map_err(|e| unreachable(leg, base, &e))?;
        Ok(resp.map(WorkerBody::Pooled))
    }

    /// The headers of a POST to a worker, for either client (the own client adds host and
    /// content-length, hyper its own).
    fn post_headers(&self, request_id: &str) -> Result<Vec<(&'static str, HeaderValue)>, hyper::header::InvalidHeaderValue> {
        // Content encodings are not relayed: ask for none (a worker that encodes anyway is refused).
        let mut headers = vec![
            ("accept-encoding", HeaderValue::from_static("identity")),
            ("content-type", HeaderValue::from_static("application/json")),
            ("x-request-id", HeaderValue::from_str(request_id)?),
        ];
        if let Some(key) = &self.worker_key {
            headers.push(("authorization", key.clone()));
        }
        // The hop header (edge/hops.rs): a request that comes back to this gateway is cut.
        if let Some(via) = crate::observe::scope::via() {
            headers.push(("via", via));
        }
        // W3C trace context: the leg's span with --enable-trace, else the client's as it came.
        if let Some((parent, state)) = crate::observe::scope::worker_trace_headers() {
            headers.push(("traceparent", parent));
            if let Some(state) = state {
                headers.push(("tracestate", state));
            }
        }
        Ok(headers)
    }

    /// GETs `url` (health, loads, model cards, `/server_info`, bootstrap query) with the worker key.
    pub async fn get(&self, url: &str, leg: Leg) -> Result<Response<Incoming>, GatewayError> {
        self.get_keyed(url, leg, true).await
    }

    /// GETs `url`, with the worker key only when `send_key`.
    pub async fn get_keyed(&self, url: &str, leg: Leg, send_key: bool) -> Result<Response<Incoming>, GatewayError> {
        let req = Request::builder().method(Method::GET).uri(url);
        let req = if send_key { self.with_key(req) } else { req };
        let req = req.body(Full::new(Bytes::new())).map_err(|e| GatewayError::internal(format!("cannot build request to {url}: {e}")))?;
        self.client.request(req).await.map_err(|e| unreachable(leg, url, &e))
    }

    fn with_key(&self, req: hyper::http::request::Builder) -> hyper::http::request::Builder {
        match &self.worker_key {
            Some(key) => req.header(header::AUTHORIZATION, key.clone()),
            None => req,
        }
    }
}

/// A worker's answer body, from either client.
pub enum WorkerBody {
    Pooled(Incoming),
    Own(H1Body),
}

/// Why a worker's answer body broke off.
#[derive(Debug, thiserror::Error)]
pub enum BodyError {
    #[error(transparent)]
    Pooled(#[from] hyper::Error),
    #[error(transparent)]
    Own(#[from] H1Error),
}

impl Body for WorkerBody {
    type Data = Bytes;
    type Error = BodyError;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        match self.get_mut() {
            WorkerBody::Pooled(b) => Pin::new(b).poll_frame(cx).map(|f| f.map(|r| r.map_err(BodyError::from))),
            WorkerBody::Own(b) => Pin::new(b).poll_frame(cx).map(|f| f.map(|r| r.map_err(BodyError::from))),
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            WorkerBody::Pooled(b) => b.is_end_stream(),
            WorkerBody::Own(b) => b.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            WorkerBody::Pooled(b) => b.size_hint(),
            WorkerBody::Own(b) => b.size_hint(),
        }
    }
}

fn client(connect_timeout: Duration, tls: rustls::ClientConfig) -> Client<HttpsConnector<HttpConnector>, Full<Bytes>> {
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    connector.set_connect_timeout(Some(connect_timeout));
    // The TLS layer takes https:// URLs; plain http goes straight through.
    connector.enforce_http(false);
    let connector = hyper_rustls::HttpsConnectorBuilder::new().with_tls_config(tls).https_or_http().enable_http1().wrap_connector(connector);
    Client::builder(TokioExecutor::new()).pool_idle_timeout(Duration::from_secs(60)).pool_max_idle_per_host(256).build(connector)
}

fn unreachable(leg: Leg, target: &str, err: &hyper_util::client::legacy::Error) -> GatewayError {
    let role = leg.as_str();
    if let Some(tls) = crate::clients::worker_tls::tls_cause(err) {
        // Said plainly: a certificate problem is fixed by configuration, not by waiting.
        tracing::warn!(worker = %target, error = %tls, "TLS handshake with worker failed (see --worker-ca-cert)");
        return GatewayError::unreachable(leg, format!("{role} worker {target} unreachable: TLS handshake failed: {tls}")).not_sent();
    }
    // The legacy client's Display is terse ("client error (Connect)"); the sources say why.
    let mut cause = String::new();
    let mut next = std::error::Error::source(err);
    while let Some(e) = next {
        let text = e.to_string();
        if !cause.contains(&text) {
            cause.push_str(": ");
            cause.push_str(&text);
        }
        next = e.source();
    }
    let e = GatewayError::unreachable(leg, format!("{role} worker {target} unreachable: {err}{cause}"));
    // A refused or failed connect: the worker never saw the request (not a death mid-answer).
    if err.is_connect() {
        e.not_sent()
    } else {
        e
    }
}
