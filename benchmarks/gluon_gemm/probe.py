"""The Gluon Hopper GEMM (cuda.gluon.gemm, opsadv/backends/cuda/_gluon_gemm_kernel.py) on an H100/H200:
first correctness of every variant, then timing against the peers.

  PYTHONPATH=. python benchmarks/gluon_gemm/probe.py OUT.json

1. check: every variant (gluon_gemm.VARIANTS), each in its own child process, all in parallel, killed
   after 150 s (a deadlock is reported as such, the other variants still run), at odd shapes (M 1 / 7 /
   127 / 1000 / 2100, N and K multiples of 8 that are not multiples of the tile), each with the full
   grid and with the grid capped at 5 CTAs (every CTA walks many tiles: the persistent path), every
   activation, bias / residual / alpha != 1, B as (K, N) and as an nn.Linear weight.t(), bf16 and fp16
   (CHECKS), NaN-poisoned outputs, against float64.
   PROBE_VARIANTS=pingpong,coop limits the variants.  A variant that fails
   any check is not timed (its errors are in the JSON).
2. timing (bf16; CUDA events, 5 warm-up calls, median of 30): each passing variant vs torch.matmul,
   addmm + activation, torch._addmm_activation (bias+gelu_tanh / bias+relu only), torch.compile of
   addmm + activation (default mode; PROBE_COMPILE=0 skips it), and the cuda.triton.gemm_persistent impl
   (pinned, Triton autotune over its table).  torch.compile peers are skipped once PROBE_BUDGET_S (220 s)
   have passed, to stay within 5 minutes.  "ratio" = best peer ms / variant ms (> 1: the variant wins);
   the best peer is the fastest of the epilogue peers (matmul only where there is no epilogue).
   Each variant's timed output is compared with the addmm + activation peer (rel err < 2e-2).
   Why the op's bias+gelu_tanh (0.985x in the session-9 suite) trails the probe's 1.069x: PROBE_B_NK=1 times
   with B as an nn.Linear weight.t() (the suite's layout), PROBE_DO_BENCH=1 with do_bench (the suite's L2-flushed
   timing) instead of warm back-to-back calls, PROBE_OP=1 adds "gluon.op": opsadv.ops.gemm pinned to the impl
   (validation, dispatch and the per-bucket schedule pick included).
Results are written to OUT.json after every case, so a killed run keeps what finished.
Expected runtime on an H200: ~2.5-4 minutes (about 50 Gluon compiles of ~2 s, mostly in the parallel checks,
the Triton autotune, 4 torch.compile graphs)."""
from __future__ import annotations

import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import opsadv  # noqa: E402
from opsadv.backends.cuda import gluon_gemm as GG  # noqa: E402

T0 = time.time()
ACTS = ("none", "relu", "gelu", "gelu_tanh", "silu")
TORCH_ACT = {"none": lambda y: y, "relu": F.relu, "gelu": F.gelu,
             "gelu_tanh": lambda y: F.gelu(y, approximate="tanh"), "silu": F.silu}
CASES = [  # name, M, N, K, bias, activation
    ("square_none", 8192, 8192, 8192, False, "none"),
    ("suite_bias_gelu_tanh", 16384, 12288, 4096, True, "gelu_tanh"),
    ("suite_bias_silu", 16384, 11008, 4096, True, "silu"),
    ("bert_ffn1_bias_gelu", 12288, 3072, 768, True, "gelu"),
    ("decode_m8_none", 8, 4096, 4096, False, "none"),
]
if os.environ.get("PROBE_CASES"):          # e.g. PROBE_CASES=suite_bias_gelu_tanh,suite_bias_silu
    CASES = [c for c in CASES if c[0] in os.environ["PROBE_CASES"].split(",")]
ODD = [(1, 8, 8), (7, 24, 40), (127, 136, 264), (1000, 520, 264), (1000, 776, 1544), (2100, 1096, 136)]
# Grid caps per ODD shape: None = min(tiles, #SMs) (mostly one tile per CTA at these shapes), and 5 CTAs, so
# every CTA walks many tiles (ring wrap-around across tiles, ping-pong turns, deferred TMA store waits).
GRID_CAPS = (None, 5)
CHECK_TIMEOUT_S = float(os.environ.get("PROBE_CHECK_TIMEOUT_S", "150"))   # a hung (deadlocked) variant is killed
WARMUP, REPS = 5, 30
DEV = os.environ.get("PROBE_DEVICE", "cuda")     # "cpu": a dry run of the script's logic (see README)
TRITON_PERSISTENT = "cuda.triton.gemm_persistent"
BUDGET_S = float(os.environ.get("PROBE_BUDGET_S", "220"))    # past it, torch.compile peers are skipped (5 min cap)


