//! The client edge: how connections are served and bounded (`conn`), which requests loop
//! (`hops`, `own_addr`), and how much a bad client can make the gateway log (`log_limit`).
//! `scope` carries a request's id and hop header to code that runs without its context;
//! `threads` are the event loops connections are served on, `lanes` which one serves which.

pub mod conn;
pub mod hops;
pub mod lanes;
pub mod log_limit;
pub mod own_addr;
pub mod scope;
pub mod threads;

use std::net::{Ipv4Addr, SocketAddr};

/// Per-gateway edge state, one per `AppState`.
pub struct Edge {
    pub hops: hops::Hops,
    /// This gateway's listener, for refusing workers that are this gateway.
    pub own: own_addr::OwnListener,
    pub log: log_limit::LogLimiter,
}

impl Edge {
    pub fn new() -> Self {
        Edge { hops: hops::Hops::new(), own: own_addr::OwnListener::new(SocketAddr::from((Ipv4Addr::UNSPECIFIED, 0))), log: log_limit::LogLimiter::default() }
    }
}

impl Default for Edge {
    fn default() -> Self {
        Self::new()
    }
}
