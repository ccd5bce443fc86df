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
