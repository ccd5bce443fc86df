//! pdgate-gateway: the running gateway. HTTP front, upstream client, the PD executors, health
//! checks, metrics. Decisions are delegated to `pdgate-core`; wire formats to
//! `pdgate-protocol`. This crate does the IO and keeps it thin.

mod auth;
mod discovery;
mod edge;
mod exec;
mod front;
mod health;
mod load;
mod membership;
mod metrics;
mod record;
mod registry;
mod render;
mod request_id;
mod server;
mod state;
mod upstream;
mod worker_tls;
mod workers_api;

pub use pdgate_core::GatewayConfig;
pub use record::ROUTE_HEADER;
pub use server::{start, RunningGateway, StartError};

/// The environment variable `pdgate-gateway` (and `pdgate launch`) read the worker key from
/// when `--worker-api-key` is not given; read by the binaries, never by the config schema.
pub const WORKER_API_KEY_ENV: &str = "PDGATE_WORKER_API_KEY";

/// Fills `--worker-api-key` from [`WORKER_API_KEY_ENV`] when the command line left it out.
pub fn worker_api_key_from_env(config: &mut GatewayConfig) {
    if config.worker_api_key.is_none() {
        config.worker_api_key = std::env::var(WORKER_API_KEY_ENV).ok().filter(|k| !k.is_empty());
    }
}

/// Installs the tracing subscriber once; later calls are no-ops. `RUST_LOG` wins over `filter`.
pub fn init_logging(filter: &str) {
    // `warning` is the Python name; tracing calls it `warn` (validate_log_level accepts both).
    let filter = filter.to_ascii_lowercase().replace("warning", "warn");
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .or_else(|_| tracing_subscriber::EnvFilter::try_new(&filter))
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    // Logs go to stderr, coloured only for a terminal (not in files or CI logs).
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let _ = tracing_subscriber::fmt().with_env_filter(filter).with_target(false).with_writer(std::io::stderr).with_ansi(ansi).try_init();
}
