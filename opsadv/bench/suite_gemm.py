"""Bench suite "gemm": opsadv.ops.gemm / swiglu_gemm against cuBLAS through torch (matmul/addmm +
activation, torch._addmm_activation) and torch.compile of the same expression.
Grid (docs/performance.md): bf16, (m, n, k) = (8192,8192,8192), (16384,12288,4096), (16384,11008,4096),
(16384,4096,11008); epilogues none, bias+gelu_tanh, bias+silu, SwiGLU (n is the intermediate size:
one GEMM over [W_g | W_u] of shape (k, 2n)).  The weight is an nn.Linear-style (n, k) tensor passed
as weight.t().  FLOPs 2*m*n*k (SwiGLU 4*m*n*k); forward+backward 3x.  When the dispatcher picks
cuBLAS, an "[own]" row times the library's own kernel too (the Gluon GEMM on sm_90, else the Triton one)."""
from __future__ import annotations

import dataclasses
from typing import Iterator

import torch
import torch.nn.functional as F

import opsadv
from opsadv.core import dispatch
from opsadv.ops.gemm import _gemm_spec, _swiglu_spec
from opsadv.core.policy import current_policy
from opsadv.registry import get_registry

from .case import BenchCase, compiled_peer

SHAPES = ((8192, 8192, 8192), (16384, 12288, 4096), (16384, 11008, 4096), (16384, 4096, 11008))
EPILOGUES = ("none", "gelu_tanh", "silu", "swiglu")
_COMPILED: dict = {}


# `opsadv bench --allow-cpu` without a GPU: the quick grid at sizes a CPU runs in seconds (a smoke test)
CPU_QUICK = [(256, 256, 256, "none", False), (256, 192, 256, "swiglu", False)]


def _grid(quick: bool):
    """(m, n, k, epilogue, backward)"""
    if quick and not torch.cuda.is_available():
        return CPU_QUICK
    if quick:
        return [(8192, 8192, 8192, "none", False), (16384, 12288, 4096, "gelu_tanh", False),
                (16384, 11008, 4096, "silu", False), (16384, 11008, 4096, "swiglu", False)]
    g = [(m, n, k, ep, False) for m, n, k in SHAPES for ep in EPILOGUES]
    # training rows: a GEMM's forward + backward (grad-recording calls keep the pre-activation: gemm.py)
    return g + [(16384, 12288, 4096, "gelu_tanh", True), (16384, 11008, 4096, "silu", True),
                (8192, 8192, 8192, "none", True), (16384, 11008, 4096, "swiglu", True)]


OWN_PREFIXES = ("cuda.gluon.", "cuda.triton.")   # the library's own kernels, in the order the [own] row prefers


def own_impl(op: str, spec):
    """(impl, ctx) of the library's own kernel for this call: the Gluon GEMM where the policy accepts it
    (sm_90, K and N multiples of 8), else the Triton kernel (TMA variant where it serves)."""
    reg = get_registry()
    if "cuda" not in reg.backends or not reg.backends["cuda"].available:
        return None
    pol = dataclasses.replace(current_policy(), backend="cuda", autotune=False)
    exp, r = dispatch.explain_spec(spec, pol)
    if r is None:
        return None
    for prefix in OWN_PREFIXES:
        ok = [c.impl for c in exp.candidates if c.accepted and c.impl.id.startswith(prefix)]
        if ok:
            best = max(ok, key=lambda i: (i.priority, i.id))
            return best, dataclasses.replace(r.ctx, spec=spec)
    return None


def _eager(ep):
    def act(y):
        return F.gelu(y, approximate="tanh") if ep == "gelu_tanh" else F.silu(y) if ep == "silu" else y

    def fn(a, wt, bias):
        if ep == "swiglu":
            g, u = (a @ wt).chunk(2, dim=-1)
            return F.silu(g) * u
        return act(torch.addmm(bias, a, wt)) if bias is not None else a @ wt
    return fn


def _compiled(ep):
    if ep not in _COMPILED:
        _COMPILED[ep] = compiled_peer(_eager(ep))
    return _COMPILED[ep]


