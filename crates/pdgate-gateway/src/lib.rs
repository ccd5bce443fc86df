//! pdgate-gateway: the running gateway. Decisions are delegated to `pdgate-core`; wire formats
//! to `pdgate-protocol`. This crate does the IO and keeps it thin.
//!
//! Its folders are the stages of a request, in the request's order, and imports run one way:
//! a stage uses the stages below it, never one above (`scripts/import_layers.py` checks it).
//!
//! ```text
//! app      start/stop, the routes, the handles each stage gets (AppState)
//!  │
//! edge     connections, their threads and limits, loop detection, API keys
//! admit    --max-concurrent-requests and its priority queue
//! exec     a request as one transaction: place → select → plan → legs → commit → relay → finish
//!  │         (reads the fleet's snapshot, runs its legs over a worker client)
//! fleet    which workers there are and what is known of them: registry, membership, health,
//!  │         load, discovery, KV events, the /workers API
//! clients  talking to one worker: the WorkerClient trait, HTTP (own h1 client) and gRPC, TLS
//! observe  metrics, goodput, request/access logs, decision records, logging, traces
//! ```
//!
//! Below every stage, three leaves that import nothing of this crate: `render` (the one place a
//! `GatewayError` becomes an HTTP response), `request_id` (minting the ids legs rendezvous on)
//! and `prompt_ids` (a prompt's token ids for KV-event routing).

mod admit;
mod app;
mod clients;
mod edge;
mod exec;
mod fleet;
mod observe;
pub mod prompt_ids;
mod render;
mod request_id;

pub use app::server::{start, RunningGateway, StartError};
pub use clients::grpc;
pub use fleet::kv_sub;
pub use observe::log_file::LOG_FILE;
pub use observe::record::ROUTE_HEADER;
pub use observe::telemetry::init_logging;
pub use observe::tracing_export::flush as flush_traces;
pub use pdgate_core::GatewayConfig;

/// The environment variable `pdgate-gateway` (and `pdgate launch`) read the worker key from
/// when `--worker-api-key` is not given; read by the binaries, never by the config schema.
pub const WORKER_API_KEY_ENV: &str = "PDGATE_WORKER_API_KEY";

/// Fills `--worker-api-key` from [`WORKER_API_KEY_ENV`] when the command line left it out.
pub fn worker_api_key_from_env(config: &mut GatewayConfig) {
    if config.worker_api_key.is_none() {
        config.worker_api_key = std::env::var(WORKER_API_KEY_ENV).ok().filter(|k| !k.is_empty());
    }
}
