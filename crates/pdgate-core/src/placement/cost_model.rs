//! The cost model: how long a prefill, a KV transfer and a decode step take, learned online.
//!
//! - prefill_ms = a + b·tokens, fitted by weighted least squares over the observed prefill legs;
//! - transfer_ms = setup + bytes / bandwidth, fitted the same way over observed KV transfers
//!   (bytes, milliseconds), with `kv_bytes_per_token` (configuration) turning tokens into bytes;
//! - decode step ms, a weighted mean of observed TPOTs (plus a fixed per-sequence term from the
//!   priors, not fitted).
//!
//! Each fit starts from a prior (the configured parameters) that counts as `prior_weight`
//! observations, and forgets exponentially (`forgetting` per new observation), the prior
//! included, so the model follows a fleet whose speed changes while one wild sample cannot
//! throw it far. The prior keeps a floor of [`PRIOR_FLOOR`] of its weight, so a fit whose
//! observations all have one size still has a slope. Nothing here reads a clock: observations
//! come in as numbers.

use serde::{Deserialize, Serialize};

pub const GIB: f64 = 1024.0 * 1024.0 * 1024.0;

/// The share of its weight the prior keeps however much is observed.
pub const PRIOR_FLOOR: f64 = 1e-3;

/// The configured starting point of the model (and all of it when nothing is observed).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct CostPriors {
    /// Fixed cost of one prefill, ms.
    pub prefill_base_ms: f64,
    /// Prefill cost per prompt token, ms.
    pub prefill_ms_per_token: f64,
    /// One decode step with no other sequence running, ms.
    pub decode_step_ms: f64,
    /// What each running sequence adds to a decode step, ms (not fitted).
    pub decode_step_per_seq_ms: f64,
    /// KV bytes per prompt token (model and dtype dependent; not fitted).
    pub kv_bytes_per_token: f64,
    /// Fixed cost of one KV send, ms.
    pub link_setup_ms: f64,
    /// KV link bandwidth, GiB/s.
    pub link_gib_per_s: f64,
    /// The prefill sends its KV in chunks of this many tokens as it computes them (0: one send
    /// after the prefill). Only the part of the transfer that outlasts the prefill is exposed.
    pub send_chunk_tokens: u64,
    /// A colocated worker prefills in chunks of this many tokens, each chunk riding in one step
    /// with its running decodes (0: one chunk).
    pub prefill_chunk_tokens: u64,
    /// How many observations the prior is worth.
    pub prior_weight: f64,
    /// Weight kept by older observations at each new one, in (0, 1]: 0.98 makes the last ~50
    /// observations count.
    pub forgetting: f64,
}

impl Default for CostPriors {
    /// The design's worked example: prefill 20 + 0.035·tokens ms, 45 ms decode step, 320 KiB of
    /// KV per token, a 12 ms + 22 GiB/s link, whole-KV sends.
    fn default() -> Self {
        CostPriors {
            prefill_base_ms: 20.0,
            prefill_ms_per_token: 0.035,
            decode_step_ms: 45.0,
            decode_step_per_seq_ms: 0.0,
            kv_bytes_per_token: 320.0 * 1024.0,
            link_setup_ms: 12.0,
            link_gib_per_s: 22.0,
            send_chunk_tokens: 0,
            prefill_chunk_tokens: 0,
            prior_weight: 10.0,
            forgetting: 0.98,
        }
    }
}

impl CostPriors {
    /// Why these priors cannot make a model, if they cannot.
    pub fn check(&self) -> Result<(), String> {
        let finite_non_negative = [
            ("prefill_base_ms", self.prefill_base_ms),
            ("prefill_ms_per_token", self.prefill_ms_per_token),
            ("decode_step_ms", self.decode_step_ms),
            ("decode_step_per_seq_ms", self.decode_step_per_seq_ms),
            ("kv_bytes_per_token", self.kv_bytes_per_token),
            ("link_setup_ms", self.link_setup_ms),
        ];
        for (name, v) in finite_non_negative {
            if !v.is_finite() || v < 0.0 {
                return Err(format!("{name} must be a finite number >= 0, got {v}"));
            }
        }
        if !(self.link_gib_per_s.is_finite() && self.link_gib_per_s > 0.0) {
            return Err(format!("link bandwidth must be > 0 GiB/s, got {}", self.link_gib_per_s));
        }
        if !(self.prior_weight.is_finite() && self.prior_weight > 0.0) {
            return Err(format!("prior weight must be > 0, got {}", self.prior_weight));
        }
        if !(self.forgetting > 0.0 && self.forgetting <= 1.0) {
            return Err(format!("forgetting must be in (0, 1], got {}", self.forgetting));
        }
        Ok(())
    }
}

