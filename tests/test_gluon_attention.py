"""The Gluon Hopper flash-attention forward (impl cuda.gluon.flash_attention).

CPU: every kernel schedule compiles for sm_90 with no register spills (ptxas, no GPU needed); the impl's
declaration and its rejection reasons (also when Gluon does not import); the kernel's recurrence (tile
range, which tiles are masked, finite running max, P in the input dtype, rescale after P V, empty rows)
emulated in torch against a float64 reference, for causal / ragged / GQA shapes.
GPU (sm_90 only): forward + backward through opsadv.ops.flash_attention pinned to the impl, against the
float64 reference, with NaN-poisoned outputs; every schedule's forward directly."""
from __future__ import annotations

import importlib
import math
import os

import pytest
import torch

# one xdist worker runs this whole module, so its module-scoped fixture is built once (the README's
# `pytest -n auto --dist loadgroup`)
pytestmark = pytest.mark.xdist_group("gluon_attention")

import opsadv
from opsadv.ops.flash_attention import reference as R
from opsadv.core.kernel import CallSpec

from barrier_sim import Bar, Ring, run
from conftest import (assert_attention_matches, ATTENTION_GPU_CASES, fake_cuda_env, gluon_marks, load_without_gluon,
                      rel_err)

GA = pytest.importorskip("opsadv.backends.cuda.flash_attention.gluon")
IMPL_ID = GA.IMPL_ID
needs_gluon, requires_sm90 = gluon_marks(GA)


def _ref(q, k, v, causal, scale, do=None):
    q64, k64, v64 = q.double(), k.double(), v.double()
    out, lse = R.attention_fwd(None, q64, k64, v64, None, causal, scale)
    if do is None:
        return out, lse
    return out, lse, R.attention_bwd(None, do.double(), q64, k64, v64, out, lse, None, causal, scale)


# ---- compile for sm_90 on CPU ------------------------------------------------------------------------
# Runs in a fresh interpreter without TRITON_INTERPRET (conftest turns it on for this session, and under it
# gluon.jit functions become interpreter objects that cannot be compiled).  Binds and specializes like
# JITFunction.run, compiles for sm_90 (launches nothing), counts STL/LDL (register spills) in the SASS.
_COMPILE_SCRIPT = r"""
import json, os, re, subprocess, sys, tempfile
os.environ.pop("TRITON_INTERPRET", None)
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import make_backend
from triton.experimental.gluon._runtime import GluonASTSource
from triton.runtime.jit import create_function_from_signature
from opsadv.backends.cuda.flash_attention import gluon_kernel as K, gluon as GA
target = GPUTarget("cuda", 90, 128)
backend = make_backend(target)
fn = K.fa_fwd_kernel
tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
report = {}
for d, variant, causal, dt in json.loads(sys.argv[1]):
    q = torch.randn(1, 4, 1000, d).to(getattr(torch, dt))
    k, v = (torch.randn(1, 2, 1000, d).to(q.dtype) for _ in range(2))
    out, lse = torch.empty_like(q), torch.empty(1, 4, 1000)
    grid, args, kw = GA.launch_args(q, k, v, out, lse, causal, d ** -0.5, variant)
    kw["debug"] = False
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, _ = binder(*args, **kw)
    options, signature, constexprs, attrs = fn._pack_args(backend, kw, bound, specialization, None)
    kern = triton.compile(GluonASTSource(fn, signature, constexprs, attrs), target=target, options=options.__dict__)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kern.asm["cubin"])
        f.flush()
        sass = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True, check=True).stdout
        res = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    report[f"{d}-{variant}-{causal}-{dt}"] = {"spills": len(re.findall(r"\b(?:STL|LDL)\b", sass)),
                                              "stack": int(re.search(r"STACK:(\d+)", res).group(1)),
                                              "shared": kern.metadata.shared}
print(json.dumps(report))
"""