def cases(quick: bool) -> Iterator[BenchCase]:
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16
    for m, n, k, ep, bwd in _grid(quick):
        torch.manual_seed(0)
        nout = 2 * n if ep == "swiglu" else n
        a = torch.randn(m, k, device=dev, dtype=dtype)
        wt = (torch.randn(nout, k, device=dev, dtype=dtype) * k ** -0.5).t()     # nn.Linear weight.t()
        bias = torch.randn(n, device=dev, dtype=dtype) if ep in ("gelu_tanh", "silu") else None
        go = torch.randn(m, n, device=dev, dtype=dtype) if bwd else None
        ins = [t.clone().requires_grad_(bwd) if t is not None else None for t in (a, wt, bias)]

        def run(fn, ins=ins, go=go, bwd=bwd):
            if not bwd:
                with torch.no_grad():
                    return fn(*ins)
            return torch.autograd.grad(fn(*ins), [t for t in ins if t is not None], go)

        if ep == "swiglu":
            def mine(a_, w_, b_):
                return opsadv.ops.swiglu_gemm(a_, w_)
        else:
            def mine(a_, w_, b_, ep=ep):
                return opsadv.ops.gemm(a_, w_, bias=b_, activation=ep)
        peers = {"torch_eager": (lambda fn=_eager(ep), run=run: run(fn))}
        if ep == "gelu_tanh" and dev == "cuda":
            peers["addmm_activation"] = (lambda run=run: run(lambda a_, w_, b_: torch._addmm_activation(b_, a_, w_, use_gelu=True)))
        if dev == "cuda":
            peers["torch_compile"] = (lambda fn=_compiled(ep), run=run: run(fn))
        extra = {}
        if bwd:
            # training calls run the GEMM (+ bias) through the op and the activation as torch ops
            # (opsadv.ops.gemm._composed_for_training): the [own] row pins that GEMM to our kernel
            own = own_impl("gemm", _gemm_spec(a, wt, bias, "none", None, 1.0, False))
            if own is not None:
                def own_fn(impl_id=own[0].id, mine=mine):
                    with opsadv.use_backend("cuda", impls={"gemm": impl_id}):
                        return run(mine)
                extra = {"own": own_fn, "own_prefix": OWN_PREFIXES, "own_impl": own[0].id}
        else:
            act = "none" if ep == "swiglu" else ep
            spec = _swiglu_spec(a, wt, None, False) if ep == "swiglu" else _gemm_spec(a, wt, bias, act, None, 1.0, False)
            own = own_impl("swiglu_gemm" if ep == "swiglu" else "gemm", spec)
            if own is not None:
                impl, ctx = own
                args = (a, wt, None) if ep == "swiglu" else (a, wt, bias, act, None, 1.0)
                extra = {"own": (lambda impl=impl, ctx=ctx, args=args: impl.fn(ctx, *args)), "own_prefix": OWN_PREFIXES,
                         "own_impl": impl.id}
        flops = 2.0 * m * nout * k * (3 if bwd else 1)
        words = ["fwd+bwd" if bwd else "fwd", "bf16", f"m{m}", f"n{n}", f"k{k}"] + \
                ({"none": [], "gelu_tanh": ["bias", "gelu_tanh"], "silu": ["bias", "silu"], "swiglu": ["swiglu"]}[ep])
        yield BenchCase(suite="gemm", case=" ".join(words), opsadv=(lambda fn=mine, run=run: run(fn)), peers=peers,
                        work=flops, unit="TFLOP/s", extra=extra)
    if not quick:
        yield from _swiglu_act_cases(dev, dtype)


DT_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def _swiglu_act(gu):
    g, u = gu.chunk(2, dim=-1)
    return F.silu(g) * u


def _swiglu_act_cases(dev: str, dtype, m: int = 16384, n: int = 11008) -> Iterator[BenchCase]:
    """The swiglu op alone (memory-bound: TB/s of gate_up read + y written, forward; gate_up + grad read and
    d gate_up written, backward) against eager silu(g) * u and torch.compile of it, at the suite's SwiGLU size."""
    for bwd in (False, True):
        torch.manual_seed(0)
        gu = torch.randn(m, 2 * n, device=dev, dtype=dtype).requires_grad_(bwd)
        go = torch.randn(m, n, device=dev, dtype=dtype) if bwd else None

        def run(fn, gu=gu, go=go, bwd=bwd):
            if not bwd:
                with torch.no_grad():
                    return fn(gu)
            return torch.autograd.grad(fn(gu), gu, go)

        peers = {"torch_eager": (lambda run=run: run(_swiglu_act))}
        if dev == "cuda":
            comp = compiled_peer(_swiglu_act)
            peers["torch_compile"] = (lambda comp=comp, run=run: run(comp))
        nbytes = m * n * gu.element_size() * ((2 + 3 + 2 + 1) if bwd else 3)   # fwd 2N in, N out; bwd again + 2N out
        yield BenchCase(suite="gemm", case=f"{'fwd+bwd' if bwd else 'fwd'} {DT_NAMES[dtype]} t{m} n{n} swiglu_act",
                        opsadv=(lambda run=run: run(opsadv.ops.swiglu)), peers=peers, work=nbytes, unit="TB/s")
