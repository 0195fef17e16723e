"""The Gluon Hopper GEMM (impl cuda.gluon.gemm): compiled for sm_90 here, NOT yet run on a GPU.

CPU: every variant x activation x dtype x residual (with bias; plus bias-free and B-as-(N, K) cases) compiles
for sm_90 with no register spills (ptxas, no GPU needed); the impl's declaration and rejection reasons (also
when Gluon does not import); the host-side launch arguments (grid, descriptor block shapes, the (N, K) read of
an nn.Linear weight.t()); the persistent tile schedule (producer and consumers walk the same tiles, every tile
exactly once); the ring + ping-pong turn barrier protocol under random interleavings.
GPU (sm_90 only, skipped elsewhere): every variant against a float64 reference at odd shapes (full grid and
5 CTAs walking many tiles each), and forward +
backward through opsadv.ops.gemm pinned to the impl, with NaN-poisoned outputs."""
from __future__ import annotations

import random

import pytest
import torch

# one xdist worker runs this whole module, so its module-scoped fixture is built once (the README's
# `pytest -n auto --dist loadgroup`)
pytestmark = pytest.mark.xdist_group("gluon_gemm")

import opsadv
from opsadv.core.kernel import CallSpec

from barrier_sim import Bar, Ring, run
from conftest import (SM90_SCRIPT_PRELUDE, assert_gemm_close, assert_sm90_clean, assert_sm90_impl_rejections,
                      fake_cuda_env, gluon_marks, load_without_gluon, registered_impl)

GG = pytest.importorskip("opsadv.backends.cuda.gemm.gluon")
IMPL_ID = GG.IMPL_ID
needs_gluon, requires_sm90 = gluon_marks(GG)

# ---- compile for sm_90 on CPU ------------------------------------------------------------------------
# Runs in fresh interpreters without TRITON_INTERPRET (conftest turns it on for this session, and under it
# gluon.jit functions cannot be compiled), with benchmarks/gluon_fa/compile_sm90.py's helpers: bind and
# specialize like JITFunction.run, compile for sm_90 (launches nothing), count STL/LDL in the SASS, and the
# highest register each setmaxnreg region uses.
_COMPILE_SCRIPT = SM90_SCRIPT_PRELUDE + r"""
from opsadv.backends.cuda.gemm import gluon_kernel as K, gluon as GG
for variant, act, dt, bias, res, b_nk in json.loads(sys.argv[1]):
    dtype = getattr(torch, dt)
    m, n, k = 1000, 520, 264                         # tails in M, N and K
    a = torch.randn(m, k).to(dtype)
    b = torch.randn(n, k).to(dtype) if b_nk else torch.randn(k, n).to(dtype)
    out = torch.empty(m, n, dtype=dtype)
    grid, args, kw = GG.launch_args(a, b, out, torch.randn(n).to(dtype) if bias else None,
                                    torch.randn(m, n).to(dtype) if res else None, act, 0.5, variant, b_nk)
    report["-".join(map(str, (variant, act, dt, int(bias), int(res), int(b_nk))))] = kernel_report(
        compile_sm90(K.gemm_kernel, args, kw))
print(json.dumps(report))
"""

ACTS = ("none", "relu", "gelu", "gelu_tanh", "silu")
# Every variant x activation x residual with a bias in bf16; fp16 (the same registers, another cvt) for every
# variant with the epilogues that hold the most registers (gelu_tanh / silu, with the residual);
# plus bias-free and B-as-(N, K) (nn.Linear weight.t()) representatives, which change only the loads / the bias add.
# A TANH variant differs from its base schedule only in gelu_tanh / silu: those are compiled.
BASE_VARIANTS = [v for v, c in GG.ALL_VARIANTS.items() if not c.get("TANH")]
TANH_VARIANTS = [v for v, c in GG.ALL_VARIANTS.items() if c.get("TANH")]
FP16_ACTS = ("gelu_tanh", "silu")


def _full_grid(act, dt, res) -> bool:
    return dt == "bfloat16" or (act in FP16_ACTS and res)


