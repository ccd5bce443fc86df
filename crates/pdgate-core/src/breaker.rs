//! A per-worker circuit breaker fed by request outcomes.
//!
//! Closed → Open after `failure_threshold` consecutive failures within the sliding `window`
//! (SMG's `--cb-window-duration-secs`: an older failure no longer counts); Open → HalfOpen once
//! `cooldown` has passed; HalfOpen → Closed after `success_threshold` consecutive successes, or
//! back to Open on any failure. A 429 (or any client error) counts as neither: an overloaded or
//! strict worker is not a broken one. Time is an argument (`now`), so the machine is tested on
//! a fake clock; the gateway passes `tokio::time::Instant::now().into_std()`.
//!
//! Half-open lets ONE request through at a time (the probe, [`Breaker::try_admit`]); the
//! others go elsewhere until its outcome is recorded, so a worker that is still broken fails
//! one request per probe, not every request that arrives in the meantime. The first failure
//! re-opens. A probe whose outcome never comes (its client went away) frees the slot after
//! `probe_timeout`. The snapshot is immutable, so the gateway must rebuild it when a breaker
//! changes state, when a probe starts or ends, and at [`Breaker::half_open_at`] (an open
//! breaker becomes half-open by the clock alone).

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use crate::config::GatewayConfig;
use crate::error::{ErrorKind, GatewayError, Leg};

/// The breaker's thresholds, from `--breaker-*` and `--disable-circuit-breaker`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BreakerConfig {
    pub enabled: bool,
    pub failure_threshold: u32,
    pub success_threshold: u32,
    pub cooldown: Duration,
    /// How long a half-open probe holds the slot at most (the request deadline, at most one
    /// cool-down).
    pub probe_timeout: Duration,
    /// Failures older than this (at the time of the next failure) no longer count.
    pub window: Duration,
}

impl Default for BreakerConfig {
    fn default() -> Self {
        BreakerConfig {
            enabled: true,
            failure_threshold: 5,
            success_threshold: 2,
            cooldown: Duration::from_secs(30),
            probe_timeout: Duration::from_secs(600),
            window: Duration::from_secs(120),
        }
    }
}

impl BreakerConfig {
    pub fn from_config(c: &GatewayConfig) -> Self {
        BreakerConfig {
            enabled: !c.disable_circuit_breaker,
            failure_threshold: c.breaker_failure_threshold.max(1),
            success_threshold: c.breaker_success_threshold.max(1),
            cooldown: Duration::from_secs(c.breaker_cooldown_secs),
            // A probe whose outcome never comes (its client went away before any verdict)
            // holds the slot for the request deadline at most, and never longer than one
            // cool-down: at most one probe per cool-down is the worst case.
            probe_timeout: Duration::from_secs(c.request_timeout_secs.min(c.breaker_cooldown_secs).max(1)),
            window: Duration::from_secs(c.breaker_window_secs.max(1)),
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum BreakerState {
    #[default]
    Closed,
    Open,
    HalfOpen,
}

impl BreakerState {
    pub fn as_str(self) -> &'static str {
        match self {
            BreakerState::Closed => "closed",
            BreakerState::Open => "open",
            BreakerState::HalfOpen => "half_open",
        }
    }

    /// Whether a worker in this state may be routed to.
    pub fn allows(self) -> bool {
        self != BreakerState::Open
    }

    /// Gauge value for metrics: 0 closed, 1 open, 2 half-open.
    pub fn as_gauge(self) -> u8 {
        match self {
            BreakerState::Closed => 0,
            BreakerState::Open => 1,
            BreakerState::HalfOpen => 2,
        }
    }
}

/// What one request (or one PD leg) did to the worker's record.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    Success,
    Failure,
    /// No answer by the request's deadline (no response head, no stream data) from a request
    /// sent at this instant. Engines send a non-streamed answer's head only with its end, so a
    /// long request looks silent: neutral when the worker answered another request since then
    /// (it was busy, not broken); otherwise the record cannot tell a long request from a hung
    /// worker, and [`Breaker::judge`] asks for a health probe ([`Judgement::Probe`]), whose
    /// answer decides ([`Outcome::of_probe`]). [`Breaker::record`], which cannot ask, fails it.
    NoAnswerSince(Instant),
    /// 429, client errors, cancellations: says nothing about the worker's health.
    Neutral,
}

impl Outcome {
    /// From a worker's HTTP status: 5xx fails, 2xx/3xx succeeds, 4xx (429 included) is neutral.
    pub fn from_status(status: u16) -> Self {
        match status {
            500..=599 => Outcome::Failure,
            400..=499 => Outcome::Neutral,
            _ => Outcome::Success,
        }
    }

