"""Compile the Gluon attention forward (opsadv/backends/cuda/flash_attention/gluon_kernel.py) for sm_90 on a CPU-only
machine (no GPU, no driver): every schedule of cuda/flash_attention/gluon.py VARIANTS, d 128/64, bf16/fp16, causal or not.

Builds the real launch arguments on CPU tensors (TensorDescriptors only need data_ptr/shape/stride),
binds and specializes them like JITFunction.run, and compiles through Gluon's own AST source class
(GluonASTSource: the kernel body is already TTGIR-level, so no layout inference pass) with
triton.compile for GPUTarget("cuda", 90, 128).  Per variant it prints registers / spills (cuobjdump of
the cubin), shared memory (compiler metadata), and the wgmma / wait / barrier sequence of the main loop
from the PTX.

  PYTHONPATH=. python benchmarks/gluon_fa/compile_sm90.py [OUT_DIR] [--json=REPORT.json]
      OUT_DIR gets the .ttgir / .ptx per variant and summary.json; --json writes the same summary elsewhere.

Spills: "stack" (cuobjdump -res-usage) and "sass_stl_ldl" (STL/LDL in the SASS); the PTX never has them
("local ld/st" only counts what the compiler put in local memory before ptxas).
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile

os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import make_backend  # noqa: E402
from triton.experimental.gluon._runtime import GluonASTSource  # noqa: E402
from triton.runtime.jit import create_function_from_signature  # noqa: E402

from opsadv.backends.cuda.flash_attention import gluon_kernel as K  # noqa: E402
from opsadv.backends.cuda.flash_attention import gluon as GA  # noqa: E402

TARGET = GPUTarget("cuda", 90, 128)
BACKEND = make_backend(TARGET)


def compile_sm90(fn, args, kw):
    """Bind + specialize like JITFunction.run, then compile (nothing launches)."""
    binder = create_function_from_signature(fn.signature, fn.params, BACKEND)
    kw = dict(kw)
    kw.setdefault("debug", False)
    bound, specialization, _ = binder(*args, **kw)
    options, signature, constexprs, attrs = fn._pack_args(BACKEND, kw, bound, specialization, None)
    src = GluonASTSource(fn, signature, constexprs, attrs)
    return triton.compile(src, target=TARGET, options=options.__dict__)


def cuobjdump(kernel, flag: str) -> str:
    """`cuobjdump FLAG` (e.g. -sass, -res-usage) of a compiled kernel's cubin, with Triton's own tool."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        return subprocess.run([tool, flag, f.name], capture_output=True, text=True, check=True).stdout


def sass_of(kernel) -> str:
    return cuobjdump(kernel, "-sass")


def kernel_report(kernel, mufu_ops=("EX2", "RCP", "TANH")) -> dict:
    """cubin resources, and from the SASS: STL/LDL count (spills), the highest register each setmaxnreg region
    uses, the HGMMA (wgmma) count and the count of each MUFU op."""
    sass = sass_of(kernel)
    info = cubin_resources(kernel)
    info["spills"] = len(re.findall(r"\b(?:STL|LDL)\b", sass))
    info["regions"] = setmaxnreg_regions(sass)
    info["hgmma"] = len(re.findall(r"\bHGMMA\.", sass))
    info["mufu"] = {op: len(re.findall(r"MUFU\." + op + r"\b", sass)) for op in mufu_ops}
    return info


def sass_instructions(sass: str) -> list[tuple[int, str]]:
    """(address, instruction text) of every SASS line."""
    return [(int(m.group(1), 16), m.group(2)) for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]