COMPILE_CASES = ([(v, act, dt, True, res, False) for v in BASE_VARIANTS for act in ACTS
                  for dt in ("bfloat16", "float16") for res in (False, True) if _full_grid(act, dt, res)]
                 + [(v, act, dt, True, res, False) for v in TANH_VARIANTS for act in GG.TANH_ACTIVATIONS
                    for dt in ("bfloat16", "float16") for res in (False, True) if _full_grid(act, dt, res)]
                 + [(v, act, "bfloat16", False, False, False) for v in GG.ALL_VARIANTS for act in ("none", "gelu_tanh")]
                 + [(v, "silu", dt, True, True, True) for v in GG.ALL_VARIANTS for dt in ("bfloat16", "float16")])


def _key(case) -> str:
    variant, act, dt, bias, res, b_nk = case
    return "-".join(map(str, (variant, act, dt, int(bias), int(res), int(b_nk))))


@pytest.fixture(scope="module")
def sm90_compile_report():
    from conftest import run_sm90_compile_jobs
    return run_sm90_compile_jobs(_COMPILE_SCRIPT, COMPILE_CASES)


@needs_gluon
@pytest.mark.parametrize("case", COMPILE_CASES, ids=_key)
def test_compiles_for_sm90_without_spills(case, sm90_compile_report):
    assert_sm90_clean(sm90_compile_report[_key(case)], _key(case))


@needs_gluon
@pytest.mark.parametrize("base,sk", [("coop", "coop_sk"), ("coop_tanh", "coop_tanh_sk")])
def test_stream_k_variants_add_one_main_loop_copy(base, sk, sm90_compile_report):
    """A stream-K variant is its base schedule plus the chunks' copy of the same main loop: twice the wgmmas."""
    for key in [k for k in sm90_compile_report if k.startswith(base + "-")]:
        r_base, r_sk = sm90_compile_report[key], sm90_compile_report[sk + key[len(base):]]
        assert r_sk["hgmma"] == 2 * r_base["hgmma"] > 0, (key, r_base["hgmma"], r_sk["hgmma"])


@needs_gluon
@pytest.mark.parametrize("act", GG.TANH_ACTIVATIONS)
def test_tanh_variants_spend_one_mufu_op_per_element(act, sm90_compile_report):
    """coop_tanh / pingpong_tanh: the sigmoid of gelu_tanh / silu is one MUFU.TANH per element where the
    base schedule spends an EX2 and an RCP (the epilogue's MUFU work halves)."""
    for base, fast in (("coop", "coop_tanh"), ("pingpong", "pingpong_tanh"), ("coop_sk", "coop_tanh_sk")):
        b = sm90_compile_report[_key((base, act, "bfloat16", True, False, False))]["mufu"]
        f = sm90_compile_report[_key((fast, act, "bfloat16", True, False, False))]["mufu"]
        assert f["EX2"] == 0 and f["TANH"] == b["EX2"] > 0 and f["RCP"] < b["RCP"], (b, f)


def test_compile_cases_cover_every_variant_activation_dtype_residual():
    full = {(v, a, d, r) for v, a, d, b, r, nk in COMPILE_CASES if b and not nk}
    assert full == {(v, a, d, r) for v in GG.ALL_VARIANTS for a in (GG.TANH_ACTIVATIONS if v in TANH_VARIANTS else ACTS)
                    for d in ("bfloat16", "float16") for r in (False, True) if _full_grid(a, d, r)}
    assert set(TANH_VARIANTS) == {"coop_tanh", "pingpong_tanh", "coop_tanh_sk"}
    assert set(ACTS) == set(GG.ACTIVATIONS) == set(GG._K.ACT_IDS if GG._K else ACTS)


# ---- declaration and rejection reasons -------------------------------------------------------------------
def _impl():
    return registered_impl("gemm", IMPL_ID)


