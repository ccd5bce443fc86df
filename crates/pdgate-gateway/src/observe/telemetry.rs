//! Logs: text or JSON (`--log-json`) on stderr, and also in `DIR/pdgate.log` with `--log-dir`
//! (rotated daily, see log_file.rs).
//!
//! With `--enable-trace`, the OpenTelemetry layer (tracing_export.rs) joins the log layers; the
//! log filter then applies to the log layers only, so `--log-level` never hides spans from the
//! exporter. Without it the subscriber is the same as before tracing existed.
//!
//! Installed once per process: a second gateway embedded in the same Python process logs
//! (and traces) through the first one's subscriber (its `--log-*` and trace options are then
//! not applied).

use pdgate_core::GatewayConfig;
use tracing_subscriber::fmt::MakeWriter;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Layer, Registry};

use crate::observe::log_file::DailyFile;

type Boxed = Box<dyn Layer<Registry> + Send + Sync>;

/// One formatting layer: JSON objects (with the target and the request span) or text.
fn format_layer<W>(json: bool, ansi: bool, writer: W) -> Boxed
where
    W: for<'w> MakeWriter<'w> + Send + Sync + 'static,
{
    let layer = tracing_subscriber::fmt::layer().with_writer(writer);
    if json {
        layer.json().with_target(true).with_current_span(true).with_span_list(false).boxed()
    } else {
        layer.with_target(false).with_ansi(ansi).boxed()
    }
}

/// The log filter: `RUST_LOG` wins over `--log-level`. The phase spans are for the exporter
/// only: never logged, whatever the level.
fn filter(level: &str) -> EnvFilter {
    // `warning` is the Python name; tracing calls it `warn` (validate_log_level accepts both).
    let level = level.to_ascii_lowercase().replace("warning", "warn");
    let filter = EnvFilter::try_from_default_env().or_else(|_| EnvFilter::try_new(&level)).unwrap_or_else(|_| EnvFilter::new("info"));
    match format!("{}=off", crate::observe::tracing_export::TARGET).parse() {
        Ok(directive) => filter.add_directive(directive),
        Err(_) => filter,
    }
}

/// Installs the subscriber for `config`'s `--log-level`, `--log-json`, `--log-dir` and
/// `--enable-trace`. Later calls in the same process do nothing (but a bad `--log-dir` is still
/// an error).
pub fn init_logging(config: &GatewayConfig) -> Result<(), String> {
    let file = config.log_dir.as_deref().map(DailyFile::open).transpose()?;
    if tracing::dispatcher::has_been_set() {
        if config.enable_trace && !crate::observe::tracing_export::enabled() {
            tracing::warn!("--enable-trace ignored: this process set up its logging without tracing (once per process)");
        }
        return Ok(());
    }
    // Colour only for a terminal (not in files or CI logs).
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let mut layers: Vec<Boxed> = vec![format_layer(config.log_json, ansi, std::io::stderr)];
    if let Some(f) = file {
        layers.push(format_layer(config.log_json, false, f));
    }
    let logs = filter(&config.log_level);
    if !config.enable_trace {
        // One global filter, as before tracing: disabled callsites cost nothing.
        let _ = tracing_subscriber::registry().with(layers).with(logs).try_init();
        return Ok(());
    }
    let registry = tracing_subscriber::registry().with(layers.with_filter(logs));
    let otel = crate::observe::tracing_export::install(&config.otlp_traces_endpoint)?;
    let _ = registry.with(otel).try_init();
    Ok(())
}
