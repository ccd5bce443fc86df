//! The failure policy: when a prefill or a KV transfer fails before anything reached the
//! client, retry on another pair, recompute colocated, or fail, by the remaining deadline and
//! the predicted cost of each.

use serde::Serialize;

/// What to do after a failure before commit.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Recovery {
    /// A fresh attempt on another prefill/decode pair.
    RetryPair,
    /// A fresh attempt on a colocated target (no KV to move).
    RecomputeColocated,
    /// Answer the error now.
    Fail,
}

impl Recovery {
    pub fn as_str(self) -> &'static str {
        match self {
            Recovery::RetryPair => "retry_pair",
            Recovery::RecomputeColocated => "recompute_colocated",
            Recovery::Fail => "fail",
        }
    }
}

/// What the choice looks at.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct FailureInput {
    /// Time left before the request's deadline, ms.
    pub remaining_ms: f64,
    /// Whether the error allows another attempt at all (retryable, attempts and budget left).
    pub may_retry: bool,
    /// Predicted TTFT of a fresh attempt on another pair, `None` when there is none.
    pub retry_ttft_ms: Option<f64>,
    /// Predicted TTFT of a colocated attempt, `None` when there is no colocated target.
    pub colocated_ttft_ms: Option<f64>,
}

/// The cheaper of the two recoveries that is predicted to finish its first token before the
/// deadline; failing at once when neither is (a retry that cannot make it only adds load).
pub fn recover(input: &FailureInput) -> (Recovery, &'static str) {
    if !input.may_retry {
        return (Recovery::Fail, "not_retryable");
    }
    let fits = |t: &f64| *t <= input.remaining_ms;
    match (input.retry_ttft_ms.filter(fits), input.colocated_ttft_ms.filter(fits)) {
        (Some(r), Some(c)) if c < r => (Recovery::RecomputeColocated, "colocated_cheaper"),
        (Some(_), _) => (Recovery::RetryPair, "retry_fits_deadline"),
        (None, Some(_)) => (Recovery::RecomputeColocated, "only_colocated_fits_deadline"),
        (None, None) if input.retry_ttft_ms.is_none() && input.colocated_ttft_ms.is_none() => (Recovery::Fail, "no_alternative"),
        (None, None) => (Recovery::Fail, "deadline_too_short"),
    }
}
