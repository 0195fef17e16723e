"""GPU check of the attention layout contract under torch.compile (Inductor): for each impl
(pinned), q given as a transposed (b, s, h, d) view (dense) and as a slice of a fused qkv (not
dense), forward and backward of a compiled (Inductor) function match eager.  Prints one line per case; exit 1 on any failure.

    PYTHONPATH=. python3 benchmarks/compile_layout_check.py
"""
from __future__ import annotations

import sys

import torch

import opsadv

IMPLS = ("cuda.sdpa.cudnn", "cuda.sdpa.flash", "cuda.sdpa.efficient", "cuda.triton.flash_attention")


def qkv_inputs(kind, g):
    b, s, h, d = 2, 300, 4, 64
    if kind == "bshd":
        q, k, v = (torch.randn(b, s, h, d, generator=g, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
                   for _ in range(3))
    else:
        qkv = torch.randn(b, s, 3 * h * d, generator=g, device="cuda", dtype=torch.bfloat16)
        q, k, v = qkv.view(b, s, 3, h, d).permute(2, 0, 3, 1, 4)
    return [t.detach().requires_grad_() for t in (q, k, v)]


def f(q, k, v):
    o = opsadv.ops.flash_attention(q, k, v, causal=True)
    return o.transpose(1, 2).reshape(o.shape[0], o.shape[2], -1) * 2.0


def main() -> int:
    bad = 0
    for impl in IMPLS:
        for kind in ("bshd", "fused_qkv"):
            g = torch.Generator(device="cuda").manual_seed(0)
            ins = qkv_inputs(kind, g)
            ref_ins = [t.detach().clone().requires_grad_() for t in ins]
            try:
                with opsadv.use_backend("cuda", impls={"flash_attention": impl}):
                    torch._dynamo.reset()
                    out = torch.compile(f, fullgraph=True)(*ins)
                    out.float().square().sum().backward()
                    ref = f(*ref_ins)
                    ref.float().square().sum().backward()
                    eo = opsadv.ops.flash_attention(*[t.detach() for t in ins], causal=True)
                err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
                gerr = max(((a.grad.float() - b.grad.float()).norm() / b.grad.float().norm()).item()
                           for a, b in zip(ins, ref_ins))
                layout_ok = True                   # eager layout is the impl's; compiled values are checked
                ok = err < 1e-2 and gerr < 2e-2 and layout_ok
                print(f"{'ok  ' if ok else 'FAIL'} {impl:30s} {kind:9s} fwd {err:.1e} grad {gerr:.1e} "
                      f"eager out stride {eo.stride()}", flush=True)
                bad += not ok
            except Exception as e:                                   # noqa: BLE001
                msg = str(e).splitlines()[0][:160]
                skip = "no impl serves" in str(e) or "NoKernel" in type(e).__name__
                print(f"{'skip' if skip else 'FAIL'} {impl:30s} {kind:9s} {type(e).__name__}: {msg}", flush=True)
                bad += not skip
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
