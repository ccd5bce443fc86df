//! Routing policies: pure functions that pick one of a set of candidate workers.
//!
//! A policy reads the snapshot and the request, takes randomness as an argument and keeps no
//! state: `select(snapshot, candidates, input, rng)`. What a policy needs to know about the
//! world comes in through [`RouteInput`]: the gateway's round-robin counter, the workers' load
//! (a [`LoadView`] over the gateway's in-flight and token counters and polled engine load), the
//! request's text and the radix tree (cache-aware, least_tokens), its prompt and output token
//! counts (least_tokens, most_free_kv), the session key (consistent hashing).
//!
//! Every policy is O(1) in the size of the fleet, up to small constant bounds: the routing hot
//! path must not scan thousands of workers per request. Policies that look for the least loaded
//! worker scan at most [`SCAN_LIMIT`] candidates (a random sample beyond that).
//!
//! Candidates are snapshot indices in ascending order (every list the snapshot hands out is, and
//! filtering keeps the order); policies rely on it for membership tests.

use std::borrow::Cow;
use std::fmt;

use rand::{Rng, RngCore};

use crate::config::{CacheSource, GatewayConfig, PolicyName};
use crate::radix::RadixTree;
use crate::snapshot::PoolSnapshot;

mod basic;
mod cache_aware;
mod cache_events;
mod consistent_hash;
mod least_tokens;
mod most_free_kv;
mod power_of_two;

pub use basic::{RandomPolicy, RoundRobinPolicy};
pub use cache_aware::CacheAwarePolicy;
pub use cache_events::uses_events;
pub use consistent_hash::{ConsistentHashPolicy, HashRing};
pub use least_tokens::LeastTokensPolicy;
pub use most_free_kv::{MostFreeKvPolicy, NO_ROOM};
pub use power_of_two::{gen_pair, PowerOfTwoPolicy};

/// The most candidates a policy looks at to find a least-loaded one; beyond this it samples.
pub const SCAN_LIMIT: usize = 128;

/// Current load of each worker, by snapshot index: the gateway's in-flight count plus the
/// engine's polled queue, or whatever the gateway decides load means. Unknown workers are 0.
pub trait LoadView: Sync {
    /// Requests queued or running on this worker (what count-based policies compare).
    fn load(&self, worker: usize) -> u64;
    /// Prompt tokens queued or being prefilled on this worker (the gateway's own count plus what
    /// the engine reports waiting), 0 when unknown.
    fn prompt_tokens(&self, _worker: usize) -> u64 {
        0
    }
    /// KV tokens this worker can still take (engine-reported free KV minus what the gateway placed
    /// since that report), `None` when unknown.
    fn free_kv_tokens(&self, _worker: usize) -> Option<u64> {
        None
    }
    /// Requests running on this worker (engine report, else the gateway's in-flight count).
    fn running(&self, worker: usize) -> u64 {
        self.load(worker)
    }
}

/// Every worker idle: the load view of tests and of policies that ignore load.
#[derive(Clone, Copy, Debug, Default)]
pub struct NoLoad;

impl LoadView for NoLoad {
    fn load(&self, _: usize) -> u64 {
        0
    }
}

/// A table of loads by snapshot index.
impl LoadView for [u64] {
    fn load(&self, worker: usize) -> u64 {
        self.get(worker).copied().unwrap_or(0)
    }
}

impl LoadView for Vec<u64> {
    fn load(&self, worker: usize) -> u64 {
        self.as_slice().load(worker)
    }
}

/// What a policy may look at besides the pool. Build it with struct update syntax:
/// `RouteInput { text: Some(t), loads: &view, ..RouteInput::default() }`.
#[derive(Clone, Copy)]
pub struct RouteInput<'a> {
    /// The request's prompt text (cache-aware routing).
    pub text: Option<&'a str>,
    /// Session affinity key: a routing header or the request's `user` (consistent hashing).
    pub key: Option<&'a str>,
    /// A per-gateway counter, one step per decision (round robin).
    pub sequence: u64,
    /// Worker loads by snapshot index (power of two, cache-aware).
    pub loads: &'a dyn LoadView,
    /// The gateway's radix tree of recent prompts per worker (cache-aware, least_tokens).
    pub tree: Option<&'a RadixTree>,
    /// The request's prompt length in tokens (`ParsedRequest::prompt_tokens`; least_tokens).
    pub prompt_tokens: u64,
    /// The output tokens the request may generate (its `max_tokens`, or the gateway's
    /// assumption when it gave none); with the prompt, the KV it needs (most_free_kv).
    pub output_tokens: u64,
    /// What the engines' KV events say the workers hold of this prompt (cache_aware with
    /// `--cache-source events|auto`); `None` when the request has no token ids.
    pub kv: Option<KvMatch<'a>>,
}

