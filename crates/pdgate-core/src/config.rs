//! The gateway's configuration, declared once.
//!
//! `GatewayConfig` is at the same time the serde schema (Python API, JSON config) and the clap
//! command line (Rust binary, `pdgate launch`). Nothing else declares an option; the Python
//! surfaces read [`GatewayConfig::schema`] and a test checks that the two views agree.

use clap::{ArgAction, CommandFactory, Parser, ValueEnum};
use serde::{Deserialize, Serialize};

use crate::pairing::PairingMode;
use crate::placement::{CostPriors, PlacementMode};
pub use crate::registration::parse_label;
use crate::worker::{KvConnector, WorkerRole, WorkerSpec};

/// Routing policy names. Every policy is a pure function over a pool snapshot (see `policy`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, ValueEnum, Default)]
#[serde(rename_all = "snake_case")]
#[value(rename_all = "snake_case")]
pub enum PolicyName {
    Random,
    #[default]
    RoundRobin,
    /// Two random candidates, the less loaded one.
    PowerOfTwo,
    /// Prefix affinity over an approximate radix tree, with load balancing.
    CacheAware,
    /// Session affinity by a routing key (header or `user`). SMG spells it `consistent_hashing`.
    #[serde(alias = "consistent_hashing")]
    #[value(alias = "consistent_hashing")]
    ConsistentHash,
    /// Fewest queued prompt tokens (with the radix tree's prefix credit); for prefill pools.
    LeastTokens,
    /// Enough free KV for prompt + max_tokens, then the smallest running batch; for decode pools.
    MostFreeKv,
}

/// How EPD assigns a request's media items to encode workers (SMG's `--encode-policy`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, ValueEnum, Default)]
#[serde(rename_all = "snake_case")]
#[value(rename_all = "snake_case")]
pub enum EncodePolicy {
    Random,
    RoundRobin,
    /// By the item's content hash: a repeated image goes to the same encode worker (whose
    /// embedding cache then has it).
    #[default]
    #[serde(alias = "consistent_hash")]
    #[value(alias = "consistent_hash")]
    ConsistentHashing,
}

impl EncodePolicy {
    /// The routing policy that implements it (over the encode pool, keyed by the content hash).
    pub fn policy_name(self) -> PolicyName {
        match self {
            EncodePolicy::Random => PolicyName::Random,
            EncodePolicy::RoundRobin => PolicyName::RoundRobin,
            EncodePolicy::ConsistentHashing => PolicyName::ConsistentHash,
        }
    }
}

/// Where `cache_aware` learns what each worker's prefix cache holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, ValueEnum, Default)]
#[serde(rename_all = "snake_case")]
#[value(rename_all = "snake_case")]
pub enum CacheSource {
    /// The engines' KV events for workers that publish them, the text tree for the others.
    #[default]
    Auto,
    /// The engines' KV events only (a worker that publishes none holds nothing).
    Events,
    /// The gateway's radix tree of the prompts it sent (a guess: blind to evictions and to
    /// what other replicas sent).
    Text,
}

#[derive(Clone, Debug, Parser, Serialize, Deserialize, PartialEq)]
#[command(name = "pdgate-gateway", about = "pdgate: a gateway for prefill/decode disaggregated LLM serving", version)]
#[serde(default, deny_unknown_fields)]
pub struct GatewayConfig {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,

    /// Port to listen on (0 picks a free port).
    #[arg(long, default_value_t = 30000)]
    pub port: u16,

    /// Regular (non-PD) workers: one pool, each request to one worker (in PD mode, the colocated
    /// pool of --pd-placement). Each URL may be followed by `kv_connector=NAME`,
    /// `kv_events=tcp://HOST:PORT`, `kv_events_replay=tcp://HOST:PORT` and `label=KEY=VALUE`
    /// (repeatable), as for --decode.
    #[arg(long, num_args = 1.., value_name = "URL")]
    pub worker_urls: Vec<String>,

    /// Run in prefill/decode disaggregated mode.
    #[arg(long)]
    pub pd_disaggregation: bool,

    /// A prefill worker, optionally its bootstrap port (`none` for the engine default), then
    /// any of `kv_connector=NAME` (overrides the global connector), `kv_engine_id=ID` (a
    /// Mooncake prefill's engine id), `kv_events=tcp://HOST:PORT` and `kv_events_replay=tcp://HOST:PORT`
    /// (the engine's KV event publisher and replay socket) and `label=KEY=VALUE` (repeatable).
    /// Repeat for more workers.
    #[arg(long, num_args = 1.., action = ArgAction::Append, value_names = ["URL", "BOOTSTRAP_PORT"])]
    #[serde(deserialize_with = "crate::config_serde::prefill_list")]
    pub prefill: Vec<Vec<String>>,

    /// A decode worker, optionally followed by `kv_connector=NAME`, `kv_events=tcp://HOST:PORT`,
    /// `kv_events_replay=tcp://HOST:PORT` and `label=KEY=VALUE` (repeatable). Repeat for more workers.
    #[arg(long, num_args = 1.., action = ArgAction::Append, value_name = "URL")]
    #[serde(deserialize_with = "crate::config_serde::decode_list")]
    pub decode: Vec<Vec<String>>,

    /// Encode/prefill/decode mode (SMG's spelling): PD mode plus encode workers (--encode) that
    /// run the vision encoder for a chat request's images and hand the embeddings to the
    /// prefill. With the bootstrap connector, TokenSpeed's protocol (`POST /encode`, embeddings
    /// shipped to the prefill by room); with nixl or mooncake, vLLM's disaggregated encoder (a
    /// chat completion per image, answered before the prefill is sent, its `ec_transfer_params`
    /// relayed to the prefill). Text-only requests run as plain PD.
    #[arg(long)]
    pub epd_disaggregation: bool,

    /// An encode worker (EPD, http://: `POST /encode` under the bootstrap connector, a vLLM
    /// `ec_producer` under nixl/mooncake) and its bootstrap port (`none` for the engine default;
    /// unused by vLLM encoders), then any `label=KEY=VALUE`. Repeat for more workers. gRPC
    /// encode workers are not built yet.
    #[arg(long, num_args = 1.., action = ArgAction::Append, value_names = ["URL", "BOOTSTRAP_PORT"])]
    #[serde(deserialize_with = "crate::config_serde::encode_list")]
    pub encode: Vec<Vec<String>>,

    /// EPD: which encode worker gets each image: random, round_robin, or consistent_hashing
    /// (by the image's content hash, SHA-256 of its bytes, so a repeated image goes to the same
    /// encode worker).
    #[arg(long, value_enum, default_value_t = EncodePolicy::ConsistentHashing)]
    pub encode_policy: EncodePolicy,

