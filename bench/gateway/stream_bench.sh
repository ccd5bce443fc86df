#!/usr/bin/env bash
# Streaming benchmark (not a test): pdgate against peer gateways, same run, same mock engines.
#
# Three fast mock engines (examples/stream_mock.rs, one thread each: a regular worker, a prefill,
# a decode) answer OpenAI completions; a streamed answer is 8 content events, each its own write,
# plus the usage event when asked for it. wrk (-t2 -c32) drives each gateway in each scenario,
# one after the other, and the script reads utime+stime from /proc of the gateway and of the
# mocks around the measured run: req/s, the router's CPU per request, the workers' CPU per
# request (all mocks together).
#
#   cargo build --release -p pdgate-gateway --bin pdgate-gateway --example stream_mock
#   bench/gateway/stream_bench.sh                         # all gateways, all scenarios
#   BASE=/tmp/base/pdgate-gateway bench/gateway/stream_bench.sh   # also "pdgate-base": a previous build
#   GATEWAYS="pdgate smg" SCENARIOS="bootstrap:stream" bench/gateway/stream_bench.sh
#   MEMORY=1 GATEWAYS="pdgate smg" bench/gateway/stream_bench.sh  # RSS idle and with 1,000 slow streams
#   ROUNDS=5 bench/gateway/stream_bench.sh                # 5 interleaved rounds, then medians
#   CI's smoke, three runs (DURATION=1s each): ROUNDS=2 GATEWAYS="pdgate nginx-proxy"
#     SCENARIOS=regular:stream; GATEWAYS="pdgate smg vllm-router" SCENARIOS="bootstrap:whole
#     nixl:stream"; MEMORY=1 MEMORY_SECONDS=2 STREAMS=20 SLOW_MS=200 GATEWAYS=pdgate MEMORY_MODES=regular
#
# ROUNDS=N runs every scenario and gateway N times, round after round (so a noisy minute hits
# every gateway alike), prints each round, then the median of each column per gateway and
# scenario, then for each peer the median over rounds of pdgate's ratio to it in the same round
# (req/s, router CPU and workers' CPU per request): on a shared machine one run's ratios move by
# 20 % or more.
#
# Scenarios (MODE:KIND): MODE is regular (one worker), bootstrap (SGLang PD: both legs at once,
# the same body to each) or nixl (vLLM PD: the prefill first, max_tokens 1, then the decode);
# KIND is stream (8 chunks) or whole (non-streamed). A gateway is run only in the modes it
# speaks: pdgate all three, vllm-router regular and nixl (its --vllm-pd-disaggregation), smg
# regular and bootstrap. Every gateway routes round robin. `nginx-proxy` (regular mode only, not
# in the default list) is a floor: nginx, one process, relaying the stream unbuffered over
# keep-alive connections, with no parsing, routing or accounting: what two loopback hops per
# chunk cost in a lean C event loop (`apt-get install nginx-light`).
#
# Peers: `pip install vllm-router smg==1.13.0` (VLLM_ROUTER and SMG name their commands).
# MEMORY=1: the decode (and regular) mock waits SLOW_MS (default 1000) between 30 chunks, wrk
# holds STREAMS (default 1000) streams open through the gateway, and the gateway's VmRSS is
# read idle (after a warm-up) and after MEMORY_SECONDS (default 15) of that load.
#
# Exits 1 after its output when a gateway never routed or a measured wrk run saw errors.
set -euo pipefail
cd "$(dirname "$0")/../.."
T=${CARGO_TARGET_DIR:-target}
BIN=${BIN:-$T/release/pdgate-gateway}
MOCK=${MOCK:-$T/release/examples/stream_mock}
BASE=${BASE:-}
VLLM_ROUTER=${VLLM_ROUTER:-vllm-router}
SMG=${SMG:-smg}
DURATION=${DURATION:-5s}
SCENARIOS=${SCENARIOS:-regular:stream regular:whole bootstrap:stream bootstrap:whole nixl:stream nixl:whole}
GATEWAYS=${GATEWAYS:-pdgate${BASE:+ pdgate-base} vllm-router smg}
ulimit -n 65536 2>/dev/null || true

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }
rss_kb() { awk '/VmRSS/ {print $2}' "/proc/$1/status"; }
D=$(mktemp -d /tmp/pdgate-stream.XXXXXX)
PIDS=()
GW=
cleanup() { kill $GW "${PIDS[@]}" 2>/dev/null || true; wait 2>/dev/null || true; }
trap cleanup EXIT
source bench/gateway/checks.sh  # check_wrk, fail, finish

