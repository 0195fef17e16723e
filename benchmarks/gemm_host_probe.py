"""Where does the gemm op's extra time go?  Session 10's PART=gk timed opsadv.ops.gemm pinned to
cuda.gluon.gemm 0.16-0.27 ms slower per call than the impl's gemm_fwd called directly when each call is timed
alone (event, call, event, synchronize), and even with them under do_bench (calls queued back to back): a
host-side cost, or a GPU-side one (an extra kernel)?  This prints, per shape:
  host_us   host time per call with the GPU kept busy ahead (benchmarks/host_cost.host_us), and
  kernels   the CUDA kernels one call launches (torch.profiler), with their GPU time,
for: gemm_fwd direct (the coop schedule), the op pinned to the Gluon impl, the op as dispatched, and
torch._addmm_activation; then a cProfile of the pinned op's host path.

    PYTHONPATH=. python3 benchmarks/gemm_host_probe.py OUT.txt
"""
from __future__ import annotations

import sys

import torch

import opsadv
from opsadv.backends.cuda import gluon_gemm as GG

sys.path.insert(0, "benchmarks")
from host_cost import host_us, profile_text  # noqa: E402


def kernels(fn) -> list[str]:
    """The CUDA kernels one call of fn launches: name and GPU microseconds."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [f"{e.key[:70]:70} x{e.count} {e.device_time_total:9.1f} us"
            for e in prof.key_averages() if e.device_time_total > 0]


def main(path: str) -> None:
    lines = []
    dt = torch.bfloat16
    for m, n, k in [(16384, 12288, 4096), (16, 4096, 4096)]:
        torch.manual_seed(0)
        a = torch.randn(m, k, device="cuda", dtype=dt)
        w = torch.randn(n, k, device="cuda", dtype=dt) * k ** -0.5      # nn.Linear weight (N, K)
        b = w.t()
        bias = torch.randn(n, device="cuda", dtype=dt)

        def direct():
            return GG.gemm_fwd(None, a, b, bias, "gelu_tanh", None, 1.0, variant="coop")

        def op():
            with torch.no_grad():
                return opsadv.ops.gemm(a, b, bias=bias, activation="gelu_tanh")

        def peer():
            return torch._addmm_activation(bias, a, b, use_gelu=True)

        lines.append(f"== M={m} N={n} K={k} bias+gelu_tanh, B = weight.t()")
        with opsadv.use_backend("cuda", autotune=True, impls={"gemm": GG.IMPL_ID}):
            pinned = {"direct gemm_fwd(coop)": direct, "op pinned to gluon": op}
            for name, fn in pinned.items():
                lines.append(f"{name:28} host {host_us(fn):8.1f} us")
                lines += ["    " + x for x in kernels(fn)]
            prof = profile_text(op, 200, 25, sort="cumtime", busy_gpu=True)
        with opsadv.use_backend("cuda", autotune=True):
            op()
            with torch.no_grad():
                chosen = opsadv.explain("gemm", a, b, bias=bias, activation="gelu_tanh").chosen
            lines.append(f"{'op dispatched':28} host {host_us(op):8.1f} us  ({chosen})")
            lines += ["    " + x for x in kernels(op)]
        tuner = GG._variant_tuner()
        for key, cfg in tuner.best.items():
            if key[2] == n and key[3] == k:
                names = [{"variant": v} for v in GG.VARIANTS]
                lines.append(f"variant picked for {key}: {cfg['variant']}  times (ms) "
                             + str({names[i]['variant'] if i < len(names) else i: round(t, 4)
                                    for i, t in tuner.times.get(key, {}).items()}))
        lines.append(f"{'torch._addmm_activation':28} host {host_us(peer):8.1f} us")
        lines += ["    " + x for x in kernels(peer)]
        lines.append("cProfile of 200 pinned op calls (cumtime):")
        lines.append(prof)
        print("\n".join(lines[-12:]), flush=True)
    with open(path, "w") as f:
        f.write("\n".join(lines))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "/tmp/gemm_host_probe.txt")