    /// EPD: how long an encode worker may take to accept an image (answer `POST /encode`, or a
    /// vLLM encoder its chat completion).
    /// One that does not is a failed encode leg (`encode_timeout`): its breaker hears it and
    /// the request is retried on another encode worker while its own deadline allows.
    #[arg(long, default_value_t = 30)]
    pub encode_timeout_secs: u64,

    /// EPD: hosts the gateway may fetch `http(s)://` images from (vLLM's flag name). Unset (the
    /// default), a remote image URL is a 400 and the gateway fetches nothing. A listed host's
    /// image (host matched exactly, any port) is fetched once per request, within
    /// --media-fetch-timeout-secs and the request's deadline, at most --max-image-bytes; it must
    /// answer 200 with an `image/*` type (redirects are not followed), and every leg then gets
    /// it as a `data:` URL. A failed fetch is the client's 400.
    #[arg(long, num_args = 1.., value_name = "HOST")]
    pub allowed_media_domains: Vec<String>,

    /// EPD: how long fetching one remote image may take (--allowed-media-domains).
    #[arg(long, default_value_t = 10)]
    pub media_fetch_timeout_secs: u64,

    /// EPD: the largest remote image the gateway fetches, in bytes (--allowed-media-domains).
    #[arg(long, default_value_t = 20 * 1024 * 1024)]
    pub max_image_bytes: usize,

    /// How KV moves between prefill and decode: SGLang bootstrap rendezvous, vLLM NIXL (pull)
    /// or vLLM Mooncake (push). Workers registered with their own connector override this.
    #[arg(long, value_enum, default_value_t = KvConnector::Bootstrap)]
    pub kv_connector: KvConnector,

    /// Policy for both pools unless --prefill-policy / --decode-policy say otherwise.
    #[arg(long, value_enum, default_value_t = PolicyName::RoundRobin)]
    pub policy: PolicyName,

    /// Policy for choosing the prefill worker in PD mode.
    #[arg(long, value_enum)]
    pub prefill_policy: Option<PolicyName>,

    /// Policy for choosing the decode worker in PD mode.
    #[arg(long, value_enum)]
    pub decode_policy: Option<PolicyName>,

    /// cache_aware: minimum prefix match ratio (0.0-1.0) to route by cache affinity.
    #[arg(long, visible_alias = "cache-match-threshold", default_value_t = 0.3)]
    pub cache_threshold: f64,

    /// cache_aware: what a worker's cache holds, from the engines' KV events (matched in prompt
    /// tokens; needs token ids in the request or --model-path/--tokenizer-path), the gateway's
    /// text tree, or auto (events for workers that publish them, text otherwise). Requests
    /// without token ids use the text tree.
    #[arg(long, value_enum, default_value_t = CacheSource::Auto)]
    pub cache_source: CacheSource,

    /// cache_aware: load is imbalanced when max - min exceeds this (and the relative threshold).
    #[arg(long, default_value_t = 64)]
    pub balance_abs_threshold: u64,

    /// cache_aware: load is imbalanced when max exceeds this times min (and the absolute threshold).
    #[arg(long, default_value_t = 1.5)]
    pub balance_rel_threshold: f64,

    /// cache_aware: most characters (UTF-8 bytes) of request text kept in the radix tree;
    /// least recently used prefixes are evicted beyond it.
    #[arg(long, default_value_t = 67_108_864)]
    pub max_tree_size: usize,

    /// Most worker-block entries the KV event index keeps (docs/kv-events.md); past it the
    /// oldest are evicted, except that a prefix lookups reach gets a second chance.
    #[arg(long, default_value_t = 4_194_304)]
    pub kv_index_max_blocks: usize,

    /// Seed of the routing rng: random and power_of_two picks, and the random tie-breaks and
    /// samples of the other policies. With the same seed, workers and requests in the same
    /// order, a gateway makes the same choices (for tests and reproducible benchmarks). Unset: a
    /// random seed per thread. Bootstrap rooms and request ids stay random either way (two
    /// replicas with one seed must not mint the same rooms).
    #[arg(long)]
    pub seed: Option<u64>,

    /// Which prefill/decode pairs may work together: off (KV transport only), lenient (a known
    /// runtime or KV layout mismatch refuses) or strict (an unknown one refuses too).
    #[arg(long, value_enum, default_value_t = PairingMode::Lenient)]
    pub pd_pairing_mode: PairingMode,

    /// Consecutive failed requests, all within --breaker-window-secs, that open a worker's
    /// circuit breaker.
    #[arg(long, visible_alias = "cb-failure-threshold", default_value_t = 5)]
    pub breaker_failure_threshold: u32,

    /// Consecutive successful requests in half-open state that close the breaker again.
    #[arg(long, visible_alias = "cb-success-threshold", default_value_t = 2)]
    pub breaker_success_threshold: u32,

    /// Seconds an open breaker waits before letting probe requests through (half-open).
    #[arg(long, visible_alias = "cb-timeout-duration-secs", default_value_t = 30)]
    pub breaker_cooldown_secs: u64,

    /// Sliding window for counting failures: a failure older than this many seconds no longer
    /// counts towards --breaker-failure-threshold.
    #[arg(long, visible_alias = "cb-window-duration-secs", default_value_t = 120)]
    pub breaker_window_secs: u64,

    /// Never open circuit breakers (request failures then only count through health checks).
    #[arg(long)]
    pub disable_circuit_breaker: bool,

    /// Deadline for a whole request, all attempts and both legs included.
    #[arg(long, default_value_t = 600)]
    pub request_timeout_secs: u64,

    /// Timeout for opening a connection to a worker.
    #[arg(long, default_value_t = 5000)]
    pub worker_connect_timeout_ms: u64,

    // --- Workers behind TLS and auth (crates/pdgate-gateway/src/upstream.rs, docs/security.md) ---
    /// Sent as `Authorization: Bearer KEY` on every call to a worker (requests, health checks,
    /// load polls, `/server_info`, the Mooncake bootstrap query); the client's own
    /// `Authorization` is never forwarded. `pdgate launch` and `pdgate-gateway` also read it from
    /// PDGATE_WORKER_API_KEY.
    #[arg(long, value_name = "KEY")]
    pub worker_api_key: Option<String>,

    /// PEM bundle of the CA certificates that sign `https://` workers' certificates (a private
    /// CA). When given, only these are trusted for workers; without it, the system's roots.
    #[arg(long, value_name = "PATH")]
    pub worker_ca_cert: Option<String>,

    // --- Tokenizer (crates/pdgate-tokenizer, docs/tokenizer.md) ---
    /// A local Hugging Face model directory (or a `tokenizer.json` file) whose tokenizer and
    /// chat template the gateway loads and validates at start-up. Not yet used by the routes:
    /// prompt token counts are still estimated (`--chars-per-token`) until they are wired to it.
    #[arg(long, value_name = "PATH")]
    pub model_path: Option<String>,

