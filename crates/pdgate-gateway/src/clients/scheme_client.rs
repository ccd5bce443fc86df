//! The gateway's [`WorkerClient`]: each leg goes over the wire its worker's URL names
//! (`grpc://` to the gRPC client, `http(s)://` to the HTTP one), so one fleet may mix both.

use std::sync::Arc;

use bytes::Bytes;
use pdgate_core::plan::AbortStyle;
use pdgate_core::worker::is_grpc_url;
use tokio::time::Instant;

use super::client::{LegAnswer, LegFuture, LegRequest, WorkerClient};
use super::http_client::HttpClient;
use crate::clients::grpc::GrpcClient;

pub struct SchemeClient {
    http: HttpClient,
    grpc: Arc<GrpcClient>,
}

impl SchemeClient {
    pub fn new(http: HttpClient, grpc: Arc<GrpcClient>) -> Self {
        SchemeClient { http, grpc }
    }
}

impl WorkerClient for SchemeClient {
    fn send(&self, req: LegRequest) -> LegFuture<LegAnswer> {
        if is_grpc_url(&req.url) {
            self.grpc.send(req)
        } else {
            self.http.send(req)
        }
    }

    fn call(&self, req: LegRequest, limit: usize) -> LegFuture<Bytes> {
        if is_grpc_url(&req.url) {
            self.grpc.call(req, limit)
        } else {
            self.http.call(req, limit)
        }
    }

    fn abort(&self, url: &str, how: &AbortStyle) {
        if is_grpc_url(url) {
            self.grpc.abort(url, how)
        } else {
            self.http.abort(url, how)
        }
    }

    fn engine_id(&self, prefill_url: &str, bootstrap_base: &str, deadline: Instant) -> LegFuture<String> {
        if is_grpc_url(prefill_url) {
            self.grpc.engine_id(prefill_url, bootstrap_base, deadline)
        } else {
            self.http.engine_id(prefill_url, bootstrap_base, deadline)
        }
    }
}
