#!/usr/bin/env bash
# Session 4's GPU calls after the first two (the sparse backward probe, the autograd-thread probe + jetson prefill;
# their commands are in the session note).  From the repo root on the GPU host, $OUT set:
#   OPSADV_COMMIT=<sha> PART=b bash benchmarks/h200_s4.sh   host cost per call + norm fwd+bwd bench + sparse conformance
#   OPSADV_COMMIT=<sha> PART=c bash benchmarks/h200_s4.sh   e2e quick BERT + decode twice, BERT's aten ops (--ops)
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 OPSADV_CACHE_DIR=/tmp/opsadv-cache OPSADV_COMMIT=${OPSADV_COMMIT:-unknown}
case "${PART:-b}" in
b)
  timeout 100 python3 benchmarks/host_cost.py --detail --decode-impls --profile "$OUT/host.txt" > "$OUT/host.log" 2>&1
  echo "host rc $?"; cat "$OUT/host.txt" | head -40
  timeout 60 python3 benchmarks/host_cost.py --experiments --profile "$OUT/host_exp.txt" > "$OUT/host_exp.log" 2>&1
  echo "host experiments rc $?"; cat "$OUT/host_exp.txt"
  timeout 150 python3 -m opsadv bench --suite norm --filter 'fwd\+bwd|h1024' --json "$OUT/norm.json" > "$OUT/norm.log" 2>&1
  echo "norm rc $?"; grep -E "^(fwd|case)" "$OUT/norm.log" | tail -16
  timeout 200 python3 -m opsadv conformance --backend cuda --ops sparse_attention --json "$OUT/conf_sparse.json" \
    > "$OUT/conf_sparse.log" 2>&1; echo "sparse conformance rc $?"; tail -2 "$OUT/conf_sparse.log"
  ;;
c)
  for i in 1 2; do
    timeout 170 python3 -m opsadv bench --suite e2e --quick --filter 'bert|decode' --json "$OUT/e2e_$i.json" \
      > "$OUT/e2e_$i.log" 2>&1; echo "e2e run $i rc $?"; grep -E "^(prefill|decode)" "$OUT/e2e_$i.log" | tail -2
  done
  timeout 120 python3 benchmarks/bert_probe.py "$OUT/bert_ops.json" --ops > "$OUT/bert_ops.log" 2>&1
  echo "bert ops rc $?"; grep -E "^  " "$OUT/bert_ops.log" | head -16
  ;;
esac
