"""The jetson backend: detection from faked Tegra files and device properties, options, the
re-registered cuda kernels under the jetson profile (Triton interpreter on CPU), and the chunked
attention / GEMM that bound workspace."""
import dataclasses
import importlib.util

import pytest
import torch

import opsadv
from opsadv.backends.jetson import chunking as C
from opsadv.backends.jetson import detect as D
from opsadv.backends.jetson import opsadv_probe
from opsadv.backends.jetson.attention import _bwd as math_bwd
from opsadv.backends.jetson.attention import _fwd as math_fwd
from opsadv.ops.flash_attention.reference import attention_bwd, attention_fwd
from opsadv.ops.gemm.reference import gemm_bwd, gemm_fwd, swiglu_bwd, swiglu_fwd
from opsadv.ops.norm.reference import rms_norm_fwd
from opsadv.core.errors import BackendUnavailableError, InvalidArgumentError, UnknownOptionError
from opsadv.core.kernel import CallSpec, Profile
from opsadv.registry import get_registry, reset_registry

from conftest import rel_err

GIB = 1 << 30
ORIN = dict(device_type="cuda", device_name="Orin", device_count=1, compute_capability=(8, 7), sm_count=8,
            total_memory=7 * GIB, shared_memory_per_block_optin=163 * 1024, l2_cache_size=2 << 20,
            integrated=True, unified_memory=True)
XAVIER = dict(ORIN, device_name="Xavier", compute_capability=(7, 2), shared_memory_per_block_optin=96 * 1024)
THOR = dict(ORIN, device_name="NVIDIA Thor", compute_capability=(11, 0), total_memory=122 * GIB)
SPARK = dict(ORIN, device_name="NVIDIA GB10", compute_capability=(12, 1), total_memory=119 * GIB)
BOARDS = {   # device-tree model, compatible, L4T release line
    "orin": ("NVIDIA Jetson Orin Nano Developer Kit", ["nvidia,p3768-0000+p3767-0005", "nvidia,tegra234"],
             "# R36 (release), REVISION: 3.0, GCID: 36923193, BOARD: generic, EABI: aarch64, DATE: 2024"),
    "xavier": ("NVIDIA Jetson Xavier NX Developer Kit", ["nvidia,p3509-0000+p3668-0001", "nvidia,tegra194"],
               "# R35 (release), REVISION: 4.1, GCID: 33958178, BOARD: t186ref, EABI: aarch64, DATE: 2023"),
    "thor": ("NVIDIA Jetson AGX Thor Developer Kit", ["nvidia,p3971-0000", "nvidia,tegra264"],
             "# R38 (release), REVISION: 2.0, GCID: 41000000, BOARD: generic, EABI: aarch64, DATE: 2025"),
}


def fake_root(tmp_path, board: str | None, mem_available_kib: int = 5 << 20):
    (tmp_path / "proc/device-tree").mkdir(parents=True)
    (tmp_path / "proc/meminfo").write_text(f"MemTotal: {8 << 20} kB\nMemAvailable: {mem_available_kib} kB\n")
    if board is not None:
        model, compat, release = BOARDS[board]
        (tmp_path / "etc").mkdir()
        (tmp_path / "etc/nv_tegra_release").write_text(release + "\n")
        (tmp_path / "proc/device-tree/model").write_bytes(model.encode() + b"\x00")
        (tmp_path / "proc/device-tree/compatible").write_bytes(b"".join(c.encode() + b"\x00" for c in compat))
    return tmp_path


def fake_env(tmp_path, board, props, **kw):
    return opsadv.detect(root=fake_root(tmp_path, board, **kw), cuda_properties=lambda errors: dict(props),
                         environ={"TRITON_INTERPRET": "1"})


@pytest.fixture
def registry_with(tmp_path):
    """Reset the registry with a faked EnvInfo; rebuilt from the real machine afterwards."""
    def make(env):
        return reset_registry(env)
    yield make
    reset_registry()


