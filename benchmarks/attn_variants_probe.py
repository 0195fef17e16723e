"""H200 sweep of the own Triton attention kernels' variants (tile configs and kernel flags:
conditional rescaling, source-pipelined QK^T, warp specialization, TMA) for dense flash attention
(forward, both backward kernels) and the block-sparse kernel.  Every variant is checked against
torch SDPA (math backend, fp32 on the same bf16 inputs) before it is timed; timings use
triton.testing.do_bench medians on the bench suites' shapes, next to SDPA cuDNN / flash.

  PYTHONPATH=. python benchmarks/attn_variants_probe.py sweep OUT_DIR [--only dense,sparse]
Compilation runs first in parallel worker processes (`compile` mode, one per chunk of variants;
a compiler crash loses only its chunk, reported as failed); the main process then hits Triton's
disk cache.  Results: OUT_DIR/attn_variants.json (rewritten after every record)."""
from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
import time
import traceback

import torch
import torch.nn.functional as F

DENSE_TIME = (4, 32, 4096)          # b, h, s of the bench suite's quick dense cases (d128)
DENSE_TIME_D64 = (16, 32, 1024)
DENSE_CHECK = (1, 16, 1024)         # same divisibility specialisation as the timed shapes
DENSE_RAGGED = (1, 16, 1000)        # EVEN_M = False, kv tail
SP_S, SP_W = 16384, 1024
SP_CHECK_S, SP_CHECK_W = 2048, 256
VARLEN = (8, 4096)
DEV = "cuda"
DT = torch.bfloat16
if os.environ.get("PROBE_SMOKE"):   # CPU smoke test of this script under TRITON_INTERPRET=1 (tiny shapes)
    DENSE_TIME = DENSE_TIME_D64 = DENSE_CHECK = (1, 2, 256)
    DENSE_RAGGED = (1, 2, 200)
    SP_S, SP_W, SP_CHECK_S, SP_CHECK_W, VARLEN = 512, 128, 384, 64, (3, 256)
    DEV, DT = "cpu", torch.float16           # the interpreter's bf16 dot is wrong


def _t(bm, bn, w, s, **flags):
    return {"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": w, "num_stages": s, **flags}


