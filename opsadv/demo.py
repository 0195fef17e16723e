"""`opsadv demo`: every op through the selected backend on random data, each checked against
the reference backend (float64), with the kernel that ran."""
from __future__ import annotations

import time

import torch

import opsadv
from opsadv.core.device_check import check_device


def _rel(a, b) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


def _cases(device: str, dtype: torch.dtype):
    g = torch.Generator().manual_seed(int(time.time()))
    r = lambda *s: torch.randn(*s, generator=g).to(device=device, dtype=dtype)  # noqa: E731
    big = device.startswith("cuda")
    b, h, hkv, s, d = (2, 16, 4, 1024, 128) if big else (1, 4, 2, 100, 64)
    q, k, v = r(b, h, s, d), r(b, hkv, s, d), r(b, hkv, s, d)
    m, kk, n = (4096, 2048, 2048) if big else (100, 96, 80)
    x, w, w2, bias = r(m, kk), r(kk, n) * kk ** -0.5, r(kk, 2 * n) * kk ** -0.5, r(n)
    hid = r(m, kk)
    bs = 64 if big else 16
    nb = -(-s // bs)
    layout = opsadv.SparseLayout(s, s, bs, torch.zeros(1, 1, nb, nb, dtype=torch.bool, device=device),
                                 causal=True, window=(4 * bs, 0))
    yield "flash_attention", (q, k, v), {"causal": True}
    yield "sparse_attention", (q, k, v, layout), {}
    yield "gemm", (x, w), {"bias": bias, "activation": "gelu_tanh"}
    yield "swiglu_gemm", (x, w2), {}
    yield "swiglu", (r(m, 2 * n),), {}
    yield "layer_norm", (hid, r(kk), r(kk), 1e-5), {"residual": r(m, kk)}
    yield "rms_norm", (hid, r(kk), 1e-6), {"residual": r(m, kk)}


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
        fn = getattr(opsadv.ops, op)
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
            ref = getattr(opsadv.ops, op)(*[_to64(a) for a in args], **{k: _to64(v) for k, v in kwargs.items()})
        outs = out if isinstance(out, tuple) else (out,)
        refs = ref if isinstance(ref, tuple) else (ref,)
        err = max(_rel(o, r) for o, r in zip(outs, refs))
        ok = err <= tol
        bad += not ok
        impl = ", ".join(t.counts) or "?"
        rows.append({"op": op, "impl": impl, "rel_err": err, "tolerance": tol, "ms": ms, "ok": ok})
        say(f"{op:18s} {impl:40s} {err:9.2e}  {ms:8.3f}  {'ok' if ok else 'MISMATCH'}")
    _, args, kwargs = next(_cases(device, dtype))
    exp = opsadv.explain("flash_attention", *args, **kwargs)
    if as_json:
        import json
        print(json.dumps({"backend": str(b), "device": device, "dtype": str(dtype).replace("torch.", ""),
                          "opsadv": opsadv.__version__, "ops": rows, "failed": bad,
                          "explain_flash_attention": exp.to_dict()}, indent=1))
        return 1 if bad else 0
    print("\nwhy these kernels: opsadv.explain(op, *args) — e.g. for flash_attention:\n")
    print(exp)
    return 1 if bad else 0
