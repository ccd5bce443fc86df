//! Connection threads (`--connection-threads`): N OS threads, each running one single-threaded
//! tokio runtime (an event loop of its own). The acceptor hands each new client connection to
//! one of them (edge/lanes.rs: fill first, shed when hot); the connection, its requests,
//! their worker legs and whatever those spawn then run on that thread only.
//!
//! Why not one multi-thread runtime: its work stealing spreads a stream's tasks over every
//! worker thread, and each thread wakes for a few events at a time; parking, waking and
//! switching threads per relayed chunk then cost as much as the socket writes that are the
//! real work (docs/performance.md, run 5).
//!
//! The threads stop when `ConnThreads` is dropped: each waits on a oneshot whose sender it
//! holds; its runtime is dropped then, which cancels whatever it still runs.

use std::cell::OnceCell;
use std::io;
use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpStream;
use tokio::runtime::{Builder, Handle, RuntimeMetrics};
use tokio::sync::oneshot;
use tokio::time::Instant;
use tokio_util::task::TaskTracker;

use super::lanes;
use crate::observe::metrics::EdgeMetrics;

/// How often each thread's load is read and shedding decided.
const WINDOW: Duration = Duration::from_millis(250);

thread_local! {
    static STATE: OnceCell<Arc<LaneState>> = const { OnceCell::new() };
}

/// Whether the response being answered now on this thread should close its connection (the
/// thread is shedding, edge/lanes.rs). Claims one unit of the thread's shed budget.
pub fn shed_one() -> bool {
    STATE.with(|s| s.get().is_some_and(|st| st.shed.fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1)).is_ok()))
}

/// What the acceptor and the balancer know of one thread.
#[derive(Default)]
struct LaneState {
    /// Share of a CPU used in the last window, permille (`measure_self`).
    load: AtomicU32,
    /// Connections still to close at their next response.
    shed: AtomicUsize,
    /// Connections served on the thread now.
    open: AtomicUsize,
}

pub struct ConnThreads {
    handles: Vec<Handle>,
    states: Vec<Arc<LaneState>>,
    tracker: TaskTracker,
    /// Dropping these ends the threads' `block_on`.
    _stops: Vec<oneshot::Sender<()>>,
}

impl ConnThreads {
    /// Starts `n` (at least 1) connection threads; `metrics` gets their CPU shares and sheds.
    pub fn start(n: usize, metrics: Arc<EdgeMetrics>) -> io::Result<Self> {
        let n = n.max(1);
        let states: Vec<Arc<LaneState>> = (0..n).map(|_| Arc::default()).collect();
        let (mut handles, mut stops) = (Vec::with_capacity(n), Vec::with_capacity(n));
        for (i, state) in states.iter().enumerate() {
            let runtime = Builder::new_current_thread().enable_all().build()?;
            handles.push(runtime.handle().clone());
            let (stop, stopped) = oneshot::channel::<()>();
            stops.push(stop);
            let state = state.clone();
            std::thread::Builder::new().name(format!("pdgate-conn-{}", i + 1)).spawn(move || {
                crate::clients::h1_client::pool::set_lane(i + 1);
                STATE.with(|s| {
                    let _ = s.set(state);
                });
                runtime.block_on(async move {
                    let _ = stopped.await;
                });
            })?;
        }
        for (i, (handle, state)) in handles.iter().zip(&states).enumerate() {
            handle.spawn(measure_self(i, handle.metrics(), state.clone(), metrics.clone()));
        }
        // One thread has nowhere to move connections to.
        if n > 1 {
            handles[0].spawn(balance(states.clone()));
        }
        Ok(ConnThreads { handles, states, tracker: TaskTracker::new(), _stops: stops })
    }

    /// How many threads there are.
    pub fn len(&self) -> usize {
        self.handles.len()
    }