    /// The tokenizer to load instead of `--model-path`'s (a directory or a `tokenizer.json`).
    #[arg(long, value_name = "PATH")]
    pub tokenizer_path: Option<String>,

    /// Most attempts per request, the first one included (SMG's meaning: 3 means one try and
    /// two retries; 0 and 1 mean no retry). Retries happen only before any byte reached the
    /// client, each on another worker or pair.
    #[arg(long, default_value_t = 3)]
    pub retry_max_retries: u32,

    /// First retry backoff; grows by --retry-backoff-multiplier per attempt, with jitter.
    #[arg(long, default_value_t = 50)]
    pub retry_initial_backoff_ms: u64,

    /// Upper bound of one retry backoff.
    #[arg(long, default_value_t = 1000)]
    pub retry_max_backoff_ms: u64,

    /// Most times one stream is continued on a new prefill/decode pair after its decode died
    /// mid-answer (prompt + generated token ids, the same client stream); 0 turns resuming off.
    /// Always within the request's deadline (docs/architecture.md, "Resume").
    #[arg(long, default_value_t = 1)]
    pub max_resumes: u32,

    // --- Overload protection (pdgate-core retry_budget.rs, docs/architecture.md) ---
    /// Retry budget shared by all requests: retries in the window may be at most this fraction
    /// of the requests that started in it (plus --retry-budget-min-per-sec), so retries cannot
    /// multiply an overload. A retry over budget is not made (`pdgate_retries_refused_total`).
    #[arg(long, default_value_t = 0.2)]
    pub retry_budget_ratio: f64,

    /// Retries per second the budget allows whatever the traffic (a quiet gateway still retries).
    #[arg(long, default_value_t = 10)]
    pub retry_budget_min_per_sec: u32,

    /// Seconds over which the retry budget counts requests and retries.
    #[arg(long, default_value_t = 10)]
    pub retry_budget_window_secs: u64,

    /// On SIGTERM (or `stop()`): readiness turns 503 and new requests are refused with 503 at
    /// once, while requests in flight (streams included) get this many seconds to finish; then
    /// the gateway stops and exits 0.
    #[arg(long, default_value_t = 30)]
    pub shutdown_grace_period_secs: u64,

    /// Largest non-streamed worker answer the gateway reads, in bytes. A larger one fails the
    /// leg with 502 `bad_worker_response` (workers are not trusted to bound their answers).
    #[arg(long, default_value_t = 64 * 1024 * 1024)]
    pub max_response_bytes: usize,

    /// Longest SSE event (and so line) a worker may stream, in bytes. A longer one ends the
    /// stream with an error event; without it a worker streaming one endless line grows the
    /// gateway's memory without bound.
    #[arg(long, default_value_t = 4 * 1024 * 1024)]
    pub max_sse_event_bytes: usize,

    /// Largest request body accepted, in bytes.
    #[arg(long, default_value_t = 32 * 1024 * 1024)]
    pub max_payload_size: usize,

    // --- The Responses API's store (`/v1/responses`, `store: true`; docs/protocols.md) ---
    /// Most responses the gateway keeps in memory for `GET /v1/responses/{id}` and
    /// `previous_response_id`; the oldest leave first. 0 keeps none.
    #[arg(long, default_value_t = 10_000)]
    pub responses_store_max_entries: usize,

    /// Most bytes (the JSON of responses and their conversations) the in-memory Responses store
    /// holds; the oldest leave first, and a larger conversation is not kept.
    #[arg(long, default_value_t = 256 * 1024 * 1024)]
    pub responses_store_max_bytes: usize,

    /// Seconds a stored response is kept before it expires (OpenAI keeps them 30 days; an
    /// in-memory store bounds it to a day by default).
    #[arg(long, default_value_t = 86_400)]
    pub responses_store_ttl_secs: u64,

    // --- Request bounds (pdgate-protocol `limits`): each violation is a 400 naming the field ---
    /// Largest `n` (choices per prompt), `best_of` and `/generate` `sampling_params.n`.
    #[arg(long, default_value_t = 128)]
    pub max_n: u64,

    /// Most sequences one request may run: prompts in a list (`prompt`, `/generate` `text` or
    /// `input_ids`) times `n`.
    #[arg(long, default_value_t = 1024)]
    pub max_batch_size: u64,

    /// Largest prompt text in UTF-8 bytes, summed over the request (prompts, `text`, message
    /// contents); token-id prompts are bounded by --max-payload-size and the context length.
    #[arg(long, default_value_t = 8 * 1024 * 1024)]
    pub max_prompt_bytes: usize,

    /// Most entries in `stop` (and in `stop_token_ids`). OpenAI allows 4; engines accept more.
    #[arg(long, default_value_t = 32)]
    pub max_stop_sequences: usize,

    /// Largest `stop` string, in bytes.
    #[arg(long, default_value_t = 1024)]
    pub max_stop_bytes: usize,

    /// Most entries in `logit_bias`.
    #[arg(long, default_value_t = 2048)]
    pub max_logit_bias: usize,

    /// Most entries in `tools` (and the legacy `functions`). OpenAI allows 128.
    #[arg(long, default_value_t = 512)]
    pub max_tools: usize,

    /// UTF-8 bytes per token, to estimate a text prompt's token count for token-based load
    /// (`least_tokens`, `most_free_kv`); token-id prompts are counted exactly. 4.0 suits
    /// English with BPE tokenizers; the reference engine's byte-level presets need 1.
    #[arg(long, default_value_t = 4.0)]
    pub chars_per_token: f64,

    /// Seconds between active health checks of each worker.
    #[arg(long, default_value_t = 5)]
    pub health_check_interval_secs: u64,

    /// Timeout of one health check.
    #[arg(long, default_value_t = 3)]
    pub health_check_timeout_secs: u64,

    /// Consecutive failed checks before a worker is marked unhealthy.
    #[arg(long, default_value_t = 3)]
    pub health_failure_threshold: u32,

    /// Consecutive successful checks before an unhealthy worker is healthy again.
    #[arg(long, default_value_t = 2)]
    pub health_success_threshold: u32,

    /// Health check path on each worker.
    #[arg(long, default_value = "/health")]
    pub health_check_endpoint: String,

    /// Log level: debug, info, warn (or warning), error, trace or off; or per-target
    /// directives such as `pdgate_gateway=debug,info`. Anything else is refused. The access
    /// log (one line per request) is the target `pdgate::access` at info.
    #[arg(long, default_value = "info")]
    pub log_level: String,

    /// Seconds between polls of each worker's own load report (`/v1/loads`, else vLLM
    /// `/metrics`), used by load-aware policies; 0 turns polling off.
    #[arg(long, default_value_t = 2)]
    pub load_poll_interval_secs: u64,

    /// Require `Authorization: Bearer KEY` on the client endpoints. On the command line, the
    /// environment variable PDGATE_API_KEY stands in when the flag is not given.
    #[arg(long)]
    pub api_key: Option<String>,