def ref64(a, b, bias, act, res, alpha):
    z = alpha * (a.double() @ b.double())
    if bias is not None:
        z = z + bias.double()
    z = TORCH_ACT[act](z)
    return z + res.double() if res is not None else z


def rel_err(x, ref) -> float:
    return ((x.double() - ref).norm() / ref.norm().clamp_min(1e-12)).item()


# (dtype, activation, bias, residual, alpha, B read as (N, K)) checked per variant at every ODD shape: every
# activation with the full epilogue in bf16, the bare GEMM, bias-only, residual-only and the nn.Linear
# weight.t() read; fp16 on two.  Each is its own compile (~2 s), so the list is kept short.
CHECKS = ([("bfloat16", act, True, True, 1.3, False) for act in ACTS]
          + [("bfloat16", "none", False, False, 1.0, False), ("bfloat16", "silu", True, False, 0.7, False),
             ("bfloat16", "none", False, True, 1.0, False), ("bfloat16", "gelu_tanh", True, False, 1.0, True),
             ("float16", "gelu", True, True, 0.7, True)])
VARIANTS = [v for v in GG.VARIANTS if v in os.environ.get("PROBE_VARIANTS", ",".join(GG.VARIANTS)).split(",")]


def check_variant(variant) -> list[str]:
    """Every failure of one variant at the odd shapes (empty: it passed), NaN-poisoned outputs."""
    os.environ["OPSADV_POISON_OUTPUTS"] = "1"
    errors = []
    try:
        for dt, act, has_bias, has_res, alpha, b_nk in CHECKS:
            dtype = getattr(torch, dt)
            tol = 1e-2 if dtype == torch.bfloat16 else 2e-3
            for (m, n, k) in ODD:
                g = torch.Generator(device=DEV).manual_seed(m * 7 + n)
                a = torch.randn(m, k, device=DEV, generator=g).to(dtype)
                w = (torch.randn(n, k, device=DEV, generator=g) * k ** -0.5).to(dtype)      # (N, K)
                b = w.t() if b_nk else w.t().contiguous()
                bias = torch.randn(n, device=DEV, generator=g).to(dtype) if has_bias else None
                res = torch.randn(m, n, device=DEV, generator=g).to(dtype) if has_res else None
                ref = ref64(a, b, bias, act, res, alpha)
                for cap in GRID_CAPS:
                    tag = (f"{variant} {dt} m{m} n{n} k{k} {act} bias={has_bias} res={has_res} alpha={alpha} "
                           f"b_nk={b_nk} grid_cap={cap}")
                    print("  " + tag, flush=True)                # the last line printed names a hang
                    try:
                        out = GG.gemm_fwd(None, a, b, bias, act, res, alpha, variant=variant, num_sms=cap)
                        if DEV == "cuda":
                            torch.cuda.synchronize()
                    except Exception as e:  # a compile / launch failure is a failed check
                        errors.append(f"{tag}: {type(e).__name__}: {str(e)[:300]}")
                        return errors
                    if torch.isnan(out).any():
                        errors.append(f"{tag}: NaN (unwritten output?)")
                        continue
                    e = rel_err(out, ref)
                    if not e < tol:
                        errors.append(f"{tag}: rel err {e:.3g}")
    finally:
        os.environ["OPSADV_POISON_OUTPUTS"] = "0"
    return errors


