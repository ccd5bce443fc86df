//! `pdgate-gateway`: the gateway as a standalone binary. Same options as `pdgate launch`.

use std::process::ExitCode;

use pdgate_gateway::{init_logging, start, worker_api_key_from_env, GatewayConfig};

// glibc malloc took ~10% of the gateway's CPU per request (cross-thread frees, consolidation);
// mimalloc's thread-local free lists cut that to a few percent (docs/performance.md).
#[cfg(feature = "mimalloc")]
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[tokio::main]
async fn main() -> ExitCode {
    let mut config = GatewayConfig::parse_cli(std::env::args_os()).unwrap_or_else(|e| e.exit());
    // The command line's environment fallbacks (PDGATE_API_KEY, ...); the core reads none.
    config.fill_from_env(|var| std::env::var(var).ok());
    worker_api_key_from_env(&mut config);
    if let Err(e) = init_logging(&config) {
        eprintln!("pdgate-gateway: {e}");
        return ExitCode::from(2);
    }
    let gateway = match start(config).await {
        Ok(g) => g,
        Err(e) => {
            eprintln!("pdgate-gateway: {e}");
            return ExitCode::from(2);
        }
    };
    println!("pdgate listening on http://{}", gateway.local_addr());
    wait_for_signal().await;
    gateway.shutdown().await;
    ExitCode::SUCCESS
}

async fn wait_for_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
        Ok(s) => s,
        Err(_) => {
            let _ = ctrl_c.await;
            return;
        }
    };
    tokio::select! {
        _ = ctrl_c => {}
        _ = term.recv() => {}
    }
}
