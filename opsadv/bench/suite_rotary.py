"""Bench suite "rotary": opsadv.ops.rotary_embedding against transformers' eager `apply_rotary_pos_emb` (the
rotate_half expression every Llama-family modeling file uses), torch.compile of it, and Liger-Kernel's
`liger_rotary_pos_emb` where it is installed (BENCHMARKS.md peers).  q and k come as transformers makes them:
(b, s, h, d) projections viewed as (b, h, s, d); cos / sin (b, s, R) in the model dtype.  Forward and
forward + backward (gradients of q and k), bf16.  Rate in TB/s of bytes moved: q and k read and written (and
dq, dk for the backward), cos / sin read once per direction."""
from __future__ import annotations

from typing import Iterator

import torch

import opsadv

from .case import BenchCase, compiled_peer

# (name, b, s, hq, hk, d, rotary width)
SHAPES = (("llama3-8b", 4, 4096, 32, 8, 128, 128), ("qwen2-0.5b", 8, 2048, 14, 2, 64, 64),
          ("pythia-1.4b", 8, 2048, 16, 16, 128, 32), ("decode-b64", 64, 1, 32, 8, 128, 128))
_COMPILED: dict = {}


def rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def hf_rope(q, k, cos, sin):
    """transformers' apply_rotary_pos_emb, partial width as in GPT-NeoX / Phi-3 (identical when R = D)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    r = cos.shape[-1]
    if r == q.shape[-1]:
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
    qr, qp, kr, kp = q[..., :r], q[..., r:], k[..., :r], k[..., r:]
    return (torch.cat((qr * cos + rotate_half(qr) * sin, qp), -1),
            torch.cat((kr * cos + rotate_half(kr) * sin, kp), -1))


def _liger():
    try:
        from liger_kernel.transformers.rope import liger_rotary_pos_emb
    except Exception:                     # noqa: BLE001 - not installed (or broken): the peer is left out
        return None
    return liger_rotary_pos_emb


def bytes_moved(b, s, hq, hk, d, r, backward: bool, es: int = 2) -> float:
    qk = b * s * (hq + hk) * d * es
    tables = 2 * b * s * r * es
    one = 2 * qk + tables
    return float(one * (2 if backward else 1))


def _grid(quick: bool):
    shapes = SHAPES[:2] if quick else SHAPES
    return [(shape, bwd) for bwd in (False, True) for shape in shapes]


def cases(quick: bool) -> Iterator[BenchCase]:
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16
    liger = _liger() if dev == "cuda" else None
    for (name, b, s, hq, hk, d, r), bwd in _grid(quick):
        g = torch.Generator(device="cpu").manual_seed(0)
        qp = torch.randn(b, s, hq * d, generator=g).to(dev, dtype)
        kp = torch.randn(b, s, hk * d, generator=g).to(dev, dtype)
        pos = torch.arange(s, dtype=torch.float32)
        inv = 1.0 / (10000 ** (torch.arange(0, r, 2, dtype=torch.float32) / r))
        emb = torch.cat((torch.outer(pos, inv),) * 2, -1)[None].expand(b, s, r)
        cos, sin = emb.cos().to(dev, dtype), emb.sin().to(dev, dtype)
        gq = torch.randn(b, s, hq, d, generator=g).to(dev, dtype).transpose(1, 2) if bwd else None
        gk = torch.randn(b, s, hk, d, generator=g).to(dev, dtype).transpose(1, 2) if bwd else None

        qg = qp.detach().requires_grad_(bwd)
        kg = kp.detach().requires_grad_(bwd)

        def run(fn, qg=qg, kg=kg, cos=cos, sin=sin, gq=gq, gk=gk, bwd=bwd, b=b, s=s, hq=hq, hk=hk, d=d):
            # (b, h, s, d) views of the projections, as transformers hands them over
            q = qg.view(b, s, hq, d).transpose(1, 2)
            k = kg.view(b, s, hk, d).transpose(1, 2)
            if not bwd:
                with torch.no_grad():
                    return fn(q, k, cos, sin)
            oq, ok = fn(q, k, cos, sin)
            return torch.autograd.grad((oq, ok), (qg, kg), (gq, gk))

        peers = {"torch_eager": (lambda run=run: run(hf_rope))}
        if dev == "cuda":
            if "hf" not in _COMPILED:
                _COMPILED["hf"] = compiled_peer(hf_rope)
            peers["torch_compile"] = (lambda run=run: run(_COMPILED["hf"]))
        if liger is not None and r == d:          # (Liger rotates whole heads only)
            # Liger rotates q and k in place: its own copies of the projections (drifting across calls does
            # not change its time; the rows' rel_err is against transformers' expression, the baseline)
            ql = qp.detach().clone().requires_grad_(bwd)
            kl = kp.detach().clone().requires_grad_(bwd)
            gql = gq.clone() if bwd else None                 # (and its backward rotates dq' / dk' in place)
            gkl = gk.clone() if bwd else None
            peers["liger"] = (lambda run=run, ql=ql, kl=kl, gql=gql, gkl=gkl: run(liger, qg=ql, kg=kl, gq=gql,
                                                                                  gk=gkl))
        words = ["fwd+bwd" if bwd else "fwd", "bf16", name, f"b{b}", f"s{s}", f"h{hq}/{hk}", f"d{d}"]
        if r != d:
            words.append(f"r{r}")
        yield BenchCase(suite="rotary", case=" ".join(words),
                        opsadv=(lambda run=run: run(opsadv.ops.rotary_embedding)), peers=peers,
                        work=bytes_moved(b, s, hq, hk, d, r, bwd), unit="TB/s", baseline="torch_eager")
