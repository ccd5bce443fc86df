//! The top: starting and stopping a gateway (`server.rs`, open it first), the routes that hand
//! each path to its stage (`front.rs`; the Messages API's translation: `messages.rs`), the
//! separate `/metrics` listener, and `AppState`: the handles every stage is given (`state.rs`).
//! It may use every stage; no stage uses it.

pub mod front;
pub mod intake;
pub mod messages;
mod messages_body;
pub mod metrics_listener;
pub mod responses;
pub mod server;
pub mod state;
