"""Padded BERT-base (b32 s512, ~25% padding, bf16): transformers sdpa (the peer) against opsadv
conversions: packed encoder (default) eager, packed + CUDA graphs, padded + CUDA graphs (the
device-side key-padding attention path).  Times with do_bench (median), error on real tokens,
kernels per layer and the top CUDA kernels of the graphed variants.

    PYTHONPATH=. python3 benchmarks/bert_probe.py [OUT.json] [--compile] [--ops]
--ops: only the packed eager conversion, with the aten ops that launch GPU work (op, input shapes, GPU
time, count): names the op behind each non-GEMM kernel of the graphed run.
"""
from __future__ import annotations

import copy
import json
import sys
import time

import torch
from triton.testing import do_bench

import opsadv
from opsadv.bench import suite_e2e as E


def top_kernels(fn, n=8):
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    rows = sorted(((e.key, e.device_time_total / 1e3, e.count) for e in prof.key_averages()), key=lambda r: -r[1])
    total = sum(r[1] for r in rows)
    return round(total, 3), [{"kernel": k[:80], "ms": round(ms, 3), "count": c} for k, ms, c in rows[:n]]


def op_table(fn, n=16):
    """aten ops with GPU time (their kernels' time), grouped by op and input shapes."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
        fn()
        torch.cuda.synchronize()
    rows = [(e.key, str(e.input_shapes)[:120], e.self_device_time_total / 1e3, e.count)
            for e in prof.key_averages(group_by_input_shape=True) if e.self_device_time_total > 0]
    rows.sort(key=lambda r: -r[2])
    return [{"op": k, "shapes": sh, "gpu_ms": round(ms, 3), "count": c} for k, sh, ms, c in rows[:n]]


def main():
    out = {}
    b, s = E.BERT_SHAPE
    L = E.BERT["num_hidden_layers"]
    base = E._build("bert", "cuda")
    g = torch.Generator().manual_seed(0)
    lens = torch.randint(int(0.4 * s), s + 1, (b,), generator=g)
    am = (torch.arange(s)[None, :] < lens[:, None]).long().cuda()
    ids = torch.randint(0, E.BERT["vocab_size"], (b, s), device="cuda")
    out["padding_fraction"] = round(1 - am.float().mean().item(), 3)

    def run(m, mask=am):
        def f():
            with torch.no_grad():
                return m(input_ids=ids, attention_mask=mask).last_hidden_state
        return f

    ref = run(base)()
    keep = am.bool()

    def err(y):
        return ((y[keep].double() - ref[keep].double()).norm() / ref[keep].double().norm()).item()

    out["hf_sdpa_ms"] = do_bench(run(base), warmup=25, rep=200, return_mode="median")
    out["hf_sdpa_launches_per_layer"] = round(E.launches(run(base)) / L, 1)
    variants = {"packed_eager": {}, "packed_graphs": {"cuda_graphs": True},
                "padded_graphs": {"cuda_graphs": True, "pack_padding": False}}
    if "--ops" in sys.argv:
        variants = {"packed_eager": {}}
    for name, kw in variants.items():
        t0 = time.perf_counter()
        conv = opsadv.convert_model(copy.deepcopy(base), validate="warn", **kw)
        torch.cuda.synchronize()
        r = {"convert_s": round(time.perf_counter() - t0, 2), "options": kw,
             "validation": {k: v for k, v in (conv.opsadv_report.validation or {}).items() if k != "limits"}}
        f = run(conv)
        r["err"] = err(f())
        r["ms"] = do_bench(f, warmup=25, rep=200, return_mode="median")
        r["launches_per_layer"] = round(E.launches(f) / L, 1)
        if "--ops" in sys.argv:
            r["ops"] = op_table(f)
            for row in r["ops"]:
                print(f"  {row['gpu_ms']:8.3f} ms {row['count']:4d}x {row['op']:40s} {row['shapes']}", flush=True)
        if "graphs" in name:
            r["gpu_total_ms"], r["top"] = top_kernels(f)
            # a second mask (other lengths): a new bucket or a replay with new values, still exact
            am2 = am.clone()
            am2[:, s // 2:] = 0
            y2 = run(conv, am2)()
            ref2 = run(base, am2)()
            k2 = am2.bool()
            r["err_mask2"] = ((y2[k2].double() - ref2[k2].double()).norm() / ref2[k2].double().norm()).item()
            r["pad_zero_mask2"] = bool((y2[~k2] == 0).all())
            r["err_again"] = err(f())
            r["graphs"] = str(conv.opsadv_graphs)
        out[name] = r
        print(name, json.dumps(r)[:600], flush=True)
        del conv, f
        torch.cuda.empty_cache()
    if "--compile" in sys.argv:
        comp = torch.compile(base)
        t0 = time.perf_counter()
        run(comp)()
        out["compile_s"] = round(time.perf_counter() - t0, 1)
        out["torch_compile_ms"] = do_bench(run(comp), warmup=25, rep=200, return_mode="median")
    out["hf_sdpa_ms_after"] = do_bench(run(base), warmup=25, rep=200, return_mode="median")
    print(json.dumps(out, indent=1))
    paths = [a for a in sys.argv[1:] if not a.startswith("--")]
    if paths:
        with open(paths[0], "w") as fh:
            json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
