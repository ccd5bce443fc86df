//! Latency objectives and goodput: the figures of one finished request, how they are judged
//! against the time-to-first-token (TTFT) and time-per-output-token (TPOT) objectives, and the
//! rate of requests that met both over a sliding window.
//!
//! Pure: the gateway measures (arrival, first content token, end, usage) and passes the
//! figures in; time comes in as whole seconds from any epoch the caller keeps.

use std::time::Duration;

/// `x-slo-ttft-ms`, then llm-d's spelling: the first one present wins.
pub const TTFT_HEADERS: [&str; 2] = ["x-slo-ttft-ms", "x-llm-d-slo-ttft-ms"];
/// `x-slo-tpot-ms`, then llm-d's spelling.
pub const TPOT_HEADERS: [&str; 2] = ["x-slo-tpot-ms", "x-llm-d-slo-tpot-ms"];

/// The TTFT objective goodput is reported against when nobody set one (`--slo-ttft-ms`
/// unset, no header): a reporting objective only, never a reason to refuse a request.
pub const REPORTING_TTFT_MS: f64 = 1000.0;
/// The TPOT objective goodput is reported against when nobody set one.
pub const REPORTING_TPOT_MS: f64 = 50.0;

/// The objectives one request is judged by, in milliseconds.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SloTargets {
    pub ttft_ms: f64,
    pub tpot_ms: f64,
    /// Someone chose `ttft_ms` (the operator's `--slo-ttft-ms` or this request's header), so
    /// early rejection may act on it; false for [`REPORTING_TTFT_MS`], which only reports.
    pub ttft_set: bool,
}

impl SloTargets {
    /// Objectives that were chosen (tests, the simulator): early rejection may act on them.
    pub const fn set(ttft_ms: f64, tpot_ms: f64) -> SloTargets {
        SloTargets { ttft_ms, tpot_ms, ttft_set: true }
    }

    /// The reporting objectives, which nothing is refused for.
    pub const fn reporting() -> SloTargets {
        SloTargets { ttft_ms: REPORTING_TTFT_MS, tpot_ms: REPORTING_TPOT_MS, ttft_set: false }
    }
}

/// A per-request objective header that is not a positive number of milliseconds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BadSloHeader {
    pub header: &'static str,
    pub message: String,
}

impl SloTargets {
    /// The defaults overridden by the request's headers (`header` looks one up by its
    /// lower-case name). A present but malformed header is refused, naming it: a client that
    /// asked for an objective must not be judged silently by another.
    pub fn with_headers<'a>(self, header: impl Fn(&str) -> Option<&'a [u8]>) -> Result<SloTargets, BadSloHeader> {
        let pick = |names: [&'static str; 2], default: f64| -> Result<f64, BadSloHeader> {
            let Some((name, raw)) = names.iter().find_map(|n| header(n).map(|v| (*n, v))) else { return Ok(default) };
            parse_ms(raw)
                .ok_or_else(|| BadSloHeader { header: name, message: format!("header '{name}' must be a positive number of milliseconds, not {:?}", String::from_utf8_lossy(raw)) })
        };
        let ttft_header = TTFT_HEADERS.iter().any(|n| header(n).is_some());
        Ok(SloTargets { ttft_ms: pick(TTFT_HEADERS, self.ttft_ms)?, tpot_ms: pick(TPOT_HEADERS, self.tpot_ms)?, ttft_set: self.ttft_set || ttft_header })
    }
}

/// A positive, finite number of milliseconds (integer or decimal), at most a day.
fn parse_ms(raw: &[u8]) -> Option<f64> {
    let v: f64 = std::str::from_utf8(raw).ok()?.trim().parse().ok()?;
    (v.is_finite() && v > 0.0 && v <= 86_400_000.0).then_some(v)
}

/// What the gateway measured of one finished request: the struct the SLO judgement, the
/// metrics, the request log and (later) the placement cost model read.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct RequestFigures {
    /// Arrival at the gateway → end of the response (last byte relayed, or the error).
    pub e2e: Duration,
    /// Arrival → first content token relayed to the client. A non-streamed answer delivers
    /// its first token with the whole answer, so this is `e2e` there. `None` when no content
    /// reached the client (an error before commit, an empty stream).
    pub ttft: Option<Duration>,
    /// The answer was streamed (TPOT is observable only then).
    pub streamed: bool,
    pub prompt_tokens: Option<u64>,
    pub output_tokens: Option<u64>,
    pub cached_tokens: Option<u64>,
    /// The request did not end with a complete answer (an error status, a stream cut short,
    /// the client gone).
    pub failed: bool,
}