    /// What a health probe of a silent worker says: failed (error, non-2xx, timeout) is a
    /// failure; a worker that answers its health check was busy with a long request, neutral.
    pub fn of_probe(healthy: bool) -> Self {
        if healthy {
            Outcome::Neutral
        } else {
            Outcome::Failure
        }
    }

    /// From the error a leg ended with. Errors that are not the worker's (client, gateway,
    /// the whole request's deadline) are neutral. A leg whose worker gave no answer by the
    /// deadline fails; one whose worker was still answering (head received, data arriving) is
    /// neutral: a request that outlives its deadline says nothing against the worker.
    pub fn from_error(e: &GatewayError) -> Self {
        match &e.kind {
            ErrorKind::WorkerUnreachable | ErrorKind::WorkerProtocol => Outcome::Failure,
            ErrorKind::BadWorkerResponse | ErrorKind::StreamTruncated => Outcome::Failure,
            ErrorKind::WorkerStatus { status, .. } => Outcome::from_status(*status),
            ErrorKind::Timeout if e.leg.is_some() => Outcome::Failure,
            _ => Outcome::Neutral,
        }
    }

    /// [`Outcome::from_error`] for an attempt sent at `sent`: a leg's no-answer timeout becomes
    /// [`Outcome::NoAnswerSince`]. Except an encode leg's: it had `--encode-timeout-secs` to
    /// accept one image, and an encode worker that hangs on `/encode` still passes its health
    /// probe, so the probe could not tell; its silence is a failure.
    pub fn of_attempt(e: &GatewayError, sent: Instant) -> Self {
        match (&e.kind, Outcome::from_error(e)) {
            (ErrorKind::Timeout, Outcome::Failure) if e.leg == Some(Leg::Encode) => Outcome::Failure,
            (ErrorKind::Timeout, Outcome::Failure) => Outcome::NoAnswerSince(sent),
            (_, o) => o,
        }
    }
}

/// What a breaker's record says of an outcome before it is recorded ([`Breaker::judge`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Judgement {
    /// Record this outcome.
    Record(Outcome),
    /// The record cannot tell: ask the worker (one health probe, off the request path) and
    /// record [`Outcome::of_probe`] of its answer.
    Probe,
}

/// One worker's breaker. Plain data; the gateway keeps one per worker under its registry lock.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Breaker {
    state: BreakerState,
    /// When each failure of the current run of consecutive failures happened, oldest first;
    /// only those within the window are kept, and never more than the threshold.
    failures: VecDeque<Instant>,
    consecutive_successes: u32,
    opened_at: Option<Instant>,
    /// When the worker last answered a request (judges [`Outcome::NoAnswerSince`]).
    last_success: Option<Instant>,
    /// When the half-open probe now in flight was let through; `None` when there is none.
    probe_since: Option<Instant>,
}

impl Breaker {
    /// The state at `now`: an open breaker whose cool-down has passed reads as half-open.
    pub fn state(&self, now: Instant, cfg: &BreakerConfig) -> BreakerState {
        if !cfg.enabled {
            return BreakerState::Closed;
        }
        match (self.state, self.opened_at) {
            (BreakerState::Open, Some(t)) if now.saturating_duration_since(t) >= cfg.cooldown => BreakerState::HalfOpen,
            (s, _) => s,
        }
    }

    pub fn allows(&self, now: Instant, cfg: &BreakerConfig) -> bool {
        self.state(now, cfg).allows()
    }

    /// Admits one request at `now`: always when closed, never when open, and when half-open
    /// only if no probe is in flight (this request becomes the probe and holds the slot until
    /// an outcome is recorded or `probe_timeout` passes).
    pub fn try_admit(&mut self, now: Instant, cfg: &BreakerConfig) -> bool {
        match self.state(now, cfg) {
            BreakerState::Closed => true,
            BreakerState::Open => false,
            BreakerState::HalfOpen if self.probing(now, cfg) => false,
            BreakerState::HalfOpen => {
                self.probe_since = Some(now);
                true
            }
        }
    }