def variants() -> list[dict]:
    v = []
    fwd128 = [_t(64, 64, 4, 3), _t(128, 128, 8, 3), _t(128, 64, 8, 3), _t(128, 64, 8, 2), _t(128, 128, 8, 2),
              _t(64, 128, 4, 3), _t(128, 64, 4, 3), _t(64, 64, 4, 4)]
    for base in (_t(64, 64, 4, 3), _t(128, 64, 8, 3), _t(128, 128, 8, 3), _t(128, 64, 4, 3)):
        for fl in ({"RESCALE": 8.0}, {"PIPE": True}, {"PIPE": True, "RESCALE": 8.0}):
            fwd128.append({**base, **fl})
    fwd128 += [_t(128, 128, 8, 3, TMA=True), _t(128, 64, 8, 3, TMA=True, PIPE=True)]
    for c in fwd128:
        v.append({"kind": "fwd", "d": 128, "cfg": c})
    for c in (_t(128, 128, 8, 3, WS=True), _t(128, 64, 4, 3, WS=True), _t(128, 128, 8, 3, WS=True, TMA=True)):
        v.append({"kind": "fwd", "d": 128, "cfg": c, "isolated": True})
    for c in (_t(64, 64, 4, 3), _t(128, 64, 4, 3), _t(128, 128, 8, 3), _t(64, 128, 4, 3), _t(128, 128, 4, 3),
              _t(64, 64, 4, 3, RESCALE=8.0), _t(128, 64, 4, 3, PIPE=True), _t(128, 128, 8, 3, PIPE=True)):
        v.append({"kind": "fwd", "d": 64, "cfg": c})
    for c in (_t(64, 64, 4, 2), _t(64, 64, 4, 3), _t(32, 64, 4, 3), _t(64, 128, 8, 2), _t(64, 128, 8, 3),
              _t(32, 128, 4, 3)):
        v.append({"kind": "bwd_kv", "d": 128, "cfg": c})
    for c in (_t(64, 64, 4, 2), _t(128, 64, 8, 3), _t(128, 64, 8, 2), _t(64, 64, 4, 3), _t(128, 128, 8, 2)):
        v.append({"kind": "bwd_q", "d": 128, "cfg": c})
    for c in ((64, 64, 4, 3), (64, 64, 4, 2), (64, 64, 4, 4), (128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 4, 3),
              (64, 128, 4, 3), (64, 64, 4, 3, 8.0), (128, 64, 8, 3, 8.0)):
        v.append({"kind": "sp_fwd", "d": 128, "cfg": c})
    for c in ((64, 64, 4, 2), (128, 64, 8, 3), (64, 64, 4, 3), (128, 64, 8, 2)):
        v.append({"kind": "sp_dq", "d": 128, "cfg": c})
    for c in ((64, 64, 4, 2), (64, 128, 8, 2), (32, 64, 4, 3), (64, 64, 4, 3), (32, 128, 4, 3)):
        v.append({"kind": "sp_dkdv", "d": 128, "cfg": c})
    # round 2 (after the first sweep): warp specialization around the winner, 3 CTAs per SM (BLOCK_N 32)
    for c in (_t(128, 128, 8, 2, WS=True), _t(128, 64, 8, 3, WS=True), _t(128, 128, 8, 3, WS=True, RESCALE=8.0),
              _t(64, 64, 4, 3, WS=True)):
        v.append({"kind": "fwd", "d": 128, "cfg": c, "isolated": True})
    for c in (_t(64, 32, 4, 3), _t(64, 32, 4, 4)):
        v.append({"kind": "fwd", "d": 128, "cfg": c})
    for i, x in enumerate(v):
        x["id"] = i
    return v


# ---- dense ----------------------------------------------------------------------------------------
DEFAULT = {"fwd": _t(64, 64, 4, 3), "bwd_kv": _t(64, 64, 4, 2), "bwd_q": _t(64, 64, 4, 2)}


def _dense_ctx(q, k, causal):
    import opsadv
    from opsadv.core import dispatch
    from opsadv.core.ops import attention as OA
    opsadv.use_backend("cuda")
    _, r = dispatch.explain_spec(OA._spec(q, k, None, causal, True))
    return dataclasses.replace(r.ctx, profile=dataclasses.replace(r.ctx.profile, autotune=False))


def _force(which_cfg: dict):
    """Make the attention module take exactly these configs (per pass), flags filled in."""
    from opsadv.backends.cuda import attention as A

    def cfgs(ctx, which, d, tma_ok):
        c = dict(which_cfg.get(which, DEFAULT[which]))
        for f, off in A._FWD_FLAGS.items():
            c.setdefault(f, off)
        return [c]
    A._configs = cfgs


