"""Compile the sparse attention BACKWARD kernels (opsadv/backends/cuda/sparse.py _sparse_dq, _sparse_dkdv)
for sm_90 WITHOUT a GPU and report what Triton's software pipeliner did in their loops.

The launch arguments are the real ones: SP.sparse_bwd runs on CPU tensors with the "h100" profile's
tiles, and the kernel launches are intercepted (nothing executes); each captured call is bound and
specialized the way JITFunction.run does (pointer alignment, ints divisible by 16, ints equal to 1)
and compiled by triton.compile for GPUTarget("cuda", 90, 128).  Per kernel and loop variant it prints,
from the TTGIR: every scf.for with the async copies it holds, the shared-memory buffers (leading dim of
the ttg.local_alloc memdescs the copies write) and the ttg.async_wait counts; and from the cubin (ptxas
via cuobjdump): registers, and the kernel's shared memory.

  python benchmarks/sparse_bwd_ir.py [OUT_DIR]            (no TRITON_INTERPRET; CPU only)
OUT_DIR (optional) receives the TTGIR of each compile.  IR_LOOPS=list,run picks loop variants,
IR_CASES=REGEX the layouts, IR_STAGES=3 the num_stages of both kernels (default: the h100 profile's)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from types import SimpleNamespace

os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, make_backend  # noqa: E402
from triton.runtime.jit import create_function_from_signature  # noqa: E402

from opsadv import SparseLayout  # noqa: E402
from opsadv.backends.cuda import sparse as SP  # noqa: E402

TARGET = GPUTarget("cuda", 90, 128)
BACKEND = make_backend(TARGET)
OUT_DIR = sys.argv[1] if len(sys.argv) > 1 else None


class _Capture:
    """Stands in for a @triton.jit kernel: kernel[grid](*args, **kw) records (fn, args, kw)."""
    def __init__(self, fn, sink):
        self.fn, self.sink = fn, sink

    def __getitem__(self, grid):
        return lambda *a, **kw: self.sink.append((self.fn, a, kw))


def compile_sm90(fn, args, kw):
    """Bind and specialize like JITFunction.run, then compile for sm_90 (no driver needed)."""
    binder = create_function_from_signature(fn.signature, fn.params, BACKEND)
    kw = dict(kw)
    kw.setdefault("debug", False)
    bound, specialization, _ = binder(*args, **kw)
    options, signature, constexprs, attrs = fn._pack_args(BACKEND, kw, bound, specialization, None)
    return triton.compile(ASTSource(fn, signature, constexprs, attrs), target=TARGET, options=options.__dict__)


def analyse(ttgir: str) -> list[dict]:
    """Per scf.for region (by brace depth), in the order they close (the partial-tile loop before the
    full-tile one): async copies, the multi-buffers they index, async_wait nums, dots, scalar i32 loads."""
    allocs = {}
    for m in re.finditer(r"(%[\w#]+) = ttg\.local_alloc[^\n]*?!ttg\.memdesc<(\d+)x(\d+)x(\d+)x(\w+)", ttgir):
        allocs[m.group(1)] = f"{m.group(2)}x{m.group(3)}x{m.group(4)}x{m.group(5)}"
    loops, stack, depth = [], [], 0
    for line in ttgir.splitlines():
        s = line.strip()
        if "scf.for" in s and s.endswith("{"):
            stack.append({"depth": depth, "copies": 0, "waits": [], "bufs": set(), "dots": 0, "id_loads": 0})
        elif stack:
            cur = stack[-1]
            if "ttg.async_copy_global_to_local" in s:
                cur["copies"] += 1
            if "ttg.memdesc_index" in s or "ttg.memdesc_subview" in s:
                for name, shape in allocs.items():
                    if re.search(re.escape(name) + r"[ ,\[]", s):
                        cur["bufs"].add(shape)
            for m in re.finditer(r"ttg\.async_wait[^\n]*?\{num = (\d+) : i32\}", s):
                cur["waits"].append(int(m.group(1)))
            if "warp_group_dot " in s or "tt.dot " in s:
                cur["dots"] += 1
            if re.search(r"= tt\.load [^:]*: !tt\.ptr<i32>", s):       # scalar tile-id loads
                cur["id_loads"] += 1
        depth += s.count("{") - s.count("}")
        while stack and depth <= stack[-1]["depth"]:
            done = stack.pop()
            if done["copies"] or done["dots"]:
                done["bufs"] = sorted(done["bufs"])
                del done["depth"]
                loops.append(done)
    return loops


def resources(kernel) -> dict:
    """Shared memory (compiler metadata); registers and stack frame from the cubin."""
    cubin = kernel.asm.get("cubin")
    info = {"shared_bytes": kernel.metadata.shared}
    if cubin is None:
        return info
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        res = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True).stdout
    m = re.search(r"REG:(\d+)", res)
    if m:
        info["regs"] = int(m.group(1))
    m = re.search(r"STACK:(\d+)", res)
    if m:
        info["stack"] = int(m.group(1))
    return info


CASES = {   # name -> layout (the benchmark shapes' s and d; 2 heads: specialization does not depend on h)
    "window1024 causal": lambda: SparseLayout.sliding_window(16384, 1024, causal=True, block_size=128),
    "global128+window256": lambda: SparseLayout.global_tokens(16384, 128, window=256, block_size=128),
    "varlen causal": lambda: SparseLayout.varlen([4096, 2000, 3500, 1024, 4096, 777, 3000, 4096], causal=True,
                                                 block_size=128),
}


def main():
    tiles = {}
    if os.environ.get("IR_STAGES"):     # pipeline depth of both backward kernels (default: the profile's)
        st = int(os.environ["IR_STAGES"])
        fwd, dq, dkdv = SP.tiles_for(SimpleNamespace(name="h100", tiles={}), 128)
        tiles = {SP.OP: (fwd, (*dq[:3], st), (*dkdv[:3], st))}
    ctx = SimpleNamespace(profile=SimpleNamespace(name="h100", tiles=tiles), options={})
    ids = getattr(SP, "BWD_LOOP_IDS", {"list": 0})      # before the backward loop variants: one loop
    loops = [x for x in os.environ.get("IR_LOOPS", ",".join(ids)).split(",") if x]
    cases = [c for c in CASES if re.search(os.environ.get("IR_CASES", "."), c)]
    for cname in cases:
        lay = CASES[cname]()
        h, d = 2, 128
        g = torch.Generator().manual_seed(0)
        q, k, v, o, do = (torch.randn(1, h, lay.seq_q, d, generator=g).to(torch.bfloat16) for _ in range(5))
        lse = torch.zeros(1, h, lay.seq_q)
        for loop in loops:
            sink = []
            saved = {n: getattr(SP, n) for n in ("_sparse_dq", "_sparse_dkdv", "_bwd_delta")}
            try:
                SP._sparse_dq = _Capture(saved["_sparse_dq"], sink)
                SP._sparse_dkdv = _Capture(saved["_sparse_dkdv"], sink)
                SP._bwd_delta = _Capture(saved["_bwd_delta"], [])
                SP.sparse_bwd(ctx, do, q, k, v, o, lse, lay.block_mask, lay.key_padding_mask, lay.cu_seqlens,
                              lay.block_size, lay.causal, lay.window_left, lay.window_right, lay.num_global,
                              d ** -0.5, **({"variant": {"dq": loop, "dkdv": loop}} if len(ids) > 1 else {}))
            finally:
                for n, f in saved.items():
                    setattr(SP, n, f)
            for fn, a, kw in sink:
                kern = compile_sm90(fn, a, kw)
                ttgir = kern.asm["ttgir"]
                if OUT_DIR:
                    os.makedirs(OUT_DIR, exist_ok=True)
                    tag = re.sub(r"\W+", "_", f"{cname}_{fn.__name__}_{loop}")
                    open(os.path.join(OUT_DIR, tag + ".ttgir"), "w").write(ttgir)
                res = resources(kern)
                print(f"{cname:22s} {fn.__name__:13s} {loop:9s} LOOP={kw.get('LOOP')} "
                      f"tile {kw['BLOCK_M']}x{kw['BLOCK_N']}/{kw['num_warps']}w/{kw['num_stages']}s  {res}")
                for lp in analyse(ttgir):
                    print(f"    loop: async copies {lp['copies']}, buffers {lp['bufs']}, async_wait num "
                          f"{lp['waits']}, dots {lp['dots']}, i32 id loads {lp['id_loads']}")
            sys.stdout.flush()


if __name__ == "__main__":
    main()
