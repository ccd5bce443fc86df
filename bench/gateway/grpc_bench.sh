#!/usr/bin/env bash
# gRPC benchmark (not a test): the gateway's CPU per request and req/s with gRPC workers, pdgate
# against SMG's gRPC mode, plus pdgate in HTTP mode as the relay-only reference, same run, same
# machine, fast mock workers (so the gateway is what is measured).
#
# Workers: examples/grpc_mock.rs (SGLang's SglangScheduler service; 8 token ids per answer that
# detokenize to real text in the exported tiny tokenizer, each streamed token its own message)
# and, for pdgate-http, examples/stream_mock.rs (the same 8 events as OpenAI SSE). One thread each.
# wrk (-t2 -c$CONNECTIONS, 2 s warm-up, $DURATION measured) drives each gateway in each scenario,
# one after the other; the script reads utime+stime from /proc of the gateway's process tree and of
# the mocks around the measured run. Every gateway routes round robin. In gRPC mode a gateway
# tokenizes the prompt (chat: renders the chat template first), detokenizes the ids and writes
# the OpenAI JSON/SSE itself; in HTTP mode it relays the engine's bytes.
#
#   cargo build --release -p pdgate-gateway --bin pdgate-gateway --example grpc_mock --example stream_mock
#   pip install smg==1.13.0
#   bench/gateway/grpc_bench.sh                         # all gateways, regular mode, 4 scenarios, 2 rounds
#   BASE=/tmp/base/pdgate-gateway bench/gateway/grpc_bench.sh     # also "pdgate-base": a previous build
#   MODES="regular bootstrap" ROUNDS=1 bench/gateway/grpc_bench.sh  # also SGLang bootstrap PD over gRPC
#   ROUNDS=1 DURATION=1s MODES=bootstrap SCENARIOS="completions:whole chat:stream" ...  # CI's smoke
#
# Scenarios (ROUTE:KIND): ROUTE is completions (/v1/completions, a short prompt) or chat
# (/v1/chat/completions, one user message); KIND is whole or stream. pdgate-http runs the
# completions scenarios only (the HTTP mock writes completions-shaped events). Modes: regular
# (one worker) and bootstrap (SGLang PD: both legs at once; the prefill mock answers one token).
# Rounds alternate the gateways' order. At the end: pdgate-grpc's CPU/request over smg-grpc's,
# per scenario and round (the issue's target: <= 0.5). Exits 1 after its output when a gateway
# never routed, an answer lacked what the mock sent, or a measured wrk run saw errors.
#
# MODEL_DIR: the model directory both gateways load the tokenizer from (default: written with
# `python -m pdgate.engine --model tiny --export-tokenizer`, from this checkout's python/).
set -euo pipefail
cd "$(dirname "$0")/../.."
T=${CARGO_TARGET_DIR:-target}
BIN=${BIN:-$T/release/pdgate-gateway}
GMOCK=${GMOCK:-$T/release/examples/grpc_mock}
HMOCK=${HMOCK:-$T/release/examples/stream_mock}
BASE=${BASE:-}
SMG=${SMG:-smg}
DURATION=${DURATION:-5s}
CONNECTIONS=${CONNECTIONS:-32}
ROUNDS=${ROUNDS:-2}
MODES=${MODES:-regular}
SCENARIOS=${SCENARIOS:-completions:whole completions:stream chat:whole chat:stream}
GATEWAYS=${GATEWAYS:-pdgate-grpc${BASE:+ pdgate-base-grpc} smg-grpc pdgate-http}
ulimit -n 65536 2>/dev/null || true
for exe in "$BIN" "$GMOCK" "$HMOCK"; do
    [ -x "$exe" ] || { echo "missing $exe: cargo build --release -p pdgate-gateway --bin pdgate-gateway --example grpc_mock --example stream_mock" >&2; exit 2; }
done

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
# utime + stime (ticks) of a process and all its descendants.
tree_ticks() {
    local total=0 p
    for p in "$@"; do
        [ -r "/proc/$p/stat" ] && total=$(( total + $(awk '{print $14 + $15}' "/proc/$p/stat") ))
    done
    echo "$total"
}
descendants() {
    local p=$1 c
    echo "$p"
    for c in $(pgrep -P "$p" || true); do descendants "$c"; done
}
D=$(mktemp -d /tmp/pdgate-grpc-bench.XXXXXX)
PIDS=()
GW=
cleanup() { kill $GW "${PIDS[@]}" 2>/dev/null || true; wait 2>/dev/null || true; }
trap cleanup EXIT
source bench/gateway/checks.sh  # check_wrk, fail, finish

