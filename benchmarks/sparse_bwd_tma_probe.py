"""The sparse backward with q / dO (dK/dV kernel) and k / v (dQ kernel) through TMA descriptors ("tma") and with
its two kernels on two streams ("streams"), against its current default, at causal windows (s16384 d128 bf16, the
issue-5 shape) and the packed varlen batch.  A check against the pointer-load backward (bit-identical is not
expected for "tma": the same math, so rel err ~0) runs first at each timed shape.

    PYTHONPATH=. python3 benchmarks/sparse_bwd_tma_probe.py OUT.json
    PROBE_TINY=1 TRITON_INTERPRET=1 ...: a dry run on CPU (tiny shapes; streams need CUDA: serial there)
"""
from __future__ import annotations

import dataclasses
import os
import sys

import torch
from _probe_log import record_case, warm_and_time  # (benchmarks/ is sys.path[0] when run as a script)

import opsadv
from opsadv import SparseLayout
from opsadv.backends.cuda import sparse as SP
from opsadv.core import dispatch
from opsadv.core.ops import sparse as S

TINY = os.environ.get("PROBE_TINY") == "1"
DEV = "cpu" if TINY else "cuda"
DT = torch.float16 if TINY else torch.bfloat16
VARIANTS = {"default": {}, "tma": {"tma": True}, "streams": {"streams": True},
            "tma_streams": {"tma": True, "streams": True}}


def _layouts():
    s = 384 if TINY else 16384
    out = [(f"sliding{w} causal", SparseLayout.sliding_window(s, w, causal=True, block_size=128 if not TINY else 16,
                                                                 device=DEV), 1, 32 if not TINY else 2)
           for w in ((24, 100) if TINY else (256, 1024, 2048))]
    lens = [37, 90, 11, 70] if TINY else [4096, 2900, 3500, 1800, 4096, 2200, 3000, 2000]
    out.append(("varlen", SparseLayout.varlen(lens, causal=False, block_size=16 if TINY else 128, device=DEV), 1,
                2 if TINY else 16))
    return out


def main(path: str) -> None:
    d = 32 if TINY else 128
    res = {"commit": os.environ.get("OPSADV_COMMIT", "unknown"),
           "device": DEV if TINY else torch.cuda.get_device_name(), "cases": []}
    for name, lay, b, h in _layouts():
        torch.manual_seed(0)
        q, do = (torch.randn(b, h, lay.seq_q, d, device=DEV, dtype=DT) for _ in range(2))
        k, v = (torch.randn(b, h // 2, lay.seq_k, d, device=DEV, dtype=DT) for _ in range(2))
        spec = S.layout_spec(q, k, lay, True)
        with opsadv.use_backend("cuda", impls={"sparse_attention": "cuda.triton.sparse_attention"}):
            _, r = dispatch.explain_spec(spec)
        ctx = r.ctx
        args = (lay.block_mask, lay.key_padding_mask, lay.cu_seqlens, lay.block_size, lay.causal, lay.window_left,
                lay.window_right, lay.num_global, d ** -0.5)
        o, lse = SP.sparse_fwd(ctx, q, k, v, *args)
        fns = {n: (lambda var=var: SP.sparse_bwd(ctx, do, q, k, v, o, lse, *args, variant=var))
               for n, var in VARIANTS.items()}
        base = fns["default"]()
        errs = {n: max(float((x.double() - y.double()).norm() / y.double().norm()) for x, y in zip(f(), base))
                for n, f in fns.items()}
        times = warm_and_time(fns)
        row = {"case": name, "rel_err_vs_default": errs, "ms": {n: round(t, 4) for n, t in times.items()},
               "vs_default": {n: round(times["default"] / t, 3) for n, t in times.items()}}
        record_case(res, path, row)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "sparse_bwd_tma_probe.json")