cat > "$D/stream.lua" <<'EOF'
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.body = '{"model":"mock-model","prompt":"The capital of France is","max_tokens":8,"stream":true}'
EOF
cat > "$D/whole.lua" <<'EOF'
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.body = '{"model":"mock-model","prompt":"The capital of France is","max_tokens":8}'
EOF

RP=$(free_port); PP=$(free_port); DP=$(free_port)
DELAY=0; [ -n "${MEMORY:-}" ] && DELAY=${SLOW_MS:-1000}
[ -n "${MEMORY:-}" ] && export STREAM_CHUNKS=30
"$MOCK" "$RP" decode "$DELAY" & PIDS+=($!); MR=$!
"$MOCK" "$PP" prefill 0 & PIDS+=($!); MP=$!
"$MOCK" "$DP" decode "$DELAY" & PIDS+=($!); MD=$!
R="http://127.0.0.1:$RP"; P="http://127.0.0.1:$PP"; DE="http://127.0.0.1:$DP"
sleep 0.5

speaks() {  # speaks GATEWAY MODE
    case "$1:$2" in
        vllm-router:bootstrap|smg:nixl|nginx-proxy:bootstrap|nginx-proxy:nixl) return 1 ;;
        *) return 0 ;;
    esac
}

start() {  # start GATEWAY MODE PORT; sets GW
    local bin=$BIN args
    case $1 in
        pdgate|pdgate-base)
            [ "$1" = pdgate-base ] && bin=$BASE
            case $2 in
                regular) args=(--worker-urls "$R") ;;
                bootstrap) args=(--pd-disaggregation --prefill "$P" 8998 --decode "$DE") ;;
                nixl) args=(--vllm-pd-disaggregation --prefill "$P" --decode "$DE") ;;
            esac
            "$bin" --port "$3" --log-level warn --policy round_robin "${args[@]}" ${PDGATE_ARGS:-} > "$D/$1-$2.log" 2>&1 & GW=$! ;;
        vllm-router)
            case $2 in
                regular) args=(--worker-urls "$R") ;;
                nixl) args=(--vllm-pd-disaggregation --prefill "$P" --decode "$DE") ;;
            esac
            $VLLM_ROUTER --host 127.0.0.1 --port "$3" --log-level warning --policy round_robin "${args[@]}" > "$D/$1-$2.log" 2>&1 & GW=$! ;;
        smg)
            case $2 in
                regular) args=(--worker-urls "$R") ;;
                bootstrap) args=(--pd-disaggregation --prefill "$P" 8998 --decode "$DE") ;;
            esac
            $SMG launch --host 127.0.0.1 --port "$3" --log-level warn --policy round_robin "${args[@]}" > "$D/$1-$2.log" 2>&1 & GW=$! ;;
        nginx-proxy)
            nginx_proxy_conf "$D" "$3" "$RP" "proxy_buffering off;" > "$D/proxy.conf"
            nginx -p "$D" -c "$D/proxy.conf" -g 'daemon off;' > "$D/$1-$2.log" 2>&1 & GW=$! ;;
    esac
}

# nginx-proxy: bench/gateway/nginx_proxy.sh
source bench/gateway/nginx_proxy.sh  # the cwd is the repo root

