//! The client edge: where a request enters. How connections are served and bounded
//! (`conn.rs`, open it first: timeouts, the connection cap, panics), the threads they are
//! served on and which thread takes which (`threads.rs`, `lanes.rs`), loop detection (`hops.rs`)
//! and the API keys (`auth.rs`). The routes themselves are `app/front.rs`.
//!
//! May use `observe`, `clients` (the connection threads mark their lane for the worker
//! connection pool) and the leaves; hands requests to `admit` and `exec` only through the
//! routes in `app`.

pub mod auth;
pub mod conn;
pub mod hops;
pub mod lanes;
pub mod threads;

use std::net::{Ipv4Addr, SocketAddr};

/// Per-gateway edge state, one per `AppState`.
pub struct Edge {
    pub hops: hops::Hops,
    /// This gateway's listener, for refusing workers that are this gateway.
    pub own: crate::fleet::own_addr::OwnListener,
    pub log: crate::observe::log_limit::LogLimiter,
}

impl Edge {
    pub fn new() -> Self {
        Edge {
            hops: hops::Hops::new(),
            own: crate::fleet::own_addr::OwnListener::new(SocketAddr::from((Ipv4Addr::UNSPECIFIED, 0))),
            log: crate::observe::log_limit::LogLimiter::default(),
        }
    }
}

impl Default for Edge {
    fn default() -> Self {
        Self::new()
    }
}
