"""cuda.gluon.swiglu_gemm (gluon_swiglu_gemm.py, _gluon_swiglu_kernel.py): the Gluon SwiGLU GEMM.

CPU: every variant x dtype x weight layout x bias compiles for sm_90 (ptxas) without spills and within the shared
memory limit, with the two accumulators' eight wgmmas per K-slice; declaration and rejection reasons; a machine
without Gluon still registers the impl with the reason.  H200 (-k gpu): every variant against float64 at odd M,
N and K tails, both weight layouts, with and without bias, on a capped grid too (each CTA walks many tiles);
through the op (batched, the autograd path) pinned to this impl."""

import pytest
import torch

# one xdist worker runs this whole module, so its module-scoped fixture is built once (the README's
# `pytest -n auto --dist loadgroup`)
pytestmark = pytest.mark.xdist_group("gluon_swiglu_gemm")

import opsadv  # noqa: E402
from opsadv.core.kernel import CallSpec  # noqa: E402

from conftest import (SM90_SCRIPT_PRELUDE, assert_gemm_close, assert_sm90_clean, assert_sm90_impl_rejections,
                      fake_cuda_env, gluon_marks, load_without_gluon, registered_impl)  # noqa: E402

GS = pytest.importorskip("opsadv.backends.cuda.swiglu_gemm.gluon")
IMPL_ID = GS.IMPL_ID
needs_gluon, requires_sm90 = gluon_marks(GS)

_COMPILE_SCRIPT = SM90_SCRIPT_PRELUDE + r"""
from opsadv.backends.cuda.swiglu_gemm import gluon_kernel as K, gluon as GS
for variant, dt, bias, w_nk in json.loads(sys.argv[1]):
    dtype = getattr(torch, dt)
    m, n, k = 1000, 520, 264                         # tails in M, N and K
    x = torch.randn(m, k).to(dtype)
    w = torch.randn(2 * n, k).to(dtype) if w_nk else torch.randn(k, 2 * n).to(dtype)
    out = torch.empty(m, n, dtype=dtype)
    grid, args, kw = GS.launch_args(x, w, out, torch.randn(2 * n).to(dtype) if bias else None, variant, w_nk)
    report["-".join(map(str, (variant, dt, int(bias), int(w_nk))))] = kernel_report(
        compile_sm90(K.swiglu_gemm_kernel, args, kw))
print(json.dumps(report))
"""

COMPILE_CASES = ([(v, dt, True, nk) for v in GS.VARIANTS for dt in ("bfloat16", "float16") for nk in (False, True)]
                 + [("coop", "bfloat16", False, nk) for nk in (False, True)])


def _key(case) -> str:
    variant, dt, bias, w_nk = case
    return "-".join(map(str, (variant, dt, int(bias), int(w_nk))))


@pytest.fixture(scope="module")
def sm90_compile_report():
    from conftest import run_sm90_compile_jobs
    return run_sm90_compile_jobs(_COMPILE_SCRIPT, COMPILE_CASES)


@needs_gluon
@pytest.mark.parametrize("case", COMPILE_CASES, ids=_key)
def test_compiles_for_sm90_without_spills(case, sm90_compile_report):
    r = sm90_compile_report[_key(case)]
    assert_sm90_clean(r, _key(case))
    # two accumulators: 2 x (BK / 16) = 8 wgmma per K-slice; the stream-K chunks' main loop is a second copy
    cfg = GS.VARIANTS[case[0]]
    assert r["hgmma"] == 2 * cfg["BK"] // 16 * (2 if cfg.get("STREAM_K") else 1), r


@needs_gluon
def test_tanh_variant_spends_one_mufu_op_per_element(sm90_compile_report):
    base = sm90_compile_report[_key(("coop", "bfloat16", True, True))]["mufu"]
    fast = sm90_compile_report[_key(("coop_tanh", "bfloat16", True, True))]["mufu"]
    assert fast["EX2"] == 0 and fast["TANH"] == base["EX2"] > 0, (base, fast)


# ---- declaration and rejection reasons -------------------------------------------------------------------
def _impl():
    return registered_impl("swiglu_gemm", IMPL_ID)


def _spec(dtype=torch.bfloat16, m=1000, k=264, n=520, features=(), device="cuda", backward=False):
    return CallSpec(op="swiglu_gemm", device_type=device, dtype=dtype, features=frozenset(features),
                    bucket=(m, k, n), shapes=((m, k), (k, 2 * n)), backward=backward)


def _reasons(spec, env, experimental_ok=True):
    return _impl().rejection_reasons(spec, env, experimental_ok=experimental_ok, deterministic=False)


