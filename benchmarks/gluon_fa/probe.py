"""GPU probe for the Gluon Hopper flash-attention forward (opsadv/backends/cuda/_gluon_fa_kernel.py,
impl cuda.gluon.flash_attention): correctness of each schedule, then timing next to SDPA cuDNN.

  PYTHONPATH=. python benchmarks/gluon_fa/probe.py OUT.json [--variants=ws,inline,...] [--no-impl]

Variants: every gluon_attention.VARIANTS entry by default, each only at the head dims where it is a
distinct kernel (gluon_attention.variants_for: the 3-stage ones, inline_st3 and pingpong_st3, are
d128 only).  Exit status 1 when any schedule gave a wrong result (FAIL lines, 'check' rows).

Correctness: out and lse of each schedule against float32 softmax attention from the same inputs
(norm-relative error of out < 1e-2, max |lse error| < 1e-2 on rows that see a key, lse = -inf exactly
on rows that see none, no NaN left of the NaN-poisoned outputs), for causal / non-causal, ragged
lengths, GQA, s_q != s_k.  A schedule wrong anywhere is not timed.
Timing (triton.testing.do_bench median, ms): each schedule's launch (descriptors prebuilt) next to
SDPA cuDNN at b4 h32 s4096 and b1 h32 s16384, d128/d64, causal and not; then, unless --no-impl, the
impl through opsadv.ops.flash_attention pinned (forward, and forward + backward with the Triton
backward; autotune off: the profile's first Triton backward configs) next to SDPA cuDNN (direct, and as impl cuda.sdpa.cudnn pinned: x cuDNN of an impl row is
against that, same host path) and the Triton impl.
TFLOP/s counts 4 b h s^2 d per forward (half of it causal), 3.5x that for forward + backward.
SDPA cuDNN with GQA: F.scaled_dot_product_attention(enable_gqa=True) (cuDNN reads the kv heads natively).
The emulation of the kernel's recurrence on CPU lives in tests/test_gluon_attention.py."""
from __future__ import annotations

import json
import math
import os
import sys
import time
import traceback

import torch
import torch.nn.functional as F

CHECK_SHAPES = [  # b, hq, hkv, sq, sk, d, causal
    (1, 1, 1, 128, 128, 64, False), (1, 3, 3, 1, 1, 128, False), (2, 5, 5, 383, 383, 64, True),
    (2, 4, 2, 1000, 1000, 128, True), (2, 4, 1, 1000, 1000, 128, False), (1, 4, 2, 1, 4097, 128, True),
    (1, 4, 2, 700, 2000, 128, True), (1, 4, 4, 2000, 700, 64, True), (1, 4, 4, 2000, 700, 128, True),
    (4, 32, 32, 4096, 4096, 128, True), (4, 32, 8, 4096, 4096, 128, False),
]
TIME_SHAPES = [(4, 32, 32, 4096, 128), (4, 32, 32, 4096, 64), (1, 32, 32, 16384, 128), (1, 32, 32, 16384, 64),
               (4, 32, 8, 4096, 128)]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def reference(q, k, v, scale, causal):
    """float32 softmax attention and natural-log lse, one head at a time (bottom-right causal)."""
    b, hq, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    out = torch.empty(b, hq, sq, d, dtype=torch.float32, device=q.device)
    lse = torch.empty(b, hq, sq, dtype=torch.float32, device=q.device)
    if causal:
        keep = torch.arange(sk, device=q.device)[None, :] <= torch.arange(sq, device=q.device)[:, None] + (sk - sq)
    for i in range(b):
        for j in range(hq):
            jk = j // (hq // hkv)
            sc = (q[i, j].float() @ k[i, jk].float().T) * scale
            if causal:
                sc = sc.masked_fill(~keep, float("-inf"))
            lse[i, j] = torch.logsumexp(sc, dim=-1)
            out[i, j] = torch.nan_to_num(torch.softmax(sc, dim=-1)) @ v[i, jk].float()
    return out, lse


def check(out, lse, ref_out, ref_lse):
    empty = torch.isneginf(ref_lse)
    nan = bool(torch.isnan(out).any() or torch.isnan(lse).any())
    rel = ((out.float() - ref_out).norm() / ref_out.norm().clamp_min(1e-30)).item()
    lse_err = (lse[~empty] - ref_lse[~empty]).abs().max().item() if (~empty).any() else 0.0
    empty_ok = bool(torch.equal(torch.isneginf(lse), empty) and (out[empty] == 0).all())
    return {"rel_err": rel, "lse_max_abs_err": lse_err, "nan": nan, "empty_rows": int(empty.sum()),
            "empty_ok": empty_ok, "ok": (not nan) and empty_ok and rel < 1e-2 and lse_err < 1e-2}


