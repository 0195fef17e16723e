"""The swiglu op (act(g) * u over gate_up = [g | u], act silu or gelu_tanh (GeGLU)): the cuda backend's Triton
kernels under the interpreter (fp32 / fp16) against float64, forward and backward, odd and strided shapes, poisoned
outputs; argument errors; bf16 on a real GPU.  GeGLU's op paths, opcheck and conversion: test_geglu.py."""
import pytest
import torch

import opsadv
from opsadv.errors import InvalidArgumentError

from conftest import HAS_CUDA, rel_err, requires_gpu

DEV = "cuda" if HAS_CUDA else "cpu"
TOL = {torch.float32: 1e-6, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def _ref(gate_up: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """float64 oracle, independent of opsadv's activation helpers: torch's silu / tanh-GELU."""
    g, u = gate_up.chunk(2, dim=-1)
    act = torch.nn.functional.silu(g) if activation == "silu" else torch.nn.functional.gelu(g, approximate="tanh")
    return act * u


def _check(gate_up, dtype, *, backend="cuda", activation="silu"):
    x = gate_up.detach().requires_grad_()
    kw = {} if activation == "silu" else {"activation": activation}
    with opsadv.use_backend(backend), opsadv.trace() as t:
        y = opsadv.ops.swiglu(x, **kw)
        go = torch.randn_like(y)
        (dx,) = torch.autograd.grad(y, x, go)
    x64 = gate_up.detach().double().requires_grad_()
    ref = _ref(x64, activation)
    (rdx,) = torch.autograd.grad(ref, x64, go.double())
    assert y.shape == ref.shape and dx.shape == x.shape
    assert not y.isnan().any() and not dx.isnan().any()          # outputs are NaN-poisoned before the kernel
    assert rel_err(y, ref) < TOL[dtype] and rel_err(dx, rdx) < TOL[dtype]
    return t.counts


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", [(1, 2), (3, 2 * 3), (127, 2 * 65), (2, 3, 2 * 1100), (4, 2 * 1024)])
def test_triton_swiglu_matches_float64(shape, dtype, activation):
    torch.manual_seed(sum(shape))
    counts = _check(torch.randn(*shape, dtype=dtype, device=DEV) * 3, dtype, activation=activation)
    assert counts["cuda.triton.swiglu"] == 2                    # forward and backward both ran the kernels


@pytest.mark.parametrize("cfg", __import__("opsadv.backends.triton_common.swiglu.swiglu", fromlist=["CONFIGS"]).CONFIGS)
def test_every_tile_config_matches_float64(cfg, monkeypatch):
    """Each (ROWS, BLOCK_N cap, warps) tile the tuner may pick, forced: ragged rows and columns, 3-D input; SwiGLU
    and GeGLU."""
    from opsadv.backends.triton_common.swiglu import swiglu as S
    monkeypatch.setattr(S, "CONFIGS", (cfg,))
    for shape in [(5, 2 * 1100), (3, 3, 2 * 65), (1, 2)]:
        for act in ("silu", "gelu_tanh"):
            torch.manual_seed(len(shape) + shape[-1])
            assert _check(torch.randn(*shape, device=DEV) * 3, torch.float32,
                          activation=act)["cuda.triton.swiglu"] == 2


def test_flat_tiles_with_int64_indices(monkeypatch):
    """The flattened tiles' int64 path (taken past 2^31 elements), forced at a small shape."""
    from opsadv.backends.triton_common.swiglu import swiglu as S
    monkeypatch.setattr(S, "CONFIGS", ((0, 64, 4),))
    monkeypatch.setattr(S, "FLAT_INT32_LIMIT", 16)
    torch.manual_seed(5)
    assert _check(torch.randn(7, 2 * 45, device=DEV) * 3, torch.float32)["cuda.triton.swiglu"] == 2
    assert _check(torch.randn(40, 2 * 33, device=DEV)[::3], torch.float32)["cuda.triton.swiglu"] == 2


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_strided_rows_and_a_strided_last_dim(activation):
    base = torch.randn(10, 2 * 40, device=DEV)
    kw = dict(activation=activation)
    assert _check(base[::2], torch.float32, **kw)["cuda.triton.swiglu"] == 2          # every other row
    assert _check(torch.randn(2 * 40, 7, device=DEV).t(), torch.float32, **kw)["cuda.triton.swiglu"] == 2  # copied


def test_swiglu_of_a_gemm_equals_swiglu_gemm():
    x, w = torch.randn(9, 32, device=DEV), torch.randn(32, 2 * 24, device=DEV) / 6
    with opsadv.use_backend("cuda", precision="tf32"), torch.no_grad():
        assert rel_err(opsadv.ops.swiglu(x @ w), opsadv.ops.swiglu_gemm(x, w)) < 1e-5


def test_no_grad_and_compile():
    gu = torch.randn(6, 2 * 20, device=DEV)
    with opsadv.use_backend("cuda"), torch.no_grad():
        eager = opsadv.ops.swiglu(gu)
        compiled = torch.compile(opsadv.ops.swiglu, backend="eager", fullgraph=True)(gu)
    assert rel_err(eager, _ref(gu.double())) < 1e-6 and torch.equal(eager, compiled)


@pytest.mark.parametrize("bad,match", [
    (torch.randn(4, 7), "even last dim"),
    (torch.randint(0, 3, (4, 8)), "dtype"),
    (torch.tensor(1.0), "rank >= 1"),
    ("not a tensor", "torch.Tensor"),
])
def test_argument_errors_name_the_op_and_argument(bad, match):
    with pytest.raises(InvalidArgumentError, match=match) as e:
        opsadv.ops.swiglu(bad)
    assert "swiglu" in str(e.value) and "gate_up" in str(e.value)


def test_explain_names_the_kernel():
    gu = torch.randn(3, 2 * 16, device=DEV)
    with opsadv.use_backend("cuda"):
        assert opsadv.explain("swiglu", gu).chosen == "cuda.triton.swiglu"


@requires_gpu
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 2), (127, 2 * 65), (4096, 2 * 2752)])
def test_gpu_swiglu(shape, dtype, activation, monkeypatch):
    monkeypatch.setenv("OPSADV_POISON_OUTPUTS", "1")
    torch.manual_seed(1)
    assert _check(torch.randn(*shape, dtype=dtype, device="cuda") * 3, dtype,
                  activation=activation)["cuda.triton.swiglu"] == 2


