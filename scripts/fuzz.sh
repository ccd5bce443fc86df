#!/usr/bin/env bash
# Runs the cargo-fuzz targets in fuzz/ (request parsing; SSE framing and the logprob merge the
# stream rewriter applies) for a bounded time each: FUZZ_SECONDS (default 30). libFuzzer needs a
# nightly toolchain: without one this says so and exits 0, since the same properties run on
# stable with proptest in `cargo test`.
set -euo pipefail
cd "$(dirname "$0")/.."
secs="${FUZZ_SECONDS:-30}"
if ! rustup run nightly rustc --version >/dev/null 2>&1; then
    echo "fuzz: no nightly toolchain; cargo-fuzz targets skipped (their proptest equivalents ran in cargo test)"
    exit 0
fi
if ! cargo +nightly fuzz --version >/dev/null 2>&1; then
    cargo install -q --locked cargo-fuzz || { echo "fuzz: cannot install cargo-fuzz; skipped"; exit 0; }
fi
cd fuzz
for target in parse_request sse; do
    echo "== fuzz $target (${secs}s)"
    cargo +nightly fuzz run "$target" -- -max_total_time="$secs" -rss_limit_mb=2048
done
