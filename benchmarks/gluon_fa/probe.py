"""GPU probe for the Gluon Hopper flash-attention forward (fa_fwd_hopper.py): correctness, then timing
next to SDPA cuDNN / flash.  Nothing here has run on a GPU yet.

  PYTHONPATH=. python benchmarks/gluon_fa/probe.py OUT.json        (H100/H200; exits 1 on any wrong result)
  python benchmarks/gluon_fa/probe.py --emulate                    (CPU: the kernel's recurrence in torch)

Correctness: out and lse of both variants (warp-specialized, inline loads) against softmax(q k^T s) v
computed in float32 from the same 16-bit inputs; norm-relative error of out < 1e-2, max |lse error| < 1e-2,
no NaN left from the poisoned outputs.  Odd b/h and the smallest s (one tile) are included.  A variant
that fails is not timed.  Timing: triton.testing.do_bench median (ms) of the launch only (descriptors
prebuilt), TFLOP/s = 4 b h s^2 d / t, ratio to cuDNN."""
from __future__ import annotations

import json
import math
import os
import sys
import traceback

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

CHECK_SHAPES = [(1, 1, 128, 64), (1, 3, 128, 128), (2, 5, 384, 64), (2, 3, 1152, 128), (4, 32, 4096, 128),
                (4, 32, 4096, 64), (1, 32, 16384, 128)]
TIME_SHAPES = [(4, 32, 4096, 128), (4, 32, 4096, 64), (1, 32, 16384, 128), (1, 32, 16384, 64)]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def variants(d):
    """(warp_spec, stages): the default ring depth, plus 3 stages at d128 (224 KB + barriers of smem:
    fits the 227 KB limit per compile_sm90, no margin)."""
    return [(True, None), (False, None)] + ([(True, 3), (False, 3)] if d == 128 else [])


def vlabel(ws, stages):
    return ("gluon_ws" if ws else "gluon_inline") + (f"_st{stages}" if stages else "")


def reference(q, k, v, scale):
    """float32 softmax attention and natural-log lse, one head at a time (s=16384 scores are 1 GiB/head)."""
    b, h, s, d = q.shape
    out = torch.empty(b, h, s, d, dtype=torch.float32, device=q.device)
    lse = torch.empty(b, h, s, dtype=torch.float32, device=q.device)
    for i in range(b):
        for j in range(h):
            sc = (q[i, j].float() @ k[i, j].float().T) * scale
            lse[i, j] = torch.logsumexp(sc, dim=-1)
            out[i, j] = torch.softmax(sc, dim=-1) @ v[i, j].float()
    return out, lse


def emulate(q, k, v, scale, block_n=128):
    """The kernel's exact recurrence on CPU (float32): S_{j+1} before the rescale of O by alpha, P in the
    input dtype for P V, m in log2 units with the scale folded in."""
    qk_scale = scale * 1.4426950408889634
    s = q.float() @ k[..., :block_n, :].float().transpose(-1, -2)
    m = s.amax(-1) * qk_scale
    p = torch.exp2(s * qk_scale - m[..., None])
    l = p.sum(-1)
    o = torch.zeros(*q.shape[:-1], v.shape[-1])
    n_tiles = k.shape[-2] // block_n
    for j in range(n_tiles - 1):
        kn = k[..., (j + 1) * block_n:(j + 2) * block_n, :].float()
        vj = v[..., j * block_n:(j + 1) * block_n, :].float()
        s = q.float() @ kn.transpose(-1, -2)
        pv = p.to(q.dtype).float() @ vj                           # issued before the softmax of S_{j+1}
        m_new = torch.maximum(m, s.amax(-1) * qk_scale)
        alpha = torch.exp2(m - m_new)
        p = torch.exp2(s * qk_scale - m_new[..., None])
        l = l * alpha + p.sum(-1)
        m = m_new
        o = (o + pv) * alpha[..., None]
    o = o + p.to(q.dtype).float() @ v[..., -block_n:, :].float()
    return (o / l[..., None]).to(q.dtype), (m + torch.log2(l)) * math.log(2)


def check(out, lse, ref_out, ref_lse):
    nan = bool(torch.isnan(out).any() or torch.isnan(lse).any())
    rel = ((out.float() - ref_out).norm() / ref_out.norm()).item()
    lse_err = (lse - ref_lse).abs().max().item()
    return {"rel_err": rel, "max_abs_err": (out.float() - ref_out).abs().max().item(), "lse_max_abs_err": lse_err,
            "nan": nan, "ok": (not nan) and rel < 1e-2 and lse_err < 1e-2}


