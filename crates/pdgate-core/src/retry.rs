//! Retry decisions: pure functions of the error, the attempt count and the time left.
//!
//! The budget is counted as SMG counts it: `max_attempts` is every attempt, the first one
//! included (`--retry-max-retries 3` sends at most three, `--disable-retries` one). The backoff
//! before attempt `n + 1` is `initial * multiplier^(n-1)`, capped at `max_backoff`, times a
//! uniform factor in `[1 - jitter, 1 + jitter]`, capped again.

use std::time::Duration;

use rand::Rng;

use crate::config::GatewayConfig;
use crate::error::GatewayError;

#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RetryPolicy {
    /// Attempts in all, the first one included (at least 1).
    pub max_attempts: u32,
    pub initial_backoff: Duration,
    pub max_backoff: Duration,
    /// Growth of the backoff per attempt (at least 1.0).
    pub multiplier: f64,
    /// Spread of each backoff, 0.0-1.0.
    pub jitter: f64,
}

impl RetryPolicy {
    pub fn from_config(c: &GatewayConfig) -> Self {
        RetryPolicy {
            max_attempts: c.max_attempts(),
            initial_backoff: Duration::from_millis(c.retry_initial_backoff_ms),
            max_backoff: Duration::from_millis(c.retry_max_backoff_ms),
            multiplier: c.retry_backoff_multiplier.max(1.0),
            jitter: c.retry_jitter_factor.clamp(0.0, 1.0),
        }
    }

    /// Whether attempt number `attempt` (1-based) that failed with `err` may be followed by
    /// another. Never once a byte reached the client, and never when the backoff alone would
    /// outlast the deadline.
    pub fn should_retry(&self, err: &GatewayError, attempt: u32, bytes_sent: bool, time_left: Duration) -> bool {
        !bytes_sent && err.retryable() && attempt < self.max_attempts && time_left > self.longest_backoff(attempt)
    }

    /// The backoff before attempt `attempt + 1`, without jitter, capped.
    fn base_backoff(&self, attempt: u32) -> Duration {
        let exp = attempt.saturating_sub(1).min(64) as i32;
        let secs = self.initial_backoff.as_secs_f64() * self.multiplier.powi(exp);
        Duration::try_from_secs_f64(secs).unwrap_or(Duration::MAX).min(self.max_backoff)
    }

    /// The longest backoff jitter can make before attempt `attempt + 1`.
    fn longest_backoff(&self, attempt: u32) -> Duration {
        self.base_backoff(attempt).mul_f64(1.0 + self.jitter).min(self.max_backoff)
    }

    /// The jittered backoff before attempt `attempt + 1`.
    pub fn backoff<R: Rng + ?Sized>(&self, attempt: u32, rng: &mut R) -> Duration {
        let base = self.base_backoff(attempt);
        if base.is_zero() || self.jitter == 0.0 {
            return base;
        }
        let factor = rng.random_range((1.0 - self.jitter)..=(1.0 + self.jitter));
        base.mul_f64(factor).min(self.max_backoff)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Leg;
    use rand::{rngs::StdRng, SeedableRng};

    fn policy() -> RetryPolicy {
        RetryPolicy { max_attempts: 3, initial_backoff: Duration::from_millis(50), max_backoff: Duration::from_millis(300), multiplier: 2.0, jitter: 0.2 }
    }

    #[test]
    fn max_attempts_counts_the_first_attempt_as_smg_does() {
        let err = GatewayError::worker_status(Leg::Prefill, 503, None);
        let left = Duration::from_secs(10);
        // Three attempts: after the first and the second failure a retry, after the third none.
        assert!(policy().should_retry(&err, 1, false, left));
        assert!(policy().should_retry(&err, 2, false, left));
        assert!(!policy().should_retry(&err, 3, false, left));
        let once = RetryPolicy { max_attempts: 1, ..policy() };
        assert!(!once.should_retry(&err, 1, false, left), "one attempt: no retry");
    }

    #[test]
    fn the_config_gives_smg_counts() {
        let attempts = |args: &[&str]| {
            let mut argv = vec!["pdgate"];
            argv.extend_from_slice(args);
            RetryPolicy::from_config(&GatewayConfig::parse_cli(argv).unwrap()).max_attempts
        };
        assert_eq!(attempts(&["--retry-max-retries", "3"]), 3);
        assert_eq!(attempts(&["--retry-max-retries", "0"]), 1);
        assert_eq!(attempts(&["--retry-max-retries", "5", "--disable-retries"]), 1);
        assert_eq!(attempts(&[]), 3);
    }

    #[test]
    fn never_retries_after_bytes_or_client_errors_or_near_deadline() {
        let err = GatewayError::unreachable(Leg::Decode, "reset");
        assert!(!policy().should_retry(&err, 1, true, Duration::from_secs(10)));
        assert!(!policy().should_retry(&err, 1, false, Duration::from_millis(10)));
        let bad = GatewayError::worker_status(Leg::Decode, 422, None);
        assert!(!policy().should_retry(&bad, 1, false, Duration::from_secs(10)));
    }

    #[test]
    fn backoff_grows_by_the_multiplier_within_the_jitter_and_the_cap() {
        let mut rng = StdRng::seed_from_u64(7);
        let p = RetryPolicy { multiplier: 1.5, max_backoff: Duration::from_secs(30), ..policy() };
        for (attempt, base_ms) in [(1, 50.0), (2, 75.0), (3, 112.5), (4, 168.75)] {
            for _ in 0..50 {
                let d = p.backoff(attempt, &mut rng).as_secs_f64() * 1000.0;
                assert!((base_ms * 0.8 - 1e-6..=base_ms * 1.2 + 1e-6).contains(&d), "attempt {attempt}: {d} ms");
            }
        }
        let samples: Vec<_> = (0..200).map(|_| p.backoff(1, &mut rng)).collect();
        let distinct: std::collections::HashSet<_> = samples.iter().collect();
        assert!(distinct.len() > 100, "backoff should be jittered");
        let capped = policy();
        assert!((0..200).all(|_| capped.backoff(10, &mut rng) <= capped.max_backoff));
        let exact = RetryPolicy { jitter: 0.0, ..policy() };
        assert_eq!(exact.backoff(3, &mut rng), Duration::from_millis(200));
    }
}