def check_in_subprocesses(variants, path) -> dict:
    """check_variant of every variant, each in its own child process (python probe.py --check VARIANT
    OUT), all at once (their compiles run in parallel; the GPU time-slices the small launches).  A child
    that deadlocks on the GPU is killed after CHECK_TIMEOUT_S and reported; the others are unaffected.  The
    children's compiles land in Triton's disk cache, so timing here compiles only the timed cases' flags."""
    import subprocess
    import tempfile
    procs = {}
    for v in variants:
        out = f"{path}.check_{v}.json"
        if os.path.exists(out):
            os.remove(out)                                   # a stale result must not pass for this run's
        log = tempfile.TemporaryFile(mode="w+")              # a file, not a pipe: a chatty child never blocks
        cmd = [sys.executable, os.path.abspath(__file__), "--check", v, out]
        procs[v] = (subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True), log, out)
    deadline = time.time() + CHECK_TIMEOUT_S
    results = {}
    for v, (p, log, out) in procs.items():
        try:
            rc = p.wait(timeout=max(1.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
            rc = None
        log.seek(0)
        lines = [ln.strip() for ln in log.read().splitlines() if ln.strip()]
        if rc is None:
            results[v] = [f"timed out after {CHECK_TIMEOUT_S:.0f}s (hang?); last case started: "
                          f"{lines[-1] if lines else '?'}"]
        elif rc != 0 or not os.path.exists(out):
            results[v] = [f"check process failed (rc {rc}): " + " | ".join(lines[-12:])[-1500:]]
        else:
            with open(out) as f:
                results[v] = json.load(f)
    return results


def bench(fn) -> float:
    if DEV == "cuda" and os.environ.get("PROBE_DO_BENCH") == "1":
        # the bench suite's timing (L2 flushed before every call), instead of back-to-back warm calls
        from triton.testing import do_bench
        return float(do_bench(fn, warmup=25, rep=100, return_mode="median"))
    for _ in range(WARMUP):
        fn()
    if DEV != "cuda":
        return statistics.median(_wall(fn) for _ in range(3))
    torch.cuda.synchronize()
    times = []
    for _ in range(REPS):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e))
    return statistics.median(times)


def _wall(fn) -> float:
    t = time.perf_counter()
    fn()
    return (time.perf_counter() - t) * 1e3


def peers(a, b, bias, act):
    """name -> callable computing act(a @ b + bias) (bf16) for the peer implementations."""
    out = {"torch.matmul": lambda: torch.matmul(a, b)}
    if bias is not None:
        out["addmm+act"] = lambda: TORCH_ACT[act](torch.addmm(bias, a, b))
        if act in ("gelu_tanh", "relu"):
            out["torch._addmm_activation"] = lambda: torch._addmm_activation(bias, a, b, use_gelu=act == "gelu_tanh")
    elif act != "none":
        out["mm+act"] = lambda: TORCH_ACT[act](torch.mm(a, b))
    if (os.environ.get("PROBE_COMPILE", "1") != "0" and (bias is not None or act != "none")
            and time.time() - T0 < BUDGET_S):
        if bias is not None:
            comp = torch.compile(lambda a_, b_, c_: TORCH_ACT[act](torch.addmm(c_, a_, b_)))
            out["torch.compile"] = lambda: comp(a, b, bias)
        else:
            comp = torch.compile(lambda a_, b_: TORCH_ACT[act](torch.mm(a_, b_)))
            out["torch.compile"] = lambda: comp(a, b)

    # timed inside use_backend(impls=...) pinned to it (see main): the context is entered once, not per call
    out[TRITON_PERSISTENT] = lambda: opsadv.ops.gemm(a, b, bias=bias, activation=act)
    return out


