#!/usr/bin/env bash
# Many concurrent slow streams (issue 30 item 4), not a test: N streams held open through R
# gateway replicas, against 32 streams at the same stream rate, in interleaved rounds.
#
#   cargo build --release -p pdgate-gateway --bin pdgate-gateway --example stream_mock
#   R=1 N=9900 ROUNDS=3 bench/gateway/many_streams.sh     # one process: as many as its fds allow
#   R=2 N=10000 ROUNDS=3 bench/gateway/many_streams.sh    # two replicas, the client spreads
#   MODE=bootstrap R=2 N=10000 bench/gateway/many_streams.sh   # SGLang PD: a prefill leg too
#   CI's smoke: R=2 N=8 BASE_N=4 CHUNKS=10 SLOW_MS=50 WARM=1 ROUNDS=1
#
# A row (n streams) starts its own mock worker (examples/stream_mock.rs, one thread;
# MODE=bootstrap adds a prefill mock) that answers a stream with CHUNKS events and `[DONE]`,
# each after DELAY ms, and R gateways in front of it, and holds n/R connections on each replica
# (the client spreads its connections), each streaming one request after another: n streams in
# flight all the time.
#
# Rows: the big n (N, DELAY = SLOW_MS) and the baseline (BASE_N, default 32) at the same stream
# rate: DELAY = SLOW_MS * BASE_N / N - 1, at least 1 ms (or BASE_DELAY), since the mock's sleep
# ends on the timer's next millisecond, so an event takes DELAY + 1 ms; the str/s column shows
# both rates. (32 streams 1 s apart complete one stream a second: too few 10 ms CPU ticks to
# count, and the gateway's own timers would weigh on each.) Both rows are made of one unit, a
# group of GROUP connections (default BASE_N / R) driven by one wrk, whose streams start
# together and whose chunks arrive together: the baseline is one group per replica, the big row
# n / BASE_N groups with their starts spread evenly over one stream length. Both then see a
# group's chunks arrive every DELAY + 1 ms of the baseline's, do the same work per second, and
# leave the mock and the client the same share of the cores; only how many streams are open,
# and so how much state the gateway cycles through, differs. (Larger groups batch more chunks
# per wake-up and make the big row cheaper per stream; all connections opened at once
# overflow the listen backlogs, 128, and wait for SYN retransmits: docs/performance.md.)
#
# Each row, once every connection streams (one stream length, plus up to 2 s): over a window of
# WAVES (default 2) stream lengths of the big row, the gateways' CPU (utime+stime, /proc; and
# split) per stream completed in it (pdgate_request_duration_seconds_count); VmRSS over the
# idle figure (after the warm-up) per stream in flight (pdgate_client_requests_in_flight, less
# the scrape itself), per replica, at the window's start and end; open fds per replica at the end; wrk's
# completed streams and errors (non-2xx, socket errors, timeouts) and the slowest stream and
# p99 (the highest of the wrk processes'), against the stream's length, (CHUNKS + 1) *
# (DELAY + 1) ms (one event more where the gateway asks for the usage event: a PD stream, or
# one sent before it knows the worker returns token ids). wrk's --timeout is the deadline: the
# length plus a tenth, at least 1 s more, in whole seconds (a slower stream is a timeout). Then each round's big / baseline CPU per
# stream and the median over rounds.
#
# fds: a gateway holds two sockets per stream (the client's and the worker leg's) and 24 of its
# own, and the hard limit (`ulimit -Hn`; the script raises the soft limit to it) caps each
# process: with 20,000, one gateway holds at most 9,988 streams; 9,900 leaves room for the
# transients (a worker leg whose body ends after `[DONE]` is drained off the client's path for
# up to 5 s while the client's next request opens another). The mock holds one socket per
# stream, each wrk process its share.
#
# Exits 1 after its output when a run saw errors or a stall, or a gateway never routed.
set -euo pipefail
cd "$(dirname "$0")/../.."
T=${CARGO_TARGET_DIR:-target}
BIN=${BIN:-$T/release/pdgate-gateway}
MOCK=${MOCK:-$T/release/examples/stream_mock}
MODE=${MODE:-regular}; R=${R:-1}; N=${N:-1000}; BASE_N=${BASE_N:-32}; ROUNDS=${ROUNDS:-3}
CHUNKS=${CHUNKS:-30}; SLOW_MS=${SLOW_MS:-1000}; WAVES=${WAVES:-2}; WARM=${WARM:-2}
GROUP=${GROUP:-$((BASE_N / R))}
# Both rows measure over the same window: WAVES stream lengths of the big row.
WINDOW=$(awk -v w="$WAVES" -v c="$CHUNKS" -v s="$SLOW_MS" 'BEGIN {print w * (c + 1) * (s + 1) / 1000}')
ulimit -n "$(ulimit -Hn)" 2>/dev/null || true
export STREAM_CHUNKS=$CHUNKS

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
ticks() { awk '{print $14, $15}' "/proc/$1/stat"; }  # user, system
rss_kb() { awk '/VmRSS/ {print $2}' "/proc/$1/status"; }
# (awk reads to the end: an early exit would break curl's pipe, and pipefail fail the read.)
metric() { curl -s "$1/metrics" | awk -v m="$2" '$1 == m {v = $2} END {print v}'; }
calc() { awk "BEGIN {print ($*)}"; }
after() { awk -v t="$1" -v s="$2" 'BEGIN {printf "%.3f", t + s}'; }  # a timestamp plus seconds
sleep_until() { sleep "$(awk -v t="$1" -v n="$(date +%s.%N)" 'BEGIN {print (t > n ? t - n : 0)}')"; }
# wrk's durations (12.3ms, 30.01s, 1.00m) in seconds.
secs() { awk -v v="$1" 'BEGIN {u = v; sub(/^[0-9.]+/, "", u); f = (u == "us" ? 1e-6 : u == "ms" ? 1e-3 : u == "m" ? 60 : u == "h" ? 3600 : 1); printf "%.3f", v * f}'; }
D=$(mktemp -d /tmp/pdgate-many.XXXXXX)
PIDS=()
cleanup() { [ "${#PIDS[@]}" -gt 0 ] && kill "${PIDS[@]}" 2>/dev/null; wait 2>/dev/null || true; }
trap cleanup EXIT
source bench/gateway/checks.sh  # check_wrk, fail, finish

