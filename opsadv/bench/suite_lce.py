"""Bench suite "lce": opsadv.ops.linear_cross_entropy (a causal LM's head + loss without the logits in memory)
against transformers' way (`torch_eager`: logits = h @ W^T in bf16, upcast to float32, F.cross_entropy),
torch.compile of that expression and Liger-Kernel's fused linear cross-entropy where it is installed.
Forward + backward (the gradients of hidden and weight), bf16, hidden 4096 / vocabulary 128256 (Llama-3) at 8192
and 32768 tokens, 10% of the labels ignored.  Rate in TFLOP/s of the three GEMMs (6 N H V); every row also
carries each contender's peak memory beyond its inputs (`peak_mib`), measured once before the timing.

The Triton impl's chunk size (token rows per chunk, about CHUNK_FACTOR x the hidden states' bytes of logits) trades
memory for passes over dW: the first shape's row also times our op at factors 1, 2 and 8 (`opsadv_cf<k>`, the
shipped factor is the `opsadv` column), so one run shows time and `peak_mib` per factor beside Liger's."""
from __future__ import annotations

from typing import Iterator

import torch
import torch.nn.functional as F

import opsadv
from opsadv.backends.triton_common.linear_cross_entropy import linear_cross_entropy as _impl

from .case import BenchCase, compiled_peer, peak_mib

FACTORS = (1, 2, 8)          # chunk factors timed beside the shipped one (first shape, GPU)

# (name, tokens, hidden, vocab)
SHAPES = (("llama3-8b-head", 8192, 4096, 128256), ("llama3-8b-head", 32768, 4096, 128256))
CPU_QUICK = (("tiny", 256, 64, 1000),)
_COMPILED: dict = {}


def hf_loss(h, w, labels):
    """transformers' ForCausalLMLoss on already shifted labels: float32 logits, mean over the labels kept."""
    return F.cross_entropy((h @ w.t()).float(), labels, ignore_index=-100)


def _liger():
    try:
        from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction
    except Exception:                     # noqa: BLE001 - not installed (or broken): the peer is left out
        return None

    def loss(h, w, labels):
        out = LigerFusedLinearCrossEntropyFunction.apply(h, w, labels)
        return out[0] if isinstance(out, tuple) else out
    return loss


def _with_chunk_factor(factor: int):
    """opsadv.ops.linear_cross_entropy with the Triton impl's CHUNK_FACTOR set to `factor` for the call."""
    def loss(h, w, labels):
        shipped, _impl.CHUNK_FACTOR = _impl.CHUNK_FACTOR, factor
        try:
            return opsadv.ops.linear_cross_entropy(h, w, labels)
        finally:
            _impl.CHUNK_FACTOR = shipped
    return loss


def cases(quick: bool) -> Iterator[BenchCase]:
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    shapes = CPU_QUICK if dev == "cpu" else SHAPES[:1] if quick else SHAPES
    liger = _liger() if dev == "cuda" else None
    for name, n, h, v in shapes:
        gen = torch.Generator(device="cpu").manual_seed(0)
        hidden = torch.randn(n, h, generator=gen).to(dev, dtype).requires_grad_()
        weight = (torch.randn(v, h, generator=gen) / h ** 0.5).to(dev, dtype).requires_grad_()
        labels = torch.randint(0, v, (n,), generator=gen)
        labels[torch.rand(n, generator=gen) < 0.1] = -100
        labels = labels.to(dev)

        def step(fn, hidden=hidden, weight=weight, labels=labels):
            loss = fn(hidden, weight, labels)
            return (loss.detach(), *torch.autograd.grad(loss, (hidden, weight)))

        calls = {"opsadv": lambda step=step: step(opsadv.ops.linear_cross_entropy),
                 "torch_eager": lambda step=step: step(hf_loss)}
        if dev == "cuda":
            if "hf" not in _COMPILED:
                _COMPILED["hf"] = compiled_peer(hf_loss)
            calls["torch_compile"] = lambda step=step: step(_COMPILED["hf"])
            if liger is not None:
                calls["liger"] = lambda step=step: step(liger)
            if (name, n) == SHAPES[0][:2]:
                for f in FACTORS:
                    calls[f"opsadv_cf{f}"] = lambda step=step, loss=_with_chunk_factor(f): step(loss)
        extra: dict = {}

        def setup(every=dict(calls), extra=extra):
            for k, fn in every.items():
                fn()                                      # (compilation and autotuning stay out of the peak)
                extra[f"{k}_peak_mib"] = peak_mib(fn)

        words = ["fwd+bwd", "bf16" if dtype == torch.bfloat16 else "fp32", name, f"N{n}", f"h{h}", f"V{v}"]
        yield BenchCase(suite="lce", case=" ".join(words), opsadv=calls.pop("opsadv"), peers=calls,
                        work=6.0 * n * h * v, baseline="torch_eager", extra=extra,
                        setup=setup if dev == "cuda" else None)