    /// Require `Authorization: Bearer KEY` on the worker API (`/workers`). On the command
    /// line, the environment variable PDGATE_ADMIN_API_KEY stands in when the flag is not given.
    #[arg(long)]
    pub admin_api_key: Option<String>,

    // --- The client edge: who may use the worker API, and how long a client may hold a
    // connection (crates/pdgate-gateway/src/conn.rs, docs/security.md) ---
    /// Open the worker API (`/workers`) without a key, for development only: anyone who can
    /// reach the gateway may then list, add and remove workers. Without it and without
    /// --admin-api-key the worker API is closed.
    #[arg(long)]
    pub admin_api_open: bool,

    /// Seconds a client has to send a request's headers, counted from when the connection
    /// waits for them (slowloris guard); the connection is then closed without an answer.
    #[arg(long, default_value_t = 10)]
    pub header_read_timeout_secs: u64,

    /// Seconds a client has to send a request's body (never beyond the request deadline);
    /// answered 408 when it runs out.
    #[arg(long, default_value_t = 30)]
    pub body_read_timeout_secs: u64,

    /// Seconds a keep-alive connection may sit idle between requests before it is closed
    /// (the header-read timeout bounds idle connections too).
    #[arg(long, default_value_t = 5)]
    pub idle_timeout_secs: u64,

    /// Most client connections open at once; a connection beyond it is closed at once.
    #[arg(long, default_value_t = 4096)]
    pub max_connections: usize,

    /// Threads that serve client connections, each its own event loop: a connection, its
    /// requests and their worker legs stay on the thread it was handed to, so no relayed chunk
    /// wakes another thread. 0: one per CPU (a gateway embedded in a single-threaded tokio
    /// runtime serves on that runtime instead).
    #[arg(long, default_value_t = 0)]
    pub connection_threads: usize,

    // --- Kubernetes service discovery (crates/pdgate-gateway/src/discovery) ---
    /// Find workers among Kubernetes pods by label (see docs/kubernetes.md).
    #[arg(long)]
    pub service_discovery: bool,

    /// Regular mode: labels a worker pod has, as `k=v` (all must match). In PD mode, labels every
    /// prefill, decode and encode pod must have in addition to its role's selector.
    #[arg(long, num_args = 1.., value_name = "KEY=VALUE")]
    pub selector: Vec<String>,

    /// PD mode: labels of prefill pods, as `k=v` (all must match).
    #[arg(long, num_args = 1.., value_name = "KEY=VALUE")]
    pub prefill_selector: Vec<String>,

    /// PD mode: labels of decode pods, as `k=v` (all must match).
    #[arg(long, num_args = 1.., value_name = "KEY=VALUE")]
    pub decode_selector: Vec<String>,

    /// EPD mode: labels of encode pods, as `k=v` (all must match). Optional: without it,
    /// encode workers come only from --encode and the worker API.
    #[arg(long, num_args = 1.., value_name = "KEY=VALUE")]
    pub encode_selector: Vec<String>,

    /// Namespace to watch for worker pods (default: all namespaces).
    #[arg(long, value_name = "NAMESPACE")]
    pub service_discovery_namespace: Option<String>,

    /// Worker port on each pod, unless the pod's `pdgate.ai/port` annotation says otherwise
    /// (80 by default, as SMG).
    #[arg(long, default_value_t = 80)]
    pub service_discovery_port: u16,

    /// Kubeconfig file for running outside the cluster (default: in-cluster service account).
    #[arg(long, value_name = "PATH")]
    pub kubeconfig: Option<String>,

    // --- Options in SMG's spelling and meaning (docs/migrating-from-smg.md): retries,
    // health, metrics listener, request ids, logs, admission, control-plane keys ---
    /// Factor by which the retry backoff grows per attempt (at least 1.0).
    #[arg(long, default_value_t = 2.0)]
    pub retry_backoff_multiplier: f64,

    /// Random spread of each retry backoff, 0.0-1.0: the delay is multiplied by a uniform
    /// factor in [1 - f, 1 + f], then capped by --retry-max-backoff-ms.
    #[arg(long, default_value_t = 0.2)]
    pub retry_jitter_factor: f64,

    /// One attempt per request, never a retry (same as --retry-max-retries 1).
    #[arg(long)]
    pub disable_retries: bool,

    /// No active health checks: every worker counts as healthy from registration (the circuit
    /// breaker still takes failing ones out).
    #[arg(long)]
    pub disable_health_check: bool,

    /// Also serve `/metrics` on a listener of its own at this port (0 picks a free port).
    /// Without it, metrics are only on the main port, which always keeps `/metrics`.
    #[arg(long, value_name = "PORT")]
    pub prometheus_port: Option<u16>,

    /// Address of the --prometheus-port listener.
    #[arg(long, default_value = "127.0.0.1")]
    pub prometheus_host: String,

    /// Headers a client request id is read from, the first present one wins (its value must be
    /// 1-128 characters of `[A-Za-z0-9._:-]`, else it is ignored).
    #[arg(long, num_args = 1.., value_name = "HEADER", default_values_t = ["x-request-id".to_string(), "x-correlation-id".to_string(), "x-trace-id".to_string(), "request-id".to_string()])]
    pub request_id_headers: Vec<String>,

    /// Write logs as JSON objects, one per line.
    #[arg(long)]
    pub log_json: bool,

    /// Also write logs to `pdgate.log` in this directory (created when missing), rotated daily
    /// (UTC) as SMG rotates: the past day's file becomes `pdgate.log.YYYY-MM-DD`.
    #[arg(long, value_name = "DIR")]
    pub log_dir: Option<String>,

    // --- Tracing (crates/pdgate-gateway/src/tracing_export.rs, docs/observability.md) ---
    /// Export OpenTelemetry traces (a span per request and per phase: admit, attempt, select,
    /// the prefill and decode legs, relay, finish) over OTLP/gRPC to --otlp-traces-endpoint,
    /// and send each leg's W3C `traceparent` to its worker. Off: no exporter, and a client's
    /// valid `traceparent`/`tracestate` are passed on to the workers unchanged.
    #[arg(long)]
    pub enable_trace: bool,

    /// OTLP/gRPC collector for --enable-trace: `host:port` (`http://` is assumed) or a full
    /// `http://` / `https://` URL.
    #[arg(long, value_name = "HOST:PORT", default_value = "localhost:4317")]
    pub otlp_traces_endpoint: String,

    /// Most inference requests served at once; more wait in a FIFO queue. 0 or -1: no limit
    /// (SMG's -1 derives one from the host; pdgate has none by default, and
    /// --max-connections bounds connections).
    #[arg(long, default_value_t = -1, allow_negative_numbers = true)]
    pub max_concurrent_requests: i64,

