//! `pdgate._core`: the pyo3 glue that embeds the Rust gateway in the `pdgate` Python package.
//!
//! Only conversion and lifecycle live here: the config crosses the boundary as JSON (one schema,
//! `pdgate_core::GatewayConfig`), and `GatewayHandle` owns a tokio runtime running one gateway.
//! No routing logic belongs in this crate.

use pyo3::prelude::*;

mod errors;
mod handle;
mod placement;

// The same allocator as the standalone binary (see crates/pdgate-gateway/src/main.rs); it serves
// Rust allocations only, Python keeps its own.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

use pdgate_core::GatewayConfig;

/// The option schema as JSON: `{"options": [{name, flag, help, default, choices, takes_value,
/// json_schema, repeated}]}` (`json_schema`: the value's type in the JSON view). The Python CLI and `pdgate.Gateway` are generated from / checked against it.
#[pyfunction]
fn config_schema() -> String {
    GatewayConfig::schema().to_string()
}

/// Parse `pdgate launch` arguments (without the program name) into config JSON.
///
/// Raises `pdgate.errors.CommandLineError` with clap's rendered text; its `exit_code` is 0 for
/// `--help` / `--version` (the caller prints the text and exits), 2 for a bad command line.
#[pyfunction]
fn parse_cli(py: Python<'_>, argv: Vec<String>) -> PyResult<String> {
    let args = std::iter::once("pdgate launch".to_string()).chain(argv);
    match GatewayConfig::parse_cli(args) {
        Ok(mut config) => {
            // `pdgate launch` is a command line: its environment fallbacks (PDGATE_API_KEY, ...)
            // apply here, never in the config schema or the Python API.
            config.fill_from_env(|var| std::env::var(var).ok());
            // clap checks each flag; the cross-field rules live in `validate`.
            config.validate().map_err(|e| errors::config_error(py, &e))?;
            Ok(config.to_json())
        }
        Err(e) => Err(errors::command_line_error(py, e.render().to_string(), e.exit_code())),
    }
}

/// Validate config JSON and return it complete (every option present, defaults filled in).
#[pyfunction]
fn normalize_config(py: Python<'_>, config_json: &str) -> PyResult<String> {
    let config = GatewayConfig::from_json(config_json).map_err(|e| errors::config_error(py, &e))?;
    Ok(config.to_json())
}

/// The version of the compiled extension (the workspace version).
#[pyfunction]
fn version() -> &'static str {
    env!("CARGO_PKG_VERSION")
}

#[pymodule]
#[pyo3(name = "_core")]
fn core_module(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(config_schema, m)?)?;
    m.add_function(wrap_pyfunction!(parse_cli, m)?)?;
    m.add_function(wrap_pyfunction!(normalize_config, m)?)?;
    m.add_function(wrap_pyfunction!(version, m)?)?;
    m.add_class::<handle::GatewayHandle>()?;
    m.add_class::<placement::PlacementModel>()?;
    Ok(())
}