# ---- detection and profile selection -------------------------------------------------------------
@pytest.mark.parametrize("board,props,gen,dtype,l4t", [
    ("orin", ORIN, "orin", "bfloat16", "36.3.0"),
    ("xavier", XAVIER, "xavier", "float16", "35.4.1"),
    ("thor", THOR, "thor", "bfloat16", "38.2.0"),
])
def test_jetson_detected_and_profile_selected(tmp_path, registry_with, board, props, gen, dtype, l4t):
    env = fake_env(tmp_path, board, props)
    assert env.is_jetson and env.mem_available == (5 << 20) * 1024
    probe = opsadv_probe(env=env)
    assert probe.available, probe.reasons
    assert probe.capabilities["generation"] == gen and probe.capabilities["compute_dtype"] == dtype
    assert probe.capabilities["l4t"] == l4t
    reg = registry_with(env)
    assert reg.auto_backend().name == "jetson"                       # auto_priority 120 > cuda's 100
    assert not reg.backends["cuda"].available                         # the cuda backend leaves Jetson to us
    b = opsadv.use_backend("auto")
    assert (b.name, b.profile) == ("jetson", "jetson")
    prof = next(p for p in reg.backends["jetson"].profiles if p.name == "jetson")
    tiles = prof.tiles["flash_attention"]["fwd"]
    assert not prof.autotune and prof.num_stages <= 2 and prof.workspace_cap_bytes
    assert all(c["BLOCK_M"] <= 64 and c["BLOCK_N"] <= 64 and c["num_stages"] <= 2 for cs in tiles.values() for c in cs)
    assert all(len(cs) == 1 for cs in tiles.values())                # fixed configs: no autotune space


def test_generation_from_properties_alone(tmp_path):
    # Tegra marker present but the model string is unknown: the compute capability decides.
    root = fake_root(tmp_path, "orin")
    (root / "proc/device-tree/compatible").write_bytes(b"nvidia,tegra\x00")
    (root / "proc/device-tree/model").write_bytes(b"custom carrier\x00")
    env = opsadv.detect(root=root, cuda_properties=lambda e: dict(XAVIER))
    assert D.generation(env) == "xavier" and not D.has_bf16(env)


def test_dgx_spark_like_integrated_gpu_is_not_a_jetson(tmp_path, registry_with):
    env = fake_env(tmp_path, None, SPARK)
    assert env.integrated and not env.is_jetson and D.generation(env) is None
    probe = opsadv_probe(env=env)
    assert not probe.available
    assert any("DGX Spark" in r for r in probe.reasons) and any("nv_tegra_release" in r for r in probe.reasons)
    reg = registry_with(env)
    assert reg.backends["cuda"].available and reg.auto_backend().name == "cuda"
    with pytest.raises(BackendUnavailableError) as ei:
        opsadv.use_backend("jetson")
    assert "DGX Spark" in str(ei.value)


def test_use_backend_jetson_on_this_machine_says_why():
    if get_registry().env.is_jetson:
        pytest.skip("this machine is a Jetson")
    with pytest.raises(BackendUnavailableError) as ei:
        opsadv.use_backend("jetson")
    assert ei.value.reasons and "nv_tegra_release" in str(ei.value)


def test_discrete_gpu_on_a_tegra_board_is_not_a_jetson(tmp_path):
    env = fake_env(tmp_path, "orin", dict(ORIN, integrated=False, unified_memory=False, compute_capability=(8, 6)))
    assert not env.is_jetson
    assert any("discrete" in r for r in opsadv_probe(env=env).reasons)


