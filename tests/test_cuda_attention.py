"""The cuda backend's flash attention: the Triton kernels under the interpreter on CPU tensors
(fp16, and fp32 under a half-precision policy), against the reference in float64, forward and
backward; declared limits; and, on a GPU, bf16/fp16 plus the SDPA vendor impls and the measured
choice per bucket."""
from __future__ import annotations

import importlib
import math

import pytest
import torch

import opsadv
from opsadv.ops.flash_attention import reference as R
from opsadv.errors import NoKernelError

from conftest import rel_err, requires_gpu

TRITON_ID = "cuda.triton.flash_attention"
ATOMIC_ID = "cuda.triton.flash_attention.atomic_dq"


def _ref(q, k, v, do, causal, scale):
    q64, k64, v64 = q.double(), k.double(), v.double()
    out, lse = R.attention_fwd(None, q64, k64, v64, None, causal, scale)
    grads = R.attention_bwd(None, do.double(), q64, k64, v64, out, lse, None, causal, scale)
    return out, lse, grads


def _check(b, hq, hkv, sq, sk, d, causal, dtype=torch.float16, device="cpu", tol=2e-3, lse_tol=1e-5, **policy):
    q = torch.randn(b, hq, sq, d, dtype=dtype, device=device, requires_grad=True)
    k = torch.randn(b, hkv, sk, d, dtype=dtype, device=device, requires_grad=True)
    v = torch.randn(b, hkv, sk, d, dtype=dtype, device=device, requires_grad=True)
    scale = 0.7 / math.sqrt(d)
    with opsadv.use_backend("cuda", **policy), opsadv.trace() as t:
        out, lse = opsadv.ops.flash_attention(q, k, v, causal=causal, scale=scale, return_lse=True)
        do = torch.randn_like(out)
        dq, dk, dv = torch.autograd.grad(out, (q, k, v), do)
    ro, rl, (rq, rk, rv) = _ref(q.detach(), k.detach(), v.detach(), do, causal, scale)
    assert out.dtype == dtype and lse.dtype == torch.float32 and lse.shape == (b, hq, sq)
    for name, x in (("out", out), ("dq", dq), ("dk", dk), ("dv", dv)):
        assert not torch.isnan(x).any(), name
    empty = torch.isneginf(rl)
    assert torch.equal(torch.isneginf(lse), empty), "rows with no visible key: lse must be -inf exactly there"
    assert (out[empty] == 0).all()
    assert rel_err(lse[~empty], rl[~empty]) < lse_tol
    for name, x, r in (("out", out, ro), ("dq", dq, rq), ("dk", dk, rk), ("dv", dv, rv)):
        assert rel_err(x, r) < tol, (name, rel_err(x, r))
    return t


CASES = [  # b, hq, hkv, sq, sk, d, causal
    (1, 2, 2, 17, 17, 64, False),        # odd length, one partial block
    (2, 2, 2, 67, 67, 32, True),         # causal, several blocks + tail
    (1, 2, 1, 1, 37, 64, True),          # decode: s_q = 1 sees every key (bottom-right)
    (1, 4, 2, 3, 130, 32, True),         # s_q < s_k, GQA 2
    (1, 2, 2, 45, 20, 64, True),         # s_q > s_k: the first 25 rows see nothing
    (2, 4, 1, 33, 33, 32, False),        # MQA
    (1, 2, 2, 40, 40, 96, True),         # head dim 96 (padded to 128 in registers)
]


@pytest.mark.parametrize("b,hq,hkv,sq,sk,d,causal", CASES)
def test_triton_matches_reference_fp16(b, hq, hkv, sq, sk, d, causal, seed, monkeypatch):
    monkeypatch.setenv("OPSADV_POISON_OUTPUTS", "1")   # outputs start as NaN: an unwritten element fails
    t = _check(b, hq, hkv, sq, sk, d, causal)
    assert t.counts[TRITON_ID] == 2                      # forward + backward both ran the Triton kernels


@pytest.mark.parametrize("b,hq,hkv,sq,sk,d,causal", CASES)
def test_backward_tma_loads_match_reference(b, hq, hkv, sq, sk, d, causal, seed, monkeypatch):
    """The backward with its streamed tiles (q / dO, k / v) loaded through (b, h, s, d) descriptors, as the h100
    profile's TMA configs run it: ragged tails (zero rows from the descriptor bounds), GQA / MQA, s_q != s_k,
    decode.  Head dim 96 is padded to 128 in registers: no descriptor path there."""
    from opsadv.backends.triton_common.flash_attention import attention as A
    monkeypatch.setenv("OPSADV_POISON_OUTPUTS", "1")
    orig, real = A._configs, A.desc_bhsd
    monkeypatch.setattr(A, "_configs", lambda ctx, which, d_, tma_ok: [
        {**c, "TMA": tma_ok and which != "fwd"} for c in orig(ctx, which, d_, tma_ok)])
    made = []
    monkeypatch.setattr(A, "desc_bhsd", lambda t, rows: made.append(rows) or real(t, rows))
    t = _check(b, hq, hkv, sq, sk, d, causal)
    assert t.counts[TRITON_ID] == 2
    assert len(made) == (0 if d == 96 else 4)             # q, dO (dK/dV kernel), k, v (dQ kernel)