# Waits until the gateway routes a request (at most ~60 s).
wait_routing() {
    for _ in $(seq 200); do
        [ "$(curl -s -o /dev/null -w '%{http_code}' -H 'content-type: application/json' -d '{"model":"mock-model","prompt":"x","max_tokens":1}' "$1")" = 200 ] && return 0
        sleep 0.3
    done
    echo "gateway at $1 never routed a request; log: $D" >&2
    return 1
}

# The gateway's process: a Python launcher may exec or fork the Rust server.
gw_pid() {
    local child
    child=$(pgrep -P "$GW" | head -1 || true)
    echo "${child:-$GW}"
}

stop() { kill "$GW" 2>/dev/null || true; wait "$GW" 2>/dev/null || true; GW=; }

# up GATEWAY MODE KIND: starts the gateway, waits until it routes, warms it up for 2 s with
# KIND requests; sets URL and pid. Fails (gateway stopped) when it never routes.
up() {
    local port
    port=$(free_port); start "$1" "$2" "$port"
    URL="http://127.0.0.1:$port/v1/completions"
    wait_routing "$URL" || { stop; return 1; }
    pid=$(gw_pid)
    wrk -t2 -c32 -d2s -s "$D/$3.lua" "$URL" > /dev/null
}

if [ -n "${MEMORY:-}" ]; then
    printf '%-12s %-10s %10s %12s %12s %14s\n' gateway mode idle_MiB loaded_MiB streams KiB/stream
    for name in $GATEWAYS; do
        for mode in ${MEMORY_MODES:-regular bootstrap}; do
            speaks "$name" "$mode" || continue
            up "$name" "$mode" whole || { fail "$name $mode never routed"; continue; }
            sleep 1
            idle=$(rss_kb "$pid")
            wrk -t2 -c"${STREAMS:-1000}" -d$((${MEMORY_SECONDS:-15} + 10))s --timeout 60s -s "$D/stream.lua" "$URL" > "$D/$name-$mode-mem.wrk" &
            WRK=$!
            sleep "${MEMORY_SECONDS:-15}"
            loaded=$(rss_kb "$pid")
            open=$(ls /proc/"$pid"/fd | wc -l)
            wait $WRK || true
            printf '%-12s %-10s %10.1f %12.1f %12s %14.1f\n' "$name" "$mode" "$(echo "$idle/1024" | bc -l)" "$(echo "$loaded/1024" | bc -l)" \
                "${STREAMS:-1000}" "$(echo "($loaded-$idle)/${STREAMS:-1000}" | bc -l)"
            echo "  (open fds under load: $open)"
            stop
        done
    done
    finish
    exit 0
fi

