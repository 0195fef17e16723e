"""GPU probe for the cuda backend's flash attention: correctness of every impl (Triton + SDPA
vendors) against the reference in float32/64, then timing of key cases against SDPA cuDNN/flash.

  PYTHONPATH=. python benchmarks/attention_probe.py correct PART NPARTS OUT.json
  PYTHONPATH=. python benchmarks/attention_probe.py time OUT.json [PART NPARTS]
Results are appended to the JSON file after every case (a killed run keeps what it had)."""
from __future__ import annotations

import dataclasses
import json
import math
import sys
import time
import traceback

import torch
import torch.nn.functional as F

import opsadv
from opsadv.backends.reference import kernels as R
from opsadv.core import dispatch
from opsadv.core.ops import attention as A
from opsadv.registry import get_registry

DT = {"bf16": torch.bfloat16, "fp16": torch.float16}


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def save(path, rec):
    try:
        data = json.load(open(path))
    except Exception:
        data = []
    data.append(rec)
    json.dump(data, open(path, "w"), indent=1)
    print(json.dumps(rec), flush=True)


def impls():
    return {i.id: i for i in get_registry().impls_by_op["flash_attention"]}


def ctx_for(q, k, causal, backward=False, autotune=False):
    opsadv.use_backend("cuda")
    exp, r = dispatch.explain_spec(A._spec(q, k, None, causal, backward))
    prof = r.ctx.profile if autotune else dataclasses.replace(r.ctx.profile, autotune=False)
    return dataclasses.replace(r.ctx, profile=prof), exp


CORRECT = [  # (dtype, b, hq, hkv, sq, sk, d, causal)
    ("bf16", 2, 8, 2, 1024, 1024, 128, True), ("bf16", 2, 8, 2, 1024, 1024, 128, False),
    ("bf16", 1, 4, 4, 333, 200, 128, True), ("bf16", 1, 4, 4, 1, 1000, 128, False),
    ("bf16", 2, 8, 2, 1024, 1024, 64, True), ("bf16", 1, 4, 4, 200, 333, 64, False),
    ("bf16", 1, 4, 2, 300, 300, 32, True), ("bf16", 1, 4, 2, 300, 300, 96, True),
    ("bf16", 1, 4, 2, 300, 300, 256, True), ("fp16", 1, 4, 4, 777, 777, 128, True),
    ("fp16", 1, 4, 1, 129, 700, 64, True),
]