    /// Whether a half-open probe holds the slot at `now` (routing then skips the worker).
    pub fn probing(&self, now: Instant, cfg: &BreakerConfig) -> bool {
        self.probe_since.is_some_and(|t| now.saturating_duration_since(t) < cfg.probe_timeout)
    }

    /// When the probe in flight gives up its slot by the clock alone (the gateway rebuilds its
    /// snapshot then, so the next request can probe).
    pub fn probe_expires_at(&self, cfg: &BreakerConfig) -> Option<Instant> {
        self.probe_since.map(|t| t + cfg.probe_timeout)
    }

    /// Frees the probe slot without a verdict (the probe's outcome was neutral: a 429, the
    /// client cancelled). True when a probe was in flight.
    pub fn end_probe(&mut self) -> bool {
        self.probe_since.take().is_some()
    }

    /// When an open breaker turns half-open by itself (the gateway rebuilds its snapshot then).
    pub fn half_open_at(&self, cfg: &BreakerConfig) -> Option<Instant> {
        match (cfg.enabled, self.state, self.opened_at) {
            (true, BreakerState::Open, Some(t)) => Some(t + cfg.cooldown),
            _ => None,
        }
    }

    /// Judges an outcome by the record alone: a [`Outcome::NoAnswerSince`] is neutral when the
    /// worker answered another request since, and needs a probe otherwise. Every other outcome
    /// is recorded as it is.
    pub fn judge(&self, outcome: Outcome) -> Judgement {
        match outcome {
            Outcome::NoAnswerSince(sent) if self.last_success.is_some_and(|t| t >= sent) => Judgement::Record(Outcome::Neutral),
            Outcome::NoAnswerSince(_) => Judgement::Probe,
            o => Judgement::Record(o),
        }
    }

    /// Records one outcome at `now`; returns the new state when it changed (including the
    /// clock-driven Open → HalfOpen step that this observation made visible).
    pub fn record(&mut self, outcome: Outcome, now: Instant, cfg: &BreakerConfig) -> Option<BreakerState> {
        if !cfg.enabled {
            return None;
        }
        // A caller that cannot probe gets the strict reading: silence is a failure.
        let outcome = match self.judge(outcome) {
            Judgement::Record(o) => o,
            Judgement::Probe => Outcome::Failure,
        };
        let before = self.state;
        // Any verdict ends the probe in flight (a late outcome of an older request too: the
        // next request then probes again, which errs on the side of finding out sooner).
        self.probe_since = None;
        // Apply the cool-down first: an outcome that arrives after it is a half-open probe,
        // and only probes count towards closing again.
        let current = self.state(now, cfg);
        if current != self.state {
            self.state = current;
            self.failures.clear();
            self.consecutive_successes = 0;
        }
        match outcome {
            Outcome::Neutral => {}
            Outcome::Success => {
                self.last_success = Some(now);
                self.failures.clear();
                self.consecutive_successes = self.consecutive_successes.saturating_add(1);
                if self.state == BreakerState::HalfOpen && self.consecutive_successes >= cfg.success_threshold {
                    self.close();
                }
            }
            Outcome::Failure | Outcome::NoAnswerSince(_) => {
                self.consecutive_successes = 0;
                let trips = match self.state {
                    BreakerState::Closed => self.count_failure(now, cfg) >= cfg.failure_threshold,
                    BreakerState::HalfOpen => true,
                    // A late failure from a request that started before opening: keep the
                    // cool-down running from the first opening.
                    BreakerState::Open => false,
                };
                if trips {
                    self.state = BreakerState::Open;
                    self.opened_at = Some(now);
                    // Re-opening from half-open is a change even though it started open.
                    return Some(BreakerState::Open);
                }
            }
        }
        (before != self.state).then_some(self.state)
    }

