//! Rust failures as the Python exceptions of `pdgate.errors`.
//!
//! The exception classes are defined once, in Python (documented there); this module looks them
//! up at raise time so the hierarchy has a single source.

use pdgate_core::ConfigError;
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use pyo3::types::{PyString, PyTuple};

/// Instantiate `pdgate.errors.<class>(*args)` as a `PyErr`.
fn raise<'py>(py: Python<'py>, class: &str, args: Bound<'py, PyTuple>, fallback: String) -> PyErr {
    let made = py.import("pdgate.errors").and_then(|m| m.getattr(class)).and_then(|cls| cls.call1(args));
    match made {
        Ok(exc) => PyErr::from_value(exc),
        // Only if the Python package is broken: still raise something readable.
        Err(_) => PyRuntimeError::new_err(fallback),
    }
}

fn with_message(py: Python<'_>, class: &str, message: String) -> PyErr {
    match PyTuple::new(py, [message.clone()]) {
        Ok(args) => raise(py, class, args, message),
        Err(e) => e,
    }
}

/// An invalid option value or combination (`ConfigError`, a `ValueError`); one option at fault
/// is an `OptionError` (`.option`, `.value`), an unknown name an `UnknownOptionError`.
pub fn config_error(py: Python<'_>, error: &ConfigError) -> PyErr {
    let message = error.to_string();
    let args = match error {
        ConfigError::UnknownOption { name } => ("UnknownOptionError", (message.clone(), name.clone(), py.None())),
        ConfigError::BadValue { name, value, .. } => {
            // The value travels as JSON text; give Python the value itself (the text when it
            // was cut short and so is no JSON any more).
            let value = py.import("json").and_then(|json| json.call_method1("loads", (value.as_str(),))).unwrap_or_else(|_| PyString::new(py, value).into_any()).unbind();
            ("OptionError", (message.clone(), name.clone(), value))
        }
        _ => return with_message(py, "ConfigError", message),
    };
    match args.1.into_pyobject(py) {
        Ok(tuple) => raise(py, args.0, tuple, message),
        Err(e) => e,
    }
}

/// clap rejected or answered the command line (`CommandLineError`, carries the exit code).
pub fn command_line_error(py: Python<'_>, text: String, exit_code: i32) -> PyErr {
    match (text.clone(), exit_code).into_pyobject(py) {
        Ok(args) => raise(py, "CommandLineError", args, text),
        Err(e) => e,
    }
}

/// The gateway could not start (bind failure, runtime failure).
pub fn start_error(py: Python<'_>, message: String) -> PyErr {
    with_message(py, "GatewayStartError", message)
}

/// Misuse of a handle, e.g. `start()` twice.
pub fn state_error(py: Python<'_>, message: String) -> PyErr {
    with_message(py, "GatewayStateError", message)
}