    /// Requests that may wait for a --max-concurrent-requests slot; one more gets 429 at once
    /// (0: no queue).
    #[arg(long, default_value_t = 100)]
    pub queue_size: usize,

    /// Seconds a request may wait in the queue before it is answered 408.
    #[arg(long, default_value_t = 60)]
    pub queue_timeout_secs: u64,

    /// vLLM router's spelling of --pd-disaggregation: PD mode, with `nixl` as the KV connector
    /// unless --kv-connector says otherwise.
    #[arg(long)]
    pub vllm_pd_disaggregation: bool,

    /// Admin keys in SMG's spelling, `ID:NAME:admin:KEY` (repeatable): each KEY opens the
    /// worker API like --admin-api-key. The `user` role (read-only) is not supported yet.
    #[arg(long, num_args = 1.., value_name = "ID:NAME:ROLE:KEY")]
    pub control_plane_api_keys: Vec<String>,

    /// Time-to-first-token objective in milliseconds (arrival at the gateway to the first
    /// content token relayed); a request may set its own with `x-slo-ttft-ms` (or llm-d's
    /// `x-llm-d-slo-ttft-ms`). Setting it arms early rejection (--admission-slack); unset,
    /// requests are never refused for time and goodput is reported against 1000 ms, the
    /// reporting objective.
    #[arg(long, value_name = "MS")]
    pub slo_ttft_ms: Option<f64>,

    /// Time-per-output-token objective in milliseconds, (E2E - TTFT) / (output tokens - 1);
    /// per request: `x-slo-tpot-ms` (or `x-llm-d-slo-tpot-ms`). Unset: goodput is reported
    /// against 50 ms, the reporting objective.
    #[arg(long, value_name = "MS")]
    pub slo_tpot_ms: Option<f64>,

    // --- Placement (pdgate-core placement/, docs/placement.md) ---
    /// Where PD-mode requests run: `disaggregated` (every request on a prefill/decode pair),
    /// `colocated` (on one worker of the regular pool, given with --worker-urls), or
    /// `conditional` (per request, by the cost model's predicted TTFT and the stall on running
    /// decodes).
    #[arg(long, value_enum, default_value_t = PlacementMode::Disaggregated)]
    pub pd_placement: PlacementMode,

    /// Early rejection: a PD-mode request whose predicted TTFT (time waited + prefill queue +
    /// prefill + transfer + decode wait) exceeds its TTFT objective times this is answered 429
    /// `overloaded` at once. It acts only on an objective someone set (--slo-ttft-ms, or the
    /// request's `x-slo-ttft-ms`), never on the reporting default. 0 turns early rejection
    /// off; otherwise at least 1.
    #[arg(long, default_value_t = 2.0)]
    pub admission_slack: f64,

    /// Cost model prior: fixed cost of one prefill, ms (learned online from there).
    #[arg(long, default_value_t = 20.0)]
    pub placement_prefill_base_ms: f64,

    /// Cost model prior: prefill cost per prompt token, ms.
    #[arg(long, default_value_t = 0.035)]
    pub placement_prefill_ms_per_token: f64,

    /// Cost model prior: one decode step (TPOT), ms.
    #[arg(long, default_value_t = 45.0)]
    pub placement_decode_step_ms: f64,

    /// KV cache bytes per prompt token (model and dtype dependent; not learned).
    #[arg(long, default_value_t = 327_680.0)]
    pub placement_kv_bytes_per_token: f64,

    /// Cost model prior: fixed cost of one KV transfer, ms.
    #[arg(long, default_value_t = 12.0)]
    pub placement_link_setup_ms: f64,

    /// Cost model prior: KV link bandwidth, GiB/s.
    #[arg(long, default_value_t = 22.0)]
    pub placement_link_gib_per_s: f64,

    /// How many observations the cost model's priors are worth.
    #[arg(long, default_value_t = 10.0)]
    pub placement_prior_weight: f64,

    /// Weight the cost model keeps of older observations at each new one, in (0, 1]
    /// (0.98: about the last 50 count).
    #[arg(long, default_value_t = 0.98)]
    pub placement_forgetting: f64,

    /// Seconds over which `pdgate_goodput_requests_per_second` counts the requests that met
    /// both objectives.
    #[arg(long, default_value_t = 60)]
    pub goodput_window_secs: u64,

    /// Append one JSON line per finished request to this file (arrival, route, placement,
    /// workers, tokens, TTFT/TPOT/E2E, status, attempts); written off the request path, lines
    /// that would wait are dropped and counted (`pdgate_request_log_dropped_total`).
    #[arg(long, value_name = "PATH")]
    pub request_log: Option<String>,
}

/// One `--control-plane-api-keys` entry: `ID:NAME:ROLE:KEY`; the key itself may contain `:`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ControlPlaneKey {
    pub id: String,
    pub name: String,
    pub key: String,
}

/// Parses one `--control-plane-api-keys` entry. Only the `admin` role exists in pdgate.
pub fn parse_control_plane_key(entry: &str) -> Result<ControlPlaneKey, String> {
    let parts: Vec<&str> = entry.splitn(4, ':').collect();
    let [id, name, role, key] = parts.as_slice() else {
        return Err("--control-plane-api-keys: expected ID:NAME:ROLE:KEY".into());
    };
    if id.trim().is_empty() || key.is_empty() {
        return Err(format!("--control-plane-api-keys entry {:?}: the id and the key must not be empty", id));
    }
    match role.trim().to_ascii_lowercase().as_str() {
        "admin" => Ok(ControlPlaneKey { id: id.to_string(), name: name.to_string(), key: key.to_string() }),
        "user" => Err(format!("--control-plane-api-keys entry {id:?}: the read-only `user` role is not supported yet; use `admin`")),
        other => Err(format!("--control-plane-api-keys entry {id:?}: unknown role {other:?} (expected admin)")),
    }
}

impl Default for GatewayConfig {
    fn default() -> Self {
        // The clap defaults are the only defaults: parse an empty command line.
        Self::parse_from(["pdgate-gateway"])
    }
}

/// Level names `--log-level` accepts, alone or per target (`pdgate_gateway=debug`).
/// A bound on `--connection-threads` that no machine needs to exceed (a typo guard).
pub const MAX_CONNECTION_THREADS: usize = 1024;

pub const LOG_LEVELS: [&str; 7] = ["trace", "debug", "info", "warn", "warning", "error", "off"];

/// `--log-level`: a level name, or comma-separated `target=level` directives with level names.
/// Anything else is refused: a typo such as `warnn` would otherwise parse as a target name and
/// silently mute every log line.
pub fn validate_log_level(value: &str) -> Result<(), String> {
    let level_ok = |l: &str| LOG_LEVELS.contains(&l.trim().to_ascii_lowercase().as_str());
    let ok = !value.trim().is_empty()
        && value.split(',').all(|d| match d.split_once('=') {
            None => level_ok(d),
            Some((target, level)) => !target.trim().is_empty() && level_ok(level),
        });
    if ok {
        Ok(())
    } else {
        Err(format!("--log-level {value:?}: expected one of {} (or TARGET=LEVEL directives)", LOG_LEVELS.join(", ")))
    }
}

