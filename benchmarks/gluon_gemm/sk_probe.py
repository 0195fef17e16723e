"""Stream-K A/B on an H100/H200: each Gluon GEMM / SwiGLU schedule against its stream-K twin (coop vs coop_sk,
coop_tanh vs coop_tanh_sk) at the gemm suite's shapes, the kernels called directly (no dispatch), with
triton.testing.do_bench (L2 flushed between calls, median), plus cuBLAS (torch.matmul / the eager SwiGLU:
one matmul over [W_g | W_u], chunk, silu * mul) for scale.  Every output is checked against torch first.

  PYTHONPATH=. python benchmarks/gluon_gemm/sk_probe.py OUT.json

Each case times its variants in ROUNDS interleaved rounds (A B A B ...: clock and power drift hit both alike);
"ratio_sk_<base>" = the median over rounds of base ms / stream-K ms (> 1: stream-K wins), "<v>_ms" the median ms.
SK_SHAPES / SK_EPILOGUES (comma lists) narrow the grid.  Written after every row (a killed run keeps them)."""
from __future__ import annotations

import json
import os
import statistics
import sys

import torch
import torch.nn.functional as F
from triton.testing import do_bench

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from opsadv.backends.cuda import gluon_gemm as GG, gluon_swiglu_gemm as GS  # noqa: E402

SHAPES = ((8192, 8192, 8192), (16384, 12288, 4096), (16384, 11008, 4096), (16384, 4096, 11008))
PAIRS = {"gemm": (("coop", "coop_sk"), ("coop_tanh", "coop_tanh_sk")),
         "swiglu": (("coop", "coop_sk"), ("coop_tanh", "coop_tanh_sk"))}
EPILOGUES = os.environ.get("SK_EPILOGUES", "none,silu,gelu_tanh,swiglu").split(",")
if os.environ.get("SK_SHAPES"):            # e.g. SK_SHAPES=0,3
    SHAPES = tuple(SHAPES[int(i)] for i in os.environ["SK_SHAPES"].split(","))
ROUNDS = int(os.environ.get("SK_ROUNDS", "5"))


def ms(fn) -> float:
    return float(do_bench(fn, warmup=10, rep=60, return_mode="median"))


def rel_err(x, ref) -> float:
    return float((x.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30))


def main(path: str) -> None:
    rows = []
    report = {"commit": os.environ.get("OPSADV_COMMIT", "unknown"), "device": torch.cuda.get_device_name(),
              "torch": torch.__version__, "rows": rows}
    dt = torch.bfloat16
    for m, n, k in SHAPES:
        g = torch.Generator(device="cuda").manual_seed(0)
        a = torch.randn(m, k, device="cuda", dtype=dt, generator=g)
        for ep in EPILOGUES:
            cols = 2 * n if ep == "swiglu" else n
            w = (torch.randn(cols, k, device="cuda", dtype=dt, generator=g) / k ** 0.5).t()   # nn.Linear weight.t()
            bias = None if ep in ("none", "swiglu") else torch.randn(n, device="cuda", dtype=dt, generator=g)
            if ep == "swiglu":
                def peer():
                    gg, u = (a @ w).chunk(2, dim=-1)
                    return F.silu(gg) * u

                def run(v):
                    return lambda: GS.swiglu_gemm_fwd(None, a, w, None, variant=v)
            else:
                act = {"none": lambda y: y, "silu": F.silu, "gelu_tanh": lambda y: F.gelu(y, approximate="tanh")}[ep]

                def peer():
                    return act(torch.addmm(bias, a, w)) if bias is not None else a @ w

                def run(v, ep=ep):
                    return lambda: GG.gemm_fwd(None, a, w, bias, ep, None, 1.0, variant=v)
            ref = peer()
            flops = 2.0 * m * cols * k
            row = {"case": f"m{m} n{n} k{k} {ep}"}
            pairs = [(b_, s_) for b_, s_ in PAIRS["swiglu" if ep == "swiglu" else "gemm"]
                     if not ("tanh" in b_ and ep == "none")]
            fns = {"peer": peer}
            for v in [v for pair in pairs for v in pair]:
                row[f"{v}_err"] = rel_err(run(v)(), ref)
                if row[f"{v}_err"] < 2e-2:
                    fns[v] = run(v)
            times = {name: [] for name in fns}
            for _ in range(ROUNDS):
                for name, fn in fns.items():
                    times[name].append(ms(fn))
            row["peer_ms"] = statistics.median(times["peer"])
            for name in fns:
                row[f"{name}_ms"] = statistics.median(times[name])
                row[f"{name}_tflops"] = round(flops / row[f"{name}_ms"] / 1e9, 1)
            for b_, s_ in pairs:
                if b_ in fns and s_ in fns:
                    row[f"ratio_sk_{b_}"] = round(statistics.median(x / y for x, y in zip(times[b_], times[s_])), 4)
                    row[f"ratio_sk_{b_}_range"] = [round(min(x / y for x, y in zip(times[b_], times[s_])), 4),
                                                   round(max(x / y for x, y in zip(times[b_], times[s_])), 4)]
            row["peer_tflops"] = round(flops / row["peer_ms"] / 1e9, 1)
            rows.append(row)
            print(json.dumps(row), flush=True)
            with open(path, "w") as f:
                json.dump(report, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "sk_probe.json")
