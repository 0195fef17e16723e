"""Host-side profile of one Llama decode step (the e2e suite's case: 1.1B, b8, 2047 cached tokens):
converted vs transformers sdpa eager.  Per model: wall per step (synchronized), host enqueue time per
step, then cProfile over 10 steps (tottime top 35; cumulative top 30 for the converted model).  Also
torch.profiler's self-CPU table of one step per model, which separates aten dispatch from Python.

    PYTHONPATH=. python3 benchmarks/decode_profile.py [OUT.txt]
    DECODE_MODE=timing ...   only: loop vs the e2e suite's do_bench timing, before / after a torch.profiler
                             launch count
    DECODE_PRE=compile ...   first torch.compile the base model and run one b8 s2048 prefill through it
                             (what the e2e suite's prefill case does before its decode case)
"""
from __future__ import annotations

import cProfile
import io
import os
import pstats
import sys
import time

import torch

from opsadv.bench import suite_e2e as E

sys.path.insert(0, os.path.dirname(__file__))
from host_cost import b2b as b2b_us  # noqa: E402  (back-to-back wall µs per call)


def _state() -> str:
    """What decides our ops' eager fast path (opsadv.core.ops._common.eager_mode), and the threads alive."""
    import threading
    from opsadv.core.ops._common import eager_mode
    x = torch.zeros(1, device="cuda")
    return (f"torch_function_mode={torch._C._is_torch_function_mode_enabled()} "
            f"dispatch_stack={torch._C._len_torch_dispatch_stack()} eager_mode={eager_mode(x)} "
            f"threads={threading.active_count()} grad={torch.is_grad_enabled()}")


def _timing_order(conv, base, key, ids, tok, lines):
    """Does the way the e2e suite times (do_bench in interleaved rounds) or its torch.profiler launch
    count before timing change the decode step's cost?  Loop and bench timings before and after it."""
    from opsadv.bench.runner import time_interleaved
    from opsadv.bench.suite_e2e import launches
    steps = {}
    with torch.no_grad():
        for name, m in (("opsadv", conv), ("hf_sdpa", base)):
            cache = getattr(m(input_ids=ids, use_cache=True), key)

            def step(m=m, cache=cache):
                with torch.no_grad():
                    out = m(input_ids=tok, use_cache=True, **{key: cache}).logits
                cache.crop(-1)
                return out
            steps[name] = step

    def loop(fn):
        return b2b_us(fn, n=20) / 1e3          # ms per step, back to back, one sync
    for phase in ("before profiler", "after profiler"):
        if phase == "after profiler":
            for f in steps.values():
                launches(f)
        lp = {n: round(loop(f), 3) for n, f in steps.items()}
        bench = {n: round(v, 3) for n, v in time_interleaved(steps).items()}
        lines.append(f"{phase}: loop ms/step {lp} | time_interleaved {bench} | "
                     f"speedup loop {lp['hf_sdpa'] / lp['opsadv']:.3f} bench {bench['hf_sdpa'] / bench['opsadv']:.3f}")


def main():
    b, cached = E.DECODE
    base = E._build("llama", "cuda")
    conv = E._convert(base, {}, None)
    key = E._cache_key(base)
    ids = torch.randint(0, E.LLAMA["vocab_size"], (b, cached), device="cuda")
    tok = torch.randint(0, E.LLAMA["vocab_size"], (b, 1), device="cuda")
    lines = []
    if os.environ.get("DECODE_PRE") == "compile":
        compiled = torch.compile(base)
        with torch.no_grad():
            compiled(input_ids=torch.randint(0, E.LLAMA["vocab_size"], E.PREFILL, device="cuda"),
                     logits_to_keep=1, use_cache=False)
        torch.cuda.synchronize()
        lines.append("after torch.compile prefill: " + _state())
    lines.append("state: " + _state())
    if os.environ.get("DECODE_MODE") == "timing":
        _timing_order(conv, base, key, ids, tok, lines)
        print("\n".join(lines))
        if len(sys.argv) > 1:
            open(sys.argv[1], "w").write("\n".join(lines))
        return
    for name, m in (("opsadv", conv), ("hf_sdpa", base)):
        with torch.no_grad():
            cache = getattr(m(input_ids=ids, use_cache=True), key)

            def step():
                m(input_ids=tok, use_cache=True, **{key: cache})
                cache.crop(-1)
            for _ in range(5):
                step()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(20):
                step()
            host = (time.perf_counter() - t0) / 20
            torch.cuda.synchronize()
            wall = (time.perf_counter() - t0) / 20
            lines.append(f"{name}: host {host * 1e3:.2f} ms/step (enqueue), wall {wall * 1e3:.2f} ms/step")
            pr = cProfile.Profile()
            pr.enable()
            for _ in range(10):
                step()
            pr.disable()
            torch.cuda.synchronize()
            from torch.profiler import ProfilerActivity, profile
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                step()
                torch.cuda.synchronize()
        sio = io.StringIO()
        pstats.Stats(pr, stream=sio).sort_stats("tottime").print_stats(35)
        lines.append(sio.getvalue())
        if name == "opsadv":
            sio = io.StringIO()
            pstats.Stats(pr, stream=sio).sort_stats("cumulative").print_stats(30)
            lines.append(sio.getvalue())
        lines.append(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))
        lines.append(prof.key_averages().table(sort_by="self_device_time_total", row_limit=15))
    text = "\n".join(lines)
    print("\n".join(x for x in lines if x.startswith(("opsadv:", "hf_sdpa:", "state", "after", "before"))))
    if len(sys.argv) > 1:
        open(sys.argv[1], "w").write(text)


if __name__ == "__main__":
    main()
