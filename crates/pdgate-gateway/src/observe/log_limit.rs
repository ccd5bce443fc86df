//! Bounded logs: a client (or a broken worker) must not be able to fill the disk by repeating
//! one bad request. Each warning line is one line with its values truncated, and identical
//! warnings (same message, code and truncated error) are let through at most `burst` times per
//! `interval`; the next one let through says how many were left out.

use std::borrow::Cow;
use std::collections::hash_map::DefaultHasher;
use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use pdgate_core::GatewayError;

use crate::observe::metrics::Metrics;

/// Longest value (error text, route record) written into one warning line, in characters.
pub const MAX_VALUE_CHARS: usize = 200;
/// Distinct warnings tracked at once; beyond it the oldest windows are forgotten.
const MAX_KEYS: usize = 1024;

/// At most `max` characters of `s`, with a note of what was cut.
pub fn truncate(s: &str, max: usize) -> Cow<'_, str> {
    match s.char_indices().nth(max) {
        None => Cow::Borrowed(s),
        Some((i, _)) => Cow::Owned(format!("{}… ({} bytes in all)", &s[..i], s.len())),
    }
}

#[derive(Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Write the line; `suppressed` identical lines were left out before it.
    Log {
        suppressed: u64,
    },
    Suppress,
}

struct Window {
    start: Instant,
    count: u32,
    suppressed: u64,
}

pub struct LogLimiter {
    interval: Duration,
    burst: u32,
    windows: Mutex<HashMap<u64, Window>>,
}

impl Default for LogLimiter {
    /// Ten identical warnings per ten seconds.
    fn default() -> Self {
        Self::new(10, Duration::from_secs(10))
    }
}

impl LogLimiter {
    pub fn new(burst: u32, interval: Duration) -> Self {
        LogLimiter { interval, burst: burst.max(1), windows: Mutex::new(HashMap::new()) }
    }

    /// Whether a warning with identity `key` may be written at `now`.
    pub fn check(&self, key: &str, now: Instant) -> Verdict {
        let mut h = DefaultHasher::new();
        key.hash(&mut h);
        let id = h.finish();
        let mut windows = self.windows.lock().unwrap_or_else(|p| p.into_inner());
        if windows.len() >= MAX_KEYS && !windows.contains_key(&id) {
            let interval = self.interval;
            windows.retain(|_, w| now.saturating_duration_since(w.start) < interval);
            if windows.len() >= MAX_KEYS {
                windows.clear();
            }
        }
        let w = windows.entry(id).or_insert(Window { start: now, count: 0, suppressed: 0 });
        if now.saturating_duration_since(w.start) >= self.interval {
            w.start = now;
            w.count = 0;
        }
        if w.count < self.burst {
            w.count += 1;
            Verdict::Log { suppressed: std::mem::take(&mut w.suppressed) }
        } else {
            w.suppressed += 1;
            Verdict::Suppress
        }
    }
}

/// The one warning line of a failed request (or of a stream cut after bytes went out): the
/// request id, the error code, the error and the route record truncated, rate-limited per
/// identical message. Left-out lines are counted in `pdgate_log_lines_suppressed_total`.
pub fn warn_request(log: &LogLimiter, metrics: &Metrics, request_id: Option<&str>, what: &'static str, err: &GatewayError, route: Option<&str>) {
    let code = err.code();
    let error = truncate(&err.message, MAX_VALUE_CHARS);
    let key = format!("{what}\u{0}{code}\u{0}{error}");
    match log.check(&key, Instant::now()) {
        Verdict::Suppress => metrics.edge.log_suppressed.inc(),
        Verdict::Log { suppressed } => {
            let request_id = truncate(request_id.unwrap_or("-"), MAX_VALUE_CHARS);
            let route = truncate(route.unwrap_or(""), MAX_VALUE_CHARS);
            if suppressed > 0 {
                tracing::warn!(request_id = %request_id, code = %code, error = %error, route = %route, suppressed, "{what} (and {suppressed} identical warnings left out)");
            } else {
                tracing::warn!(request_id = %request_id, code = %code, error = %error, route = %route, "{what}");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identical_warnings_are_limited_per_interval_and_the_gap_is_reported() {
        let limiter = LogLimiter::new(3, Duration::from_secs(10));
        let t0 = Instant::now();
        let verdicts: Vec<Verdict> = (0..100).map(|i| limiter.check("same", t0 + Duration::from_millis(i))).collect();
        assert_eq!(verdicts.iter().filter(|v| matches!(v, Verdict::Log { .. })).count(), 3);
        // Another message has its own budget.
        assert_eq!(limiter.check("other", t0), Verdict::Log { suppressed: 0 });
        // The next window lets the message through again and says how many were left out.
        assert_eq!(limiter.check("same", t0 + Duration::from_secs(10)), Verdict::Log { suppressed: 97 });
        assert_eq!(limiter.check("same", t0 + Duration::from_secs(11)), Verdict::Log { suppressed: 0 });
    }

    #[test]
    fn the_table_of_messages_stays_bounded() {
        let limiter = LogLimiter::new(1, Duration::from_secs(10));
        let t0 = Instant::now();
        for i in 0..(3 * MAX_KEYS) {
            limiter.check(&format!("m{i}"), t0);
        }
        assert!(limiter.windows.lock().unwrap().len() <= MAX_KEYS);
    }

    #[test]
    fn long_values_are_cut_on_a_char_boundary() {
        assert_eq!(truncate("short", 10), "short");
        let long = "é".repeat(1000);
        let cut = truncate(&long, MAX_VALUE_CHARS);
        assert!(cut.starts_with(&"é".repeat(MAX_VALUE_CHARS)));
        assert!(cut.ends_with("(2000 bytes in all)"));
        assert!(cut.chars().count() < MAX_VALUE_CHARS + 30);
    }
}