body() { printf 'wrk.method = "POST"\nwrk.headers["Content-Type"] = "application/json"\nwrk.body = %s\n' "'{\"model\":\"mock-model\",\"prompt\":\"The capital of France is\",\"max_tokens\":$CHUNKS$1}'"; }
body "" > "$D/whole.lua"; body ',"stream":true' > "$D/stream.lua"
CPU=$(getconf CLK_TCK)

# fleet N DELAY TAG: the mock worker(s) answering each stream's events DELAY ms apart, R gateways
# in front (GWS, URLS), each warmed up; IDLE: each gateway's VmRSS (KiB) after the warm-up.
fleet() {
    local n=$1 delay=$2 tag=$3 dp pp wp args i w=()
    GWS=(); URLS=(); IDLE=()
    dp=$(free_port); "$MOCK" "$dp" decode "$delay" > "$D/$tag-mock.log" 2>&1 & PIDS+=($!)
    args=(--worker-urls "http://127.0.0.1:$dp")
    if [ "$MODE" = bootstrap ]; then
        pp=$(free_port); "$MOCK" "$pp" prefill 0 > "$D/$tag-prefill.log" 2>&1 & PIDS+=($!)
        args=(--pd-disaggregation --prefill "http://127.0.0.1:$pp" 8998 --decode "http://127.0.0.1:$dp")
    fi
    for i in $(seq "$R"); do
        wp=$(free_port)
        "$BIN" --port "$wp" --log-level warn --policy round_robin --max-connections $((n / R + 64)) "${args[@]}" \
            > "$D/$tag-gw$i.log" 2>&1 & PIDS+=($!); GWS+=($!); URLS+=("http://127.0.0.1:$wp")
    done
    for i in "${!URLS[@]}"; do
        for _ in $(seq 200); do
            [ "$(curl -s -o /dev/null -w '%{http_code}' -H 'content-type: application/json' -d '{"model":"mock-model","prompt":"x","max_tokens":1}' "${URLS[$i]}/v1/completions")" = 200 ] && break
            sleep 0.3
        done
    done
    for i in "${!URLS[@]}"; do wrk -t1 -c8 -d"${WARM}s" -s "$D/whole.lua" "${URLS[$i]}/v1/completions" > "$D/$tag-warm$i.wrk" & w+=($!); done
    wait "${w[@]}" || true; sleep 1
    for i in "${!URLS[@]}"; do check_wrk "$D/$tag-warm$i.wrk" "$tag warm-up of replica $((i + 1))"; done
    for i in "${!GWS[@]}"; do IDLE+=("$(rss_kb "${GWS[$i]}")"); done
}