# ---- options ------------------------------------------------------------------------------------
def test_memory_budget_option(tmp_path, registry_with):
    registry_with(fake_env(tmp_path, "orin", ORIN))
    assert dict(opsadv.use_backend("jetson").policy.options)["memory_budget"] == (5 << 20) * 1024   # MemAvailable
    opts = dict(opsadv.use_backend("jetson", memory_budget="3GiB").policy.options)
    assert opts["memory_budget"] == 3 * GIB and "memory_budget" in opts["memory_budget_source"]
    assert dict(opsadv.use_backend("jetson", memory_budget="50%").policy.options)["memory_budget"] == (5 << 20) * 512
    assert dict(opsadv.use_backend("jetson", memory_budget=123456).policy.options)["memory_budget"] == 123456
    with pytest.warns(RuntimeWarning, match="exceeds MemAvailable"):
        opsadv.use_backend("jetson", memory_budget="6GiB")
    for bad in ("3 parsecs", "-1GiB", 0, 1.5, True, "0MiB", "150%"):
        with pytest.raises(InvalidArgumentError, match="memory_budget"):
            opsadv.use_backend("jetson", memory_budget=bad)
    with pytest.raises(UnknownOptionError, match="tile_sizes"):
        opsadv.use_backend("jetson", tile_sizes=64)
    assert dict(opsadv.use_backend("jetson", tile_size=32).policy.options)["tile_size"] == 32   # the seed option
    with pytest.raises(InvalidArgumentError, match="tile_size"):
        opsadv.use_backend("jetson", tile_size=24)
    opts = dict(opsadv.use_backend("jetson", mem_opt="balanced").policy.options)
    assert opts["mem_opt"] == 2
    with pytest.raises(InvalidArgumentError, match="mem_opt"):
        opsadv.use_backend("jetson", mem_opt=7)


def test_jetson_impls_reuse_cuda_kernels(tmp_path, registry_with):
    reg = registry_with(fake_env(tmp_path, "orin", ORIN))
    ids = {i.id for i in reg.backends["jetson"].impls}
    assert ids and all(i.startswith("jetson.") for i in ids)
    assert "jetson.chunked_math_attention" in ids
    for mod, expect in (("flash_attention.attention", "jetson.triton.flash_attention"),
                        ("gemm.gemm", "jetson.triton.gemm"), ("gemm.gemm", "jetson.cublas.gemm_epilogue")):
        if importlib.util.find_spec(f"opsadv.backends.triton_common.{mod}") is not None:
            assert expect in ids
    assert all(i.backend == "jetson" for i in reg.backends["jetson"].impls)


def test_xavier_rejects_bf16_with_a_reason(tmp_path, registry_with):
    env = dataclasses.replace(fake_env(tmp_path, "xavier", XAVIER), triton_interpret=False)
    reg = registry_with(env)
    spec = CallSpec("flash_attention", "cuda", torch.bfloat16, frozenset({"causal"}), (16, 16, 16), head_dim=32,
                    shapes=((1, 2, 16, 32), (1, 2, 16, 32)))
    for impl in reg.backends["jetson"].impls:
        if impl.op == "flash_attention":
            why = impl.rejection_reasons(spec, env, experimental_ok=False, deterministic=False)
            assert any(("float16" in r or "compute capability >=" in r) and "7.2" in r for r in why), (impl.id, why)
            if impl.id == "jetson.chunked_math_attention":
                assert any("run the model in float16" in r for r in why)
    ok = dataclasses.replace(spec, dtype=torch.float16)
    math = next(i for i in reg.backends["jetson"].impls if i.id == "jetson.chunked_math_attention")
    assert math.rejection_reasons(ok, env, experimental_ok=False, deterministic=False) == []


# ---- kernels under the jetson profile (Triton interpreter on CPU) -------------------------------
def _need(mod):
    if importlib.util.find_spec(f"opsadv.backends.triton_common.{mod}") is None:
        pytest.skip(f"opsadv.backends.triton_common.{mod} is not written yet")


@pytest.fixture
def orin(tmp_path, registry_with):
    registry_with(fake_env(tmp_path, "orin", ORIN))
    with opsadv.use_backend("jetson") as b:
        yield b


