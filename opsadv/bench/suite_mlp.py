"""Bench suite "mlp": one gated MLP block, down(silu(gate(x)) * up(x)), as convert_model runs it (the SwiGLUMLP
module: swiglu_gemm over [W_gate|W_up], then down_proj) against transformers' LlamaMLP expression (`torch_eager`),
torch.compile of it and Liger-Kernel's LigerSwiGLUMLP (its SiLU-mul kernel between cuBLAS GEMMs), with the pieces
of the training step on their own: the gate_up GEMM (opsadv.ops.gemm vs F.linear) and the activation
(opsadv.ops.swiglu vs torch's silu * mul vs Liger's).  The model matrix's floor measures the whole MLP rewrite
per model; this suite says which piece wins or loses.

Shapes are the matrix's models' (hidden, intermediate) at 8192 tokens (a b4 s2048 training batch), bf16.
"train" = forward + backward with every gradient (x and each weight); "fwd" = a no-grad forward.  Rate in
TFLOP/s of the GEMMs (the activation rows: TB/s of gate_up read, y written, and back)."""
from __future__ import annotations

from typing import Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F

import opsadv
from opsadv.convert.modules import SwiGLUMLP

from .case import BenchCase, compiled_peer

TOKENS = 8192
# (name, hidden, intermediate)
SHAPES = (("llama3-0.5b", 960, 2560), ("qwen2-0.5b", 896, 4864), ("llama3-1.5b", 2048, 8192))
CPU_QUICK = (("tiny", 64, 128),)
_COMPILED: dict = {}


def _liger_silu_mul():
    try:
        from liger_kernel.ops.swiglu import LigerSiLUMulFunction
    except Exception:                     # noqa: BLE001 - not installed (or broken): the peer is left out
        return None
    return LigerSiLUMulFunction.apply


def hf_mlp(x, gate, up, down):
    """transformers' LlamaMLP.forward."""
    return down(F.silu(gate(x)) * up(x))


def _grid(quick: bool):
    if not torch.cuda.is_available():
        return [(s, TOKENS // 64, part, train) for s in CPU_QUICK for part in ("block",) for train in (False, True)]
    shapes = SHAPES[:1] if quick else SHAPES
    parts = ("block", "gate_up", "swiglu")
    return [(s, TOKENS, part, train) for s in shapes for part in parts for train in (True, False)
            if train or part == "block"]


def _grads(fn, leaves, g):
    def run():
        out = fn()
        return torch.autograd.grad(out, leaves, g)
    return run


def cases(quick: bool) -> Iterator[BenchCase]:
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    silu_mul = _liger_silu_mul() if dev == "cuda" else None
    for (name, hidden, inter), m, part, train in _grid(quick):
        gen = torch.Generator(device="cpu").manual_seed(0)
        x = torch.randn(m, hidden, generator=gen).to(dev, dtype).requires_grad_(train)
        gate, up = (nn.Linear(hidden, inter, bias=False) for _ in range(2))
        down = nn.Linear(inter, hidden, bias=False)
        for lin in (gate, up, down):
            lin.to(dev, dtype).requires_grad_(train)
        words = ["train" if train else "fwd", "bf16" if dtype == torch.bfloat16 else "fp32", name,
                 f"M{m}", f"h{hidden}", f"i{inter}", part]
        flops = 2.0 * m * hidden * inter * 3
        if part == "block":
            ours = SwiGLUMLP(gate, up, down)
            leaves = [x, gate.weight, up.weight, down.weight] if train else None
            g = torch.randn(m, hidden, generator=gen).to(dev, dtype) if train else None
            calls = {"opsadv": lambda: ours(x), "torch_eager": lambda: hf_mlp(x, gate, up, down)}
            if dev == "cuda":
                if "hf" not in _COMPILED:
                    _COMPILED["hf"] = compiled_peer(hf_mlp)
                calls["torch_compile"] = lambda: _COMPILED["hf"](x, gate, up, down)
                if silu_mul is not None:
                    calls["liger"] = lambda: down(silu_mul(gate(x), up(x)))
            work = flops * (3 if train else 1)
        elif part == "gate_up":        # the fused GEMM alone, fwd + bwd (x and the [W_g|W_u] gradient)
            w = torch.randn(2 * inter, hidden, generator=gen).to(dev, dtype).div_(hidden ** 0.5).requires_grad_()
            leaves = [x, w]
            g = torch.randn(m, 2 * inter, generator=gen).to(dev, dtype)
            calls = {"opsadv": lambda: opsadv.ops.gemm(x, w.t()), "torch_eager": lambda: F.linear(x, w)}
            work = 2.0 * m * hidden * 2 * inter * 3
        else:                          # the activation alone on the GEMM's output, fwd + bwd
            gu = torch.randn(m, 2 * inter, generator=gen).to(dev, dtype).requires_grad_()
            leaves = [gu]
            g = torch.randn(m, inter, generator=gen).to(dev, dtype)
            calls = {"opsadv": lambda: opsadv.ops.swiglu(gu),
                     "torch_eager": lambda: F.silu(gu[:, :inter]) * gu[:, inter:]}
            if silu_mul is not None:
                calls["liger"] = lambda: silu_mul(gu[:, :inter], gu[:, inter:])
            work = float(m * inter * 2 * (3 + 4))     # fwd: read 2N write N; bwd: read 2N + N, write 2N
        if train:
            calls = {k: _grads(fn, leaves, g) for k, fn in calls.items()}
        else:
            calls = {k: (lambda fn=fn: _no_grad(fn)) for k, fn in calls.items()}
        yield BenchCase(suite="mlp", case=" ".join(words), opsadv=calls.pop("opsadv"), peers=calls, work=work,
                        unit="TB/s" if part == "swiglu" else "TFLOP/s", baseline="torch_eager")


def _no_grad(fn):
    with torch.no_grad():
        return fn()

