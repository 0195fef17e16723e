"""Which tensors are alive at the activation peak of one forward?  Replays the CUDA caching
allocator's trace (torch.cuda.memory._record_memory_history) of one prefill of the converted
Llama 1.1B (jetson profile, mem_opt=3; b1 s8192, last-token logits) and of the transformers sdpa
model, and prints the live blocks at the peak with the Python line that allocated each.

    PYTHONPATH=. python3 benchmarks/memory_trace_probe.py [--seq 8192] [--json OUT]
"""
from __future__ import annotations

import argparse
import copy
import gc
import json

import torch

import opsadv

MIB = 1 << 20


def build(seq):
    import transformers
    cfg = transformers.LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                                   num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=max(seq, 8192))
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device("cuda"):
        m = transformers.LlamaForCausalLM(cfg)
    return m.to(torch.bfloat16).eval(), cfg


def frame_of(ev) -> str:
    for f in ev.get("frames", []):
        fn = f.get("filename", "")
        if fn.endswith(".py") and "torch/cuda/memory" not in fn and "torch/utils" not in fn:
            return f"{fn.split('site-packages/')[-1].replace('/work/main/', '')}:{f.get('line')} {f.get('name')}"
    return "?"


def live_at_peak(fn):
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(max_entries=200000)
    with torch.no_grad():
        fn()
    torch.cuda.synchronize()
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    live: dict[int, tuple[int, str]] = {}
    cur = peak = 0
    peak_set: dict = {}
    for trace in snap["device_traces"]:
        for ev in trace:
            if ev["action"] == "alloc":
                live[ev["addr"]] = (ev["size"], frame_of(ev))
                cur += ev["size"]
                if cur > peak:
                    peak, peak_set = cur, dict(live)
            elif ev["action"] in ("free_requested", "free") and ev["addr"] in live:
                if ev["action"] == "free_requested":
                    cur -= live.pop(ev["addr"])[0]
    rows: dict[str, list] = {}
    for size, where in peak_set.values():
        r = rows.setdefault(where, [0, 0])
        r[0] += size
        r[1] += 1
    top = sorted(rows.items(), key=lambda kv: -kv[1][0])[:20]
    return {"peak_mib": round(peak / MIB, 1),
            "live": [{"where": w, "mib": round(s / MIB, 1), "n": n} for w, (s, n) in top]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    base, cfg = build(a.seq)
    ids = torch.randint(0, cfg.vocab_size, (1, a.seq), device="cuda")
    run = lambda m: (lambda: m(input_ids=ids, use_cache=False, logits_to_keep=1).logits)  # noqa: E731
    out = {"hf_sdpa": live_at_peak(run(base))}
    opsadv.use_backend("cuda", profile="jetson")
    conv = opsadv.convert_model(copy.deepcopy(base), mem_opt=3, validate=False)
    del base
    with torch.no_grad():
        conv(input_ids=ids, use_cache=False, logits_to_keep=1)
    out["opsadv_jetson_mem3"] = live_at_peak(run(conv))
    print(json.dumps(out, indent=1))
    if a.json:
        json.dump(out, open(a.json, "w"), indent=1)


if __name__ == "__main__":
    main()
