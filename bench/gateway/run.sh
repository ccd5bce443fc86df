#!/usr/bin/env bash
# Gateway overhead benchmark (not a test).
#
# wrk at 32 connections against nginx answering fixed completions (a mock far faster than any
# engine), first directly, then through `pdgate launch` in regular mode and in PD (bootstrap)
# mode. For the runs through pdgate it reports the gateway's CPU time per request, read from
# /proc/<pid>/stat (utime + stime of all its threads) around the same wrk run.
#
#   bench/gateway/run.sh            # DURATION=10s CONNECTIONS=32 THREADS=2 by default
#   DURATION=1s CONNECTIONS=4 RESULTS=/tmp/r bench/gateway/run.sh   # CI's smoke
#
# RESULTS: where the report goes (default bench/results). Exits 1 after the report when a wrk
# run completed no request or saw errors.
# Needs: wrk and nginx (Debian packages `wrk`, `nginx-light`), pdgate installed (pip install .).
set -euo pipefail
cd "$(dirname "$0")/../.."

DURATION=${DURATION:-10s}
CONNECTIONS=${CONNECTIONS:-32}
THREADS=${THREADS:-2}
PYTHON=${PYTHON:-python}
DIR=$(mktemp -d /tmp/pdgate-bench.XXXXXX)
RESULTS=${RESULTS:-bench/results}
mkdir -p "$RESULTS"
PIDS=()
source bench/gateway/checks.sh  # check_wrk, finish

cleanup() {
    for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
    wait 2>/dev/null || true
}
trap cleanup EXIT

free_port() { "$PYTHON" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
cpu_ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }
wait_http() {  # wait_http URL: until it answers 200, at most 30 s
    for _ in $(seq 300); do
        [ "$(curl -s -o /dev/null -w '%{http_code}' "$1" || true)" = 200 ] && return 0
        sleep 0.1
    done
    echo "timed out waiting for $1" >&2; return 1
}

REGULAR_PORT=$(free_port); PREFILL_PORT=$(free_port); DECODE_PORT=$(free_port)
sed -e "s#@DIR@#$DIR#g" -e "s#@REGULAR_PORT@#$REGULAR_PORT#g" -e "s#@PREFILL_PORT@#$PREFILL_PORT#g" \
    -e "s#@DECODE_PORT@#$DECODE_PORT#g" bench/gateway/nginx.conf.in > "$DIR/nginx.conf"
nginx -p "$DIR" -c "$DIR/nginx.conf" -g 'daemon off;' &
PIDS+=($!)
wait_http "http://127.0.0.1:$REGULAR_PORT/health"
wait_http "http://127.0.0.1:$PREFILL_PORT/health"

TICK_US=$((1000000 / $(getconf CLK_TCK)))
ROWS=()

# run_wrk NAME URL [GATEWAY_PID]: one measured run; appends a table row.
run_wrk() {
    local name=$1 url=$2 pid=${3:-}
    wrk -t"$THREADS" -c"$CONNECTIONS" -d2s -s bench/gateway/post.lua "$url/v1/completions" > /dev/null  # warm-up
    local before=0 after=0
    [ -n "$pid" ] && before=$(cpu_ticks "$pid")
    wrk -t"$THREADS" -c"$CONNECTIONS" -d"$DURATION" -s bench/gateway/post.lua "$url/v1/completions" > "$DIR/$name.wrk"
    [ -n "$pid" ] && after=$(cpu_ticks "$pid")
    check_wrk "$DIR/$name.wrk" "$name"
    local requests rps errors cpu="-"
    requests=$(awk '/requests in/ {print $1}' "$DIR/$name.wrk")
    rps=$(awk '/Requests\/sec/ {printf "%.0f", $2}' "$DIR/$name.wrk")
    errors=$(awk '/Non-2xx|Socket errors/ {print}' "$DIR/$name.wrk" | tr '\n' ' ')
    [ -n "$pid" ] && cpu=$(awk -v t=$((after - before)) -v us="$TICK_US" -v n="$requests" 'BEGIN {printf "%.1f", t * us / n}')
    ROWS+=("| $name | $rps | $cpu | ${errors:-none} |")
    echo "$name: $rps req/s, gateway CPU $cpu us/request ${errors}"
}

# start_gateway ARGS...: `pdgate launch` on a free port; sets GATEWAY_URL and GATEWAY_PID.
start_gateway() {
    local log="$DIR/gateway-$RANDOM.log"
    "$PYTHON" -m pdgate.cli launch --host 127.0.0.1 --port 0 --log-level warn \
        --health-check-interval-secs 1 --health-success-threshold 1 "$@" > "$log" 2>&1 &
    GATEWAY_PID=$!
    PIDS+=("$GATEWAY_PID")
    for _ in $(seq 300); do grep -q "listening on" "$log" && break; sleep 0.1; done
    GATEWAY_URL=$(sed -n 's/.*listening on //p' "$log" | head -1)
    [ -n "$GATEWAY_URL" ] || { cat "$log"; exit 1; }
    wait_http "$GATEWAY_URL/readiness"
}

run_wrk "direct (nginx)" "http://127.0.0.1:$REGULAR_PORT"

start_gateway --worker-urls "http://127.0.0.1:$REGULAR_PORT"
run_wrk "pdgate regular" "$GATEWAY_URL" "$GATEWAY_PID"
kill "$GATEWAY_PID"; wait "$GATEWAY_PID" 2>/dev/null || true

start_gateway --pd-disaggregation --prefill "http://127.0.0.1:$PREFILL_PORT" 8998 --decode "http://127.0.0.1:$DECODE_PORT"
run_wrk "pdgate PD (bootstrap)" "$GATEWAY_URL" "$GATEWAY_PID"
kill "$GATEWAY_PID"; wait "$GATEWAY_PID" 2>/dev/null || true

REPORT="$RESULTS/gateway-overhead-$(date +%Y%m%d-%H%M%S).md"
{
    echo "wrk -t$THREADS -c$CONNECTIONS -d$DURATION, $(nproc) cores, $(uname -r), nginx mock with 1 worker"
    echo
    echo "| scenario | req/s | gateway CPU µs/request | errors |"
    echo "|---|---|---|---|"
    printf '%s\n' "${ROWS[@]}"
} | tee "$REPORT"
echo "report: $REPORT"
finish
