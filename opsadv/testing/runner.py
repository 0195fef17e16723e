"""Runs conformance cases for one backend against the reference backend in float64 and builds
the backend x op x dtype x shape-class matrix (pass / skip with reason / fail)."""
from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable

import torch

import opsadv
from opsadv.registry import get_registry
from opsadv.core.errors import BackendUnavailableError, NoKernelError
from opsadv.core.precision import PrecisionPolicy, parse_dtype

from opsadv.core.opdef import get_op

from .cases import BASELINE_FACTOR, CATALOGUE, DTYPES, Case, call

DT = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32", torch.float64: "float64"}


@dataclass
class Result:
    backend: str
    op: str
    dtype: str
    shape_class: str
    status: str                     # "pass" | "skip" | "fail"
    reason: str = ""
    impl: str | None = None
    backward_impl: str | None = None
    fwd_err: float | None = None            # ||impl - oracle|| / ||oracle||, worst output
    bwd_err: float | None = None            # the same over the input gradients
    fwd_base: float | None = None           # the baseline's (reference on the low-precision inputs) error there
    bwd_base: float | None = None
    tol: tuple[float, float] | None = None  # the floors (forward, backward); see core.opdef.BASELINE_FACTOR
    seed: int | None = None
    seconds: float = 0.0
    checks: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def default_device(backend: str) -> str:
    rec = get_registry().backends.get(backend)
    types = rec.info.device_types if rec else ("cpu",)
    if "cuda" in types and torch.cuda.is_available():
        return "cuda"
    if "npu" in types and hasattr(torch, "npu") and torch.npu.is_available():  # type: ignore[attr-defined]
        return "npu"
    return "cpu"


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative-norm difference of two runs of the same impl (compile / export against eager)."""
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    if not torch.isfinite(a).all():
        return float("inf")
    denom = max(b.norm().item(), b.numel() ** 0.5)
    return (a - b).norm().item() / denom


@dataclass
class _Verdict:
    ok: bool
    err: float          # worst ||x - oracle|| / ||oracle|| (inf where x is not finite where the oracle is)
    base: float         # the baseline's, at the same output
    detail: str


# triton 3.6's interpreter rounds float32 -> bfloat16 stores toward zero (a -0.28% mean scale error, up to one ulp,
# 2^-7, per element; GPUs round to nearest): interpreted bf16 cells get one ulp more room, and only they
INTERPRETER_BF16_ROOM = 2.0 ** -7


def _judge(xs, bases, oracles, k: float, floor: float, log_outputs=frozenset()) -> _Verdict:
    """The conformance rule for a list of outputs (or gradients): each x must satisfy
    ||x - o|| <= k ||base - o|| + floor ||o||, its component along o (a scale error) the same rule, and be
    non-finite exactly where the oracle is.  Outputs in log_outputs take ||o|| at least their RMS of 1."""
    worst = _Verdict(True, 0.0, 0.0, "")
    for i, (x, bs, o) in enumerate(zip(xs, bases, oracles)):
        x, bs, o = (t.detach().double().cpu() for t in (x, bs, o))
        if x.shape != o.shape:
            return _Verdict(False, float("inf"), 0.0, f"output {i}: shape {tuple(x.shape)}, oracle {tuple(o.shape)}")
        fin = torch.isfinite(o)
        if not torch.equal(torch.isfinite(x), fin):
            bad = int((torch.isfinite(x) != fin).sum())
            return _Verdict(False, float("inf"), 0.0,
                            f"output {i}: {bad} elements non-finite where the oracle is finite (or the reverse)")
        x, bs, o = x[fin], bs[fin], o[fin]
        if o.numel() == 0:
            continue                    # non-finite exactly where the oracle is, and nothing else to compare
        bs = torch.where(torch.isfinite(bs), bs, o)
        on, e, eb = o.norm().item(), (x - o).norm().item(), (bs - o).norm().item()
        # an oracle that is (nearly) zero (dq with a single key): the scale is at least an RMS of 1e-3
        scale = max(on, (1.0 if i in log_outputs else 1e-3) * o.numel() ** 0.5)
        rel, relb = e / scale, eb / scale
        if not e <= k * eb + floor * scale:
            return _Verdict(False, rel, relb, f"output {i}: rel err {rel:.3g} > {k:g} x baseline {relb:.3g} + {floor:g}")
        # the error's component along the oracle (a scale error) under the same rule: rounding noise has almost
        # none, so a 0.5% scale error hidden in bf16 noise still shows
        if on > 0.0:
            # (along the unit vector o / ||o||, relative to the floored scale: bounded by rel for a ~0 oracle)
            bias, biasb = (abs(((t - o) * o).sum().item()) / (on * scale) for t in (x, bs))
            if not bias <= k * biasb + floor:
                return _Verdict(False, rel, relb, f"output {i}: scale error {bias:.3g} > {k:g} x baseline "
                                                  f"{biasb:.3g} + {floor:g} (rel err {rel:.3g})")
        if rel >= worst.err:
            worst = _Verdict(True, rel, relb, "")
    return worst


def _outputs(out) -> list[torch.Tensor]:
    """The tensors of an op's result; None entries (an output the call did not ask for) dropped."""
    return [o for o in out if o is not None] if isinstance(out, (tuple, list)) else [out]


