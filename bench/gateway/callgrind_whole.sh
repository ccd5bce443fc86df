#!/usr/bin/env bash
# Instructions per request (not a test): one gateway under valgrind's callgrind serving
# `regular:whole` requests (stream_bench.sh's shape: one stream_mock worker, round robin,
# non-streamed completions) after a warm-up. Counted instructions do not depend on the
# machine's load, so two builds can be compared on a busy machine where CPU time cannot.
#
#   bench/gateway/callgrind_whole.sh NAME GATEWAY_BIN STREAM_MOCK_BIN
#   N=1000 WARM=300 ...            # sequential requests on one keep-alive connection (default)
#   WRK=1 WRK_D=10s ...            # wrk -t2 -c32 for WRK_D instead (bench/gateway/post.lua)
#   SIM=1 ...                      # also simulated cache misses and branch mispredictions
#   STREAM=1 ...                   # sequential requests streamed (regular:stream's body)
#   N=10 WARM=5 STREAM=1 ... ; WRK=1 WRK_D=1s SIM=1 WARM=5 ...   # CI's smoke (two runs)
#
# Writes $OUTDIR/NAME.cg.1 (the counters from after the warm-up to the last request; read it
# with callgrind_annotate [--inclusive=yes]) and prints the counters per request.
# Needs valgrind (apt-get install valgrind), python3, curl (and wrk for WRK=1). Fails (non-zero)
# when a measured request did not get a 200 or wrk saw errors.
set -euo pipefail
cd "$(dirname "$0")/../.."
NAME=$1 BIN=$2 MOCK=$3
N=${N:-1000}; WARM=${WARM:-300}; OUTDIR=${OUTDIR:-/tmp/pdgate-callgrind}; mkdir -p "$OUTDIR"
rm -f "$OUTDIR/$NAME.cg" "$OUTDIR/$NAME.cg".*
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
RP=$(free_port); GP=$(free_port)
"$MOCK" "$RP" decode 0 > "$OUTDIR/$NAME.mock.log" 2>&1 & MOCKPID=$!
SIMARGS=(); [ -n "${SIM:-}" ] && SIMARGS=(--cache-sim=yes --branch-sim=yes)
valgrind --tool=callgrind "${SIMARGS[@]}" --callgrind-out-file="$OUTDIR/$NAME.cg" \
    "$BIN" --port "$GP" --log-level warn --policy round_robin --worker-urls "http://127.0.0.1:$RP" \
    > "$OUTDIR/$NAME.gw.log" 2>&1 & VGPID=$!
trap 'kill $VGPID $MOCKPID 2>/dev/null || true' EXIT
source bench/gateway/checks.sh  # check_wrk, fail, finish
URL="http://127.0.0.1:$GP/v1/completions"
for _ in $(seq 300); do
    [ "$(curl -s -o /dev/null -w '%{http_code}' -H 'content-type: application/json' -d '{"model":"mock-model","prompt":"x","max_tokens":1}' "$URL")" = 200 ] && break
    sleep 0.5
done
client() {  # client COUNT: sequential requests on one connection; prints how many got a 200
    python3 - "$GP" "$1" "${STREAM:-}" <<'PY'
import http.client, sys
port, n = int(sys.argv[1]), int(sys.argv[2])
body = b'{"model":"mock-model","prompt":"The capital of France is","max_tokens":8%s}' % (b',"stream":true' if sys.argv[3] else b'')
c = http.client.HTTPConnection("127.0.0.1", port)
ok = 0
for _ in range(n):
    c.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    r = c.getresponse(); r.read()
    ok += r.status == 200
print(ok)
PY
}
client "$WARM" > /dev/null
sleep 1
callgrind_control -z "$VGPID" > /dev/null
if [ -n "${WRK:-}" ]; then
    wrk -t2 -c32 -d"${WRK_D:-10s}" --timeout 30s -s bench/gateway/post.lua "$URL" > "$OUTDIR/$NAME.wrk"
    check_wrk "$OUTDIR/$NAME.wrk" "$NAME"
    REQ=$(awk '/requests in/ {print $1}' "$OUTDIR/$NAME.wrk")
else
    REQ=$(client "$N")
    [ "$REQ" = "$N" ] || fail "$NAME: $REQ of $N requests got a 200"
fi
finish
callgrind_control -d "$VGPID" > /dev/null
kill "$VGPID"; wait "$VGPID" 2>/dev/null || true
F=$OUTDIR/$NAME.cg.1
echo "$NAME: $REQ requests, $F"
python3 - "$F" "$REQ" <<'PY'
import sys
f, n = sys.argv[1], int(sys.argv[2])
ev = tot = None
for line in open(f):
    if line.startswith("events:"): ev = line.split()[1:]
    if line.startswith("summary:"): tot = [int(x) for x in line.split()[1:]]
print("per request:", " ".join(f"{e}={t/n:.0f}" for e, t in zip(ev, tot)))
PY