# No schedule may spill (no STL/LDL, stack 0).  Every schedule in bf16; the d128 ping-pong ones the dispatcher
# takes (the defaults, GA.DEFAULT_VARIANT) also in fp16: they sit at the register limit (up to R237 of 240) and
# spilled at 2cfc9ce (stack 8 / 24 causal).  The experimental ping-pong variants (pinned only) in bf16.
FP16_COMPILED = {"pingpong", "pingpong_st3", *GA.DEFAULT_VARIANT.values()}
COMPILE_CASES = [(d, name, causal, dt) for d in (128, 64) for name in GA.variants_for(d) for causal in (False, True)
                 for dt in ("bfloat16", "float16") if dt == "bfloat16" or (d == 128 and name in FP16_COMPILED)]


@pytest.fixture(scope="module")
def sm90_compile_report():
    import json
    from conftest import run_sm90_compile
    return json.loads(run_sm90_compile(["-c", _COMPILE_SCRIPT, json.dumps(COMPILE_CASES)]).strip().splitlines()[-1])


@needs_gluon
@pytest.mark.parametrize("d,variant,causal,dt", COMPILE_CASES)
def test_compiles_for_sm90_without_spills(d, variant, causal, dt, sm90_compile_report):
    r = sm90_compile_report[f"{d}-{variant}-{causal}-{dt}"]
    assert r["shared"] <= 232448                     # the sm_90 opt-in limit (227 KB)
    assert r["spills"] == 0 and r["stack"] == 0, f"{variant} d{d} causal={causal} {dt}: {r}"


def test_every_variant_is_compiled_and_d128_pingpong_in_fp16_too():
    """The compile check covers each distinct schedule (an explicit 3-stage ring is d64's default
    depth, so those variants are d128-only), and the spill-prone d128 ping-pong the dispatcher runs in both dtypes."""
    assert {(d, n) for d, n, _, _ in COMPILE_CASES} == {(d, n) for d in (128, 64) for n in GA.variants_for(d)}
    assert "pingpong_st3" in GA.variants_for(128) and "pingpong_st3" not in GA.variants_for(64)
    pingpongs = [n for n in GA.variants_for(128) if n.startswith("pingpong")]
    assert {"pingpong", "pingpong_st3", "pingpong_kv", "pingpong_kv_st3"} <= set(pingpongs)
    for name in pingpongs:
        assert {(c, dt) for d, n, c, dt in COMPILE_CASES if d == 128 and n == name} == \
            {(c, dt) for c in (False, True) for dt in ("bfloat16", "float16")
             if dt == "bfloat16" or name in FP16_COMPILED}
    assert GA.DEFAULT_VARIANT[128] in FP16_COMPILED


# ---- declaration and rejection reasons -------------------------------------------------------------------
def _impl():
    from opsadv.registry import get_registry
    impls = {i.id: i for i in get_registry().impls_by_op["flash_attention"]}
    assert IMPL_ID in impls, sorted(impls)
    return impls[IMPL_ID]


def _spec(dtype=torch.bfloat16, d=128, features=(), device="cuda", backward=False):
    return CallSpec(op="flash_attention", device_type=device, dtype=dtype, features=frozenset(features),
                    bucket=(), head_dim=d, shapes=((1, 2, 100, d), (1, 2, 100, d)), backward=backward)


_env = fake_cuda_env


def _reasons(spec, env, experimental_ok=True):
    return _impl().rejection_reasons(spec, env, experimental_ok=experimental_ok, deterministic=False)


def test_rank_above_cudnn_only_where_the_h200_measured_it_faster():
    """rank(): the Gluon forward outranks cuDNN (without autotune) for no-grad d128 causal self-attention at
    s > 2048 with batch * heads > 16, nowhere else; the specs are the op's own (attention._spec, meta tensors)."""
    from opsadv.core.kernel import PRIORITY_VENDOR
    A = importlib.import_module("opsadv.ops.flash_attention")

    def rank(b=1, h=32, hkv=None, s=16384, sk=None, d=128, causal=True, backward=False, train=False, inference=True,
             mask=False):
        q = torch.empty(b, h, s, d, device="meta", dtype=torch.bfloat16)
        k = torch.empty(b, hkv or h, sk or s, d, device="meta", dtype=torch.bfloat16)
        m = torch.empty(s, sk or s, device="meta", dtype=torch.bool) if mask else None
        return _impl().priority_for(A._spec(q, k, m, causal, backward, train, inference), _env())

    for kw in (dict(), dict(b=4, s=4096), dict(hkv=8), dict(s=3000), dict(b=2, h=16, s=65536)):
        prio, why = rank(**kw)
        assert prio == PRIORITY_VENDOR + 10 and "H200-measured" in why, kw
    static = _impl().priority
    for kw in (dict(s=2048), dict(b=16, s=1024), dict(d=64), dict(causal=False), dict(inference=False),
               dict(inference=False, train=True), dict(backward=True, inference=False), dict(h=8, s=8192),
               dict(sk=8192), dict(mask=True, causal=False)):
        assert rank(**kw) == (static, ""), kw