/// Weighted sufficient statistics of y = a + b·x.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
struct Sums {
    w: f64,
    x: f64,
    y: f64,
    xx: f64,
    xy: f64,
}

impl Sums {
    fn add(&mut self, x: f64, y: f64, w: f64) {
        self.w += w;
        self.x += w * x;
        self.y += w * y;
        self.xx += w * x * x;
        self.xy += w * x * y;
    }

    fn scale(&mut self, k: f64) {
        *self = Sums { w: self.w * k, x: self.x * k, y: self.y * k, xx: self.xx * k, xy: self.xy * k };
    }

    fn plus(&self, o: &Sums) -> Sums {
        Sums { w: self.w + o.w, x: self.x + o.x, y: self.y + o.y, xx: self.xx + o.xx, xy: self.xy + o.xy }
    }
}

/// An online fit of y = a + b·x with a fixed prior and exponential forgetting. The prior is two
/// pseudo-observations on the prior line, at x = 0 and at `x_ref` (a typical size), so it pins
/// both the intercept and the slope until real data outweighs it. The slope never goes below 0
/// (more work never predicts less time).
#[derive(Clone, Debug, PartialEq)]
pub struct LinearFit {
    prior: Sums,
    prior_scale: f64,
    seen: Sums,
    forgetting: f64,
    fitted: (f64, f64),
    observations: u64,
}

impl LinearFit {
    pub fn new(a: f64, b: f64, x_ref: f64, prior_weight: f64, forgetting: f64) -> Self {
        let mut prior = Sums::default();
        prior.add(0.0, a, prior_weight / 2.0);
        prior.add(x_ref, a + b * x_ref, prior_weight / 2.0);
        LinearFit { prior, prior_scale: 1.0, seen: Sums::default(), forgetting, fitted: (a, b), observations: 0 }
    }

    /// One observation; ignored unless both are finite and non-negative.
    pub fn observe(&mut self, x: f64, y: f64) {
        if !(x.is_finite() && y.is_finite() && x >= 0.0 && y >= 0.0) {
            return;
        }
        self.seen.scale(self.forgetting);
        self.seen.add(x, y, 1.0);
        self.prior_scale = (self.prior_scale * self.forgetting).max(PRIOR_FLOOR);
        self.observations += 1;
        let mut prior = self.prior;
        prior.scale(self.prior_scale);
        self.fitted = Self::solve(&prior.plus(&self.seen)).unwrap_or(self.fitted);
    }

    fn solve(s: &Sums) -> Option<(f64, f64)> {
        let det = s.w * s.xx - s.x * s.x;
        if det.abs() < 1e-12 * (s.w * s.xx).abs().max(1e-300) {
            return None;
        }
        let b = ((s.w * s.xy - s.x * s.y) / det).max(0.0);
        // With the slope clamped, the best intercept is the weighted mean residual.
        let a = ((s.y - b * s.x) / s.w).max(0.0);
        (a.is_finite() && b.is_finite()).then_some((a, b))
    }

    pub fn intercept(&self) -> f64 {
        self.fitted.0
    }

    pub fn slope(&self) -> f64 {
        self.fitted.1
    }

    pub fn at(&self, x: f64) -> f64 {
        self.fitted.0 + self.fitted.1 * x.max(0.0)
    }

    pub fn observations(&self) -> u64 {
        self.observations
    }
}

/// An online weighted mean with a fixed prior and exponential forgetting.
#[derive(Clone, Debug, PartialEq)]
pub struct MeanFit {
    prior_w: f64,
    prior_floor: f64,
    prior_mean: f64,
    w: f64,
    sum: f64,
    forgetting: f64,
    observations: u64,
}

impl MeanFit {
    pub fn new(mean: f64, prior_weight: f64, forgetting: f64) -> Self {
        MeanFit { prior_w: prior_weight, prior_floor: prior_weight * PRIOR_FLOOR, prior_mean: mean, w: 0.0, sum: 0.0, forgetting, observations: 0 }
    }

    pub fn observe(&mut self, y: f64) {
        if !(y.is_finite() && y >= 0.0) {
            return;
        }
        self.w = self.w * self.forgetting + 1.0;
        self.sum = self.sum * self.forgetting + y;
        self.prior_w = (self.prior_w * self.forgetting).max(self.prior_floor);
        self.observations += 1;
    }

    pub fn mean(&self) -> f64 {
        (self.prior_w * self.prior_mean + self.sum) / (self.prior_w + self.w)
    }

    pub fn observations(&self) -> u64 {
        self.observations
    }
}

