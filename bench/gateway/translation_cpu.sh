#!/usr/bin/env bash
# The translations' cost in router CPU (issue 29 item 7; a benchmark, not a test): the router's
# CPU per streamed `/v1/messages` and `/v1/responses` request against the same conversation on
# `/v1/chat/completions`, through the same pdgate, in the same run. (Named messages_cpu.sh, and
# Messages only, before 2026-12-07 evening.) translation_instructions.sh counts instructions of
# the same setup: load-independent, but blind to the kernel's share, which the routes share.
#
# Three fast mock engines (examples/stream_mock.rs: a prefill and a decode in SGLang's bootstrap
# PD mode; a chat stream is STREAM_CHUNKS (default 8) `delta.content` events, each its own write,
# plus the usage event); one pdgate in front of them; wrk (-t2 -c32) sends streamed requests of
# the same conversation, alternating between the routes for ROUNDS rounds (so a noisy minute
# hits all alike; a round's order rotates); utime+stime of the gateway from /proc around each
# measured run. Prints each run, the medians, and per translated route the median over rounds
# of its ratio to chat in the same round.
#
#   cargo build --release -p pdgate-gateway --bin pdgate-gateway --example stream_mock
#   bench/gateway/translation_cpu.sh                # ROUNDS=5 DURATION=5s by default
#   ROUNDS=1 DURATION=1s bench/gateway/translation_cpu.sh   # CI's smoke
#
# Exits 1 after its output when a measured wrk run completed no request or saw errors.
set -euo pipefail
cd "$(dirname "$0")/../.."
T=${CARGO_TARGET_DIR:-target}
BIN=${BIN:-$T/release/pdgate-gateway}
MOCK=${MOCK:-$T/release/examples/stream_mock}
DURATION=${DURATION:-5s}
ROUNDS=${ROUNDS:-5}
ulimit -n 65536 2>/dev/null || true

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }
D=$(mktemp -d /tmp/pdgate-messages.XXXXXX)
PIDS=()
cleanup() { kill "${PIDS[@]}" 2>/dev/null || true; wait 2>/dev/null || true; }
trap cleanup EXIT
source bench/gateway/checks.sh  # check_wrk, finish

cat > "$D/chat.lua" <<'LUA'
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.body = '{"model":"mock-model","messages":[{"role":"system","content":"You answer briefly."},{"role":"user","content":"The capital of France is"}],"max_tokens":8,"stream":true,"stream_options":{"include_usage":true}}'
LUA
cat > "$D/messages.lua" <<'LUA'
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.body = '{"model":"mock-model","system":"You answer briefly.","messages":[{"role":"user","content":"The capital of France is"}],"max_tokens":8,"stream":true}'
LUA
cat > "$D/responses.lua" <<'LUA'
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.body = '{"model":"mock-model","instructions":"You answer briefly.","input":"The capital of France is","max_output_tokens":8,"stream":true}'
LUA

PP=$(free_port); DP=$(free_port); GP=$(free_port)
"$MOCK" "$PP" prefill 0 & PIDS+=($!)
"$MOCK" "$DP" decode 0 & PIDS+=($!)
sleep 0.5
"$BIN" --port "$GP" --log-level warn --policy round_robin --pd-disaggregation --prefill "http://127.0.0.1:$PP" 8998 \
    --decode "http://127.0.0.1:$DP" > "$D/gateway.log" 2>&1 & PIDS+=($!); GW=$!
G="http://127.0.0.1:$GP"
for _ in $(seq 200); do
    [ "$(curl -s -o /dev/null -w '%{http_code}' -H 'content-type: application/json' -d '{"model":"mock-model","max_tokens":1,"messages":[{"role":"user","content":"x"}]}' "$G/v1/messages")" = 200 ] && break
    sleep 0.3
done
# The translated stream must be Anthropic's: checked once before measuring.
curl -sN -H 'content-type: application/json' -d '{"model":"mock-model","max_tokens":8,"stream":true,"messages":[{"role":"user","content":"x"}]}' "$G/v1/messages" \
    | grep -q '^event: message_stop' || { echo "no message_stop from /v1/messages; log: $D" >&2; exit 1; }
curl -sN -H 'content-type: application/json' -d '{"model":"mock-model","max_output_tokens":8,"stream":true,"input":"x"}' "$G/v1/responses" \
    | grep -q '^event: response.incomplete' || { echo "no response.incomplete from /v1/responses; log: $D" >&2; exit 1; }
route() { case $1 in chat) echo "$G/v1/chat/completions" ;; messages) echo "$G/v1/messages" ;; responses) echo "$G/v1/responses" ;; esac; }
KINDS=(chat messages responses)
for kind in "${KINDS[@]}"; do wrk -t2 -c32 -d2s -s "$D/$kind.lua" "$(route $kind)" > /dev/null; done

tick=$(( 1000000 / $(getconf CLK_TCK) ))
printf '%-6s %-9s %9s %14s %8s\n' round route req/s 'router us/req' errors
ROWS="$D/rows.txt"
for round in $(seq "$ROUNDS"); do
    # Each round starts one route later: no route always runs first or last.
    shift_by=$(( (round - 1) % ${#KINDS[@]} ))
    for kind in "${KINDS[@]:$shift_by}" "${KINDS[@]:0:$shift_by}"; do
        g0=$(ticks "$GW")
        wrk -t2 -c32 -d"$DURATION" -s "$D/$kind.lua" "$(route $kind)" > "$D/$kind-$round.wrk"
        g1=$(ticks "$GW")
        check_wrk "$D/$kind-$round.wrk" "$kind round $round"
        n=$(awk '/requests in/ {print $1}' "$D/$kind-$round.wrk")
        rps=$(awk '/Requests\/sec/ {printf "%d", $2}' "$D/$kind-$round.wrk")
        errors=$(grep -E 'Non-2xx|Socket errors' "$D/$kind-$round.wrk" | tr -s ' ' | tr '\n' ';' || true)
        us=$(awk -v t=$((g1 - g0)) -v us=$tick -v n="$n" 'BEGIN {printf "%.1f", t * us / n}')
        printf '%-6s %-9s %9s %14s %8s\n' "$round" "$kind" "$rps" "$us" "${errors:-none}"
        echo "$round $kind $rps $us" >> "$ROWS"
    done
done
python3 - "$ROWS" <<'PY'
import statistics, sys
rows = [l.split() for l in open(sys.argv[1])]
by = {}
for r, kind, rps, us in rows:
    by.setdefault(kind, []).append((float(rps), float(us)))
for kind, vals in by.items():
    print(f"median {kind:9s} {statistics.median(v[0] for v in vals):9.0f} req/s {statistics.median(v[1] for v in vals):9.1f} us/req")
rounds = {}
for r, kind, rps, us in rows:
    rounds.setdefault(r, {})[kind] = float(us)
for kind in ("messages", "responses"):
    ratios = [v[kind] / v["chat"] for v in rounds.values() if "chat" in v and kind in v]
    print(f"{kind}/chat router CPU per request, per round:", " ".join(f"{x:.3f}" for x in ratios))
    print(f"{kind} median ratio: {statistics.median(ratios):.3f}")
PY
finish
