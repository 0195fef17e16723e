"""`opsadv demo`: every op through the selected backend on random data, each checked against
the reference backend (float64), with the kernel that ran."""
from __future__ import annotations

import time

import torch

import opsadv
from opsadv.core.device_check import check_device
from opsadv.core.opdef import get_op, op_defs


def _rel(a, b) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


def _cases(device: str, dtype: torch.dtype):
    """(op, args, kwargs) for every registered op that has demo inputs (OpDef.demo), GPU-sized on a GPU."""
    g = torch.Generator().manual_seed(int(time.time()))
    big = device.startswith("cuda")
    for d in op_defs():
        if d.demo is not None:
            args, kwargs = d.demo(device, dtype, g, big)
            yield d.name, args, kwargs


def _to64(x):
    if isinstance(x, torch.Tensor) and x.is_floating_point():
        return x.double().cpu()
    if isinstance(x, opsadv.SparseLayout):
        import dataclasses
        return dataclasses.replace(x, block_mask=x.block_mask.cpu())
    return x.cpu() if isinstance(x, torch.Tensor) else x


def run_demo(backend: str = "auto", device: str | None = None, as_json: bool = False) -> int:
    """Print the table (or, as_json, one JSON object); 1 when an op's result is off the reference."""
    device = str(check_device(device, "demo", "--device")) if device else None
    b = opsadv.use_backend(backend)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    cuda = device.startswith("cuda")
    say = (lambda *a: None) if as_json else print  # noqa: E731
    say(f"opsadv demo: {b} on {device} ({str(dtype).replace('torch.', '')}), each op checked against the "
        f"reference backend in float64\n")
    say(f"{'op':18s} {'kernel that ran':40s} {'rel err':>9s}  {'ms':>8s}  verdict")
    tol = 3e-2 if dtype == torch.bfloat16 else 1e-3
    bad = 0
    rows = []
    for op, args, kwargs in _cases(device, dtype):
        fn = get_op(op).fn
        with opsadv.trace() as t:
            out = fn(*args, **kwargs)
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn(*args, **kwargs)
        if cuda:
            torch.cuda.synchronize()
        ms = (time.perf_counter() - t0) * 1e3
        with opsadv.use_backend("reference"):
            ref = fn(*[_to64(a) for a in args], **{k: _to64(v) for k, v in kwargs.items()})
        outs = out if isinstance(out, tuple) else (out,)
        refs = ref if isinstance(ref, tuple) else (ref,)
        err = max(_rel(o, r) for o, r in zip(outs, refs))
        ok = err <= tol
        bad += not ok
        impl = ", ".join(t.counts) or "?"
        rows.append({"op": op, "impl": impl, "rel_err": err, "tolerance": tol, "ms": ms, "ok": ok})
        say(f"{op:18s} {impl:40s} {err:9.2e}  {ms:8.3f}  {'ok' if ok else 'MISMATCH'}")
    op, args, kwargs = next(_cases(device, dtype))
    exp = opsadv.explain(op, *args, **kwargs)
    if as_json:
        import json
        print(json.dumps({"backend": str(b), "device": device, "dtype": str(dtype).replace("torch.", ""),
                          "opsadv": opsadv.__version__, "ops": rows, "failed": bad,
                          f"explain_{op}": exp.to_dict()}, indent=1))
        return 1 if bad else 0
    print(f"\nwhy these kernels: opsadv.explain(op, *args) — e.g. for {op}:\n")
    print(exp)
    return 1 if bad else 0
