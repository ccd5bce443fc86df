//! pdgate-core: every decision the gateway makes, as pure functions over plain data.
//!
//! Worker specs, the pool snapshot, routing policies, pair selection, retry decisions, the
//! error type and the configuration schema. This crate must not depend on tokio, hyper or any
//! IO: randomness and time come in as arguments, so everything here is unit-tested with a
//! seeded rng.

pub mod armed;
pub mod breaker;
pub mod config;
mod config_json;
mod config_serde;
pub mod epd;
pub mod error;
pub mod health;
pub mod kv_events;
pub mod kv_index;
pub mod pairing;
pub mod placement;
pub mod plan;
pub mod policy;
pub mod radix;
pub mod registration;
pub mod retry;
pub mod retry_budget;
pub mod route;
pub mod slo;
pub mod snapshot;
pub mod worker;

pub use breaker::{Breaker, BreakerConfig, BreakerState, Judgement, Outcome};
pub use config::{CacheSource, ConfigError, GatewayConfig, PolicyName};
pub use error::{ErrorKind, GatewayError, Leg, Source};
pub use health::{HealthState, Probe};
pub use pairing::{KvLayout, PairingKey, PairingMode};
pub use policy::{make_policy, make_policy_with, CachedBlocks, KvMatch, LoadView, NoBlocks, Policy, PolicyOptions, RouteInput, Selection};
pub use radix::RadixTree;
pub use registration::{RegistrationError, WorkerRegistration};
pub use snapshot::{PoolSnapshot, SnapshotOptions, WorkerView};
pub use worker::{KvConnector, WorkerRole, WorkerSpec, DEFAULT_BOOTSTRAP_PORT};
