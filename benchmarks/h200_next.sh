#!/usr/bin/env bash
# What the next GPU session should measure first (each part fits one <= 10-minute device call):
#   PART=a: the sparse backward loop variants (benchmarks/sparse_bwd_probe.py: list/prefetch/run x 2/3 stages
#           vs flex, gradients checked), then the sparse suite's window-1024 / varlen rows.
#   PART=b: host cost after any norm-backward host-path change (host_cost.py --experiments --detail) and the
#           norm fwd+bwd bench; the sparse conformance rows (the forward loop changed after 32a4d99).
#   PART=c: e2e quick, BERT and decode, three times (the decode peer's time varies ~40% on that host).
# OPSADV_COMMIT=<sha> PART=a bash benchmarks/h200_next.sh   (from the repo root on the GPU host, $OUT set)
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 OPSADV_CACHE_DIR=/tmp/opsadv-cache OPSADV_COMMIT=${OPSADV_COMMIT:-unknown}
case "${PART:-a}" in
a)
  timeout 420 python3 benchmarks/sparse_bwd_probe.py "$OUT/sparse_bwd_probe_h200.json" 400 > "$OUT/probe.log" 2>&1
  echo "probe rc $?"; tail -12 "$OUT/probe.log"
  timeout 150 python3 -m opsadv bench --suite sparse --filter 'sliding1024 causal|varlen' \
    --json "$OUT/h200_sparse.json" > "$OUT/bench_sparse.log" 2>&1; echo "sparse rc $?"; tail -8 "$OUT/bench_sparse.log"
  ;;
b)
  timeout 90 python3 benchmarks/host_cost.py --experiments --detail --profile "$OUT/host.txt" > /dev/null 2>&1
  echo "host rc $?"; cat "$OUT/host.txt"
  timeout 120 python3 -m opsadv bench --suite norm --filter 'fwd\+bwd' --json "$OUT/norm_fb.json" > "$OUT/bench.log" 2>&1
  echo "norm rc $?"; grep -E "^fwd" "$OUT/bench.log" | tail -12
  timeout 240 python3 -m opsadv conformance --backend cuda --ops sparse_attention --json "$OUT/conf_sparse.json" \
    > "$OUT/conf_sparse.log" 2>&1; echo "sparse conformance rc $?"; tail -1 "$OUT/conf_sparse.log"
  ;;
c)
  for i in 1 2 3; do
    timeout 170 python3 -m opsadv bench --suite e2e --quick --filter 'bert|decode' --json "$OUT/e2e_$i.json" \
      > "$OUT/e2e_$i.log" 2>&1; echo "e2e run $i rc $?"; grep -E "^(prefill|decode)" "$OUT/e2e_$i.log" | tail -2
  done
  ;;
esac
