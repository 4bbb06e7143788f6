#!/usr/bin/env bash
# Unmodified programs over kernel TCP and under libsdp_preload.so, one host, in one run:
# sockperf ping-pong latency and iperf3 single-stream throughput, each plain then preloaded,
# ROUNDS times alternated (the machine's speed drifts: compare within a round).
#   cargo build --release -p sdp-preload && benches/scripts/preload_programs.sh
set -u
cd "$(dirname "$0")/../.."
LIB=${LIB:-$PWD/target/release/libsdp_preload.so}
ROUNDS=${ROUNDS:-2}
SECS=${SECS:-3}
[ -f "$LIB" ] || { echo "build it first: cargo build --release -p sdp-preload" >&2; exit 1; }
port=$((20000 + RANDOM % 20000))
for round in $(seq 1 "$ROUNDS"); do
    for mode in plain preloaded; do
        pre=()
        [ "$mode" = preloaded ] && pre=("LD_PRELOAD=$LIB")
        port=$((port + 1))
        env "${pre[@]}" sockperf sr --tcp -i 127.0.0.1 -p $port >/dev/null 2>&1 &
        srv=$!
        sleep 0.7
        # --mps: sockperf sizes its sequence table for 600,000 messages a second unless told
        # more, and a faster ping-pong overruns it ("_seqN > m_maxSequenceNo").
        out=$(env "${pre[@]}" timeout 60 sockperf pp --tcp -i 127.0.0.1 -p $port -t "$SECS" --mps 5000000 2>&1)
        lat=$(echo "$out" | awk '/percentile 50.000/ {p50=$NF} /percentile 99.000/ {p99=$NF}
            END {if (p50 == "") print "FAILED"; else print "p50 " p50 " us, p99 " p99 " us"}')
        [ "$lat" = FAILED ] && lat="FAILED: $(echo "$out" | tail -2 | tr '\n' ' ')"
        kill $srv 2>/dev/null || true
        wait $srv 2>/dev/null || true
        port=$((port + 1))
        env "${pre[@]}" iperf3 -s -1 -p $port >/dev/null 2>&1 &
        srv=$!
        sleep 0.7
        bw=$(env "${pre[@]}" timeout 60 iperf3 -c 127.0.0.1 -p $port -t "$SECS" -f g 2>&1 |
            awk '/receiver/ {print $(NF-2) " " $(NF-1)}')
        wait $srv 2>/dev/null || true
        echo "round $round, $mode: sockperf ping-pong $lat; iperf3 $bw"
    done
done
