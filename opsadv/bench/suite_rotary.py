"""Bench suite "rotary": opsadv.ops.rotary_embedding against transformers' eager `apply_rotary_pos_emb` (the
rotate_half expression every Llama-family modeling file uses), torch.compile of it, and Liger-Kernel's
`liger_rotary_pos_emb` where it is installed (BENCHMARKS.md peers).  q and k come as transformers makes them:
(b, s, h, d) projections viewed as (b, h, s, d); cos / sin (b, s, R) in the model dtype.  Forward and
forward + backward (gradients of q and k), bf16.  Rate in TB/s of bytes moved: q and k read and written (and
dq, dk for the backward), cos / sin read once per direction.

On a GPU, rows "qk_norm" add opsadv.ops.qk_norm_rotary (Qwen3's per-head q / k RMSNorm fused with rotary)
against transformers' eager Qwen3 expression (Qwen3RMSNorm on the (b, s, h, d) projections, transpose,
apply_rotary_pos_emb), torch.compile of it, and Liger's LigerRMSNorm + liger_rotary_pos_emb (what
apply_liger_kernel_to_qwen3 installs).  Gradients of the projections and both norm weights.  Bytes: q and k read
and written forward; read x and dy, write dx backward; tables once per direction (the weights are negligible).
On the CPU these rows are left out (no compile or Liger peer to measure; the interpreter is not timed)."""
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
    if dev == "cuda":
        yield from qk_cases(quick, dev)


# ---- qk_norm_rotary: Qwen3's q / k norms + rotary ----------------------------------------------------------------
# (name, b, s, hq, hk, d)
QK_SHAPES = (("qwen3-8b", 4, 4096, 32, 8, 128), ("qwen3-0.6b", 8, 2048, 16, 8, 128), ("decode-b64", 64, 1, 32, 8, 128))
EPS = 1e-6


def qwen3_rms_norm(x, w, eps: float = EPS):
    """transformers' Qwen3RMSNorm: float32 statistics, normalized x rounded to its dtype, then times the weight."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(x.dtype)


def hf_qk_norm_rope(q, k, cos, sin, qw, kw):
    """Qwen3Attention's lines: q / k norms on the (b, s, h, d) projections, transposed, then the rotary function."""
    return hf_rope(qwen3_rms_norm(q, qw).transpose(1, 2), qwen3_rms_norm(k, kw).transpose(1, 2), cos, sin)


def opsadv_qk_norm_rope(q, k, cos, sin, qw, kw):
    return opsadv.ops.qk_norm_rotary(q.transpose(1, 2), k.transpose(1, 2), cos, sin, qw, kw, eps=EPS)


def _liger_qk():
    try:
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction
        from liger_kernel.transformers.rope import liger_rotary_pos_emb
    except Exception:                     # noqa: BLE001 - not installed (or broken): the peer is left out
        return None

    def liger_qk_norm_rope(q, k, cos, sin, qw, kw):
        # LigerRMSNorm(head_dim, eps) as apply_liger_kernel_to_qwen3 installs it (casting mode "llama", offset 0)
        qn = LigerRMSNormFunction.apply(q, qw, EPS, 0.0, "llama")
        kn = LigerRMSNormFunction.apply(k, kw, EPS, 0.0, "llama")
        return liger_rotary_pos_emb(qn.transpose(1, 2), kn.transpose(1, 2), cos, sin)
    return liger_qk_norm_rope


def qk_bytes_moved(b, s, hq, hk, d, backward: bool, es: int = 2) -> float:
    qk = b * s * (hq + hk) * d * es
    tables = 2 * b * s * d * es
    fwd = 2 * qk + tables
    return float(fwd + (3 * qk + tables if backward else 0))


def qk_cases(quick: bool, dev: str, shapes=None) -> Iterator[BenchCase]:
    """The qk_norm rows on device dev (cases() yields them on a GPU only; tests call this on the CPU)."""
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    liger = _liger_qk() if dev == "cuda" else None
    shapes = shapes or (QK_SHAPES[:2] if quick else QK_SHAPES)
    for (name, b, s, hq, hk, d), bwd in [(sh, bwd) for bwd in (False, True) for sh in shapes]:
        g = torch.Generator(device="cpu").manual_seed(0)
        qp = torch.randn(b, s, hq * d, generator=g).to(dev, dtype)
        kp = torch.randn(b, s, hk * d, generator=g).to(dev, dtype)
        qw0 = (1 + 0.1 * torch.randn(d, generator=g)).to(dev, dtype)
        kw0 = (1 + 0.1 * torch.randn(d, generator=g)).to(dev, dtype)
        pos = torch.arange(s, dtype=torch.float32)
        inv = 1.0 / (1e6 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
        emb = torch.cat((torch.outer(pos, inv),) * 2, -1)[None].expand(b, s, d)
        cos, sin = emb.cos().to(dev, dtype), emb.sin().to(dev, dtype)
        gq = torch.randn(b, s, hq, d, generator=g).to(dev, dtype).transpose(1, 2) if bwd else None
        gk = torch.randn(b, s, hk, d, generator=g).to(dev, dtype).transpose(1, 2) if bwd else None
        leaves = tuple(t.detach().requires_grad_(bwd) for t in (qp, kp, qw0, kw0))

        def run(fn, leaves=leaves, cos=cos, sin=sin, gq=gq, gk=gk, bwd=bwd, b=b, s=s, hq=hq, hk=hk, d=d):
            qg, kg, qw, kw = leaves
            q, k = qg.view(b, s, hq, d), kg.view(b, s, hk, d)       # (b, s, h, d): Qwen3 norms before transposing
            if not bwd:
                with torch.no_grad():
                    return fn(q, k, cos, sin, qw, kw)
            oq, ok = fn(q, k, cos, sin, qw, kw)
            return torch.autograd.grad((oq, ok), leaves, (gq, gk))

        peers = {"torch_eager": (lambda run=run: run(hf_qk_norm_rope))}
        if dev == "cuda":
            if "hf_qk" not in _COMPILED:
                _COMPILED["hf_qk"] = compiled_peer(hf_qk_norm_rope)
            peers["torch_compile"] = (lambda run=run: run(_COMPILED["hf_qk"]))
        if liger is not None:
            # Liger's rope rotates in place (its backward too): its own leaves and output gradients
            ll = tuple(t.detach().clone().requires_grad_(bwd) for t in (qp, kp, qw0, kw0))
            gql = gq.clone() if bwd else None
            gkl = gk.clone() if bwd else None
            peers["liger"] = (lambda run=run, ll=ll, gql=gql, gkl=gkl: run(liger, leaves=ll, gq=gql, gk=gkl))
        words = ["fwd+bwd" if bwd else "fwd", "bf16" if dtype == torch.bfloat16 else "fp32", "qk_norm", name,
                 f"b{b}", f"s{s}", f"h{hq}/{hk}", f"d{d}"]
        yield BenchCase(suite="rotary", case=" ".join(words), opsadv=(lambda run=run: run(opsadv_qk_norm_rope)),
                        peers=peers, work=qk_bytes_moved(b, s, hq, hk, d, bwd), unit="TB/s", baseline="torch_eager")