def test_flash_attention_jetson_matches_reference(orin, seed):
    _need("flash_attention.attention")
    for b, hq, hkv, sq, sk, d, causal in ((1, 2, 1, 37, 70, 32, True), (2, 2, 2, 65, 65, 64, False)):
        q = torch.randn(b, hq, sq, d, dtype=torch.float16, requires_grad=True)
        k = torch.randn(b, hkv, sk, d, dtype=torch.float16, requires_grad=True)
        v = torch.randn(b, hkv, sk, d, dtype=torch.float16, requires_grad=True)
        with opsadv.trace() as t:
            o = opsadv.ops.flash_attention(q, k, v, causal=causal)
        assert t.counts and all(i.startswith("jetson.triton.flash_attention") for i in t.counts), t.counts
        want, _ = attention_fwd(None, q.double(), k.double(), v.double(), None, causal, d ** -0.5)
        assert rel_err(o, want) < 2e-3
        g = torch.randn_like(o)
        o.backward(g)
        dq, dk, dv = attention_bwd(None, g.double(), q.double(), k.double(), v.double(), want,
                                       attention_fwd(None, q.double(), k.double(), v.double(), None, causal,
                                                         d ** -0.5)[1], None, causal, d ** -0.5)
        for got, ref in ((q.grad, dq), (k.grad, dk), (v.grad, dv)):
            assert rel_err(got, ref) < 5e-3


def test_gemm_jetson_matches_reference(orin, seed):
    _need("gemm.gemm")
    a = torch.randn(3, 45, 96, dtype=torch.float16)
    w = torch.randn(96, 80, dtype=torch.float16) / 10
    bias = torch.randn(80, dtype=torch.float16)
    with opsadv.trace() as t:
        out = opsadv.ops.gemm(a, w, bias=bias, activation="gelu_tanh")
    assert all(i.startswith("jetson.") for i in t.counts)
    want = gemm_fwd(None, a.double(), w.double(), bias.double(), "gelu_tanh", None, 1.0)
    assert rel_err(out, want) < 2e-3


def test_norm_jetson_matches_reference(orin, seed):
    _need("norm.norm")
    x = torch.randn(7, 130, dtype=torch.float16)
    w = torch.randn(130, dtype=torch.float16)
    with opsadv.trace() as t:
        y = opsadv.ops.rms_norm(x, w, eps=1e-6)
    assert all(i.startswith("jetson.") for i in t.counts)
    want = rms_norm_fwd(None, x.double(), w.double(), 1e-6, None, 0.0)[0]
    assert rel_err(y, want) < 2e-3


def test_math_attention_through_the_op_chunks_under_a_small_budget(tmp_path, registry_with, seed):
    # head_dim 24 is not in the Triton kernel's list: the chunked math attention serves it.
    registry_with(fake_env(tmp_path, "xavier", XAVIER))
    q = torch.randn(2, 4, 100, 24, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 2, 90, 24, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 2, 90, 24, dtype=torch.float64, requires_grad=True)
    mask = torch.rand(1, 1, 100, 90) > 0.2
    want, lse = attention_fwd(None, q, k, v, mask, True, 0.3)
    # per query row: b*hq*sk*16 bytes = 11520; a budget of 4 * 64 rows' worth forces two chunks
    with opsadv.use_backend("jetson", memory_budget=4 * 64 * 11520):
        assert C.chunk_rows(100, 11520, 64 * 11520) == 64
        with opsadv.trace() as t:
            o = opsadv.ops.flash_attention(q, k, v, causal=True, scale=0.3, attn_mask=mask)
        assert set(t.counts) == {"jetson.chunked_math_attention"}
        g = torch.randn_like(o)
        o.backward(g)
    assert rel_err(o, want) < 1e-12
    for got, ref in zip((q.grad, k.grad, v.grad), attention_bwd(None, g, q, k, v, want, lse, mask, True, 0.3)):
        assert rel_err(got, ref) < 1e-12


# ---- chunking equals the unchunked call ---------------------------------------------------------
def _ctx(cap):
    prof = Profile(name="jetson", backend="jetson", workspace_cap_bytes=cap, autotune=False)
    return type("Ctx", (), {"profile": prof, "options": {}, "env": None, "spec": None})()


