//! OpenTelemetry tracing (`--enable-trace`, `--otlp-traces-endpoint`), as SMG exports it: OTLP
//! over gRPC, `host:port` meaning `http://host:port`, default `localhost:4317`.
//!
//! - Spans: the request span (`front.rs`, target [`REQUEST_TARGET`]) and the phase spans of
//!   `exec/` (target [`TARGET`]: admit, attempt, select, the legs, relay, finish). The log
//!   layers never see the phase spans; without `--enable-trace` nothing sees them, so their
//!   callsites are disabled once and cost nothing per request.
//! - Export: a batch processor on its own thread, behind a bounded queue ([`QUEUE`] spans).
//!   A span that finds the queue full is dropped and counted (`pdgate_trace_spans_dropped_total`);
//!   a request never waits for the exporter. The gRPC channel runs on a small runtime of its
//!   own, so it outlives any one gateway's runtime (Python may start several in turn).
//! - Propagation (W3C trace context): a client's `traceparent`/`tracestate` is the parent of
//!   the request span; every leg sent to a worker carries a `traceparent` naming the leg's
//!   span. With tracing off, a client's valid trace context is passed to the workers as it
//!   came.
//!
//! Like the log options, tracing is set up once per process: a second gateway embedded in the
//! same Python process traces (or not) as the first one decided.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, LazyLock, OnceLock};
use std::time::Duration;

use axum::http::{HeaderMap, HeaderValue};
use opentelemetry::trace::{SpanContext, SpanId, TraceContextExt, TraceFlags, TraceId, TraceState, TracerProvider as _};
use opentelemetry_otlp::WithExportConfig;
use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::trace::{BatchConfigBuilder, BatchSpanProcessor, SdkTracerProvider, SpanData, SpanExporter, SpanProcessor};
use opentelemetry_sdk::Resource;
use prometheus::{IntCounter, IntCounterVec, Opts, Registry};
use tracing::{Metadata, Subscriber};
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::Layer;

/// Target of the phase spans (exported, never logged).
pub const TARGET: &str = "pdgate::trace";
/// Target of the request span: logged (it carries the ids of every log line) and exported.
pub const REQUEST_TARGET: &str = "pdgate_gateway::request";

/// Spans waiting for export at most; one more is dropped and counted.
pub const QUEUE: usize = 2048;
/// Spans per export call, and the longest a span waits for a batch (SMG's values).
const BATCH: usize = 64;
const DELAY: Duration = Duration::from_millis(500);
/// Longest a flush (graceful shutdown) waits for the collector.
const FLUSH_TIMEOUT: Duration = Duration::from_secs(5);
/// Longest `tracestate` passed on (W3C: at least 512 characters should be propagated).
const MAX_TRACESTATE: usize = 512;

/// The process's exporter, once `--enable-trace` set it up.
struct Export {
    provider: SdkTracerProvider,
    /// Drives the gRPC channel's connection tasks; lives as long as the process.
    _runtime: tokio::runtime::Runtime,
}

static EXPORT: OnceLock<Export> = OnceLock::new();

/// Whether this process exports traces.
pub fn enabled() -> bool {
    EXPORT.get().is_some()
}

/// The exporter's counters: process-wide (the exporter is), shown by every gateway's `/metrics`.
struct Counters {
    dropped: IntCounter,
    exported: IntCounterVec,
}

static COUNTERS: LazyLock<Counters> = LazyLock::new(|| {
    let dropped = IntCounter::new("pdgate_trace_spans_dropped_total", "Spans dropped because the export queue was full (the collector is slow or unreachable)")
        .unwrap_or_else(|e| panic!("metric pdgate_trace_spans_dropped_total: {e}"));
    let exported = IntCounterVec::new(Opts::new("pdgate_trace_spans_exported_total", "Spans handed to the OTLP collector, by result (ok, error)"), &["result"])
        .unwrap_or_else(|e| panic!("metric pdgate_trace_spans_exported_total: {e}"));
    for result in ["ok", "error"] {
        exported.with_label_values(&[result]);
    }
    Counters { dropped, exported }
});

/// Registers the exporter's counters (at 0 until tracing exports) in a gateway's registry.
pub fn register_metrics(r: &Registry) {
    let c = &*COUNTERS;
    r.register(Box::new(c.dropped.clone())).unwrap_or_else(|e| panic!("metric pdgate_trace_spans_dropped_total: {e}"));
    r.register(Box::new(c.exported.clone())).unwrap_or_else(|e| panic!("metric pdgate_trace_spans_exported_total: {e}"));
}

