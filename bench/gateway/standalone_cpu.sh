#!/usr/bin/env bash
# Gateway CPU per request of the standalone Rust binary (no Python process around it), against
# the same nginx mock as run.sh, next to baselines measured in the same run. Not a test.
#
#   cargo build --release -p pdgate-gateway --bin pdgate-gateway --example hyper_floor
#   bench/gateway/standalone_cpu.sh                          # pdgate regular, pdgate PD, floors
#   GATEWAYS="pdgate" bench/gateway/standalone_cpu.sh        # a subset, in this order
#   TOKIO_WORKER_THREADS=1 bench/gateway/standalone_cpu.sh   # one runtime thread
#   PERF=1 GATEWAYS=pdgate bench/gateway/standalone_cpu.sh   # also a perf profile summary
#   DURATION=1s GATEWAYS="pdgate pdgate-pd hyper-floor nginx-proxy custom" GATEWAY_CMD=... \
#     BIN=... FLOOR=... bench/gateway/standalone_cpu.sh      # CI's smoke (and PERF=1 GATEWAYS=pdgate)
#
# Gateways (each gets the same wrk load, one after the other):
#   pdgate       the release binary, regular mode, round robin over one worker
#   pdgate-pd    the release binary, PD mode (SGLang bootstrap: both legs per request)
#   hyper-floor  examples/hyper_floor.rs: the same tokio/hyper stack doing nothing but forward
#   nginx-proxy  nginx 1 process as a keep-alive reverse proxy: a floor for two loopback hops
#   custom       GATEWAY_CMD, run with PORT and WORKER set, e.g. a peer gateway:
#     python3 -m venv /tmp/smg && /tmp/smg/bin/pip install smg==1.13.0
#     GATEWAYS=custom GATEWAY_CMD='/tmp/smg/bin/smg launch --host 127.0.0.1 --port $PORT \
#       --worker-urls $WORKER --policy round_robin --log-level warn' bench/gateway/standalone_cpu.sh
# Exits 1 after its table when a gateway never routed or a measured wrk run saw errors.
set -euo pipefail
cd "$(dirname "$0")/../.."
BIN=${BIN:-target/release/pdgate-gateway}
FLOOR=${FLOOR:-target/release/examples/hyper_floor}
GATEWAYS=${GATEWAYS:-pdgate pdgate-pd hyper-floor nginx-proxy}
DURATION=${DURATION:-5s}
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
RP=$(free_port); PP=$(free_port); DP=$(free_port); D=$(mktemp -d /tmp/pdgate-cpu.XXXXXX)
sed -e "s#@DIR@#$D#g" -e "s#@REGULAR_PORT@#$RP#g" -e "s#@PREFILL_PORT@#$PP#g" \
    -e "s#@DECODE_PORT@#$DP#g" bench/gateway/nginx.conf.in > "$D/nginx.conf"
nginx -p "$D" -c "$D/nginx.conf" -g 'daemon off;' & NG=$!
GW=
trap 'kill $GW $NG 2>/dev/null || true' EXIT
source bench/gateway/checks.sh  # check_wrk, fail, finish
WORKER="http://127.0.0.1:$RP"

# nginx-proxy: bench/gateway/nginx_proxy.sh
source bench/gateway/nginx_proxy.sh  # the cwd is the repo root

start() {  # $1 gateway name, $2 port; sets GW
    case $1 in
        pdgate) "$BIN" --port "$2" --log-level warn --worker-urls "$WORKER" > "$D/$1.log" 2>&1 & GW=$! ;;
        pdgate-pd) "$BIN" --port "$2" --log-level warn --pd-disaggregation --prefill "http://127.0.0.1:$PP" 8998 \
                       --decode "http://127.0.0.1:$DP" > "$D/$1.log" 2>&1 & GW=$! ;;
        hyper-floor) "$FLOOR" "$2" "$WORKER" > "$D/$1.log" 2>&1 & GW=$! ;;
        nginx-proxy) nginx_proxy_conf "$D" "$2" "$RP" > "$D/proxy.conf"
                     nginx -p "$D" -c "$D/proxy.conf" -g 'daemon off;' > "$D/$1.log" 2>&1 & GW=$! ;;
        custom) PORT=$2 WORKER=$WORKER bash -c "exec $GATEWAY_CMD" > "$D/$1.log" 2>&1 & GW=$! ;;
        *) echo "unknown gateway $1" >&2; exit 2 ;;
    esac
}

printf '%-12s %9s %22s %6s %8s\n' gateway req/s 'CPU us/req (usr+sys)' ratio errors
base=
for name in $GATEWAYS; do
    port=$(free_port)
    start "$name" "$port"
    URL="http://127.0.0.1:$port/v1/completions"
    routed=
    for _ in $(seq 100); do  # until the gateway routes a request (at most ~30 s; SMG needs the model)
        curl -s -o /dev/null -w '%{http_code}' -H 'content-type: application/json' -d '{"model":"mock-model","prompt":"x","max_tokens":1}' "$URL" | grep -q 200 && { routed=1; break; }
        sleep 0.3
    done
    [ -n "$routed" ] || fail "$name never routed a request"
    wrk -t2 -c32 -d2s -s bench/gateway/post.lua "$URL" > /dev/null
    PERF_PID=
    if [ -n "${PERF:-}" ]; then perf record -F 1999 -g -p "$GW" -o "$D/$name.perf" -- sleep 5 > /dev/null 2>&1 & PERF_PID=$!; fi
    read -r ub sb < <(awk '{print $14, $15}' "/proc/$GW/stat")
    wrk -t2 -c32 -d"$DURATION" -s bench/gateway/post.lua "$URL" > "$D/$name.wrk"
    read -r ua sa < <(awk '{print $14, $15}' "/proc/$GW/stat")
    check_wrk "$D/$name.wrk" "$name"
    n=$(awk '/requests in/ {print $1}' "$D/$name.wrk")
    rps=$(awk '/Requests\/sec/ {printf "%d", $2}' "$D/$name.wrk")
    errors=$(grep -cE 'Non-2xx|Socket errors' "$D/$name.wrk" || true)
    tick=$(( 1000000 / $(getconf CLK_TCK) ))
    us=$(( (ua - ub + sa - sb) * tick * 10 / n ))  # tenths of a microsecond
    base=${base:-$us}
    printf '%-12s %9s %14s (%s+%s) %6s %8s\n' "$name" "$rps" "$((us / 10)).$((us % 10))" \
        "$(( (ua - ub) * tick / n ))" "$(( (sa - sb) * tick / n ))" \
        "$(awk -v a="$us" -v b="$base" 'BEGIN {printf "%.2f", a / b}')" "$([ "$errors" = 0 ] && echo none || echo SEE_$D)"
    if [ -n "${PERF:-}" ]; then
        wait "$PERF_PID" 2>/dev/null || true
        # To a file, then the first 25 rows: `| head` would end perf with SIGPIPE (pipefail).
        perf report -i "$D/$name.perf" --no-children --sort dso,symbol --stdio -g none > "$D/$name.report" 2>/dev/null
        awk '/^ +[0-9]/ && n++ < 25' "$D/$name.report"
    fi
    kill "$GW" 2>/dev/null || true; wait "$GW" 2>/dev/null || true; GW=
done
echo "ratio: CPU per request relative to the first gateway listed; raw wrk output in $D"
finish
