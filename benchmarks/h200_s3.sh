#!/usr/bin/env bash
# Session 3's GPU calls (each fits one <= 10-minute device call), from the repo root on the GPU host, $OUT set:
#   PART=a: host cost per call (benchmarks/host_cost.py), gemm suite (quick: Hopper epilogue ranking),
#           norm fwd+bwd at hidden 1024, the sparse window/density series + our dense kernel (effective TFLOP/s).
#   PART=b: e2e non-quick (tune_for_hardware wall time; Llama re-measured; BERT tuned then graphed).
#   PART=c: host-cost partition of a LayerNorm call (host_cost.py --detail); the Triton flash kernel pinned over the full conformance catalogue (bf16 included).
# OPSADV_COMMIT=<sha> PART=a bash benchmarks/h200_s3.sh
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 OPSADV_CACHE_DIR=/tmp/opsadv-cache OPSADV_COMMIT=${OPSADV_COMMIT:-unknown}
case "${PART:-a}" in
a)
  timeout 80 python3 benchmarks/host_cost.py --json "$OUT/host_cost.json" --profile "$OUT/host_profile.txt" \
    > "$OUT/host.log" 2>&1; echo "host rc $?"; tail -8 "$OUT/host.log"
  timeout 150 python3 -m opsadv bench --suite gemm --quick --json "$OUT/h200_gemm.json" > "$OUT/bench.log" 2>&1
  echo "gemm rc $?"
  timeout 100 python3 -m opsadv bench --suite norm --filter "h1024" --json "$OUT/h200_norm.json" >> "$OUT/bench.log" 2>&1
  echo "norm rc $?"; grep -E "speedup|^fwd|x " "$OUT/bench.log" | tail -24
  timeout 230 python3 -m opsadv bench --suite sparse --filter "^fwd bf16 b1 .*(sliding|dense)" \
    --json "$OUT/h200_sparse.json" --plot "$OUT/h200_sparse.png" > "$OUT/bench_sparse.log" 2>&1
  echo "sparse rc $?"; tail -14 "$OUT/bench_sparse.log"
  ;;
b)
  timeout 570 python3 -m opsadv bench --suite e2e --json "$OUT/h200_e2e.json" > "$OUT/bench_e2e.log" 2>&1
  echo "e2e rc $?"; tail -10 "$OUT/bench_e2e.log"
  ;;
c)
  timeout 90 python3 benchmarks/host_cost.py --detail --profile "$OUT/host_detail.txt" > "$OUT/host_detail.log" 2>&1
  echo "host detail rc $?"; cat "$OUT/host_detail.log" | tail -12
  timeout 300 python3 -m opsadv conformance --backend cuda -v --impl cuda.triton.flash_attention \
    --json "$OUT/conf_triton_fa.json" > "$OUT/conformance.log" 2>&1; echo "conformance rc $?"; tail -3 "$OUT/conformance.log"
  ;;
esac
# PART=d (diagnostic): fwd+bwd host split across autograd's threads + decode cProfile
if [ "${PART:-a}" = d ]; then
  timeout 200 python3 benchmarks/host_cost.py --split --decode --profile "$OUT/host_split_decode.txt" > "$OUT/host_d.log" 2>&1
  echo "split/decode rc $?"; head -8 "$OUT/host_split_decode.txt"; tail -5 "$OUT/host_d.log"
fi
# PART=e: after the host-path work (norm backward stage 2 in one launch, FastLaunch, decode priority):
# GPU test of the launch fast path, norm conformance (real kernels), host cost tables, norm fwd+bwd bench, e2e decode
if [ "${PART:-a}" = e ]; then
  TRITON_INTERPRET=0 timeout 90 python3 -m pytest -q -p no:cacheprovider tests/test_fast_launch.py > "$OUT/gpu_tests.log" 2>&1
  echo "gpu tests rc $?"; tail -2 "$OUT/gpu_tests.log"
  timeout 100 python3 -m opsadv conformance --backend cuda --ops layer_norm,rms_norm --json "$OUT/conf_norm.json" \
    > "$OUT/conf_norm.log" 2>&1; echo "norm conformance rc $?"; tail -1 "$OUT/conf_norm.log"
  timeout 100 python3 benchmarks/host_cost.py --detail --split --decode-impls --profile "$OUT/host_tables.txt" \
    > /dev/null 2>&1; echo "host tables rc $?"; cat "$OUT/host_tables.txt"
  timeout 100 python3 -m opsadv bench --suite norm --filter 'fwd\+bwd' --json "$OUT/norm_fb.json" > "$OUT/bench.log" 2>&1
  echo "norm rc $?"
  timeout 150 python3 -m opsadv bench --suite e2e --quick --filter decode --json "$OUT/e2e_decode.json" >> "$OUT/bench.log" 2>&1
  echo "decode rc $?"; grep -E "^(fwd|decode)" "$OUT/bench.log" | tail -16
fi
# PART=f (last call of session 3): sparse with the new forward defaults (window 1024/2048/4096 fwd and
# fwd+bwd, varlen, our dense kernel) + the fwd+bwd host-cost experiments (multithreading off, stubbed backward)
if [ "${PART:-a}" = f ]; then
  timeout 60 python3 benchmarks/host_cost.py --experiments --profile "$OUT/host_experiments.txt" > /dev/null 2>&1
  echo "experiments rc $?"; cat "$OUT/host_experiments.txt"
  timeout 150 python3 -m opsadv bench --suite sparse --filter 'sliding(1024|2048|4096) causal|dense causal|varlen' \
    --json "$OUT/h200_sparse.json" > "$OUT/bench_sparse.log" 2>&1
  echo "sparse rc $?"; grep -E "^(fwd|case)" "$OUT/bench_sparse.log" | tail -12
fi
