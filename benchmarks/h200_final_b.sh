#!/usr/bin/env bash
# Final H200 run, part B: end-to-end model cases and the jetson-profile memory cases.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 OPSADV_CACHE_DIR=/tmp/opsadv-cache OPSADV_COMMIT=${OPSADV_COMMIT:-unknown}
echo "== bench e2e" >> "$OUT/bench_e2e.log"
timeout "${T_E2E:-270}" python3 -m opsadv bench --suite e2e --quick --json "$OUT/h200_e2e.json" >> "$OUT/bench_e2e.log" 2>&1
echo "bench e2e rc $?"; tail -15 "$OUT/bench_e2e.log"
timeout "${T_JETSON:-200}" python3 benchmarks/jetson_probe.py > "$OUT/jetson.log" 2>&1; echo "jetson rc $?"
tail -15 "$OUT/jetson.log"
