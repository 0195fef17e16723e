"""Compile the Gluon attention backward (opsadv/backends/cuda/flash_attention/gluon_bwd_kernel.py) for sm_90 on a
CPU-only machine: d 128/64, bf16/fp16, causal or not, with the real launch arguments of CPU tensors
(same method as compile_sm90.py).  Prints registers, spill instructions (STL/LDL in the SASS), stack,
shared memory, the wgmma/wait sequence and the setmaxnreg levels, for every schedule of
cuda/flash_attention/gluon_bwd.py VARIANTS (or --variants=a,b); writes summary.json (+ .ttgir/.ptx) to OUT_DIR if given.

  PYTHONPATH=. python benchmarks/gluon_fa/compile_bwd_sm90.py [OUT_DIR] [--stages=2] [--variants=inline,ws]
"""
from __future__ import annotations

import itertools
import json
import os
import re
import sys

os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402
import triton  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from compile_sm90 import (compile_sm90, cubin_resources, ptx_sequence, sass_instructions, sass_of,  # noqa: E402
                          setmaxnreg_regions)

from opsadv.backends.cuda.flash_attention import gluon_bwd_kernel as KB  # noqa: E402
from opsadv.backends.cuda.flash_attention import gluon_bwd as GB  # noqa: E402


def spill_counts(sass: str) -> tuple[int, int]:
    """(STL/LDL in the whole kernel, STL/LDL inside the main loop).  The main loop is the widest
    conditional backward branch (@P BRA to a lower address) around an HGMMA; the unconditional ones
    are the jumps back from mbarrier try-wait retry blocks placed after the kernel's end."""
    ins = sass_instructions(sass)
    loops = []
    for addr, text in ins:
        m = re.search(r"^@!?U?P\d\s+BRA\s+(?:`\(\.L_x_\d+\)|0x([0-9a-f]+))", text)
        if m and m.group(1) and int(m.group(1), 16) < addr:
            lo = int(m.group(1), 16)
            if any("HGMMA" in t for a, t in ins if lo <= a <= addr):
                loops.append((lo, addr))
    spill = [a for a, t in ins if re.search(r"\b(?:STL|LDL)\b", t)]
    if not loops:
        return len(spill), 0
    lo, hi = max(loops, key=lambda r: r[1] - r[0])
    return len(spill), sum(lo <= a <= hi for a in spill)


def compile_variant(d, dt, causal, stages=GB.DEFAULT_STAGES, variant=GB.DEFAULT_VARIANT):
    """(tag, compiled kernel): ragged s_q/s_k and GQA 4/2, the general path.  The default schedule keeps
    its pre-VARIANTS tag (no schedule name) so reports stay comparable."""
    b, hq, hkv, sq, sk = 1, 4, 2, 1000, 1000
    q, dout = (torch.randn(b, hq, sq, d).to(dt) for _ in range(2))
    k, v, dk, dv = (torch.randn(b, hkv, sk, d).to(dt) for _ in range(4))
    dq_acc = torch.zeros(b, hq, sq, d)
    lse2, delta = torch.zeros(b, hq, sq), torch.zeros(b, hq, sq)
    grid, args, kw = GB.launch_args(q, k, v, dout, dq_acc, dk, dv, lse2, delta, causal, d ** -0.5, stages,
                                    variant)
    name = "" if variant == "inline" else variant + "_"
    tag = f"bwd_{name}d{d}_{str(dt).split('.')[-1]}_st{stages}{'_causal' if causal else ''}"
    return tag, compile_sm90(KB.fa_bwd_kernel, args, kw)


def main():
    argv = [a for a in sys.argv[1:] if not a.startswith("--")]
    stages = int(next((a.split("=")[1] for a in sys.argv[1:] if a.startswith("--stages=")), GB.DEFAULT_STAGES))
    names = next((a.split("=")[1].split(",") for a in sys.argv[1:] if a.startswith("--variants=")), list(GB.VARIANTS))
    out_dir = argv[0] if argv else None
    summary = []
    for variant, d, dt, causal in itertools.product(names, (128, 64), (torch.bfloat16, torch.float16),
                                                 (False, True)):
        tag = f"bwd_{variant}_d{d}_{str(dt).split('.')[-1]}{'_causal' if causal else ''}"
        try:
            tag, kern = compile_variant(d, dt, causal, stages, variant)
        except Exception as e:
            msg = str(e).strip().splitlines()
            print(f"{tag}: COMPILE FAILED: {type(e).__name__}: {' | '.join(msg[-8:])[:2000]}")
            summary.append({"variant": tag, "schedule": variant, "compiled": False, "error": " | ".join(msg[-8:])[:2000]})
            continue
        ptx = kern.asm["ptx"]
        if out_dir:
            os.makedirs(out_dir, exist_ok=True)
            open(os.path.join(out_dir, tag + ".ttgir"), "w").write(kern.asm["ttgir"])
            open(os.path.join(out_dir, tag + ".ptx"), "w").write(ptx)
        sass = sass_of(kern)
        row = {"variant": tag, "schedule": variant, "compiled": True, **cubin_resources(kern),
               "atomics": len(re.findall(r"\bred\.global|\batom\.global", ptx)),
               "setmaxnreg": re.findall(r"setmaxnreg\.(\w+)\.sync\.aligned\.u32\s+(\d+)", ptx),
               "setmaxnreg_regions": setmaxnreg_regions(sass),
               "ptx_async_sequence": ptx_sequence(ptx)}
        row["sass_spills"], row["main_loop_spills"] = spill_counts(sass)
        summary.append(row)
        print(f"{tag}: regs {row.get('regs')} stack {row.get('stack')} STL/LDL {row['sass_spills']} "
              f"(main loop {row['main_loop_spills']}) "
              f"smem {row['shared_bytes']} red/atom {row['atomics']}"
              + (f" [setmaxnreg, top R] {[r for r in row['setmaxnreg_regions'] if r[0] >= 128]}"
                 if row["setmaxnreg"] else ""))
        sys.stdout.flush()
    if out_dir:
        with open(os.path.join(out_dir, "summary.json"), "w") as f:
            json.dump({"commit": os.environ.get("OPSADV_COMMIT", "unknown"), "triton": triton.__version__,
                       "target": "cuda sm_90", "results": summary}, f, indent=1)
    return 0 if all(r["compiled"] for r in summary) else 1


if __name__ == "__main__":
    sys.exit(main())
