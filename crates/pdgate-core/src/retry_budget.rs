//! A retry budget shared by all requests, so that retries cannot multiply an overload.
//!
//! Per-request limits (`--retry-max-retries`) bound one request; when every worker fails, every
//! request still retries, and the fleet sees up to (1 + max retries) times the offered load just
//! when it can least take it. The budget bounds retries across requests instead: over a sliding
//! window, retries may be at most `ratio` times the requests that started in it, plus a floor
//! of `min_per_sec` per second so that a quiet gateway can still retry. This is the idea of
//! tower's `retry::budget::TpsBudget` (ttl, min_per_sec, retry_percent); the implementation is
//! our own: plain counters in time slots, with the clock passed in (`now`) so it is tested on a
//! fake clock.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use crate::config::GatewayConfig;

/// Slots per window: the window slides in steps of window / SLOTS.
const SLOTS: u32 = 10;

#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RetryBudgetConfig {
    /// Retries allowed per request started in the window (0.2: one retry per five requests).
    pub ratio: f64,
    /// Retries allowed per second of window regardless of traffic.
    pub min_per_sec: u32,
    /// How far back requests and retries are counted.
    pub window: Duration,
}

impl Default for RetryBudgetConfig {
    fn default() -> Self {
        RetryBudgetConfig { ratio: 0.2, min_per_sec: 10, window: Duration::from_secs(10) }
    }
}

impl RetryBudgetConfig {
    pub fn from_config(c: &GatewayConfig) -> Self {
        RetryBudgetConfig { ratio: c.retry_budget_ratio.max(0.0), min_per_sec: c.retry_budget_min_per_sec, window: Duration::from_secs(c.retry_budget_window_secs.max(1)) }
    }
}

#[derive(Clone, Copy, Debug)]
struct Slot {
    start: Instant,
    requests: u64,
    retries: u64,
}

/// The budget's state. Plain data: the gateway keeps one behind a mutex.
#[derive(Clone, Debug)]
pub struct RetryBudget {
    cfg: RetryBudgetConfig,
    slots: VecDeque<Slot>,
}

impl RetryBudget {
    pub fn new(cfg: RetryBudgetConfig) -> Self {
        RetryBudget { cfg, slots: VecDeque::with_capacity(SLOTS as usize + 1) }
    }

    /// A request started at `now` (its first attempt): it earns `ratio` retries.
    pub fn deposit(&mut self, now: Instant) {
        self.slot(now).requests += 1;
    }

    /// Asks for one retry at `now`: true (and counted) when the window's retries stay within
    /// the budget, false when the retry must not happen.
    pub fn try_withdraw(&mut self, now: Instant) -> bool {
        let (requests, retries) = self.totals(now);
        if retries + 1 > self.allowed(requests) {
            return false;
        }
        self.slot(now).retries += 1;
        true
    }

    /// Retries allowed in one window with `requests` started in it.
    fn allowed(&self, requests: u64) -> u64 {
        let floor = u64::from(self.cfg.min_per_sec).saturating_mul(self.cfg.window.as_secs().max(1));
        // Truncation is intended: a fraction of a retry is not a retry.
        floor.saturating_add((self.cfg.ratio * requests as f64) as u64)
    }

    /// (requests, retries) counted in the window ending at `now`.
    fn totals(&mut self, now: Instant) -> (u64, u64) {
        self.expire(now);
        self.slots.iter().fold((0, 0), |(q, r), s| (q + s.requests, r + s.retries))
    }

    fn expire(&mut self, now: Instant) {
        let window = self.cfg.window;
        while self.slots.front().is_some_and(|s| now.saturating_duration_since(s.start) >= window) {
            self.slots.pop_front();
        }
    }

    fn slot(&mut self, now: Instant) -> &mut Slot {
        self.expire(now);
        let step = self.cfg.window / SLOTS;
        let fresh = match self.slots.back() {
            Some(s) => now.saturating_duration_since(s.start) >= step,
            None => true,
        };
        if fresh {
            self.slots.push_back(Slot { start: now, requests: 0, retries: 0 });
        }
        let last = self.slots.len() - 1;
        &mut self.slots[last]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn budget(ratio: f64, min_per_sec: u32) -> RetryBudget {
        RetryBudget::new(RetryBudgetConfig { ratio, min_per_sec, window: Duration::from_secs(10) })
    }

    fn withdrawals(b: &mut RetryBudget, now: Instant, asked: usize) -> usize {
        (0..asked).filter(|_| b.try_withdraw(now)).count()
    }

    #[test]
    fn retries_are_a_fraction_of_recent_requests() {
        let t0 = Instant::now();
        let mut b = budget(0.2, 0);
        for _ in 0..100 {
            b.deposit(t0);
        }
        assert_eq!(withdrawals(&mut b, t0, 1000), 20, "20% of 100 requests");
        for _ in 0..10 {
            b.deposit(t0);
        }
        assert_eq!(withdrawals(&mut b, t0, 1000), 2, "each new request earns its share");
    }

    #[test]
    fn a_floor_per_second_lets_a_quiet_gateway_retry() {
        let t0 = Instant::now();
        let mut b = budget(0.2, 1);
        assert_eq!(withdrawals(&mut b, t0, 100), 10, "1/s over a 10 s window, no requests needed");
    }

    #[test]
    fn the_window_slides() {
        let t0 = Instant::now();
        let mut b = budget(0.5, 0);
        for _ in 0..10 {
            b.deposit(t0);
        }
        assert_eq!(withdrawals(&mut b, t0, 100), 5);
        // Still in the window: nothing new to spend.
        assert_eq!(withdrawals(&mut b, t0 + Duration::from_secs(9), 100), 0);
        // The requests and the retries of t0 have left the window together.
        let t1 = t0 + Duration::from_secs(10);
        assert_eq!(withdrawals(&mut b, t1, 100), 0, "no requests in the window, no floor");
        for _ in 0..4 {
            b.deposit(t1);
        }
        assert_eq!(withdrawals(&mut b, t1, 100), 2);
    }

    #[test]
    fn an_overload_cannot_multiply_the_load() {
        // Every attempt fails and every request would retry twice: the budget keeps the
        // retries at ratio x requests (plus the floor) whatever the per-request limit says.
        let t0 = Instant::now();
        let mut b = budget(0.1, 1);
        let (mut sent, mut retried) = (0u64, 0u64);
        for i in 0..10_000u64 {
            let now = t0 + Duration::from_millis(i); // 1000 requests/s for 10 s
            b.deposit(now);
            sent += 1;
            for _ in 0..2 {
                if b.try_withdraw(now) {
                    retried += 1;
                }
            }
        }
        assert!(retried <= sent / 10 + 10, "retried {retried} of {sent}");
        assert!(retried >= sent / 10 - 10, "the budget is spent, not hoarded: {retried}");
    }
}