def _to64(x):
    if isinstance(x, torch.Tensor) and x.is_floating_point():
        return x.detach().double().cpu()
    if isinstance(x, torch.Tensor):
        return x.cpu()
    if isinstance(x, opsadv.SparseLayout):
        import dataclasses
        return dataclasses.replace(x, block_mask=x.block_mask.cpu(),
                                   key_padding_mask=None if x.key_padding_mask is None else x.key_padding_mask.cpu(),
                                   cu_seqlens=None if x.cu_seqlens is None else x.cu_seqlens.cpu())
    return x


def _cpu(x):
    return x.detach().cpu() if isinstance(x, torch.Tensor) else x


def _explain(case: Case, args, kwargs, backward: bool):
    return opsadv.explain(case.op, *args, backward=backward, **kwargs)


def _policy_class(dtype: torch.dtype, op: str, precision) -> str | None:
    """The precision class ("fp16", "bf16", "tf32") a policy computes float32 inputs of `op` in (the PrecisionPolicy
    field its OpDef names governs its products), else None."""
    field_name = get_op(op).precision
    if dtype != torch.float32 or precision is None or field_name is None:
        return None
    cls = getattr(PrecisionPolicy.from_string(precision), field_name)
    return cls if cls in ("fp16", "bf16", "tf32") else None


def _compute_dtype(dtype: torch.dtype, op: str, precision) -> torch.dtype:
    """float32 inputs computed in half precision (policy) get a baseline run on the inputs rounded to it."""
    cls = _policy_class(dtype, op, precision)
    return parse_dtype(cls) if cls in ("fp16", "bf16") else dtype


def _tolerance(dtype: torch.dtype, op: str, precision) -> tuple[float, float]:
    """The floors of a cell, from the op's tolerance rows: its dtype's, or those of the precision a policy computes
    it in (an OpDef's own table without a "tf32" row holds tf32 cells to its float32 row)."""
    tol = get_op(op).tolerance
    if _policy_class(dtype, op, precision) == "tf32":
        return tol.get("tf32", tol[torch.float32])
    return tol[_compute_dtype(dtype, op, precision)]


def _cast(x, dtype: torch.dtype):
    if isinstance(x, torch.Tensor) and x.is_floating_point():
        return x.detach().to(dtype)
    return x


def run_case(case: Case, backend: str, dtype: torch.dtype, device: str, *, seed: int | None = None,
             check_determinism: bool = True, precision=None, impls: dict | None = None) -> Result:
    """One cell.  `precision` ("fp16", "bf16", "tf32" or a PrecisionPolicy) is the policy under which
    the backend runs; float32 cells are then held to the compute precision's tolerance."""
    seed = seed if seed is not None else int.from_bytes(os.urandom(4), "little")
    tol = _tolerance(dtype, case.op, precision)
    res = Result(backend, case.op, DT[dtype], case.shape_class, "pass", seed=seed, tol=tol)
    t0 = time.perf_counter()
    try:
        _run(case, res, backend, dtype, device, seed, check_determinism, precision, tol, impls)
    except NoKernelError as e:
        res.status, res.reason = "skip", "no impl serves this case: " + "; ".join(
            f"{k}: {', '.join(v)}" for k, v in e.reasons.items() if k.startswith(backend + ".") or True)
    except Exception as e:  # a crash of the impl is a failure, with the message
        res.status, res.reason = "fail", f"{type(e).__name__}: {e}".splitlines()[0][:400]
    res.seconds = round(time.perf_counter() - t0, 3)
    return res


