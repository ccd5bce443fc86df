//! The HTTP client that talks to workers: one pooled hyper client, TCP_NODELAY, a connect timeout.

use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::{header, Method, Request, Response};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;

use pdgate_core::{GatewayError, Leg};

#[derive(Clone)]
pub struct Upstream {
    /// Bounds on what a worker may send back (`--max-response-bytes`, `--max-sse-event-bytes`).
    pub limits: AnswerLimits,
    client: Client<HttpConnector, Full<Bytes>>,
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
    pub fn new(connect_timeout: Duration) -> Self {
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        connector.set_connect_timeout(Some(connect_timeout));
        connector.enforce_http(true);
        let client = Client::builder(TokioExecutor::new()).pool_idle_timeout(Duration::from_secs(60)).pool_max_idle_per_host(256).build(connector);
        Upstream { limits: AnswerLimits::from_config(&pdgate_core::GatewayConfig::default()), client }
    }

    pub fn with_limits(mut self, limits: AnswerLimits) -> Self {
        self.limits = limits;
        self
    }

    /// POSTs a JSON body to `base` + `path`; returns once the response head arrived.
    pub async fn post_json(&self, base: &str, path: &str, body: Bytes, request_id: &str, leg: Leg) -> Result<Response<Incoming>, GatewayError> {
        let req = Request::builder()
            .method(Method::POST)
            // Content encodings are not relayed: ask for none (a worker that encodes anyway is refused).
            .header(header::ACCEPT_ENCODING, "identity")
            .uri(format!("{base}{path}"))
            .header(header::CONTENT_TYPE, "application/json")
            .header("x-request-id", request_id);
        // The hop header (edge/hops.rs): a request that comes back to this gateway is cut.
        let req = match crate::edge::scope::via() {
            Some(via) => req.header(header::VIA, via),
            None => req,
        };
        let req = req.body(Full::new(body)).map_err(|e| GatewayError::internal(format!("cannot build request to {base}{path}: {e}")))?;
        self.client.request(req).await.map_err(|e| unreachable(leg, base, &e))
    }

    pub async fn get(&self, url: &str, leg: Leg) -> Result<Response<Incoming>, GatewayError> {
        let req =
            Request::builder().method(Method::GET).uri(url).body(Full::new(Bytes::new())).map_err(|e| GatewayError::internal(format!("cannot build request to {url}: {e}")))?;
        self.client.request(req).await.map_err(|e| unreachable(leg, url, &e))
    }
}

fn unreachable(leg: Leg, target: &str, err: &hyper_util::client::legacy::Error) -> GatewayError {
    // The legacy client's Display is terse ("client error (Connect)"); the source says why.
    let cause = std::error::Error::source(err).map(|s| s.to_string()).unwrap_or_default();
    GatewayError::unreachable(leg, format!("{} worker {target} unreachable: {err} {cause}", leg.as_str()))
}
