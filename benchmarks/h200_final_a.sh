#!/usr/bin/env bash
# Final H200 run, part A: environment, dispatch overhead, the cuda conformance catalogue, and the
# kernel bench suites (quick grids; each suite under its own time limit).  Run from the repo root
# on the GPU host with OUT set:  OPSADV_COMMIT=<sha> bash benchmarks/h200_final_a.sh
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 OPSADV_CACHE_DIR=/tmp/opsadv-cache OPSADV_COMMIT=${OPSADV_COMMIT:-unknown}
python3 -m opsadv info > "$OUT/info.txt" 2>&1
python3 benchmarks/dispatch_overhead.py --json "$OUT/overhead.json" 2>&1 | tail -3
timeout "${T_CONF:-130}" python3 -m opsadv conformance --backend cuda -v --json "$OUT/cuda-h200.json" \
  --markdown "$OUT/cuda-h200.md" > "$OUT/conformance.log" 2>&1; echo "conformance rc $?"
tail -2 "$OUT/conformance.log"
for spec in attention:${T_ATT:-140} gemm:${T_GEMM:-110} norm:${T_NORM:-70} sparse:${T_SPARSE:-80}; do
  s=${spec%%:*}; t=${spec##*:}
  echo "== bench $s (limit ${t}s)" >> "$OUT/bench.log"
  timeout "$t" python3 -m opsadv bench --suite "$s" --quick --json "$OUT/h200.json" >> "$OUT/bench.log" 2>&1
  echo "bench $s rc $?"
done
grep -E "speedup|^fwd|^ *fwd" "$OUT/bench.log" | tail -40