def run_emulation():
    torch.manual_seed(0)
    bad = 0
    for b, h, s, d in [(1, 3, 128, 64), (2, 2, 384, 128), (1, 2, 1152, 64)]:
        for name, dt in DTYPES.items():
            q, k, v = (torch.randn(b, h, s, d).to(dt) for _ in range(3))
            o, lse = emulate(q, k, v, d ** -0.5)
            r = check(o, lse, *reference(q, k, v, d ** -0.5))
            bad += not r["ok"]
            print(f"emulate b{b} h{h} s{s} d{d} {name}: {r}")
    return 1 if bad else 0


def main(out_path):
    import triton
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import fa_fwd_hopper as FA

    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        raise SystemExit("probe.py needs a Hopper (sm_90) GPU")
    rec = {"commit": os.environ.get("OPSADV_COMMIT", "unknown"), "device": torch.cuda.get_device_name(),
           "torch": torch.__version__, "triton": triton.__version__, "check": [], "time": []}
    failed = set()      # (variant label, dtype name) pairs that produced a wrong result somewhere

    def save():
        json.dump(rec, open(out_path, "w"), indent=1)

    torch.manual_seed(0)
    for b, h, s, d in CHECK_SHAPES:
        for name, dt in DTYPES.items():
            q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=dt) for _ in range(3))
            scale = d ** -0.5
            ref_out, ref_lse = reference(q, k, v, scale)
            for ws, st in variants(d):
                row = {"shape": [b, h, s, d], "dtype": name, "impl": vlabel(ws, st)}
                try:
                    out, lse = FA.attention(q, k, v, scale, warp_spec=ws, stages=st)
                    torch.cuda.synchronize()
                    row.update(check(out, lse, ref_out, ref_lse))
                except Exception as e:
                    row.update({"ok": False, "error": f"{type(e).__name__}: {str(e)[-800:]}"})
                    traceback.print_exc()
                if not row["ok"]:
                    failed.add((vlabel(ws, st), name))
                    print(f"FAIL {row}", flush=True)
                rec["check"].append(row)
                print(json.dumps(row), flush=True)
            del ref_out, ref_lse
            save()

    for b, h, s, d in TIME_SHAPES:
        for name, dt in DTYPES.items():
            q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=dt) for _ in range(3))
            fl = FA.flops(b, h, s, d)
            times = {}
            for label, backend in (("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION), ("sdpa_flash", SDPBackend.FLASH_ATTENTION)):
                try:
                    with sdpa_kernel([backend]):
                        F.scaled_dot_product_attention(q, k, v)
                        times[label] = triton.testing.do_bench(lambda: F.scaled_dot_product_attention(q, k, v),
                                                               return_mode="median")
                except Exception as e:
                    times[label] = None
                    print(f"{label} b{b} h{h} s{s} d{d} {name}: {type(e).__name__}: {e}", flush=True)
            for ws, st in variants(d):
                label = vlabel(ws, st)
                if (label, name) in failed:
                    times[label] = None       # wrong somewhere: a time for it would mean nothing
                    continue
                grid, args, kw, _, _ = FA.launch_args(q, k, v, warp_spec=ws, stages=st)
                times[label] = triton.testing.do_bench(lambda: FA.fa_fwd_kernel[grid](*args, **kw),
                                                       return_mode="median")
            cudnn = times.get("sdpa_cudnn")
            for label, ms in times.items():
                row = {"shape": [b, h, s, d], "dtype": name, "impl": label, "ms": ms,
                       "tflops": fl / (ms * 1e-3) / 1e12 if ms else None,
                       "vs_cudnn": cudnn / ms if (ms and cudnn) else None}
                rec["time"].append(row)
            save()

    print(f"\n{'shape':22s} {'dt':5s} {'impl':13s} {'ms':>8s} {'TFLOP/s':>8s} {'x cuDNN':>8s}")
    for r in rec["time"]:
        ms, tf, x = r["ms"], r["tflops"], r["vs_cudnn"]
        print(f"{str(r['shape']):22s} {r['dtype']:5s} {r['impl']:13s} {ms if ms is None else f'{ms:8.3f}':>8} "
              f"{tf if tf is None else f'{tf:8.1f}':>8} {x if x is None else f'{x:8.3f}':>8}")
    if failed:
        print(f"\nWRONG RESULTS in {sorted(failed)}: see the FAIL lines / 'check' rows in {out_path}")
        return 1
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--emulate":
        sys.exit(run_emulation())
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    sys.exit(main(sys.argv[1]))
