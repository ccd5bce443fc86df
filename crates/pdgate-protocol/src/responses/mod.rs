//! The OpenAI Responses API (`/v1/responses`) as a translation to and from Chat Completions.
//!
//! The gateway serves Responses by translating: a Responses request becomes the equivalent
//! `/v1/chat/completions` body ([`request`]), which then runs the ordinary transaction, and the
//! chat answer comes back in the Responses shape, whole ([`answer`]) or as the Responses event
//! stream built incrementally from `chat.completion.chunk` events ([`stream`]). Why translate
//! rather than forward the engine's own endpoint: docs/protocols.md, "Responses API".
//! Pure data transformations; ids and times come in as arguments.

pub mod answer;
pub mod request;
mod request_usual;
pub mod stream;

#[cfg(test)]
mod tests;

pub use answer::{response_from_chat, response_json_from_chat, Outcome, ResponseMeta};
pub use request::{items_to_messages, parse_responses, ResponsesRequest};
pub use stream::{StreamTranslator, Terminal};
