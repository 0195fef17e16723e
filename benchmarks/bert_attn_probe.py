"""BERT's attention through the packed (varlen) path: forward tile sweep of the sparse kernel at d64.

The BERT e2e case (b32 s512, ~25% padding, 12 heads, d64; packed into one row of ~12.2K tokens with
cu_seqlens) spends 1.086 ms in `_sparse_fwd` over 12 layers (results/bert_graphs_probe_h200.json), i.e.
~150 TFLOP/s: the h100 profile's sparse tile (64x64, 4 warps, 3 stages) was chosen on d128 windows.
This probe times the forward at that exact layout for several (BLOCK_M, BLOCK_N, warps, stages), next to
PyTorch's FlashAttention-2 varlen kernel (aten._flash_attention_forward with cu_seqlens), and checks each
against float32 attention per sequence.

It also times opsadv.ops.sparse_attention with the FA2 varlen impl (cuda.sdpa.flash_varlen, pinned) and
with the cuda backend's own choice, on the eager packed layout and on the CUDA-graph runner's layout
(rows = bucket_rows(tokens), filler rows split into segments of <= s, max_seqlen = s).

  PYTHONPATH=. python3 benchmarks/bert_attn_probe.py OUT.json
  PROBE_CONFIGS=default ...   only the profile's own sparse tile (skips the tile sweep's compiles)
"""
from __future__ import annotations

import json
import sys

import torch
import torch.nn.functional as F
from triton.testing import do_bench, do_bench_cudagraph

import opsadv
from opsadv import SparseLayout
from opsadv.backends.cuda import sparse as SP