# load N LEN END DEADLINE TAG: n/R connections on each replica in groups of about GROUP (one
# wrk each), the groups opened evenly over LEN seconds, all running until END; pids in WRKS.
load() {
    local n=$1 len=$2 end=$3 deadline=$4 tag=$5 per=$(($1 / R)) steps s i c t
    steps=$(((per + GROUP / 2) / GROUP)); steps=$((steps > 0 ? steps : 1)); WRKS=()
    for s in $(seq 0 $((steps - 1))); do
        t=$(after "$START" "$(calc "$s * $len / $steps")"); sleep_until "$t"
        c=$((per * (s + 1) / steps - per * s / steps))
        for i in "${!URLS[@]}"; do
            wrk -t1 -c"$c" -d"$(awk -v e="$end" -v t="$t" 'BEGIN {printf "%d", e - t + 1}')s" --timeout "${deadline}s" --latency \
                -s "$D/stream.lua" "${URLS[$i]}/v1/completions" > "$D/$tag-$i-$s.wrk" & WRKS+=($!)
        done
    done
}

# Each replica's VmRSS over its idle figure per stream in flight (KiB), joined by "/".
per_stream_kib() {
    local out=() j f
    for j in "${!GWS[@]}"; do
        f=$(($(metric "${URLS[$j]}" pdgate_client_requests_in_flight) - 1))  # less the scrape itself
        out+=("$(awk -v l="$(rss_kb "${GWS[$j]}")" -v i="${IDLE[$j]}" -v f="$f" 'BEGIN {printf "%.1f", (f > 0 ? (l - i) / f : 0)}')")
    done
    (IFS=/; echo "${out[*]}")
}

# The gateways' CPU ticks (user, system) and completed streams, all replicas together.
sample() {
    local u=0 k=0 c=0 j a b
    for j in "${!GWS[@]}"; do
        read -r a b < <(ticks "${GWS[$j]}"); u=$((u + a)); k=$((k + b))
        c=$((c + $(metric "${URLS[$j]}" 'pdgate_request_duration_seconds_count{route="/v1/completions"}')))
    done
    echo "$u $k $c"
}

# wrk_summary TAG WHAT: completed, errors, slowest and p99 (the highest of the wrk processes').
wrk_summary() {
    local ok=0 errors=0 max=0 p99=0 f v
    for f in "$D/$1"-*-*.wrk; do
        check_wrk "$f" "$2"
        ok=$((ok + $(awk '/requests in/ {print $1}' "$f")))
        errors=$((errors + $(awk '/Non-2xx/ {e += $NF} /Socket errors/ {gsub(/,/, ""); e += $4 + $6 + $8 + $10} END {print e + 0}' "$f")))
        v=$(secs "$(awk '/^ +Latency +[0-9]/ {print $4}' "$f")"); max=$(calc "$v > $max ? $v : $max")
        v=$(secs "$(awk '/^ +99%/ {print $2}' "$f")"); p99=$(calc "$v > $p99 ? $v : $p99")
    done
    echo "$ok $errors $max $p99"
}

