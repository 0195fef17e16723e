"""Where does padded BERT-base (b32 s512, ~25% padding) spend its time under opsadv?

Times, on the GPU, with do_bench: transformers sdpa (the peer), opsadv's conversion with padded
encoders on the varlen sparse_attention path (default), and the same conversion with the masked
dense flash_attention path; prints the top CUDA kernels of each opsadv variant.

    PYTHONPATH=. python3 benchmarks/bert_probe.py [OUT.json]
"""
from __future__ import annotations

import json
import sys

import torch
from triton.testing import do_bench

import opsadv
from opsadv.bench import suite_e2e as E
from opsadv.convert import hf_attention


def top_kernels(fn, n=8):
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    rows = sorted(((e.key, e.device_time_total / 1e3, e.count) for e in prof.key_averages()), key=lambda r: -r[1])
    return [{"kernel": k[:90], "ms": round(ms, 3), "count": c} for k, ms, c in rows[:n]]


def main():
    out = {}
    b, s = E.BERT_SHAPE
    base = E._build("bert", "cuda")
    g = torch.Generator().manual_seed(0)
    lens = torch.randint(int(0.4 * s), s + 1, (b,), generator=g)
    am = (torch.arange(s)[None, :] < lens[:, None]).long().cuda()
    ids = torch.randint(0, E.BERT["vocab_size"], (b, s), device="cuda")
    out["padding_fraction"] = round(1 - am.float().mean().item(), 3)
    extra: dict = {}
    conv = E._convert(base, extra, None)

    def run(m):
        def f():
            with torch.no_grad():
                return m(input_ids=ids, attention_mask=am).last_hidden_state
        return f

    ref = run(base)()
    keep = am.bool()

    def err(y):
        return ((y[keep].double() - ref[keep].double()).norm() / ref[keep].double().norm()).item()

    out["hf_sdpa_ms"] = do_bench(run(base), warmup=25, rep=100, return_mode="median")
    out["varlen_ms"] = do_bench(run(conv), warmup=25, rep=100, return_mode="median")
    out["varlen_err"] = err(run(conv)())
    out["varlen_top"] = top_kernels(run(conv))
    orig = hf_attention._varlen_layout
    hf_attention._varlen_layout = lambda *a, **k: None          # padded batches -> masked dense flash_attention
    try:
        with opsadv.trace() as t:
            run(conv)()
        out["masked_impls"] = dict(t.counts)
        out["masked_ms"] = do_bench(run(conv), warmup=25, rep=100, return_mode="median")
        out["masked_err"] = err(run(conv)())
        out["masked_top"] = top_kernels(run(conv))
    finally:
        hf_attention._varlen_layout = orig
    out["hf_top"] = top_kernels(run(base))
    print(json.dumps(out, indent=1))
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
