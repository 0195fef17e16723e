"""cuda backend gemm / swiglu_gemm: the Triton kernels under the interpreter (fp32 under tf32
policy, fp16) and the cuBLAS impls' torch code, against the reference backend in float64,
forward and backward; bf16 and the dispatcher on a real GPU with requires_gpu."""
import pytest
import torch

import opsadv
from opsadv.core import dispatch
from opsadv.core.kernel import ResolveContext
from opsadv.ops.gemm import _gemm_spec, _swiglu_spec
from opsadv.errors import NoKernelError
from opsadv.registry import get_registry

from conftest import HAS_CUDA, rel_err, requires_gpu

ACTS = ("none", "relu", "gelu", "gelu_tanh", "silu")
TOL = {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}
DEV = "cuda" if HAS_CUDA else "cpu"


def _impl(impl_id):
    return next(i for op in ("gemm", "swiglu_gemm") for i in get_registry().impls_by_op[op] if i.id == impl_id)


def _ctx(spec):
    """The context the dispatcher would hand an impl of the cuda backend under precision tf32."""
    with opsadv.use_backend("cuda", precision="tf32", strict=True):
        exp, r = dispatch.explain_spec(spec)
    assert r is not None, str(exp)
    return ResolveContext(env=r.ctx.env, profile=r.ctx.profile, options=r.ctx.options, spec=spec)


def _ref_gemm(a, b, bias, act, res, alpha):
    with opsadv.use_backend("reference"):
        d = lambda t: None if t is None else t.detach().double()  # noqa: E731
        return opsadv.ops.gemm(d(a), d(b), bias=d(bias), activation=act, residual=d(res), alpha=alpha)


def _inputs(m, k, n, dtype, *, lead=(), transposed=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g).to(dtype).to(DEV)  # noqa: E731
    a = r(*lead, m, k)
    b = r(n, k).t() if transposed else r(k, n)                    # nn.Linear weight.t() is the common case
    return a, b, r(n), r(*lead, m, n)


