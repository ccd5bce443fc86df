#!/usr/bin/env bash
# Where a slow stream's memory goes: heaptrack the gateway while it holds N slow streams, then
# print the heap at its peak by the innermost call site of ours or of a library's (hyper, tokio),
# in bytes per stream.
#
#   cargo build --release -p pdgate-gateway --no-default-features --features kubernetes --bin pdgate-gateway
#   MODE=regular N=1000 bench/gateway/stream_heap.sh     # MODE=bootstrap for SGLang PD
#   MODE=bootstrap N=20 DURATION=3s BIN=... bench/gateway/stream_heap.sh   # CI's smoke
#
# DURATION (default 25s): how long wrk holds the N slow streams (each lasts 30 s). Fails
# (non-zero) when the warm-up saw errors or heaptrack recorded no heap (a mimalloc build).
# heaptrack (apt-get install heaptrack) sees only the system allocator's calls, hence the build
# without the `mimalloc` feature. The heap is what was allocated, not what is resident: an
# allocation's untouched pages cost no RSS (bench/gateway/stream_bench.sh MEMORY=1 reads RSS).
set -euo pipefail
cd "$(dirname "$0")/../.."
T=${CARGO_TARGET_DIR:-target}
BIN=${BIN:-$T/release/pdgate-gateway}
MOCK=${MOCK:-$T/release/examples/stream_mock}
MODE=${MODE:-regular}; N=${N:-1000}; DURATION=${DURATION:-25s}
command -v heaptrack >/dev/null || { echo "heaptrack not installed (apt-get install heaptrack)" >&2; exit 1; }
ulimit -n 20000 2>/dev/null || true
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
D=$(mktemp -d /tmp/pdgate-heap.XXXXXX)
RP=$(free_port); PP=$(free_port); DP=$(free_port); GP=$(free_port)
export STREAM_CHUNKS=30
PIDS=()
trap 'kill "${PIDS[@]}" 2>/dev/null || true; wait 2>/dev/null || true' EXIT
source bench/gateway/checks.sh  # check_wrk, finish
"$MOCK" "$RP" decode 1000 & PIDS+=($!)
"$MOCK" "$PP" prefill 0 & PIDS+=($!)
"$MOCK" "$DP" decode 1000 & PIDS+=($!)
case $MODE in
    regular) args=(--worker-urls "http://127.0.0.1:$RP") ;;
    bootstrap) args=(--pd-disaggregation --prefill "http://127.0.0.1:$PP" 8998 --decode "http://127.0.0.1:$DP") ;;
    *) echo "MODE is regular or bootstrap" >&2; exit 2 ;;
esac
BIN=$(realpath "$BIN")
heaptrack -o "$D/heap" "$BIN" --port "$GP" --log-level warn --policy round_robin "${args[@]}" > "$D/gateway.log" 2>&1 &
HT=$!
URL="http://127.0.0.1:$GP/v1/completions"
for _ in $(seq 200); do
    [ "$(curl -s -o /dev/null -w '%{http_code}' -H 'content-type: application/json' -d '{"model":"mock-model","prompt":"x","max_tokens":1}' "$URL")" = 200 ] && break
    sleep 0.3
done
body() { printf 'wrk.method = "POST"\nwrk.headers["Content-Type"] = "application/json"\nwrk.body = %s\n' "'{\"model\":\"mock-model\",\"prompt\":\"The capital of France is\",\"max_tokens\":8$1}'"; }
body "" > "$D/whole.lua"; body ',"stream":true' > "$D/stream.lua"
wrk -t2 -c32 -d2s -s "$D/whole.lua" "$URL" > "$D/warm-up.wrk"
check_wrk "$D/warm-up.wrk" "warm-up"
finish
wrk -t2 -c"$N" -d"$DURATION" --timeout 60s -s "$D/stream.lua" "$URL" > /dev/null
# The gateway itself (heaptrack's wrapper runs it as a child), stopped so heaptrack writes out.
kill -INT "$(pgrep -f "^$BIN --port $GP" | head -1)"
wait "$HT" || true
# (No --print-histogram: it takes a file name, and `0` wrote a file named 0 into the checkout.)
heaptrack_print -f "$D"/heap.*zst --print-peaks 0 --print-allocators 0 --print-temporary 0 --print-leaks 0 \
    -F "$D/peak.folded" --flamegraph-cost-type peak > /dev/null 2>&1
python3 - "$D/peak.folded" "$N" <<'PY'
import collections, re, sys
path, n = sys.argv[1], int(sys.argv[2])
generic = re.compile(r"(alloc::|core::|std::|__rust|_RN|bytes::|hashbrown|<alloc|<core|<bytes|malloc|realloc|calloc)")
sites, total = collections.Counter(), 0
for line in open(path):
    stack, _, size = line.rstrip().rpartition(" ")
    total += int(size)
    site = next((f for f in reversed(stack.split(";")) if f.strip() and not generic.search(f)), "?")
    sites[site.split(" (")[0][:110]] += int(size)
if not total:
    sys.exit(f"heaptrack recorded no heap in {path}: a build with mimalloc? (see above)")
print(f"heap at the peak: {total / 2**20:.1f} MiB, {total / n / 1024:.1f} KiB per stream ({n} streams)")
for site, size in sites.most_common(15):
    print(f"{size / n:9.0f} B/stream  {site}")
PY
