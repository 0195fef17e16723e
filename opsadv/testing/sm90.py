"""Compile a Triton kernel for sm_90 on a machine without a GPU and read what ptxas says about it: how the CPU
tests check register spills, TMA instructions and atomics of the cuda backend's Hopper paths.  Call it in a
process where TRITON_INTERPRET is unset (under the interpreter jit functions cannot be compiled)."""
from __future__ import annotations

import os
import re
import subprocess
import tempfile


def compile_sm90(fn, kwargs: dict, num_warps: int, num_stages: int) -> dict:
    """fn (a @triton.jit function) bound to kwargs (every argument by name, runtime and constexpr), compiled for
    sm_90a: {"ptx", "registers", "spill_stores", "spill_loads", "tma_loads"} (ptxas -v's resource report)."""
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature
    target = GPUTarget("cuda", 90, 128)
    backend = make_backend(target)
    opts = dict(num_warps=num_warps, num_stages=num_stages, debug=False)
    bound, spec, _ = create_function_from_signature(fn.signature, fn.params, backend)(**kwargs, **opts)
    options, signature, constexprs, attrs = fn._pack_args(backend, opts, bound, spec, None)
    ptx = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target,
                         options=options.__dict__).asm["ptx"]
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    try:
        log = subprocess.run([knobs.nvidia.ptxas.path, "-arch=sm_90a", "-v", f.name, "-o", os.devnull],
                             capture_output=True, text=True).stderr
    finally:
        os.unlink(f.name)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    regs = re.search(r"Used (\d+) registers", log)
    return {"ptx": ptx, "registers": int(regs.group(1)), "spill_stores": int(spill.group(1)),
            "spill_loads": int(spill.group(2)), "tma_loads": len(re.findall(r"cp\.async\.bulk\.tensor", ptx))}
