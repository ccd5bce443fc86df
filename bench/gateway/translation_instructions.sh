#!/usr/bin/env bash
# The translation's cost in instructions (issue 29 item 7; a benchmark, not a test): the
# gateway's instructions per streamed request on `/v1/messages` and `/v1/responses` against the
# same conversation on `/v1/chat/completions`, counted by valgrind's callgrind. A count does not
# depend on what else the machine runs, so this is the number to read where the CPU-time
# benchmarks (messages_cpu.sh, responses_cpu.py) are too noisy to tell.
#
# One pdgate under callgrind in SGLang bootstrap PD mode in front of two fast mock engines
# (examples/stream_mock.rs: a chat stream is STREAM_CHUNKS (default 8) `delta.content` events
# plus the usage event); one keep-alive client sends N streamed requests per route and reads
# each to its end. Per round and route: the counters are zeroed, the N requests run, the
# counters are dumped; rounds alternate the routes. (The mock's 8 tokens meet max_tokens 8: the
# Responses stream ends `response.incomplete`, the Messages one with `max_tokens`.) Prints instructions per request and each
# route's ratio to chat (the median over rounds).
#
#   cargo build --release -p pdgate-gateway --bin pdgate-gateway --example stream_mock
#   bench/gateway/translation_instructions.sh     # ROUNDS=3 N=200 by default
#   ROUNDS=1 N=3 bench/gateway/translation_instructions.sh   # CI's smoke
#
# Fails (non-zero) on any answer that is not a 200 ending as its route's stream should.
set -euo pipefail
cd "$(dirname "$0")/../.."
T=${CARGO_TARGET_DIR:-target}
BIN=${BIN:-$T/release/pdgate-gateway}
MOCK=${MOCK:-$T/release/examples/stream_mock}
ROUNDS=${ROUNDS:-3}
N=${N:-200}

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
D=$(mktemp -d /tmp/pdgate-instructions.XXXXXX)
PIDS=()
cleanup() { kill "${PIDS[@]}" 2>/dev/null || true; wait 2>/dev/null || true; }
trap cleanup EXIT

PP=$(free_port); DP=$(free_port); GP=$(free_port)
"$MOCK" "$PP" prefill 0 & PIDS+=($!)
"$MOCK" "$DP" decode 0 & PIDS+=($!)
sleep 0.5
valgrind --tool=callgrind --callgrind-out-file="$D/cg.out" "$BIN" --port "$GP" --log-level warn --policy round_robin \
    --pd-disaggregation --prefill "http://127.0.0.1:$PP" 8998 --decode "http://127.0.0.1:$DP" > "$D/gateway.log" 2>&1 &
PIDS+=($!); GW=$!

python3 - "$GP" "$GW" "$D" "$ROUNDS" "$N" <<'PY'
import http.client, json, os, re, statistics, subprocess, sys, time

port, gw, d, rounds, n = int(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
system, user = "You answer briefly.", "The capital of France is"
bodies = {
    "chat": ("/v1/chat/completions", {"model": "mock-model", "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
                                      "max_tokens": 8, "stream": True, "stream_options": {"include_usage": True}}, b"data: [DONE]"),
    "messages": ("/v1/messages", {"model": "mock-model", "system": system, "messages": [{"role": "user", "content": user}], "max_tokens": 8,
                                  "stream": True}, b"event: message_stop"),
    "responses": ("/v1/responses", {"model": "mock-model", "instructions": system, "input": user, "max_output_tokens": 8, "stream": True},
                  b"event: response.incomplete"),
}

def run(kind: str, count: int) -> None:
    path, body, end = bodies[kind]
    data = json.dumps(body).encode()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    for _ in range(count):
        conn.request("POST", path, body=data, headers={"content-type": "application/json"})
        r = conn.getresponse()
        out = r.read()
        assert r.status == 200 and end in out, (kind, r.status, out[-300:])
    conn.close()

deadline = time.time() + 300
while True:
    try:
        run("chat", 1)
        break
    except Exception:
        if time.time() > deadline:
            raise
        time.sleep(1)
for kind in bodies:
    run(kind, 20)

def dump_total() -> int:
    before = set(os.listdir(d))
    subprocess.run(["callgrind_control", "-d", gw], check=True, capture_output=True)
    for _ in range(600):
        new = [f for f in set(os.listdir(d)) - before if f.startswith("cg.out")]
        if new:
            text = open(os.path.join(d, new[0])).read()
            m = re.search(r"^(?:summary|totals): (\d+)", text, re.M)
            if m:
                return int(m.group(1))
        time.sleep(0.1)
    raise SystemExit("no callgrind dump")

per = {k: [] for k in bodies}
for r in range(rounds):
    order = list(bodies) if r % 2 == 0 else list(reversed(bodies))
    for kind in order:
        subprocess.run(["callgrind_control", "-z", gw], check=True, capture_output=True)
        run(kind, n)
        per[kind].append(dump_total() / n)
        print(f"round {r + 1} {kind:9s} {per[kind][-1]:12.0f} instructions/request", flush=True)
for kind in bodies:
    print(f"median {kind:9s} {statistics.median(per[kind]):12.0f} instructions/request")
for kind in ("messages", "responses"):
    ratios = [a / b for a, b in zip(per[kind], per["chat"])]
    print(f"{kind}/chat per round: {' '.join(f'{x:.3f}' for x in ratios)}; median {statistics.median(ratios):.3f}")
PY
