"""GPU probe for the sparse attention BACKWARD loop variants (opsadv/backends/cuda/sparse.py BWD_LOOP_IDS:
"list" = the kernels as of 6ec5a3d and the current default, "prefetch", "run"), each at the profile's
backward pipeline depth (2 stages on h100) and at 3 stages (sm_90 TTGIR: only "prefetch"/"run" get 3
buffers there, benchmarks/sparse_bwd_notes.md).  One process:

  1. timing, fwd+bwd through the op (autograd, as the sparse suite times it), two interleaved rounds of
     do_bench medians, for b1 h32 s16384 d128 bf16 causal windows 1024 / 4096 and the packed varlen batch
     n8 h16 s4096 (~28% padding) causal and not, against compiled FlexAttention fwd+bwd (same mask);
     gradients of every variant checked against flex's and against "list" at 2 stages (max abs diff: the
     variants only reorder loads, so it should be 0).  bwd_ms = fwd+bwd - our forward (no_grad);
  2. correctness (as time allows): fwd+bwd through the public op for every variant on small odd patterns
     (bf16, GQA 2:1, padding, globals, bigbird) against the reference backend (float32): out, dq, dk, dv.
The variant is applied by setting SP.BWD_DEFAULT (loop) and the dq / dkdv stages of SP.TILES[profile]
inside each timed call (the forward keeps its default tiles and loop).

  PYTHONPATH=. python benchmarks/sparse_bwd_probe.py OUT.json [budget_s]
The JSON is rewritten after every record (a killed run keeps what it had).
Dry run on CPU under the interpreter (tiny shapes, fp16, no flex): PROBE_TINY=1 TRITON_INTERPRET=1 ..."""
from __future__ import annotations

import time

T0 = time.time()

import torch  # noqa: E402
from _probe_log import ProbeLog, probe_setup  # noqa: E402  (benchmarks/ is sys.path[0] when run as a script)
from _sparse_patterns import odd_patterns  # noqa: E402

import opsadv  # noqa: E402
from opsadv import SparseLayout  # noqa: E402
from opsadv.backends.cuda import sparse as SP  # noqa: E402
from opsadv.bench import suite_sparse as SS  # noqa: E402
from opsadv.bench.runner import rel_err, time_ms  # noqa: E402
from opsadv.core.dispatch import select_profile  # noqa: E402
from opsadv.core.policy import current_policy  # noqa: E402
from opsadv.registry import get_registry  # noqa: E402

OUT, BUDGET, TINY, DEV, DT, R = probe_setup("sparse_bwd_probe.json", 420.0)

PROFILE = select_profile(get_registry().backends["cuda"], current_policy())
assert SP.OP not in (getattr(PROFILE, "tiles", None) or {}), "profile pins its own sparse tiles: TILES unused"
_BASE = {cls: SP.TILES[PROFILE.name][cls] for cls in ("small", "large")}
STAGES0 = _BASE["small"][1][3]
# name -> (loop for dQ and dK/dV, backward num_stages or None = the profile's)
VARIANTS = {f"{loop}_s{st}": (loop, st) for st in dict.fromkeys((STAGES0, 3)) for loop in SP.BWD_LOOP_IDS}
BASELINE = f"list_s{STAGES0}"
R.update(profile=PROFILE.name, base_tiles=_BASE["small"], variants=VARIANTS, baseline=BASELINE)


def use_variant(name):
    """Point the module's backward default and tiles at variant `name` (called inside each timed fn)."""
    loop, st = VARIANTS[name]
    SP.BWD_DEFAULT = {"dq": loop, "dkdv": loop}
    for cls, (fwd, dq, dkdv) in _BASE.items():
        SP.TILES[PROFILE.name][cls] = (fwd, (*dq[:3], st), (*dkdv[:3], st))


LOG = ProbeLog(OUT, BUDGET, R, T0)
save, left, guarded = LOG.save, LOG.left, LOG.guarded