/// `--otlp-traces-endpoint` as the exporter's URL: `host:port` gets SMG's `http://`; a URL keeps
/// its scheme, which must be `http` or `https`, and needs a host.
pub fn otlp_endpoint_url(value: &str) -> Result<String, String> {
    let value = value.trim();
    let full = if value.contains("://") { value.to_string() } else { format!("http://{value}") };
    let bad = |why: &str| format!("--otlp-traces-endpoint {value:?}: {why} (expected HOST:PORT or an http(s):// URL)");
    let url = url::Url::parse(&full).map_err(|e| bad(&e.to_string()))?;
    if !matches!(url.scheme(), "http" | "https") {
        return Err(bad(&format!("scheme {:?} is not http or https", url.scheme())));
    }
    if url.host_str().is_none_or(str::is_empty) {
        return Err(bad("no host"));
    }
    Ok(full)
}

/// Checks `--otlp-traces-endpoint` (see [`otlp_endpoint_url`]).
pub fn validate_otlp_endpoint(value: &str) -> Result<(), String> {
    otlp_endpoint_url(value).map(|_| ())
}

/// What was wrong with a configuration, in words a user can act on.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("invalid configuration: {0}")]
    Invalid(String),
    #[error("invalid configuration JSON: {0}")]
    Json(#[from] serde_json::Error),
    /// A name that is not an option (the JSON view; clap reports the CLI's own).
    #[error("unknown option {name:?}")]
    UnknownOption { name: String },
    /// One option's value has the wrong type or is not one of its choices. `value` is the value
    /// as JSON text (cut when long).
    #[error("option {name} = {value}: {reason}")]
    BadValue { name: String, value: String, reason: String },
}

/// Environment variables that stand in for unset options on a command line: (option, variable).
/// Only the command-line layers (the `pdgate-gateway` binary, `pdgate launch`) read them, through
/// [`GatewayConfig::fill_from_env`]; the core reads no environment, so the schema, the defaults
/// and the Python API never depend on what happens to be set.
pub const ENV_FALLBACKS: [(&str, &str); 2] = [("api_key", "PDGATE_API_KEY"), ("admin_api_key", "PDGATE_ADMIN_API_KEY")];

impl GatewayConfig {
    /// Fills options the command line left unset from environment variables
    /// ([`ENV_FALLBACKS`]), looked up through `lookup` (the caller passes `std::env::var`). An
    /// empty variable counts as unset.
    pub fn fill_from_env(&mut self, lookup: impl Fn(&str) -> Option<String>) {
        let read = |var: &str| lookup(var).filter(|v| !v.is_empty());
        if self.api_key.is_none() {
            self.api_key = read(ENV_FALLBACKS[0].1);
        }
        if self.admin_api_key.is_none() {
            self.admin_api_key = read(ENV_FALLBACKS[1].1);
        }
    }

    /// Parse a command line (the first item is the program name, which `--version` and
    /// `--help` then show: `pdgate launch 0.1.0` from Python, not the Rust binary's name).
    pub fn parse_cli<I, T>(args: I) -> Result<Self, clap::Error>
    where
        I: IntoIterator<Item = T>,
        T: Into<std::ffi::OsString> + Clone,
    {
        use clap::{CommandFactory, FromArgMatches};
        let args: Vec<std::ffi::OsString> = args.into_iter().map(Into::into).collect();
        let mut command = Self::command();
        if let Some(name) = args.first() {
            command = command.display_name(name.to_string_lossy().into_owned());
        }
        let matches = command.try_get_matches_from(args)?;
        let mut config = Self::from_arg_matches(&matches)?;
        let connector_given = matches.value_source("kv_connector") == Some(clap::parser::ValueSource::CommandLine);
        config.resolve_spellings(connector_given);
        Ok(config)
    }

    /// Parse the JSON form used by the Python API; missing keys take the CLI defaults.
    pub fn from_json(text: &str) -> Result<Self, ConfigError> {
        // Parsed for one fact only: whether the connector was given (vllm-router's
        // `--vllm-pd-disaggregation` implies NIXL unless told otherwise).
        let connector_given = serde_json::from_str::<serde_json::Value>(text).ok().and_then(|v| v.get("kv_connector").map(|c| !c.is_null())).unwrap_or(false);
        let mut config = crate::config_json::parse(text)?;
        config.resolve_spellings(connector_given);
        config.validate()?;
        Ok(config)
    }

    /// Applies what another router's spelling implies: `--vllm-pd-disaggregation` is PD mode
    /// with NIXL unless the connector was given.
    fn resolve_spellings(&mut self, connector_given: bool) {
        if self.epd_disaggregation {
            self.pd_disaggregation = true;
        }
        if self.vllm_pd_disaggregation {
            self.pd_disaggregation = true;
            if !connector_given {
                self.kv_connector = KvConnector::Nixl;
            }
        }
    }

    pub fn to_json(&self) -> String {
        serde_json::to_string(self).unwrap_or_default()
    }

