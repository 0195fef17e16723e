#!/usr/bin/env bash
# Session 2, GPU call B: compile/layout check and flash_attention conformance after the layout and
# masked-backward fixes, then the jetson-profile memory probe (run_batched budget cases).
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 OPSADV_CACHE_DIR=/tmp/opsadv-cache OPSADV_COMMIT=${OPSADV_COMMIT:-unknown}
timeout "${T_COMPILE:-60}" python3 benchmarks/compile_layout_check.py > "$OUT/compile_check.txt" 2>&1; echo "compile check rc $?"
grep -E "^(ok|FAIL|skip)" "$OUT/compile_check.txt" | cut -c1-110
timeout "${T_FA:-150}" python3 -m opsadv conformance --backend cuda -v --ops flash_attention \
  --json "$OUT/conf_flash_attention.json" > "$OUT/conformance.log" 2>&1; echo "conformance rc $?"
tail -1 "$OUT/conformance.log"; grep -E "^ *fail" "$OUT/conformance.log" | head
timeout "${T_JETSON:-140}" python3 benchmarks/jetson_probe.py --json "$OUT/jetson_probe.json" > "$OUT/jetson.log" 2>&1
echo "jetson rc $?"; grep -o '"case": "[^"]*"\|"within_budget": [a-z]*\|"peak_act_mib": [0-9.]*\|"budget_mib": [0-9.]*' "$OUT/jetson_probe.json" | paste -sd' ' | sed 's/"case"/\n"case"/g'