MODEL_DIR=${MODEL_DIR:-$D/model}
if [ ! -f "$MODEL_DIR/tokenizer.json" ]; then
    PYTHONPATH=python${PYTHONPATH:+:$PYTHONPATH} python3 -m pdgate.engine --model tiny --export-tokenizer "$MODEL_DIR" > /dev/null
fi

body() {  # body ROUTE KIND
    local stream=false
    [ "$2" = stream ] && stream=true
    case $1 in
        completions) echo "{\"model\":\"mock-model\",\"prompt\":\"The capital of France is\",\"max_tokens\":8,\"stream\":$stream}" ;;
        chat) echo "{\"model\":\"mock-model\",\"messages\":[{\"role\":\"user\",\"content\":\"What is the capital of France?\"}],\"max_tokens\":8,\"stream\":$stream}" ;;
    esac
}
path() { [ "$1" = chat ] && echo /v1/chat/completions || echo /v1/completions; }
for route in completions chat; do
    for kind in whole stream; do
        printf 'wrk.method = "POST"\nwrk.headers["Content-Type"] = "application/json"\nwrk.body = %s\n' "'$(body $route $kind)'" > "$D/$route-$kind.lua"
    done
done

# Mocks: a regular worker, a prefill and a decode of each kind.
GR=$(free_port); GP=$(free_port); GD=$(free_port); HR=$(free_port); HP=$(free_port); HD=$(free_port)
"$GMOCK" "$GR" regular "$MODEL_DIR" 2> "$D/grpc-regular.mock" & PIDS+=($!); MGR=$!
"$GMOCK" "$GP" prefill "$MODEL_DIR" 2> "$D/grpc-prefill.mock" & PIDS+=($!); MGP=$!
"$GMOCK" "$GD" decode "$MODEL_DIR" 2> "$D/grpc-decode.mock" & PIDS+=($!); MGD=$!
"$HMOCK" "$HR" decode 0 & PIDS+=($!); MHR=$!
"$HMOCK" "$HP" prefill 0 & PIDS+=($!); MHP=$!
"$HMOCK" "$HD" decode 0 & PIDS+=($!); MHD=$!
MOCKS="$MGR $MGP $MGD $MHR $MHP $MHD"
sleep 0.5

speaks() {  # speaks GATEWAY ROUTE
    [ "$1" != pdgate-http ] || [ "$2" = completions ]
}

start() {  # start GATEWAY MODE PORT; sets GW
    local bin=$BIN scheme=grpc r=$GR p=$GP d=$GD args
    case $1 in
        pdgate-base-grpc) bin=$BASE ;;
        pdgate-http) scheme=http; r=$HR; p=$HP; d=$HD ;;
    esac
    case $2 in
        regular) args=(--worker-urls "$scheme://127.0.0.1:$r") ;;
        bootstrap) args=(--pd-disaggregation --prefill "$scheme://127.0.0.1:$p" 8998 --decode "$scheme://127.0.0.1:$d") ;;
    esac
    case $1 in
        pdgate-grpc|pdgate-base-grpc)
            "$bin" --port "$3" --log-level warn --policy round_robin --model-path "$MODEL_DIR" "${args[@]}" > "$D/$1-$2.log" 2>&1 & GW=$! ;;
        pdgate-http)
            "$bin" --port "$3" --log-level warn --policy round_robin "${args[@]}" > "$D/$1-$2.log" 2>&1 & GW=$! ;;
        smg-grpc)
            $SMG launch --host 127.0.0.1 --port "$3" --prometheus-port "$(free_port)" --log-level warn --policy round_robin --model-path "$MODEL_DIR" "${args[@]}" > "$D/$1-$2.log" 2>&1 & GW=$! ;;
    esac
}

# Waits until the gateway answers a completion (at most ~60 s); keeps the answer for the log.
wait_routing() {  # wait_routing BASE_URL NAME MODE
    for _ in $(seq 200); do
        if [ "$(curl -s -o "$D/$2-$3.first" -w '%{http_code}' -H 'content-type: application/json' -d "$(body completions whole)" "$1/v1/completions")" = 200 ]; then
            return 0
        fi
        sleep 0.3
    done
    echo "gateway $2 at $1 never routed a request; log: $D/$2-$3.log" >&2
    return 1
}

stop() { kill "$GW" 2>/dev/null || true; wait "$GW" 2>/dev/null || true; GW=; }

