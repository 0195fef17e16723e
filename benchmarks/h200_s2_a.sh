#!/usr/bin/env bash
# Session 2, GPU call A: compile/layout check, then the cuda conformance catalogue for the ops whose
# kernels changed (flash_attention, sparse_attention, layer_norm, rms_norm), each under its own limit.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 OPSADV_CACHE_DIR=/tmp/opsadv-cache OPSADV_COMMIT=${OPSADV_COMMIT:-unknown}
python3 -m opsadv info > "$OUT/info.txt" 2>&1
timeout "${T_COMPILE:-60}" python3 benchmarks/compile_layout_check.py > "$OUT/compile_check.txt" 2>&1; echo "compile check rc $?"
grep -E "^(ok|FAIL|skip)" "$OUT/compile_check.txt" | cut -c1-120
for spec in flash_attention:${T_FA:-190} sparse_attention:${T_SP:-70} layer_norm,rms_norm:${T_NORM:-60}; do
  ops=${spec%%:*}; t=${spec##*:}
  timeout "$t" python3 -m opsadv conformance --backend cuda -v --ops "$ops" --json "$OUT/conf_${ops%%,*}.json" \
    >> "$OUT/conformance.log" 2>&1; echo "conformance $ops rc $?"
  tail -1 "$OUT/conformance.log"
done
grep -E "^ *fail" "$OUT/conformance.log" | head -20
