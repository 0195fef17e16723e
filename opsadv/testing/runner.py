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

from .cases import CATALOGUE, DTYPES, TOLERANCE, Case, call

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
    fwd_err: float | None = None
    bwd_err: float | None = None
    tol: tuple[float, float] | None = None
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
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    if not torch.isfinite(a).all():
        return float("inf")
    # relative-norm error; the floor (an RMS of 1, the inputs' scale) keeps a reference that is
    # exactly zero (e.g. dq with a single key) from turning rounding noise into a relative error of 1
    denom = max(b.norm().item(), b.numel() ** 0.5)
    return (a - b).norm().item() / denom


def _outputs(out) -> list[torch.Tensor]:
    return list(out) if isinstance(out, (tuple, list)) else [out]


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


def _explain(case: Case, args, kwargs, backward: bool):
    return opsadv.explain(case.op, *args, backward=backward, **kwargs)


def _tolerance(dtype: torch.dtype, op: str, precision) -> tuple[float, float]:
    """float32 inputs computed in a lower precision (policy) are held to that precision's row."""
    if dtype == torch.float32 and precision is not None:
        pol = PrecisionPolicy.from_string(precision)
        cls = pol.attention if op in ("flash_attention", "sparse_attention") else pol.matmul if op in (
            "gemm", "swiglu_gemm") else "fp32"
        if cls in ("fp16", "bf16"):
            return TOLERANCE[parse_dtype(cls)]
    return TOLERANCE[dtype]


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
    fwd_tol, bwd_tol = tol
    with opsadv.use_backend("reference"):
        rargs = [_to64(a) for a in args]
        rargs = [a.requires_grad_(True) if i in case.grad_args else a for i, a in enumerate(rargs)]
        routs = _outputs(call(case, tuple(rargs), {k: _to64(v) for k, v in kwargs.items()}))
    res.fwd_err = max(_rel(o, r) for o, r in zip(outs, routs))
    if not res.fwd_err <= fwd_tol:
        res.status, res.reason = "fail", f"forward rel err {res.fwd_err:.3g} > {fwd_tol:g}"
        return
    res.checks.append("forward")
    # the same call without autograd: ops resolve eager no-grad calls in their own bucket, where an impl may
    # run its `inference` forward (no statistics: cuDNN attention without its lse, norms without mean / rstd)
    with opsadv.use_backend(backend, **pol), torch.no_grad(), opsadv.trace() as t:
        nouts = _outputs(call(case, tuple(args), kwargs))
    nerr = max(_rel(o, r) for o, r in zip(nouts, routs))
    if not nerr <= fwd_tol:
        res.status, res.reason = "fail", f"no-grad forward ({' + '.join(sorted(t.counts))}) rel err {nerr:.3g} > {fwd_tol:g}"
        return
    res.checks.append("no-grad forward")
    # backward: same random output gradients for both
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
    res.bwd_err = max(_rel(a, b) for a, b in zip(got, want))
    if not res.bwd_err <= bwd_tol:
        res.status, res.reason = "fail", f"backward rel err {res.bwd_err:.3g} > {bwd_tol:g}"
        return
    res.checks.append("backward")
    # Not under the Triton interpreter: it runs a launch's programs one after another on the CPU, so two runs agree
    # whatever the kernel would do on a GPU -- the check would pass without testing anything (H200 runs check it).
    interpreted = impl.requires_interpret_or_cuda and device == "cpu"
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