# measure N DELAY ROUND: one row, printed and appended to $D/rows.txt.
measure() {
    local n=$1 delay=$2 round=$3 tag="r$3-n$1" len deadline settle t0 u0 k0 c0 t1 u1 k1 c1 kib0 kib1 ok errors max p99 us i
    local fds=() rss=() idle=()
    fleet "$n" "$delay" "$tag"
    len=$(calc "($CHUNKS + 1) * ($delay + 1) / 1000")  # a wait before [DONE] too; ~1 ms over each
    deadline=$(awk -v l="$len" 'BEGIN {d = l + (l / 10 > 1 ? l / 10 : 1); printf "%d", (d == int(d) ? d : int(d) + 1)}')
    settle=$(calc "$len + ($len < 2 ? $len : 2)")  # every connection open and streaming
    START=$(date +%s.%N)
    load "$n" "$len" "$(after "$START" "$(calc "$settle + $WINDOW + 1")")" "$deadline" "$tag"
    sleep_until "$(after "$START" "$settle")"
    read -r u0 k0 c0 < <(sample); t0=$(date +%s.%N)
    kib0=$(per_stream_kib)
    sleep_until "$(after "$t0" "$WINDOW")"
    read -r u1 k1 c1 < <(sample); t1=$(date +%s.%N)
    kib1=$(per_stream_kib)
    for i in "${!GWS[@]}"; do
        fds+=("$(ls "/proc/${GWS[$i]}/fd" | wc -l)"); rss+=("$(($(rss_kb "${GWS[$i]}") / 1024))"); idle+=("$((IDLE[i] / 1024))")
    done
    for i in "${WRKS[@]}"; do wait "$i" || true; done
    read -r ok errors max p99 < <(wrk_summary "$tag" "n=$n round $round")
    us=$(awk -v u=$((u1 - u0)) -v k=$((k1 - k0)) -v c=$((c1 - c0)) -v hz="$CPU" \
        'BEGIN {f = c > 0 ? 1e6 / hz / c : 0; printf "%.1f %.0f/%.0f", (u + k) * f, u * f, k * f}')
    printf "$ROW" "$round" "$n" "$R" "$delay" "$ok" "$errors" "$len" "$max" "$p99" "$deadline" "$((c1 - c0))" \
        "$(calc "int(($c1 - $c0) / ($t1 - $t0))")" $us "$(IFS=/; echo "${idle[*]}")" "$(IFS=/; echo "${rss[*]}")" "$kib0" "$kib1" "$(IFS=/; echo "${fds[*]}")" \
        | tee -a "$D/rows.txt"
    [ "$(calc "$max > $deadline")" = 1 ] && fail "n=$n round $round: slowest stream ${max}s, deadline ${deadline}s"
    kill "${PIDS[@]}" 2>/dev/null || true; wait 2>/dev/null || true; PIDS=()
}

BASE_DELAY=${BASE_DELAY:-$(awk -v s="$SLOW_MS" -v b="$BASE_N" -v n="$N" 'BEGIN {d = int(s * b / n - 1 + 0.5); print (d < 1 ? 1 : d)}')}
echo "mode $MODE, $R replica(s), $N against $BASE_N streams of $CHUNKS chunks, fd limit $(ulimit -n) per process"
ROW='%-5s %6s %2s %4s %8s %6s %8s %7s %7s %4s %7s %5s %9s %9s %8s %8s %13s %13s %11s\n'
printf "$ROW" round streams R ms wrk_done errors length_s max_s p99_s ddl window str/s us/stream usr/sys idle_MiB RSS_MiB \
    KiB/str@start KiB/str@end fds
for round in $(seq "$ROUNDS"); do
    measure "$BASE_N" "$BASE_DELAY" "$round"
    measure "$N" "$SLOW_MS" "$round"
done
echo "-- medians over $ROUNDS rounds (KiB per stream: the mean of the replicas)"
awk -v base="$BASE_N" -v big="$N" '
    function med(a, c,    i, j, t) {
        for (i = 2; i <= c; i++) { t = a[i]; for (j = i - 1; j >= 1 && a[j] > t; j--) a[j + 1] = a[j]; a[j + 1] = t }
        return c % 2 ? a[(c + 1) / 2] : (a[c / 2] + a[c / 2 + 1]) / 2
    }
    { k = $2; n[k]++; us[k, n[k]] = $13; mx[k, n[k]] = $8; p[k, n[k]] = $9; m = split($18, x, "/"); kib[k, n[k]] = 0
      for (i = 1; i <= m; i++) kib[k, n[k]] += x[i] / m }
    END {
        for (s = 1; s <= 2; s++) { k = s == 1 ? base : big; c = n[k]
            for (i = 1; i <= c; i++) { a[i] = us[k, i]; b[i] = mx[k, i]; q[i] = p[k, i]; z[i] = kib[k, i] }
            printf "%6s streams: %.1f us/stream, slowest %.3f s, p99 %.3f s, %.1f KiB per stream at the end\n", k, med(a, c), med(b, c), med(q, c), med(z, c) }
        c = n[big] < n[base] ? n[big] : n[base]; line = ""
        for (i = 1; i <= c; i++) { r[i] = us[base, i] > 0 ? us[big, i] / us[base, i] : 0; line = line sprintf(" %.2f", r[i]) }
        printf "CPU per stream, %s / %s streams, per round:%s; median %.2fx (target <= 1.2x)\n", big, base, line, med(r, c)
    }' "$D/rows.txt"
echo "raw wrk output and gateway logs in $D"
finish