_SM90_COMPILE = r"""
import json, os, re
os.environ.pop("TRITON_INTERPRET", None)
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import create_function_from_signature
from opsadv.backends.triton_common.swiglu import kernels as K, swiglu as S
target = GPUTarget("cuda", 90, 128)
backend = make_backend(target)
m, n = 16384, 11008
gu, y = torch.empty(m, 2 * n, dtype=torch.bfloat16), torch.empty(m, n, dtype=torch.bfloat16)
res = {}
for cfg in S.CONFIGS:
  for act, act_id in S.ACT_IDS.items():
    t = S._tile(m, n, cfg)
    t.pop("grid")
    t["ACT"] = act_id
    warps = t.pop("num_warps")
    for name, fn, args in (("fwd", K.swiglu_fwd_kernel, (gu, y, m, n, 2 * n, n)),
                           ("bwd", K.swiglu_bwd_kernel, (gu, y, gu, m, n, 2 * n, n, 2 * n))):
        opts = dict(num_warps=warps, num_stages=1, debug=False)
        bound, spec, _ = create_function_from_signature(fn.signature, fn.params, backend)(
            **dict(zip(fn.arg_names, args)), **t, **opts)
        options, signature, constexprs, attrs = fn._pack_args(backend, opts, bound, spec, None)
        ptx = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target,
                             options=options.__dict__).asm["ptx"]
        res[f"{cfg} {act} {name}"] = {"local": len(re.findall(r"\b(?:ld|st)\.local", ptx)),
                                      "v4_loads": len(re.findall(r"ld\.global(?:\.\w+)*\.v4", ptx))}
print(json.dumps(res))
"""


def test_every_tile_config_compiles_for_sm90_with_vector_loads():
    """Each config compiles for sm_90 (bf16, 16384 x 11008), SwiGLU and GeGLU, without local memory, loading 16 bytes
    per access."""
    import json
    from conftest import run_sm90_compile
    r = json.loads(run_sm90_compile(["-c", _SM90_COMPILE]).strip().splitlines()[-1])
    from opsadv.backends.triton_common.swiglu import swiglu as S
    assert len(r) == 2 * len(S.ACT_IDS) * len(S.CONFIGS)
    for key, v in r.items():
        assert v["local"] == 0, key
        assert v["v4_loads"] > 0, key