@pytest.mark.parametrize("sq,sk,causal,hq,hkv,mask", [
    (130, 70, True, 4, 2, None),     # s_q > s_k causal: the first 60 rows see no key at all
    (70, 130, True, 2, 2, None),     # s_q < s_k causal (decode-like, bottom-right)
    (129, 129, True, 2, 1, "bool"),
    (100, 77, False, 2, 2, "float"),
])
def test_chunked_attention_equals_unchunked(seed, sq, sk, causal, hq, hkv, mask):
    q = torch.randn(2, hq, sq, 16, dtype=torch.float64)
    k = torch.randn(2, hkv, sk, 16, dtype=torch.float64)
    v = torch.randn(2, hkv, sk, 16, dtype=torch.float64)
    m = None
    if mask == "bool":
        m = torch.rand(2, 1, sq, sk) > 0.3
    elif mask == "float":
        m = torch.randn(1, hq, sq, sk, dtype=torch.float64)
    per_row = 2 * hq * sk * 8
    ctx = _ctx(64 * per_row)                          # 64-row chunks
    assert C.attention_rows(ctx, q, k, 8) == 64
    o1, l1 = C.chunked_attention_fwd(math_fwd, 8, ctx, q, k, v, m, causal, 0.25)
    o0, l0 = attention_fwd(None, q, k, v, m, causal, 0.25)
    assert torch.allclose(o1, o0, atol=1e-12) and torch.equal(torch.isinf(l1), torch.isinf(l0))
    assert torch.allclose(l1[~torch.isinf(l0)], l0[~torch.isinf(l0)], atol=1e-12)
    dout = torch.randn_like(o0)
    g1 = C.chunked_attention_bwd(math_bwd, 8, ctx, dout, q, k, v, o1, l1, m, causal, 0.25)
    g0 = attention_bwd(None, dout, q, k, v, o0, l0, m, causal, 0.25)
    for a, b in zip(g1, g0):
        assert a.shape == b.shape and torch.allclose(a, b, atol=1e-10)


def test_chunked_triton_attention_equals_unchunked(seed):
    _need("flash_attention.attention")
    from opsadv.backends.triton_common.flash_attention.attention import flash_bwd, flash_fwd
    from opsadv.backends.jetson.profiles import JETSON
    ctx = type("Ctx", (), {"profile": JETSON, "options": {}, "env": None, "spec": None})()
    q = torch.randn(1, 2, 100, 32, dtype=torch.float16)
    k = torch.randn(1, 1, 80, 32, dtype=torch.float16)
    v = torch.randn(1, 1, 80, 32, dtype=torch.float16)
    o0, l0 = flash_fwd(ctx, q, k, v, None, True, 0.2)
    small = _ctx(64 * 2 * 80 * 8)
    small.profile = dataclasses.replace(JETSON, workspace_cap_bytes=64 * 2 * 80 * 8)
    o1, l1 = C.chunked_attention_fwd(flash_fwd, 8, small, q, k, v, None, True, 0.2)
    assert rel_err(o1, o0) < 1e-3
    fin = ~torch.isinf(l0)
    assert torch.equal(fin, ~torch.isinf(l1)) and torch.allclose(l1[fin], l0[fin], atol=1e-3)
    dout = torch.randn_like(o0)
    g0 = flash_bwd(ctx, dout, q, k, v, o0, l0, None, True, 0.2)
    g1 = C.chunked_attention_bwd(flash_bwd, 8, small, dout, q, k, v, o1, l1, None, True, 0.2)
    for a, b in zip(g1, g0):
        assert rel_err(a, b) < 2e-3