/// The batch processor behind a queue bound of our own, so that drops are counted: a span is
/// counted from its end until its export call returned, which is never less than what the
/// batch processor holds, so its own (silent) drop never happens.
#[derive(Debug)]
struct Bounded {
    inner: BatchSpanProcessor,
    queued: Arc<AtomicUsize>,
}

impl SpanProcessor for Bounded {
    fn on_start(&self, span: &mut opentelemetry_sdk::trace::Span, cx: &opentelemetry::Context) {
        self.inner.on_start(span, cx);
    }

    fn on_end(&self, span: SpanData) {
        if self.queued.fetch_add(1, Ordering::AcqRel) >= QUEUE {
            self.queued.fetch_sub(1, Ordering::AcqRel);
            COUNTERS.dropped.inc();
            return;
        }
        self.inner.on_end(span);
    }

    fn force_flush(&self) -> OTelSdkResult {
        self.inner.force_flush()
    }

    fn shutdown_with_timeout(&self, timeout: Duration) -> OTelSdkResult {
        self.inner.shutdown_with_timeout(timeout)
    }

    fn set_resource(&mut self, resource: &Resource) {
        self.inner.set_resource(resource);
    }
}

/// Whether the last export failed (for logging the changes only).
static EXPORT_FAILING: AtomicBool = AtomicBool::new(false);

/// The OTLP exporter, counting what it exported and releasing the queue bound.
#[derive(Debug)]
struct Counted<E> {
    inner: E,
    queued: Arc<AtomicUsize>,
}

impl<E: SpanExporter> SpanExporter for Counted<E> {
    async fn export(&self, batch: Vec<SpanData>) -> OTelSdkResult {
        let n = batch.len();
        let result = self.inner.export(batch).await;
        self.queued.fetch_sub(n, Ordering::AcqRel);
        let label = if result.is_ok() { "ok" } else { "error" };
        COUNTERS.exported.with_label_values(&[label]).inc_by(n as u64);
        // Said once per change, not per batch: a down collector fails every 500 ms.
        match &result {
            Err(e) if !EXPORT_FAILING.swap(true, Ordering::AcqRel) => tracing::warn!(error = %e, "trace export failing: the spans of failed batches are lost"),
            Ok(()) if EXPORT_FAILING.swap(false, Ordering::AcqRel) => tracing::info!("trace export works again"),
            _ => {}
        }
        result
    }

    fn shutdown_with_timeout(&self, timeout: Duration) -> OTelSdkResult {
        self.inner.shutdown_with_timeout(timeout)
    }

    fn force_flush(&self) -> OTelSdkResult {
        self.inner.force_flush()
    }

    fn set_resource(&mut self, resource: &Resource) {
        self.inner.set_resource(resource);
    }
}

/// Sets up the exporter for `endpoint` (`--otlp-traces-endpoint`) and returns the layer that
/// turns the gateway's spans into OpenTelemetry spans. Once per process: a second call
/// returns `None`.
pub fn install<S>(endpoint: &str) -> Result<Option<Box<dyn Layer<S> + Send + Sync>>, String>
where
    S: Subscriber + for<'a> LookupSpan<'a> + Send + Sync,
{
    if enabled() {
        return Ok(None);
    }
    let url = pdgate_core::config::otlp_endpoint_url(endpoint)?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name("pdgate-otlp")
        .enable_all()
        .build()
        .map_err(|e| format!("--enable-trace: cannot start the exporter's runtime: {e}"))?;
    // The lazy gRPC channel spawns its worker on the current runtime: ours.
    let built = {
        let _inside = runtime.enter();
        opentelemetry_otlp::SpanExporter::builder().with_tonic().with_endpoint(&url).build()
    };
    let exporter = match built {
        Ok(e) => e,
        Err(e) => {
            // Dropping a runtime may block, which async code (a caller's runtime) must not.
            runtime.shutdown_background();
            return Err(format!("--otlp-traces-endpoint {endpoint:?}: {e}"));
        }
    };
    let queued = Arc::new(AtomicUsize::new(0));
    let config = BatchConfigBuilder::default().with_max_queue_size(QUEUE).with_max_export_batch_size(BATCH).with_scheduled_delay(DELAY).build();
    let batch = BatchSpanProcessor::builder(Counted { inner: exporter, queued: queued.clone() }).with_batch_config(config).build();
    // OTEL_SERVICE_NAME (read by the default resource) wins over the name "pdgate".
    let resource = match std::env::var("OTEL_SERVICE_NAME") {
        Ok(name) if !name.is_empty() => Resource::builder().build(),
        _ => Resource::builder().with_service_name("pdgate").build(),
    };
    let provider = SdkTracerProvider::builder().with_span_processor(Bounded { inner: batch, queued }).with_resource(resource).build();
    let tracer = provider.tracer("pdgate");
    if let Err(lost) = EXPORT.set(Export { provider, _runtime: runtime }) {
        // Another gateway set tracing up at the same moment: its exporter is the process's.
        lost._runtime.shutdown_background();
        return Ok(None);
    }
    let layer = tracing_opentelemetry::layer()
        .with_tracer(tracer)
        .with_location(false)
        .with_threads(false)
        .with_tracked_inactivity(false)
        .with_level(false)
        .with_filter(tracing_subscriber::filter::filter_fn(exported));
    Ok(Some(Box::new(layer)))
}