/// (E2E − TTFT) / max(output tokens − 1, 1): the mean gap between output tokens after the first.
pub fn tpot(e2e: Duration, ttft: Duration, output_tokens: u64) -> Duration {
    let steps = output_tokens.saturating_sub(1).max(1);
    e2e.saturating_sub(ttft) / u32::try_from(steps).unwrap_or(u32::MAX)
}

impl RequestFigures {
    /// TPOT of a streamed request that delivered content; `None` otherwise (a non-streamed
    /// answer has no observable token gaps at the gateway).
    pub fn tpot(&self) -> Option<Duration> {
        if !self.streamed || self.failed {
            return None;
        }
        Some(tpot(self.e2e, self.ttft?, self.output_tokens.unwrap_or(0)))
    }
}

/// How a request fared against its objectives (`pdgate_slo_requests_total{result}`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SloResult {
    Met,
    TtftMissed,
    TpotMissed,
    Failed,
}

impl SloResult {
    pub const ALL: [SloResult; 4] = [SloResult::Met, SloResult::TtftMissed, SloResult::TpotMissed, SloResult::Failed];

    pub fn as_str(self) -> &'static str {
        match self {
            SloResult::Met => "met",
            SloResult::TtftMissed => "ttft_missed",
            SloResult::TpotMissed => "tpot_missed",
            SloResult::Failed => "failed",
        }
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// Judges a finished request. A streamed one meets TTFT and TPOT each (TTFT is checked first:
/// a request late on both counts as `ttft_missed`). A non-streamed one is judged on its E2E
/// against the budget the two objectives give its length, TTFT + TPOT × (output tokens − 1),
/// since the client sees nothing before the end; a miss is a `ttft_missed` (its first token
/// came late).
pub fn classify(f: &RequestFigures, t: &SloTargets) -> SloResult {
    if f.failed {
        return SloResult::Failed;
    }
    if !f.streamed {
        let steps = f.output_tokens.unwrap_or(1).saturating_sub(1) as f64;
        return if ms(f.e2e) <= t.ttft_ms + t.tpot_ms * steps { SloResult::Met } else { SloResult::TtftMissed };
    }
    let ttft = f.ttft.unwrap_or(f.e2e);
    if ms(ttft) > t.ttft_ms {
        return SloResult::TtftMissed;
    }
    match f.tpot() {
        Some(tpot) if ms(tpot) > t.tpot_ms => SloResult::TpotMissed,
        _ => SloResult::Met,
    }
}

/// Requests that met their objectives per second, over the last `window` seconds: a ring of
/// per-second buckets, so memory is fixed and old seconds fall out without a sweep.
#[derive(Clone, Debug)]
pub struct GoodputWindow {
    /// (second, count) per slot; a slot holding an older second is stale.
    buckets: Vec<(u64, u64)>,
}

impl GoodputWindow {
    /// A window of `secs` seconds (at least 1).
    pub fn new(secs: u64) -> Self {
        let n = usize::try_from(secs.max(1)).unwrap_or(usize::MAX).min(86_400);
        GoodputWindow { buckets: vec![(u64::MAX, 0); n] }
    }

    pub fn secs(&self) -> u64 {
        self.buckets.len() as u64
    }

    /// One request that met its objectives, finished at second `now`.
    pub fn record(&mut self, now: u64) {
        let n = self.secs();
        let slot = &mut self.buckets[(now % n) as usize];
        if slot.0 != now {
            *slot = (now, 0);
        }
        slot.1 += 1;
    }

    /// Met requests per second over the seconds (now − window, now].
    pub fn rate(&self, now: u64) -> f64 {
        let n = self.secs();
        let live = |s: u64| s != u64::MAX && s <= now && now - s < n;
        let met: u64 = self.buckets.iter().filter(|(s, _)| live(*s)).map(|(_, c)| c).sum();
        met as f64 / n as f64
    }
}

#[cfg(test)]
#[path = "slo_tests.rs"]
mod tests;
