//! Talking to one worker. The `WorkerClient` trait a transaction's legs run over, its events
//! and the abort guard (`client.rs`, open it first); its HTTP side (`http_client.rs` over
//! `upstream.rs`: the own HTTP/1.1 client `h1_client/` for `http://` POSTs, hyper-util with
//! rustls for GETs and `https://`, `worker_tls.rs`) and its gRPC side (`grpc/`);
//! `scheme_client.rs` picks one per worker URL. `leg.rs`: leg helpers and deadline errors;
//! `engine_info.rs`: the facts an engine reports about itself.
//!
//! May use `observe` and the leaves; knows nothing of the registry, admission or the
//! transaction (a client is handed URLs and bodies, and answers events).

pub mod client;
pub mod engine_info;
pub mod grpc;
pub mod h1_client;
pub mod http_client;
pub mod leg;
pub mod scheme_client;
pub mod upstream;
pub mod worker_tls;