def randn(*shape, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    return torch.randn(*shape, device=DEV, dtype=DT, generator=g)


def fwd_bwd(q, k, v, do, lay):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = opsadv.ops.sparse_attention(q, k, v, lay)
    return (out, *torch.autograd.grad(out, (q, k, v), do))


# ---- 2. small odd patterns vs the reference backend -----------------------------------------------------
def small_correctness():
    s = 150 if TINY else 1500
    pats = odd_patterns(s, DEV, bidirectional=True)
    for pname, (lay, b) in pats.items():
        if left() < 25:
            save({"section": "correct_small", "pattern": pname, "skipped": f"time budget ({left():.0f}s left)"})
            continue
        d = 128
        q, do = randn(b, 4, s, d, seed=1), randn(b, 4, s, d, seed=4)
        k, v = randn(b, 2, s, d, seed=2), randn(b, 2, s, d, seed=3)          # GQA 2:1
        with opsadv.use_backend("reference"):
            ref = fwd_bwd(q.float(), k.float(), v.float(), do.float(), lay)
        errs = {}
        for name in VARIANTS:
            use_variant(name)
            got = fwd_bwd(q, k, v, do, lay)
            errs[name] = {n: float(f"{rel_err(x, y):.3g}") for n, x, y in zip(("out", "dq", "dk", "dv"), got, ref)}
        use_variant(BASELINE)
        save({"section": "correct_small", "pattern": pname, "errs": errs,
              "ok": all(e < 2e-2 for v_ in errs.values() for e in v_.values())})


# ---- 1. timing vs flex ------------------------------------------------------------------------------------
def _cases():
    """(fwd+bwd case, forward-only case of the same shapes and layout)."""
    if TINY:
        s, h, d = 384, 2, 32
        for w in (24, 100):
            lay = SparseLayout.sliding_window(s, w, causal=True, block_size=128, device=DEV)
            yield tuple(SS.pattern_case(f"sliding{w} causal", lay, None, h=h, d=d, dtype=DT, bwd=bwd, dev=DEV)
                        for bwd in (True, False))
        for causal in (True, False):
            yield tuple(SS.varlen_case(n=4, max_len=160, h=2, d=32, causal=causal, dtype=DT, bwd=bwd, dev=DEV)
                        for bwd in (True, False))
        return
    for w in (1024, 4096):
        yield SS.window_case(w=w, bwd=True), SS.window_case(w=w, bwd=False)
    for causal in (True, False):
        yield SS.varlen_case(causal=causal, bwd=True), SS.varlen_case(causal=causal, bwd=False)


def _check_grads(case, outs):
    """Every variant's (dq, dk, dv) against the baseline variant (max abs diff) and flex (rel err)."""
    base = outs[BASELINE]
    rec = {"section": "grads", "case": case.case,
           f"max_abs_diff_vs_{BASELINE}": {n: max(float((x.float() - y.float()).abs().max()) for x, y in zip(o, base))
                                           for n, o in outs.items()}}
    peer = case.peers.get("flex")
    if peer is not None:
        if case.compare is not None:          # varlen: its compare runs flex itself
            rec["rel_err_vs_flex"] = {n: float(f"{case.compare(o, None):.3g}") for n, o in outs.items()}
        else:
            ref = peer()
            rec["rel_err_vs_flex"] = {n: float(f"{rel_err(o, ref):.3g}") for n, o in outs.items()}
    elif "sdpa_masked" in case.peers:         # CPU dry run: no flex
        ref = case.peers["sdpa_masked"]()
        rec["rel_err_vs_sdpa_masked"] = {n: float(f"{rel_err(o, ref):.3g}") for n, o in outs.items()}
    save(rec)


def timing():
    prepared = []
    for case, fwd_case in _cases():
        if left() < 60:
            break
        fns = {}
        for name in VARIANTS:
            def fn(name=name, run=case.opsadv):
                use_variant(name)
                return run()
            fns[name] = fn
        _check_grads(case, {name: fn() for name, fn in fns.items()})     # also compiles every variant
        fwd_case.opsadv()
        prepared.append((case, fns, case.peers.get("flex"), fwd_case.opsadv))
    rounds = {}
    for rnd in range(2):
        for case, fns, peer, fwd in prepared:
            if left() < 20:
                break
            for name, fn in {**fns, "flex": peer, "fwd_only": fwd}.items():
                if fn is not None:
                    rounds.setdefault((case.case, name), []).append(time_ms(fn))
    use_variant(BASELINE)
    for case, fns, peer, fwd in prepared:
        flex_ms = min(rounds.get((case.case, "flex"), [float("nan")]))
        fwd_ms = min(rounds.get((case.case, "fwd_only"), [float("nan")]))
        rec = {"section": "fwd_bwd_time", "case": case.case, "flex_ms": round(flex_ms, 4),
               "our_fwd_ms": round(fwd_ms, 4), "work": case.work, "variants": {}}
        for name in fns:
            ms_l = rounds.get((case.case, name))
            if ms_l:
                ms = min(ms_l)
                rec["variants"][name] = {"ms": [round(x, 4) for x in ms_l], "bwd_ms": round(ms - fwd_ms, 4),
                                         "tflops": round(case.work / ms / 1e9, 1),
                                         "speedup_vs_flex": round(flex_ms / ms, 3),
                                         "vs_baseline": round(min(rounds[(case.case, BASELINE)]) / ms, 3)}
        save(rec)


def summary():
    rows = []
    for r in R["records"]:
        if r.get("section") == "fwd_bwd_time":
            rows.append(f"{r['case'][:52]:52s} flex {r['flex_ms']:7.3f} ms  our fwd {r['our_fwd_ms']:7.3f} ms")
            rows.append("    " + "  ".join(f"{k}={min(v['ms']):.3f}({v['vs_baseline']:.3f}x)"
                                           for k, v in r["variants"].items()))
        if r.get("section") == "correct_small" and "pattern" in r:
            rows.append(f"small {r['pattern']:24s} ok={r['ok']}")
    print("\n".join(rows), flush=True)


if __name__ == "__main__":
    guarded("timing", timing, 60)                    # first: the numbers the default depends on
    guarded("correct_small", small_correctness, 30)
    guarded("summary", summary, 0)                   # a partial run (budget) keeps its records either way
    print(f"total {time.time() - T0:.0f}s", flush=True)
