//! pdgate-gateway: the running gateway. HTTP front, upstream client, the PD executors, health
//! checks, metrics. Decisions are delegated to `pdgate-core`; wire formats to
//! `pdgate-protocol`. This crate does the IO and keeps it thin.

mod access_log;
mod admission;
mod admission_queue;
mod auth;
mod discovery;
mod edge;
mod exec;
mod front;
mod goodput;
pub mod grpc;
mod h1_client;
mod health;
pub mod kv_sub;
mod load;
mod log_file;
mod membership;
mod metrics;
mod metrics_listener;
mod policy_rng;
pub mod prompt_ids;
mod record;
mod registry;
mod render;
mod request_id;
mod request_log;
mod server;
mod state;
mod telemetry;
mod token_load;
mod tracing_export;
mod upstream;
mod worker_tls;
mod workers_api;

pub use log_file::LOG_FILE;
pub use pdgate_core::GatewayConfig;
pub use record::ROUTE_HEADER;
pub use server::{start, RunningGateway, StartError};
pub use telemetry::init_logging;
pub use tracing_export::flush as flush_traces;

/// The environment variable `pdgate-gateway` (and `pdgate launch`) read the worker key from
/// when `--worker-api-key` is not given; read by the binaries, never by the config schema.
pub const WORKER_API_KEY_ENV: &str = "PDGATE_WORKER_API_KEY";

/// Fills `--worker-api-key` from [`WORKER_API_KEY_ENV`] when the command line left it out.
pub fn worker_api_key_from_env(config: &mut GatewayConfig) {
    if config.worker_api_key.is_none() {
        config.worker_api_key = std::env::var(WORKER_API_KEY_ENV).ok().filter(|k| !k.is_empty());
    }
}
