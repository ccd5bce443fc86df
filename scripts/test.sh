#!/usr/bin/env bash
# The README's test command: builds and installs pdgate from this checkout, then runs every tier:
# Rust unit + component tests (cargo), then Python unit, engine and end-to-end tests (pytest).
set -euo pipefail
cd "$(dirname "$0")/.."

# One target dir outside the checkout, so a rebuild after a fresh clone reuses compiled crates.
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/pdgate/target}"
PY="${PYTHON:-python3}"

echo "== building and installing pdgate (maturin, release)"
"$PY" -m pip install -q --disable-pip-version-check ".[test]"

echo "== cargo fmt --check, cargo clippy -D warnings"
# Formatting and lints first: they take seconds and fail for reasons a test run would bury.
cargo fmt --all --check
cargo clippy -q --workspace --all-targets -- -D warnings
# Imports run one way between the gateway's stages, no import circle over two files (issue 28).
"$PY" scripts/import_layers.py >/dev/null || "$PY" scripts/import_layers.py
if command -v cargo-machete >/dev/null 2>&1; then
    cargo machete  # unused dependencies (installed by .ci/run)
fi

echo "== cargo test"
# The pyo3 extension crate links against libpython only when loaded by Python: test it there.
cargo test -q --workspace --exclude pdgate-python
# The criterion benches, each benchmark run once in criterion's test mode (untimed): they still
# build and run. The bench scripts' smoke is tests/bench/test_bench_smoke.py.
cargo test -q --workspace --exclude pdgate-python --bench '*'

echo "== pytest"
# Run from a directory where `import pdgate` finds the installed wheel, not the source tree.
# --durations: the slowest tests' times end the output, where CI's time goes (its limit is 90 min).
"$PY" -m pytest -q -p no:cacheprovider --durations=25 tests "$@"
