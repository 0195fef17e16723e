"""Find what fails in the e2e case "decode ... static graphs" on a GPU: each contender in its own process
(an illegal memory access kills the CUDA context), with CUDA_LAUNCH_BLOCKING=1, a few steps each, then a
check of its logits against transformers eager on a StaticCache.

  PYTHONPATH=. python benchmarks/static_graph_debug.py [conv|conv_eager|base|compiled] ...

Prints per contender: ok / the exception, the transformers version and whether its StaticLayer keeps a
device-side write position (cumulative_length), and, for conv, the impls the converted model ran."""
from __future__ import annotations

import os
import subprocess
import sys
import traceback

STEPS = 12


def one(name: str) -> None:
    import torch
    import transformers as tf

    import opsadv
    from opsadv.bench import suite_e2e as E
    print(f"[{name}] transformers {tf.__version__}; StaticLayer has cumulative_length:",
          "cumulative_length" in tf.cache_utils.StaticLayer.__init__.__code__.co_names, flush=True)
    b, cached = E.DECODE
    base = E._build("llama", "cuda")
    key = E._cache_key(base)
    ids = torch.randint(0, E.LLAMA["vocab_size"], (b, cached), device="cuda")
    tok = torch.randint(0, E.LLAMA["vocab_size"], (b, 1), device="cuda")
    model = {"base": lambda: base, "compiled": lambda: torch.compile(base, mode="reduce-overhead"),
             "conv": lambda: E._convert(base, {}, None, cuda_graphs=True),
             "conv_eager": lambda: E._convert(base, {}, None)}[name]()
    ref_cache = tf.StaticCache(config=base.config, max_cache_len=cached + 64)
    cache = tf.StaticCache(config=base.config, max_cache_len=cached + 64)
    with torch.no_grad():
        base(input_ids=ids, use_cache=True, logits_to_keep=1, **{key: ref_cache})
        model(input_ids=ids, use_cache=True, logits_to_keep=1, **{key: cache})
        torch.cuda.synchronize()
        print(f"[{name}] prefill ok", flush=True)
        with opsadv.trace() as tr:
            for step in range(STEPS):
                want = base(input_ids=tok, use_cache=True, **{key: ref_cache}).logits.float()
                got = model(input_ids=tok, use_cache=True, **{key: cache}).logits.float()
                torch.cuda.synchronize()
                err = ((got - want).norm() / want.norm()).item()
                print(f"[{name}] step {step} rel err {err:.3g}", flush=True)
    if name.startswith("conv"):
        print(f"[{name}] impls (eager steps only; a replay calls none):\n{tr}")


if __name__ == "__main__":
    names = sys.argv[1:] or ["conv", "conv_eager", "base", "compiled"]
    if len(names) == 1 and os.environ.get("_STATIC_DEBUG_CHILD"):
        try:
            one(names[0])
        except Exception:
            traceback.print_exc()
            sys.exit(1)
        sys.exit(0)
    for n in names:
        env = dict(os.environ, _STATIC_DEBUG_CHILD="1", CUDA_LAUNCH_BLOCKING="1")
        r = subprocess.run([sys.executable, __file__, n], env=env, capture_output=True, text=True, timeout=240)
        print(f"==== {n}: rc {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-4000:]}", flush=True)
