"""The flash-attention backward's dS variants (attention._bwd_ds, _attn_dq_gemm.py): the dK/dV kernel writes
dS^T into a workspace and dQ is a GEMM over it.  Under the interpreter on CPU (fp16) against float64, with the
workspace NaN-filled (an element a sum reads without the dK/dV kernel having written it shows up), chunked
by a small cap, odd lengths, causal with s_q != s_k, GQA / MQA; on a GPU, bf16 and the two-stream pipeline."""
from __future__ import annotations

import importlib
import pytest
import torch

import opsadv
from opsadv.backends.triton_common.flash_attention import dq_gemm as G
from opsadv.backends.triton_common.flash_attention import attention as A
from opsadv.core import dispatch
OA = importlib.import_module("opsadv.ops.flash_attention")

from conftest import rel_err, requires_gpu
from test_cuda_attention import CASES, _ref


def _nan_workspace(monkeypatch):
    made = []
    real = G.new_workspace

    def poisoned(*a, **kw):
        ws = real(*a, **kw).fill_(float("nan"))
        made.append(ws.shape)
        return ws
    monkeypatch.setattr(G, "new_workspace", poisoned)
    return made


def _grads(b, hq, hkv, sq, sk, d, causal, variant, device="cpu", dtype=torch.float16, scale=0.2):
    q = torch.randn(b, hq, sq, d, dtype=dtype, device=device)
    k = torch.randn(b, hkv, sk, d, dtype=dtype, device=device)
    v = torch.randn_like(k)
    do = torch.randn_like(q)
    with opsadv.use_backend("cuda"):
        _, r = dispatch.explain_spec(OA._spec(q, k, None, causal, True))
    o, lse = A.flash_fwd(r.ctx, q, k, v, None, causal, scale)
    grads = A.flash_bwd_variant(r.ctx, do, q, k, v, o, lse, causal, scale, variant)
    _, _, ref = _ref(q, k, v, do, causal, scale)
    return grads, ref


@pytest.mark.parametrize("dq_tile", [(16, 16), (32, 16), (16, 32)])
@pytest.mark.parametrize("b,hq,hkv,sq,sk,d,causal", CASES)
def test_ds_backward_matches_reference(b, hq, hkv, sq, sk, d, causal, dq_tile, seed, monkeypatch):
    """dq_tile: the dQ GEMM's (queries, keys) tile against the dK/dV kernel's 16 x 16: a taller one reads
    causal tiles the dK/dV kernel's loop never visited (NaN here), a wider one keys past its last tile."""
    monkeypatch.setenv("OPSADV_POISON_OUTPUTS", "1")
    made = _nan_workspace(monkeypatch)
    orig = A._configs
    monkeypatch.setattr(A, "_configs", lambda ctx, which, d_, tma_ok: [
        {**c, "BLOCK_M": dq_tile[0], "BLOCK_N": dq_tile[1]} if which == "bwd_dsq" else c
        for c in orig(ctx, which, d_, tma_ok)])
    grads, ref = _grads(b, hq, hkv, sq, sk, d, causal, "ds")
    assert len(made) == 1 and made[0][1] % G.DS_PAD == 0 and made[0][2] % G.DS_PAD == 0
    for name, x, y in zip(("dq", "dk", "dv"), grads, ref):
        assert not torch.isnan(x).any(), name
        assert rel_err(x, y) < 2e-3, (name, rel_err(x, y))


@pytest.mark.parametrize("b,hq,hkv,sq,sk,d,causal", [CASES[1], CASES[3], CASES[4], CASES[6]])
def test_ds_stored_through_a_descriptor(b, hq, hkv, sq, sk, d, causal, seed, monkeypatch):
    """The dK/dV kernel's DS_TMA config (dS^T out by a (slabs, s_k, s_q) descriptor store); head dim 96 has no
    descriptor path and keeps the plain stores."""
    monkeypatch.setenv("OPSADV_POISON_OUTPUTS", "1")
    _nan_workspace(monkeypatch)
    orig, made = A._configs, []
    monkeypatch.setattr(A, "_configs", lambda ctx, which, d_, tma_ok: [
        {**c, "DS_TMA": tma_ok} if which == "bwd_kv" else c for c in orig(ctx, which, d_, tma_ok)])
    real = A.TensorDescriptor
    monkeypatch.setattr(A, "TensorDescriptor", lambda t, *a: made.append(t.dim()) or real(t, *a))
    grads, ref = _grads(b, hq, hkv, sq, sk, d, causal, "ds")
    assert made == ([] if d == 96 else [3])
    for name, x, y in zip(("dq", "dk", "dv"), grads, ref):
        assert not torch.isnan(x).any(), name
        assert rel_err(x, y) < 2e-3, (name, rel_err(x, y))