def correct(part, nparts, out):
    torch.manual_seed(part)
    I = impls()
    for n, (dt, b, hq, hkv, sq, sk, d, causal) in enumerate(CORRECT):
        if n % nparts != part:
            continue
        dtype = DT[dt]
        q = torch.randn(b, hq, sq, d, device="cuda", dtype=dtype)
        k = torch.randn(b, hkv, sk, d, device="cuda", dtype=dtype)
        v = torch.randn(b, hkv, sk, d, device="cuda", dtype=dtype)
        do = torch.randn(b, hq, sq, d, device="cuda", dtype=dtype)
        s = 1 / math.sqrt(d)
        ro, rl = R.attention_fwd(None, q.double(), k.double(), v.double(), None, causal, s)
        rq, rk, rv = R.attention_bwd(None, do.double(), q.double(), k.double(), v.double(), ro, rl, None, causal, s)
        ctx, exp = ctx_for(q, k, causal)
        fin = torch.isfinite(rl)
        for iid, c in ((c.impl.id, c) for c in exp.candidates):
            rec = {"kind": "correct", "case": [dt, b, hq, hkv, sq, sk, d, causal], "impl": iid,
                   "accepted": c.accepted, "reasons": list(c.reasons)}
            if c.accepted:
                impl = I[iid]
                try:
                    o, l = impl.fn(ctx, q, k, v, None, causal, s)
                    torch.cuda.synchronize()
                    dq, dk, dv = impl.backward(ctx, do, q, k, v, o, l, None, causal, s)
                    torch.cuda.synchronize()
                    rec.update(out=rel(o, ro), lse=rel(l[fin], rl[fin]), lse_shape=list(l.shape),
                               lse_empty_ok=bool((l[~fin] == -math.inf).all()), nan=bool(o.isnan().any() or dq.isnan().any()),
                               dq=rel(dq, rq), dk=rel(dk, rk), dv=rel(dv, rv))
                except Exception as e:
                    rec.update(error=f"{type(e).__name__}: {str(e)[:400]}")
            save(out, rec)
    if part == 0:   # non-contiguous (b, s, h, d) inputs, fp32 with precision, explain + measured choice
        try:
            x = torch.randn(2, 500, 8, 128, device="cuda", dtype=torch.bfloat16)
            q = x.transpose(1, 2)
            kv = torch.randn(2, 500, 2, 128, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
            with opsadv.use_backend("cuda", deterministic=True):
                o = opsadv.ops.flash_attention(q, kv, kv, causal=True)
            ro, _ = R.attention_fwd(None, q.double(), kv.double(), kv.double(), None, True, 128 ** -0.5)
            save(out, {"kind": "noncontig", "out": rel(o, ro)})
            qf = torch.randn(1, 4, 300, 64, device="cuda", requires_grad=True)
            with opsadv.use_backend("cuda", precision="bf16"):
                o = opsadv.ops.flash_attention(qf, qf, qf, causal=True)
                o.sum().backward()
                e = str(opsadv.explain("flash_attention", qf, qf, qf, causal=True))
            ro, _ = R.attention_fwd(None, qf.double(), qf.double(), qf.double(), None, True, 64 ** -0.5)
            save(out, {"kind": "fp32_bf16", "out": rel(o, ro), "dtype": str(o.dtype), "grad_dtype": str(qf.grad.dtype),
                       "explain": e})
            q = torch.randn(4, 32, 2048, 128, device="cuda", dtype=torch.bfloat16)
            with opsadv.use_backend("cuda", autotune=True):
                o = opsadv.ops.flash_attention(q, q, q, causal=True)
                e = str(opsadv.explain("flash_attention", q, q, q, causal=True))
            save(out, {"kind": "measured", "explain": e})
        except Exception:
            save(out, {"kind": "part0_error", "tb": traceback.format_exc()[-2000:]})


def bench(fn):
    from triton.testing import do_bench
    return float(do_bench(fn, warmup=25, rep=100, return_mode="median"))


TIME = [  # (dtype, b, hq, hkv, s, d, causal)
    ("bf16", 4, 32, 32, 4096, 128, False), ("bf16", 4, 32, 32, 4096, 128, True),
    ("bf16", 1, 32, 8, 16384, 128, True), ("bf16", 1, 32, 32, 16384, 128, False),
    ("bf16", 16, 32, 32, 1024, 64, False), ("bf16", 4, 32, 32, 4096, 64, True),
    ("bf16", 16, 32, 32, 1024, 128, True), ("fp16", 4, 32, 32, 4096, 128, False),
]


def timing(out, part=0, nparts=1):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from opsadv.backends.cuda import attention as TA
    I = impls()
    tri = I["cuda.triton.flash_attention"]
    for dt, b, hq, hkv, s, d, causal in TIME[part::nparts]:
        torch.manual_seed(0)
        dtype = DT[dt]
        q = torch.randn(b, hq, s, d, device="cuda", dtype=dtype, requires_grad=True)
        k = torch.randn(b, hkv, s, d, device="cuda", dtype=dtype, requires_grad=True)
        v = torch.randn(b, hkv, s, d, device="cuda", dtype=dtype, requires_grad=True)
        do = torch.randn(b, hq, s, d, device="cuda", dtype=dtype)
        flops = 4 * b * hq * s * s * d * (0.5 if causal else 1.0)
        rec = {"kind": "time", "case": [dt, b, hq, hkv, s, d, causal]}
        try:
            ctx, _ = ctx_for(q, k, causal, autotune=True)
            sc = d ** -0.5
            t0 = time.time()
            o, l = tri.fn(ctx, q.detach(), k.detach(), v.detach(), None, causal, sc)
            tri.backward(ctx, do, q.detach(), k.detach(), v.detach(), o, l, None, causal, sc)
            torch.cuda.synchronize()
            rec["tune_s"] = time.time() - t0
            for name, tuner in (("fwd", TA._FWD), ("bwd_kv", TA._BWD_KV), ("bwd_q", TA._BWD_Q)):
                for key, best in tuner.best.items():
                    if key[1] == d and key[2] == causal and key[4] == TA.bucket(s) and key[0] == str(dtype):
                        rec[f"cfg_{name}"] = best
                        rec[f"cfg_{name}_ms"] = {str(i): round(t, 4) for i, t in tuner.times[key].items()}
            f_t = lambda: tri.fn(ctx, q.detach(), k.detach(), v.detach(), None, causal, sc)
            b_t = lambda: tri.backward(ctx, do, q.detach(), k.detach(), v.detach(), o, l, None, causal, sc)
            rec["triton_fwd_ms"] = bench(f_t)
            rec["triton_bwd_ms"] = bench(b_t)
            try:
                tria = I["cuda.triton.flash_attention.atomic_dq"]
                ga = tria.backward(ctx, do, q.detach(), k.detach(), v.detach(), o, l, None, causal, sc)
                gd = b_t()
                rec["atomic_vs_det_rel"] = max(rel(x, y) for x, y in zip(ga, gd))
                rec["triton_bwd_atomic_ms"] = bench(
                    lambda: tria.backward(ctx, do, q.detach(), k.detach(), v.detach(), o, l, None, causal, sc))
                for key, best in TA._BWD_KVA.best.items():
                    if key[1] == d and key[2] == causal and key[4] == TA.bucket(s) and key[0] == str(dtype):
                        rec["cfg_bwd_kva"] = best
                        rec["cfg_bwd_kva_ms"] = {str(i): round(t, 4) for i, t in TA._BWD_KVA.times[key].items()}
            except Exception:
                rec["atomic_tb"] = traceback.format_exc()[-1500:]
            if (dt, s, d, causal) == ("bf16", 4096, 128, False):   # clock drift check: alternate cuDNN and Triton
                from torch.nn.attention import SDPBackend as _B, sdpa_kernel as _k
                def cud():
                    with _k([_B.CUDNN_ATTENTION]), torch.no_grad():
                        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=hkv != hq)
                rec["drift"] = [round(bench(fn), 4) for fn in (cud, f_t, cud, f_t, cud, f_t)]
            ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=hkv != hq)
            rec["triton_rel_err"] = rel(o, ref)
            for nm, be in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION),
                           ("efficient", SDPBackend.EFFICIENT_ATTENTION)):
                try:
                    with sdpa_kernel([be]):
                        ff = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=hkv != hq)
                        with torch.no_grad():
                            rec[f"{nm}_fwd_ms"] = bench(ff)
                        rec[f"{nm}_fwdbwd_ms"] = bench(lambda: torch.autograd.grad(ff(), (q, k, v), do))
                except Exception as e:
                    rec[f"{nm}_error"] = f"{type(e).__name__}: {str(e)[:200]}"
            rec["triton_fwdbwd_ms"] = rec["triton_fwd_ms"] + rec["triton_bwd_ms"]
            if "triton_bwd_atomic_ms" in rec:
                rec["triton_atomic_fwdbwd_ms"] = rec["triton_fwd_ms"] + rec["triton_bwd_atomic_ms"]
            for key in list(rec):
                if key.startswith("cfg") or not isinstance(rec[key], float):
                    continue
                if key.endswith("fwd_ms"):
                    rec[key.replace("_ms", "_tflops")] = round(flops / rec[key] / 1e9, 1)
                elif key.endswith("fwdbwd_ms"):
                    rec[key.replace("_ms", "_tflops")] = round(3.5 * flops / rec[key] / 1e9, 1)
        except Exception:
            rec["tb"] = traceback.format_exc()[-2500:]
        save(out, rec)


if __name__ == "__main__":
    if sys.argv[1] == "correct":
        correct(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
    else:
        timing(sys.argv[2], *(int(a) for a in sys.argv[3:5]))
