"""Host-side (Python) profile of one forward of the converted padded BERT-base (b32 s512): where
the CPU time of a host-bound forward goes.  cProfile over N forwards after warm-up, plus the wall
time per forward with and without a synchronize.

    PYTHONPATH=. python3 benchmarks/host_profile.py [OUT.txt]
"""
from __future__ import annotations

import cProfile
import io
import pstats
import sys
import time

import torch

from opsadv.bench import suite_e2e as E


def main():
    b, s = E.BERT_SHAPE
    base = E._build("bert", "cuda")
    g = torch.Generator().manual_seed(0)
    lens = torch.randint(int(0.4 * s), s + 1, (b,), generator=g)
    am = (torch.arange(s)[None, :] < lens[:, None]).long().cuda()
    ids = torch.randint(0, E.BERT["vocab_size"], (b, s), device="cuda")
    conv = E._convert(base, {}, None)
    lines = []
    for name, m in (("opsadv", conv), ("hf_sdpa", base)):
        with torch.no_grad():
            for _ in range(5):
                m(input_ids=ids, attention_mask=am)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(20):
                m(input_ids=ids, attention_mask=am)
            host = (time.perf_counter() - t0) / 20
            torch.cuda.synchronize()
            wall = (time.perf_counter() - t0) / 20
            lines.append(f"{name}: host {host * 1e3:.2f} ms/forward (enqueue), wall {wall * 1e3:.2f} ms/forward")
            pr = cProfile.Profile()
            pr.enable()
            for _ in range(10):
                m(input_ids=ids, attention_mask=am)
            pr.disable()
            torch.cuda.synchronize()
        sio = io.StringIO()
        pstats.Stats(pr, stream=sio).sort_stats("tottime").print_stats(30)
        lines.append(sio.getvalue())
        if name == "opsadv":
            sio = io.StringIO()
            pstats.Stats(pr, stream=sio).sort_stats("cumulative").print_stats(45)
            lines.append(sio.getvalue())
    text = "\n".join(lines)
    print(text[:6000])
    if len(sys.argv) > 1:
        open(sys.argv[1], "w").write(text)


if __name__ == "__main__":
    main()