    /// Cross-field checks that neither clap nor serde express.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let bad = |m: String| Err(ConfigError::Invalid(m));
        // In PD mode, --worker-urls is the colocated pool of --pd-placement, accepted in every
        // mode (unused under `disaggregated`: see `warnings`).
        if !self.pd_disaggregation && (!self.prefill.is_empty() || !self.decode.is_empty()) {
            return bad("--prefill/--decode need --pd-disaggregation".into());
        }
        if !self.epd_disaggregation && !self.encode.is_empty() {
            return bad("--encode needs --epd-disaggregation".into());
        }
        if self.request_timeout_secs == 0 {
            return bad("--request-timeout-secs must be at least 1".into());
        }
        if self.encode_timeout_secs == 0 {
            return bad("--encode-timeout-secs must be at least 1".into());
        }
        if !self.allowed_media_domains.is_empty() && !self.epd_disaggregation {
            return bad("--allowed-media-domains needs --epd-disaggregation (elsewhere the engines fetch their own images)".into());
        }
        if let Some(bad_host) = self.allowed_media_domains.iter().find(|h| h.is_empty() || h.contains(['/', ':', '*', ' '])) {
            return bad(format!("--allowed-media-domains: {bad_host:?} is not a host name (no scheme, port, path or wildcard)"));
        }
        if self.media_fetch_timeout_secs == 0 || self.max_image_bytes == 0 {
            return bad("--media-fetch-timeout-secs and --max-image-bytes must be at least 1".into());
        }
        if self.max_n == 0 || self.max_batch_size == 0 {
            return bad("--max-n and --max-batch-size must be at least 1".into());
        }
        if self.health_failure_threshold == 0 || self.health_success_threshold == 0 {
            return bad("health thresholds must be at least 1".into());
        }
        if self.breaker_failure_threshold == 0 || self.breaker_success_threshold == 0 {
            return bad("breaker thresholds must be at least 1".into());
        }
        if !(0.0..=1.0).contains(&self.cache_threshold) {
            return bad(format!("--cache-threshold must be between 0 and 1, not {}", self.cache_threshold));
        }
        if self.balance_rel_threshold.is_nan() || self.balance_rel_threshold < 1.0 {
            return bad(format!("--balance-rel-threshold must be at least 1.0, not {}", self.balance_rel_threshold));
        }
        if !self.chars_per_token.is_finite() || self.chars_per_token <= 0.0 {
            return bad(format!("--chars-per-token must be a number above 0, not {}", self.chars_per_token));
        }
        if !self.retry_budget_ratio.is_finite() || self.retry_budget_ratio < 0.0 || self.retry_budget_window_secs == 0 {
            return bad(format!("--retry-budget-ratio must be a number >= 0 (not {}) and --retry-budget-window-secs at least 1", self.retry_budget_ratio));
        }
        validate_log_level(&self.log_level).map_err(ConfigError::Invalid)?;
        if self.header_read_timeout_secs == 0 || self.body_read_timeout_secs == 0 || self.idle_timeout_secs == 0 {
            return bad("--header-read-timeout-secs, --body-read-timeout-secs and --idle-timeout-secs must be at least 1".into());
        }
        if !(1..=1_000_000).contains(&self.max_connections) {
            return bad(format!("--max-connections must be between 1 and 1000000, not {}", self.max_connections));
        }
        if self.connection_threads > MAX_CONNECTION_THREADS {
            return bad(format!("--connection-threads must be between 0 (one per CPU) and {MAX_CONNECTION_THREADS}, not {}", self.connection_threads));
        }
        self.validate_discovery()?;
        self.validate_smg_options()?;
        self.workers().map(|_| ())
    }

    /// The options in SMG's spelling: ranges SMG also enforces, and the key entries' syntax.
    fn validate_smg_options(&self) -> Result<(), ConfigError> {
        let bad = |m: String| Err(ConfigError::Invalid(m));
        if !self.retry_backoff_multiplier.is_finite() || self.retry_backoff_multiplier < 1.0 {
            return bad(format!("--retry-backoff-multiplier must be finite and at least 1.0, not {}", self.retry_backoff_multiplier));
        }
        if !(0.0..=1.0).contains(&self.retry_jitter_factor) {
            return bad(format!("--retry-jitter-factor must be between 0 and 1, not {}", self.retry_jitter_factor));
        }
        if self.breaker_window_secs == 0 {
            return bad("--breaker-window-secs (--cb-window-duration-secs) must be at least 1".into());
        }
        for (flag, v) in [("--slo-ttft-ms", self.slo_ttft_ms), ("--slo-tpot-ms", self.slo_tpot_ms)].into_iter().filter_map(|(f, v)| Some((f, v?))) {
            if !(v.is_finite() && v > 0.0) {
                return bad(format!("{flag} must be a positive number of milliseconds, not {v}"));
            }
        }
        if self.goodput_window_secs == 0 || self.goodput_window_secs > 86_400 {
            return bad(format!("--goodput-window-secs must be between 1 and 86400, not {}", self.goodput_window_secs));
        }
        if self.max_concurrent_requests < -1 {
            return bad(format!("--max-concurrent-requests must be -1, 0 or positive, not {}", self.max_concurrent_requests));
        }
        if self.concurrency_limit().is_some() && self.queue_size > 0 && self.queue_timeout_secs == 0 {
            return bad("--queue-timeout-secs must be at least 1 when requests may queue".into());
        }
        for h in &self.request_id_headers {
            if h.is_empty() || !h.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_') {
                return bad(format!("--request-id-headers: {h:?} is not a header name"));
            }
        }
        if self.log_dir.as_deref().is_some_and(|d| d.trim().is_empty()) {
            return bad("--log-dir must not be empty".into());
        }
        if self.enable_trace {
            validate_otlp_endpoint(&self.otlp_traces_endpoint).map_err(ConfigError::Invalid)?;
        }
        for entry in &self.control_plane_api_keys {
            parse_control_plane_key(entry).map_err(ConfigError::Invalid)?;
        }
        self.validate_placement()
    }

    fn validate_placement(&self) -> Result<(), ConfigError> {
        let bad = |m: String| Err(ConfigError::Invalid(m));
        // The SLO flags themselves are checked with the other SMG-era options above.
        if !(self.admission_slack == 0.0 || (self.admission_slack.is_finite() && self.admission_slack >= 1.0)) {
            return bad(format!("--admission-slack must be 0 (off) or at least 1, not {}", self.admission_slack));
        }
        self.cost_priors().check().map_err(|e| ConfigError::Invalid(format!("--placement-*: {e}")))
    }

    /// The cost model's starting point, from the `--placement-*` options.
    pub fn cost_priors(&self) -> CostPriors {
        CostPriors {
            prefill_base_ms: self.placement_prefill_base_ms,
            prefill_ms_per_token: self.placement_prefill_ms_per_token,
            decode_step_ms: self.placement_decode_step_ms,
            kv_bytes_per_token: self.placement_kv_bytes_per_token,
            link_setup_ms: self.placement_link_setup_ms,
            link_gib_per_s: self.placement_link_gib_per_s,
            prior_weight: self.placement_prior_weight,
            forgetting: self.placement_forgetting,
            ..CostPriors::default()
        }
    }

    /// Attempts per request, the first included: `--retry-max-retries` in SMG's meaning, one
    /// with `--disable-retries`.
    pub fn max_attempts(&self) -> u32 {
        if self.disable_retries {
            1
        } else {
            self.retry_max_retries.max(1)
        }
    }

    /// `--max-concurrent-requests` as a limit; `None` for no limit (0 or -1).
    pub fn concurrency_limit(&self) -> Option<usize> {
        usize::try_from(self.max_concurrent_requests).ok().filter(|n| *n > 0)
    }

    /// Every key that opens the worker API: `--admin-api-key` and the `admin` entries of
    /// `--control-plane-api-keys`. Empty keys are left out.
    pub fn admin_keys(&self) -> Vec<String> {
        let control_plane = self.control_plane_api_keys.iter().filter_map(|e| parse_control_plane_key(e).ok()).map(|k| k.key);
        self.admin_api_key.iter().cloned().chain(control_plane).filter(|k| !k.is_empty()).collect()
    }

    /// `--service-discovery` and its selectors: each selector is `k=v`, and each is given only
    /// where it means something.
    fn validate_discovery(&self) -> Result<(), ConfigError> {
        let bad = |m: String| Err(ConfigError::Invalid(m));
        let sets = [
            ("--selector", &self.selector),
            ("--prefill-selector", &self.prefill_selector),
            ("--decode-selector", &self.decode_selector),
            ("--encode-selector", &self.encode_selector),
        ];
        for (flag, labels) in sets {
            if !labels.is_empty() && !self.service_discovery {
                return bad(format!("{flag} needs --service-discovery"));
            }
            for kv in labels {
                if parse_label(kv).is_none() {
                    return bad(format!("{flag} {kv:?}: expected KEY=VALUE"));
                }
            }
        }
        if !self.pd_disaggregation && (!self.prefill_selector.is_empty() || !self.decode_selector.is_empty()) {
            return bad("--prefill-selector/--decode-selector need --pd-disaggregation; use --selector in regular mode".into());
        }
        if !self.epd_disaggregation && !self.encode_selector.is_empty() {
            return bad("--encode-selector needs --epd-disaggregation (encode workers serve EPD mode only)".into());
        }
        if !self.service_discovery {
            return Ok(());
        }
        // An empty selector matches every pod in the namespace: never what anyone means.
        if self.pd_disaggregation && (self.prefill_selector.is_empty() || self.decode_selector.is_empty()) {
            return bad("--service-discovery in PD mode needs --prefill-selector and --decode-selector".into());
        }
        if !self.pd_disaggregation && self.selector.is_empty() {
            return bad("--service-discovery needs --selector KEY=VALUE".into());
        }
        if self.service_discovery_port == 0 {
            return bad("--service-discovery-port must be at least 1".into());
        }
        Ok(())
    }

    /// The objectives a request is judged by when it sends no header of its own: the ones set,
    /// else the reporting objectives (which goodput is counted against, and nothing is refused
    /// for).
    pub fn slo_targets(&self) -> crate::slo::SloTargets {
        use crate::slo::{REPORTING_TPOT_MS, REPORTING_TTFT_MS};
        crate::slo::SloTargets {
            ttft_ms: self.slo_ttft_ms.unwrap_or(REPORTING_TTFT_MS),
            tpot_ms: self.slo_tpot_ms.unwrap_or(REPORTING_TPOT_MS),
            ttft_set: self.slo_ttft_ms.is_some(),
        }
    }

    /// The request bounds, as the parser takes them.
    pub fn limits(&self) -> pdgate_protocol::Limits {
        pdgate_protocol::Limits {
            max_n: self.max_n,
            max_batch_size: self.max_batch_size,
            max_prompt_bytes: self.max_prompt_bytes,
            max_stop_sequences: self.max_stop_sequences,
            max_stop_bytes: self.max_stop_bytes,
            max_logit_bias: self.max_logit_bias,
            max_tools: self.max_tools,
            chars_per_token: self.chars_per_token,
        }
    }

    /// The policy that picks prefill workers (regular workers use `policy`).
    pub fn effective_prefill_policy(&self) -> PolicyName {
        self.prefill_policy.unwrap_or(self.policy)
    }

    pub fn effective_decode_policy(&self) -> PolicyName {
        self.decode_policy.unwrap_or(self.policy)
    }

    /// The statically configured workers, parsed and checked.
    pub fn workers(&self) -> Result<Vec<WorkerSpec>, ConfigError> {
        let mut out = Vec::new();
        // `--worker-urls URL [kv_events=...] [label=K=V]... URL ...`: the tokens of --decode.
        for tokens in crate::registration::worker_url_groups(&self.worker_urls).map_err(ConfigError::Invalid)? {
            let reg = crate::registration::from_tokens(tokens, WorkerRole::Regular).map_err(ConfigError::Invalid)?;
            out.push(reg.into_spec(false).map_err(|e| ConfigError::Invalid(e.message))?);
        }
        out.extend(self.prefill_args()?);
        for tokens in &self.decode {
            let reg = crate::config_serde::decode_from_tokens(tokens).map_err(ConfigError::Invalid)?;
            out.push(reg.into_spec(true).map_err(|e| ConfigError::Invalid(e.message))?);
        }
        for tokens in &self.encode {
            let reg = crate::config_serde::encode_from_tokens(tokens).map_err(ConfigError::Invalid)?;
            out.push(reg.into_spec(true).map_err(|e| ConfigError::Invalid(e.message))?);
        }
        let mut seen = std::collections::HashSet::new();
        for w in &out {
            if !seen.insert(w.url.clone()) {
                return Err(ConfigError::Invalid(format!("worker {} is listed twice", w.url)));
            }
        }
        Ok(out)
    }

    /// What a valid configuration still does not do as asked, for the start-up log.
    pub fn warnings(&self) -> Vec<String> {
        let mut out = Vec::new();
        if self.pd_disaggregation && self.pd_placement == PlacementMode::Disaggregated && !self.worker_urls.is_empty() {
            out.push(format!(
                "--worker-urls gives a colocated pool of {} worker(s) that --pd-placement disaggregated never uses (every request runs on a prefill/decode pair); use --pd-placement colocated or conditional to route to it",
                crate::registration::worker_url_groups(&self.worker_urls).map_or(0, |g| g.len())
            ));
        }
        out
    }

    /// `--prefill URL [PORT] ...` occurrences as worker specs.
    pub fn prefill_args(&self) -> Result<Vec<WorkerSpec>, ConfigError> {
        self.prefill
            .iter()
            .map(|tokens| {
                let reg = crate::config_serde::prefill_from_tokens(tokens).map_err(ConfigError::Invalid)?;
                reg.into_spec(true).map_err(|e| ConfigError::Invalid(e.message))
            })
            .collect()
    }

    /// A machine-readable description of every option, for the Python CLI and API.
    pub fn schema() -> serde_json::Value {
        let cmd = Self::command();
        let defaults = serde_json::to_value(Self::default()).unwrap_or_default();
        let options: Vec<serde_json::Value> = cmd
            .get_arguments()
            .filter(|a| a.get_long().is_some())
            .map(|a| {
                let id = a.get_id().as_str().to_string();
                serde_json::json!({
                    "name": id,
                    "flag": format!("--{}", a.get_long().unwrap_or_default()),
                    "aliases": a.get_visible_aliases().unwrap_or_default().iter().map(|x| format!("--{x}")).collect::<Vec<_>>(),
                    "help": a.get_help().map(|h| h.to_string()).unwrap_or_default(),
                    "default": defaults.get(&id).cloned().unwrap_or(serde_json::Value::Null),
                    "choices": a.get_possible_values().iter().map(|v| v.get_name().to_string()).collect::<Vec<_>>(),
                    "takes_value": a.get_action().takes_values(),
                    "json_schema": crate::config_json::option_schema(a, defaults.get(&id)),
                    "repeated": matches!(a.get_action(), ArgAction::Append) || a.get_num_args().map(|n| n.max_values() > 1).unwrap_or(false),
                })
            })
            .collect();
        serde_json::json!({ "options": options })
    }
}