def _inputs(b, h, s, d, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    return [torch.randn(b, h, s, d, device=DEV, dtype=DT, generator=g) for _ in range(4)]


def _rel(a, b):
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _math_ref(q, k, v, do, causal, bwd):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    qf, kf, vf = (t.float().requires_grad_(bwd) for t in (q, k, v))
    with sdpa_kernel([SDPBackend.MATH]):
        o = F.scaled_dot_product_attention(qf, kf, vf, is_causal=causal)
    if not bwd:
        return o.detach(), None
    return o.detach(), torch.autograd.grad(o, (qf, kf, vf), do.float())


def dense_run(var, q, k, v, do, causal):
    """(out, grads or None) of the dense impl with this variant forced."""
    from opsadv.backends.cuda import attention as A
    _force({var["kind"]: var["cfg"]})
    ctx = _dense_ctx(q, k, causal)
    sc = q.shape[-1] ** -0.5
    o, lse = A.flash_fwd(ctx, q, k, v, None, causal, sc)
    if var["kind"] == "fwd":
        return (o, lse), None, (lambda: A.flash_fwd(ctx, q, k, v, None, causal, sc))
    grads = A.flash_bwd(ctx, do, q, k, v, o, lse, None, causal, sc)
    return (o, lse), grads, (lambda: A.flash_bwd(ctx, do, q, k, v, o, lse, None, causal, sc))


def _dense_shapes(var):
    if var["d"] == 64:
        return [(DENSE_CHECK, False, "check"), (DENSE_TIME_D64, False, "time")]
    shapes = [(DENSE_CHECK, c, "check") for c in (False, True)] + [(DENSE_TIME, c, "time") for c in (False, True)]
    if var["kind"] == "fwd":
        shapes += [(DENSE_RAGGED, True, "check")]
    return shapes


# ---- sparse ---------------------------------------------------------------------------------------
SP_DEFAULT = ((64, 64, 4, 3), (64, 64, 4, 2), (64, 64, 4, 2))


def _sp_layouts():
    from opsadv import SparseLayout
    from opsadv.bench.suite_sparse import varlen_lengths
    lens = varlen_lengths(*VARLEN)
    return {"window": SparseLayout.sliding_window(SP_S, SP_W, causal=True, block_size=128, device=DEV),
            "window_check": SparseLayout.sliding_window(SP_CHECK_S, SP_CHECK_W, causal=True, block_size=128,
                                                        device=DEV),
            "varlen": SparseLayout.varlen(lens, causal=False, block_size=128, device=DEV),
            "varlen_check": SparseLayout.varlen([70, 110, 23] if DEV == "cpu" else [700, 1100, 230], causal=False, block_size=128, device=DEV)}


# ---- driver ---------------------------------------------------------------------------------------
OUT: dict = {"records": []}


def save(path, rec):
    OUT["records"].append(rec)
    print(json.dumps(rec), flush=True)
    if path:
        with open(path, "w") as f:
            json.dump(OUT, f, indent=0)


def bench(fn):
    if DEV == "cpu":
        t0 = time.time()
        fn()
        return (time.time() - t0) * 1e3
    from triton.testing import do_bench
    return float(do_bench(fn, warmup=10, rep=40, return_mode="median"))


def run_variant(var, path, timing=True):
    kind = var["kind"]
    rec = {"id": var["id"], "kind": kind, "d": var["d"], "cfg": var["cfg"]}
    try:
        if kind in ("fwd", "bwd_kv", "bwd_q"):
            for (b, h, s), causal, what in _dense_shapes(var):
                if what == "time" and not timing:
                    continue
                q, k, v, do = _inputs(b, h, s, var["d"], seed=s + causal)
                (o, lse), grads, fn = dense_run(var, q, k, v, do, causal)
                tag = f"{'c' if causal else 'n'}{s}"
                if what == "check":
                    ro, rg = _math_ref(q, k, v, do, causal, kind != "fwd")
                    rec[f"err_o_{tag}"] = _rel(o, ro)
                    if rg is not None:
                        names = ("dq",) if kind == "bwd_q" else ("dk", "dv")
                        idx = {"dq": 0, "dk": 1, "dv": 2}
                        for n in names:
                            rec[f"err_{n}_{tag}"] = _rel(grads[idx[n]], rg[idx[n]])
                else:
                    rec[f"ms_{tag}"] = bench(fn)
        else:
            rec.update(sparse_variant(var, timing))
    except Exception as e:
        rec["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        rec["tb"] = traceback.format_exc()[-800:]
    save(path, rec)
    return rec


def sparse_variant(var, timing):
    import opsadv
    from opsadv.backends.cuda import sparse as SP
    kind = var["kind"]
    tiles = list(SP_DEFAULT)
    tiles[{"sp_fwd": 0, "sp_dq": 1, "sp_dkdv": 2}[kind]] = tuple(var["cfg"])
    tiles = tuple(tiles)
    lays = LAYOUTS
    rec = {}
    for name in ("window_check", "varlen_check", "window", "varlen"):
        if not name.endswith("check") and not timing:
            continue
        if kind != "sp_fwd" and name.startswith("varlen"):
            continue
        lay = lays[name]
        h = 32 if name.startswith("window") else 16
        q, k, v, do = (torch.randn(1, h, lay.seq_q, 128, device=DEV, dtype=DT) for _ in range(4))
        with opsadv.use_backend("cuda"):
            ctx = SPARSE_CTX(q, lay)
        ctx = dataclasses.replace(ctx, profile=dataclasses.replace(ctx.profile, tiles={"sparse_attention": {
            "small": tiles, "large": tiles}}))
        args = (lay.block_mask, lay.key_padding_mask, lay.cu_seqlens, lay.block_size, lay.causal,
                lay.window_left, lay.window_right, lay.num_global)
        sc = 128 ** -0.5
        out, lse = SP.sparse_fwd(ctx, q, k, v, *args, sc)
        only = {"sp_dq": "dq", "sp_dkdv": "dkdv"}.get(kind)
        if name.endswith("check"):
            dense = lay.dense_mask(device=DEV)
            ro, rg = _masked_ref(q, k, v, do, dense, kind != "sp_fwd")
            rec[f"err_o_{name}"] = _rel(out, ro)
            if rg is not None:
                dq, dk, dv = SP.sparse_bwd(ctx, do, q, k, v, out, lse, *args, sc, only=only)
                if only == "dq":
                    rec[f"err_dq_{name}"] = _rel(dq, rg[0])
                else:
                    rec[f"err_dk_{name}"] = _rel(dk, rg[1])
                    rec[f"err_dv_{name}"] = _rel(dv, rg[2])
        else:
            if kind == "sp_fwd":
                rec[f"ms_{name}"] = bench(lambda: SP.sparse_fwd(ctx, q, k, v, *args, sc))
            else:
                rec[f"ms_{name}"] = bench(lambda: SP.sparse_bwd(ctx, do, q, k, v, out, lse, *args, sc, only=only))
    return rec


def _masked_ref(q, k, v, do, dense, bwd):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    qf, kf, vf = (t.float().requires_grad_(bwd) for t in (q, k, v))
    with sdpa_kernel([SDPBackend.MATH]):
        o = F.scaled_dot_product_attention(qf, kf, vf, attn_mask=dense)
    o = torch.nan_to_num(o)
    if not bwd:
        return o.detach(), None
    return o.detach(), torch.autograd.grad(o, (qf, kf, vf), do.float())


def SPARSE_CTX(q, lay):
    from opsadv.core import dispatch
    from opsadv.core.ops import sparse as OS
    spec = OS._spec(q, q, lay.key_padding_mask, lay.cu_seqlens, lay.block_size, lay.causal, lay.window_left,
                    lay.num_global, True)
    _, r = dispatch.explain_spec(spec)
    return r.ctx


LAYOUTS: dict = {}


def peers(path):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    for (b, h, s), d, causals in ((DENSE_TIME, 128, (False, True)), (DENSE_TIME_D64, 64, (False,))):
        for causal in causals:
            q, k, v, do = _inputs(b, h, s, d, seed=1)
            qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
            rec = {"kind": "peer", "case": [b, h, s, d, causal]}
            for nm, be in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
                def f(be=be):
                    with sdpa_kernel([be]):
                        return F.scaled_dot_product_attention(qg, kg, vg, is_causal=causal)
                with torch.no_grad():
                    rec[f"{nm}_fwd_ms"] = bench(f)
                rec[f"{nm}_fwdbwd_ms"] = bench(lambda f=f: torch.autograd.grad(f(), (qg, kg, vg), do))
            save(path, rec)


def compile_mode(ids):
    """Worker: run each listed variant once on its check shapes (compiles into Triton's disk cache)."""
    global LAYOUTS
    LAYOUTS = _sp_layouts()
    vs = {v["id"]: v for v in variants()}
    for i in ids:
        t0 = time.time()
        r = run_variant(vs[i], None, timing=False)
        print(f"compiled {i} in {time.time() - t0:.1f}s {'ERR ' + r['error'][:120] if 'error' in r else ''}",
              flush=True)


def sweep(out_dir, only):
    global LAYOUTS
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "attn_variants.json")
    OUT.update(device=torch.cuda.get_device_name() if DEV == "cuda" else "cpu", torch=torch.__version__,
               triton=__import__("triton").__version__, commit=os.environ.get("OPSADV_COMMIT", "?"))
    vs = [v for v in variants() if ("sparse" in only and v["kind"].startswith("sp_"))
          or ("dense" in only and not v["kind"].startswith("sp_"))]
    if "--ids" in sys.argv:
        keep = {int(x) for x in sys.argv[sys.argv.index("--ids") + 1].split(",")}
        vs = [v for v in vs if v["id"] in keep]
    # parallel compile: isolated variants alone, the rest in chunks
    nproc = int(os.environ.get("PROBE_JOBS", "12"))
    iso = [[v["id"]] for v in vs if v.get("isolated")]
    rest = [v["id"] for v in vs if not v.get("isolated")]
    chunks = iso + [rest[i::max(1, nproc - len(iso))] for i in range(max(1, nproc - len(iso)))]
    t0 = time.time()
    procs = [(c, subprocess.Popen([sys.executable, __file__, "compile", *map(str, c)], stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True)) for c in chunks if c]
    failed = set()
    for c, p in procs:
        try:
            txt, _ = p.communicate(timeout=float(os.environ.get("PROBE_COMPILE_TIMEOUT", "150")))
        except subprocess.TimeoutExpired:
            p.kill()
            txt = "timeout"
        if p.returncode != 0:
            failed.update(c)
            save(path, {"kind": "compile_failed", "ids": c, "rc": p.returncode, "tail": (txt or "")[-1500:]})
        else:
            for ln in (txt or "").splitlines():
                if ln.startswith("compiled"):
                    print(ln)
    print(f"compile phase {time.time() - t0:.1f}s", flush=True)
    LAYOUTS = _sp_layouts()
    if "dense" in only and DEV == "cuda":
        peers(path)
    order = {"fwd128": 0, "sp_fwd": 1, "bwd_kv": 2, "bwd_q": 3, "fwd64": 4, "sp_dq": 5, "sp_dkdv": 6}
    rank = lambda v: (order.get(v["kind"] + (str(v["d"]) if v["kind"] == "fwd" else ""), 9), v["id"])  # noqa: E731
    for v in sorted(vs, key=rank):     # most important first: a call stopped at its limit keeps those
        if v["id"] in failed:
            continue
        run_variant(v, path)
    if "dense" in only and DEV == "cuda":
        peers(path)                    # again after the variants: clock drift shows as a change
    summary(path)


def summary(path):
    recs = OUT["records"]
    print("\n==== summary (ms; err = max rel err vs SDPA math fp32) ====")
    for r in recs:
        if r["kind"] in ("peer", "compile_failed"):
            print(r)
            continue
        errs = [v for k, v in r.items() if k.startswith("err_")]
        ms = {k[3:]: round(v, 4) for k, v in r.items() if k.startswith("ms_")}
        print(r["id"], r["kind"], r["d"], r["cfg"], "err=%.2e" % max(errs) if errs else "err=?", ms,
              r.get("error", ""))


if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "compile":
        compile_mode([int(x) for x in sys.argv[2:]])
    elif mode == "sweep":
        only = "dense,sparse"
        if "--only" in sys.argv:
            only = sys.argv[sys.argv.index("--only") + 1]
        sweep(sys.argv[2], only.split(","))
    elif mode == "list":
        for v in variants():
            print(v)