def _run(case, res, backend, dtype, device, seed, check_determinism, precision, tol, impls=None):
    pol: dict = {"strict": True}
    if precision is not None:
        pol["precision"] = precision
    if impls:
        # pinning is how an experimental impl earns conformance: the pin is the explicit opt-in
        pol.update(impls=impls, experimental=True)
    g = torch.Generator().manual_seed(seed)
    args, kwargs = case.build(dtype, device, g)
    with opsadv.use_backend(backend, **pol):
        exp = _explain(case, args, kwargs, backward=False)
        if exp.chosen is None:
            raise NoKernelError(case.op, exp.policy, {c.impl.id: list(c.reasons) for c in exp.candidates})
        res.impl = exp.chosen
        impl = next(c.impl for c in exp.candidates if c.chosen)
        gargs = [a.detach().clone().requires_grad_(True) if i in case.grad_args else a for i, a in enumerate(args)]
        outs = _outputs(call(case, tuple(gargs), kwargs))
    fwd_floor, bwd_floor = tol
    fwd_k, bwd_k = BASELINE_FACTOR
    # Under the Triton interpreter: a launch's programs run one after another on the CPU (see the determinism
    # check), and bf16 stores round toward zero
    interpreted = impl.requires_interpret_or_cuda and device == "cpu"
    if interpreted and dtype == torch.bfloat16:
        fwd_floor, bwd_floor = fwd_floor + INTERPRETER_BF16_ROOM, bwd_floor + INTERPRETER_BF16_ROOM
        res.tol = (fwd_floor, bwd_floor)
    with opsadv.use_backend("reference"):
        # the oracle on the CPU: kept arguments (a storage format: fp8 caches, accumulators) keep their dtype but
        # move with the others, or a GPU cell would hand the reference tensors on two devices
        keep = _cpu if not all(i in case.kept for i in range(len(args))) else (lambda a: a)
        rargs = [keep(a) if i in case.kept else _to64(a) for i, a in enumerate(args)]
        rargs = [a.requires_grad_(True) if i in case.grad_args else a for i, a in enumerate(rargs)]
        routs = _outputs(call(case, tuple(rargs), {k: keep(v) if k in case.kept else _to64(v)
                                                   for k, v in kwargs.items()}))
        # the baseline: plain torch on the same low-precision inputs (rounded to the compute dtype of a policy cell)
        cdt = _compute_dtype(dtype, case.op, precision)
        bargs = [a if i in case.kept else _cast(a, cdt) for i, a in enumerate(args)]
        bargs = [a.requires_grad_(True) if i in case.grad_args else a for i, a in enumerate(bargs)]
        bouts = _outputs(call(case, tuple(bargs), {k: v if k in case.kept else _cast(v, cdt)
                                                   for k, v in kwargs.items()}))
    v = _judge(outs, bouts, routs, fwd_k, fwd_floor, case.log_outputs)
    res.fwd_err, res.fwd_base = v.err, v.base
    if not v.ok:
        res.status, res.reason = "fail", f"forward {v.detail}"
        return
    res.checks.append("forward")
    # the same call without autograd: ops resolve eager no-grad calls in their own bucket, where an impl may
    # run its `inference` forward (no statistics: cuDNN attention without its lse, norms without mean / rstd)
    with opsadv.use_backend(backend, **pol), torch.no_grad(), opsadv.trace() as t:
        nouts = _outputs(call(case, tuple(args), kwargs))
    nv = _judge(nouts, bouts, routs, fwd_k, fwd_floor, case.log_outputs)
    if not nv.ok:
        res.status, res.reason = "fail", f"no-grad forward ({' + '.join(sorted(t.counts))}) {nv.detail}"
        return
    res.checks.append("no-grad forward")
    # backward: same random output gradients for all three
    if not case.grad_args:      # a forward-only case (scaled_gemm, paged / fp8 attention)
        return
    grads_out = [torch.randn(r.shape, generator=g, dtype=torch.float64) for r in routs]
    try:
        with opsadv.use_backend(backend, **pol):
            bexp = _explain(case, args, kwargs, backward=True)
            res.backward_impl = bexp.chosen
            if bexp.chosen is None:
                res.checks.append("backward: no impl (" + "; ".join(
                    f"{c.impl.id}: {', '.join(c.reasons)}" for c in bexp.candidates if c.impl.backend == backend) + ")")
                return
            got = torch.autograd.grad(outs, [gargs[i] for i in case.grad_args],
                                      [go.to(dtype=o.dtype, device=o.device) for go, o in zip(grads_out, outs)])
    except NoKernelError as e:
        res.checks.append(f"backward: {e}".splitlines()[0])
        return
    want = torch.autograd.grad(routs, [rargs[i] for i in case.grad_args], grads_out)
    with opsadv.use_backend("reference"):
        base = torch.autograd.grad(bouts, [bargs[i] for i in case.grad_args],
                                   [go.to(dtype=o.dtype, device=o.device) for go, o in zip(grads_out, bouts)])
    bv = _judge(got, base, want, bwd_k, bwd_floor)
    res.bwd_err, res.bwd_base = bv.err, bv.base
    if not bv.ok:
        res.status, res.reason = "fail", f"backward {bv.detail}"
        return
    res.checks.append("backward")
    # Not under the Triton interpreter: two runs agree whatever the kernel would do on a GPU -- the check would
    # pass without testing anything (H200 runs check it).
    if check_determinism and impl.deterministic and backend != "reference" and not interpreted:
        with opsadv.use_backend(backend, **pol):
            again = _outputs(call(case, tuple(gargs), kwargs))
            got2 = torch.autograd.grad(again, [gargs[i] for i in case.grad_args],
                                       [go.to(dtype=o.dtype, device=o.device) for go, o in zip(grads_out, again)])
        same = all(torch.equal(a, b) for a, b in zip(outs + list(got), again + list(got2)))
        if not same:
            res.status, res.reason = "fail", "impl declares determinism but two runs differ bitwise"
            return
        res.checks.append("deterministic")


