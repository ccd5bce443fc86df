//! `GatewayHandle`: one gateway on its own tokio runtime, started and stopped from Python.
//!
//! Every wait happens with the GIL released (`Python::detach`), and the state lock is only taken
//! inside those detached sections, so a Python thread holding the GIL never waits on a thread
//! that needs the GIL back.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use pdgate_core::GatewayConfig;
use pdgate_gateway::RunningGateway;
use pyo3::prelude::*;
use tokio::runtime::Runtime;

use crate::errors;

/// How long a stop may take beyond `--shutdown-grace-period-secs` (the gateway cuts what is
/// left at the end of its grace period; this bounds the closing of connections after it).
const SHUTDOWN_MARGIN: Duration = Duration::from_secs(5);

struct Running {
    runtime: Runtime,
    gateway: RunningGateway,
    addr: SocketAddr,
}

impl Running {
    fn shutdown(self, grace: Duration) {
        let Running { runtime, gateway, .. } = self;
        // A request that outlives the grace period is dropped with the runtime.
        // The timer must be created inside the runtime, hence the async block.
        let _ = runtime.block_on(async move { tokio::time::timeout(grace + SHUTDOWN_MARGIN, gateway.shutdown()).await });
        runtime.shutdown_timeout(Duration::from_secs(1));
    }
}

/// A gateway built from config JSON; `start()` serves, `stop()` drains and stops.
#[pyclass(module = "pdgate._core", frozen)]
pub struct GatewayHandle {
    config: GatewayConfig,
    state: Mutex<Option<Running>>,
}

fn lock(state: &Mutex<Option<Running>>) -> MutexGuard<'_, Option<Running>> {
    // A panic while holding the lock leaves plain data behind; keep using it.
    state.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Where a client on this machine reaches a socket bound to `addr` (0.0.0.0 → 127.0.0.1).
fn reachable(addr: SocketAddr) -> SocketAddr {
    match addr.ip() {
        IpAddr::V4(ip) if ip.is_unspecified() => SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), addr.port()),
        IpAddr::V6(ip) if ip.is_unspecified() => SocketAddr::new(IpAddr::V6(Ipv6Addr::LOCALHOST), addr.port()),
        _ => addr,
    }
}

enum StartOutcome {
    Started,
    AlreadyRunning,
    Failed(String),
}

fn start_blocking(config: GatewayConfig, state: &Mutex<Option<Running>>) -> StartOutcome {
    let mut slot = lock(state);
    if slot.is_some() {
        return StartOutcome::AlreadyRunning;
    }
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().thread_name("pdgate-gateway").build() {
        Ok(rt) => rt,
        Err(e) => return StartOutcome::Failed(format!("cannot create the tokio runtime: {e}")),
    };
    if let Err(e) = pdgate_gateway::init_logging(&config) {
        return StartOutcome::Failed(e);
    }
    match runtime.block_on(pdgate_gateway::start(config)) {
        Ok(gateway) => {
            let addr = gateway.local_addr();
            *slot = Some(Running { runtime, gateway, addr });
            StartOutcome::Started
        }
        Err(e) => StartOutcome::Failed(e.to_string()),
    }
}

#[pymethods]
impl GatewayHandle {
    /// Validate `config_json` (the `GatewayConfig` JSON form); nothing starts yet.
    #[new]
    fn new(py: Python<'_>, config_json: &str) -> PyResult<Self> {
        let config = GatewayConfig::from_json(config_json).map_err(|e| errors::config_error(py, &e))?;
        Ok(Self { config, state: Mutex::new(None) })
    }

    /// Bind and start serving; returns once the gateway accepts connections.
    fn start(&self, py: Python<'_>) -> PyResult<()> {
        let config = self.config.clone();
        match py.detach(|| start_blocking(config, &self.state)) {
            StartOutcome::Started => Ok(()),
            StartOutcome::AlreadyRunning => Err(errors::state_error(py, "the gateway is already running".into())),
            StartOutcome::Failed(message) => Err(errors::start_error(py, message)),
        }
    }

    /// Stop accepting, drain in-flight requests (bounded), stop the runtime. Idempotent.
    fn stop(&self, py: Python<'_>) {
        py.detach(|| {
            let running = lock(&self.state).take();
            if let Some(running) = running {
                running.shutdown(self.grace());
            }
        });
    }

    /// Whether `start()` succeeded and `stop()` has not been called since.
    #[getter]
    fn running(&self, py: Python<'_>) -> bool {
        py.detach(|| lock(&self.state).is_some())
    }

    /// The bound port (useful with `port=0`); `None` when not running.
    #[getter]
    fn port(&self, py: Python<'_>) -> Option<u16> {
        py.detach(|| lock(&self.state).as_ref().map(|r| r.addr.port()))
    }

    /// `http://host:port` for clients on this machine; `None` when not running.
    #[getter]
    fn url(&self, py: Python<'_>) -> Option<String> {
        py.detach(|| lock(&self.state).as_ref().map(|r| format!("http://{}", reachable(r.addr))))
    }

    /// `http://host:port/metrics` of the `--prometheus-port` listener; `None` without one.
    #[getter]
    fn metrics_url(&self, py: Python<'_>) -> Option<String> {
        py.detach(|| {
            let slot = lock(&self.state);
            let addr = slot.as_ref()?.gateway.metrics_addr()?;
            Some(format!("http://{}/metrics", reachable(addr)))
        })
    }

    /// The complete configuration as JSON (defaults filled in).
    #[getter]
    fn config_json(&self) -> String {
        self.config.to_json()
    }
}

impl GatewayHandle {
    fn grace(&self) -> Duration {
        Duration::from_secs(self.config.shutdown_grace_period_secs)
    }
}

impl Drop for GatewayHandle {
    fn drop(&mut self) {
        // A handle collected while running still shuts its gateway down.
        if let Some(running) = lock(&self.state).take() {
            running.shutdown(self.grace());
        }
    }
}
