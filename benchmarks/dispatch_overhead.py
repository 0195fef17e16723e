"""Eager per-call overhead of opsadv's dispatch: a public op call vs calling the resolved
reference impl directly, on a tiny tensor so kernel time is small and stable.

    python benchmarks/dispatch_overhead.py [--json PATH]

Reports the best-of-N mean per call (µs) for: no-grad (DIRECT path), grad (autograd.Function
path), and the full torch.ops path (what compile/export and dispatch modes take)."""
from __future__ import annotations

import argparse
import json
import platform
import timeit

import torch

import opsadv
from opsadv.backends.reference import kernels as K


def best(stmt, n=2000, repeat=15) -> float:
    return min(timeit.repeat(stmt, number=n, repeat=repeat)) / n * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    opsadv.use_backend("reference")
    x, w = torch.randn(4, 64), torch.randn(64)
    xg, wg = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    rows = {}
    with torch.no_grad():
        opsadv.ops.rms_norm(x, w)
        direct = best(lambda: K.rms_norm_fwd(None, x, w, 1e-6, None, 0.0))
        public = best(lambda: opsadv.ops.rms_norm(x, w))
        torch_ops = best(lambda: torch.ops.opsadv.rms_norm(x, w, 1e-6, None, 0.0))
    rows["no_grad"] = {"direct_impl_us": direct, "opsadv_us": public, "overhead_us": public - direct,
                       "torch_ops_us": torch_ops, "torch_ops_overhead_us": torch_ops - direct}
    opsadv.ops.rms_norm(xg, wg)
    direct_g = best(lambda: K.rms_norm_fwd(None, xg, wg, 1e-6, None, 0.0))
    public_g = best(lambda: opsadv.ops.rms_norm(xg, wg))
    torch_ops_g = best(lambda: torch.ops.opsadv.rms_norm(xg, wg, 1e-6, None, 0.0))
    rows["grad_forward"] = {"direct_impl_us": direct_g, "opsadv_us": public_g, "overhead_us": public_g - direct_g,
                            "torch_ops_us": torch_ops_g, "torch_ops_overhead_us": torch_ops_g - direct_g}
    meta = {"torch": torch.__version__, "python": platform.python_version(), "machine": platform.processor() or platform.machine()}
    print(f"dispatch overhead per call ({meta})")
    for k, r in rows.items():
        print(f"  {k:13s} impl {r['direct_impl_us']:7.1f} µs | opsadv {r['opsadv_us']:7.1f} µs (+{r['overhead_us']:.1f}) "
              f"| via torch.ops {r['torch_ops_us']:7.1f} µs (+{r['torch_ops_overhead_us']:.1f})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
