# Sourced by the gateway benchmarks: a run whose load failed is not a result. A script records
# each failure as it goes, prints everything it measured, then ends with `finish`, which exits 1
# when anything failed (CI's smoke of each script, tests/bench/test_bench_smoke.py, relies on it).
#
#   check_wrk FILE WHAT   records WHAT as failed when wrk's FILE shows no completed request or
#                         any error (non-2xx answers, connect/read/write errors, timeouts)
#   fail WHAT             records WHAT as failed (and says so on stderr at once)
#   finish                exits 1, listing the failures, when there were any
FAILED=()

fail() {
    FAILED+=("$*")
    echo "FAILED: $*" >&2
}

check_wrk() {
    local n
    n=$(awk '/requests in/ {print $1}' "$1" 2>/dev/null || true)
    if [ -z "$n" ] || [ "$n" = 0 ]; then
        fail "$2: wrk completed no request ($1)"
    elif grep -qE 'Non-2xx|Socket errors' "$1"; then
        fail "$2: wrk saw errors: $(grep -E 'Non-2xx|Socket errors' "$1" | tr -s ' ' | tr '\n' ';') ($1)"
    fi
}

finish() {
    [ "${#FAILED[@]}" -eq 0 ] && return 0
    printf 'failed: %s\n' "${FAILED[@]}" >&2
    exit 1
}