@pytest.mark.parametrize("dq_tile", [(16, 16), (32, 16)])
@pytest.mark.parametrize("b,hq,hkv,sq,sk,d,causal", [CASES[1], CASES[3], CASES[4], CASES[6]])
def test_dq_gemm_loads_through_descriptors(b, hq, hkv, sq, sk, d, causal, dq_tile, seed, monkeypatch):
    """The dQ GEMM's TMA configs: dS^T tiles from a (slabs, s_k, s_q) descriptor (NaN where unwritten: the
    diagonal band still selected away), K from a (b, h_kv, s_k, d) one (zero past s_k); head dim 96: none."""
    monkeypatch.setenv("OPSADV_POISON_OUTPUTS", "1")
    _nan_workspace(monkeypatch)
    orig, made = A._configs, []
    monkeypatch.setattr(A, "_configs", lambda ctx, which, d_, tma_ok: [
        {**c, "TMA": tma_ok, "BLOCK_M": dq_tile[0], "BLOCK_N": dq_tile[1]} if which == "bwd_dsq" else c
        for c in orig(ctx, which, d_, tma_ok)])
    real_td, real_bhsd = G.TensorDescriptor, G.desc_bhsd
    monkeypatch.setattr(G, "TensorDescriptor", lambda t, *a: made.append("ds") or real_td(t, *a))
    monkeypatch.setattr(G, "desc_bhsd", lambda t, rows: made.append("k") or real_bhsd(t, rows))
    grads, ref = _grads(b, hq, hkv, sq, sk, d, causal, "ds")
    assert made == ([] if d == 96 else ["ds", "k"])
    for name, x, y in zip(("dq", "dk", "dv"), grads, ref):
        assert not torch.isnan(x).any(), name
        assert rel_err(x, y) < 2e-3, (name, rel_err(x, y))


