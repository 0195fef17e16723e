#!/usr/bin/env bash
# The next GPU session's first calls (written at the end of session 4; each part fits one <= 10-minute call):
#   PART=a: e2e non-quick (Llama prefill, decode, BERT) once at HEAD + benchmarks/decode_attn_probe.py (which
#           attention kernel eager SDPA picks at a decode step, and what each costs)
#   PART=b: e2e non-quick twice more (issue 6 is resolved on the median of three runs at one commit)
#   PART=c: persistent GEMM odd shapes (PROBE_SECTIONS=odd) + norm fwd+bwd bench twice on one machine
#           (separates host noise from change)
#   PART=d: the Gluon FA3-style forward (benchmarks/gluon_fa/: compiles for sm_90 on CPU, never run): correctness
#           against float32 attention, then TFLOP/s next to SDPA cuDNN / flash (issue 3)
# OPSADV_COMMIT=<sha> PART=a bash benchmarks/h200_next.sh   (from the repo root on the GPU host, $OUT set)
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 OPSADV_CACHE_DIR=/tmp/opsadv-cache OPSADV_COMMIT=${OPSADV_COMMIT:-unknown}
e2e() {
  timeout "$2" python3 -m opsadv bench --suite e2e --json "$OUT/e2e_$1.json" > "$OUT/e2e_$1.log" 2>&1
  echo "e2e run $1 rc $?"; grep -E "^(prefill|decode)" "$OUT/e2e_$1.log" | tail -4
}
case "${PART:-a}" in
a)
  e2e 1 420
  timeout 120 python3 benchmarks/decode_attn_probe.py "$OUT/decode_attn_probe_h200.json" > "$OUT/decode_attn.log" 2>&1
  echo "decode attn rc $?"; tail -30 "$OUT/decode_attn.log"
  ;;
b)
  e2e 2 280; e2e 3 280
  ;;
c)
  PROBE_SECTIONS=odd timeout 200 python3 benchmarks/gemm_persistent_probe.py "$OUT/gemm_odd_h200.json" 180 \
    > "$OUT/gemm_odd.log" 2>&1; echo "gemm odd rc $?"; tail -8 "$OUT/gemm_odd.log"
  for i in 1 2; do
    timeout 140 python3 -m opsadv bench --suite norm --filter 'fwd\+bwd' --json "$OUT/norm_$i.json" > "$OUT/norm_$i.log" 2>&1
    echo "norm run $i rc $?"; grep -E "^fwd" "$OUT/norm_$i.log" | tail -12
  done
  ;;
d)
  timeout 300 python3 benchmarks/gluon_fa/probe.py "$OUT/gluon_fa_h200.json" > "$OUT/gluon_fa.log" 2>&1
  echo "gluon fa rc $?"; tail -30 "$OUT/gluon_fa.log"
  ;;
esac
