"""Is a 5-GEMM deterministic backward faster: the dK/dV kernel writes dS^T to a workspace and dQ is a GEMM over it
(attention._bwd_ds, _attn_dq_gemm.py), instead of a dQ kernel recomputing S and dP (7 GEMMs per tile pair)?
(issue 3: own fwd+bwd needs the backward ~5% faster for 1.5x SDPA-flash; cuDNN's backward is 5.36 ms vs our 6.54
at b4 s4096 d128.)

Per shape: the backward with each variant forced ("kernels": the current two kernels on two streams; "ds": dS
workspace in chunks of <= 2 GiB; "ds_pipe": two workspaces, chunk i's dQ GEMM on a side stream beside chunk
i+1's dK/dV kernel) with their tiles autotuned as the op does, next to cuDNN's backward; then the variant the
op's measured choice picks.  First, on the GPU: each variant's gradients against float64 on a ragged GQA causal
shape, with the workspace NaN-filled.

    PYTHONPATH=. python3 benchmarks/attn_bwd_ds_probe.py OUT.json
    PROBE_SHAPES=0,3 PROBE_CAPS=4,8 ...: a subset of SHAPES; "ds" also with 4 and 8 GiB workspace caps
    GQA shapes also time "kernels+split" / "ds+split": every dK/dV tile with SPLIT (one program per q head), the
    dS variant's cap raised by the shares' bytes
    PROBE_DEVICE=cpu TRITON_INTERPRET=1 ...: a dry run of the logic ("ds" only; tiles not tuned)
"""
from __future__ import annotations

import os
import sys

import torch
from _attn_probe import ragged_gqa_case, timing_case  # (benchmarks/ is sys.path[0] when run as a script)
from _probe_log import record_case, warm_and_time

from opsadv.backends.cuda import _attn_dq_gemm as G
from opsadv.backends.cuda import attention as A
from opsadv.backends.cuda._triton_utils import ConfigTuner
from opsadv.backends.reference import kernels as R

DEV = os.environ.get("PROBE_DEVICE", "cuda")
SHAPES = [(4, 32, 32, 4096, 128, False), (4, 32, 32, 4096, 128, True), (1, 32, 32, 16384, 128, True),
          (4, 32, 8, 4096, 128, True), (16, 32, 32, 1024, 128, False), (4, 32, 32, 4096, 64, True),
          (1, 32, 32, 16384, 128, False), (4, 32, 32, 4096, 64, False),
          (1, 32, 8, 16384, 128, True)]      # b, h, h_kv, s, d, causal (8: GQA s16384 causal, session 14's SPLIT)
VARIANTS = ["kernels", "ds", "ds_pipe"] if DEV == "cuda" else ["kernels", "ds"]
CAPS = [float(c) for c in os.environ.get("PROBE_CAPS", "").split(",") if c]    # e.g. "4,8": GiB
if os.environ.get("PROBE_SHAPES"):        # e.g. "0,1,6": a subset of SHAPES by index
    SHAPES = [SHAPES[int(i)] for i in os.environ["PROBE_SHAPES"].split(",")]
if DEV == "cpu":
    SHAPES = [(1, 2, 1, 70, 64, True)]


def check() -> dict:
    real = G.new_workspace
    G.new_workspace = lambda *a, **kw: real(*a, **kw).fill_(float("nan"))
    try:
        ctx, do, q, k, v, o, lse = ragged_gqa_case(DEV)
        q64, k64, v64 = q.double(), k.double(), v.double()
        ro, rl = R.attention_fwd(None, q64, k64, v64, None, True, 0.1)
        ref = R.attention_bwd(None, do.double(), q64, k64, v64, ro, rl, None, True, 0.1)
        out = {}
        for var in VARIANTS:
            grads = A.flash_bwd_variant(ctx, do, q, k, v, o, lse, True, 0.1, var)
            out[var] = {n: round(float((g.double() - r).norm() / r.norm()), 6) if not torch.isnan(g).any() else "nan"
                        for n, g, r in zip(("dq", "dk", "dv"), grads, ref)}
        return out
    finally:
        G.new_workspace = real


def kernel_us(fn) -> dict:
    """GPU time per kernel name (us, summed over launches) of one call of fn, from torch.profiler: which
    kernel of a variant costs what (the dK/dV kernel with and without the dS store, the dQ GEMM, the dQ kernel)."""
    if DEV != "cuda":
        return {}
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    out: dict = {}
    try:
        for e in prof.key_averages():
            t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0.0)
            if str(getattr(e, "device_type", "")).endswith("CUDA") and t > 0:     # kernels, not CPU ops
                out[e.key[:60]] = round(out.get(e.key[:60], 0.0) + t, 1)
    except Exception as e:  # a profiler API change must not cost the timings of the run
        out["error"] = repr(e)[:200]
    return out