def run_graph_checks(op: str, backend: str, device: str, impls: dict | None = None) -> list[Result]:
    """torch.compile(fullgraph=True) and torch.export round trip, for impls that claim them; with
    `impls` ({op: impl id}) the pinned kernel is the one compiled / exported."""
    case = next(c for c in CATALOGUE if c.op == op)
    out: list[Result] = []
    pins = {"impls": impls, "experimental": True} if impls else {}
    for dtype in (torch.float32, torch.float16):
        g = torch.Generator().manual_seed(0)
        args, kwargs = case.build(dtype, device, g)
        with opsadv.use_backend(backend, strict=True, **pins):
            exp = _explain(case, args, kwargs, backward=False)
        if exp.chosen is not None:
            break
    else:
        return [Result(backend, op, "-", "compile", "skip", "no impl serves float32/float16 here")]
    impl = next(c.impl for c in exp.candidates if c.chosen)
    for kind in ("compile", "export"):
        r = Result(backend, op, DT[dtype], kind, "pass", impl=impl.id)
        claims = impl.supports_compile if kind == "compile" else impl.supports_export
        if not claims:
            r.status, r.reason = "skip", f"{impl.id} does not claim {kind} support"
            out.append(r)
            continue
        t0 = time.perf_counter()
        try:
            with opsadv.use_backend(backend, strict=True, **pins):
                eager = _outputs(call(case, args, kwargs))
                if kind == "compile":
                    torch._dynamo.reset()
                    fn = torch.compile(lambda *a: call(case, a, kwargs), fullgraph=True, backend="aot_eager")
                    got = _outputs(fn(*args))
                else:
                    tpos = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]

                    class M(torch.nn.Module):   # non-tensor args (a SparseLayout) are constants of the program
                        def forward(self, *t):
                            full = list(args)
                            for i, x in zip(tpos, t):
                                full[i] = x
                            return call(case, tuple(full), kwargs)
                    tensor_args = tuple(args[i] for i in tpos)
                    ep = torch.export.export(M(), tensor_args)
                    if not any("opsadv" in str(n.target) for n in ep.graph.nodes):
                        raise AssertionError("exported graph has no opsadv op")
                    got = _outputs(ep.module()(*tensor_args))
            err = max(_rel(a, b) for a, b in zip(got, eager))
            r.fwd_err = err
            if not err <= 1e-6:
                r.status, r.reason = "fail", f"{kind} result differs from eager: rel err {err:.3g}"
        except Exception as e:
            r.status, r.reason = "fail", f"{type(e).__name__}: {e}".splitlines()[0][:400]
        r.seconds = round(time.perf_counter() - t0, 3)
        out.append(r)
    return out


def iter_cases(quick: bool, ops: Iterable[str] | None = None) -> list[Case]:
    ops = set(ops) if ops else None
    return [c for c in CATALOGUE if (c.quick or not quick) and (ops is None or c.op in ops)]


def run_conformance(backend: str, *, quick: bool = False, device: str | None = None, ops=None,
                    dtypes=None, graph_checks: bool = True, progress=None, precision=None,
                    impls: dict | None = None) -> list[Result]:
    """Every case x dtype for `backend`; returns the results (the matrix's cells).  `impls`
    ({op: impl id}) pins the kernel under test; cells it cannot serve are skipped with its reasons."""
    reg = get_registry()
    if backend not in reg.backends or not reg.backends[backend].available:
        rec = reg.backends.get(backend)
        raise BackendUnavailableError(backend, list(rec.probe.reasons) if rec else [f"unknown; known: {sorted(reg.backends)}"])
    device = device or default_device(backend)
    dtypes = dtypes or (DTYPES if not quick else (torch.float16, torch.float32, torch.bfloat16))
    results: list[Result] = []
    cases = iter_cases(quick, ops)
    for case in cases:
        for dtype in dtypes:
            results.append(run_case(case, backend, dtype, device, precision=precision, impls=impls))
            if progress:
                progress(results[-1])
    if graph_checks:
        for op in dict.fromkeys(c.op for c in cases):
            results.extend(run_graph_checks(op, backend, device, impls=impls))
            if progress:
                progress(results[-1])
    return results