def _spec(dtype=torch.bfloat16, m=1000, k=264, n=520, features=(), device="cuda", backward=False):
    return CallSpec(op="gemm", device_type=device, dtype=dtype, features=frozenset(features), bucket=(m, k, n),
                    shapes=((m, k), (k, n)), backward=backward)


def _reasons(spec, env, experimental_ok=True):
    return _impl().rejection_reasons(spec, env, experimental_ok=experimental_ok, deterministic=False)


@needs_gluon
def test_declared_support_accepts_sm90_bf16_fp16_every_feature():
    from opsadv.backends.triton_common.gemm.gemm import GEMM_FEATURES
    for dt in (torch.bfloat16, torch.float16):
        for feats in ((), ("bias", "act_gelu_tanh"), tuple(sorted(GEMM_FEATURES - {"act_relu", "act_gelu",
                                                                                 "act_gelu_tanh"}))):
            assert _reasons(_spec(dt, features=feats), fake_cuda_env()) == [], (dt, feats)
            assert _reasons(_spec(dt, features=feats, backward=True), fake_cuda_env()) == []
    assert _reasons(_spec(m=1, k=8, n=8), fake_cuda_env()) == []


def test_rejection_reasons():
    env = fake_cuda_env()
    # pinned H200 conformance passed (b28714e): not experimental
    assert_sm90_impl_rejections(_impl(), _reasons, _spec)
    if not GG.UNAVAILABLE:
        assert _reasons(_spec(), env, experimental_ok=False) == []
    if not GG.UNAVAILABLE:
        assert any("multiples of 8" in r and "K=100" in r for r in _reasons(_spec(k=100), env))
        assert any("multiples of 8" in r and "N=36" in r for r in _reasons(_spec(n=36), env))
        assert any("TRITON_INTERPRET" in r for r in _reasons(_spec(), fake_cuda_env(interpret=True)))


def test_unavailable_without_gluon(monkeypatch):
    """With triton.experimental.gluon unimportable the module still imports and the impl rejects every
    call, naming the import failure."""
    mod = load_without_gluon(monkeypatch, GG, "gemm.gluon_kernel")
    assert "triton.experimental.gluon" in mod.UNAVAILABLE
    (impl,) = mod.impls(fake_cuda_env())
    assert impl.rejection_reasons(_spec(), fake_cuda_env(), experimental_ok=True, deterministic=False) == \
        [mod.UNAVAILABLE]
    with pytest.raises(RuntimeError, match="not importable"):
        mod.launch_args(torch.empty(8, 8), torch.empty(8, 8), torch.empty(8, 8))


def test_default_dispatch_unchanged_on_cpu():
    """Registered, but never chosen on the CPU / under the interpreter."""
    with opsadv.trace() as t:
        opsadv.ops.gemm(torch.randn(5, 16), torch.randn(16, 8), bias=torch.randn(8), activation="silu")
    assert IMPL_ID not in t.counts


# ---- host side ------------------------------------------------------------------------------------------
@needs_gluon
@pytest.mark.parametrize("variant", list(GG.ALL_VARIANTS))
@pytest.mark.parametrize("m,n,k,sms", [(1, 8, 8, 132), (1000, 520, 264, 132), (16384, 12288, 4096, 132),
                                       (300, 4096, 64, 7), (8192, 8192, 64, 132)])
