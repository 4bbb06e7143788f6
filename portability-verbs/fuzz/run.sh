#!/usr/bin/env bash
# Builds the fuzz targets with libFuzzer coverage instrumentation on the stable toolchain (no
# cargo-fuzz or nightly needed) and runs each for SECONDS (default 60).
#   ./run.sh                 all targets        ./run.sh ring_record 600   one target, 10 min
set -euo pipefail
cd "$(dirname "$0")"
target=$(rustc -vV | sed -n 's/^host: //p')
export RUSTFLAGS="-Cpasses=sancov-module -Cllvm-args=-sanitizer-coverage-level=4 \
 -Cllvm-args=-sanitizer-coverage-inline-8bit-counters -Cllvm-args=-sanitizer-coverage-pc-table \
 -Cllvm-args=-sanitizer-coverage-trace-compares -Cdebug-assertions -Coverflow-checks"
cargo build --release --target "$target"
# Where cargo put the build (CARGO_TARGET_DIR, if set, is relative to this directory or absolute).
out=${CARGO_TARGET_DIR:-target}
targets=${1:-"ring_record endpoint_info bootstrap_frames fc_chunk mad_wire sdp_wire tcp_frame sdp_discovery exs_wire"}
for t in $targets; do
    mkdir -p "corpus/$t"
    # libFuzzer exits non-zero on a crash, a panic or a leak: that fails this script.
    rc=0
    "$out/$target/release/$t" "corpus/$t" -max_total_time="${2:-${SECONDS_PER_TARGET:-60}}" \
        >"$out/$t.log" 2>&1 || rc=$?
    if [ "$rc" -ne 0 ]; then
        tail -40 "$out/$t.log"
        echo "fuzz target $t failed (exit $rc): see $out/$t.log"
        exit 1
    fi
    echo "fuzz: $t $(sed -n 's/^Done \([0-9]*\) runs.*/\1/p' "$out/$t.log") executions"
done
