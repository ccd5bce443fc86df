//! Where client connections go among the connection threads (edge/threads.rs), as pure
//! functions of each thread's load: the share of one CPU it used over the last sampling
//! window, in permille (edge/threads.rs, `measure_self`).
//!
//! Fill first: a new connection goes to the first thread with room, not round robin. An event
//! loop that wakes for many ready sockets at once spends less per event than several loops
//! that each wake for a few: on a 2-core machine one loop served a regular stream for 13-27 %
//! less CPU than two dealt round robin (docs/performance.md, run 5). More loops are used as the load needs them.
//!
//! Keep-alive connections stay where they were placed, so a burst of connections opened while
//! the gateway was idle all lands on the first thread. When a thread is nearly always busy
//! while another has room, the hot thread sheds some connections: each answers its next
//! response with `Connection: close`, and the client's next connection is placed again. The
//! client learns it from the response itself, so no request races a close.

/// Below this load (permille of a CPU) a thread takes new connections.
pub const FILL: u32 = 600;
/// At or above this load in each of the last `SUSTAIN` windows a thread sheds
/// connections, if another is below `FILL`. Sustained, so a burst (or a thread preempted by
/// other processes for a moment) moves nothing.
pub const HOT: u32 = 900;
pub const SUSTAIN: usize = 4;
/// The share of a hot thread's connections it sheds per window (at least one).
const SHED_DIVISOR: usize = 4;

/// The thread (index into `loads`) a new connection goes to: the first below `FILL`, or the
/// least loaded when none is. `loads` is never empty.
pub fn place(loads: &[u32]) -> usize {
    loads.iter().position(|&l| l < FILL).unwrap_or_else(|| (0..loads.len()).min_by_key(|&i| loads[i]).unwrap_or(0))
}

/// How many connections each thread should close at their next response: a quarter of a
/// thread's open connections (at least one) when its load was at least `HOT` in every
/// recent window (`lowest`: the lowest share of the last `SUSTAIN` windows) while some thread
/// is below `FILL` now (`loads`); none otherwise.
pub fn shed_plan(lowest: &[u32], loads: &[u32], open: &[usize]) -> Vec<usize> {
    let room = loads.iter().any(|&l| l < FILL);
    lowest.iter().zip(open).map(|(&l, &n)| if room && l >= HOT && n > 1 { (n / SHED_DIVISOR).max(1) } else { 0 }).collect()
}

/// The last `SUSTAIN` loads of one thread.
#[derive(Default)]
pub struct Recent {
    shares: [u32; SUSTAIN],
    next: usize,
}

impl Recent {
    pub fn push(&mut self, share: u32) {
        self.shares[self.next] = share;
        self.next = (self.next + 1) % SUSTAIN;
    }

    /// Forgets the windows so far: after a thread shed, it must be hot for `SUSTAIN` more
    /// windows before it sheds again (at most a quarter of its connections per `SUSTAIN`
    /// windows, however starved the machine is).
    pub fn clear(&mut self) {
        *self = Recent::default();
    }

    /// The lowest of the last `SUSTAIN` (0 until that many were pushed).
    pub fn lowest(&self) -> u32 {
        self.shares.iter().copied().min().unwrap_or(0)
    }
}

/// `used` (CPU or busy time) as permille of `wall` (clamped: the clocks are read apart).
pub fn permille(used: std::time::Duration, wall: std::time::Duration) -> u32 {
    if wall.is_zero() {
        return 0;
    }
    ((used.as_secs_f64() / wall.as_secs_f64()) * 1000.0).round().clamp(0.0, 1000.0) as u32
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn new_connections_fill_the_first_thread_with_room() {
        assert_eq!(place(&[0, 0, 0]), 0, "idle: the first");
        assert_eq!(place(&[599, 0]), 0, "just below FILL still takes more");
        assert_eq!(place(&[600, 0, 0]), 1, "at FILL the next one");
        assert_eq!(place(&[950, 700, 10]), 2);
        assert_eq!(place(&[950, 700, 800]), 1, "all full: the least busy");
        assert_eq!(place(&[1000]), 0, "one thread takes everything");
    }

    #[test]
    fn a_hot_thread_sheds_a_quarter_of_its_connections_only_when_another_has_room() {
        assert_eq!(shed_plan(&[950, 100], &[950, 100], &[32, 0]), vec![8, 0]);
        assert_eq!(shed_plan(&[900, 599], &[900, 599], &[3, 1]), vec![1, 0], "at least one");
        assert_eq!(shed_plan(&[950, 650], &[950, 650], &[32, 8]), vec![0, 0], "nowhere to go: keep them");
        assert_eq!(shed_plan(&[950, 0], &[950, 700], &[32, 8]), vec![0, 0], "room is judged now, not over the windows");
        assert_eq!(shed_plan(&[899, 0], &[990, 0], &[32, 0]), vec![0, 0], "hot now but not in every recent window");
        assert_eq!(shed_plan(&[1000, 0], &[1000, 0], &[1, 0]), vec![0, 0], "one connection: moving it moves the heat");
        assert_eq!(shed_plan(&[1000], &[1000], &[64]), vec![0], "one thread: nowhere to go");
        assert_eq!(shed_plan(&[950, 950, 0], &[950, 950, 0], &[8, 4, 0]), vec![2, 1, 0]);
    }

    #[test]
    fn hot_means_hot_in_every_one_of_the_last_windows() {
        let mut r = Recent::default();
        for _ in 0..SUSTAIN - 1 {
            r.push(1000);
        }
        assert_eq!(r.lowest(), 0, "not enough windows yet");
        r.push(950);
        assert_eq!(r.lowest(), 950);
        r.push(100);
        assert_eq!(r.lowest(), 100, "one cool window breaks the run");
        for _ in 0..SUSTAIN {
            r.push(920);
        }
        assert_eq!(r.lowest(), 920, "the cool window has aged out");
        r.clear();
        r.push(1000);
        assert_eq!(r.lowest(), 0, "after a shed: a fresh run of windows");
    }

    #[test]
    fn load_is_permille_of_wall_time_clamped() {
        assert_eq!(permille(Duration::from_millis(125), Duration::from_millis(250)), 500);
        assert_eq!(permille(Duration::from_millis(300), Duration::from_millis(250)), 1000);
        assert_eq!(permille(Duration::ZERO, Duration::from_millis(250)), 0);
        assert_eq!(permille(Duration::from_millis(1), Duration::ZERO), 0);
    }
}