@pytest.mark.parametrize("impl_id,shapes", [
    ("cuda.triton.gemm", [(1, 37, 23), (3, 70, 33), (17, 130, 65)]),          # K, N not multiples of the tile
    ("cuda.triton.gemm_tma", [(1, 40, 24), (3, 64, 48), (17, 72, 40)]),       # TMA needs 16-byte rows
    # interpreter: 2 persistent programs walk 1..20 tiles of 32x32
    ("cuda.triton.gemm_persistent", [(1, 40, 24), (3, 64, 48), (67, 72, 72), (127, 24, 136)]),
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gemm_forward_epilogues(impl_id, shapes, dtype):
    impl = _impl(impl_id)
    for i, (m, k, n) in enumerate(shapes):
        a, b, bias, res = _inputs(m, k, n, dtype, transposed=i % 2 == 0, seed=i)
        for j, act in enumerate(ACTS):
            use_bias, use_res, alpha = j % 2 == 0, j % 3 != 1, (1.0 if j % 2 else 0.5)
            bb, rr = (bias if use_bias else None), (res if use_res else None)
            ctx = _ctx(_gemm_spec(a, b, bb, act, rr, alpha, False))
            out = impl.fn(ctx, a, b, bb, act, rr, alpha)
            want = _ref_gemm(a, b, bb, act, rr, alpha)
            assert out.shape == want.shape and out.dtype == dtype
            assert rel_err(out, want) < TOL[dtype], (m, k, n, act, use_bias, use_res, alpha)


# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages, programs per "SM", EPI_SPLIT): whole-tile and half-tile TMA
# stores, several programs, a tile wider than N, a K tile wider than K
PERSISTENT_CONFIGS = [(32, 32, 32, 4, 1, 1, False), (32, 32, 32, 4, 1, 3, True), (16, 64, 64, 4, 1, 1, True)]


@pytest.mark.parametrize("config", PERSISTENT_CONFIGS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_persistent_kernel_configs(config, dtype):
    """The persistent kernel under explicit configs, every epilogue, into NaN-poisoned outputs:
    odd M (1, 3, 127), K and N not multiples of the tiles, b as (K, N) and as nn.Linear (N, K)."""
    from opsadv.backends.triton_common.gemm.gemm import _launch
    for i, (m, k, n) in enumerate([(1, 40, 24), (3, 200, 56), (127, 24, 136)]):
        a, b, bias, res = _inputs(m, k, n, dtype, transposed=i % 2 == 0, seed=10 + i)
        for j, act in enumerate(ACTS):
            bb, rr, alpha = (bias if j % 2 == 0 else None), (res if j % 3 != 1 else None), (1.0 if j % 2 else 0.5)
            ctx = _ctx(_gemm_spec(a, b, bb, act, rr, alpha, False))
            out = torch.full((m, n), float("nan"), dtype=dtype, device=DEV)
            _launch(ctx, a, b, out, bb, rr, None, act, alpha, False, False, "persistent", config=config)
            assert rel_err(out, _ref_gemm(a, b, bb, act, rr, alpha)) < TOL[dtype], (config, m, k, n, act)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gemm_dispatch_batched_noncontiguous(dtype):
    a, b, bias, res = _inputs(5, 48, 40, dtype, lead=(2, 3))
    a_nc = torch.randn(2, 3, 5, 96, dtype=dtype, device=DEV)[..., ::2]          # non-unit stride in K
    with opsadv.use_backend("cuda", precision="tf32"):
        out = opsadv.ops.gemm(a, b, bias=bias, activation="gelu_tanh", residual=res, alpha=2.0)
        out_nc = opsadv.ops.gemm(a_nc, b, activation="silu")
        chosen = opsadv.explain("gemm", a, b, bias=bias, activation="gelu_tanh", residual=res, alpha=2.0).chosen
    assert chosen.startswith("cuda.triton.gemm")
    assert out.shape == (2, 3, 5, 40)
    assert rel_err(out, _ref_gemm(a, b, bias, "gelu_tanh", res, 2.0)) < TOL[dtype]
    assert rel_err(out_nc, _ref_gemm(a_nc, b, None, "silu", None, 1.0)) < TOL[dtype]


@pytest.mark.parametrize("act", ACTS)
def test_gemm_backward_autograd(act):
    a, b, bias, res = _inputs(17, 40, 24, torch.float32, lead=(2,), seed=3)
    a, b, bias, res = (t.requires_grad_() for t in (a, b, bias, res))
    go = torch.randn(2, 17, 24, dtype=torch.float32, device=DEV)
    with opsadv.use_backend("cuda", precision="tf32"):
        out = opsadv.ops.gemm(a, b, bias=bias, activation=act, residual=res, alpha=0.7)
        grads = torch.autograd.grad(out, (a, b, bias, res), go)
    ref_in = [t.detach().double().requires_grad_() for t in (a, b, bias, res)]
    with opsadv.use_backend("reference"):
        ref = opsadv.ops.gemm(ref_in[0], ref_in[1], bias=ref_in[2], activation=act, residual=ref_in[3], alpha=0.7)
        ref_grads = torch.autograd.grad(ref, ref_in, go.double())
    for name, g, r in zip("a b bias residual".split(), grads, ref_grads):
        assert rel_err(g, r) < 1e-5, (act, name)


@pytest.mark.parametrize("impl_id", ["cuda.triton.gemm", "cuda.triton.gemm_tma", "cuda.triton.gemm_persistent",
                                     "cuda.cublas.gemm_epilogue"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gemm_backward_impls(impl_id, dtype):
    impl = _impl(impl_id)
    a, b, bias, _ = _inputs(3, 64, 40, dtype, lead=(2,), seed=5)
    go = torch.randn(2, 3, 40, device=DEV).to(dtype)
    for act in ("none", "gelu_tanh", "silu"):
        ctx = _ctx(_gemm_spec(a, b, bias, act, None, 1.5, True))
        da, db, dbias = impl.backward(ctx, go, a, b, bias, act, 1.5)
        with opsadv.use_backend("reference"):
            ref = _impl_ref("gemm").backward(ctx, go.double(), a.double(), b.double(), bias.double(), act, 1.5)
        for g, r in zip((da, db, dbias), ref):
            assert g.dtype == dtype and g.shape == r.shape
            assert rel_err(g, r) < 5 * TOL[dtype], (impl_id, act)


def _impl_ref(op):
    return next(i for i in get_registry().impls_by_op[op] if i.backend == "reference")


@pytest.mark.parametrize("impl_id", ["cuda.triton.swiglu_gemm", "cuda.triton.swiglu_gemm_tma",
                                     "cuda.triton.swiglu_gemm_persistent", "cuda.cublas.swiglu_gemm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_swiglu_forward_backward(impl_id, dtype):
    impl = _impl(impl_id)
    shapes = [(1, 40, 24), (17, 64, 40)] if "tma" in impl_id or "persistent" in impl_id else [(1, 37, 23), (17, 70, 33)]
    for i, (m, k, n) in enumerate(shapes):
        g = torch.Generator().manual_seed(i)
        x = torch.randn(2, m, k, generator=g).to(dtype).to(DEV)
        w = torch.randn(k, 2 * n, generator=g).to(dtype).to(DEV)
        if i % 2:
            w = torch.randn(2 * n, k, generator=g).to(dtype).to(DEV).t()        # transposed [W_g | W_u]
        bias = torch.randn(2 * n, generator=g).to(dtype).to(DEV) if i % 2 == 0 else None
        go = torch.randn(2, m, n, generator=g).to(dtype).to(DEV)
        ctx = _ctx(_swiglu_spec(x, w, bias, False))
        out = impl.fn(ctx, x, w, bias)
        grads = impl.backward(ctx, go, x, w, bias)
        ref = _impl_ref("swiglu_gemm")
        d = lambda t: None if t is None else t.double()  # noqa: E731
        want = ref.fn(ctx, d(x), d(w), d(bias))
        want_grads = ref.backward(ctx, d(go), d(x), d(w), d(bias))
        assert out.shape == (2, m, n) and rel_err(out, want) < TOL[dtype]
        for got, r in zip(grads, want_grads):
            if r.numel():
                assert rel_err(got, r) < 5 * TOL[dtype], impl_id
            else:
                assert got.numel() == 0


def test_swiglu_autograd_dispatch():
    x = torch.randn(3, 24, device=DEV, requires_grad=True)
    w = torch.randn(24, 32, device=DEV, requires_grad=True)
    with opsadv.use_backend("cuda", precision="tf32"):
        y = opsadv.ops.swiglu_gemm(x, w)
        dx, dw = torch.autograd.grad(y.sum(), (x, w))
    xd, wd = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    g, u = (xd @ wd).chunk(2, -1)
    yr = torch.nn.functional.silu(g) * u
    dxr, dwr = torch.autograd.grad(yr.sum(), (xd, wd))
    assert rel_err(y, yr) < 1e-5 and rel_err(dx, dxr) < 1e-5 and rel_err(dw, dwr) < 1e-5


@pytest.mark.parametrize("impl_id", ["cuda.cublas.gemm", "cuda.cublas.gemm_epilogue", "cuda.cublas.gemm_small_m"])
def test_cublas_impls_torch_code(impl_id):
    """The vendor impls' torch code (addmm, _addmm_activation) runs on CPU tensors too."""
    impl = _impl(impl_id)
    a, b, bias, res = _inputs(17, 40, 24, torch.float32, lead=(2,))
    combos = [("none", bias, None), ("none", None, None), ("relu", bias, None)]
    if not impl_id.endswith("cublas.gemm"):
        combos += [(act, bias, res) for act in ACTS] + [("relu", None, res), ("gelu_tanh", bias, None)]
    for act, bb, rr in combos:
        ctx = _ctx(_gemm_spec(a, b, bb, act, rr, 0.5, False))
        assert rel_err(impl.fn(ctx, a, b, bb, act, rr, 0.5), _ref_gemm(a, b, bb, act, rr, 0.5)) < 1e-5, act


def test_cublas_impl_declarations():
    """Static priorities follow the H200 measurements: cuBLASLt's fused bias+gelu_tanh and cuBLAS at
    decode sizes win by default; each cuBLAS impl declares what it cannot serve."""
    fused = _impl("cuda.cublas.gemm")
    a, b, bias, _ = _inputs(17, 40, 24, torch.float16)
    env = get_registry().env
    ok = _gemm_spec(a, b, bias, "gelu_tanh", None, 1.0, False)
    no_bias = _gemm_spec(a, b, None, "gelu_tanh", None, 1.0, False)
    assert "only together with a bias" in " ".join(fused.check(no_bias, env))
    assert fused.check(ok, env) == []
    small = _impl("cuda.cublas.gemm_small_m")
    big = _gemm_spec(torch.empty(300, 40, dtype=torch.float16), b, bias, "silu", None, 1.0, False)
    assert small.check(ok, env) == [] and "M <= 64" in " ".join(small.check(big, env))


def test_fp32_needs_tf32_policy():
    a, b, _, _ = _inputs(3, 16, 8, torch.float32)
    with opsadv.use_backend("cuda"):
        exp = opsadv.explain("gemm", a, b)
        trit = [c for c in exp.candidates if c.impl.id.startswith("cuda.triton")]
        assert trit and all(not c.accepted and any("tf32" in r for r in c.reasons) for c in trit)
        if not HAS_CUDA:
            with pytest.raises(NoKernelError):
                opsadv.ops.gemm(a, b)


def test_tma_rejects_unaligned_rows():
    a, b, _, _ = _inputs(3, 37, 24, torch.float16)
    with opsadv.use_backend("cuda"):
        exp = opsadv.explain("gemm", a, b, activation="relu")
    tma = next(c for c in exp.candidates if c.impl.id == "cuda.triton.gemm_tma")
    assert not tma.accepted and any("16-byte" in r for r in tma.reasons)
    assert exp.chosen == "cuda.triton.gemm"
    x, w = torch.randn(3, 32, dtype=torch.float16), torch.randn(32, 24, dtype=torch.float16)   # N = 12 halfs
    with opsadv.use_backend("cuda"):
        exp = opsadv.explain("swiglu_gemm", x, w)
    for c in exp.candidates:
        if c.impl.id.endswith(("_tma", "_persistent")):
            assert not c.accepted and any("N=12" in r for r in c.reasons), c.impl.id


@pytest.mark.parametrize("profile", ["jetson", "interpreter"])
def test_profiles_fixed_tiles(profile):
    from opsadv.backends.triton_common.gemm.gemm import _fixed_config
    bm, bn, bk, w, s = _fixed_config(profile, "gemm", 4096, 4096)
    if profile == "jetson":
        assert max(bm, bn, bk) <= 64 and s <= 2
    a, b, bias, _ = _inputs(17, 40, 24, torch.float16)
    with opsadv.use_backend("cuda", profile=profile):
        out = opsadv.ops.gemm(a, b, bias=bias, activation="silu")
    assert rel_err(out, _ref_gemm(a, b, bias, "silu", None, 1.0)) < TOL[torch.float16]


@requires_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 16, 300])
def test_gpu_gemm_impls(dtype, m):
    a, b, bias, res = _inputs(m, 512, 384, dtype, lead=(2,))
    for impl_id in ("cuda.triton.gemm", "cuda.triton.gemm_tma", "cuda.triton.gemm_persistent",
                    "cuda.cublas.gemm_epilogue"):
        impl = _impl(impl_id)
        if impl_id.endswith(("tma", "persistent")) and torch.cuda.get_device_capability() < (9, 0):
            continue
        for act in ACTS:
            ctx = _ctx(_gemm_spec(a, b, bias, act, res, 0.5, False))
            out = impl.fn(ctx, a, b, bias, act, res, 0.5)
            assert rel_err(out, _ref_gemm(a, b, bias, act, res, 0.5)) < TOL[dtype], (impl_id, act)
            da, db, dbias = impl.backward(ctx, res, a, b, bias, act, 0.5)
            ref = _impl_ref("gemm").backward(ctx, res.double(), a.double(), b.double(), bias.double(), act, 0.5)
            for g, r in zip((da, db, dbias), ref):
                assert rel_err(g, r) < 3 * TOL[dtype], (impl_id, act)
    w = torch.randn(512, 768, device="cuda").to(dtype)
    ref = _impl_ref("swiglu_gemm").fn(None, a.double(), w.double(), None)
    with opsadv.use_backend("cuda"):
        assert rel_err(opsadv.ops.swiglu_gemm(a, w), ref) < TOL[dtype]


def test_hopper_ranks_cublas_epilogue_above_triton():
    """On cc >= 9.0 the unfused cuBLAS epilogue path outranks the Triton GEMM (measured there);
    elsewhere Triton's fused epilogue keeps its rank.  SwiGLU keeps Triton everywhere."""
    import dataclasses
    from opsadv.backends.cuda.gemm import cublas as CB
    from opsadv.backends.triton_common.gemm import gemm as G
    from opsadv.core.env import current_env
    base = current_env()
    rank = {}
    for cc in ((9, 0), (8, 0)):
        env = dataclasses.replace(base, device_type="cuda", compute_capability=cc)
        rank[cc] = {i.id: i.priority for i in G.impls(env) + CB.impls(env)}
    h, a = rank[(9, 0)], rank[(8, 0)]
    if "cuda.triton.gemm_tma" in h:
        assert h["cuda.cublas.gemm_epilogue"] > h["cuda.triton.gemm_persistent"] > h["cuda.triton.gemm_tma"] \
            > h["cuda.triton.gemm"]
        assert h["cuda.triton.swiglu_gemm_tma"] > h["cuda.triton.swiglu_gemm_persistent"]   # SwiGLU unmeasured
        assert h["cuda.triton.swiglu_gemm_tma"] > h["cuda.cublas.swiglu_gemm"]
    if "cuda.triton.gemm" in a:
        assert a["cuda.cublas.gemm_epilogue"] < a["cuda.triton.gemm"]


def _dispatched_gemm_keys(monkeypatch):
    """Every (op, backward, activation-or-None) the gemm ops ask the dispatcher for, in call order."""
    seen = []
    real = dispatch.call

    def spy(key, *args, **kw):
        if key[0] == "gemm":
            seen.append(("gemm", key[1], key[4]))
        elif key[0] in ("swiglu_gemm", "swiglu"):
            seen.append((key[0], key[1], None))
        return real(key, *args, **kw)
    monkeypatch.setattr(dispatch, "call", spy)
    return seen


def _graph_nodes(t):
    names, todo = set(), [t.grad_fn]
    while todo:
        f = todo.pop()
        if f is not None and f.name() not in names:
            names.add(f.name())
            todo += [n for n, _ in f.next_functions]
    return names


@pytest.mark.parametrize("act,node", [("relu", "ReluBackward0"), ("gelu", "GeluBackward0"),
                                      ("gelu_tanh", "GeluBackward0"), ("silu", "SiluBackward0")])
def test_training_calls_keep_the_preactivation(act, node, monkeypatch):
    """A grad-recording gemm with an activation runs the GEMM with activation "none" (forward and backward
    buckets) and the activation as torch's op, whose autograd node keeps z: the backward needs no third GEMM
    to recompute it.  A no-grad call keeps the fused epilogue.  Gradients match float64."""
    a, b, bias, res = _inputs(19, 40, 24, torch.float32, lead=(2,), seed=5)
    seen = _dispatched_gemm_keys(monkeypatch)
    with opsadv.use_backend("cuda", precision="tf32"):
        with torch.no_grad():
            fused = opsadv.ops.gemm(a, b, bias=bias, activation=act, residual=res, alpha=0.7)
        assert seen == [("gemm", False, act)]
        seen.clear()
        ins = [t.clone().requires_grad_() for t in (a, b, bias, res)]
        out = opsadv.ops.gemm(*ins[:2], bias=ins[2], activation=act, residual=ins[3], alpha=0.7)
        assert node in _graph_nodes(out)
        go = torch.randn_like(out)
        grads = torch.autograd.grad(out, ins, go)
    assert seen == [("gemm", False, "none"), ("gemm", True, "none")]
    assert rel_err(fused, _ref_gemm(a, b, bias, act, res, 0.7)) < 1e-5
    ref_in = [t.double().requires_grad_() for t in (a, b, bias, res)]
    z = ref_in[0] @ ref_in[1] * 0.7 + ref_in[2]
    ref = {"relu": torch.relu, "gelu": torch.nn.functional.gelu, "silu": torch.nn.functional.silu,
           "gelu_tanh": lambda t: torch.nn.functional.gelu(t, approximate="tanh")}[act](z) + ref_in[3]
    assert rel_err(out, ref) < 1e-5
    for name, g, r in zip("a b bias residual".split(), grads, torch.autograd.grad(ref, ref_in, go.double())):
        assert rel_err(g, r) < 1e-5, name


def test_swiglu_training_calls_run_the_gemm_then_the_swiglu_op(monkeypatch):
    x, w, bias, _ = _inputs(13, 40, 48, torch.float32, seed=6)          # w: (40, 48) = [W_g | W_u]
    seen = _dispatched_gemm_keys(monkeypatch)
    with opsadv.use_backend("cuda", precision="tf32"):
        with torch.no_grad():
            opsadv.ops.swiglu_gemm(x, w, bias=bias)
        assert seen == [("swiglu_gemm", False, None)]
        seen.clear()
        ins = [t.clone().requires_grad_() for t in (x, w, bias)]
        out = opsadv.ops.swiglu_gemm(ins[0], ins[1], bias=ins[2])
        go = torch.randn_like(out)
        grads = torch.autograd.grad(out, ins, go)
    # the GEMM, then the swiglu op; backward in reverse order
    assert seen == [("gemm", False, "none"), ("swiglu", False, None), ("swiglu", True, None), ("gemm", True, "none")]
    ref_in = [t.double().requires_grad_() for t in (x, w, bias)]
    g_, u_ = (ref_in[0] @ ref_in[1] + ref_in[2]).chunk(2, dim=-1)
    ref = torch.nn.functional.silu(g_) * u_
    assert rel_err(out, ref) < 1e-5
    for name, g, r in zip("x w bias".split(), grads, torch.autograd.grad(ref, ref_in, go.double())):
        assert rel_err(g, r) < 1e-5, name


def test_explain_describes_the_training_composition():
    """explain() shows what a grad-recording call runs: the activation-free GEMM, and says so."""
    a, b, bias, _ = _inputs(5, 16, 8, torch.float32)
    with opsadv.use_backend("cuda", precision="tf32"):
        fused = opsadv.explain("gemm", a, b, bias=bias, activation="silu")
        train = opsadv.explain("gemm", a.requires_grad_(), b, bias=bias, activation="silu")
        sw = opsadv.explain("swiglu_gemm", a, torch.randn(16, 8, device=DEV))
    assert "act_silu" in fused.spec.features and "grad-recording" not in fused.why
    assert "act_silu" not in train.spec.features and "then silu as torch ops" in train.why
    assert sw.op == "gemm" and "swiglu op" in sw.why


def test_traced_training_calls_compose_too():
    """Under torch.compile (the TORCH_OPS path) a grad-recording gemm with an activation and a swiglu_gemm run
    the same composition as eager: gradients match eager's."""
    a, b, bias, _ = _inputs(7, 24, 16, torch.float32, seed=8)
    w = torch.randn(24, 2 * 16, device=DEV) / 5

    def step(a_, b_, bias_, w_):
        y = opsadv.ops.gemm(a_, b_, bias=bias_, activation="gelu_tanh")
        return (y * opsadv.ops.swiglu_gemm(a_, w_)).sum()

    grads = {}
    for name, fn in (("eager", step), ("compiled", torch.compile(step, backend="aot_eager", fullgraph=True))):
        ins = [t.clone().requires_grad_() for t in (a, b, bias, w)]
        with opsadv.use_backend("cuda", precision="tf32"):
            grads[name] = torch.autograd.grad(fn(*ins), ins)
    for g, r in zip(grads["compiled"], grads["eager"]):
        assert rel_err(g, r) < 1e-6


@pytest.mark.parametrize("kernel", ["ptr", "tma", "persistent"])
def test_tuned_config_is_measured_kept_and_reused(kernel, tmp_path, monkeypatch):
    """The Triton GEMM's tile configs go through the kernels' ConfigTuner: every config launches (NaN-poisoned
    output, odd shapes, checked against float64), the fastest is kept in kernel_configs.json under
    triton_gemm.<kernel>, and a fresh process takes it without launching anything."""
    from opsadv.backends.triton_common import utils as U
    from opsadv.backends.triton_common.gemm import gemm as G
    monkeypatch.setenv("OPSADV_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(U, "_CONFIGS", None)
    monkeypatch.setattr(G, "_TUNERS", {})
    monkeypatch.setattr(U.torch.cuda, "is_current_stream_capturing", lambda: False)
    configs = [(16, 32, 32, 4, 1), (32, 32, 32, 4, 1)]
    if kernel == "persistent":
        configs = [c + (1, True) for c in configs]
    checked = []

    def rounds(steps, device_type, timing):
        for i in steps:                           # each config's own output, poisoned first
            out.fill_(float("nan"))
            steps[i]()
            checked.append(rel_err(out, want) < TOL[torch.float32])
        return {i: [3.0, 1.0][i] for i in steps}
    monkeypatch.setattr(U, "time_rounds", rounds)
    a, b, bias, res = _inputs(37, 40, 24, torch.float32, seed=5)
    ctx = _ctx(_gemm_spec(a, b, bias, "gelu", res, 0.5, False))
    want = _ref_gemm(a, b, bias, "gelu", res, 0.5)
    out = torch.full((37, 24), float("nan"), device=DEV)
    got = G._tuned_config(ctx, kernel, configs, a, b, out, bias, res, None, "gelu", 0.5, False, False)
    assert got == configs[1] and checked == [True, True]
    stored = (tmp_path / "kernel_configs.json").read_text()
    assert f"triton_gemm.{kernel}|" in stored
    monkeypatch.setattr(U, "_CONFIGS", None)
    monkeypatch.setattr(G, "_TUNERS", {})                        # "a new process"
    monkeypatch.setattr(U, "time_rounds", lambda *a: 1 / 0)
    again = G._tuned_config(ctx, kernel, configs, a, b, out.fill_(float("nan")), bias, res, None, "gelu", 0.5,
                            False, False)
    assert again == configs[1] and torch.isnan(out).all()       # nothing launched
