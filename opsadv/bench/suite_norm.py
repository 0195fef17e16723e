"""Bench suite "norm": opsadv.ops.layer_norm / rms_norm (optionally with the fused residual add)
against F.layer_norm / F.rms_norm (after a separate add) and torch.compile of the same expression.
Grid (docs/performance.md): bf16, (tokens, hidden) = (32768,4096), (16384,8192), (65536,1024); forward,
forward+backward and the backward alone ("bwd" rows: the forward's graph kept, only autograd.grad timed; issue
4's "backward >= 1.5x eager"); with and without residual.  Rate in TB/s of bytes moved: forward reads x
(+ residual) and the weights, writes y (+ the sum); backward adds reading dy (+ dsum) and the
normalized input, writing dx (+ the weight gradients)."""
from __future__ import annotations

from typing import Iterator

import torch
import torch.nn.functional as F

import opsadv

from .case import BenchCase, compiled_peer

SHAPES = ((32768, 4096), (16384, 8192), (65536, 1024))
_COMPILED: dict = {}


# `opsadv bench --allow-cpu` without a GPU: the quick grid at sizes a CPU runs in seconds (a smoke test)
CPU_QUICK = [("layer_norm", 1024, 512, False, False), ("rms_norm", 1024, 512, True, True)]


def _grid(quick: bool):
    """(op, tokens, hidden, residual, backward)"""
    if quick and not torch.cuda.is_available():
        return CPU_QUICK
    if quick:
        return [("layer_norm", 32768, 4096, False, False), ("rms_norm", 32768, 4096, False, False),
                ("rms_norm", 32768, 4096, True, False), ("layer_norm", 32768, 4096, False, True),
                ("rms_norm", 16384, 8192, True, True)]
    return [(op, t, h, res, bwd) for bwd in (False, True, "only") for op in ("layer_norm", "rms_norm")
            for t, h in SHAPES for res in (False, True)]


def _eager(op, residual):
    def fn(x, r, w, b):
        s = x + r if residual else x
        y = F.layer_norm(s, (s.shape[-1],), w, b, 1e-5) if op == "layer_norm" else F.rms_norm(s, (s.shape[-1],), w, 1e-6)
        return (y, s) if residual else y
    return fn


def _compiled(op, residual):
    key = (op, residual)
    if key not in _COMPILED:
        _COMPILED[key] = compiled_peer(_eager(op, residual))
    return _COMPILED[key]


def _mine(op, residual):
    def fn(x, r, w, b):
        if op == "layer_norm":
            return opsadv.ops.layer_norm(x, w, b, 1e-5, residual=r if residual else None)
        return opsadv.ops.rms_norm(x, w, 1e-6, residual=r if residual else None)
    return fn


def bytes_moved(op: str, t: int, h: int, residual: bool, backward, es: int = 2) -> float:
    """backward: False (forward), True (forward + backward) or "only" (the backward alone)."""
    act = t * h * es
    nw = (2 if op == "layer_norm" else 1) * h * es
    fwd = act * (2 + (2 if residual else 0)) + nw               # x, y (+ residual read, sum write)
    bwd = act * (3 + (1 if residual else 0)) + 2 * nw           # dy, xin, dx (+ dsum), weights + their grads
    return float(bwd if backward == "only" else fwd + (bwd if backward else 0))


def cases(quick: bool) -> Iterator[BenchCase]:
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16
    for op, t, h, res, bwd in _grid(quick):
        torch.manual_seed(0)
        x = torch.randn(t, h, device=dev, dtype=dtype)
        r = torch.randn(t, h, device=dev, dtype=dtype)
        w = 1 + 0.1 * torch.randn(h, device=dev, dtype=dtype)
        b = 0.1 * torch.randn(h, device=dev, dtype=dtype) if op == "layer_norm" else None
        gy = torch.randn(t, h, device=dev, dtype=dtype) if bwd else None
        gs = torch.randn(t, h, device=dev, dtype=dtype) if bwd and res else None
        g = bool(bwd)
        ins = [x.clone().requires_grad_(g), r.clone().requires_grad_(g and res), w.clone().requires_grad_(g),
               b.clone().requires_grad_(g) if b is not None else None]

        kept: dict = {}     # "only": each contender's forward output, its graph kept across calls

        def run(fn, ins=ins, gy=gy, gs=gs, bwd=bwd, res=res, kept=kept):
            if not bwd:
                with torch.no_grad():
                    return fn(*ins)
            if bwd == "only":
                if fn not in kept:
                    kept[fn] = fn(*ins)
                out = kept[fn]
            else:
                out = fn(*ins)
            outs, grads = ((out[0], out[1]), (gy, gs)) if res else ((out,), (gy,))
            wrt = [t_ for t_ in ins if t_ is not None and t_.requires_grad]
            return torch.autograd.grad(outs, wrt, grads, retain_graph=bwd == "only")

        # run bound per case (a late-bound name would call the last generated case's run)
        peers = {"torch_eager": (lambda fn=_eager(op, res), run=run: run(fn))}
        if dev == "cuda":
            peers["torch_compile"] = (lambda fn=_compiled(op, res), run=run: run(fn))
        words = [{False: "fwd", True: "fwd+bwd", "only": "bwd"}[bwd], "bf16", f"t{t}", f"h{h}", op] + (["residual"] if res else [])
        yield BenchCase(suite="norm", case=" ".join(words), opsadv=(lambda fn=_mine(op, res), run=run: run(fn)), peers=peers,
                        work=bytes_moved(op, t, h, res, bwd), unit="TB/s")