def test_rejection_reasons():
    env = fake_cuda_env()
    # its H200 checks and pinned conformance passed (7a12dcb): not experimental
    assert_sm90_impl_rejections(_impl(), _reasons, _spec)
    if not GS.UNAVAILABLE:
        assert _reasons(_spec(), env) == []
        assert _reasons(_spec(features=("bias", "batched"), backward=True), env) == []
    if not GS.UNAVAILABLE:
        assert _reasons(_spec(), env, experimental_ok=False) == []
    if not GS.UNAVAILABLE:
        assert any("multiples of 8" in r and "N=521" in r for r in _reasons(_spec(n=521), env))
        assert any("multiples of 8" in r and "K=263" in r for r in _reasons(_spec(k=263), env))
    assert any("TRITON_INTERPRET" in r for r in _reasons(_spec(), fake_cuda_env(interpret=True)))


def test_without_gluon_the_impl_registers_with_the_reason(monkeypatch):
    mod = load_without_gluon(monkeypatch, GS, "swiglu_gemm.gluon_kernel")
    assert mod.UNAVAILABLE
    (impl,) = mod.impls(fake_cuda_env())
    why = impl.rejection_reasons(_spec(), fake_cuda_env(), experimental_ok=True, deterministic=False)
    assert why and all("gluon" in r.lower() for r in why), why
    with pytest.raises(RuntimeError, match=IMPL_ID):
        mod.launch_args(torch.ones(8, 8), torch.ones(8, 16), torch.ones(8, 8))


# ---- H200 ------------------------------------------------------------------------------------------------
def _ref(x, w, bias):
    z = x.double().reshape(-1, x.shape[-1]) @ w.double()
    if bias is not None:
        z = z + bias.double()
    g, u = z.chunk(2, dim=-1)
    return (torch.nn.functional.silu(g) * u).reshape(*x.shape[:-1], w.shape[1] // 2)


GPU_SHAPES = [(1, 8, 8), (7, 24, 40), (127, 136, 264), (1000, 520, 264), (4096, 1032, 776), (2100, 1096, 136)]


@requires_sm90
@pytest.mark.parametrize("variant", list(GS.VARIANTS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m,n,k", GPU_SHAPES)
def test_gpu_every_variant(variant, dtype, m, n, k, seed, monkeypatch):
    monkeypatch.setenv("OPSADV_POISON_OUTPUTS", "1")
    x = torch.randn(m, k, device="cuda", dtype=dtype)
    w_rows = torch.randn(2 * n, k, device="cuda", dtype=dtype) / k ** 0.5       # nn.Linear [W_g; W_u]
    for w in (w_rows.t(), w_rows.t().contiguous()):                              # (2N, K) rows, then (K, 2N)
        for bias in (None, torch.randn(2 * n, device="cuda", dtype=dtype)):
            ref = _ref(x, w, bias)
            for cap in (None, 5):      # 5 CTAs: each walks many tiles (ring wrap, store waits)
                assert_gemm_close(GS.swiglu_gemm_fwd(None, x, w, bias, variant=variant, num_sms=cap), ref, dtype)


@requires_sm90
@pytest.mark.parametrize("variant", [v for v, c in GS.VARIANTS.items() if c.get("STREAM_K")])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_stream_k_split_tiles_exact_and_deterministic(variant, dtype, seed, monkeypatch):
    """Stream-K where tiles really are split (test_gluon_gemm.SK_GPU_CASES): against float64 with the biases, both
    weight layouts, and bitwise equal on a second run."""
    from test_gluon_gemm import SK_GPU_CASES, split_happens
    monkeypatch.setenv("OPSADV_POISON_OUTPUTS", "1")
    for m, n, k, caps in SK_GPU_CASES:
        x = torch.randn(m, k, device="cuda", dtype=dtype)
        w_rows = torch.randn(2 * n, k, device="cuda", dtype=dtype) / k ** 0.5
        bias = torch.randn(2 * n, device="cuda", dtype=dtype)
        for w in (w_rows.t(), w_rows.t().contiguous()):
            ref = _ref(x, w, bias)
            for cap in caps:
                assert split_happens(GS.VARIANTS[variant], m, n, cap)
                out = GS.swiglu_gemm_fwd(None, x, w, bias, variant=variant, num_sms=cap)
                assert_gemm_close(out, ref, dtype)
                assert torch.equal(out, GS.swiglu_gemm_fwd(None, x, w, bias, variant=variant, num_sms=cap))


@requires_sm90
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 127, 4096])
def test_gpu_op_pinned(dtype, m, seed, monkeypatch):
    """Through opsadv.ops.swiglu_gemm pinned to this impl: batched leading dims, forward in no-grad calls."""
    monkeypatch.setenv("OPSADV_POISON_OUTPUTS", "1")
    n, k = 520, 264
    x = torch.randn(2, m, k, device="cuda", dtype=dtype)
    w = (torch.randn(2 * n, k, device="cuda", dtype=dtype) / k ** 0.5).t()
    bias = torch.randn(2 * n, device="cuda", dtype=dtype)
    with opsadv.use_backend("cuda", experimental=True, autotune=False, impls={"swiglu_gemm": IMPL_ID}), \
            opsadv.trace() as t, torch.no_grad():
        out = opsadv.ops.swiglu_gemm(x, w, bias=bias)
    assert t.counts[IMPL_ID] == 1
    assert_gemm_close(out, _ref(x, w, bias), dtype)