B, S, H, D = 32, 512, 12, 64
CONFIGS = [(64, 64, 4, 3), (128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (128, 128, 8, 2),
           (64, 128, 4, 3), (128, 32, 4, 3), (64, 64, 4, 4), (64, 32, 4, 3), (128, 64, 4, 4)]


def gpu_ms(fn) -> float:
    """GPU time per call: replayed from a CUDA graph (the eager op is host-bound on the GPU host, so
    do_bench's event timing would measure the host), else the profiler's kernel time."""
    try:
        return do_bench_cudagraph(fn, rep=100, return_mode="median")
    except Exception:  # noqa: BLE001
        from torch.profiler import ProfilerActivity, profile
        fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(20):
                fn()
            torch.cuda.synchronize()
        return sum(e.self_device_time_total for e in prof.key_averages()) / 20 / 1e3


def main() -> None:
    out_path = sys.argv[1] if len(sys.argv) > 1 else "bert_attn_probe.json"
    g = torch.Generator().manual_seed(0)
    lens = torch.randint(int(0.4 * S), S + 1, (B,), generator=g).tolist()   # as benchmarks/bert_probe.py
    n = sum(lens)
    dev, dt = "cuda", torch.bfloat16
    # (1, H, N, D) over (1, N, H, D) memory: what the converted BERT hands the op (a view of the qkv GEMM)
    q, k, v = (torch.randn(1, n, H, D, device=dev, dtype=dt).transpose(1, 2) for _ in range(3))
    lay = SparseLayout.varlen(lens, block_size=128, device=dev)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), device=dev, dtype=torch.int32)
    flops = sum(4 * L * L * D * H for L in lens)

    # float32 reference per sequence (every 4th sequence: enough to catch a wrong tile)
    ref = {}
    for i in range(0, B, 4):
        a, b_ = int(cu[i]), int(cu[i + 1])
        ref[i] = F.scaled_dot_product_attention(*(t[:, :, a:b_].float() for t in (q, k, v)))

    def err(o):
        e = [((o[:, :, int(cu[i]):int(cu[i + 1])].float() - r).norm() / r.norm()).item() for i, r in ref.items()]
        return max(e)

    rows = []
    base = SP.TILES["h100"]["small"]
    import os
    configs = [base[0]] if os.environ.get("PROBE_CONFIGS") == "default" else CONFIGS
    # pinned: since cuda.sdpa.flash_varlen exists the backend's own pick for this layout is FA2 (at 3a3315c the
    # unpinned "opsadv sparse" row, results/bert_attn_probe_flash_varlen_h200.json, timed FA2, not the sweep's tile)
    with opsadv.use_backend("cuda", impls={"sparse_attention": "cuda.triton.sparse_attention"}):
        for cfg in configs:
            SP.TILES["h100"]["small"] = (cfg, base[1], base[2])
            try:
                fn = lambda: opsadv.ops.sparse_attention(q, k, v, lay)   # noqa: E731
                o = fn()
                e = err(o)
                ms = gpu_ms(fn)
                host = do_bench(fn, warmup=25, rep=200, return_mode="median")
                rows.append({"impl": "opsadv sparse", "cfg": cfg, "ms": round(ms, 4), "tflops": round(flops / ms / 1e9, 1),
                             "eager_ms": round(host, 4), "rel_err": round(e, 5)})
            except Exception as ex:  # noqa: BLE001  (a config that does not compile / fit is a result too)
                rows.append({"impl": "opsadv sparse", "cfg": cfg, "error": f"{type(ex).__name__}: {str(ex)[:200]}"})
            print(rows[-1], flush=True)
        SP.TILES["h100"]["small"] = base
    qf, kf, vf = (t.transpose(1, 2)[0] for t in (q, k, v))        # (N, H, D) contiguous views
    mx = max(lens)

    def fa2():
        return torch.ops.aten._flash_attention_forward(qf, kf, vf, cu, cu, mx, mx, 0.0, False, False,
                                                       scale=D ** -0.5)[0]
    try:
        o = fa2().transpose(0, 1)[None]
        rows.append({"impl": "aten flash varlen (FA2)", "ms": round(gpu_ms(fa2), 4),
                     "eager_ms": round(do_bench(fa2, warmup=25, rep=200, return_mode="median"), 4),
                     "rel_err": round(err(o), 5)})
        rows[-1]["tflops"] = round(flops / rows[-1]["ms"] / 1e9, 1)
    except Exception as ex:  # noqa: BLE001
        rows.append({"impl": "aten flash varlen (FA2)", "error": f"{type(ex).__name__}: {str(ex)[:300]}"})
    print(rows[-1], flush=True)
    # the op itself: FA2 varlen impl pinned, and the cuda backend's own pick, on the eager layout and the
    # graph runner's layout (filler rows after the real ones, in segments of <= S; outputs there unused)
    from opsadv.convert import packing
    rows_g = packing.bucket_rows(n, B * S)
    kpm = torch.zeros(B, S, dtype=torch.bool, device=dev)
    for i, L in enumerate(lens):
        kpm[i, :L] = True
    token = packing.static_rows.set(rows_g)
    try:
        lay_g = packing.build_pack(kpm).layout
    finally:
        packing.static_rows.reset(token)
    qg, kg, vg = (torch.randn(1, rows_g, H, D, device=dev, dtype=dt).transpose(1, 2) for _ in range(3))
    qg[:, :, :n], kg[:, :, :n], vg[:, :, :n] = q, k, v          # same real tokens: the same error check applies
    pins = (("flash_varlen (pinned)", {"impls": {"sparse_attention": "cuda.sdpa.flash_varlen"}}),
            ("triton sparse (pinned)", {"impls": {"sparse_attention": "cuda.triton.sparse_attention"}}),
            ("cuda auto", {}))
    for where, (lay_x, qkv) in (("eager layout", (lay, (q, k, v))),
                                (f"graph layout rows={rows_g}", (lay_g, (qg, kg, vg)))):
        for label, kw in pins:
            name = f"op {label}, {where}"
            try:
                with opsadv.use_backend("cuda", **kw), opsadv.trace() as tr:
                    fn = lambda: opsadv.ops.sparse_attention(*qkv, lay_x)   # noqa: E731
                    o = fn()
                    e = err(o[:, :, :n])
                    ms = gpu_ms(fn)
                    host = do_bench(fn, warmup=25, rep=200, return_mode="median")
                rows.append({"impl": name, "chosen": sorted(tr.counts), "ms": round(ms, 4),
                             "tflops": round(flops / ms / 1e9, 1), "eager_ms": round(host, 4), "rel_err": round(e, 5)})
            except Exception as ex:  # noqa: BLE001
                rows.append({"impl": name, "error": f"{type(ex).__name__}: {str(ex)[:300]}"})
            print(rows[-1], flush=True)
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "lens": lens, "tokens": n,
           "shape": f"packed b{B} s{S} h{H} d{D} bf16, non-causal", "rows": rows}
    res["commit"] = os.environ.get("OPSADV_COMMIT", "")
    with open(out_path, "w") as f:
        json.dump(res, f, indent=1)
    for r in rows:
        print(f"{r['impl'][:58]:58s} {str(r.get('cfg', '')):18s} {r.get('ms', '-'):>8} ms {r.get('tflops', '-'):>7} TFLOP/s "
              f"(eager {r.get('eager_ms', '-')} ms) err {r.get('rel_err', r.get('error', ''))}")


if __name__ == "__main__":
    main()