def test_chunked_gemm_equals_unchunked(seed):
    a = torch.randn(2, 100, 24, dtype=torch.float64)
    w = torch.randn(24, 40, dtype=torch.float64)
    bias = torch.randn(40, dtype=torch.float64)
    res = torch.randn(2, 100, 40, dtype=torch.float64)
    ctx = _ctx(64 * 40 * 4 * 2)                       # factor 2: 64-row chunks over 200 rows
    out = C.chunked_gemm_fwd(gemm_fwd, 2, ctx, a, w, bias, "silu", res, 0.5)
    assert torch.allclose(out, gemm_fwd(None, a, w, bias, "silu", res, 0.5), atol=1e-12)
    g = torch.randn_like(out)
    got = C.chunked_gemm_bwd(gemm_bwd, 0, ctx, g, a, w, bias, "silu", 0.5)
    for x, y in zip(got, gemm_bwd(None, g, a, w, bias, "silu", 0.5)):
        assert torch.allclose(x, y, atol=1e-10)
    wgu = torch.randn(24, 80, dtype=torch.float64)
    out = C.chunked_swiglu_fwd(swiglu_fwd, 2, ctx, a, wgu, None)
    assert torch.allclose(out, swiglu_fwd(None, a, wgu, None), atol=1e-12)
    g = torch.randn_like(out)
    got = C.chunked_swiglu_bwd(swiglu_bwd, 0, ctx, g, a, wgu, None)
    for x, y in zip(got, swiglu_bwd(None, g, a, wgu, None)):
        assert torch.allclose(x, y, atol=1e-10)


def test_chunk_rows():
    assert C.chunk_rows(100, 10, 10_000) == 100        # fits: one chunk
    assert C.chunk_rows(1000, 10, 2000) == 192          # multiple of the 64-row tile
    assert C.chunk_rows(1000, 10**9, 1) == 64          # never below one tile
    assert C.chunk_rows(1000, 0, 1) == 1000            # fused kernels declare no workspace


def test_conformance_kit_passes_on_a_faked_orin(tmp_path, registry_with):
    """The project's conformance matrix for flash_attention and the norms (quick set) against the
    reference: float32 cells exercise the chunked math attention, float16 the Triton kernels."""
    from opsadv.testing.runner import run_conformance
    registry_with(fake_env(tmp_path, "orin", ORIN))
    res = run_conformance("jetson", quick=True, graph_checks=False, ops=["flash_attention", "rms_norm"],
                          dtypes=(torch.float32, torch.float16))
    assert not [r for r in res if r.status == "fail"], [(r.op, r.dtype, r.shape_class, r.reason) for r in res
                                                        if r.status == "fail"]
    impls = {r.impl for r in res if r.status == "pass"}
    assert "jetson.chunked_math_attention" in impls
    if importlib.util.find_spec("opsadv.backends.triton_common.flash_attention.attention") is not None:
        assert any(i.startswith("jetson.triton.flash_attention") for i in impls)


def test_gqa_kv_expanding_impls_refused_above_the_cap(tmp_path, registry_with):
    env = dataclasses.replace(fake_env(tmp_path, "orin", ORIN), triton_interpret=False)
    reg = registry_with(env)
    jet = {i.id: i for i in reg.backends["jetson"].impls}
    if "jetson.sdpa.efficient" not in jet:
        pytest.skip("opsadv.backends.cuda.flash_attention.sdpa is not written yet")

    def spec(s):
        return CallSpec("flash_attention", "cuda", torch.float16, frozenset({"causal", "gqa"}), (s, s, 32),
                        head_dim=128, shapes=((1, 32, s, 128), (1, 4, s, 128)))
    with opsadv.use_backend("jetson", memory_budget="1GiB"):     # cap: min(64 MiB, 1 GiB / 4)
        big = jet["jetson.sdpa.efficient"].rejection_reasons(spec(8192), env, experimental_ok=False,
                                                             deterministic=False)
        assert any("expands K/V" in r and "128 MiB > the 64 MiB" in r for r in big), big
        for native in ("jetson.sdpa.flash", "jetson.sdpa.cudnn"):               # native GQA
            assert not jet[native].rejection_reasons(spec(8192), env, experimental_ok=False, deterministic=False)
        assert not jet["jetson.sdpa.efficient"].rejection_reasons(spec(1024), env, experimental_ok=False,
                                                                  deterministic=False)