RESULTS=$D/results.tsv
: > "$RESULTS"
printf '%-5s %-17s %-10s %-18s %9s %14s %14s %8s\n' round gateway mode scenario req/s 'gateway us/req' 'workers us/req' errors
tick=$(( 1000000 / $(getconf CLK_TCK) ))
for round in $(seq "$ROUNDS"); do
    order=$GATEWAYS
    [ $((round % 2)) = 0 ] && order=$(echo "$GATEWAYS" | tr ' ' '\n' | tac | tr '\n' ' ')
    for mode in $MODES; do
        for name in $order; do
            port=$(free_port); start "$name" "$mode" "$port"
            URL="http://127.0.0.1:$port"
            wait_routing "$URL" "$name" "$mode" || { fail "$name $mode never routed"; stop; continue; }
            pids=$(descendants "$GW")
            for scenario in $SCENARIOS; do
                route=${scenario%%:*}; kind=${scenario##*:}
                speaks "$name" "$route" || continue
                # A whole answer must carry the mock's text (the gateway detokenized the ids), a
                # stream its end.
                a=$D/$name-$mode-$scenario.answer
                curl -s -H 'content-type: application/json' -d "$(body "$route" "$kind")" "$URL$(path "$route")" > "$a"
                want='The qui'
                [ "$kind" = stream ] && want='[DONE]'
                [ "$name" = pdgate-http ] && [ "$kind" = whole ] && want=' tok'
                grep -qF "$want" "$a" || fail "$name $mode $scenario: answer without '$want': $(head -c 300 "$a")"
                wrk -t2 -c"$CONNECTIONS" -d2s -s "$D/$route-$kind.lua" "$URL$(path "$route")" > /dev/null
                g0=$(tree_ticks $pids); w0=$(tree_ticks $MOCKS)
                wrk -t2 -c"$CONNECTIONS" -d"$DURATION" -s "$D/$route-$kind.lua" "$URL$(path "$route")" > "$D/$round-$name-$mode-$scenario.wrk"
                g1=$(tree_ticks $pids); w1=$(tree_ticks $MOCKS)
                out=$D/$round-$name-$mode-$scenario.wrk
                check_wrk "$out" "$name $mode $scenario"
                n=$(awk '/requests in/ {print $1}' "$out")
                rps=$(awk '/Requests\/sec/ {printf "%d", $2}' "$out")
                errors=$(grep -E 'Non-2xx|Socket errors' "$out" | tr -s ' ' | tr '\n' ';' || true)
                gus=$(awk -v t=$((g1 - g0)) -v us=$tick -v n="$n" 'BEGIN {printf "%.1f", t * us / n}')
                wus=$(awk -v t=$((w1 - w0)) -v us=$tick -v n="$n" 'BEGIN {printf "%.1f", t * us / n}')
                printf '%-5s %-17s %-10s %-18s %9s %14s %14s %8s\n' "$round" "$name" "$mode" "$scenario" "$rps" "$gus" "$wus" "${errors:-none}"
                printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$round" "$name" "$mode" "$scenario" "$rps" "$gus" >> "$RESULTS"
            done
            stop
        done
    done
done

echo
echo "pdgate-grpc / smg-grpc (CPU per request; req/s), per round:"
awk -F'\t' '
    { cpu[$1 FS $2 FS $3 FS $4] = $6; rps[$1 FS $2 FS $3 FS $4] = $5; key[$1 FS $3 FS $4] = 1 }
    END {
        for (k in key) {
            split(k, f, FS)
            p = f[1] FS "pdgate-grpc" FS f[2] FS f[3]; s = f[1] FS "smg-grpc" FS f[2] FS f[3]
            if ((p in cpu) && (s in cpu) && cpu[s] > 0 && rps[s] > 0)
                printf "  round %s %-10s %-18s CPU %.2fx  req/s %.2fx\n", f[1], f[2], f[3], cpu[p] / cpu[s], rps[p] / rps[s]
        }
    }' "$RESULTS" | sort
# The gRPC mocks' call counts (all gateways and rounds together), printed when they stop.
kill $MGR $MGP $MGD 2>/dev/null || true
wait $MGR $MGP $MGD 2>/dev/null || true
for m in regular prefill decode; do echo "grpc mock $m: $(grep 'grpc_mock calls' "$D/grpc-$m.mock" || echo '(no count)')"; done
echo "raw wrk output, answers and gateway logs in $D"
finish
