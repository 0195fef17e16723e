"""Which attention kernel is fastest at a decode step, and which one eager SDPA picks (GPU host).

Session 4 saw (results/host_s4_h200.txt, b8, 32 query / 4 kv heads, 1 new token over 2048 cached, d64, bf16)
eager `F.scaled_dot_product_attention(q, k, v, enable_gqa=True)` at 15.6 us of GPU time against 36.7 us for our
cuDNN impl and 47.5 us for our SDPA-flash impl on the same tensors.  This probe prints torch's own backend
choice (`torch._fused_sdp_choice`), then GPU time (CUDA-graph replays) and back-to-back wall time per call of:
eager SDPA, SDPA with each backend forced (with enable_gqa, and with K/V expanded to the query heads), the aten
entry points our impls call, and opsadv.ops.flash_attention per impl (pinned), each checked against float32.

  PYTHONPATH=. python3 benchmarks/decode_attn_probe.py OUT.json
"""
from __future__ import annotations

import json
import os
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench_cudagraph

import opsadv

sys.path.insert(0, os.path.dirname(__file__))
from host_cost import b2b as b2b_us  # noqa: E402  (back-to-back wall µs per call)

B, H, HKV, D, CTX = 8, 32, 4, 64, 2048
BACKENDS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}


def main() -> None:
    out = sys.argv[1] if len(sys.argv) > 1 else "decode_attn_probe.json"
    dt = torch.bfloat16
    q = torch.randn(B, H, 1, D, device="cuda", dtype=dt)
    k, v = (torch.randn(B, HKV, CTX, D, device="cuda", dtype=dt) for _ in range(2))
    ke, ve = (t.repeat_interleave(H // HKV, dim=1) for t in (k, v))
    ref = F.scaled_dot_product_attention(q.float(), ke.float(), ve.float())
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "commit": os.environ.get("OPSADV_COMMIT", ""), "shape": f"b{B} h{H}/kv{HKV} 1x{CTX} d{D} bf16", "rows": []}
    try:
        choice = torch._fused_sdp_choice(q, k, v, None, 0.0, False, enable_gqa=True)
        res["eager_choice_gqa"] = str(SDPBackend(choice))
        res["eager_choice_expanded"] = str(SDPBackend(torch._fused_sdp_choice(q, ke, ve, None, 0.0, False)))
    except Exception as e:  # noqa: BLE001  (private API: record why it is missing)
        res["eager_choice_error"] = f"{type(e).__name__}: {e}"
    print({k_: v_ for k_, v_ in res.items() if k_.startswith("eager")}, flush=True)

    cases = {"eager sdpa (enable_gqa)": lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True),
             "eager sdpa (expanded kv)": lambda: F.scaled_dot_product_attention(q, ke, ve)}
    for name, be in BACKENDS.items():
        cases[f"sdpa forced {name} (enable_gqa)"] = (lambda be=be: _forced(be, q, k, v, True))
        cases[f"sdpa forced {name} (expanded kv)"] = (lambda be=be: _forced(be, q, ke, ve, False))
    cases["aten cudnn (our impl's call)"] = lambda: torch.ops.aten._scaled_dot_product_cudnn_attention(
        q, k, v, None, True, 0.0, False, False, scale=D ** -0.5)[0]
    cases["aten cudnn, no lse"] = lambda: torch.ops.aten._scaled_dot_product_cudnn_attention(
        q, k, v, None, False, 0.0, False, False, scale=D ** -0.5)[0]
    cases["aten flash (our impl's call)"] = lambda: torch.ops.aten._scaled_dot_product_flash_attention(
        q, k, v, 0.0, False, False, scale=D ** -0.5)[0]
    from opsadv.registry import get_registry
    impls = [i.id for i in get_registry().impls_by_op.get("flash_attention", []) if i.backend == "cuda"]
    # one policy object per pin, built once (a policy made inside the timed call would miss the dispatch memo)
    pins = {impl: opsadv.use_backend("cuda", impls={"flash_attention": impl}) for impl in impls}
    for impl, scope in pins.items():
        def run(scope=scope):
            with scope:
                return opsadv.ops.flash_attention(q, k, v)
        cases[f"opsadv pinned {impl}"] = run
    with opsadv.use_backend("cuda"):
        cases["opsadv auto"] = lambda: opsadv.ops.flash_attention(q, k, v)
        for name, fn in cases.items():
            row = {"case": name}
            try:
                o = fn()
                row["rel_err"] = round(((o.float() - ref).norm() / ref.norm()).item(), 5)
                row["gpu_us"] = round(do_bench_cudagraph(fn, rep=50, return_mode="median") * 1e3, 2)
                row["b2b_us"] = round(b2b_us(fn), 2)
            except Exception as e:  # noqa: BLE001  (a backend that refuses the shape is a result)
                row["error"] = f"{type(e).__name__}: {str(e)[:160]}"
            res["rows"].append(row)
            print(row, flush=True)
    with open(out, "w") as f:
        json.dump(res, f, indent=1)


def _forced(be, q, k, v, gqa):
    with sdpa_kernel([be]):
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa)


if __name__ == "__main__":
    main()
