#!/usr/bin/env bash
# H200 run, part C: the padded-BERT probe and the rest of the cuda conformance catalogue.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 OPSADV_CACHE_DIR=/tmp/opsadv-cache OPSADV_COMMIT=${OPSADV_COMMIT:-unknown}
timeout "${T_BERT:-100}" python3 benchmarks/bert_probe.py "$OUT/bert_probe.json" > "$OUT/bert_probe.log" 2>&1; echo "bert rc $?"
grep -E '"(hf_sdpa|varlen|masked)_(ms|err)"' "$OUT/bert_probe.log"
timeout "${T_CONF:-150}" python3 -m opsadv conformance --backend cuda -v --ops "${CONF_OPS:-gemm,swiglu_gemm,layer_norm,rms_norm,flash_attention,sparse_attention}" \
  --json "$OUT/cuda-h200-c.json" --markdown "$OUT/cuda-h200-c.md" > "$OUT/conformance-c.log" 2>&1; echo "conformance rc $?"
tail -3 "$OUT/conformance-c.log"