@needs_gluon
def test_declared_support_accepts_sm90_bf16_fp16_d64_d128():
    for dt in (torch.bfloat16, torch.float16):
        for d in (64, 128):
            for feats in ((), ("causal",), ("causal", "gqa", "cross_length")):
                assert _reasons(_spec(dt, d, feats), _env()) == [], (dt, d, feats)
                assert _reasons(_spec(dt, d, feats, backward=True), _env()) == []


def test_rejection_reasons():
    env = _env()
    assert _reasons(_spec(), env, experimental_ok=False) == []
    # passed the H200 conformance catalogue: no opt-in needed; above the Triton impl, below the vendor ones
    from opsadv.core.kernel import PRIORITY_TRITON, PRIORITY_VENDOR
    assert not _impl().experimental and PRIORITY_TRITON < _impl().priority < PRIORITY_VENDOR - 20
    assert any("dtype float32" in r for r in _reasons(_spec(torch.float32), env))
    assert any("head_dim 96" in r for r in _reasons(_spec(d=96), env))
    assert any("head_dim 256" in r for r in _reasons(_spec(d=256), env))
    assert any("attn_mask_bool" in r for r in _reasons(_spec(features=("attn_mask_bool",)), env))
    assert any("device 'cpu'" in r for r in _reasons(_spec(device="cpu"), env))
    assert any(">= 9.0" in r for r in _reasons(_spec(), _env((8, 0))))
    assert any("<= 9.0" in r for r in _reasons(_spec(), _env((10, 0))))
    if not GA.UNAVAILABLE:
        assert any("TRITON_INTERPRET" in r for r in _reasons(_spec(), _env(interpret=True)))


def test_unavailable_without_gluon(monkeypatch):
    """With triton.experimental.gluon unimportable the module still imports and the impl rejects every
    call, naming the import failure."""
    mod = load_without_gluon(monkeypatch, GA, "flash_attention.gluon_kernel")
    assert "triton.experimental.gluon" in mod.UNAVAILABLE
    for impl in mod.impls(_env()):             # the impl and its atomic-dQ twin
        why = impl.rejection_reasons(_spec(), _env(), experimental_ok=True, deterministic=False)
        assert why == [mod.UNAVAILABLE]
    with pytest.raises(RuntimeError, match="not importable"):
        mod.launch_args(*(torch.empty(1, 1, 1, 64),) * 5, False, 0.1)


