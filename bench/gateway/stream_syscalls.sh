#!/usr/bin/env bash
# What one regular stream costs a gateway, split (a measurement, not a test): user and kernel
# CPU per request, syscalls and context switches per request, and the mock worker's CPU per
# request, for each build given, round after round. Complements stream_bench.sh (which compares
# gateways): this one says where a build's CPU goes and whether a change moved user or kernel
# time. Needs `perf` (perf stat on the gateway's threads).
#
#   cargo build --release -p pdgate-gateway --bin pdgate-gateway --example stream_mock
#   bench/gateway/stream_syscalls.sh OLD_BIN NEW_BIN        # 3 rounds, each build once a round
#   ROUNDS=5 PROMPT_BYTES=16000 bench/gateway/stream_syscalls.sh OLD_BIN NEW_BIN
#   bench/gateway/stream_syscalls.sh BIN nginx-proxy vllm-router   # against the floor and a peer
#   ROUNDS=1 WINDOW=1 bench/gateway/stream_syscalls.sh BIN nginx-proxy vllm-router   # CI's smoke
#
# A build is a pdgate binary or one of the names `nginx-proxy` (bench/gateway/nginx_proxy.sh)
# and `vllm-router` (VLLM_ROUTER, default `vllm-router` on PATH). Besides the totals, each row
# says how the syscalls split: reads (recvfrom), vectored writes (writev), plain sends (sendto)
# and event-loop waits (epoll_wait) per request.
#
# PROMPT_BYTES: the prompt's size (default: a short one), to see costs that grow with the body.
# CHUNK_DELAY_MS=N paces the mock's events N ms apart (an engine's inter-token gap) and CONNS
# (default 32) sets wrk's connections: with back-to-back events (the default, 0) a gateway that
# returns to its event loop sooner reads fewer events per read, so a user-time saving shows up
# as more syscalls per request; paced events are read one at a time by every build, which
# measures the per-event cost alone. WINDOW (default 5): the seconds perf counts, inside a wrk
# run of WINDOW + 2. Exits 1 after its table when a wrk run saw errors or no request was counted.
set -euo pipefail
cd "$(dirname "$0")/../.."
T=${CARGO_TARGET_DIR:-target}
MOCK=${MOCK:-$T/release/examples/stream_mock}
VLLM_ROUTER=${VLLM_ROUTER:-vllm-router}
source bench/gateway/nginx_proxy.sh
[ $# -ge 1 ] || { echo "usage: $0 GATEWAY_BIN..." >&2; exit 2; }
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
D=$(mktemp -d /tmp/pdgate-syscalls.XXXXXX)
PIDS=()
cleanup() { kill "${PIDS[@]}" 2>/dev/null || true; wait 2>/dev/null || true; }
trap cleanup EXIT
source bench/gateway/checks.sh  # check_wrk, fail, finish
WINDOW=${WINDOW:-5}
prompt=$(python3 -c "import sys; n=int(sys.argv[1]); print(('The capital of France is ' * (n // 25 + 1))[:n] if n else 'The capital of France is')" "${PROMPT_BYTES:-0}")
cat > "$D/stream.lua" <<LUA
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.body = '{"model":"mock-model","prompt":"$prompt","max_tokens":8,"stream":true}'
LUA
WP=$(free_port)
"$MOCK" "$WP" decode "${CHUNK_DELAY_MS:-0}" & PIDS+=($!); MOCK_PID=$!
sleep 0.5
ticks() { awk '{print $14, $15}' "/proc/$1/stat"; }
posts() { curl -s "http://127.0.0.1:$WP/stats" | python3 -c 'import json,sys; print(json.load(sys.stdin)["posts"])'; }
printf '%-28s %8s %8s %8s %8s %9s %9s %22s\n' build req/s 'user us' 'kern us' 'mock us' syscalls switches 'recv/writev/send/epoll'
for round in $(seq "${ROUNDS:-3}"); do
    for bin in "$@"; do
        port=$(free_port)
        case $bin in
            nginx-proxy)
                nginx_proxy_conf "$D" "$port" "$WP" "proxy_buffering off;" > "$D/proxy.conf"
                nginx -p "$D" -c "$D/proxy.conf" -g 'daemon off;' > "$D/gw.log" 2>&1 & GW=$! ;;
            vllm-router)
                $VLLM_ROUTER --host 127.0.0.1 --port "$port" --log-level warning --policy round_robin --worker-urls "http://127.0.0.1:$WP" > "$D/gw.log" 2>&1 & GW=$! ;;
            *)
                "$bin" --port "$port" --log-level warn --policy round_robin --worker-urls "http://127.0.0.1:$WP" > "$D/gw.log" 2>&1 & GW=$! ;;
        esac
        # Ready when it relays (nginx has no /health of its own; it proxies the mock's).
        for _ in $(seq 200); do curl -s -o /dev/null -f "http://127.0.0.1:$port/health" && break; sleep 0.1; done
        wrk -t2 -c"${CONNS:-32}" -d2s -s "$D/stream.lua" "http://127.0.0.1:$port/v1/completions" > /dev/null
        wrk -t2 -c"${CONNS:-32}" -d$((WINDOW + 2))s -s "$D/stream.lua" "http://127.0.0.1:$port/v1/completions" > "$D/wrk.txt" & WRK=$!
        sleep 1
        read -r u0 s0 < <(ticks "$GW"); read -r mu0 ms0 < <(ticks "$MOCK_PID"); n0=$(posts)
        perf stat -x, -e raw_syscalls:sys_enter,context-switches,syscalls:sys_enter_recvfrom,syscalls:sys_enter_writev,syscalls:sys_enter_sendto,syscalls:sys_enter_epoll_wait -p "$GW" -o "$D/stat.csv" -- sleep "$WINDOW" 2>/dev/null
        read -r u1 s1 < <(ticks "$GW"); read -r mu1 ms1 < <(ticks "$MOCK_PID"); n1=$(posts)
        wait $WRK
        kill "$GW"; wait "$GW" 2>/dev/null || true
        tick=$(( 1000000 / $(getconf CLK_TCK) ))
        n=$((n1 - n0))
        check_wrk "$D/wrk.txt" "$bin round $round"
        [ "$n" -gt 0 ] || { fail "$bin round $round: the mock counted no request in the window"; continue; }
        count() { awk -F, -v e="$1" -v n="$n" '$3 == e {printf "%.2f", $1 / n}' "$D/stat.csv"; }
        split="$(count syscalls:sys_enter_recvfrom)/$(count syscalls:sys_enter_writev)/$(count syscalls:sys_enter_sendto)/$(count syscalls:sys_enter_epoll_wait)"
        name=$bin; [ -f "$bin" ] && name="$(basename "$(dirname "$bin")")/$(basename "$bin")"
        printf '%-28.28s %8d %8.1f %8.1f %8.1f %9s %9s %22s\n' "$name" "$((n / WINDOW))" \
            "$(echo "($u1 - $u0) * $tick / $n" | bc -l)" "$(echo "($s1 - $s0) * $tick / $n" | bc -l)" \
            "$(echo "($mu1 + $ms1 - $mu0 - $ms0) * $tick / $n" | bc -l)" "$(count raw_syscalls:sys_enter)" "$(count context-switches)" "$split"
    done
done
finish