def main(path: str) -> None:
    import triton
    report = {"commit": os.environ.get("OPSADV_COMMIT", "unknown"),
              "device": torch.cuda.get_device_name() if DEV == "cuda" else DEV,
              "torch": torch.__version__, "triton": triton.__version__, "default_variant": GG.DEFAULT_VARIANT,
              "variants": {k: dict(v) for k, v in GG.VARIANTS.items()}, "checks": {}, "cases": []}

    def save():
        report["elapsed_s"] = round(time.time() - T0, 1)
        with open(path, "w") as f:
            json.dump(report, f, indent=1)

    ok = []
    t = time.time()
    if os.environ.get("PROBE_CHECK_INPROC") == "1":      # one process (dry runs)
        checked = {v: check_variant(v) for v in VARIANTS}
    else:
        checked = check_in_subprocesses(VARIANTS, path)
    for variant, errors in checked.items():
        report["checks"][variant] = {"pass": not errors, "errors": errors[:20], "n_errors": len(errors)}
        print(f"check {variant:14s} {'PASS' if not errors else 'FAIL'} ({len(errors)} errors)"
              + ("" if not errors else "\n    " + "\n    ".join(errors[:5])), flush=True)
        if not errors:
            ok.append(variant)
    report["checks_s"] = round(time.time() - t, 1)
    save()

    for name, m, n, k, has_bias, act in CASES:
        g = torch.Generator(device=DEV).manual_seed(0)
        a = torch.randn(m, k, device=DEV, generator=g).to(torch.bfloat16)
        b = (torch.randn(k, n, device=DEV, generator=g) * k ** -0.5).to(torch.bfloat16)
        if os.environ.get("PROBE_B_NK") == "1":
            b = b.t().contiguous().t()            # an nn.Linear weight.t(), as the bench suite passes it (B_NK)
        bias = torch.randn(n, device=DEV, generator=g).to(torch.bfloat16) if has_bias else None
        flop = 2.0 * m * n * k
        case = {"name": name, "m": m, "n": n, "k": k, "bias": has_bias, "activation": act, "ms": {}, "tflops": {},
                "errors": {}}
        for pname, fn in peers(a, b, bias, act).items():
            try:
                if pname == TRITON_PERSISTENT:
                    with opsadv.use_backend("cuda", autotune=True, impls={"gemm": TRITON_PERSISTENT}):
                        case["ms"][pname] = bench(fn)
                else:
                    case["ms"][pname] = bench(fn)
            except Exception as e:  # a peer that cannot run here is recorded, not fatal
                case["errors"][pname] = f"{type(e).__name__}: {str(e)[:300]}"
        expect = TORCH_ACT[act](torch.addmm(bias, a, b) if bias is not None else torch.mm(a, b))
        for variant in ok:
            fn = lambda v=variant: GG.gemm_fwd(None, a, b, bias, act, None, 1.0, variant=v)  # noqa: E731
            try:
                e = rel_err(fn(), expect.double())
                case.setdefault("rel_err_vs_addmm", {})[variant] = e
                case["ms"]["gluon." + variant] = bench(fn)
            except Exception as ex:
                case["errors"]["gluon." + variant] = f"{type(ex).__name__}: {str(ex)[:300]}"
        if ok and os.environ.get("PROBE_OP") == "1":      # the whole op path (validation, dispatch, variant pick)
            def op_fn():
                with torch.no_grad():
                    return opsadv.ops.gemm(a, b, bias=bias, activation=act)
            with opsadv.use_backend("cuda", autotune=True, impls={"gemm": GG.IMPL_ID}):
                op_fn()
                case["ms"]["gluon.op"] = bench(op_fn)
        epi_peers = {p: t for p, t in case["ms"].items() if not p.startswith("gluon.")
                     and (p != "torch.matmul" or (not has_bias and act == "none"))}
        best = min(epi_peers, key=epi_peers.get) if epi_peers else None
        case["best_peer"], case["best_peer_ms"] = best, epi_peers.get(best)
        case["tflops"] = {p: flop / (t * 1e-3) / 1e12 for p, t in case["ms"].items()}
        case["ratio_vs_best_peer"] = {p: case["best_peer_ms"] / t for p, t in case["ms"].items()
                                      if p.startswith("gluon.") and best}
        report["cases"].append(case)
        save()
        print(f"\n{name}  M={m} N={n} K={k}  best peer: {best} {case['best_peer_ms'] or float('nan'):.3f} ms",
              flush=True)
        for p, t in sorted(case["ms"].items(), key=lambda kv: kv[1]):
            r = case["ratio_vs_best_peer"].get(p)
            print(f"  {p:32s} {t:8.3f} ms {case['tflops'][p]:7.1f} TFLOP/s" + (f"  x{r:.3f}" if r else ""), flush=True)
        for v, e in case.get("rel_err_vs_addmm", {}).items():
            if not e < 2e-2:
                print(f"  WARNING gluon.{v}: rel err {e:.3g} vs addmm + activation", flush=True)
        for p, e in case["errors"].items():
            print(f"  {p:32s} ERROR {e[:160]}", flush=True)
    print(f"\ndone in {time.time() - T0:.0f}s -> {path}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--check":       # child of check_in_subprocess
        errs = check_variant(sys.argv[2])
        with open(sys.argv[3], "w") as f:
            json.dump(errs, f)
    else:
        main(sys.argv[1] if len(sys.argv) > 1 else "gluon_gemm_probe.json")
