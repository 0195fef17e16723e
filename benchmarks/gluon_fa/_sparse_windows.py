"""What the Gluon sparse forward probes share (sparse_trace_probe.py): s16384 d128 bf16
b1 h32 inputs, the Gluon dense causal forward as the issue's effective-rate denominator, one causal window case,
interleaved timing rounds, and the work of the visited tiles (bench.suite_sparse.fwd_tiles, the suite's count)."""
from __future__ import annotations

import os
import sys

import torch
from triton.testing import do_bench

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import opsadv  # noqa: E402
from opsadv import SparseLayout  # noqa: E402
from opsadv.backends.cuda.sparse_attention import gluon as GS  # noqa: E402
from opsadv.bench.suite_sparse import fwd_tiles  # noqa: E402

S, H, D = 16384, 32, 128


def ms(fn, rep: int = 80) -> float:
    """Median ms of triton.testing.do_bench (L2 flushed between calls)."""
    return float(do_bench(fn, warmup=10, rep=rep, return_mode="median"))


def inputs():
    """q, k, v (1, H, S, D) bf16, seeded."""
    g = torch.Generator(device="cuda").manual_seed(0)
    return tuple(torch.randn(1, H, S, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))


def report_header() -> dict:
    return {"commit": os.environ.get("OPSADV_COMMIT", "unknown"), "device": torch.cuda.get_device_name(),
            "torch": torch.__version__, "shape": f"b1 h{H} s{S} d{D} bf16 causal windows"}


def dense_baseline(q, k, v, rep: int = 80) -> tuple[float, float]:
    """(ms, TFLOP/s) of the Gluon dense causal forward through the op."""
    with opsadv.use_backend("cuda", impls={"flash_attention": "cuda.gluon.flash_attention"}), torch.no_grad():
        dense = ms(lambda: opsadv.ops.flash_attention(q, k, v, causal=True), rep)
    return dense, 4.0 * H * S * S * D / 2 / dense / 1e9


def window_case(w: int):
    """(layout, sparse_fwd's layout arguments, tile index, n_m, FLOPs of the visited tiles) of a causal window."""
    lay = SparseLayout.sliding_window(S, w, causal=True, block_size=128, device="cuda")
    args = (lay.block_mask, lay.key_padding_mask, lay.cu_seqlens, lay.block_size, lay.causal, lay.window_left,
            lay.window_right, lay.num_global)
    visited, total = fwd_tiles(lay, D)
    return lay, args, GS.layout_index(*args, S, S), S // GS.TILE, 4.0 * H * S * S * D * visited / total


def interleaved(fns: dict, rounds: int, rep: int = 80) -> dict:
    """{name: [ms per round]}: every fn timed once per round, rounds interleaved (drift hits all alike)."""
    times = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            times[name].append(ms(fn, rep))
    return times