def test_launch_args(variant, m, n, k, sms):
    cfg = GG.ALL_VARIANTS[variant]
    dt = torch.bfloat16
    a, b, out = torch.empty(m, k, dtype=dt), torch.empty(k, n, dtype=dt), torch.empty(m, n, dtype=dt)
    res, bias = torch.empty(m, n, dtype=dt), torch.empty(n, dtype=dt)
    grid, args, kw = GG.launch_args(a, b, out, bias, res, "gelu_tanh", 0.5, variant, num_sms=sms)
    tiles = -(-m // cfg["BM"]) * -(-n // cfg["BN"])
    assert grid == (min(tiles, sms),)
    a_desc, b_desc, c_desc, r_desc = args[:4]
    assert a_desc.block_shape == [cfg["BM"], cfg["BK"]]
    assert b_desc.block_shape == [cfg["BK"], cfg["BN"]]
    assert c_desc.block_shape == r_desc.block_shape == [cfg["BM"], cfg["BN"]]
    assert r_desc.base is res and c_desc.base is out and args[4] is bias
    assert args[5:9] == (m, n, k, 0.5)
    ws, flags, dp = args[9:]
    if cfg.get("STREAM_K"):           # a float32 partial tile per split tile, zeroed int32 flags
        assert dp == GG.stream_k_plan(tiles, grid[0]) and kw["STREAM_K"]
        split = max(tiles - dp, 1)
        assert ws.dtype == torch.float32 and ws.numel() == split * cfg["BM"] * cfg["BN"]
        assert flags.dtype == torch.int32 and flags.numel() == split and not flags.any()
    else:
        assert dp == tiles and ws is out and flags is out and not kw["STREAM_K"]
    assert kw["ACT"] == (3 + 8 if cfg.get("TANH") else 3) and kw["HAS_BIAS"] and kw["HAS_RES"] and not kw["B_NK"]
    assert kw["PINGPONG"] == cfg["PINGPONG"] and kw["STAGES"] == cfg["STAGES"]
    assert kw["num_warps"] == (4 if cfg["PINGPONG"] else 8)
    # no bias / residual: flags off, the output stands in for both (never read)
    grid, args, kw = GG.launch_args(a, b, out, variant=variant, num_sms=sms)
    assert args[3].base is out and args[4] is out
    assert not kw["HAS_BIAS"] and not kw["HAS_RES"] and kw["ACT"] == 0


@needs_gluon
def test_prepare_reads_linear_weight_t_as_rows():
    w = torch.empty(520, 264, dtype=torch.bfloat16)              # nn.Linear weight (N, K)
    a = torch.empty(1000, 264, dtype=torch.bfloat16)
    a2, bb, b_nk = GG.prepare(a, w.t())
    assert b_nk and bb.data_ptr() == w.data_ptr() and bb.shape == (520, 264)
    grid, args, kw = GG.launch_args(a2, bb, torch.empty(1000, 520, dtype=torch.bfloat16), b_nk=True)
    assert args[1].block_shape == [GG.VARIANTS[GG.DEFAULT_VARIANT]["BN"], GG.VARIANTS[GG.DEFAULT_VARIANT]["BK"]]
    assert kw["B_NK"]
    b = torch.empty(264, 520, dtype=torch.bfloat16)
    assert GG.prepare(a, b) == (a, b, False)
    odd = torch.randn(264, 1040).to(torch.bfloat16)[:, ::2]     # neither layout is TMA-ready: a copy (random: NaN-free)
    a2, bb, b_nk = GG.prepare(a, odd)
    assert not b_nk and bb.is_contiguous() and torch.equal(bb, odd)


# ---- the persistent tile schedule, emulated -------------------------------------------------------------
def _tile_coords(tile, num_m, num_n, group=8):
    """_gluon_gemm_kernel._tile_coords in Python."""
    per_group = group * num_n
    first_m = (tile // per_group) * group
    size_m = min(num_m - first_m, group)
    return first_m + (tile % per_group) % size_m, (tile % per_group) // size_m


@pytest.mark.parametrize("variant", list(GG.VARIANTS))
@pytest.mark.parametrize("m,n,sms", [(1, 8, 132), (1000, 520, 132), (16384, 12288, 132), (12288, 3072, 132),
                                     (8, 4096, 132), (5000, 3000, 7)])
def test_tile_schedule_covers_every_tile_once(variant, m, n, sms):
    cfg = GG.VARIANTS[variant]
    num_m, num_n = -(-m // cfg["BM"]), -(-n // cfg["BN"])
    tiles = num_m * num_n
    nprog = min(tiles, sms)
    nwg = 2 if cfg["PINGPONG"] else 1
    seen = []
    for pid in range(nprog):
        producer = list(range(pid, tiles, nprog))
        consumers = [list(range(pid + wg * nprog, tiles, nwg * nprog)) for wg in range(nwg)]
        # the consumers' tiles interleaved (local index i -> warpgroup i % nwg) are the producer's order
        merged = [consumers[i % nwg][i // nwg] for i in range(len(producer))]
        assert merged == producer
        seen += producer
    coords = [_tile_coords(t, num_m, num_n) for t in seen]
    assert sorted(coords) == [(i, j) for i in range(num_m) for j in range(num_n)]


# ---- stream-K: the plan, and the kernel's partial-sum flow emulated -------------------------------------------
SK_CASES = [(2048, 128, 132), (4096, 128, 132), (6144, 64, 132), (24, 5, 5), (160, 13, 132), (133, 1, 132),
            (9, 7, 4), (264, 3, 132), (131, 40, 132), (1000, 2, 7)]


@pytest.mark.parametrize("tiles,k_tiles,nprog", SK_CASES)
def test_stream_k_plan_covers_every_slice_once(tiles, k_tiles, nprog):
    dp = GG.stream_k_plan(tiles, nprog)
    if tiles <= nprog or tiles % nprog == 0:
        assert dp == tiles
    else:
        assert dp % nprog == 0 and nprog <= tiles - dp < 2 * nprog       # whole waves; one to two split
    seen = {}
    for pid in range(nprog):
        chunks = GG.stream_k_chunks(tiles, k_tiles, nprog, pid)
        for i, (t, kb, ke) in enumerate(chunks):
            assert dp <= t < tiles and 0 <= kb < ke <= k_tiles
            # the publish-before-wait order: a K-tail (kb > 0) only first, a K-head with a tail elsewhere only last
            assert kb == 0 or i == 0, chunks
            assert ke == k_tiles or i == len(chunks) - 1, chunks
            seen.setdefault(t, []).append((kb, ke, pid))
        for t in range(pid, dp, nprog):
            seen.setdefault(t, []).append((0, k_tiles, pid))
    assert sorted(seen) == list(range(tiles))
    for t, parts in seen.items():
        parts.sort()
        assert len(parts) <= 2, (t, parts)                                 # one partial per tile: deterministic
        assert parts[0][0] == 0 and parts[-1][1] == k_tiles
        assert all(a[1] == b[0] and a[2] + 1 == b[2] for a, b in zip(parts, parts[1:])), parts   # next CTA


@pytest.mark.parametrize("tiles,k_tiles,nprog", SK_CASES[3:])
def test_stream_k_partial_sums_rebuild_every_tile(tiles, k_tiles, nprog):
    """The kernel's flow with numbers: each CTA sums its chunks' slices; a K-tail chunk leaves its sum in the
    workspace, the K-head chunk adds it (after its own) and stores.  Every tile must equal its full K sum."""
    rng = random.Random(tiles * 1000 + k_tiles)
    slices = [[rng.randint(-99, 99) for _ in range(k_tiles)] for _ in range(tiles)]
    dp = GG.stream_k_plan(tiles, nprog)
    ws, out = {}, {}
    per_cta = [GG.stream_k_chunks(tiles, k_tiles, nprog, pid) for pid in range(nprog)]
    for pid in range(nprog):
        for t in range(pid, dp, nprog):
            out[t] = sum(slices[t])
        for t, kb, ke in per_cta[pid]:
            if kb > 0:
                assert t not in ws
                ws[t] = sum(slices[t][kb:ke])
    for pid in range(nprog):                     # every partial is published before any head waits for it
        for t, kb, ke in per_cta[pid]:
            if kb == 0:
                assert t not in out
                out[t] = sum(slices[t][kb:ke]) + (ws.pop(t) if ke < k_tiles else 0)
    assert not ws and out == {t: sum(slices[t]) for t in range(tiles)}


# ---- the ring + turn barrier protocol, emulated -----------------------------------------------------------
def emulate_protocol(tiles_per_wg, k_tiles, stages, pingpong, seed, early_release=False, chunks=None):
    """gemm_kernel's barriers under a random interleaving of the partitions and TMA completions: the
    producer fills ring position p (tile p // k_tiles, K-slice p % k_tiles) into slot p % stages after
    waiting for the slot's empty barrier; consumer warpgroup wg takes the CTA's local tiles wg, wg + nwg, ...
    (ring positions local * k_tiles + kk), waits for ready, issues the wgmma, keeps one in flight and frees
    the previous slot; with ping-pong it takes a turn per tile and passes it after its last wgmma is issued.
    Asserts no slot is overwritten while (or before) it is read and nothing deadlocks.
    early_release: a deliberately wrong consumer that frees a slot while its wgmma may still read it.
    chunks (cooperative only): after the tiles, stream-K chunks of these K-slice counts (_mma_slices per chunk)."""
    rnd = random.Random(seed)
    nwg = 2 if pingpong else 1
    n_tiles = tiles_per_wg
    lengths = [k_tiles] * n_tiles + list(chunks or [])
    total = sum(lengths)
    ready, empty = [Bar(1) for _ in range(stages)], [Bar(1) for _ in range(stages)]
    turn = [Bar(1), Bar(1)]
    turn[0].arrive()                                          # warpgroup 0 issues first
    ring = Ring(("ab",), stages, 1)

    def producer():
        for p in range(total):
            yield empty[p % stages], ((p // stages) & 1) ^ 1
            ring.load("ab", p)

    def consumer(wg):
        local = wg
        while local < len(lengths):
            it = sum(lengths[:local])
            k_tiles = lengths[local]
            if pingpong:
                yield turn[wg], (local // 2) & 1
            in_flight = []
            for kk in range(k_tiles):
                yield ready[it % stages], (it // stages) & 1
                ring.start_read("ab", it, 0)
                in_flight.append(it)
                if early_release:
                    empty[it % stages].arrive()
                yield None, None                              # others run while the wgmma is in flight
                if len(in_flight) > 1:                        # wait(1): the previous wgmma retired
                    done = in_flight.pop(0)
                    ring.end_read("ab", done, 0)
                    if not early_release:
                        empty[done % stages].arrive()
                it += 1
            if pingpong:
                turn[1 - wg].arrive()
            yield None, None
            done = in_flight.pop(0)                           # wait(0)
            ring.end_read("ab", done, 0)
            if not early_release:
                empty[done % stages].arrive()
            yield None, None                                  # the epilogue
            local += nwg

    def land(item):
        kind, st = item
        ring.land(kind, st)
        ready[st].arrive()

    run({"producer": producer(), **{f"wg{w}": consumer(w) for w in range(nwg)}}, ring.in_flight, land, rnd)
    assert ring.all_read("ab", total)


@pytest.mark.parametrize("pingpong", [False, True])
@pytest.mark.parametrize("stages", [3, 4, 5])
def test_emulated_ring_and_turn_protocol(stages, pingpong):
    for n_tiles in (0, 1, 2, 3, 5):
        for k_tiles in (1, 2, 3, 7):
            for seed in range(12):
                emulate_protocol(n_tiles, k_tiles, stages, pingpong, seed)


@pytest.mark.parametrize("stages", [3, 4])
def test_emulated_ring_protocol_with_stream_k_chunks(stages):
    for tiles, k_tiles, nprog in ((24, 5, 5), (9, 7, 4), (160, 13, 132), (1000, 2, 7)):
        dp = GG.stream_k_plan(tiles, nprog)
        for pid in (0, nprog - 1):
            lengths = [ke - kb for _, kb, ke in GG.stream_k_chunks(tiles, k_tiles, nprog, pid)]
            for seed in range(8):
                emulate_protocol(len(range(pid, dp, nprog)), k_tiles, stages, False, seed, chunks=lengths)


def test_emulated_protocol_detects_an_early_release():
    with pytest.raises(AssertionError, match="overwritten"):
        for seed in range(200):
            emulate_protocol(4, 7, 3, True, seed, early_release=True)


# ---- on an H100/H200 ------------------------------------------------------------------------------------
def _ref(a, b, bias, act, res, alpha):
    import torch.nn.functional as F
    z = alpha * (a.double().reshape(-1, a.shape[-1]) @ b.double())
    if bias is not None:
        z = z + bias.double()
    z = {"none": lambda x: x, "relu": F.relu, "gelu": F.gelu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
         "silu": F.silu}[act](z)
    z = z.reshape(*a.shape[:-1], b.shape[1])
    return z + res.double() if res is not None else z


GPU_SHAPES = [(1, 8, 8), (7, 24, 40), (127, 136, 264), (1000, 520, 264), (4096, 1032, 776), (1000, 4096, 1024),
              (2100, 1096, 136)]


@requires_sm90
@pytest.mark.parametrize("variant", list(GG.ALL_VARIANTS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m,n,k", GPU_SHAPES)
def test_gpu_every_variant(variant, dtype, m, n, k, seed, monkeypatch):
    monkeypatch.setenv("OPSADV_POISON_OUTPUTS", "1")
    a = torch.randn(m, k, device="cuda", dtype=dtype)
    b = torch.randn(k, n, device="cuda", dtype=dtype) / k ** 0.5
    # every activation in bf16; fp16 on two (each (activation, flags) is its own ~2 s compile per variant)
    for act in ACTS if dtype == torch.bfloat16 else ("none", "gelu"):
        for has_bias, has_res, alpha in ((False, False, 1.0), (True, False, 0.7), (True, True, 1.3)):
            bias = torch.randn(n, device="cuda", dtype=dtype) if has_bias else None
            res = torch.randn(m, n, device="cuda", dtype=dtype) if has_res else None
            ref = _ref(a, b, bias, act, res, alpha)
            for cap in (None, 5):      # 5 CTAs: each walks many tiles (ring wrap, ping-pong turns, store waits)
                out = GG.gemm_fwd(None, a, b, bias, act, res, alpha, variant=variant, num_sms=cap)
                assert_gemm_close(out, ref, dtype)
    # nn.Linear weight.t(): read as (N, K) rows
    w = torch.randn(n, k, device="cuda", dtype=dtype) / k ** 0.5
    out = GG.gemm_fwd(None, a, w.t(), None, "silu", None, 1.0, variant=variant)
    assert_gemm_close(out, _ref(a, w.t(), None, "silu", None, 1.0), dtype)


SK_VARIANTS = list(GG.STREAM_K_VARIANTS)
# (m, n, k, grid caps): tile counts that leave a partial wave, so the last tiles' K-slices are split between CTAs:
# 8192 x 4096 = 1024 tiles of 128 x 256 (2048 of 128 x 128) on the full grid; 2100 x 1096 under 7 / 11 / 13 CTAs.
SK_GPU_CASES = [(8192, 4096, 1032, (None,)), (2100, 1096, 776, (7, 11, 13))]


def split_happens(variant_cfg, m, n, cap):
    tiles = -(-m // variant_cfg["BM"]) * -(-n // variant_cfg["BN"])
    nprog = min(tiles, cap or torch.cuda.get_device_properties(0).multi_processor_count)
    return GG.stream_k_plan(tiles, nprog) < tiles


@requires_sm90
@pytest.mark.parametrize("variant", SK_VARIANTS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_stream_k_split_tiles_exact_and_deterministic(variant, dtype, seed, monkeypatch):
    """Stream-K where tiles really are split: against float64 (bias, gelu_tanh, residual, alpha) and bitwise
    equal on a second run (one partial sum per tile, added in a fixed order)."""
    monkeypatch.setenv("OPSADV_POISON_OUTPUTS", "1")
    for m, n, k, caps in SK_GPU_CASES:
        a = torch.randn(m, k, device="cuda", dtype=dtype)
        b = torch.randn(k, n, device="cuda", dtype=dtype) / k ** 0.5
        bias = torch.randn(n, device="cuda", dtype=dtype)
        res = torch.randn(m, n, device="cuda", dtype=dtype)
        ref = _ref(a, b, bias, "gelu_tanh", res, 0.5)
        for cap in caps:
            assert split_happens(GG.ALL_VARIANTS[variant], m, n, cap)
            out = GG.gemm_fwd(None, a, b, bias, "gelu_tanh", res, 0.5, variant=variant, num_sms=cap)
            assert_gemm_close(out, ref, dtype)
            assert torch.equal(out, GG.gemm_fwd(None, a, b, bias, "gelu_tanh", res, 0.5, variant=variant,
                                                num_sms=cap))


@requires_sm90
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 7, 127, 1000, 4096])
@pytest.mark.parametrize("act", ACTS)
def test_gpu_op_fwd_bwd(dtype, m, act, seed, monkeypatch):
    monkeypatch.setenv("OPSADV_POISON_OUTPUTS", "1")
    n, k = 520, 264
    a = torch.randn(2, m, k, device="cuda", dtype=dtype, requires_grad=True)      # batched: flattened leading dims
    b = (torch.randn(k, n, device="cuda", dtype=dtype) / k ** 0.5).requires_grad_()
    bias = torch.randn(n, device="cuda", dtype=dtype, requires_grad=True)
    res = torch.randn(2, m, n, device="cuda", dtype=dtype, requires_grad=True)
    with opsadv.use_backend("cuda", experimental=True, autotune=False, impls={"gemm": IMPL_ID}), opsadv.trace() as t:
        out = opsadv.ops.gemm(a, b, bias=bias, activation=act, residual=res, alpha=0.9)
        g = torch.randn_like(out)
        da, db, dbias, dres = torch.autograd.grad(out, (a, b, bias, res), g)
    assert t.counts[IMPL_ID] == 2
    a64, b64, bias64, res64 = (x.detach().double().requires_grad_() for x in (a, b, bias, res))
    ref = _ref(a64, b64, bias64, act, res64, 0.9)
    ra, rb, rbias, rres = torch.autograd.grad(ref, (a64, b64, bias64, res64), g.double())
    assert_gemm_close(out, ref.detach(), dtype)
    for got, want in ((da, ra), (db, rb), (dbias, rbias), (dres, rres)):
        assert_gemm_close(got, want, dtype)


def test_variant_measured_per_shape_bucket_default_first(monkeypatch):
    """Through the op, the schedule is the variant tuner's pick among every VARIANT (DEFAULT_VARIANT first: the
    one taken untimed where the profile does not autotune), keyed by dtype, rows bucket, N, K and epilogue."""
    from types import SimpleNamespace
    seen = []

    class FakeTuner:
        def pick(self, key, configs, launch, autotune):
            seen.append((key, [c["variant"] for c in configs], autotune))
            return configs[-1]
    monkeypatch.setattr(GG, "_variant_tuner", lambda: FakeTuner())
    a2 = SimpleNamespace(dtype=torch.bfloat16, shape=(1000, 264))
    out = SimpleNamespace(is_cuda=True, shape=(1000, 520))
    tuned = SimpleNamespace(profile=SimpleNamespace(autotune=True))
    got = GG._pick_variant(tuned, a2, None, out, object(), None, "silu", 1.0, True)
    key, order, autotune = seen[0]
    assert order[0] == GG.DEFAULT_VARIANT and sorted(order) == sorted(GG.VARIANTS) and autotune
    assert got == order[-1] and key == ("torch.bfloat16", 1024, 520, 264, "silu", True, False, True)
    GG._pick_variant(tuned, a2, None, out, None, None, "relu", 1.0, False)   # a TANH variant = its base here
    assert sorted(seen[1][1]) == sorted(v for v, c in GG.VARIANTS.items() if not c.get("TANH"))
    seen.pop()
    fixed = SimpleNamespace(profile=SimpleNamespace(autotune=False))          # e.g. the jetson profile
    assert GG._pick_variant(fixed, a2, None, out, None, None, "none", 1.0, False) == GG.DEFAULT_VARIANT
    assert len(seen) == 1