/// The fitted parameters, for gauges and the decision record.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Fitted {
    pub prefill_base_ms: f64,
    pub prefill_ms_per_token: f64,
    pub link_setup_ms: f64,
    pub link_gib_per_s: f64,
    pub decode_step_ms: f64,
    pub prefill_observations: u64,
    pub transfer_observations: u64,
    pub decode_observations: u64,
}

/// Prefill, transfer and decode-step costs, learned online from priors.
#[derive(Clone, Debug, PartialEq)]
pub struct CostModel {
    priors: CostPriors,
    prefill: LinearFit,
    /// x: KV bytes, y: ms.
    transfer: LinearFit,
    decode_step: MeanFit,
}

/// A typical prompt, where the prefill prior's second point sits.
const PREFILL_REF_TOKENS: f64 = 4096.0;

impl CostModel {
    pub fn new(priors: CostPriors) -> Self {
        let p = priors;
        let ms_per_byte = 1000.0 / (p.link_gib_per_s * GIB);
        let ref_bytes = PREFILL_REF_TOKENS * p.kv_bytes_per_token.max(1.0);
        CostModel {
            priors,
            prefill: LinearFit::new(p.prefill_base_ms, p.prefill_ms_per_token, PREFILL_REF_TOKENS, p.prior_weight, p.forgetting),
            transfer: LinearFit::new(p.link_setup_ms, ms_per_byte, ref_bytes, p.prior_weight, p.forgetting),
            decode_step: MeanFit::new(p.decode_step_ms, p.prior_weight, p.forgetting),
        }
    }

    pub fn priors(&self) -> &CostPriors {
        &self.priors
    }

    /// A prefill leg of `tokens` prompt tokens took `ms`.
    pub fn observe_prefill(&mut self, tokens: u64, ms: f64) {
        self.prefill.observe(tokens as f64, ms);
    }

    /// A KV transfer of `bytes` took `ms`.
    pub fn observe_transfer(&mut self, bytes: u64, ms: f64) {
        self.transfer.observe(bytes as f64, ms);
    }

    /// A request's time per output token (one decode step as its batch ran), ms.
    pub fn observe_decode_step(&mut self, tpot_ms: f64) {
        self.decode_step.observe(tpot_ms);
    }

    pub fn prefill_ms(&self, tokens: u64) -> f64 {
        self.prefill.at(tokens as f64)
    }

    /// Prefill work queued ahead: `tokens` spread over `requests` prefills.
    pub fn queued_prefill_ms(&self, tokens: u64, requests: u64) -> f64 {
        self.prefill.intercept() * requests as f64 + self.prefill.slope() * tokens as f64
    }

    pub fn kv_bytes(&self, tokens: u64) -> f64 {
        self.priors.kv_bytes_per_token * tokens as f64
    }

    /// One send of `tokens` tokens' KV.
    pub fn send_ms(&self, tokens: u64) -> f64 {
        self.transfer.at(self.kv_bytes(tokens))
    }

    /// The transfer time left after the prefill ends. With chunked sends, chunk k leaves when
    /// the prefill has produced it and the link is free; only what outlasts the prefill counts.
    pub fn exposed_transfer_ms(&self, tokens: u64) -> f64 {
        let chunk = self.priors.send_chunk_tokens;
        if chunk == 0 || chunk >= tokens {
            return self.send_ms(tokens);
        }
        let (mut link, mut done) = (0.0f64, 0u64);
        while done < tokens {
            let size = chunk.min(tokens - done);
            done += size;
            link = link.max(self.prefill_ms(done)) + self.send_ms(size);
        }
        (link - self.prefill_ms(tokens)).max(0.0)
    }

    /// One decode step with `batch` sequences running (0 with none: no step to wait for).
    pub fn decode_step_ms(&self, batch: u64) -> f64 {
        if batch == 0 {
            return 0.0;
        }
        self.decode_step.mean() + self.priors.decode_step_per_seq_ms * batch as f64
    }

    /// Chunks of a colocated prefill of `tokens`.
    pub fn prefill_chunks(&self, tokens: u64) -> u64 {
        match self.priors.prefill_chunk_tokens {
            0 => 1,
            c => tokens.div_ceil(c).max(1),
        }
    }

    pub fn fitted(&self) -> Fitted {
        let ms_per_byte = self.transfer.slope();
        Fitted {
            prefill_base_ms: self.prefill.intercept(),
            prefill_ms_per_token: self.prefill.slope(),
            link_setup_ms: self.transfer.intercept(),
            link_gib_per_s: if ms_per_byte > 0.0 { 1000.0 / (ms_per_byte * GIB) } else { f64::INFINITY },
            decode_step_ms: self.decode_step.mean(),
            prefill_observations: self.prefill.observations(),
            transfer_observations: self.transfer.observations(),
            decode_observations: self.decode_step.observations(),
        }
    }
}