@pytest.mark.parametrize("b,hq,hkv,sq,sk,d,causal", [CASES[1], CASES[3], CASES[4], CASES[6]])
def test_atomic_dq_backward_matches_reference(b, hq, hkv, sq, sk, d, causal, seed, monkeypatch):
    """The experimental non-deterministic variant (dQ by fp32 atomics in the dK/dV kernel)."""
    from opsadv.backends.triton_common.flash_attention import attention as A
    from opsadv.core import dispatch
    OA = importlib.import_module("opsadv.ops.flash_attention")
    monkeypatch.setenv("OPSADV_POISON_OUTPUTS", "1")
    q = torch.randn(b, hq, sq, d, dtype=torch.float16)
    k = torch.randn(b, hkv, sk, d, dtype=torch.float16)
    v = torch.randn_like(k)
    do = torch.randn_like(q)
    with opsadv.use_backend("cuda", experimental=True):
        exp, r = dispatch.explain_spec(OA._spec(q, k, None, causal, True))
    assert any(c.impl.id == ATOMIC_ID and c.accepted for c in exp.candidates)
    o, lse = A.flash_fwd(r.ctx, q, k, v, None, causal, 0.2)
    grads = A.flash_bwd_atomic(r.ctx, do, q, k, v, o, lse, None, causal, 0.2)
    _, _, ref = _ref(q, k, v, do, causal, 0.2)
    for x, y in zip(grads, ref):
        assert not torch.isnan(x).any() and rel_err(x, y) < 2e-3


def test_fp32_inputs_run_in_half_under_precision_policy(seed, monkeypatch):
    monkeypatch.setenv("OPSADV_POISON_OUTPUTS", "1")
    _check(1, 2, 1, 19, 27, 32, True, dtype=torch.float32, tol=2e-3, lse_tol=3e-4, precision="fp16")  # inputs rounded to fp16


def test_fp32_without_half_policy_is_rejected_with_reason():
    q = torch.randn(1, 2, 8, 32)
    with opsadv.use_backend("cuda"):
        exp = opsadv.explain("flash_attention", q, q, q)
        with pytest.raises(NoKernelError):
            opsadv.ops.flash_attention(q, q, q)
    reasons = {c["impl"]: c["reasons"] for c in exp.to_dict()["candidates"]}
    assert any("precision" in r for r in reasons[TRITON_ID])


@pytest.mark.parametrize("what,kw,needle", [
    ("head_dim", dict(d=48), "head_dim 48 not in"),
    ("bf16", dict(dtype=torch.bfloat16), "interpreter"),
    ("mask", dict(mask=True), "attn_mask_bool"),
])
def test_declared_limits(what, kw, needle):
    d = kw.get("d", 32)
    q = torch.randn(1, 2, 8, d, dtype=kw.get("dtype", torch.float16))
    mask = torch.ones(8, 8, dtype=torch.bool) if kw.get("mask") else None
    with opsadv.use_backend("cuda"):
        exp = opsadv.explain("flash_attention", q, q, q, attn_mask=mask)
    reasons = {c["impl"]: c["reasons"] for c in exp.to_dict()["candidates"]}
    assert any(needle in r for r in reasons[TRITON_ID]), reasons[TRITON_ID]


def test_non_contiguous_inputs_and_deterministic_policy(seed):
    # (b, s, h, d) storage viewed as (b, h, s, d), as transformers hands it over
    x = torch.randn(1, 21, 2, 32, dtype=torch.float16).transpose(1, 2)
    kv = torch.randn(1, 29, 1, 32, dtype=torch.float16).transpose(1, 2)
    with opsadv.use_backend("cuda", deterministic=True), opsadv.trace() as t:
        out = opsadv.ops.flash_attention(x, kv, kv, causal=True)
    ro, _ = R.attention_fwd(None, x.double(), kv.double(), kv.double(), None, True, 32 ** -0.5)
    assert t.counts[TRITON_ID] == 1
    assert rel_err(out, ro) < 2e-3


def test_profiles_carry_attention_tiles_and_interpreter_does_not_autotune():
    from opsadv.backends.triton_common.flash_attention import attention as A
    from opsadv.backends.cuda.profiles import PROFILES
    for p in PROFILES:
        tiles = p.tiles["flash_attention"]
        for which in ("fwd", "bwd_kv", "bwd_q"):
            for dclass in (64, 128, 256):
                assert tiles[which][dclass], (p.name, which, dclass)
    interp = next(p for p in PROFILES if p.name == "interpreter")
    assert not interp.autotune

    class Ctx:
        profile = interp
    assert len(A._configs(Ctx, "fwd", 64, tma_ok=False)) == 1
    assert not A._autotune(Ctx, torch.device("cpu"))