    /// Serves `stream` on the thread `lanes::place` picks: `serve` runs there, with the stream
    /// registered with that thread's event loop.
    pub fn spawn<F, S>(&mut self, stream: TcpStream, serve: S)
    where
        S: FnOnce(TcpStream) -> F + Send + 'static,
        F: std::future::Future<Output = ()> + Send + 'static,
    {
        let loads: Vec<u32> = self.states.iter().map(|s| s.load.load(Ordering::Relaxed)).collect();
        let i = lanes::place(&loads);
        // Leaves this runtime's reactor; the thread registers it with its own.
        let std_stream = match stream.into_std() {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(error = %e, "cannot hand a client connection to a connection thread");
                return;
            }
        };
        let state = self.states[i].clone();
        state.open.fetch_add(1, Ordering::AcqRel);
        let token = self.tracker.token();
        self.handles[i].spawn(async move {
            let _token = token;
            match TcpStream::from_std(std_stream) {
                Ok(stream) => serve(stream).await,
                Err(e) => tracing::warn!(error = %e, "a connection thread cannot take a client connection"),
            }
            state.open.fetch_sub(1, Ordering::AcqRel);
        });
    }

    /// Waits until every connection handed out has ended.
    pub async fn wait(&self) {
        self.tracker.close();
        self.tracker.wait().await;
    }

    /// Tests: a function that asks thread `i` (0-based) to shed `n` connections now (with
    /// one thread, no balancer overwrites it).
    #[cfg(test)]
    pub fn shedder(&self) -> impl Fn(usize, usize) + Send + Sync + 'static {
        let states = self.states.clone();
        move |i, n| states[i].shed.store(n, Ordering::Release)
    }
}

/// Every `WINDOW` on each thread: its load, the share of one CPU it used since the last
/// window. The CPU time, not the time its event loop was busy: on a machine whose cores are
/// taken by other processes a loop is busy for longer than it runs, and another thread would
/// not find a free core either. Where the OS does not say (no /proc), the busy time stands in.
async fn measure_self(i: usize, runtime: RuntimeMetrics, state: Arc<LaneState>, metrics: Arc<EdgeMetrics>) {
    let by_cpu = thread_cpu().is_some();
    let used = || if by_cpu { thread_cpu().unwrap_or_default() } else { runtime.worker_total_busy_duration(0) };
    let gauge = metrics.thread_cpu.with_label_values(&[&(i + 1).to_string()]);
    let (mut last, mut at) = (used(), Instant::now());
    let mut tick = tokio::time::interval(WINDOW);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let (now, total) = (Instant::now(), used());
        let load = lanes::permille(total.saturating_sub(last), now - at);
        (last, at) = (total, now);
        state.load.store(load, Ordering::Relaxed);
        gauge.set(f64::from(load) / 1000.0);
    }
}

/// The calling thread's time on a CPU so far (Linux: the first field of
/// /proc/thread-self/schedstat, nanoseconds).
fn thread_cpu() -> Option<Duration> {
    let text = std::fs::read_to_string("/proc/thread-self/schedstat").ok()?;
    text.split_whitespace().next()?.parse().ok().map(Duration::from_nanos)
}

/// Every `WINDOW`: how many connections each thread should shed (a fresh budget each window:
/// an unclaimed one is not carried), from the threads' loads.
async fn balance(states: Vec<Arc<LaneState>>) {
    let mut recent: Vec<lanes::Recent> = states.iter().map(|_| lanes::Recent::default()).collect();
    let mut tick = tokio::time::interval(WINDOW);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let loads: Vec<u32> = states.iter().map(|s| s.load.load(Ordering::Relaxed)).collect();
        for (r, &load) in recent.iter_mut().zip(&loads) {
            r.push(load);
        }
        let lowest: Vec<u32> = recent.iter().map(lanes::Recent::lowest).collect();
        let open: Vec<usize> = states.iter().map(|s| s.open.load(Ordering::Acquire)).collect();
        for ((state, recent), n) in states.iter().zip(&mut recent).zip(lanes::shed_plan(&lowest, &loads, &open)) {
            state.shed.store(n, Ordering::Release);
            if n > 0 {
                recent.clear();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Spins until this thread has used `cpu` more CPU time (bounded by 10 s of wall time).
    fn spin_for_cpu(cpu: Duration) -> Duration {
        let start = thread_cpu().expect("Linux has /proc/thread-self/schedstat");
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while thread_cpu().unwrap() < start + cpu {
            assert!(std::time::Instant::now() < deadline, "this thread's CPU time does not move");
            std::hint::black_box((0..1000u64).sum::<u64>());
        }
        thread_cpu().unwrap() - start
    }

    #[test]
    fn a_threads_load_is_its_own_cpu_time_not_the_processes() {
        let mine = thread_cpu().unwrap();
        let theirs = std::thread::spawn(|| spin_for_cpu(Duration::from_millis(50))).join().unwrap();
        assert!(theirs >= Duration::from_millis(50));
        let mine_after = thread_cpu().unwrap();
        // Joining costs a little CPU here, never the other thread's 50 ms.
        assert!(mine_after - mine < Duration::from_millis(25), "{:?}", mine_after - mine);
        assert!(spin_for_cpu(Duration::from_millis(20)) >= Duration::from_millis(20));
    }
}