def flops(b, h, s, d, causal):
    return 4.0 * b * h * s * s * d * (0.5 if causal else 1.0)


def main(out_path, variants, with_impl):
    import triton
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import opsadv
    from opsadv.backends.cuda import _gluon_fa_kernel as K
    from opsadv.backends.cuda import gluon_attention as GA

    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        raise SystemExit("probe.py needs a Hopper (sm_90) GPU")
    os.environ["OPSADV_POISON_OUTPUTS"] = "1"
    rec = {"commit": os.environ.get("OPSADV_COMMIT", "unknown"), "device": torch.cuda.get_device_name(),
           "torch": torch.__version__, "triton": triton.__version__, "variants": variants,
           "default_variant": {str(k): v for k, v in GA.DEFAULT_VARIANT.items()}, "check": [], "time": [],
           "impl_time": []}
    failed = set()
    t_start = time.time()

    def save():
        json.dump(rec, open(out_path, "w"), indent=1)

    torch.manual_seed(0)
    for b, hq, hkv, sq, sk, d, causal in CHECK_SHAPES:
        for name, dt in DTYPES.items():
            if sq >= 4096 and name == "fp16":
                continue
            q = torch.randn(b, hq, sq, d, device="cuda", dtype=dt)
            k, v = (torch.randn(b, hkv, sk, d, device="cuda", dtype=dt) for _ in range(2))
            scale = d ** -0.5
            ref_out, ref_lse = reference(q, k, v, scale, causal)
            for var in variants:
                if var not in GA.variants_for(d):
                    continue
                row = {"shape": [b, hq, hkv, sq, sk, d], "causal": causal, "dtype": name, "variant": var}
                try:
                    out, lse = GA.attention_fwd(q, k, v, causal, scale, variant=var)
                    torch.cuda.synchronize()
                    row.update(check(out, lse, ref_out, ref_lse))
                except Exception as e:
                    row.update({"ok": False, "error": f"{type(e).__name__}: {str(e)[-800:]}"})
                    traceback.print_exc()
                if not row["ok"]:
                    failed.add(var)
                    print(f"FAIL {row}", flush=True)
                rec["check"].append(row)
                save()
            del ref_out, ref_lse
    print(f"checks done in {time.time() - t_start:.0f} s; failed variants: {sorted(failed)}", flush=True)

    for b, hq, hkv, s, d in TIME_SHAPES:
        for causal in (False, True):
            dt = torch.bfloat16
            q = torch.randn(b, hq, s, d, device="cuda", dtype=dt)
            k, v = (torch.randn(b, hkv, s, d, device="cuda", dtype=dt) for _ in range(2))
            times = {}
            try:
                with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                    fn = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=hkv != hq)  # noqa: E731
                    fn()
                    times["sdpa_cudnn"] = triton.testing.do_bench(fn, return_mode="median", warmup=10, rep=60)
            except Exception as e:
                times["sdpa_cudnn"] = None
                print(f"cudnn b{b} h{hq}/{hkv} s{s} d{d} causal={causal}: {type(e).__name__}: {e}", flush=True)
            for var in variants:
                if var in failed or var not in GA.variants_for(d):
                    continue
                out = torch.empty_like(q)
                lse = torch.empty(b, hq, s, device="cuda")
                grid, args, kw = GA.launch_args(q, k, v, out, lse, causal, d ** -0.5, var)
                times["gluon_" + var] = triton.testing.do_bench(lambda: K.fa_fwd_kernel[grid](*args, **kw),
                                                                return_mode="median", warmup=10, rep=60)
                if var == GA.DEFAULT_VARIANT[d]:   # the impl's output layout: (b, s, h, d) memory
                    out_bshd = torch.empty(b, s, hq, d, device="cuda", dtype=dt).transpose(1, 2)
                    g2, a2, k2 = GA.launch_args(q, k, v, out_bshd, lse, causal, d ** -0.5, var)
                    times[f"gluon_{var}_bshd_out"] = triton.testing.do_bench(
                        lambda: K.fa_fwd_kernel[g2](*a2, **k2), return_mode="median", warmup=10, rep=60)
            cudnn = times.get("sdpa_cudnn")
            fl = flops(b, hq, s, d, causal)
            for label, ms in times.items():
                rec["time"].append({"shape": [b, hq, hkv, s, d], "causal": causal, "dtype": "bf16", "impl": label,
                                    "ms": ms, "tflops": fl / (ms * 1e-3) / 1e12 if ms else None,
                                    "vs_cudnn": cudnn / ms if (ms and cudnn) else None})
            save()
    print(f"kernel timing done at {time.time() - t_start:.0f} s", flush=True)

    if with_impl:
        impl_timing(rec, save, opsadv, GA, triton, SDPBackend, sdpa_kernel)

    print(f"\n{'shape':26s} {'causal':6s} {'impl':18s} {'ms':>8s} {'TFLOP/s':>8s} {'x cuDNN':>8s}")
    for r in rec["time"] + rec["impl_time"]:
        ms, tf, x = r["ms"], r["tflops"], r["vs_cudnn"]
        print(f"{str(r['shape']):26s} {str(r['causal']):6s} {r['impl']:18s} "
              f"{'-' if ms is None else f'{ms:8.3f}':>8} {'-' if tf is None else f'{tf:8.1f}':>8} "
              f"{'-' if x is None else f'{x:8.3f}':>8}")
    save()
    if failed:
        print(f"\nWRONG RESULTS in {sorted(failed)}: see the FAIL lines / 'check' rows in {out_path}")
        return 1
    return 0


