//! Observation: what the other stages report, never what they decide. Prometheus metrics
//! (`metrics.rs`, open it first), goodput against the SLOs and the `--request-log` writer
//! (`goodput.rs`, `request_log.rs`), the access log and the decision record behind
//! `x-pdgate-route` (`access_log.rs`, `record.rs`), how much a request may make the gateway
//! log (`log_limit.rs`), the request's scope for code outside its task (`scope.rs`), logging
//! setup and OpenTelemetry traces (`telemetry.rs`, `log_file.rs`, `tracing_export.rs`).
//!
//! The bottom stage: every stage may use it; it uses only the crate's leaves (`render`,
//! `request_id`), pdgate-core and pdgate-protocol.

pub mod access_log;
pub mod goodput;
pub mod log_file;
pub mod log_limit;
pub mod metrics;
pub mod placement_metrics;
pub mod record;
pub mod request_log;
pub mod scope;
pub mod telemetry;
pub mod tracing_export;
