#!/usr/bin/env bash
# What the next GPU session should measure first (each part fits one <= 10-minute device call):
#   PART=a: gemm suite (Hopper epilogue ranking f8ede79 never benched), norm fwd+bwd at hidden 1024,
#           the Triton flash kernel pinned over the full catalogue (bf16 included).
#   PART=c: the sparse window (density) series with its time-vs-density plot (h200_sparse_density.png).
#   PART=b: e2e non-quick (tune_for_hardware wall time; Llama re-measured with native-GQA cuDNN and the
#           layout changes; BERT with tuning then graphs).
# OPSADV_COMMIT=<sha> PART=a bash benchmarks/h200_next.sh   (from the repo root on the GPU host, $OUT set)
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 OPSADV_CACHE_DIR=/tmp/opsadv-cache OPSADV_COMMIT=${OPSADV_COMMIT:-unknown}
case "${PART:-a}" in
a)
  timeout 150 python3 -m opsadv bench --suite gemm --quick --json "$OUT/h200_gemm.json" > "$OUT/bench.log" 2>&1
  echo "gemm rc $?"
  timeout 120 python3 -m opsadv bench --suite norm --filter "h1024" --json "$OUT/h200_norm.json" >> "$OUT/bench.log" 2>&1
  echo "norm rc $?"; grep -E "speedup|^fwd" "$OUT/bench.log" | tail -20
  timeout 240 python3 -m opsadv conformance --backend cuda -v --impl cuda.triton.flash_attention \
    --json "$OUT/conf_triton_fa.json" > "$OUT/conformance.log" 2>&1; echo "conformance rc $?"; tail -1 "$OUT/conformance.log"
  ;;
b)
  timeout 560 python3 -m opsadv bench --suite e2e --json "$OUT/h200_e2e.json" > "$OUT/bench_e2e.log" 2>&1
  echo "e2e rc $?"; tail -8 "$OUT/bench_e2e.log"
  ;;
c)
  timeout 400 python3 -m opsadv bench --suite sparse --filter "^fwd bf16 b1 .*sliding" --json "$OUT/h200_sparse.json" \
    --plot "$OUT/h200_sparse.png" > "$OUT/bench_sparse.log" 2>&1; echo "sparse rc $?"; tail -12 "$OUT/bench_sparse.log"
  ;;
esac
