//! pdgate-gateway: the running gateway. HTTP front, upstream client, the PD executors, health
//! checks, metrics. Decisions are delegated to `pdgate-core`; wire formats to
//! `pdgate-protocol`. This crate does the IO and keeps it thin.

mod access_log;
mod admission;
mod auth;
mod discovery;
mod edge;
mod exec;
mod front;
mod health;
mod load;
mod metrics;
mod metrics_listener;
mod record;
mod registry;
mod render;
mod request_id;
mod server;
mod state;
mod telemetry;
mod upstream;
mod workers_api;

pub use pdgate_core::GatewayConfig;
pub use record::ROUTE_HEADER;
pub use server::{start, RunningGateway, StartError};
pub use telemetry::{init_logging, LOG_FILE};