# ---- GPU ------------------------------------------------------------------------------------------
@requires_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("b,hq,hkv,sq,sk,d,causal", [
    (2, 8, 2, 1000, 1000, 128, True), (1, 4, 4, 333, 200, 128, True), (1, 4, 4, 1, 1000, 64, False),
    (1, 4, 2, 300, 300, 256, True), (1, 4, 2, 257, 257, 96, False)])
def test_gpu_triton(b, hq, hkv, sq, sk, d, causal, dtype, seed, monkeypatch):
    from opsadv.backends.triton_common.flash_attention import attention as A
    monkeypatch.setattr(A, "_autotune", lambda ctx, device: False)   # the profile's default tiles (fast to compile)
    monkeypatch.setenv("OPSADV_POISON_OUTPUTS", "1")
    tol = 1.5e-2 if dtype == torch.bfloat16 else 3e-3
    # deterministic policy: only the Triton impl with the two-kernel backward qualifies
    # pinned: on sm_90 the Gluon forward (+ this same Triton backward) outranks it at d64 / d128
    t = _check(b, hq, hkv, sq, sk, d, causal, dtype=dtype, device="cuda", tol=tol, deterministic=True,
               impls={"flash_attention": TRITON_ID})
    assert t.counts[TRITON_ID] == 2


@requires_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("b,hq,hkv,sq,sk,d,causal", [
    (2, 8, 2, 1000, 1000, 128, True), (1, 4, 4, 333, 200, 128, False), (1, 4, 4, 1, 1000, 64, False),
    (1, 4, 1, 300, 517, 64, True)])
def test_gpu_triton_backward_tma_loads(b, hq, hkv, sq, sk, d, causal, dtype, seed, monkeypatch):
    """The backward's descriptor loads (every TMA config of the h100 space forced in turn) on the GPU."""
    from opsadv.backends.triton_common.flash_attention import attention as A
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("TMA needs sm_90+")
    monkeypatch.setattr(A, "_autotune", lambda ctx, device: False)
    monkeypatch.setenv("OPSADV_POISON_OUTPUTS", "1")
    orig = A._configs
    tol = 1.5e-2 if dtype == torch.bfloat16 else 3e-3
    for which in ("bwd_kv", "bwd_q"):
        for pick in range(3):
            def configs(ctx, w, d_, tma_ok, which=which, pick=pick):
                cs = orig(ctx, w, d_, tma_ok)
                tma = [c for c in cs if c["TMA"]] if w == which else []
                return [tma[pick % len(tma)]] if tma else cs
            monkeypatch.setattr(A, "_configs", configs)
            t = _check(b, hq, hkv, sq, sk, d, causal, dtype=dtype, device="cuda", tol=tol, deterministic=True,
                       impls={"flash_attention": TRITON_ID})
            assert t.counts[TRITON_ID] == 2


@requires_gpu
@pytest.mark.parametrize("b,hq,hkv,sq,sk,d,causal", [(2, 8, 2, 1000, 1000, 128, True), (1, 4, 4, 333, 200, 64, True),
                                                      (1, 4, 2, 257, 300, 96, False)])