/// What becomes OpenTelemetry data: the request and phase spans, and warnings and errors
/// (as events of the span they happen in).
fn exported(meta: &Metadata<'_>) -> bool {
    if meta.is_span() {
        meta.target() == TARGET || meta.target() == REQUEST_TARGET
    } else {
        *meta.level() <= tracing::Level::WARN
    }
}

/// Exports what has ended so far (graceful shutdown), bounded by [`FLUSH_TIMEOUT`].
pub async fn flush() {
    let Some(export) = EXPORT.get() else { return };
    let provider = export.provider.clone();
    let flushed = tokio::time::timeout(FLUSH_TIMEOUT, tokio::task::spawn_blocking(move || provider.force_flush())).await;
    match flushed {
        Ok(Ok(Ok(()))) => {}
        Ok(Ok(Err(e))) => tracing::warn!(error = %e, "trace flush failed"),
        Ok(Err(e)) => tracing::warn!(error = %e, "trace flush failed"),
        Err(_) => tracing::warn!(timeout_secs = FLUSH_TIMEOUT.as_secs(), "trace flush timed out: the collector did not answer"),
    }
}

/// A client's W3C trace context, validated: the headers as they came.
#[derive(Clone, Debug)]
pub struct ClientTrace {
    traceparent: HeaderValue,
    tracestate: Option<HeaderValue>,
    context: SpanContext,
}

impl ClientTrace {
    /// The client's `traceparent` (and `tracestate`) when the `traceparent` is valid W3C.
    pub fn from_headers(headers: &HeaderMap) -> Option<Self> {
        let traceparent = headers.get("traceparent")?;
        let (trace_id, span_id, flags) = parse_traceparent(traceparent.to_str().ok()?)?;
        let tracestate = headers.get("tracestate").filter(|v| v.len() <= MAX_TRACESTATE && v.to_str().is_ok()).cloned();
        let state = tracestate.as_ref().and_then(|v| v.to_str().ok()).and_then(|s| s.parse::<TraceState>().ok()).unwrap_or_default();
        let context = SpanContext::new(trace_id, span_id, flags, true, state);
        Some(ClientTrace { traceparent: traceparent.clone(), tracestate, context })
    }

    /// Makes the client's span the parent of `span` (the request span, not yet entered).
    pub fn adopt(&self, span: &tracing::Span) {
        let parent = opentelemetry::Context::new().with_remote_span_context(self.context.clone());
        if let Err(e) = span.set_parent(parent) {
            tracing::debug!(error = %e, "client trace context not adopted");
        }
    }
}

/// Parses a W3C `traceparent` (`00-<32 hex>-<16 hex>-<2 hex>`; a later version may append
/// `-...` fields). All-zero ids, version `ff` and upper-case hex are invalid.
pub fn parse_traceparent(value: &str) -> Option<(TraceId, SpanId, TraceFlags)> {
    let v = value.trim();
    let head = v.get(..55)?;
    let rest = &v[55..];
    let parts: Vec<&str> = head.split('-').collect();
    let [version, trace, span, flags] = parts.as_slice() else { return None };
    let hex = |s: &str, n: usize| s.len() == n && s.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b));
    if !(hex(version, 2) && hex(trace, 32) && hex(span, 16) && hex(flags, 2)) || *version == "ff" {
        return None;
    }
    // Version 00 is exactly 55 characters; a later one may carry more after a dash.
    if (*version == "00" && !rest.is_empty()) || (!rest.is_empty() && !rest.starts_with('-')) {
        return None;
    }
    let trace_id = TraceId::from_hex(trace).ok().filter(|t| *t != TraceId::INVALID)?;
    let span_id = SpanId::from_hex(span).ok().filter(|s| *s != SpanId::INVALID)?;
    let flags = u8::from_str_radix(flags, 16).ok()?;
    Some((trace_id, span_id, TraceFlags::new(flags)))
}

