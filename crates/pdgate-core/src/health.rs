//! Health as a fact that flips only after enough consecutive observations, so one slow check
//! does not take a worker out and one lucky check does not bring a broken one back.

#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct HealthState {
    pub healthy: bool,
    /// Whether any check has completed; a worker is not healthy before its first success.
    pub checked: bool,
    consecutive_ok: u32,
    consecutive_fail: u32,
}

impl HealthState {
    /// Records one check; returns true when `healthy` changed. The first success makes a new
    /// worker healthy at once (readiness should not wait `success_threshold` intervals at start).
    pub fn observe(&mut self, ok: bool, failure_threshold: u32, success_threshold: u32) -> bool {
        let before = self.healthy;
        let first = !self.checked;
        self.checked = true;
        if ok {
            self.consecutive_ok += 1;
            self.consecutive_fail = 0;
            if !self.healthy && (first || self.consecutive_ok >= success_threshold) {
                self.healthy = true;
            }
        } else {
            self.consecutive_fail += 1;
            self.consecutive_ok = 0;
            if self.healthy && self.consecutive_fail >= failure_threshold {
                self.healthy = false;
            }
        }
        before != self.healthy
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flips_only_after_thresholds() {
        let mut h = HealthState::default();
        assert!(!h.healthy);
        assert!(h.observe(true, 3, 2), "first success makes a new worker healthy");
        assert!(!h.observe(false, 3, 2));
        assert!(!h.observe(false, 3, 2));
        assert!(h.observe(false, 3, 2) && !h.healthy, "third consecutive failure");
        assert!(!h.observe(true, 3, 2), "one success is not enough to recover");
        assert!(h.observe(true, 3, 2) && h.healthy);
    }

    #[test]
    fn a_success_resets_the_failure_count() {
        let mut h = HealthState::default();
        h.observe(true, 2, 1);
        h.observe(false, 2, 1);
        h.observe(true, 2, 1);
        h.observe(false, 2, 1);
        assert!(h.healthy);
    }
}
