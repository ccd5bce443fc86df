#!/usr/bin/env bash
# The README's first command, as a new user runs it: a fresh venv, `pip install .` with no
# extras, `pdgate quickstart`, one completion through the gateway, then Ctrl-C (SIGINT) must
# leave no worker process behind. CI runs this before the test suite (.ci/run).
set -euo pipefail
cd "$(dirname "$0")/.."

export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/pdgate/target}"
PY="${PYTHON:-python3}"
WORK="$(mktemp -d)"
QS_PID=""
cleanup() {
    [ -n "$QS_PID" ] && kill -9 "$QS_PID" 2>/dev/null || true
    rm -rf "$WORK"
}
trap cleanup EXIT

echo "== smoke: fresh venv, pip install . (no extras)"
"$PY" -m venv "$WORK/venv"
"$WORK/venv/bin/python" -m pip install -q --disable-pip-version-check .

PORT="$("$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')"
echo "== smoke: pdgate quickstart --port $PORT"
# Run from the work dir so `import pdgate` can only find the venv's installed copy.
(cd "$WORK" && exec "$WORK/venv/bin/pdgate" quickstart --port "$PORT" >"$WORK/qs.log" 2>&1) &
QS_PID=$!

for _ in $(seq 1 240); do
    grep -q "gateway ready at" "$WORK/qs.log" && break
    if ! kill -0 "$QS_PID" 2>/dev/null; then
        echo "smoke: quickstart exited early:"; cat "$WORK/qs.log"; exit 1
    fi
    sleep 0.5
done
grep -q "gateway ready at" "$WORK/qs.log" || { echo "smoke: quickstart not ready in 120 s:"; cat "$WORK/qs.log"; exit 1; }
WORKER_PIDS="$(sed -n 's/.* worker at .*(pid \([0-9]*\),.*/\1/p' "$WORK/qs.log")"
[ -n "$WORKER_PIDS" ] || { echo "smoke: quickstart printed no worker pids:"; cat "$WORK/qs.log"; exit 1; }
grep -q "log /" "$WORK/qs.log" || { echo "smoke: quickstart did not say where the worker logs are"; cat "$WORK/qs.log"; exit 1; }

"$WORK/venv/bin/python" - "$PORT" <<'PYEOF'
import json, sys, urllib.request
port = sys.argv[1]
req = urllib.request.Request(
    f"http://127.0.0.1:{port}/v1/completions",
    data=json.dumps({"model": "tiny", "prompt": "The capital of France is", "max_tokens": 8}).encode(),
    headers={"content-type": "application/json"})
with urllib.request.urlopen(req, timeout=60) as r:
    body = json.load(r)
    route = r.headers.get("x-pdgate-route", "")
choice = body["choices"][0]
usage = body["usage"]
assert body["object"] == "text_completion", body
assert 1 <= usage["completion_tokens"] <= 8, usage  # the random-weight model may stop early
assert "protocol=bootstrap" in route, route
print(f"smoke: completion through the gateway: {usage} route: {route}")
PYEOF

echo "== smoke: Ctrl-C"
kill -INT "$QS_PID"
for _ in $(seq 1 60); do kill -0 "$QS_PID" 2>/dev/null || break; sleep 0.5; done
if kill -0 "$QS_PID" 2>/dev/null; then echo "smoke: quickstart still running 30 s after SIGINT"; cat "$WORK/qs.log"; exit 1; fi
wait "$QS_PID" && rc=0 || rc=$?
QS_PID=""
[ "$rc" = 0 ] || { echo "smoke: quickstart exited with $rc after SIGINT"; cat "$WORK/qs.log"; exit 1; }
for _ in $(seq 1 20); do
    left=""
    for pid in $WORKER_PIDS; do kill -0 "$pid" 2>/dev/null && left="$left $pid"; done
    [ -z "$left" ] && break
    sleep 0.5
done
if [ -n "$left" ]; then echo "smoke: worker processes left behind:$left"; ps -fp $left || true; kill -9 $left; exit 1; fi
echo "smoke: passed (quickstart served a completion; SIGINT left no process behind)"
