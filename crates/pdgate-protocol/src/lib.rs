//! pdgate-protocol: the wire formats pdgate speaks, and nothing else.
//!
//! Request validation for the OpenAI and SGLang-native endpoints, the SGLang bootstrap fields,
//! vLLM `kv_transfer_params` for the NIXL and Mooncake connectors, SSE framing and the few
//! response rewrites a PD gateway must do (input-logprob merge, cached-token accounting), and the
//! engines' load reports (`/v1/loads`, Prometheus `/metrics`).
//! Pure data transformations: no tokio, no hyper, no IO (wire contracts: docs/protocols.md).

pub mod answer;
pub mod anthropic;
pub mod bootstrap;
mod chat_chunk;
mod chat_usage;
pub mod content;
pub mod engine_load;
mod json_scan;
pub mod kv_transfer;
pub mod limits;
pub mod logprobs;
pub mod media;
pub mod openai;
pub mod prometheus;
pub mod rendezvous;
pub mod request;
pub mod responses;
pub mod resume;
pub mod sse;
pub mod usage;

pub use limits::Limits;
pub use request::{estimate_tokens, parse_object, parse_request, Endpoint, InvalidRequest, ParsedRequest};
pub use responses::stream::push_u64;