def impl_timing(rec, save, opsadv, GA, triton, SDPBackend, sdpa_kernel):
    """The impl through the op, pinned, forward and forward + backward, next to cuDNN and the Triton impl."""
    for b, hq, hkv, s, d in [(4, 32, 32, 4096, 128)]:
        for causal in (False, True):
            torch.manual_seed(1)
            q = torch.randn(b, hq, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            k, v = (torch.randn(b, hkv, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                    for _ in range(2))
            do = torch.randn(b, hq, s, d, device="cuda", dtype=torch.bfloat16)
            res = {}

            def sdpa_fwd():
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=hkv != hq)

            def ops_fwd():
                return opsadv.ops.flash_attention(q, k, v, causal=causal)

            for label, fwd, ctx in (("sdpa_cudnn", sdpa_fwd, lambda: sdpa_kernel([SDPBackend.CUDNN_ATTENTION])),
                                    ("impl_gluon", ops_fwd, lambda: opsadv.use_backend(
                                        "cuda", experimental=True, autotune=False, impls={"flash_attention": GA.IMPL_ID})),
                                    ("impl_cudnn", ops_fwd, lambda: opsadv.use_backend(
                                        "cuda", autotune=False, impls={"flash_attention": "cuda.sdpa.cudnn"})),
                                    ("impl_triton", ops_fwd, lambda: opsadv.use_backend(
                                        "cuda", autotune=False, impls={"flash_attention": "cuda.triton.flash_attention"}))):
                try:
                    with ctx():
                        with torch.no_grad():
                            fwd()
                            res[label + "_fwd"] = triton.testing.do_bench(fwd, return_mode="median", warmup=10, rep=60)

                        def fwd_bwd():
                            torch.autograd.grad(fwd(), (q, k, v), do)
                        fwd_bwd()
                        res[label + "_fwdbwd"] = triton.testing.do_bench(fwd_bwd, return_mode="median", warmup=10, rep=60)
                except Exception as e:
                    print(f"{label} b{b} h{hq}/{hkv} s{s} causal={causal}: {type(e).__name__}: {e}", flush=True)
                    traceback.print_exc()
            fl = flops(b, hq, s, d, causal)
            for label, ms in res.items():
                base = res.get("impl_cudnn_" + label.rsplit("_", 1)[1]) if label.startswith("impl") else None
                f = fl * (3.5 if label.endswith("fwdbwd") else 1.0)     # bwd = 2.5x fwd
                rec["impl_time"].append({"shape": [b, hq, hkv, s, d], "causal": causal, "impl": label, "ms": ms,
                                         "tflops": f / (ms * 1e-3) / 1e12, "vs_cudnn": base / ms if base else None})
            save()


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    if len(args) != 1:
        raise SystemExit(__doc__)
    from opsadv.backends.cuda import gluon_attention as GA
    variants = list(GA.VARIANTS)
    with_impl = "--no-impl" not in sys.argv
    for a in sys.argv[1:]:
        if a.startswith("--variants="):
            variants = a.split("=", 1)[1].split(",")
    unknown = sorted(set(variants) - set(GA.VARIANTS))
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; known: {sorted(GA.VARIANTS)}")
    sys.exit(main(args[0], variants, with_impl))