/// The `traceparent` value naming `cx` (version 00).
pub fn format_traceparent(cx: &SpanContext) -> String {
    format!("00-{}-{}-{:02x}", cx.trace_id(), cx.span_id(), cx.trace_flags().to_u8())
}

/// The trace headers for a request to a worker, sent from inside a leg's span: with tracing
/// on, a `traceparent` naming the current span; off, the client's own context, unchanged.
pub fn worker_headers(client: Option<&ClientTrace>) -> Option<(HeaderValue, Option<HeaderValue>)> {
    if !enabled() {
        let c = client?;
        return Some((c.traceparent.clone(), c.tracestate.clone()));
    }
    let cx = tracing::Span::current().context();
    let span = cx.span();
    let sc = span.span_context();
    if !sc.is_valid() {
        return None;
    }
    let parent = HeaderValue::from_str(&format_traceparent(sc)).ok()?;
    let state = sc.trace_state().header();
    let state = (!state.is_empty()).then(|| HeaderValue::from_str(&state).ok()).flatten();
    Some((parent, state))
}

/// Marks `span` failed: `error.type` (the gateway's error code) and the OpenTelemetry status.
pub fn record_error(span: &tracing::Span, code: &str) {
    if enabled() {
        span.record("error.type", code);
        span.record("otel.status_code", "ERROR");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const VALID: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    #[test]
    fn a_valid_traceparent_parses_to_its_ids() {
        let (t, s, f) = parse_traceparent(VALID).unwrap();
        assert_eq!(t.to_string(), "4bf92f3577b34da6a3ce929d0e0e4736");
        assert_eq!(s.to_string(), "00f067aa0ba902b7");
        assert!(f.is_sampled());
        let cx = SpanContext::new(t, s, f, true, TraceState::default());
        assert_eq!(format_traceparent(&cx), VALID);
    }

    #[test]
    fn malformed_traceparents_are_refused() {
        let bad = [
            "",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
            "00_4bf92f3577b34da6a3ce929d0e0e4736_00f067aa0ba902b7_01",
            "00-4bf92f3577b34da6a3ce929d0e0e473g-00f067aa0ba902b7-01",
        ];
        for b in bad {
            assert!(parse_traceparent(b).is_none(), "{b:?} accepted");
        }
    }

    #[test]
    fn a_later_version_may_append_fields() {
        assert!(parse_traceparent("01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-later").is_some());
        assert!(parse_traceparent("01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01x").is_none());
    }

    #[test]
    fn client_headers_keep_a_bounded_tracestate_only_with_a_valid_traceparent() {
        let mut h = HeaderMap::new();
        h.insert("tracestate", HeaderValue::from_static("congo=t61rcWkgMzE"));
        assert!(ClientTrace::from_headers(&h).is_none());
        h.insert("traceparent", HeaderValue::from_static(VALID));
        let c = ClientTrace::from_headers(&h).unwrap();
        assert_eq!(c.tracestate.as_ref().unwrap(), "congo=t61rcWkgMzE");
        assert_eq!(c.context.trace_state().header(), "congo=t61rcWkgMzE");
        h.insert("tracestate", HeaderValue::from_str(&"a=b,".repeat(200)).unwrap());
        assert!(ClientTrace::from_headers(&h).unwrap().tracestate.is_none());
    }

    #[test]
    fn with_tracing_off_a_client_context_passes_unchanged() {
        // This unit-test process never installs the exporter.
        assert!(!enabled());
        let mut h = HeaderMap::new();
        h.insert("traceparent", HeaderValue::from_static(VALID));
        h.insert("tracestate", HeaderValue::from_static("k=v"));
        let c = ClientTrace::from_headers(&h).unwrap();
        let (p, s) = worker_headers(Some(&c)).unwrap();
        assert_eq!(p, VALID);
        assert_eq!(s.unwrap(), "k=v");
        assert!(worker_headers(None).is_none());
    }
}