def test_chunking_respects_the_underlying_check(seed):
    """An impl whose check() refuses causal attention with s_q != s_k (SDPA's top-left rule) is
    never handed causal query chunks: it runs unchunked."""
    from opsadv.core.kernel import KernelImpl
    seen = []

    def fn(ctx, q, k, v, m, causal, scale):
        seen.append((q.shape[2], k.shape[2]))
        return attention_fwd(ctx, q, k, v, m, causal, scale)

    def top_left_only(spec, env):
        return ["causal needs s_q == s_k"] if {"causal", "cross_length"} <= spec.features else []

    impl = KernelImpl("x.top_left", "flash_attention", "x", fn, check=top_left_only, features=frozenset({"causal"}))
    q = torch.randn(1, 2, 130, 16, dtype=torch.float64)
    ctx = _ctx(64 * 2 * 130 * 8)
    ctx.spec = CallSpec("flash_attention", "cpu", torch.float64, frozenset({"causal"}), (), head_dim=16,
                        shapes=(tuple(q.shape), tuple(q.shape)))
    o, _ = C.chunked_attention_fwd(fn, 8, ctx, q, q, q, None, True, 0.25, impl=impl)
    assert seen == [(130, 130)] and torch.allclose(o, attention_fwd(None, q, q, q, None, True, 0.25)[0])
    seen.clear()
    ctx.spec = dataclasses.replace(ctx.spec, features=frozenset())
    C.chunked_attention_fwd(fn, 8, ctx, q, q, q, None, False, 0.25, impl=impl)   # non-causal chunks are fine
    assert seen == [(64, 130), (64, 130), (2, 130)]


# ---- paged_attention: split-KV partials under the workspace cap ---------------------------------------
def test_paged_split_partials_bounded_by_the_cap(seed):
    """The split count the kernel may choose is capped so that its float32 partials (rows x Hq x (D + 1) x 4
    bytes per split) fit the workspace cap; a cap below one split's partials leaves a single split."""
    from opsadv.backends.triton_common.paged_attention.paged_attention import num_splits
    q = torch.randn(8, 1, 32, 128, dtype=torch.float16)
    per = C.paged_split_bytes(q)
    assert per == 8 * 32 * 129 * 4
    seen = []
    for cap, want in ((3 * per + 5, 3), (per // 2, 1), (1 << 40, None)):
        C.bounded_paged_fwd(lambda ctx, *a: seen.append(ctx.profile.tiles["paged_attention"]["max_splits"]),
                            _ctx(cap), q)
        assert seen[-1] == (want or 64)                 # (64: the kernel's own MAX_SPLITS, never raised)
        # a decode grid far below the SM count would take 64 splits; the capped tiles allow `seen[-1]`
        assert num_splits(2, 1 << 20, 132, {"max_splits": seen[-1]}) == seen[-1]


def test_paged_attention_jetson_splits_within_budget(orin, seed, monkeypatch):
    """Through the op on a faked Orin (Triton interpreter): a decode over a long context would split 8 ways;
    a budget whose cap holds two splits' partials gets 2, and the result still matches the reference."""
    _need("paged_attention.paged_attention")
    import opsadv.backends.triton_common.paged_attention.paged_attention as P
    from opsadv.ops.paged_attention.cases import paged_inputs
    chosen = []
    real = P.num_splits
    monkeypatch.setattr(P, "num_splits", lambda *a, **k: chosen.append(real(*a, **k)) or chosen[-1])
    args, kw = paged_inputs(torch.float16, "cpu", torch.Generator().manual_seed(0), hq=2, hkv=1, d=32, page=16,
                            lens=[2048])
    per = C.paged_split_bytes(args[0])
    with torch.no_grad(), opsadv.trace() as t:
        base = opsadv.ops.paged_attention(*args, **kw)
    assert set(t.counts) == {"jetson.triton.paged_attention"} and chosen[-1] == 8
    with torch.no_grad(), opsadv.use_backend("jetson", memory_budget=4 * (2 * per + 1)):
        out = opsadv.ops.paged_attention(*args, **kw)
    assert chosen[-1] == 2
    with torch.no_grad(), opsadv.use_backend("reference"):
        want = opsadv.ops.paged_attention(*(a.double() if a.is_floating_point() else a for a in args), **kw)
    assert rel_err(out, want) < 2e-3 and rel_err(base, want) < 2e-3
