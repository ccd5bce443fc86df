//! pdgate-core: every decision the gateway makes, as pure functions over plain data.
//!
//! Worker specs, the pool snapshot, routing policies, pair selection, retry decisions, the
//! error type and the configuration schema. This crate must not depend on tokio, hyper or any
//! IO: randomness and time come in as arguments, so everything here is unit-tested with a
//! seeded rng.

pub mod config;
mod config_serde;
pub mod error;
pub mod health;
pub mod policy;
pub mod retry;
pub mod route;
pub mod snapshot;
pub mod worker;

pub use config::{ConfigError, GatewayConfig, PolicyName};
pub use error::{ErrorKind, GatewayError, Leg, Source};
pub use health::HealthState;
pub use policy::{make_policy, Policy, RouteInput, Selection};
pub use snapshot::{PoolSnapshot, WorkerView};
pub use worker::{KvConnector, WorkerRole, WorkerSpec};