@pytest.mark.parametrize("b,hq,hkv,sq,sk,d,causal", [(2, 4, 2, 37, 37, 32, True), (3, 2, 1, 20, 33, 64, False)])
def test_ds_backward_in_chunks_of_kv_heads(b, hq, hkv, sq, sk, d, causal, seed, monkeypatch):
    """A cap that holds one kv head's q heads: one chunk per (batch, kv head), each reusing the workspace."""
    monkeypatch.setenv("OPSADV_POISON_OUTPUTS", "1")
    made = _nan_workspace(monkeypatch)
    one = (hq // hkv) * G.slab_bytes(sq, sk, torch.float16)
    monkeypatch.setattr(G, "DS_WORKSPACE_CAP", one)
    calls = []
    real = G.launch_dq_gemm
    monkeypatch.setattr(G, "launch_dq_gemm", lambda *a, **kw: calls.append(a[3:5]) or real(*a, **kw))
    grads, ref = _grads(b, hq, hkv, sq, sk, d, causal, "ds")
    group = hq // hkv
    # the tuner is off on CPU: one GEMM per chunk, chunks in order over b * h_kv
    assert calls == [(i * group, group) for i in range(b * hkv)]
    assert made == [(group, G.padded(sk), G.padded(sq))]
    for x, y in zip(grads, ref):
        assert not torch.isnan(x).any() and rel_err(x, y) < 2e-3


@pytest.mark.parametrize("variant", ["ds", "kernels"])
@pytest.mark.parametrize("b,hq,hkv,sq,sk,d,causal", [(2, 4, 2, 37, 37, 32, True), CASES[3], CASES[4]])
def test_longest_first_launch_order(b, hq, hkv, sq, sk, d, causal, variant, seed, monkeypatch):
    """LPT configs launch the dK/dV kernel on a (kv heads, kv blocks) grid: the same gradients, dS slabs where the
    dQ GEMM expects them, also over chunks of one kv head's q heads."""
    monkeypatch.setenv("OPSADV_POISON_OUTPUTS", "1")
    _nan_workspace(monkeypatch)
    monkeypatch.setattr(G, "DS_WORKSPACE_CAP", (hq // hkv) * G.slab_bytes(sq, sk, torch.float16))
    orig = A._configs
    monkeypatch.setattr(A, "_configs", lambda ctx, which, d_, tma_ok: [
        {**c, "LPT": True} if which == "bwd_kv" else c for c in orig(ctx, which, d_, tma_ok)])
    grids = []
    real = A._bwd_kv_kernel

    class Spy:
        arg_names = real.arg_names

        def __getitem__(self, grid):
            grids.append(grid)
            return real[grid]
    monkeypatch.setattr(A, "_bwd_kv_kernel", Spy())
    grads, ref = _grads(b, hq, hkv, sq, sk, d, causal, variant)
    n_blocks = -(-sk // 16)                       # the interpreter profile's 16-key tiles
    assert grids and all(g[1] == n_blocks for g in grids)
    assert sum(g[0] for g in grids) == b * hkv
    for name, x, y in zip(("dq", "dk", "dv"), grads, ref):
        assert not torch.isnan(x).any(), name
        assert rel_err(x, y) < 2e-3, (name, rel_err(x, y))


@pytest.mark.parametrize("lpt", [False, True])
@pytest.mark.parametrize("variant", ["ds", "kernels"])
@pytest.mark.parametrize("b,hq,hkv,sq,sk,d,causal,per_chunk", [
    (2, 4, 2, 37, 37, 32, True, 1), (5, 2, 1, 37, 37, 32, True, 3), (*CASES[3], 1), (*CASES[5], 1),
    (1, 6, 2, 29, 29, 96, False, 1)])
def test_split_group_dk_dv(b, hq, hkv, sq, sk, d, causal, per_chunk, variant, lpt, seed, monkeypatch):
    """SPLIT (GQA): one dK/dV program per q head writing its fp32 share, the group's shares summed in order by
    _bwd_group_sum_kernel: the same gradients (shares NaN-filled before the kernel writes them), over chunks of
    per_chunk kv heads for "ds" (3 and 2 of 5: a last chunk smaller than the shares buffer it reuses), with and without
    the longest-first order; the grid has b * h_q programs per kv block."""
    monkeypatch.setenv("OPSADV_POISON_OUTPUTS", "1")
    _nan_workspace(monkeypatch)
    monkeypatch.setattr(G, "DS_WORKSPACE_CAP", per_chunk * (hq // hkv) * G.slab_bytes(sq, sk, torch.float16))
    orig = A._configs
    monkeypatch.setattr(A, "_configs", lambda ctx, which, d_, tma_ok: [
        {**c, "SPLIT": True, "LPT": lpt} if which == "bwd_kv" else c for c in orig(ctx, which, d_, tma_ok)])
    grids, sums = [], []
    real, real_sum = A._bwd_kv_kernel, A._bwd_group_sum_kernel

    class Spy:
        def __init__(self, kernel, seen):
            self.kernel, self.seen, self.arg_names = kernel, seen, kernel.arg_names

        def __getitem__(self, grid):
            self.seen.append(grid)
            return self.kernel[grid]
    monkeypatch.setattr(A, "_bwd_kv_kernel", Spy(real, grids))
    monkeypatch.setattr(A, "_bwd_group_sum_kernel", Spy(real_sum, sums))
    grads, ref = _grads(b, hq, hkv, sq, sk, d, causal, variant)
    heads = [g[0] if lpt else g[1] for g in grids]
    assert sum(heads) == b * hq                    # one program per q head and kv block, over the chunks
    assert len(sums) == len(grids) and sum(g[1] for g in sums) == b * hkv
    for name, x, y in zip(("dq", "dk", "dv"), grads, ref):
        assert not torch.isnan(x).any(), name
        assert rel_err(x, y) < 2e-3, (name, rel_err(x, y))


def test_split_is_offered_for_gqa_on_gpus_within_the_cap():
    from types import SimpleNamespace
    gpu = SimpleNamespace(device=SimpleNamespace(type="cuda"))
    cfgs = [{"BLOCK_M": 64}, {"BLOCK_M": 32}]
    assert A._with_split(cfgs, 4, gpu) == cfgs + [{"BLOCK_M": 64, "SPLIT": True}, {"BLOCK_M": 32, "SPLIT": True}]
    assert A._with_split(cfgs, 1, gpu) == cfgs                         # MHA: nothing to split
    assert A._with_split(cfgs, 4, gpu, fits=False) == cfgs             # the shares would pass the workspace cap
    assert A._with_split(cfgs, 4, torch.empty(1)) == cfgs              # CPU: the default tile only (no tuning)
    assert A._split_bytes(4, 8, 16384, 128) == 512 << 20                # GQA 32/8 s16384 d128, all kv heads


@pytest.mark.parametrize("total,most,sizes", [(10, 4, [4, 3, 3]), (128, 72, [64, 64]), (5, 3, [3, 2]), (3, 8, [3]),
                                               (4, 1, [1, 1, 1, 1]), (7, 7, [7])])
def test_chunks_are_balanced(total, most, sizes):
    chunks = G.balanced_chunks(total, most)
    assert [c for _, c in chunks] == sizes
    assert [h0 for h0, _ in chunks] == [sum(sizes[:i]) for i in range(len(sizes))]


def test_chunk_size_from_the_cap():
    """The default cap (2.25 GiB) holds one GQA 32/8 s16384 kv head with its shares; b4 s4096 MHA still splits 64 +
    64 (the cap's 72 heads, balanced); nothing fits: 0."""
    from types import SimpleNamespace as NS
    ctx = NS(options={}, profile=None, env=NS(total_memory=141 << 30))
    bf16 = torch.bfloat16
    assert G.kv_heads_per_chunk(ctx, 1, 8, 4, 16384, 16384, bf16) == 1
    assert 4 * G.slab_bytes(16384, 16384, bf16) + A._split_bytes(4, 1, 16384, 128) <= G.workspace_cap(ctx)
    assert G.kv_heads_per_chunk(ctx, 4, 32, 1, 4096, 4096, bf16) == 64
    assert G.kv_heads_per_chunk(ctx, 1, 32, 1, 16384, 16384, bf16) == 4
    assert G.kv_heads_per_chunk(NS(options={"workspace_cap": 1 << 20}, profile=None, env=None),
                                1, 8, 4, 16384, 16384, bf16) == 0


def test_split_shares_count_against_the_workspace_cap(monkeypatch):
    """The dS variant offers SPLIT only when its workspace and the shares fit the cap together; the two-kernel
    variant when all kv heads' shares do."""
    seen = {}
    real = A._with_split

    def spy(cfgs, group, q, fits=True):
        seen.setdefault("fits", []).append(fits)
        return real(cfgs, group, q, fits)
    monkeypatch.setattr(A, "_with_split", spy)
    b, hq, hkv, s, d = 1, 4, 2, 40, 32
    slab = G.slab_bytes(s, s, torch.float16)
    monkeypatch.setattr(G, "DS_WORKSPACE_CAP", 2 * slab)              # one kv head's dS slabs, nothing more
    _grads(b, hq, hkv, s, s, d, True, "ds")
    assert seen.pop("fits") == [False]
    monkeypatch.setattr(G, "DS_WORKSPACE_CAP", 2 * slab + A._split_bytes(2, 1, s, d))
    _grads(b, hq, hkv, s, s, d, True, "ds")
    assert seen.pop("fits") == [True]
    monkeypatch.setattr(G, "DS_WORKSPACE_CAP", A._split_bytes(2, 2, s, d) - 1)
    _grads(b, hq, hkv, s, s, d, True, "kernels")
    assert seen.pop("fits") == [False]


def test_ds_variant_refused_with_reasons_when_the_workspace_does_not_fit(monkeypatch):
    monkeypatch.setattr(G, "DS_WORKSPACE_CAP", 1024)
    with pytest.raises(ValueError, match=r"flash_attention backward: variant 'ds' cannot run.*bytes.*cap 1024"):
        _grads(1, 2, 2, 40, 40, 32, True, "ds")
    with pytest.raises(ValueError, match=r"variant 'ds_pipe' cannot run"):   # CPU: no second stream
        _grads(1, 2, 2, 40, 40, 32, True, "ds_pipe")


def test_measured_choice_offers_the_ds_variants_only_where_they_fit(monkeypatch):
    """The variant tuner sees "kernels" always, "ds" when the cap holds a kv head, never "ds_pipe" on CPU."""
    offered = []
    real = A._BWD_VARIANT.pick

    def spy(key, configs, launch, autotune):
        offered.append([c["variant"] for c in configs])
        return real(key, configs, launch, autotune)
    monkeypatch.setattr(A._BWD_VARIANT, "pick", spy)
    q = torch.randn(1, 2, 19, 32, dtype=torch.float16, requires_grad=True)
    with opsadv.use_backend("cuda", impls={"flash_attention": "cuda.triton.flash_attention"}):
        opsadv.ops.flash_attention(q, q, q, causal=True).sum().backward()
        monkeypatch.setattr(G, "DS_WORKSPACE_CAP", 16)
        opsadv.ops.flash_attention(q, q, q, causal=True).sum().backward()
    assert offered == [["kernels", "ds"], ["kernels"]]


def test_workspace_cap_option(monkeypatch):
    """use_backend("cuda", workspace_cap=N) bounds the dS workspace (0: the variant is never offered); bad values
    are refused naming the option."""
    from opsadv.errors import InvalidArgumentError
    offered = []
    real = A._BWD_VARIANT.pick
    monkeypatch.setattr(A._BWD_VARIANT, "pick", lambda key, configs, launch, autotune: offered.append(
        [c["variant"] for c in configs]) or real(key, configs, launch, autotune))
    q = torch.randn(1, 2, 19, 32, dtype=torch.float16, requires_grad=True)
    one = G.slab_bytes(19, 19, torch.float16)
    for cap in (0, one - 1, one):
        with opsadv.use_backend("cuda", workspace_cap=cap, impls={"flash_attention": "cuda.triton.flash_attention"}):
            opsadv.ops.flash_attention(q, q, q, causal=True).sum().backward()
    assert offered == [["kernels"], ["kernels"], ["kernels", "ds"]]
    for bad in (-1, 1.5, True, "1G"):
        with pytest.raises(InvalidArgumentError, match="workspace_cap"):
            opsadv.use_backend("cuda", workspace_cap=bad)


def test_default_cap_follows_device_memory():
    from types import SimpleNamespace as NS
    env = lambda total: NS(total_memory=total)     # noqa: E731
    assert G.workspace_cap(NS(options={}, profile=None, env=env(None))) == G.DS_WORKSPACE_CAP
    assert G.workspace_cap(NS(options={}, profile=None, env=env(141 << 30))) == G.DS_WORKSPACE_CAP     # H200
    assert G.workspace_cap(NS(options={}, profile=None, env=env(24 << 30))) == (24 << 30) // G.DS_MEMORY_SHARE
    assert G.workspace_cap(NS(options={}, profile=NS(workspace_cap_bytes=64 << 20), env=env(24 << 30))) == 64 << 20
    assert G.workspace_cap(NS(options={"workspace_cap": 0}, profile=None, env=env(24 << 30))) == 0


@requires_gpu
@pytest.mark.parametrize("variant", ["ds", "ds_pipe"])
@pytest.mark.parametrize("b,hq,hkv,sq,sk,d,causal", [(2, 8, 2, 1000, 1000, 128, True), (1, 4, 4, 333, 200, 64, True),
                                                      (1, 4, 2, 257, 300, 96, False), (2, 4, 4, 1, 77, 128, True),
                                                      (1, 8, 8, 2048, 2048, 128, False)])
def test_gpu_ds_backward(variant, b, hq, hkv, sq, sk, d, causal, seed, monkeypatch):
    monkeypatch.setattr(A, "_autotune", lambda ctx, device: False)
    made = _nan_workspace(monkeypatch)
    # two kv heads per chunk at most, so ds_pipe alternates its two workspaces over several chunks
    monkeypatch.setattr(G, "DS_WORKSPACE_CAP", 2 * (hq // hkv) * G.slab_bytes(sq, sk, torch.bfloat16))
    grads, ref = _grads(b, hq, hkv, sq, sk, d, causal, variant, device="cuda", dtype=torch.bfloat16, scale=0.1)
    assert len(made) == (2 if variant == "ds_pipe" else 1)
    for name, x, y in zip(("dq", "dk", "dv"), grads, ref):
        assert not torch.isnan(x).any(), name
        assert rel_err(x, y) < 1.5e-2, (name, rel_err(x, y))


@requires_gpu
@pytest.mark.parametrize("b,hq,hkv,sq,sk,d,causal", [(2, 8, 2, 1000, 1000, 128, True), (1, 4, 4, 333, 200, 64, True),
                                                      (1, 8, 8, 2048, 2048, 128, False)])
def test_gpu_ds_stored_through_a_descriptor(b, hq, hkv, sq, sk, d, causal, seed, monkeypatch):
    monkeypatch.setattr(A, "_autotune", lambda ctx, device: False)
    _nan_workspace(monkeypatch)
    orig = A._configs     # both descriptor paths: the dK/dV kernel's dS store and the dQ GEMM's loads
    monkeypatch.setattr(A, "_configs", lambda ctx, which, d_, tma_ok: [
        {**c, "DS_TMA": tma_ok} if which == "bwd_kv" else {**c, "TMA": tma_ok} if which == "bwd_dsq" else c
        for c in orig(ctx, which, d_, tma_ok)])
    grads, ref = _grads(b, hq, hkv, sq, sk, d, causal, "ds", device="cuda", dtype=torch.bfloat16, scale=0.1)
    for name, x, y in zip(("dq", "dk", "dv"), grads, ref):
        assert not torch.isnan(x).any(), name
        assert rel_err(x, y) < 1.5e-2, (name, rel_err(x, y))


_DS_COMPILE = r"""
import json, os, re
os.environ.pop("TRITON_INTERPRET", None)
import torch
from triton.tools.tensor_descriptor import TensorDescriptor
from opsadv.backends.triton_common.flash_attention import dq_gemm as G
from opsadv.backends.triton_common.flash_attention import attention as A
from opsadv.testing.sm90 import compile_sm90
b, h, s, d = 4, 32, 4096, 128
q = torch.randn(b, h, s, d, dtype=torch.bfloat16)
lse2 = torch.empty(b, h, s)
ws = torch.empty(2, s, s, dtype=torch.bfloat16)
out = {}
for bm, bn, w in ((64, 64, 4), (64, 64, 8)):
    qd = A.desc_bhsd(q, bm)
    ds = TensorDescriptor(ws, list(ws.shape), list(ws.stride()), [1, bn, bm])
    args = (q, q, q, q, q, q, lse2, lse2, lse2, None, qd, qd) + q.stride()[:3] * 6 + (h, 1, s, s, 0, 0.1, 0.08)
    kw = dict(zip(A._bwd_kv_kernel.arg_names, args), HEAD_DIM=d, BLOCK_D=d, BLOCK_M=bm, BLOCK_N=bn, CAUSAL=True,
              EVEN_M=True, EVEN_N=True, ATOMIC_DQ=False, DQ_TMA=False, TMA=True, DS=ds, s_dss=ws.stride(0),
              s_dsn=ws.stride(1), BHK0=0, DS_STORE=True, DS_TMA=True)
    r = compile_sm90(A._bwd_kv_kernel, kw, num_warps=w, num_stages=2)
    out[f"kv{w}"] = {"spills": r["spill_stores"] + r["spill_loads"],
                     "bulk_stores": len(re.findall(r"cp\.async\.bulk\.tensor\.3d\.global\.shared", r["ptx"]))}
dsd = TensorDescriptor(ws, list(ws.shape), list(ws.stride()), [1, 64, 128])
args = (ws, q, q, dsd, A.desc_bhsd(q, 64), ws.stride(0), ws.stride(1)) + q.stride()[:3] * 2 + (h, 1, 0, s, s, 0, 0.08)
kw = dict(zip(G._dq_gemm_kernel.arg_names, args), HEAD_DIM=d, BLOCK_D=d, BLOCK_M=128, BLOCK_N=64, CAUSAL=True,
          EVEN_M=True, TMA=True)
r = compile_sm90(G._dq_gemm_kernel, kw, num_warps=8, num_stages=4)
out["dq"] = {"spills": r["spill_stores"] + r["spill_loads"], "tma_loads": r["tma_loads"]}
print(json.dumps(out))
"""


def test_ds_paths_compile_for_sm90():
    """Compiled for sm_90a without a GPU (ptxas): the dK/dV kernel's descriptor store of dS is one bulk tensor copy
    per loop, the dQ GEMM loads through TMA; at d128 causal with the dS store the 4-warp 64x64 tile spills (its
    accumulators and dS) and the 8-warp one does not, which is why the h100 space offers it."""
    import json
    from conftest import run_sm90_compile
    r = json.loads(run_sm90_compile(["-c", _DS_COMPILE]).strip().splitlines()[-1])
    assert r["kv4"]["bulk_stores"] > 0 and r["kv8"]["bulk_stores"] > 0
    assert r["kv4"]["spills"] > 0 and r["kv8"]["spills"] == 0
    assert r["dq"]["tma_loads"] > 0 and r["dq"]["spills"] == 0


_SPLIT_COMPILE = r"""
import json, os
os.environ.pop("TRITON_INTERPRET", None)
import torch
from triton.tools.tensor_descriptor import TensorDescriptor
from opsadv.backends.triton_common.flash_attention import attention as A
from opsadv.testing.sm90 import compile_sm90
b, h, g, s, d = 1, 32, 4, 16384, 128
q = torch.randn(b, h, s, d, dtype=torch.bfloat16)
kv = torch.randn(b, h // g, s, d, dtype=torch.bfloat16)
part = torch.empty(g, b, h // g, s, d)
lse2 = torch.empty(b, h, s)
ws = torch.empty(4, s, s, dtype=torch.bfloat16)
qd = A.desc_bhsd(q, 64)
ds = TensorDescriptor(ws, list(ws.shape), list(ws.stride()), [1, 64, 64])
out = {}
for split in (False, True):
    dk = part if split else kv
    args = (q, kv, kv, q, dk, dk, lse2, lse2, lse2, None, qd, qd) + q.stride()[:3] + kv.stride()[:3] * 2 + \
        q.stride()[:3] + dk.stride()[-4:-1] * 2 + (h, g, s, s, 0, 0.1, 0.08)
    kw = dict(zip(A._bwd_kv_kernel.arg_names, args), HEAD_DIM=d, BLOCK_D=d, BLOCK_M=64, BLOCK_N=64, CAUSAL=True,
              EVEN_M=True, EVEN_N=True, ATOMIC_DQ=False, DQ_TMA=False, TMA=True, DS=ds, s_dss=ws.stride(0),
              s_dsn=ws.stride(1), BHK0=0, DS_STORE=True, DS_TMA=True, LPT=True, s_dkg=part.stride(0),
              s_dvg=part.stride(0), SPLIT=split)
    r = compile_sm90(A._bwd_kv_kernel, kw, num_warps=8, num_stages=2)
    out[f"split{int(split)}"] = {"registers": r["registers"], "spills": r["spill_stores"] + r["spill_loads"]}
args = (part, part, kv, kv, part.stride(0)) + kv.stride()[:3] * 2 + (h // g, g, s, 0)
kw = dict(zip(A._bwd_group_sum_kernel.arg_names, args), HEAD_DIM=d, BLOCK_D=d, BLOCK_N=32)
r = compile_sm90(A._bwd_group_sum_kernel, kw, num_warps=4, num_stages=2)
out["sum"] = {"registers": r["registers"], "spills": r["spill_stores"] + r["spill_loads"]}
print(json.dumps(out))
"""


def test_split_compiles_for_sm90_like_the_grouped_kernel():
    """SPLIT changes which q heads a dK/dV program walks, not its loop body: compiled for sm_90a (ptxas, GQA 32/8
    d128 causal, the dS store through a descriptor, 8 warps) it spills no more than the grouped kernel, and the
    group sum kernel compiles without spills."""
    import json
    from conftest import run_sm90_compile
    r = json.loads(run_sm90_compile(["-c", _SPLIT_COMPILE]).strip().splitlines()[-1])
    assert r["split1"]["spills"] <= r["split0"]["spills"], r
    assert r["sum"]["spills"] == 0, r


@requires_gpu
@pytest.mark.parametrize("variant", ["ds", "ds_pipe"])
def test_gpu_ds_backward_under_cuda_graph_capture(variant, seed, monkeypatch):
    """The dS variants captured in a CUDA graph (workspace from the graph's pool; ds_pipe's side stream and events
    inside the capture) replay to the eager result."""
    monkeypatch.setattr(A, "_autotune", lambda ctx, device: False)
    monkeypatch.setattr(G, "DS_WORKSPACE_CAP", 2 * G.slab_bytes(512, 512, torch.bfloat16))   # 4 chunks of 2 heads
    b, h, s, d = 2, 4, 500, 128
    q, k, v, do = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    with opsadv.use_backend("cuda"):
        _, r = dispatch.explain_spec(OA._spec(q, k, None, True, True))
    o, lse = A.flash_fwd(r.ctx, q, k, v, None, True, 0.1)
    want = A.flash_bwd_variant(r.ctx, do, q, k, v, o, lse, True, 0.1, variant)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):                 # warm-up outside the capture (compiles, allocator)
        A.flash_bwd_variant(r.ctx, do, q, k, v, o, lse, True, 0.1, variant)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = A.flash_bwd_variant(r.ctx, do, q, k, v, o, lse, True, 0.1, variant)
    graph.replay()
    torch.cuda.synchronize()
    for x, y in zip(got, want):
        assert torch.equal(x, y)                  # deterministic: the replay gives the same bits


@requires_gpu
@pytest.mark.parametrize("variant", ["ds", "kernels"])
def test_gpu_longest_first_launch_order(variant, seed, monkeypatch):
    monkeypatch.setattr(A, "_autotune", lambda ctx, device: False)
    _nan_workspace(monkeypatch)
    orig = A._configs
    monkeypatch.setattr(A, "_configs", lambda ctx, which, d_, tma_ok: [
        {**c, "LPT": True} if which == "bwd_kv" else c for c in orig(ctx, which, d_, tma_ok)])
    grads, ref = _grads(2, 8, 2, 1000, 1000, 128, True, variant, device="cuda", dtype=torch.bfloat16, scale=0.1)
    for name, x, y in zip(("dq", "dk", "dv"), grads, ref):
        assert not torch.isnan(x).any(), name
        assert rel_err(x, y) < 1.5e-2, (name, rel_err(x, y))


@requires_gpu
@pytest.mark.parametrize("lpt", [False, True])
@pytest.mark.parametrize("variant", ["ds", "kernels", "ds_pipe"])
def test_gpu_split_group_dk_dv(variant, lpt, seed, monkeypatch):
    """SPLIT on the GPU: bf16 GQA 8/2, 1000 tokens (ragged), causal, the profile's tiles (TMA where they work), the
    dS workspace capped to two kv heads per chunk (one in each of ds_pipe's half-size workspaces), shares and outputs
    NaN-filled first."""
    monkeypatch.setattr(A, "_autotune", lambda ctx, device: False)
    monkeypatch.setenv("OPSADV_POISON_OUTPUTS", "1")
    _nan_workspace(monkeypatch)
    monkeypatch.setattr(G, "DS_WORKSPACE_CAP", 2 * 4 * G.slab_bytes(1000, 1000, torch.bfloat16))
    orig = A._configs
    monkeypatch.setattr(A, "_configs", lambda ctx, which, d_, tma_ok: [
        {**c, "SPLIT": True, "LPT": lpt} if which == "bwd_kv" else c for c in orig(ctx, which, d_, tma_ok)])
    grads, ref = _grads(2, 8, 2, 1000, 1000, 128, True, variant, device="cuda", dtype=torch.bfloat16, scale=0.1)
    for name, x, y in zip(("dq", "dk", "dv"), grads, ref):
        assert not torch.isnan(x).any(), name
        assert rel_err(x, y) < 1.5e-2, (name, rel_err(x, y))
