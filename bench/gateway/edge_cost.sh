#!/usr/bin/env bash
# What the client edge alone costs (a measurement, not a test): CPU per request for a trivial
# GET, pdgate's `/liveness` (hyper's server, the edge's timers and guards, axum's routing, a
# small JSON answer) against nginx answering `return 200` from its config, interleaved. If
# pdgate's streams cost more than nginx-proxy's, this says whether the HTTP server is where.
#
#   cargo build --release -p pdgate-gateway --bin pdgate-gateway
#   bench/gateway/edge_cost.sh target/release/pdgate-gateway      # ROUNDS=2 DURATION=5 by default
#   ROUNDS=1 DURATION=1 bench/gateway/edge_cost.sh BIN                # CI's smoke
#
# DURATION: the measured wrk run, whole seconds. Exits 1 after its table when a measured run
# completed no request or saw errors.
set -euo pipefail
cd "$(dirname "$0")/../.."
BIN=${1:?usage: $0 PDGATE_GATEWAY_BIN}
source bench/gateway/nginx_proxy.sh  # nginx_static_conf
source bench/gateway/checks.sh  # check_wrk, finish
DURATION=${DURATION:-5}
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
D=$(mktemp -d /tmp/pdgate-edge.XXXXXX)
GW=
cleanup() { [ -n "$GW" ] && kill "$GW" 2>/dev/null; wait 2>/dev/null || true; }
trap cleanup EXIT
ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }
tick=$(( 1000000 / $(getconf CLK_TCK) ))
printf '%-8s %10s %12s\n' server req/s 'CPU us/req'
for _ in $(seq "${ROUNDS:-2}"); do
    for server in pdgate nginx; do
        port=$(free_port)
        if [ "$server" = nginx ]; then
            nginx_static_conf "$D" "$port" '{"status":"ok"}' > "$D/nginx.conf"
            nginx -p "$D" -c "$D/nginx.conf" -g 'daemon off;' & GW=$!
        else
            # A worker URL nobody serves: /liveness does not need one.
            "$BIN" --port "$port" --log-level error --worker-urls "http://127.0.0.1:$(free_port)" > "$D/gw.log" 2>&1 & GW=$!
        fi
        for _ in $(seq 100); do curl -s -o /dev/null "http://127.0.0.1:$port/liveness" && break; sleep 0.1; done
        wrk -t2 -c32 -d2s "http://127.0.0.1:$port/liveness" > /dev/null
        t0=$(ticks "$GW")
        wrk -t2 -c32 -d"${DURATION}s" "http://127.0.0.1:$port/liveness" > "$D/wrk.txt"
        t1=$(ticks "$GW")
        check_wrk "$D/wrk.txt" "$server"
        n=$(awk '/requests in/ {print $1}' "$D/wrk.txt")
        printf '%-8s %10.0f %12.2f\n' "$server" "$(echo "$n / $DURATION" | bc -l)" "$(echo "($t1 - $t0) * $tick / $n" | bc -l)"
        kill "$GW"; wait "$GW" 2>/dev/null || true; GW=
    done
done
finish
