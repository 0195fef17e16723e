"""Does aten's cuDNN attention take GQA-shaped K/V (fewer kv heads) without expanding them, forward
and backward, and is it faster than expanding?  Compared against fp32 math on expanded K/V.

    PYTHONPATH=. python3 benchmarks/gqa_cudnn_probe.py [OUT.json]
"""
from __future__ import annotations

import json
import sys

import torch
import torch.nn.functional as F
from triton.testing import do_bench

A = torch.ops.aten


def ref(q, k, v, causal):
    g = q.shape[1] // k.shape[1]
    ke, ve = k.float().repeat_interleave(g, 1), v.float().repeat_interleave(g, 1)
    return F.scaled_dot_product_attention(q.float(), ke, ve, is_causal=causal)


def cudnn(q, k, v, causal):
    r = A._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False, scale=None)
    return r[0], r[1]


def cudnn_bwd(do, q, k, v, o, lse, causal):
    z = torch.zeros((), dtype=torch.int64, device=q.device)
    return A._scaled_dot_product_cudnn_attention_backward(do, q, k, v, o, lse, z, z, None, None, None,
                                                          q.shape[2], k.shape[2], 0.0, causal, scale=None)


def main():
    res = {"torch": torch.__version__, "cudnn": torch.backends.cudnn.version(), "cases": []}
    for (b, h, hk, s, d, causal) in [(4, 32, 8, 4096, 128, True), (4, 32, 8, 4096, 128, False),
                                     (2, 32, 4, 2048, 64, True), (1, 8, 1, 1000, 128, False)]:
        torch.manual_seed(0)
        q = torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(b, hk, s, d, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(b, hk, s, d, device="cuda", dtype=torch.bfloat16)
        do = torch.randn_like(q)
        row = {"shape": [b, h, hk, s, d], "causal": causal}
        r = ref(q, k, v, causal)
        g = h // hk
        try:
            o, lse = cudnn(q, k, v, causal)
            row["native_fwd_err"] = ((o.float() - r).norm() / r.norm()).item()
            row["native_lse_shape"] = list(lse.shape)
            try:
                dq, dk, dv = cudnn_bwd(do, q, k, v, o, lse, causal)
                qf, kf, vf = (t.detach().float().requires_grad_() for t in (q, k, v))
                ref(qf, kf, vf, causal).backward(do.float())
                row["native_bwd_shapes"] = [list(dq.shape), list(dk.shape), list(dv.shape)]
                row["native_bwd_err"] = max(((a.float() - b_.grad).norm() / b_.grad.norm()).item()
                                            for a, b_ in ((dq, qf), (dk, kf), (dv, vf)))
                row["native_fwdbwd_ms"] = do_bench(lambda: cudnn_bwd(do, q, k, v, *cudnn(q, k, v, causal), causal),
                                                   return_mode="median")
            except Exception as e:                                    # noqa: BLE001
                row["native_bwd_error"] = f"{type(e).__name__}: {str(e)[:300]}"
            row["native_fwd_ms"] = do_bench(lambda: cudnn(q, k, v, causal), return_mode="median")
        except Exception as e:                                        # noqa: BLE001
            row["native_fwd_error"] = f"{type(e).__name__}: {str(e)[:300]}"
        ke, ve = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
        row["expand_fwd_ms"] = do_bench(lambda: cudnn(q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1), causal),
                                        return_mode="median")
        row["expand_fwdbwd_ms"] = do_bench(lambda: cudnn_bwd(do, q, ke, ve, *cudnn(q, ke, ve, causal), causal),
                                           return_mode="median")
        row["sdpa_gqa_fwd_ms"] = do_bench(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                                                                  enable_gqa=True), return_mode="median")
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
            torch.cuda.synchronize()
        row["sdpa_gqa_kernels"] = sorted({e.name[:80] for e in prof.events()
                                          if e.device_type == torch.autograd.DeviceType.CUDA})
        print(json.dumps(row), flush=True)
        res["cases"].append(row)
    if len(sys.argv) > 1:
        json.dump(res, open(sys.argv[1], "w"), indent=1)


if __name__ == "__main__":
    main()
