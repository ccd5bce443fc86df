//! Health as a fact that flips only after enough consecutive observations, so one slow check
//! does not take a worker out and one lucky check does not bring a broken one back.
//!
//! A failed check is either *answered* (a refused connection, a non-2xx, a broken body: the
//! worker or its host said no) or *unanswered* (no answer within the timeout: a busy engine
//! answers health from the same loaded process, docs/fleet.md). A worker taken out by
//! unanswered checks alone, after it had been healthy, is [`HealthState::silent`]: routing may
//! still use it when a whole role is silent (panic routing, `snapshot.rs`).

/// One active check's outcome.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Probe {
    Ok,
    /// Refused, non-2xx, broken body: counts at once.
    Failed,
    /// No answer within the timeout.
    Unanswered,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct HealthState {
    pub healthy: bool,
    /// Whether any check has completed; a worker is not healthy before its first success.
    pub checked: bool,
    /// Healthy at least once since it was added.
    ever_healthy: bool,
    consecutive_ok: u32,
    consecutive_fail: u32,
    /// An answered failure since the last success.
    answered_fail: bool,
}

impl HealthState {
    /// Records one check's outcome; returns true when `healthy` changed. The first success
    /// makes a new worker healthy at once (readiness should not wait `success_threshold`
    /// intervals at start).
    pub fn observe(&mut self, probe: Probe, failure_threshold: u32, success_threshold: u32) -> bool {
        let before = self.healthy;
        let first = !self.checked;
        self.checked = true;
        if probe == Probe::Ok {
            self.consecutive_ok += 1;
            self.consecutive_fail = 0;
            self.answered_fail = false;
            if !self.healthy && (first || self.consecutive_ok >= success_threshold) {
                self.healthy = true;
                self.ever_healthy = true;
            }
        } else {
            self.consecutive_fail += 1;
            self.consecutive_ok = 0;
            self.answered_fail |= probe == Probe::Failed;
            if self.healthy && self.consecutive_fail >= failure_threshold {
                self.healthy = false;
            }
        }
        before != self.healthy
    }

    /// Unhealthy only because its checks went unanswered, after it had been healthy: busy, not
    /// known to be dead. A refused connection or an error status since the last success, or a
    /// worker that never passed a check (still starting), is not silent.
    pub fn silent(&self) -> bool {
        !self.healthy && self.ever_healthy && !self.answered_fail
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flips_only_after_thresholds() {
        let mut h = HealthState::default();
        assert!(!h.healthy);
        assert!(h.observe(Probe::Ok, 3, 2), "first success makes a new worker healthy");
        assert!(!h.observe(Probe::Failed, 3, 2));
        assert!(!h.observe(Probe::Failed, 3, 2));
        assert!(h.observe(Probe::Failed, 3, 2) && !h.healthy, "third consecutive failure");
        assert!(!h.observe(Probe::Ok, 3, 2), "one success is not enough to recover");
        assert!(h.observe(Probe::Ok, 3, 2) && h.healthy);
    }

    #[test]
    fn a_success_resets_the_failure_count() {
        let mut h = HealthState::default();
        h.observe(Probe::Ok, 2, 1);
        h.observe(Probe::Failed, 2, 1);
        h.observe(Probe::Ok, 2, 1);
        h.observe(Probe::Failed, 2, 1);
        assert!(h.healthy);
    }

    #[test]
    fn only_a_worker_taken_out_by_silence_alone_is_silent() {
        let mut h = HealthState::default();
        h.observe(Probe::Unanswered, 2, 1);
        assert!(!h.silent(), "never healthy: a worker still starting is not silent");
        h.observe(Probe::Ok, 2, 1);
        h.observe(Probe::Unanswered, 2, 1);
        assert!(h.observe(Probe::Unanswered, 2, 1) && !h.healthy);
        assert!(h.silent(), "two unanswered checks: out, but only by silence");
        h.observe(Probe::Failed, 2, 1);
        assert!(!h.silent(), "a refused connection or an error status: known to be down");
        h.observe(Probe::Ok, 2, 1);
        assert!(h.healthy && !h.silent());
        h.observe(Probe::Failed, 2, 1);
        h.observe(Probe::Unanswered, 2, 1);
        assert!(!h.healthy && !h.silent(), "an answered failure on the way out counts");
    }
}
