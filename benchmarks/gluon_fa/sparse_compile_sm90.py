"""Compile the Gluon block-sparse forward (opsadv/backends/cuda/sparse_attention/gluon_kernel.py) for sm_90 on a
CPU-only machine (no GPU): one launch per mask mode, from real launch arguments on CPU tensors.  Prints a
JSON report per case: shared memory, spill instructions (STL/LDL) in all and inside the K/V tile loops.

  PYTHONPATH=. python benchmarks/gluon_fa/sparse_compile_sm90.py [OUT_DIR] [--masked]   (OUT_DIR gets .ptx/.sass)

Cases: every mask mode with the default schedule, then the new schedules of cuda/sparse_attention/gluon.py VARIANTS on the
timed layouts (--masked: also on block-mask / global-token layouts).  "stack" and "setmaxnreg" (the
per-partition register counts) come from the cubin / SASS.

Run without TRITON_INTERPRET (under it gluon.jit functions are interpreter objects); tests/test_gluon_sparse.py
runs it in a subprocess."""
from __future__ import annotations

import json
import os
import re
import sys


def _compile_helpers():
    """compile_sm90.py next to this file (imported when used: importing it compiles nothing, but it
    imports Triton and drops TRITON_INTERPRET, which a test process that only parses SASS must keep)."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import compile_sm90
    return compile_sm90


def tile_loop_spills(sass: str) -> tuple[int, int, int]:
    """(spill instructions in all, inside the K/V tile loops, number of tile loops).  A tile loop is a
    predicated backward branch whose body issues exactly one S = Q K^T wgmma group (the first HGMMA of a
    group reads the accumulator as zero: 'RZ, !UPT'); the persistent item loop around them holds several,
    and the unconditional branches back from the out-of-line mbarrier wait paths are not loops."""
    ins = []          # (address, text) parsed here: a test process imports this module and must keep TRITON_INTERPRET
    for line in sass.splitlines():
        m = re.match(r"\s*/\*([0-9a-f]+)\*/\s+(.*?);", line)
        if m:
            ins.append((int(m.group(1), 16), m.group(2)))
    spill_pc = [pc for pc, t in ins if re.search(r"\b(?:STL|LDL)\b", t)]
    s_start = [pc for pc, t in ins if t.startswith("HGMMA") and "RZ, !UPT" in t]
    loops = []
    for pc, t in ins:
        m = re.match(r"@!?U?P\d\s+BRA\s+(?:`\()?0x([0-9a-f]+)", t)
        if m and int(m.group(1), 16) < pc:
            lo = int(m.group(1), 16)
            if sum(lo <= x <= pc for x in s_start) == 1:
                loops.append((lo, pc))
    inside = sum(any(lo <= x <= hi for lo, hi in loops) for x in spill_pc)
    return len(spill_pc), inside, len(loops)


def setmaxnreg_values(sass: str) -> list[int]:
    """The register counts the partitions set (USETMAXREG) in the SASS, sorted."""
    return sorted({int(x, 16) for x in re.findall(r"USETMAXREG\S*\s+(?:UP\d+,\s*)?(0x[0-9a-f]+)", sass)})


def layouts():
    """name -> (layout, batch, q heads, kv heads): one per mask mode / full-tile walk."""
    import torch
    from opsadv import SparseLayout
    g = torch.Generator().manual_seed(5)
    kpm = torch.rand(2, 300, generator=g) < 0.7
    return {
        "window_causal": (SparseLayout.sliding_window(700, 300, causal=True, block_size=128), 1, 2, 2),
        "causal": (SparseLayout.dense(300, causal=True, block_size=128), 1, 4, 2),
        "bigbird": (SparseLayout.bigbird(400, block_size=64, heads=2, random_blocks=1), 1, 2, 2),
        "padding_causal": (SparseLayout.from_padding_mask(kpm, causal=True, block_size=128), 2, 2, 2),
        "global_window": (SparseLayout.global_tokens(390, 20, window=70, block_size=16), 1, 2, 2),
        "dilated_not_one_run": (SparseLayout.dilated(640, block_size=128, dilation=2, local_blocks=1), 1, 2, 2),
    }


CASES = [("window_causal", 128), ("window_causal", 64), ("causal", 128), ("bigbird", 128), ("padding_causal", 64),
         ("global_window", 128), ("dilated_not_one_run", 128)]
# The schedules added for issue #5 (cuda/sparse_attention/gluon.py VARIANTS, not run on a GPU yet), on the layouts the probe
# times (causal sliding windows; dense causal) where each must compile with 0 spills (tests assert it).
# Masked modes (block masks, global tokens) with them: see MASKED_VARIANT_CASES.
VARIANT_CASES = [("window_causal", 128, "pingpong"), ("causal", 128, "pingpong"), ("window_causal", 64, "pingpong"),
                 ("window_causal", 128, "st3"), ("causal", 128, "st3"), ("window_causal", 128, "pingpong_st3"),
                 ("causal", 128, "pingpong_st3"), ("window_causal", 128, "q1"), ("window_causal", 128, "pingpong_kv"),
                 ("causal", 128, "pingpong_kv"), ("window_causal", 64, "pingpong_kv"),
                 # the interval mask (band layouts): the default schedule's rule (no spill inside the tile loops),
                 # 0 spills with pingpong_st3
                 ("window_causal", 128, "interval"), ("causal", 128, "interval"), ("window_causal", 64, "interval"),
                 # O out through the last K tile: 0 spills like pingpong_st3
                 ("window_causal", 128, "pingpong_st3_kslot"), ("causal", 128, "pingpong_st3_kslot"),
                 ("window_causal", 128, "pingpong_st3_interval"), ("causal", 128, "pingpong_st3_interval"),
                 ("window_causal", 64, "pingpong_st3_interval"),
                 # + the epilogue under the next item's S_0: 7 spills outside the tile loops
                 ("window_causal", 128, "pingpong_st3_kslot_es0"), ("causal", 128, "pingpong_st3_kslot_es0")]
# The no-lse build (need_lse=False: no-grad calls through the op) of what auto_schedule runs.
NOLSE_CASES = [("window_causal", 128, "pingpong_st3_kslot"), ("window_causal", 128, "interval")]
# The TRACE build of the probes (sparse_trace_probe.py): stamps spill a little outside the tile loops, none inside.
TRACE_CASES = [("window_causal", 128, "interval"), ("window_causal", 128, "pingpong_st3_interval"),
               ("window_causal", 128, "pingpong_st3_kslot")]
# Reported with --masked only (they spill: outside the loops, and for global tokens inside them).
MASKED_VARIANT_CASES = [(n, 128, v) for v in ("pingpong", "st3", "pingpong_st3", "pingpong_kv")
                        for n in ("bigbird", "global_window", "dilated_not_one_run")]


def compile_case(name, d, dtype=None, variant="default", trace=False, lse=True):
    import torch
    from opsadv.backends.cuda.sparse_attention import gluon_kernel as K, gluon as GS
    dtype = dtype or torch.bfloat16
    lay, b, hq, hkv = layouts()[name]
    q = torch.randn(b, hq, lay.seq_q, d).to(dtype)
    k, v = (torch.randn(b, hkv, lay.seq_k, d).to(dtype) for _ in range(2))
    out, lse = torch.empty_like(q), (torch.empty(b, hq, lay.seq_q) if lse else None)   # None: the no-lse build
    # trace: the probes' TRACE build (sparse_trace_probe.py), stamps into an int64 (items, 2, TRACE_STAMPS) buffer
    n_items = GS._cdiv(lay.seq_q, GS.TILE) * b * hq
    tr = torch.zeros(n_items, 2, K.TRACE_STAMPS.value, dtype=torch.int64) if trace else None
    ti = GS.layout_index(lay.block_mask, lay.key_padding_mask, None, lay.block_size, lay.causal, lay.window_left,
                         lay.window_right, lay.num_global, lay.seq_q, lay.seq_k)
    grid, args, kw = GS.launch_args(q, k, v, out, lse, ti, lay.key_padding_mask, lay.block_size, lay.causal,
                                    lay.window_left, lay.window_right, lay.num_global, 0.1, trace=tr,
                                    **GS.VARIANTS[variant])
    H = _compile_helpers()
    kern = H.compile_sm90(K.sparse_fwd_kernel, args, kw)
    sass = H.sass_of(kern)
    total, inside, loops = tile_loop_spills(sass)
    res = H.cubin_resources(kern)
    tag = (("" if variant == "default" else f"-{variant}") + ("-trace" if trace else "")
           + ("" if lse is not None else "-nolse"))
    row = {"case": f"{name}-d{d}{tag}", "variant": variant, "shared": kern.metadata.shared, "spills": total,
           "spills_in_tile_loops": inside, "tile_loops": loops, "launch_regs": res.get("regs"),
           "stack": res.get("stack"), "setmaxnreg": setmaxnreg_values(sass),
           "bm_mode": kw["BM_MODE"], "full_run": kw["FULL_RUN"], "stages": kw["STAGES"],
           "q_slots": kw["Q_SLOTS"], "pingpong": kw["PINGPONG"], "split_empty": kw["SPLIT_EMPTY"],
           "trace": bool(trace), "lse": lse is not None, "clock_reads": sass.count("SR_CLOCKLO"),
           "instructions": len(re.findall(r"/\*[0-9a-f]{4,}\*/\s+\S", sass))}
    return row, kern, sass


def main(argv):
    os.environ.pop("TRITON_INTERPRET", None)
    masked = "--masked" in argv
    argv = [a for a in argv if not a.startswith("--")]
    out_dir = argv[1] if len(argv) > 1 else None
    report = {"commit": os.environ.get("OPSADV_COMMIT", "unknown"), "target": "cuda sm_90", "results": []}
    cases = [(n, d, "default") for n, d in CASES] + VARIANT_CASES + (MASKED_VARIANT_CASES if masked else [])
    cases = ([(n, d, v, False, True) for n, d, v in cases] + [(n, d, v, True, True) for n, d, v in TRACE_CASES]
             + [(n, d, v, False, False) for n, d, v in NOLSE_CASES])
    for name, d, variant, trace, lse in cases:
        row, kern, sass = compile_case(name, d, variant=variant, trace=trace, lse=lse)
        report["results"].append(row)
        if out_dir:
            os.makedirs(out_dir, exist_ok=True)
            open(os.path.join(out_dir, f"{row['case']}.ptx"), "w").write(kern.asm["ptx"])
            open(os.path.join(out_dir, f"{row['case']}.sass"), "w").write(sass)
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
