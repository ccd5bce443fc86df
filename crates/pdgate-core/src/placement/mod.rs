//! Placement: where a request runs (a prefill/decode pair, one colocated worker, or nowhere:
//! rejected early), decided by a cost model learned online.
//!
//! - `cost_model`: prefill, transfer and decode-step costs, fitted from observations, starting
//!   from configured priors;
//! - `decide`:     the decision, a pure function of the request's size, the load on each path,
//!   the SLOs and the model (the gateway and `pdgate simulate` call the same one);
//! - `failover`:   after a failure before commit, retry, recompute colocated or fail, by the
//!   remaining deadline.
//!
//! No IO and no clock reads: time comes in as milliseconds.

mod cost_model;
mod decide;
mod failover;

pub use cost_model::{CostModel, CostPriors, Fitted, LinearFit, MeanFit, GIB, PRIOR_FLOOR};
pub use decide::{
    decide, local_stall_tpot_ms, local_ttft_ms, path_utilisation, predict, priority_slack, remote_ttft_ms, Decision, LocalPath, Placement, PlacementInput, PlacementMode,
    Predicted, RemotePath, REASONS, TIE_BREAK_MARGIN,
};
pub use failover::{recover, FailureInput, Recovery};

#[cfg(test)]
mod tests;
