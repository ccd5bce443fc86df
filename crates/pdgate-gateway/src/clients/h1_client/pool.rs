//! Idle keep-alive connections, per worker address and per connection thread. A connection is
//! checked before it is handed out (a worker closes idle connections on its own timer: uvicorn
//! after 5 s), and the most recently used goes first (its socket buffers are warm).
//!
//! A socket is registered with the event loop of the thread that opened it: one taken by
//! another connection thread (edge/threads.rs) would have every read woken across threads. So
//! each thread keeps its own idle list (`lane`; every thread of a multi-thread runtime shares
//! lane 0, one event loop).

use std::cell::Cell;
use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use tokio::net::TcpStream;

thread_local! {
    /// Which connection thread this is: 1..=N on one, 0 elsewhere (the caller's runtime).
    /// Set by the connection threads (edge/threads.rs) when they start.
    static LANE: Cell<usize> = const { Cell::new(0) };
}

/// Marks the calling thread as connection thread `lane` (edge/threads.rs, at its start).
pub fn set_lane(lane: usize) {
    LANE.with(|l| l.set(lane));
}

/// The connection thread the caller runs on (1..=N), or 0 off them. Per-thread state that
/// must not be shared across event loops (the idle worker sockets here) keys on it.
pub fn lane() -> usize {
    LANE.with(Cell::get)
}

/// Tests: runs `f` as if on connection thread `lane`.
#[cfg(test)]
pub fn as_lane<R>(lane: usize, f: impl FnOnce() -> R) -> R {
    let before = LANE.with(|l| l.replace(lane));
    let r = f();
    LANE.with(|l| l.set(before));
    r
}

pub struct Pool {
    idle: Mutex<Idle>,
    max_per_host: usize,
    idle_timeout: Duration,
}

type ByHost = HashMap<String, Vec<(TcpStream, Instant)>>;

struct Idle {
    /// Indexed by lane.
    lanes: Vec<ByHost>,
    last_sweep: Instant,
}

impl Idle {
    fn lane(&mut self) -> &mut ByHost {
        let lane = lane();
        if self.lanes.len() <= lane {
            self.lanes.resize_with(lane + 1, ByHost::new);
        }
        &mut self.lanes[lane]
    }
}

impl Pool {
    pub fn new(max_per_host: usize, idle_timeout: Duration) -> Self {
        Pool { idle: Mutex::new(Idle { lanes: Vec::new(), last_sweep: Instant::now() }), max_per_host, idle_timeout }
    }

    /// An open idle connection to `authority`, if there is one.
    pub fn take(&self, authority: &str) -> Option<TcpStream> {
        let now = Instant::now();
        loop {
            let (conn, since) = {
                let mut idle = self.idle.lock().unwrap_or_else(|p| p.into_inner());
                idle.lane().get_mut(authority)?.pop()?
            };
            if now.duration_since(since) < self.idle_timeout && still_open(&conn) {
                return Some(conn);
            }
        }
    }

    /// Keeps `conn` for the next request to `authority` (up to the per-host bound); idle
    /// connections past their timeout are closed on the way, at most once per timeout.
    pub fn put(&self, authority: &str, conn: TcpStream) {
        let now = Instant::now();
        let mut idle = self.idle.lock().unwrap_or_else(|p| p.into_inner());
        if now.duration_since(idle.last_sweep) >= self.idle_timeout {
            idle.last_sweep = now;
            let timeout = self.idle_timeout;
            for by_host in &mut idle.lanes {
                by_host.retain(|_, conns| {
                    conns.retain(|(_, since)| now.duration_since(*since) < timeout);
                    !conns.is_empty()
                });
            }
        }
        let by_host = idle.lane();
        let conns = match by_host.get_mut(authority) {
            Some(conns) => conns,
            None => by_host.entry(authority.to_string()).or_default(),
        };
        if conns.len() < self.max_per_host {
            conns.push((conn, now));
        }
    }
}

/// An idle connection is usable if reading it would block: end of stream means the worker
/// closed it, and bytes nobody asked for mean it cannot be trusted with a new answer.
fn still_open(conn: &TcpStream) -> bool {
    let mut probe = [0u8; 1];
    matches!(conn.try_read(&mut probe), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn an_idle_connection_is_handed_out_only_on_the_thread_that_put_it_back() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let conn = TcpStream::connect(listener.local_addr().unwrap()).await.unwrap();
        let _peer = listener.accept().await.unwrap();
        let pool = Pool::new(4, Duration::from_secs(60));
        as_lane(1, || pool.put("w:1", conn));
        assert!(as_lane(2, || pool.take("w:1")).is_none(), "another connection thread's socket");
        assert!(as_lane(0, || pool.take("w:1")).is_none(), "nor the caller's runtime's");
        assert!(as_lane(1, || pool.take("w:1")).is_some());
        assert!(as_lane(1, || pool.take("w:1")).is_none(), "handed out once");
    }
}