def setmaxnreg_regions(sass: str) -> list[list[int]]:
    """[setmaxnreg value, highest R register used] for each run of SASS that follows a USETMAXREG, in
    address order (an approximation of the partitions' code; runs with no register use are left out).
    An HGMMA destination counts as its whole accumulator (N/2 fp32 registers for 64xN)."""
    out, limit, top = [], None, -1
    for _, ins in sass_instructions(sass) + [(0, "USETMAXREG END")]:
        if "USETMAXREG" in ins:
            if limit is not None and top >= 0:
                out.append([limit, top])
            m = re.search(r"(0x[0-9a-f]+)\s*$", ins)
            limit, top = (int(m.group(1), 16) if m else None), -1
            continue
        regs = [int(r) for r in re.findall(r"\bR(\d+)\b", ins)]
        m = re.search(r"HGMMA\.64x(\d+)x\d+\.F32\S*\s+R(\d+)", ins)
        if m:
            regs.append(int(m.group(2)) + int(m.group(1)) // 2 - 1)
        if regs:
            top = max(top, *regs)
    return out


def cubin_resources(kernel) -> dict:
    """Registers per thread, spill stores/loads and stack from the cubin; shared bytes from metadata."""
    info = {"shared_bytes": kernel.metadata.shared}
    res = cuobjdump(kernel, "-res-usage")
    for key, pat in (("regs", r"REG:(\d+)"), ("stack", r"STACK:(\d+)")):
        m = re.search(pat, res)
        if m:
            info[key] = int(m.group(1))
    return info


def ptx_sequence(ptx: str) -> list[str]:
    """The async-relevant instructions in program order, runs of identical ones collapsed (xN)."""
    keep = re.compile(r"^\s*(wgmma\.mma_async\S*|wgmma\.commit_group\S*|wgmma\.wait_group\S*\s+\d+|"
                      r"wgmma\.fence\S*|mbarrier\.try_wait\S*|mbarrier\.arrive\S*|"
                      r"cp\.async\.bulk\.tensor\S*|setmaxnreg\S*|bar\.sync\s+\d+|barrier\.sync\S*|"
                      r"bar\.arrive\S*|ex2\.approx\S*)")
    seq = []
    for line in ptx.splitlines():
        m = keep.match(line)
        if not m:
            continue
        op = re.sub(r"\s+", " ", m.group(1))
        if seq and seq[-1][0] == op:
            seq[-1][1] += 1
        else:
            seq.append([op, 1])
    return [f"{op} x{n}" if n > 1 else op for op, n in seq]


def ptx_stats(ptx: str, ttgir: str) -> dict:
    return {
        "wgmma_mma_async": len(re.findall(r"wgmma\.mma_async", ptx)),
        "wgmma_wait_group": sorted(set(re.findall(r"wgmma\.wait_group\.sync\.aligned\s+(\d+)", ptx))),
        "ttgir_warp_group_dot_isAsync": len(re.findall(r"ttng\.warp_group_dot .*isAsync = true", ttgir)),
        "ttgir_warp_group_dot_wait": re.findall(r"ttng\.warp_group_dot_wait .*pendings = (\d+)", ttgir),
        "tma_loads": len(re.findall(r"cp\.async\.bulk\.tensor\.\dd\.shared::cluster\.global", ptx)),
        "setmaxnreg": re.findall(r"setmaxnreg\.(\w+)\.sync\.aligned\.u32\s+(\d+)", ptx),
        "local_spill_ld_st": len(re.findall(r"\b(?:ld|st)\.local", ptx)),
    }


def variants(dtypes=(torch.bfloat16, torch.float16)):
    """(d, dtype, variant name, causal): every schedule the probe runs (GA.variants_for: the 3-stage
    ones are d128 only)."""
    out = []
    for d in (128, 64):
        for dt in dtypes:
            for name in GA.variants_for(d):
                for causal in (False, True):
                    out.append((d, dt, name, causal))
    return out


def compile_variant(d, dt, name, causal):
    """(tag, compiled kernel) of one variant, from the launch arguments of CPU tensors."""
    b, hq, hkv, sq, sk = 1, 4, 2, 1000, 1000      # ragged + GQA: the general path
    q = torch.randn(b, hq, sq, d).to(dt)
    k, v = (torch.randn(b, hkv, sk, d).to(dt) for _ in range(2))
    out, lse = torch.empty_like(q), torch.empty(b, hq, sq)
    grid, args, kw = GA.launch_args(q, k, v, out, lse, causal, d ** -0.5, name)
    stages = "" if name.endswith(f"st{kw['STAGES']}") else f"_st{kw['STAGES']}"
    tag = f"d{d}_{str(dt).split('.')[-1]}_{name}{stages}{'_causal' if causal else ''}"
    return tag, compile_sm90(K.fa_fwd_kernel, args, kw)


def main():
    pos = [a for a in sys.argv[1:] if not a.startswith("--")]
    out_dir = pos[0] if pos else None
    json_path = next((a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("--json=")), None)
    summary = []
    for d, dt, name, causal in variants():
        tag = f"d{d}_{str(dt).split('.')[-1]}_{name}{'_causal' if causal else ''}"
        try:
            tag, kern = compile_variant(d, dt, name, causal)
        except Exception as e:   # report and continue: the point is to learn what compiles
            msg = str(e).strip().splitlines()
            print(f"{tag}: COMPILE FAILED: {type(e).__name__}: {' | '.join(msg[-6:])[:1500]}")
            summary.append({"variant": tag, "compiled": False, "error": " | ".join(msg[-6:])[:1500]})
            continue
        ptx, ttgir, sass = kern.asm["ptx"], kern.asm["ttgir"], sass_of(kern)
        if out_dir:
            os.makedirs(out_dir, exist_ok=True)
            open(os.path.join(out_dir, tag + ".ttgir"), "w").write(ttgir)
            open(os.path.join(out_dir, tag + ".ptx"), "w").write(ptx)
        row = {"variant": tag, "compiled": True, "num_warps": kern.metadata.num_warps, **cubin_resources(kern),
               "sass_stl_ldl": len(re.findall(r"\b(?:STL|LDL)\b", sass)),
               "setmaxnreg_regions": setmaxnreg_regions(sass),
               **ptx_stats(ptx, ttgir), "ptx_async_sequence": ptx_sequence(ptx)}
        summary.append(row)
        print(f"{tag}: regs {row.get('regs')} stack {row.get('stack')} STL/LDL {row['sass_stl_ldl']} "
              f"smem {row['shared_bytes']} "
              f"wgmma {row['wgmma_mma_async']} wait_group {row['wgmma_wait_group']} "
              f"ttgir async dots {row['ttgir_warp_group_dot_isAsync']} waits {row['ttgir_warp_group_dot_wait']} "
              f"setmaxnreg {row['setmaxnreg']} local ld/st {row['local_spill_ld_st']} "
              f"[limit, top R] {[r for r in row['setmaxnreg_regions'] if r[0] and r[0] >= 128]}")
        sys.stdout.flush()
    report = {"commit": os.environ.get("OPSADV_COMMIT", "unknown"), "triton": triton.__version__,
              "target": "cuda sm_90", "results": summary}
    for path in ([os.path.join(out_dir, "summary.json")] if out_dir else []) + ([json_path] if json_path else []):
        with open(path, "w") as f:
            json.dump(report, f, indent=1)
    return 0 if all(r["compiled"] for r in summary) else 1


if __name__ == "__main__":
    sys.exit(main())
