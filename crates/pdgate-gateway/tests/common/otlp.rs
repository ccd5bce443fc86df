//! An OTLP/gRPC trace receiver for the tracing tests: the generated `TraceService` server on
//! tonic, on loopback, keeping every span it receives. It runs on a thread and runtime of its
//! own, so it outlives each test's runtime (the gateway's exporter is process-wide).
#![allow(dead_code)] // each test binary uses part of it

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{TraceService, TraceServiceServer};
use opentelemetry_proto::tonic::collector::trace::v1::{ExportTraceServiceRequest, ExportTraceServiceResponse};
use opentelemetry_proto::tonic::common::v1::any_value::Value as AnyValue;
use opentelemetry_proto::tonic::trace::v1::Span;

/// One received span, with what the tests look at.
#[derive(Clone, Debug)]
pub struct Got {
    pub name: String,
    pub trace_id: String,
    pub span_id: String,
    pub parent_span_id: String,
    pub service: String,
    pub attributes: Vec<(String, String)>,
    /// OpenTelemetry status code: 0 unset, 1 ok, 2 error.
    pub status: i32,
}

impl Got {
    pub fn attr(&self, key: &str) -> Option<&str> {
        self.attributes.iter().find(|(k, _)| k == key).map(|(_, v)| v.as_str())
    }
}

#[derive(Clone, Default)]
pub struct Receiver {
    pub spans: Arc<Mutex<Vec<Got>>>,
    pub exports: Arc<Mutex<u32>>,
}

fn text(v: &Option<opentelemetry_proto::tonic::common::v1::AnyValue>) -> String {
    match v.as_ref().and_then(|v| v.value.as_ref()) {
        Some(AnyValue::StringValue(s)) => s.clone(),
        Some(AnyValue::IntValue(i)) => i.to_string(),
        Some(AnyValue::BoolValue(b)) => b.to_string(),
        Some(AnyValue::DoubleValue(d)) => d.to_string(),
        other => format!("{other:?}"),
    }
}

fn got(span: &Span, service: &str) -> Got {
    Got {
        name: span.name.clone(),
        trace_id: hex(&span.trace_id),
        span_id: hex(&span.span_id),
        parent_span_id: hex(&span.parent_span_id),
        service: service.to_string(),
        attributes: span.attributes.iter().map(|kv| (kv.key.clone(), text(&kv.value))).collect(),
        status: span.status.as_ref().map_or(0, |s| s.code),
    }
}

pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[tonic::async_trait]
impl TraceService for Receiver {
    async fn export(&self, request: tonic::Request<ExportTraceServiceRequest>) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        let mut spans = self.spans.lock().unwrap();
        for rs in &request.get_ref().resource_spans {
            let attrs = rs.resource.as_ref().map(|r| r.attributes.clone()).unwrap_or_default();
            let service = attrs.iter().find(|kv| kv.key == "service.name").map(|kv| text(&kv.value)).unwrap_or_default();
            for ss in &rs.scope_spans {
                spans.extend(ss.spans.iter().map(|s| got(s, &service)));
            }
        }
        *self.exports.lock().unwrap() += 1;
        Ok(tonic::Response::new(ExportTraceServiceResponse { partial_success: None }))
    }
}

impl Receiver {
    pub fn all(&self) -> Vec<Got> {
        self.spans.lock().unwrap().clone()
    }

    /// Waits (bounded, flushing the gateway's exporter) until `done` holds for the spans seen.
    pub async fn wait_for(&self, what: &str, done: impl Fn(&[Got]) -> bool) -> Vec<Got> {
        for _ in 0..100 {
            pdgate_gateway::flush_traces().await;
            let all = self.all();
            if done(&all) {
                return all;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        panic!("the OTLP receiver never got {what}; it has: {:#?}", self.all());
    }
}

/// Starts a receiver on loopback; returns it and its address.
pub fn start() -> (Receiver, SocketAddr) {
    let receiver = Receiver::default();
    let (tx, rx) = std::sync::mpsc::channel();
    let service = receiver.clone();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
        rt.block_on(async move {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            tx.send(listener.local_addr().unwrap()).unwrap();
            let incoming = tonic::transport::server::TcpIncoming::from(listener);
            tonic::transport::Server::builder().add_service(TraceServiceServer::new(service)).serve_with_incoming(incoming).await.unwrap();
        });
    });
    let addr = rx.recv_timeout(Duration::from_secs(10)).unwrap();
    (receiver, addr)
}