    /// Adds a failure at `now` to the run, forgets those outside the window, and returns how
    /// many count.
    fn count_failure(&mut self, now: Instant, cfg: &BreakerConfig) -> u32 {
        self.failures.push_back(now);
        while self.failures.front().is_some_and(|t| now.saturating_duration_since(*t) > cfg.window) {
            self.failures.pop_front();
        }
        while self.failures.len() > cfg.failure_threshold.max(1) as usize {
            self.failures.pop_front();
        }
        u32::try_from(self.failures.len()).unwrap_or(u32::MAX)
    }

    /// Failures that count now towards opening (for metrics and `/workers`).
    pub fn failures_in_window(&self, now: Instant, cfg: &BreakerConfig) -> usize {
        self.failures.iter().filter(|t| now.saturating_duration_since(**t) <= cfg.window).count()
    }

    fn close(&mut self) {
        *self = Breaker { last_success: self.last_success, ..Breaker::default() };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> BreakerConfig {
        BreakerConfig {
            enabled: true,
            failure_threshold: 3,
            success_threshold: 2,
            cooldown: Duration::from_secs(30),
            probe_timeout: Duration::from_secs(60),
            window: Duration::from_secs(120),
        }
    }

    #[test]
    fn only_failures_within_the_window_count() {
        let (c, t0) = (BreakerConfig { window: Duration::from_secs(10), ..cfg() }, Instant::now());
        let s = Duration::from_secs(1);
        let mut b = Breaker::default();
        // Three failures, but spread over more than the window: never three within it.
        assert_eq!(b.record(Outcome::Failure, t0, &c), None);
        assert_eq!(b.record(Outcome::Failure, t0 + 6 * s, &c), None);
        assert_eq!(b.record(Outcome::Failure, t0 + 12 * s, &c), None, "the first failure is 12 s old: outside the window");
        assert_eq!(b.failures_in_window(t0 + 12 * s, &c), 2);
        // The third within 10 s of the second opens it.
        assert_eq!(b.record(Outcome::Failure, t0 + 15 * s, &c), Some(BreakerState::Open));
        // At the window's edge (exactly 10 s) a failure still counts.
        let mut b = Breaker::default();
        b.record(Outcome::Failure, t0, &c);
        b.record(Outcome::Failure, t0 + 5 * s, &c);
        assert_eq!(b.record(Outcome::Failure, t0 + 10 * s, &c), Some(BreakerState::Open));
        // A success still resets the run, window or not.
        let mut b = Breaker::default();
        b.record(Outcome::Failure, t0, &c);
        b.record(Outcome::Failure, t0 + s, &c);
        b.record(Outcome::Success, t0 + 2 * s, &c);
        assert_eq!(b.record(Outcome::Failure, t0 + 3 * s, &c), None);
        assert_eq!(b.failures_in_window(t0 + 3 * s, &c), 1);
    }

    #[test]
    fn opens_after_consecutive_failures_only() {
        let (c, t0) = (cfg(), Instant::now());
        let mut b = Breaker::default();
        assert_eq!(b.record(Outcome::Failure, t0, &c), None);
        assert_eq!(b.record(Outcome::Failure, t0, &c), None);
        assert_eq!(b.record(Outcome::Success, t0, &c), None, "a success resets the count");
        assert_eq!(b.record(Outcome::Failure, t0, &c), None);
        assert_eq!(b.record(Outcome::Failure, t0, &c), None);
        assert_eq!(b.record(Outcome::Failure, t0, &c), Some(BreakerState::Open));
        assert!(!b.allows(t0, &c));
    }

    #[test]
    fn neutral_outcomes_count_as_neither() {
        let (c, t0) = (cfg(), Instant::now());
        let mut b = Breaker::default();
        b.record(Outcome::Failure, t0, &c);
        b.record(Outcome::Failure, t0, &c);
        for _ in 0..10 {
            assert_eq!(b.record(Outcome::from_status(429), t0, &c), None);
        }
        assert_eq!(b.record(Outcome::Failure, t0, &c), Some(BreakerState::Open), "429s did not reset the count");
    }

    #[test]
    fn half_open_after_cooldown_then_closes_or_reopens() {
        let (c, t0) = (cfg(), Instant::now());
        let mut b = Breaker::default();
        for _ in 0..3 {
            b.record(Outcome::Failure, t0, &c);
        }
        assert_eq!(b.half_open_at(&c), Some(t0 + c.cooldown));
        assert_eq!(b.state(t0 + Duration::from_secs(29), &c), BreakerState::Open);
        let t1 = t0 + Duration::from_secs(30);
        assert_eq!(b.state(t1, &c), BreakerState::HalfOpen);
        assert!(b.allows(t1, &c));
        // A failing probe re-opens and restarts the cool-down.
        assert_eq!(b.record(Outcome::Failure, t1, &c), Some(BreakerState::Open));
        assert_eq!(b.state(t1 + Duration::from_secs(29), &c), BreakerState::Open);
        let t2 = t1 + Duration::from_secs(30);
        assert_eq!(b.record(Outcome::Success, t2, &c), Some(BreakerState::HalfOpen));
        assert_eq!(b.record(Outcome::Success, t2, &c), Some(BreakerState::Closed));
        assert_eq!(Breaker { last_success: None, ..b }, Breaker::default());
    }

    #[test]
    fn no_answer_fails_only_a_worker_that_answered_nobody_since() {
        let (c, t0) = (cfg(), Instant::now());
        let s = Duration::from_secs(1);
        // Silent, and nothing answered since the requests were sent: a stuck worker.
        let mut b = Breaker::default();
        b.record(Outcome::Success, t0, &c);
        assert_eq!(b.record(Outcome::NoAnswerSince(t0 + s), t0 + 3 * s, &c), None);
        assert_eq!(b.record(Outcome::NoAnswerSince(t0 + s), t0 + 3 * s, &c), None);
        assert_eq!(b.record(Outcome::NoAnswerSince(t0 + s), t0 + 3 * s, &c), Some(BreakerState::Open));
        // Silent, but the worker answered others meanwhile: the requests were long, not lost.
        let mut b = Breaker::default();
        b.record(Outcome::Success, t0 + 2 * s, &c);
        for _ in 0..10 {
            assert_eq!(b.record(Outcome::NoAnswerSince(t0 + s), t0 + 3 * s, &c), None);
        }
        assert!(b.allows(t0 + 3 * s, &c));
        assert!(b.failures.is_empty());
    }

    #[test]
    fn an_encode_legs_timeout_is_a_failure_not_a_question() {
        let t0 = Instant::now();
        let encode = GatewayError::timeout("no answer").on(Leg::Encode);
        assert_eq!(Outcome::of_attempt(&encode, t0), Outcome::Failure);
        let prefill = GatewayError::timeout("no answer").on(Leg::Prefill);
        assert_eq!(Outcome::of_attempt(&prefill, t0), Outcome::NoAnswerSince(t0));
    }

    #[test]
    fn silence_from_a_worker_that_answered_nobody_since_asks_for_a_probe() {
        let (c, t0) = (cfg(), Instant::now());
        let s = Duration::from_secs(1);
        let mut b = Breaker::default();
        assert_eq!(b.judge(Outcome::NoAnswerSince(t0)), Judgement::Probe, "never answered anything");
        b.record(Outcome::Success, t0, &c);
        assert_eq!(b.judge(Outcome::NoAnswerSince(t0 + s)), Judgement::Probe);
        assert_eq!(b.judge(Outcome::NoAnswerSince(t0)), Judgement::Record(Outcome::Neutral));
        assert_eq!(b.judge(Outcome::Failure), Judgement::Record(Outcome::Failure));
        assert_eq!(b.judge(Outcome::Success), Judgement::Record(Outcome::Success));
        assert_eq!(Outcome::of_probe(true), Outcome::Neutral);
        assert_eq!(Outcome::of_probe(false), Outcome::Failure);
    }

    #[test]
    fn half_open_admits_one_probe_at_a_time() {
        let (c, t0) = (cfg(), Instant::now());
        let s = Duration::from_secs(1);
        let mut b = Breaker::default();
        assert!(b.try_admit(t0, &c) && b.try_admit(t0, &c), "closed admits everyone");
        for _ in 0..3 {
            b.record(Outcome::Failure, t0, &c);
        }
        assert!(!b.try_admit(t0 + s, &c), "open admits nobody");
        let t1 = t0 + c.cooldown;
        assert!(b.try_admit(t1, &c), "the first request after the cool-down probes");
        assert!(b.probing(t1, &c));
        for k in 1..10 {
            assert!(!b.try_admit(t1 + k * s, &c), "only one probe in flight");
        }
        // Its success frees the slot for the next probe; two successes close.
        assert_eq!(b.record(Outcome::Success, t1 + 10 * s, &c), Some(BreakerState::HalfOpen));
        assert!(!b.probing(t1 + 10 * s, &c));
        assert!(b.try_admit(t1 + 10 * s, &c) && !b.try_admit(t1 + 10 * s, &c));
        assert_eq!(b.record(Outcome::Success, t1 + 11 * s, &c), Some(BreakerState::Closed));
        assert!(b.try_admit(t1 + 11 * s, &c) && b.try_admit(t1 + 11 * s, &c));
    }

    #[test]
    fn a_failed_probe_reopens_and_a_lost_one_frees_its_slot() {
        let (c, t0) = (cfg(), Instant::now());
        let mut b = Breaker::default();
        for _ in 0..3 {
            b.record(Outcome::Failure, t0, &c);
        }
        let t1 = t0 + c.cooldown;
        assert!(b.try_admit(t1, &c));
        assert_eq!(b.record(Outcome::Failure, t1, &c), Some(BreakerState::Open));
        assert!(!b.try_admit(t1, &c), "open again, for a whole cool-down");
        let t2 = t1 + c.cooldown;
        assert!(b.try_admit(t2, &c));
        // The probe's client went away and no verdict ever comes: the slot is freed by time.
        assert_eq!(b.probe_expires_at(&c), Some(t2 + c.probe_timeout));
        assert!(!b.try_admit(t2 + c.probe_timeout - Duration::from_secs(1), &c));
        assert!(b.try_admit(t2 + c.probe_timeout, &c), "a new probe after the timeout");
        // A neutral outcome (429, cancel) frees the slot without a verdict.
        assert!(b.end_probe());
        assert_eq!(b.state(t2 + c.probe_timeout, &c), BreakerState::HalfOpen);
        assert!(b.try_admit(t2 + c.probe_timeout, &c));
    }

    #[test]
    fn disabled_breaker_never_opens() {
        let c = BreakerConfig { enabled: false, ..cfg() };
        let t0 = Instant::now();
        let mut b = Breaker::default();
        for _ in 0..100 {
            assert_eq!(b.record(Outcome::Failure, t0, &c), None);
        }
        assert!(b.allows(t0, &c));
    }

    #[test]
    fn outcomes_from_errors() {
        use crate::error::Leg;
        assert_eq!(Outcome::from_error(&GatewayError::unreachable(Leg::Prefill, "x")), Outcome::Failure);
        assert_eq!(Outcome::from_error(&GatewayError::worker_status(Leg::Decode, 503, None)), Outcome::Failure);
        assert_eq!(Outcome::from_error(&GatewayError::worker_status(Leg::Decode, 429, None)), Outcome::Neutral);
        assert_eq!(Outcome::from_error(&GatewayError::worker_status(Leg::Decode, 400, None)), Outcome::Neutral);
        assert_eq!(Outcome::from_error(&GatewayError::timeout("deadline")), Outcome::Neutral);
        assert_eq!(Outcome::from_error(&GatewayError::timeout("slow").on(Leg::Prefill)), Outcome::Failure);
        assert_eq!(Outcome::from_error(&GatewayError::timeout_while_answering(Leg::Decode, "long")), Outcome::Neutral);
        let t = Instant::now();
        assert_eq!(Outcome::of_attempt(&GatewayError::timeout("slow").on(Leg::Decode), t), Outcome::NoAnswerSince(t));
        assert_eq!(Outcome::of_attempt(&GatewayError::timeout_while_answering(Leg::Decode, "long"), t), Outcome::Neutral);
        assert_eq!(Outcome::of_attempt(&GatewayError::unreachable(Leg::Decode, "x"), t), Outcome::Failure);
        assert_eq!(Outcome::from_error(&GatewayError::bad_worker_response(Leg::Decode, "html")), Outcome::Failure);
        assert_eq!(Outcome::from_error(&GatewayError::stream_truncated(Leg::Regular)), Outcome::Failure);
    }
}
