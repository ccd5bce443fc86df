//! What one leg is, as plain data: the route it was sent to, the shape its answer is written
//! back in, its sampling, and the `GenerateRequest` calls it is sent as. Built by `request.rs`,
//! read by `calls.rs`, `prompts.rs` and the answer writers; imports none of them.

use super::logprobs::LogprobAsk;

/// The route a leg was sent to, which decides both request and answer shapes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Route {
    Completions,
    Chat,
    Generate,
}

impl Route {
    pub fn of_path(path: &str) -> Option<Route> {
        match path {
            "/v1/completions" => Some(Route::Completions),
            "/v1/chat/completions" => Some(Route::Chat),
            "/generate" => Some(Route::Generate),
            _ => None,
        }
    }
}

/// Sampling as the engines take it, before the wire's own message is built.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Sampling {
    pub max_new_tokens: u32,
    pub temperature: f32,
    pub top_p: f32,
    pub top_k: i32,
    pub min_p: f32,
    pub frequency_penalty: f32,
    pub presence_penalty: f32,
    pub repetition_penalty: f32,
    pub stop: Vec<String>,
    pub stop_token_ids: Vec<u32>,
    pub ignore_eos: bool,
    pub skip_special_tokens: bool,
    pub seed: Option<i64>,
    pub n: u32,
    /// Output logprobs with this many top entries (SGLang `return_logprob` + `top_logprobs_num`,
    /// vLLM `logprobs`).
    pub logprobs: Option<u32>,
    /// The prompt's logprobs too (SGLang always sends them with `return_logprob`; vLLM
    /// `prompt_logprobs`), and SGLang's `logprob_start_len`.
    pub prompt_logprobs: bool,
    pub logprob_start_len: i32,
}

/// What the gateway must know to write the engine's answer back as the route's JSON or SSE.
#[derive(Debug, Clone)]
pub struct Shape {
    pub route: Route,
    pub stream: bool,
    /// `stream_options.include_usage`: a last chunk with the usage (the relay may strip it).
    pub include_usage: bool,
    /// vLLM's `return_token_ids`: the ids on each choice (what resume reads).
    pub return_token_ids: bool,
    /// The response `id` (`rid` when the body gives one, as the engines do).
    pub id: String,
    /// The body's `model`, echoed (else the worker's served name).
    pub model: Option<String>,
    /// The prompts (one, or a batch's); choice `c` answers prompt `c / sampling.n`.
    pub prompts: Vec<Vec<u32>>,
    /// The body gave a list of prompts: `/generate` answers a list.
    pub batch: bool,
    /// The request's sampling (each call's own `n` and seed are in its [`Call`]).
    pub sampling: Sampling,
    pub logprobs: Option<LogprobAsk>,
    /// The prompt's last ids that are the answer's own (a resume's continuation): the writer
    /// replays them through its decoder before the first new token.
    pub resumed_ids: usize,
}

impl Shape {
    /// How many choices the answer has: prompts × n.
    pub fn choices(&self) -> usize {
        self.prompts.len() * self.sampling.n.max(1) as usize
    }

    /// Whether the answer's ids can be kept in a ledger instead of its bytes: a completions or
    /// chat stream of one choice (the only answers resume continues; `/generate` writes its
    /// cumulative ids anyway).
    pub fn ledger_fits(&self) -> bool {
        self.stream && self.route != Route::Generate && self.choices() == 1
    }

    /// Choice `c`'s prompt.
    pub fn prompt_of(&self, c: usize) -> &[u32] {
        &self.prompts[c / self.sampling.n.max(1) as usize]
    }

    /// `/generate`'s `meta_info.id` of choice `c`: the id itself for a single answer, else
    /// `{id}_{c}` (SGLang's names for a batch's items).
    pub fn item_id(&self, c: usize) -> String {
        if self.choices() == 1 {
            self.id.clone()
        } else {
            format!("{}_{c}", self.id)
        }
    }
}

/// One `GenerateRequest`: a prompt, its choices (`sampling.n` of them, numbered from `first` in
/// the answer) and, for an SGLang bootstrap PD leg, its room.
#[derive(Debug, Clone, PartialEq)]
pub struct Call {
    pub request_id: String,
    pub prompt: usize,
    pub first: u32,
    pub sampling: Sampling,
    /// SGLang bootstrap fields of a PD leg (`bootstrap_host`, `bootstrap_port`, `bootstrap_room`).
    pub bootstrap: Option<(String, i32, i32)>,
    /// vLLM NIXL / Mooncake `kv_transfer_params` of a PD leg, as the JSON text the contract's
    /// `kv_transfer_params_json` carries (the plan's object, verbatim).
    pub kv_transfer_params: Option<String>,
}