/// A request's prompt matched against the workers' KV event views, by snapshot index.
#[derive(Clone, Copy, Debug)]
pub struct KvMatch<'a> {
    /// The prompt's length in tokens.
    pub prompt_tokens: usize,
    /// `(worker, leading prompt tokens it holds)` for the workers holding at least one block,
    /// ascending by worker.
    pub held: &'a [(usize, usize)],
    /// A hash of the prompt's token ids, the same in every replica: ties between holders go
    /// by it and the worker's URL (rendezvous), so replicas with equal loads agree.
    pub key: u64,
    /// Workers without a registered `kv_events` endpoint whose events reach the index anyway
    /// (a gRPC worker's `SubscribeKvEvents` stream), ascending: `--cache-source auto` matches
    /// them on their events, like the registered publishers.
    pub subscribed: &'a [usize],
    /// How many blocks each worker's event view holds, read on a miss: a new prefix goes to
    /// the emptiest of the equally least loaded workers instead of a random one.
    pub blocks: &'a dyn CachedBlocks,
}

/// Blocks a worker's KV event view holds, by snapshot index; `None` when its events are not
/// followed.
pub trait CachedBlocks: Sync {
    fn cached_blocks(&self, worker: usize) -> Option<usize>;
}

impl std::fmt::Debug for dyn CachedBlocks + '_ {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("CachedBlocks")
    }
}

/// No counts known (tests, and workers without events).
#[derive(Clone, Copy, Debug, Default)]
pub struct NoBlocks;

impl CachedBlocks for NoBlocks {
    fn cached_blocks(&self, _: usize) -> Option<usize> {
        None
    }
}

/// Counts by snapshot index (tests).
impl CachedBlocks for Vec<usize> {
    fn cached_blocks(&self, worker: usize) -> Option<usize> {
        self.get(worker).copied()
    }
}

impl Default for RouteInput<'_> {
    fn default() -> Self {
        RouteInput { text: None, key: None, sequence: 0, loads: &NoLoad, tree: None, prompt_tokens: 0, output_tokens: 0, kv: None }
    }
}

impl RouteInput<'_> {
    /// KV tokens the request will hold on its decode worker: prompt + output.
    pub fn kv_tokens(&self) -> u64 {
        self.prompt_tokens.saturating_add(self.output_tokens)
    }
}

impl fmt::Debug for RouteInput<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RouteInput")
            .field("text_len", &self.text.map(str::len))
            .field("key", &self.key)
            .field("sequence", &self.sequence)
            .field("prompt_tokens", &self.prompt_tokens)
            .field("output_tokens", &self.output_tokens)
            .field("tree_size", &self.tree.map(RadixTree::size))
            .field("kv_held", &self.kv.map(|k| k.held.len()))
            .finish()
    }
}

/// A chosen worker and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Selection {
    /// Index into the snapshot's workers.
    pub worker: usize,
    /// For the decision record, e.g. `cache_hit=0.82` or `rebalance`.
    pub reason: Cow<'static, str>,
    /// A small fixed set of labels for metrics (`cache_hit`, `cache_miss`, `rebalance`, ...).
    pub branch: &'static str,
}

impl Selection {
    pub fn new(worker: usize, branch: &'static str) -> Self {
        Selection { worker, reason: Cow::Borrowed(branch), branch }
    }

    pub fn with_reason(worker: usize, branch: &'static str, reason: String) -> Self {
        Selection { worker, reason: Cow::Owned(reason), branch }
    }
}