def main(path: str) -> None:
    res = {"commit": os.environ.get("OPSADV_COMMIT", "unknown"),
           "device": torch.cuda.get_device_name() if DEV == "cuda" else DEV, "cap_bytes": G.DS_WORKSPACE_CAP,
           "check": check(), "cases": []}
    print("check", res["check"], flush=True)
    for b, h, hkv, s, d, causal in SHAPES:
        args, cudnn_bwd = timing_case(DEV, b, h, hkv, s, d, causal)
        ctx, do, q, k, v, o, lse, _, causal_, scale = args
        fns = {var: (lambda var=var: A.flash_bwd_variant(ctx, do, q, k, v, o, lse, causal_, scale, var))
               for var in VARIANTS}
        for gib in CAPS:        # "ds" / "ds_pipe" with another workspace cap: fewer, larger chunks (GQA s16384: the
            for var_ in [x for x in VARIANTS if x != "kernels"]:   # 2 GiB default holds one kv head, no ds_pipe)
                def with_cap(gib=gib, var_=var_):
                    old_cap, G.DS_WORKSPACE_CAP = G.DS_WORKSPACE_CAP, int(gib * (1 << 30))
                    try:
                        return A.flash_bwd_variant(ctx, do, q, k, v, o, lse, causal_, scale, var_)
                    finally:
                        G.DS_WORKSPACE_CAP = old_cap
                fns[f"{var_}@{gib}G"] = with_cap
        if h != hkv:            # GQA: SPLIT forced on every dK/dV tile (tuned among those, by tuners of their own:
            # the op's tuners keep their picks, so no call re-tunes), the dS variant's cap raised by the shares' bytes
            split_tuners = {n: ConfigTuner(f"probe.{n}") for n in ("_BWD_KV", "_BWD_KVDS", "_BWD_DQG")}

            def split(variant, ctx=ctx, do=do, q=q, k=k, v=v, o=o, lse=lse, causal_=causal_, scale=scale):
                extra = A._split_bytes(h // hkv, b * hkv, s, d)
                saved = {n: getattr(A, n) for n in split_tuners}
                old_cfg, old_cap = A._configs, G.DS_WORKSPACE_CAP
                A._configs = lambda c, which, d_, t: [{**x, "SPLIT": True} if which == "bwd_kv" else x
                                                      for x in old_cfg(c, which, d_, t)]
                G.DS_WORKSPACE_CAP = old_cap + extra
                for n, t in split_tuners.items():
                    setattr(A, n, t)
                try:
                    return A.flash_bwd_variant(ctx, do, q, k, v, o, lse, causal_, scale, variant)
                finally:
                    A._configs, G.DS_WORKSPACE_CAP = old_cfg, old_cap
                    for n, t in saved.items():
                        setattr(A, n, t)
            fns["kernels+split"] = lambda: split("kernels")
            fns["ds+split"] = lambda: split("ds")
        unavailable = {}
        for var in [v_ for v_ in list(fns) if v_ != "kernels"]:   # e.g. ds_pipe needs 2 kv heads per chunk
            try:
                fns[var]()
            except ValueError as e:
                unavailable[var] = str(e)[-160:]
                del fns[var]
        fns["chosen"] = lambda: A.flash_bwd(*args)
        if cudnn_bwd is not None:
            fns["cudnn"] = cudnn_bwd
        times = warm_and_time(fns)
        row = {"b": b, "h": h, "h_kv": hkv, "s": s, "d": d, "causal": causal,
               "ms": {n: round(t, 4) for n, t in times.items()},
               "ds_vs_kernels": round(times["kernels"] / times["ds"], 3),
               "chosen": {str(kk): vv for kk, vv in A._BWD_VARIANT.best.items()},
               "tiles": {"kv_ds": {str(kk): vv for kk, vv in A._BWD_KVDS.best.items()},
                         "dq_gemm": {str(kk): vv for kk, vv in A._BWD_DQG.best.items()}}}
        row["kernel_us"] = {var: kernel_us(fns[var]) for var in VARIANTS + [n for n in fns if "split" in n]
                            if var in fns}
        if unavailable:
            row["unavailable"] = unavailable
        if h != hkv:
            row["split_tiles"] = {n: {str(kk): vv for kk, vv in t.best.items()} for n, t in split_tuners.items()}
        if "ds_pipe" in times:
            row["ds_pipe_vs_kernels"] = round(times["kernels"] / times["ds_pipe"], 3)
        if "cudnn" in times:
            row["best_ds_vs_cudnn"] = round(times["cudnn"] / min(times["ds"], times.get("ds_pipe", 1e9)), 3)
        for t in (A._BWD_VARIANT, A._BWD_KVDS, A._BWD_DQG):
            t.best.clear()
        record_case(res, path, row)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "attn_bwd_ds_probe.json")
