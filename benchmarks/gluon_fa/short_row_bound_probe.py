"""What rows of ~9 key tiles cost a dense kernel with no masks at all: the yardstick for issue 5's two w1024 targets
(effective rate >= 0.85x our dense causal kernel; >= 30x SDPA with the dense mask, i.e. <= ~0.48 ms).

An item of the s16384 w1024 causal window is 128 query rows x ~9 key tiles (two of them masked).  The same work with
no masking is dense non-causal attention at s = 1152 = 9 x 128 (every query tile visits 9 full key tiles, K / V
shared by the 9 query tiles of a head, as the window shares them along the band): b14 h32 s1152 d128 bf16 has
4032 such items against the window's 4096.  Timed in interleaved rounds, each kernel's TFLOP/s on those short rows
next to its rate on long rows (s16384 causal and non-causal) says how much of a row's fixed cost (first S + softmax
with nothing to hide under, the last P V, the epilogue) the best kernels on this GPU pay at 9 tiles:
  ours_gluon / ours_triton (our dense kernels through the op, pinned), cudnn and flash (SDPA's backends), and our
  sparse op at w1024 (the suite's row) with SDPA-with-dense-mask (the suite's peer, one call per round).

  PYTHONPATH=. python benchmarks/gluon_fa/short_row_bound_probe.py OUT.json [rounds]"""
from __future__ import annotations

import contextlib
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

import opsadv  # noqa: E402
from _sparse_windows import D, H, S, ms, report_header, window_case  # noqa: E402

SHORT_B, SHORT_S = 14, 1152       # 14 x 32 heads x 9 query tiles = 4032 items of 9 full key tiles


def _qkv(b: int, s: int):
    g = torch.Generator(device="cuda").manual_seed(0)
    return tuple(torch.randn(b, H, s, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))


def _ours(impl: str, q, k, v, causal: bool):
    """(context, call): the backend context is entered once around a kernel's timing, not per call (entered per
    call it made this probe's first run host-bound: results/short_row_bound_s23a_h200.json)."""
    return (lambda: opsadv.use_backend("cuda", impls={"flash_attention": impl}),
            lambda: opsadv.ops.flash_attention(q, k, v, causal=causal))


def _sdpa(backend, q, k, v, causal: bool, mask=None):
    """(context, call); backend None: SDPA's own choice, as the suite's sdpa_masked peer."""
    return (lambda: contextlib.nullcontext() if backend is None else sdpa_kernel(backend),
            lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal, attn_mask=mask))


def _interleaved(entries: dict, rounds: int) -> dict:
    """{name: [ms per round]}: each kernel timed once per round inside its context, rounds interleaved."""
    times = {name: [] for name in entries}
    for _ in range(rounds):
        for name, (ctx, fn) in entries.items():
            with ctx(), torch.no_grad():
                times[name].append(ms(fn))
    return times


def main(path: str, rounds: int) -> None:
    short, long_ = _qkv(SHORT_B, SHORT_S), _qkv(1, S)
    work = {"short": 4.0 * SHORT_B * H * SHORT_S * SHORT_S * D,           # non-causal: every tile full
            "long_causal": 4.0 * H * S * S * D / 2,                        # the suite's count (causal half)
            "long_full": 4.0 * H * S * S * D}
    lay, _, _, _, w_work = window_case(1024)
    kernels = {"ours_gluon": "cuda.gluon.flash_attention", "ours_triton": "cuda.triton.flash_attention"}
    fns, work_of = {}, {}
    for name, impl in kernels.items():
        fns[f"{name} short"], work_of[f"{name} short"] = _ours(impl, *short, False), work["short"]
        fns[f"{name} long_causal"], work_of[f"{name} long_causal"] = _ours(impl, *long_, True), work["long_causal"]
        fns[f"{name} long_full"], work_of[f"{name} long_full"] = _ours(impl, *long_, False), work["long_full"]
    for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
        fns[f"{name} short"], work_of[f"{name} short"] = _sdpa(backend, *short, False), work["short"]
        fns[f"{name} long_causal"], work_of[f"{name} long_causal"] = _sdpa(backend, *long_, True), work["long_causal"]
        fns[f"{name} long_full"], work_of[f"{name} long_full"] = _sdpa(backend, *long_, False), work["long_full"]

    fns["ours_sparse w1024"] = (lambda: opsadv.use_backend("cuda"), lambda: opsadv.ops.sparse_attention(*long_, lay))
    work_of["ours_sparse w1024"] = w_work
    dense_mask = lay.dense_mask(device="cuda")
    fns["sdpa_masked w1024"] = _sdpa(None, *long_, False, dense_mask)
    work_of["sdpa_masked w1024"] = w_work

    ok = {}
    for name, (ctx, fn) in fns.items():                                     # compile / tune, and drop what fails
        try:
            with ctx(), torch.no_grad():
                fn()
            ok[name] = (ctx, fn)
        except Exception as exc:                                            # noqa: BLE001 -- reported per kernel
            print(f"{name}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
    torch.cuda.synchronize()
    times = _interleaved(ok, rounds)
    report = {**report_header(), "rounds": rounds, "short_shape": f"b{SHORT_B} h{H} s{SHORT_S} d{D} non-causal",
              "rows": []}
    for name, ts in times.items():
        med = statistics.median(ts)
        report["rows"].append({"kernel": name, "ms_median": round(med, 4), "ms_rounds": [round(t, 4) for t in ts],
                               "tflops": round(work_of[name] / med / 1e9, 1)})
    rate = {r["kernel"]: r["tflops"] for r in report["rows"]}
    summary = {}
    for k in ("ours_gluon", "ours_triton", "cudnn", "flash"):
        if f"{k} short" in rate:
            summary[k] = {"short_vs_long_causal": round(rate[f"{k} short"] / rate.get(f"{k} long_causal", float("nan")), 3),
                          "short_vs_long_full": round(rate[f"{k} short"] / rate.get(f"{k} long_full", float("nan")), 3),
                          "short_vs_ours_gluon_long_causal": round(
                              rate[f"{k} short"] / rate.get("ours_gluon long_causal", float("nan")), 3)}
    if "ours_sparse w1024" in rate and "ours_gluon long_causal" in rate:
        summary["ours_sparse_w1024_vs_ours_gluon_long_causal"] = round(
            rate["ours_sparse w1024"] / rate["ours_gluon long_causal"], 3)
    med = {r["kernel"]: r["ms_median"] for r in report["rows"]}
    if "ours_sparse w1024" in med and "sdpa_masked w1024" in med:
        summary["sdpa_masked_over_ours_sparse_w1024"] = round(med["sdpa_masked w1024"] / med["ours_sparse w1024"], 2)
        summary["ms_needed_for_30x"] = round(med["sdpa_masked w1024"] / 30, 4)
    report["summary"] = summary
    for r in report["rows"]:
        print(json.dumps(r), flush=True)
    print(json.dumps(summary, indent=1), flush=True)
    with open(path, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 5)