pub trait Policy: Send + Sync + fmt::Debug {
    fn name(&self) -> &'static str;
    /// Picks among `candidates` (ascending indices into `snapshot`); `None` only when it is
    /// empty.
    fn select(&self, snapshot: &PoolSnapshot, candidates: &[usize], input: &RouteInput<'_>, rng: &mut dyn RngCore) -> Option<Selection>;
    /// Whether the gateway should record the request text for the chosen worker in its radix
    /// tree after this policy decided (`tree.insert(text, url, now)`, then `tree.evict(max)`).
    fn uses_tree(&self) -> bool {
        false
    }
}

/// Tunables of the load- and cache-aware policies.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PolicyOptions {
    /// Minimum prefix match ratio for a cache hit.
    pub cache_threshold: f64,
    /// Load is imbalanced when max - min exceeds this...
    pub balance_abs_threshold: u64,
    /// ...and max exceeds this times min.
    pub balance_rel_threshold: f64,
    /// Where cache_aware learns what the workers hold (`--cache-source`).
    pub cache_source: CacheSource,
}

impl Default for PolicyOptions {
    fn default() -> Self {
        PolicyOptions { cache_threshold: 0.3, balance_abs_threshold: 64, balance_rel_threshold: 1.5, cache_source: CacheSource::Auto }
    }
}

impl PolicyOptions {
    pub fn from_config(c: &GatewayConfig) -> Self {
        PolicyOptions {
            cache_threshold: c.cache_threshold,
            balance_abs_threshold: c.balance_abs_threshold,
            balance_rel_threshold: c.balance_rel_threshold,
            cache_source: c.cache_source,
        }
    }

    /// SMG's rule: imbalanced when both `max - min > abs` and `max > rel * min`.
    pub fn imbalanced(&self, min: u64, max: u64) -> bool {
        max.saturating_sub(min) > self.balance_abs_threshold && max as f64 > self.balance_rel_threshold * min as f64
    }
}

/// A policy with default options.
pub fn make_policy(name: PolicyName) -> Box<dyn Policy> {
    make_policy_with(name, &PolicyOptions::default())
}

pub fn make_policy_with(name: PolicyName, options: &PolicyOptions) -> Box<dyn Policy> {
    match name {
        PolicyName::Random => Box::new(RandomPolicy),
        PolicyName::RoundRobin => Box::new(RoundRobinPolicy),
        PolicyName::PowerOfTwo => Box::new(PowerOfTwoPolicy),
        PolicyName::CacheAware => Box::new(CacheAwarePolicy::new(*options)),
        PolicyName::ConsistentHash => Box::new(ConsistentHashPolicy),
        PolicyName::LeastTokens => Box::new(LeastTokensPolicy),
        PolicyName::MostFreeKv => Box::new(MostFreeKvPolicy),
    }
}

/// Least and most loaded among (a sample of) the candidates.
#[derive(Clone, Copy, Debug)]
pub(crate) struct LoadScan {
    pub least: usize,
    pub min: u64,
    pub max: u64,
}

/// Scans all candidates when there are at most [`SCAN_LIMIT`], else a random sample of that
/// many. The scan starts at a random offset so that ties (an idle fleet) spread out.
pub(crate) fn scan_loads(candidates: &[usize], loads: &dyn LoadView, rng: &mut dyn RngCore) -> Option<LoadScan> {
    let n = candidates.len();
    if n == 0 {
        return None;
    }
    let start = rng.random_range(0..n);
    let mut scan = LoadScan { least: candidates[start], min: u64::MAX, max: 0 };
    let visit = |w: usize| {
        let l = loads.load(w);
        if l < scan.min {
            scan = LoadScan { least: w, min: l, ..scan };
        }
        scan.max = scan.max.max(l);
    };
    visit_bounded(candidates, start, rng, visit);
    Some(scan)
}

/// Visits every candidate from `start` on (wrapping) when there are at most [`SCAN_LIMIT`],
/// else `candidates[start]` and a random sample up to [`SCAN_LIMIT`] visits: the bounded scan
/// every load-reading policy shares, so routing cost does not grow with the fleet.
pub(crate) fn visit_bounded(candidates: &[usize], start: usize, rng: &mut dyn RngCore, mut visit: impl FnMut(usize)) {
    let n = candidates.len();
    if n <= SCAN_LIMIT {
        (0..n).for_each(|i| visit(candidates[(start + i) % n]));
    } else {
        visit(candidates[start]);
        (1..SCAN_LIMIT).for_each(|_| visit(candidates[rng.random_range(0..n)]));
    }
}

/// Whether `worker` is among the ascending `candidates`.
pub(crate) fn is_candidate(candidates: &[usize], worker: usize) -> bool {
    candidates.binary_search(&worker).is_ok()
}