# ---- the kernel's recurrence, emulated -----------------------------------------------------------------
def emulate(q, k, v, causal, scale, block_m=128, block_n=128):
    """The kernel's forward step by step in float32 (one q block of block_m rows at a time): K/V tiles
    0..n_tiles-1 with rows past s_k zero (TMA fill), the unmasked step before tile first_masked and the
    masked one from it on, m starting at -1e30, S_{j+1}'s softmax before O's rescale, P in the input
    dtype for P V, empty rows -> out 0 and lse -inf."""
    b, hq, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    group = hq // hkv
    kf = k.float().repeat_interleave(group, 1)
    vf = v.float().repeat_interleave(group, 1)
    pad = (-sk) % block_n                                         # TMA zero-fill past s_k
    kf = torch.nn.functional.pad(kf, (0, 0, 0, pad))
    vf = torch.nn.functional.pad(vf, (0, 0, 0, pad))
    qk_scale = scale * 1.4426950408889634
    offset = sk - sq
    out = torch.empty(b, hq, sq, d)
    lse = torch.empty(b, hq, sq)
    for m0 in range(0, sq, block_m):
        rows = torch.arange(m0, min(m0 + block_m, sq))
        qf = q[:, :, rows].float()
        if causal:
            hi = max(min(sk, m0 + block_m + offset), 0)
            n_full = max(min(sk, m0 + offset + 1), 0)
        else:
            hi = n_full = sk
        n_tiles, first_masked = -(-hi // block_n), n_full // block_n

        def step(j, m, l):
            cols = torch.arange(j * block_n, (j + 1) * block_n)
            s = qf @ kf[:, :, cols].transpose(-1, -2)
            if j >= first_masked:
                keep = (cols[None, :] < sk)
                if causal:
                    keep = keep & (cols[None, :] <= rows[:, None] + offset)
                qk = torch.where(keep, s * qk_scale, float("-inf"))
                m_new = torch.maximum(m, qk.amax(-1))
                p = torch.exp2(qk - m_new[..., None])
            else:
                m_new = torch.maximum(m, s.amax(-1) * qk_scale)
                p = torch.exp2(s * qk_scale - m_new[..., None])
            alpha = torch.exp2(m - m_new)
            return p, m_new, l * alpha + p.sum(-1), alpha

        m = torch.full(qf.shape[:-1], -1.0e30)
        l = torch.zeros(qf.shape[:-1])
        o = torch.zeros(*qf.shape[:-1], d)
        if n_tiles > 0:
            p, m, l, _ = step(0, m, l)
            for j in range(n_tiles - 1):
                pv = p.to(q.dtype).float() @ vf[:, :, j * block_n:(j + 1) * block_n]     # issued before softmax
                p, m, l, alpha = step(j + 1, m, l)
                o = (o + pv) * alpha[..., None]
            o = o + p.to(q.dtype).float() @ vf[:, :, (n_tiles - 1) * block_n:n_tiles * block_n]
        empty = l == 0
        l_safe = torch.where(empty, torch.ones_like(l), l)
        out[:, :, rows] = o / l_safe[..., None]
        lse[:, :, rows] = torch.where(empty, float("-inf"), (m + torch.log2(l_safe)) * math.log(2))
    return out.to(q.dtype), lse


EMULATE_CASES = [  # b, hq, hkv, sq, sk, d, causal
    (1, 2, 2, 1, 1, 64, False),
    (1, 2, 2, 3, 3, 64, True),
    (2, 2, 1, 127, 127, 64, True),          # one partial q block, diagonal tile masked, MQA
    (1, 4, 2, 300, 300, 64, True),          # 3 q blocks, GQA
    (1, 2, 2, 300, 300, 128, False),        # ragged tail tile only
    (1, 2, 2, 1, 300, 64, True),            # decode: s_q = 1 sees every key
    (1, 4, 2, 130, 400, 64, True),          # s_q < s_k: offset not a multiple of 128 (2 masked tiles)
    (1, 2, 2, 300, 100, 64, True),          # s_q > s_k: the first 200 rows see nothing (whole q blocks)
    (1, 2, 2, 260, 256, 64, False),         # s_k a multiple of 128, s_q not
]


@pytest.mark.parametrize("b,hq,hkv,sq,sk,d,causal", EMULATE_CASES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_emulated_recurrence_matches_float64(b, hq, hkv, sq, sk, d, causal, dtype, seed):
    q = torch.randn(b, hq, sq, d).to(dtype)
    k, v = (torch.randn(b, hkv, sk, d).to(dtype) for _ in range(2))
    scale = 0.9 / math.sqrt(d)
    out, lse = emulate(q, k, v, causal, scale)
    ro, rl = _ref(q, k, v, causal, scale)
    empty = torch.isneginf(rl)
    assert torch.equal(torch.isneginf(lse), empty)
    assert (out[empty] == 0).all() and not torch.isnan(out).any()
    if (~empty).any():
        assert (lse[~empty] - rl[~empty]).abs().max().item() < 1e-4
    assert rel_err(out.float(), ro) < (8e-3 if dtype == torch.bfloat16 else 1.5e-3)


def test_emulation_detects_a_wrong_mask():
    """The emulation is sensitive to its masks: dropping the causal mask of the diagonal tile (treating
    it as unmasked) must fail the comparison."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 200, 64).to(torch.float16) for _ in range(3))
    out, _ = emulate(q, k, v, False, 0.125)          # no mask at all
    ro, _ = _ref(q, k, v, True, 0.125)
    assert rel_err(out.float(), ro) > 0.05


# ---- on an H100/H200 ------------------------------------------------------------------------------------
GPU_CASES = ATTENTION_GPU_CASES


def _gpu_check(b, hq, hkv, sq, sk, d, causal, dtype, bshd=False):
    dev = "cuda"

    def make(h, s):
        if bshd:   # transformers' projections: (b, s, h, d) memory seen as (b, h, s, d)
            return torch.randn(b, s, h, d, device=dev, dtype=dtype).transpose(1, 2).requires_grad_()
        return torch.randn(b, h, s, d, device=dev, dtype=dtype, requires_grad=True)

    q, k, v = make(hq, sq), make(hkv, sk), make(hkv, sk)
    scale = 0.8 / math.sqrt(d)
    with opsadv.use_backend("cuda", experimental=True, autotune=False, impls={"flash_attention": IMPL_ID}), \
            opsadv.trace() as t:
        out, lse = opsadv.ops.flash_attention(q, k, v, causal=causal, scale=scale, return_lse=True)
        do = torch.randn_like(out)
        dq, dk, dv = torch.autograd.grad(out, (q, k, v), do)
    assert t.counts[IMPL_ID] == 2
    ro, rl, (rq, rk, rv) = _ref(q.detach(), k.detach(), v.detach(), causal, scale, do)
    assert_attention_matches(dtype, dict(out=out, dq=dq, dk=dk, dv=dv), dict(out=ro, dq=rq, dk=rk, dv=rv), lse, rl)


@requires_sm90
@pytest.mark.parametrize("b,hq,hkv,sq,sk,d,causal", GPU_CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_fwd_bwd_matches_reference(b, hq, hkv, sq, sk, d, causal, dtype, seed, monkeypatch):
    monkeypatch.setenv("OPSADV_POISON_OUTPUTS", "1")
    _gpu_check(b, hq, hkv, sq, sk, d, causal, dtype)


@requires_sm90
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_bshd_inputs(causal, seed, monkeypatch):
    monkeypatch.setenv("OPSADV_POISON_OUTPUTS", "1")
    _gpu_check(2, 4, 2, 333, 333, 128, causal, torch.bfloat16, bshd=True)


@requires_sm90
@pytest.mark.parametrize("variant", list(GA.VARIANTS))
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_every_schedule_forward(variant, causal, seed, monkeypatch):
    monkeypatch.setenv("OPSADV_POISON_OUTPUTS", "1")
    # (2, 3, 1, 300, 260, 128): b > 1 and h not a power of 2, for the (b, h) that d128 ping-pong recomputes
    # from the CTA id before its O store (REMAT)
    for (b, hq, hkv, sq, sk, d) in ((1, 4, 2, 1000, 1000, 128), (2, 2, 1, 127, 300, 64), (1, 2, 2, 777, 129, 128),
                                    (2, 3, 1, 300, 260, 128)):
        if variant not in GA.variants_for(d):
            continue
        q = torch.randn(b, hq, sq, d, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(b, hkv, sk, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        out, lse = GA.attention_fwd(q, k, v, causal, 0.1, variant=variant)
        ro, rl = _ref(q, k, v, causal, 0.1)
        empty = torch.isneginf(rl)
        assert torch.equal(torch.isneginf(lse), empty), (variant, b, hq, sq, sk, d)
        assert not torch.isnan(out).any()
        assert rel_err(out, ro) < 2e-2, (variant, b, hq, sq, sk, d, rel_err(out, ro))


# ---- the warp-specialized barrier protocol, emulated -----------------------------------------------------
def emulate_pipeline(n_tiles, stages, split, seed, n_wg=2, release_k_early=False):
    """The K/V ring protocol of fa_fwd_kernel with a producer warp (ping-pong: n_wg = 2 consumer
    partitions taking GEMM turns), run under a random interleaving of the partitions and of the TMA
    completions.  Asserts that a load never overwrites a slot whose previous tile a consumer has not
    finished reading, that every read finds its tile landed, and that nothing deadlocks.
    release_k_early: a deliberately wrong consumer (frees the K slot before its S has retired)."""
    import random
    rnd = random.Random(seed)
    cnt = n_wg
    k_ready, v_ready = [Bar(1) for _ in range(stages)], [Bar(1) for _ in range(stages)]
    kv_empty = [Bar(cnt) for _ in range(stages)]
    k_empty = [Bar(cnt) for _ in range(stages)] if split else kv_empty
    turn = [Bar(1), Bar(1)]
    turn[0].arrive()                                   # warpgroup 0 issues first
    ring = Ring(("k", "v"), stages, n_wg)
    load, start_read, end_read = ring.load, ring.start_read, ring.end_read

    def producer():
        if split:
            if n_tiles > 0:
                yield k_empty[0], 1
                load("k", 0)
            for j in range(n_tiles):
                if j + 1 < n_tiles:
                    yield k_empty[(j + 1) % stages], (((j + 1) // stages) & 1) ^ 1
                    load("k", j + 1)
                yield kv_empty[j % stages], ((j // stages) & 1) ^ 1
                load("v", j)
        else:
            for j in range(n_tiles):
                yield kv_empty[j % stages], ((j // stages) & 1) ^ 1
                load("k", j)
                load("v", j)

    def consumer(wg):
        def take_turn(step):
            if n_wg == 2:
                yield turn[wg], step & 1

        def pass_turn():
            if n_wg == 2:
                turn[1 - wg].arrive()
        if n_tiles == 0:
            return
        yield k_ready[0], 0
        yield from take_turn(0)
        start_read("k", 0, wg)
        pass_turn()
        end_read("k", 0, wg)
        if split:
            k_empty[0].arrive()
        for j in range(n_tiles - 1):
            cur, nxt = j % stages, (j + 1) % stages
            yield k_ready[nxt], ((j + 1) // stages) & 1
            yield v_ready[cur], (j // stages) & 1
            yield from take_turn(j + 1)
            start_read("k", j + 1, wg)
            start_read("v", j, wg)
            pass_turn()
            if split and release_k_early:
                k_empty[nxt].arrive()
            yield None, None                           # the other partitions run while S is in flight
            end_read("k", j + 1, wg)
            if split and not release_k_early:
                k_empty[nxt].arrive()
            yield None, None                           # ... and while P V is
            end_read("v", j, wg)
            kv_empty[cur].arrive()
        yield v_ready[(n_tiles - 1) % stages], ((n_tiles - 1) // stages) & 1
        yield from take_turn(n_tiles)
        start_read("v", n_tiles - 1, wg)
        pass_turn()
        end_read("v", n_tiles - 1, wg)

    def land(item):
        kind, st = item
        ring.land(kind, st)
        (k_ready if kind == "k" else v_ready)[st].arrive()

    run({"producer": producer(), **{f"wg{w}": consumer(w) for w in range(n_wg)}}, ring.in_flight, land, rnd)
    for kind in ("k", "v"):
        assert ring.all_read(kind, n_tiles), kind


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("stages", [2, 3])
def test_emulated_pingpong_pipeline_protocol(stages, split):
    for n_tiles in (0, 1, 2, 3, 4, 7):
        for seed in range(40):
            emulate_pipeline(n_tiles, stages, split, seed)
    emulate_pipeline(5, stages, split, 0, n_wg=1)      # the ws schedule's single consumer partition


def test_emulated_pipeline_detects_an_early_k_release():
    """The protocol check can fail: freeing K_{j+1}'s slot before its S has retired lets the producer
    overwrite it under the read."""
    with pytest.raises(AssertionError, match="overwritten"):
        for seed in range(200):
            emulate_pipeline(7, 2, True, seed, release_k_early=True)


# ---- EXP_EMU: exp2 on the FMA pipe, the PTX run instruction by instruction in numpy -----------------------
def _run_exp2_poly_ptx(x: "np.ndarray") -> "np.ndarray":
    """Executes _gluon_fa_kernel._EXP2_POLY (the polynomial half of the mixed exp2) on float32 x, one PTX
    instruction at a time with float32 / int32 semantics, so a wrong constant, operand or order shows."""
    import numpy as np
    from opsadv.backends.cuda.flash_attention import gluon_kernel as K

    def val(tok, regs):
        tok = tok.strip().rstrip(";")
        if tok.startswith("0f"):
            return np.array(int(tok[2:], 16), dtype=np.uint32).view(np.float32)
        return np.array(int(tok), dtype=np.int32) if tok.lstrip("-").isdigit() else regs[tok]

    regs = {"X": x.astype(np.float32)}
    for line in K._EXP2_POLY.format(x="X", y="Y").splitlines():
        op, rest = line.strip().rstrip(";").split(None, 1)
        dst, *src = [t.strip() for t in rest.split(",")]
        a = [val(t, regs) for t in src]
        if op == "max.f32":
            regs[dst] = np.maximum(a[0], a[1]).astype(np.float32)
        elif op == "add.rn.f32":
            regs[dst] = (a[0] + a[1]).astype(np.float32)
        elif op == "sub.rn.f32":
            regs[dst] = (a[0] - a[1]).astype(np.float32)
        elif op == "fma.rn.f32":     # float64 product + sum rounded once: an exact fma for float32 inputs
            regs[dst] = (a[0].astype(np.float64) * a[1] + a[2]).astype(np.float32)
        elif op == "mov.b32":
            regs[dst] = a[0].view(np.int32) if a[0].dtype == np.float32 else a[0].view(np.float32)
        elif op == "shl.b32":
            regs[dst] = (a[0].astype(np.int64) << int(a[1])).astype(np.uint32).view(np.int32)
        elif op == "add.s32":
            regs[dst] = (a[0].astype(np.int64) + a[1]).astype(np.uint32).view(np.int32)
        else:
            raise AssertionError(f"unhandled PTX op {op}")
    return regs["Y"]


def test_exp2_polynomial_ptx_matches_exp2():
    """The FMA-pipe exp2 of EXP_EMU: relative error < 1e-4 (below half an ulp of bf16 / fp16 P) for every
    x in [-125, 0] incl. integers and half-integers (the rounding edges), ~0 below (clamped at 2^-125)."""
    import numpy as np
    x = np.concatenate([np.linspace(-125, 0, 400001, dtype=np.float32), np.arange(-125, 1, 0.5, dtype=np.float32),
                        -np.logspace(-9, 0, 300).astype(np.float32)])
    y = _run_exp2_poly_ptx(x).astype(np.float64)
    rel = np.abs(y / np.exp2(x.astype(np.float64)) - 1)
    assert rel.max() < 1e-4, (x[rel.argmax()], rel.max())
    far = _run_exp2_poly_ptx(np.array([-126.0, -200.0, -1e30], dtype=np.float32))
    assert np.all(far < 1e-37) and np.all(far >= 0)


def test_exp2_mixed_asm_sends_one_element_per_pack_to_the_polynomial():
    from opsadv.backends.cuda.flash_attention import gluon_kernel as K
    for pack, asm in ((2, K.EXP2_ASM_2.value), (4, K.EXP2_ASM_4.value)):
        assert asm.count("ex2.approx.ftz.f32") == pack - 1 and asm.count("fma.rn.f32") == 3
        assert f"max.f32 t, ${2 * pack - 1}," in asm and f"mov.b32 ${pack - 1}, pb;" in asm
    assert {v: c.get("EXP_EMU") for v, c in GA.VARIANTS.items() if c.get("EXP_EMU")} == \
        {"pingpong_emu2": 2, "pingpong_emu4": 4, "pingpong_st3_emu4": 4}
