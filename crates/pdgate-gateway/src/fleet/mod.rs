//! The fleet: which workers there are and what is known of them, feeding every decision.
//! `registry.rs` (open it first) holds the routing view, an immutable `PoolSnapshot` swapped
//! atomically, and each worker's runtime counters and breaker; `membership.rs` applies the
//! one stream of changes (`Add | Drain | SetEnabled | Remove`) from the three sources: static
//! flags (`app/server.rs`), the `/workers` API (`workers_api.rs`) and Kubernetes
//! (`discovery/`). Facts come from health checks (`health.rs`), load polling (`load.rs`: where
//! a worker's load comes from), the gateway's own token counts (`token_load.rs`) and engine KV
//! events (`kv_sub/`); `own_addr.rs` refuses a worker that is this gateway.
//!
//! May use `clients` (to ask workers), `observe` and the leaves; never `exec`, `admit`, `edge`
//! or `app`.

pub mod discovery;
pub mod gauges;
pub mod health;
pub mod kv_sub;
pub mod load;
pub mod membership;
pub mod own_addr;
pub mod registry;
pub mod token_load;
pub mod workers_api;