def test_gpu_triton_atomic_dq_backward(b, hq, hkv, sq, sk, d, causal, seed, monkeypatch):
    from opsadv.backends.triton_common.flash_attention import attention as A
    monkeypatch.setattr(A, "_autotune", lambda ctx, device: False)
    from opsadv.core import dispatch
    OA = importlib.import_module("opsadv.ops.flash_attention")
    q = torch.randn(b, hq, sq, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(b, hkv, sk, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    do = torch.randn_like(q)
    with opsadv.use_backend("cuda"):
        _, r = dispatch.explain_spec(OA._spec(q, k, None, causal, True))
    o, lse = A.flash_fwd(r.ctx, q, k, v, None, causal, 0.1)
    grads = A.flash_bwd_atomic(r.ctx, do, q, k, v, o, lse, None, causal, 0.1)
    _, _, ref = _ref(q, k, v, do, causal, 0.1)
    for x, y in zip(grads, ref):
        assert rel_err(x, y) < 1.5e-2
    # Hopper, head dim a power of two: dQ went through the TMA bulk reduce (d = 96 pads to 128: element atomics)
    assert A._dq_tma_ok(q, d, 128 if d == 96 else d) == (torch.cuda.get_device_capability() >= (9, 0) and d != 96)


@requires_gpu
@pytest.mark.parametrize("impl_id", ["cuda.sdpa.cudnn", "cuda.sdpa.flash", "cuda.sdpa.efficient"])
def test_gpu_vendor_impls(impl_id, seed):
    from opsadv.core import dispatch
    A = importlib.import_module("opsadv.ops.flash_attention")
    from opsadv.registry import get_registry
    impl = next(i for i in get_registry().impls_by_op["flash_attention"] if i.id == impl_id)
    q = torch.randn(2, 8, 300, 64, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(2, 2, 300, 64, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    do = torch.randn_like(q)
    with opsadv.use_backend("cuda"):
        _, r = dispatch.explain_spec(A._spec(q, k, None, True, False))
    o, lse = impl.fn(r.ctx, q, k, v, None, True, 0.125)
    dq, dk, dv = impl.backward(r.ctx, do, q, k, v, o, lse, None, True, 0.125)
    ro, rl, (rq, rk, rv) = _ref(q, k, v, do, True, 0.125)
    if impl.inference is not None:          # the no-lse forward of no-grad calls (cuDNN)
        assert rel_err(impl.inference(r.ctx, q, k, v, None, True, 0.125)[0], ro) < 1.5e-2
    assert lse.shape == (2, 8, 300) and rel_err(lse, rl) < 1e-5
    for x, ref in ((o, ro), (dq, rq), (dk, rk), (dv, rv)):
        assert rel_err(x, ref) < 1.5e-2


@requires_gpu
def test_gpu_cudnn_training_calls_run_under_torch_autograd(seed):
    """cuda.sdpa.cudnn's `train` forward: an eager training call runs cuDNN's aten op under torch's own autograd
    (no opsadv Function, no backward dispatch), on q / k / v / dout laid out as transformers hands them ((b, s, h, d)
    memory, GQA), on the full and the fast path; forward, lse and gradients against float64."""
    b, hq, hkv, s, d = 2, 8, 2, 300, 64
    qkv = torch.randn(b, s, hq + 2 * hkv, d, device="cuda", dtype=torch.bfloat16)
    q, k, v = (t.transpose(1, 2) for t in qkv.split([hq, hkv, hkv], dim=2))
    do = torch.randn(b, s, hq, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    ro, rl, ref = _ref(q, k, v, do, True, 0.125)
    for _ in range(2):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        with opsadv.use_backend("cuda", impls={"flash_attention": "cuda.sdpa.cudnn"}), opsadv.trace() as t:
            out, lse = opsadv.ops.flash_attention(*leaves, causal=True, scale=0.125, return_lse=True)
            out.backward(do)
        assert "FlashAttentionTrainFn" not in type(out.grad_fn).__name__ and t.counts["cuda.sdpa.cudnn"] == 1
        assert rel_err(out, ro) < 1.5e-2 and rel_err(lse, rl) < 1e-5
        for x, want in zip(leaves, ref):
            assert rel_err(x.grad, want) < 1.5e-2


def _cross_pairs(device, dtype, ids, tol, shape=(2, 8, 2, 300, 300, 128)):
    """The dispatcher resolves forward and backward separately (each bucket measured on its own), so any
    impl's backward may run on another impl's (out, lse): every ordered pair must give the float64 grads."""
    from opsadv.core import dispatch
    A = importlib.import_module("opsadv.ops.flash_attention")
    from opsadv.registry import get_registry
    b, hq, hkv, sq, sk, d = shape
    q = torch.randn(b, hq, sq, d, device=device, dtype=dtype)
    k = torch.randn(b, hkv, sk, d, device=device, dtype=dtype)
    v = torch.randn_like(k)
    do = torch.randn_like(q)
    _, _, ref = _ref(q, k, v, do, True, 0.1)
    impls = {i.id: i for i in get_registry().impls_by_op["flash_attention"]}
    with opsadv.use_backend("cuda", experimental=True):
        exp, r = dispatch.explain_spec(A._spec(q, k, None, True, True))
    accepted = [c.impl.id for c in exp.candidates if c.accepted and c.impl.id in ids]
    for fwd_id in accepted:
        o, lse = impls[fwd_id].fn(r.ctx, q, k, v, None, True, 0.1)
        for bwd_id in accepted:
            grads = impls[bwd_id].backward(r.ctx, do, q, k, v, o, lse, None, True, 0.1)
            for name, x, y in zip(("dq", "dk", "dv"), grads, ref):
                assert rel_err(x, y) < tol, (fwd_id, bwd_id, name, rel_err(x, y))
    return accepted


def test_every_forward_with_every_backward_interpreter(seed):
    """CPU (interpreter): the Triton impls' forward and backward cross-paired."""
    got = _cross_pairs("cpu", torch.float16, (TRITON_ID, ATOMIC_ID), 3e-3, shape=(1, 4, 2, 45, 45, 64))
    assert set(got) == {TRITON_ID, ATOMIC_ID}


@requires_gpu
def test_gpu_every_forward_with_every_backward(seed):
    """GPU: cuDNN, flash, efficient, Triton (both backwards) and, on Hopper, Gluon, cross-paired; cuDNN's
    backward gets out in another kernel's layout (the Gluon / Triton kernels write (b, s, h, d) memory)."""
    ids = ("cuda.sdpa.cudnn", "cuda.sdpa.flash", "cuda.sdpa.efficient", TRITON_ID, ATOMIC_ID,
           "cuda.gluon.flash_attention")
    got = _cross_pairs("cuda", torch.bfloat16, ids, 1.5e-2)
    assert {"cuda.sdpa.flash", TRITON_ID} <= set(got), got


def _every_tile_config(device, dtype, d, tma_ok, profile=None):
    """Each config of the profile's autotune space (TMA ones included on a GPU), forced in turn,
    on ragged shapes (s_q > s_k, causal: rows with no key), forward and backward."""
    from opsadv.backends.triton_common.flash_attention import attention as A
    from opsadv.core import dispatch
    OA = importlib.import_module("opsadv.ops.flash_attention")
    q = torch.randn(1, 4, 133, d, device=device, dtype=dtype)
    k = torch.randn(1, 2, 100, d, device=device, dtype=dtype)
    v = torch.randn_like(k)
    do = torch.randn_like(q)
    ro, _, ref = _ref(q, k, v, do, True, 0.1)
    with opsadv.use_backend("cuda", profile=profile):
        _, r = dispatch.explain_spec(OA._spec(q, k, None, True, True))
    orig = A._configs
    space = {w: orig(r.ctx, w, d, tma_ok=tma_ok) for w in ("fwd", "bwd_kv", "bwd_q")}
    tuners = (A._FWD, A._BWD_KV, A._BWD_Q)
    try:
        for i in range(max(len(c) for c in space.values())):
            A._configs = lambda ctx, which, d_, tma_ok_, i=i: [space[which][i % len(space[which])]]
            for t in tuners:
                t.best.clear()
            o, lse = A.flash_fwd(r.ctx, q, k, v, None, True, 0.1)
            grads = A.flash_bwd(r.ctx, do, q, k, v, o, lse, None, True, 0.1)
            tol = 1.5e-2 if dtype == torch.bfloat16 else 3e-3
            assert rel_err(o, ro) < tol, space["fwd"][i % len(space["fwd"])]
            for x, y in zip(grads, ref):
                assert rel_err(x, y) < tol, (space["bwd_kv"][i % len(space["bwd_kv"])],
                                             space["bwd_q"][i % len(space["bwd_q"])])
    finally:
        A._configs = orig
        for t in tuners:
            t.best.clear()
    return len(space["fwd"])


@requires_gpu
def test_gpu_every_tile_config_is_correct_on_ragged_shapes(seed):
    assert _every_tile_config("cuda", torch.bfloat16, 128, tma_ok=True) >= 1


@requires_gpu
def test_gpu_choice_per_bucket_is_measured(tmp_path, monkeypatch, seed):
    from opsadv.core import tuning
    monkeypatch.setenv("OPSADV_CACHE_DIR", str(tmp_path))
    tuning.reload()
    q = torch.randn(2, 8, 1024, 64, device="cuda", dtype=torch.bfloat16)
    with opsadv.use_backend("cuda", autotune=True):
        opsadv.ops.flash_attention(q, q, q, causal=True)
        exp = opsadv.explain("flash_attention", q, q, q, causal=True)
    assert exp.why.startswith("measured fastest"), exp.why
    tuning.reload()


def test_backward_keeps_the_forward_policy_on_another_thread():
    """CUDA autograd runs backward on its own thread, outside `with use_backend(...)`: the
    backward must still resolve under the forward's policy."""
    import threading
    opsadv.use_backend("reference")                       # process default differs from the scoped policy
    q = torch.randn(1, 2, 20, 32, dtype=torch.float16, requires_grad=True)
    with opsadv.use_backend("cuda", deterministic=True):
        out = opsadv.ops.flash_attention(q, q, q, causal=True)
    seen = {}

    def backward():
        with opsadv.trace() as t:
            out.sum().backward()
        seen.update(t.counts)
    th = threading.Thread(target=backward)
    th.start()
    th.join()
    assert seen == {TRITON_ID: 1}


FWD_VARIANTS = [  # forward kernel variants a profile config may switch on
    {"RESCALE": 8.0}, {"RESCALE": 0.5}, {"PIPE": True}, {"PIPE": True, "RESCALE": 8.0},
]


@pytest.mark.parametrize("flags", FWD_VARIANTS, ids=lambda f: "-".join(f"{k}{v}" for k, v in f.items()))
@pytest.mark.parametrize("b,hq,hkv,sq,sk,d,causal", [CASES[0], CASES[1], CASES[3], CASES[4],
                                                     (1, 2, 2, 70, 130, 64, False)])
def test_forward_variants_match_reference(flags, b, hq, hkv, sq, sk, d, causal, seed, monkeypatch):
    """Conditional rescaling and the software-pipelined kv loop compute the same function: scores
    scaled so that row maxima grow across kv blocks (the rescale path is taken and skipped)."""
    from opsadv.backends.triton_common.flash_attention import attention as A
    from opsadv.core import dispatch
    OA = importlib.import_module("opsadv.ops.flash_attention")
    monkeypatch.setenv("OPSADV_POISON_OUTPUTS", "1")
    q = torch.randn(b, hq, sq, d, dtype=torch.float16)
    k = torch.randn(b, hkv, sk, d, dtype=torch.float16) * torch.linspace(0.2, 2.0, sk).view(1, 1, sk, 1).half()
    v = torch.randn(b, hkv, sk, d, dtype=torch.float16)
    scale = 1.5 / math.sqrt(d)
    _, r = dispatch.explain_spec(OA._spec(q, k, None, causal, False))
    orig = A._configs
    monkeypatch.setattr(A, "_configs", lambda ctx, which, d_, tma_ok: [{**c, **flags} for c in orig(ctx, which, d_,
                                                                                                    tma_ok)])
    A._FWD.best.clear()
    o, lse = A.flash_fwd(r.ctx, q, k, v, None, causal, scale)
    A._FWD.best.clear()
    ro, rl = R.attention_fwd(None, q.double(), k.double(), v.double(), None, causal, scale)
    empty = torch.isneginf(rl)
    assert not torch.isnan(o).any()
    assert torch.equal(torch.isneginf(lse), empty) and (o[empty] == 0).all()
    assert rel_err(lse[~empty], rl[~empty]) < 1e-5
    assert rel_err(o, ro) < 2e-3, rel_err(o, ro)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("mask_kind", ["bool", "float"])
def test_efficient_masked_backward_recompute_matches_reference(causal, mask_kind):
    """The masked half-precision backward of cuda.sdpa.efficient (recomputed through SDPA's own
    autograd; MATH on CPU here, the efficient kernel on a GPU): gradients equal the reference's,
    rows the mask empties give zero gradients, GQA reduced back to the kv heads."""
    from opsadv.backends.cuda.flash_attention import sdpa as S
    g = torch.Generator().manual_seed(3)
    b, hq, hk, s, d = 1, 4, 2, 19, 16
    q = torch.randn(b, hq, s, d, generator=g, dtype=torch.float64)
    k, v = (torch.randn(b, hk, s, d, generator=g, dtype=torch.float64) for _ in range(2))
    keep = torch.rand(b, 1, s, s, generator=g) > 0.4
    keep[:, :, 5] = False                                          # an empty row
    mask = keep if mask_kind == "bool" else torch.zeros(keep.shape, dtype=torch.float64).masked_fill(~keep, float("-inf"))
    dout = torch.randn(b, hq, s, d, generator=g, dtype=torch.float64)
    dq, dk, dv = S._masked_bwd_recompute(dout, q, k, v, mask, causal, d ** -0.5)
    qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
    with opsadv.use_backend("reference"):
        out = opsadv.ops.flash_attention(qq, kk, vv, attn_mask=mask, causal=causal)
    want = torch.autograd.grad(out, (qq, kk, vv), dout)
    for got, ref in zip((dq, dk, dv), want):
        torch.testing.assert_close(got, ref, atol=1e-9, rtol=1e-7)
    assert dq[:, :, 5].abs().max() == 0


def test_efficient_backward_gets_out_in_its_own_layout():
    """The cutlass backward reads out with a row stride of heads * head_dim, whatever the tensor says, so
    cuda.sdpa.efficient hands it out in (b, s, h, d) memory: a (b, h, s, d)-contiguous out (cuDNN's) is
    copied, one already in that memory (the efficient / Triton / Gluon forwards') is passed as is."""
    from opsadv.backends.cuda.flash_attention import sdpa as S
    bhsd = torch.randn(2, 3, 5, 8)
    got = S._bmhk(bhsd)
    assert got.transpose(1, 2).is_contiguous() and torch.equal(got, bhsd) and got.data_ptr() != bhsd.data_ptr()
    bshd = torch.randn(2, 5, 3, 8).transpose(1, 2)
    assert S._bmhk(bshd) is bshd


def test_no_grad_calls_without_lse_take_the_inference_bucket(dispatch_calls):
    """An eager no-grad call that does not ask for lse resolves in its own bucket and runs the impl's
    `inference` forward (cuDNN skips its lse there); one that returns lse, or records grads, does not."""
    seen = dispatch_calls
    q, k, v = (torch.randn(1, 2, 20, 16) for _ in range(3))
    with torch.no_grad():
        out = opsadv.ops.flash_attention(q, k, v, causal=True)
        assert seen[-1][1] and seen[-1][0].inference and not seen[-1][0].train
        out2, lse = opsadv.ops.flash_attention(q, k, v, causal=True, return_lse=True)
        assert not seen[-1][1] and not seen[-1][0].inference
    assert torch.equal(out, out2) and lse.shape == (1, 2, 20)


def test_training_calls_tune_each_impl_forward_with_its_own_backward(tmp_path, monkeypatch, seed):
    """A grad-recording call resolves in the train bucket: autotune times every impl's forward + its own
    backward (the step a training loop pays), stores it under "train", and the grads are right."""
    import json
    from opsadv.core import tuning
    monkeypatch.setenv("OPSADV_CACHE_DIR", str(tmp_path))
    tuning.reload()
    try:
        q, k, v = (torch.randn(1, 2, 37, 32, dtype=torch.float16, requires_grad=True) for _ in range(3))
        do = torch.randn(1, 2, 37, 32, dtype=torch.float16)
        with opsadv.use_backend("auto", autotune=True), opsadv.trace() as t:
            out = opsadv.ops.flash_attention(q, k, v, causal=True)
            dq, dk, dv = torch.autograd.grad(out, (q, k, v), do)
        entries = {key: e["value"] for dev in json.loads((tmp_path / "tuning.json").read_text())["sections"].values()
                   for key, e in dev.items()}
        train = [e for key, e in entries.items() if key.startswith("flash_attention|train|")]
        assert len(train) == 1 and len(train[0]["times_ms"]) >= 2, entries
        assert train[0]["winner"] in t.counts
        ro, _, ref = _ref(q.detach(), k.detach(), v.detach(), do, True, 32 ** -0.5)
        assert rel_err(out, ro) < 3e-3
        for got, want in zip((dq, dk, dv), ref):
            assert rel_err(got, want) < 3e-3
    finally:
        monkeypatch.undo()
        tuning.reload()


def test_explain_names_the_bucket_the_call_resolves_in():
    """explain() builds the spec the call itself uses: inference for a no-grad call without lse, train for a
    grad-recording one, the plain forward bucket when lse is returned."""
    q = torch.randn(1, 2, 20, 16)
    with torch.no_grad():
        assert "inference (no-grad" in str(opsadv.explain("flash_attention", q, q, q))
        assert "inference" not in str(opsadv.explain("flash_attention", q, q, q, return_lse=True))
    qg = q.clone().requires_grad_()
    assert "train (grad-recording" in str(opsadv.explain("flash_attention", qg, q, q))


# The Hopper dQ path of the atomic backward (one TMA bulk reduce-add per tile) has no interpreter support, so on
# CPU it is compiled for sm_90 (ptxas, no GPU) in a fresh interpreter without TRITON_INTERPRET and its PTX read;
# test_gpu_triton_atomic_dq_backward runs it on an H100 / H200.
_BWD_TMA_COMPILE = r"""
import json, os, re
os.environ.pop("TRITON_INTERPRET", None)
import torch
from triton.tools.tensor_descriptor import TensorDescriptor
from opsadv.backends.triton_common.flash_attention import attention as A
from opsadv.testing.sm90 import compile_sm90
fn = A._bwd_kv_kernel
b, hq, hkv, sq, sk, d, bm, bn = 1, 4, 2, 1000, 1000, 128, 64, 128
q = torch.randn(b, hq, sq, d, dtype=torch.bfloat16)
k = torch.randn(b, hkv, sk, d, dtype=torch.bfloat16)
lse2, dqa = torch.empty(b, hq, sq), torch.zeros(b, hq, sq, d)
out = {}
for tma in (False, True):
    desc = TensorDescriptor(dqa, [b * hq, sq, d], [sq * d, d, 1], [1, bm, d]) if tma else None
    args = (q, k, k, q, k, k, lse2, lse2, dqa, desc, None, None) + q.stride()[:3] * 2 + k.stride()[:3] * 4 + (
        hq, hq // hkv, sq, sk, 0, 0.1, 0.08)
    kw = dict(zip(fn.arg_names, args), HEAD_DIM=d, BLOCK_D=d, BLOCK_M=bm, BLOCK_N=bn, CAUSAL=True, EVEN_M=False,
              EVEN_N=False, ATOMIC_DQ=True, DQ_TMA=tma)
    ptx = compile_sm90(fn, kw, num_warps=8, num_stages=2)["ptx"]
    out[str(tma)] = {"bulk_reduce": len(re.findall(r"cp\.reduce\.async\.bulk\.tensor\.3d\.global\.shared::cta\.add", ptx)),
                     "element_atomics": len(re.findall(r"\b(?:red|atom)\.global\.", ptx))}
print(json.dumps(out))
"""


_BWD_LOADS_COMPILE = r"""
import json, os
os.environ.pop("TRITON_INTERPRET", None)
import torch
from opsadv.backends.triton_common.flash_attention import attention as A
from opsadv.testing.sm90 import compile_sm90
b, h, s, d, bm, bn = 4, 32, 4096, 128, 64, 64
q = torch.randn(b, h, s, d, dtype=torch.bfloat16)
lse2 = torch.empty(b, h, s)
out = {}
for tma in (False, True):
    qd = A.desc_bhsd(q, bm) if tma else None
    args = (q, q, q, q, q, q, lse2, lse2, lse2, None, qd, qd) + q.stride()[:3] * 6 + (h, 1, s, s, 0, 0.1, 0.08)
    kw = dict(zip(A._bwd_kv_kernel.arg_names, args), HEAD_DIM=d, BLOCK_D=d, BLOCK_M=bm, BLOCK_N=bn, CAUSAL=False,
              EVEN_M=True, EVEN_N=True, ATOMIC_DQ=False, DQ_TMA=False, TMA=tma)
    r = compile_sm90(A._bwd_kv_kernel, kw, num_warps=4, num_stages=2)
    out[str(tma)] = {k: r[k] for k in ("tma_loads", "spill_stores", "spill_loads")}
print(json.dumps(out))
"""


def test_backward_tma_loads_cut_spills_on_sm90():
    """The dK/dV kernel at the h100 default tile (64x64/4/2, d128, b4 s4096, non-causal): pointer loads of q and dO
    spill (44 B), descriptor loads do not; this is why the TMA configs are in the h100 space."""
    import json
    from conftest import run_sm90_compile
    r = json.loads(run_sm90_compile(["-c", _BWD_LOADS_COMPILE]).strip().splitlines()[-1])
    assert r["True"]["tma_loads"] > 0 and r["False"]["tma_loads"] == 0
    assert r["True"]["spill_stores"] == 0 and r["True"]["spill_loads"] == 0
    assert r["False"]["spill_stores"] > 0


def test_atomic_dq_backward_reduces_through_tma_on_sm90():
    """With DQ_TMA the dK/dV kernel adds each tile's dQ share with one bulk tensor reduce (per inner loop: the
    causal band and the rest), and no element atomics remain; without it, element atomics do the adding."""
    import json
    from conftest import run_sm90_compile
    r = json.loads(run_sm90_compile(["-c", _BWD_TMA_COMPILE]).strip().splitlines()[-1])
    assert r["True"] == {"bulk_reduce": 2, "element_atomics": 0}
    assert r["False"]["bulk_reduce"] == 0 and r["False"]["element_atomics"] > 0


@requires_gpu
def test_gpu_two_stream_backward_identical_and_graph_capturable(seed, monkeypatch):
    """CONCURRENT_BWD (dQ kernel on a side stream): the same bits as one stream, and the fork / join records into
    a CUDA graph whose replay gives the eager gradients."""
    from opsadv.backends.triton_common.flash_attention import attention as A
    monkeypatch.setattr(A, "_autotune", lambda ctx, device: False)
    q, k, v, do = (torch.randn(2, 8, 700, 128, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    pin = {"flash_attention": TRITON_ID}

    def grads():
        qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
        with opsadv.use_backend("cuda", deterministic=True, impls=pin):
            out = opsadv.ops.flash_attention(qq, kk, vv, causal=True)
            return torch.autograd.grad(out, (qq, kk, vv), do)

    monkeypatch.setattr(A, "CONCURRENT_BWD", False)
    one = grads()
    monkeypatch.setattr(A, "CONCURRENT_BWD", True)
    two = grads()
    assert all(torch.equal(a, b) for a, b in zip(one, two))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        grads()                                           # warm up (compile) outside the capture
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        static = grads()
    g.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(one, static))


def test_cudnn_ranks_below_flash_for_decode_shapes():
    """A decode step (a few queries against a longer cache) ranks cuDNN below FlashAttention-2; prefill, square and
    backward calls keep the static order (the rank is a pure function of the call's buckets)."""
    from opsadv.backends.cuda.flash_attention import sdpa
    from opsadv.core.kernel import PRIORITY_VENDOR
    from opsadv.ops.flash_attention import _spec

    def spec(sq, sk, backward=False):
        q, k = torch.empty(8, 15, sq, 64), torch.empty(8, 5, sk, 64)
        return _spec(q, k, None, False, backward)
    flash = PRIORITY_VENDOR - 10
    prio, why = sdpa._cudnn_rank(spec(1, 517), None)
    assert prio < flash and "decode" in why
    assert sdpa._cudnn_rank(spec(16, 4096), None)[0] < flash
    assert sdpa._cudnn_rank(spec(2048, 2048), None) is None
    assert sdpa._cudnn_rank(spec(1, 12), None) is None           # the keys fit the queries' bucket: not a cache
    assert sdpa._cudnn_rank(spec(1, 517, backward=True), None) is None
