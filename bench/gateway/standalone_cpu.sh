#!/usr/bin/env bash
# Gateway CPU per request of the standalone Rust binary (no Python process around it), regular
# mode, against the same nginx mock as run.sh. Not a test.
#
#   cargo build --release -p pdgate-gateway
#   bench/gateway/standalone_cpu.sh                     # tokio's default worker threads
#   TOKIO_WORKER_THREADS=1 bench/gateway/standalone_cpu.sh
#   PERF=1 bench/gateway/standalone_cpu.sh              # also a perf call-graph summary
#
# A peer gateway in the same conditions: GATEWAY_CMD is run with PORT and WORKER set, e.g.
#   python3 -m venv /tmp/smg && /tmp/smg/bin/pip install smg==1.13.0
#   GATEWAY_CMD='/tmp/smg/bin/smg launch --host 127.0.0.1 --port $PORT --worker-urls $WORKER \
#     --policy round_robin --log-level warn' bench/gateway/standalone_cpu.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
BIN=${BIN:-target/release/pdgate-gateway}
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
PORT=$(free_port); GP=$(free_port); D=$(mktemp -d /tmp/pdgate-cpu.XXXXXX)
sed -e "s#@DIR@#$D#g" -e "s#@REGULAR_PORT@#$PORT#g" -e "s#@PREFILL_PORT@#$(free_port)#g" \
    -e "s#@DECODE_PORT@#$(free_port)#g" bench/gateway/nginx.conf.in > "$D/nginx.conf"
nginx -p "$D" -c "$D/nginx.conf" -g 'daemon off;' & NG=$!
if [ -n "${GATEWAY_CMD:-}" ]; then
    worker="http://127.0.0.1:$PORT"
    PORT=$GP WORKER=$worker bash -c "exec $GATEWAY_CMD" > "$D/gw.log" 2>&1 & GW=$!
else
    "$BIN" --port "$GP" --log-level warn --worker-urls "http://127.0.0.1:$PORT" > "$D/gw.log" 2>&1 & GW=$!
fi
trap 'kill $GW $NG 2>/dev/null || true' EXIT
URL="http://127.0.0.1:$GP/v1/completions"
for _ in $(seq 100); do  # until the gateway routes a request (at most ~30 s)
    curl -s -o /dev/null -w '%{http_code}' -H 'content-type: application/json' -d '{"prompt":"x","max_tokens":1}' "$URL" | grep -q 200 && break
    sleep 0.3
done
wrk -t2 -c32 -d2s -s bench/gateway/post.lua "$URL" > /dev/null
[ -n "${PERF:-}" ] && { perf record -F 1999 -g -p "$GW" -o "$D/perf.data" -- sleep 5 > /dev/null 2>&1 & }
before=$(awk '{print $14 + $15}' "/proc/$GW/stat")
wrk -t2 -c32 -d5s -s bench/gateway/post.lua "$URL" > "$D/wrk.txt"
after=$(awk '{print $14 + $15}' "/proc/$GW/stat")
n=$(awk '/requests in/ {print $1}' "$D/wrk.txt")
grep -E 'Non-2xx|Socket errors' "$D/wrk.txt" || true
echo "requests $n, gateway CPU $(( (after - before) * (1000000 / $(getconf CLK_TCK)) / n )) us/request"
if [ -n "${PERF:-}" ]; then
    wait %3 2>/dev/null || sleep 1
    perf report -i "$D/perf.data" --children --sort symbol --stdio 2>/dev/null | grep -E '^ +[0-9]' | head -40
fi