printf '%-12s %-18s %9s %14s %14s %8s  %s\n' gateway scenario req/s 'router us/req' 'workers us/req' errors 'prefill posts/streamed'
ROWS="$D/rows.txt"
for round in $(seq "${ROUNDS:-1}"); do
    [ "${ROUNDS:-1}" -gt 1 ] && echo "-- round $round"
    for scenario in $SCENARIOS; do
        mode=${scenario%%:*}; kind=${scenario##*:}
        for name in $GATEWAYS; do
            speaks "$name" "$mode" || continue
            up "$name" "$mode" "$kind" || { fail "$name $scenario never routed"; continue; }
            s0=$(curl -s "$P/stats")
            g0=$(ticks "$pid"); w0=$(( $(ticks $MR) + $(ticks $MP) + $(ticks $MD) ))
            wrk -t2 -c32 -d"$DURATION" -s "$D/$kind.lua" "$URL" > "$D/$name-$scenario.wrk"
            g1=$(ticks "$pid"); w1=$(( $(ticks $MR) + $(ticks $MP) + $(ticks $MD) ))
            s1=$(curl -s "$P/stats")
            check_wrk "$D/$name-$scenario.wrk" "$name $scenario"
            n=$(awk '/requests in/ {print $1}' "$D/$name-$scenario.wrk")
            rps=$(awk '/Requests\/sec/ {printf "%d", $2}' "$D/$name-$scenario.wrk")
            errors=$(grep -E 'Non-2xx|Socket errors' "$D/$name-$scenario.wrk" | tr -s ' ' | tr '\n' ';' || true)
            tick=$(( 1000000 / $(getconf CLK_TCK) ))
            printf '%-12s %-18s %9s %14s %14s %8s  %s -> %s\n' "$name" "$scenario" "$rps" \
                "$(awk -v t=$((g1 - g0)) -v us=$tick -v n="$n" 'BEGIN {printf "%.1f", t * us / n}')" \
                "$(awk -v t=$((w1 - w0)) -v us=$tick -v n="$n" 'BEGIN {printf "%.1f", t * us / n}')" \
                "${errors:-none}" "$s0" "$s1" | tee -a "$ROWS"
            stop
        done
    done
done
if [ "${ROUNDS:-1}" -gt 1 ]; then
    echo "-- medians over $ROUNDS rounds"
    printf '%-12s %-18s %9s %14s %14s\n' gateway scenario req/s 'router us/req' 'workers us/req'
    # Rows in first-seen order; for each, the median of each numeric column.
    awk '{ k = $1 " " $2; if (!(k in n)) order[++m] = k; n[k]++; r[k, n[k]] = $3; g[k, n[k]] = $4; w[k, n[k]] = $5 }
        function med(a, k, c,    i, j, t, v) {
            for (i = 1; i <= c; i++) v[i] = a[k, i]
            for (i = 2; i <= c; i++) { t = v[i]; for (j = i - 1; j >= 1 && v[j] > t; j--) v[j + 1] = v[j]; v[j + 1] = t }
            return c % 2 ? v[(c + 1) / 2] : (v[c / 2] + v[c / 2 + 1]) / 2
        }
        END { for (i = 1; i <= m; i++) { k = order[i]; split(k, p, " ")
            printf "%-12s %-18s %9d %14.1f %14.1f\n", p[1], p[2], med(r, k, n[k]), med(g, k, n[k]), med(w, k, n[k]) } }' "$ROWS"
    echo "-- pdgate / peer, each round's pair (run seconds apart), then the median of those ratios"
    printf '%-12s %-18s %9s %14s %14s  %s\n' peer scenario req/s 'router CPU' 'workers CPU' 'per round (req/s, router CPU)'
    # Round i's pdgate row of a scenario over round i's peer row: slow drifts of a shared
    # machine hit both alike, so the ratio moves less than either.
    awk '{ k = $1 " " $2; n[k]++; r[k, n[k]] = $3; g[k, n[k]] = $4; w[k, n[k]] = $5; if (!($2 in seen)) { seen[$2] = 1; sc[++ns] = $2 }
           if (!(($2, $1) in has)) { has[$2, $1] = 1; peers[$2] = peers[$2] " " $1 } }
        function med(a, c,    i, j, t) {
            for (i = 2; i <= c; i++) { t = a[i]; for (j = i - 1; j >= 1 && a[j] > t; j--) a[j + 1] = a[j]; a[j + 1] = t }
            return c % 2 ? a[(c + 1) / 2] : (a[c / 2] + a[c / 2 + 1]) / 2
        }
        END { for (s = 1; s <= ns; s++) { q = split(peers[sc[s]], list, " ")
            for (x = 1; x <= q; x++) { peer = list[x]; if (peer ~ /^pdgate/) continue
                a = "pdgate " sc[s]; b = peer " " sc[s]; c = n[a] < n[b] ? n[a] : n[b]; if (c == 0) continue
                detail = ""
                for (i = 1; i <= c; i++) { rr[i] = r[a, i] / r[b, i]; gg[i] = g[a, i] / g[b, i]; ww[i] = w[a, i] / w[b, i]
                    detail = detail sprintf(" %.2f/%.2f", rr[i], gg[i]) }
                printf "%-12s %-18s %8.2fx %13.2fx %13.2fx %s\n", peer, sc[s], med(rr, c), med(gg, c), med(ww, c), detail } } }' "$ROWS"
fi
echo "raw wrk output and gateway logs in $D"
finish
