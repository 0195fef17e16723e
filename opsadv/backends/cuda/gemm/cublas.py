"""gemm and swiglu_gemm through cuBLAS (torch.addmm / torch._addmm_activation), for the cuda backend.

Impls (priority; the dispatcher's measured choice per bucket overrides it under autotune=True):
  cuda.cublas.gemm                  300  plain GEMM (+bias, alpha), and bias+relu / bias+gelu_tanh fused in the
                                         cuBLASLt epilogue
  cuda.cublas.gemm_small_m          250  the same torch code for M <= 64 (decode): cuBLAS wins there
  cuda.cublas.swiglu_gemm_small_m   250  one GEMM over [W_g | W_u] then silu(g) * u, M <= 64
  cuda.cublas.gemm_epilogue         150  cuBLAS GEMM then torch activation / residual (unfused); 215 on Hopper
  cuda.cublas.swiglu_gemm           150  one GEMM over [W_g | W_u] then silu(g) * u in torch
The Triton GEMMs they compete with live in opsadv/backends/triton_common/gemm/gemm.py.  At M = 8 cuBLAS is 2-5x
faster than the Triton kernels (H200, bf16)."""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from opsadv.backends.triton_common.gemm.gemm import ACT_FEATURES, ALL, GEMM_FEATURES, _grads_from_dz
from opsadv.core.activations import act_grad
from opsadv.core.kernel import MEMORY_FUSED, PRIORITY_TRITON, PRIORITY_VENDOR, KernelImpl, temporaries
from opsadv.core.precision import float32_matmul_scope


def _cublas_fused_check(spec, env) -> list[str]:
    acts = spec.features & ACT_FEATURES
    if acts and "bias" not in spec.features:
        return [f"cuBLASLt fuses {sorted(acts)[0][4:]} only together with a bias"]
    return []


SMALL_M = 64


def _small_m_check(spec, env) -> list[str]:
    return [] if spec.bucket[0] <= SMALL_M else [f"registered for M <= {SMALL_M} (decode); M bucket {spec.bucket[0]}"]


CUBLAS_HONOURS = frozenset({"matmul"})                # no tiles of ours (cuBLAS picks its own); see _policy_matmul


def _policy_matmul(fn):
    """cuBLAS on float32 inputs in the policy's matmul precision: tf32 -> torch's TF32 mode for the call
    (float32_matmul_scope, restored after); fp16 / bf16 -> the call on inputs cast to that dtype, outputs cast
    back to float32; fp32 -> torch's own setting."""
    @functools.wraps(fn)
    def run(ctx, *args):
        prec = ctx.options.get("precision") if ctx is not None else None
        first = next((a for a in args if isinstance(a, torch.Tensor)), None)
        if prec is None or first is None or first.dtype != torch.float32 or prec.matmul == "fp32":
            return fn(ctx, *args)
        if prec.matmul == "tf32":
            with float32_matmul_scope(prec):
                return fn(ctx, *args)
        dt = torch.float16 if prec.matmul == "fp16" else torch.bfloat16
        out = fn(ctx, *(a.to(dt) if isinstance(a, torch.Tensor) and a.dtype == torch.float32 else a for a in args))
        if isinstance(out, tuple):
            return tuple(o.float() if isinstance(o, torch.Tensor) and o.dtype == dt else o for o in out)
        return out.float()
    return run


def _torch_act(y: torch.Tensor, activation: str) -> torch.Tensor:
    if activation == "relu":
        return y.relu_()
    if activation == "gelu":
        return F.gelu(y)
    if activation == "gelu_tanh":
        return F.gelu(y, approximate="tanh")
    if activation == "silu":
        return F.silu(y, inplace=True)
    return y


@_policy_matmul
def _cublas_gemm(ctx, a, b, bias, activation, residual, alpha):
    k, n = b.shape
    a2 = a.reshape(-1, k)
    # cublasLt epilogue; on CUDA its GELU is the tanh approximation (the CPU kernel's is exact erf)
    if bias is not None and (activation == "relu" or (activation == "gelu_tanh" and a.is_cuda)):
        y = torch._addmm_activation(bias, a2, b, alpha=alpha, use_gelu=activation == "gelu_tanh")
        activation = "none"
    elif bias is not None:
        y = torch.addmm(bias, a2, b, alpha=alpha)
    elif residual is not None and activation == "none":
        y = torch.addmm(residual.reshape(-1, n), a2, b, alpha=alpha)   # beta=1 adds the residual
        residual = None
    else:
        y = torch.mm(a2, b)
        if alpha != 1.0:
            y.mul_(alpha)
    y = _torch_act(y, activation)
    if residual is not None:
        y.add_(residual.reshape(-1, n))
    return y.reshape(*a.shape[:-1], n)


@_policy_matmul
def _cublas_gemm_bwd(ctx, grad, a, b, bias, activation, alpha):
    k, n = b.shape
    a2, g2 = a.reshape(-1, k), grad.reshape(-1, n)
    if activation == "none":
        dz = g2
    else:
        z = torch.addmm(bias, a2, b, alpha=alpha) if bias is not None else torch.mm(a2, b).mul_(alpha)
        dz = (g2.float() * act_grad(activation, z.float())).to(a.dtype)
    return _grads_from_dz(a2, b, dz, alpha, bias, a.shape)


@_policy_matmul
def _cublas_swiglu(ctx, x, w, bias):
    k, n2 = w.shape
    x2 = x.reshape(-1, k)
    gu = torch.addmm(bias, x2, w) if bias is not None else torch.mm(x2, w)
    g, u = gu.chunk(2, dim=-1)
    return (F.silu(g) * u).reshape(*x.shape[:-1], n2 // 2)


@_policy_matmul
def _cublas_swiglu_bwd(ctx, grad, x, w, bias):
    k, n2 = w.shape
    x2, g2 = x.reshape(-1, k), grad.reshape(-1, n2 // 2).float()
    gu = (torch.addmm(bias, x2, w) if bias is not None else torch.mm(x2, w)).float()
    g, u = gu.chunk(2, dim=-1)
    dgu = torch.cat([g2 * u * act_grad("silu", g), g2 * F.silu(g)], dim=-1).to(x.dtype)
    return _grads_from_dz(x2, w, dgu, 1.0, bias, x.shape)


# On Hopper, cuBLAS then the activation in torch beats the Triton GEMM with a fused epilogue at
# the shapes measured (H200: bias+silu 16384x11008x4096 Triton 0.98x of addmm+silu; BERT-base FFN
# gelu GEMM Triton ~380 TFLOP/s vs cuBLAS ~650-700 in the same model; own TMA GEMM 0.88x cuBLAS
# plain): the unfused cuBLAS path ranks above Triton there.  Measured tuning (autotune=True /
# tune_for_hardware) still picks per shape bucket.  SwiGLU keeps the Triton kernel (1.14x eager).
EPILOGUE_PRIORITY_HOPPER = PRIORITY_TRITON + 15


def _epilogue_priority(env) -> int:
    cc = getattr(env, "compute_capability", None) or (0, 0)
    return EPILOGUE_PRIORITY_HOPPER if env.device_type == "cuda" and cc >= (9, 0) else 150


def impls(env) -> list[KernelImpl]:
    return [
        KernelImpl("cuda.cublas.gemm", "gemm", "cuda", _cublas_gemm, _cublas_gemm_bwd, priority=PRIORITY_VENDOR,
                   dtypes=ALL, features=frozenset({"bias", "alpha", "batched", "act_relu", "act_gelu_tanh"}),
                   check=_cublas_fused_check, memory=MEMORY_FUSED,
                   honours=CUBLAS_HONOURS, description="cuBLAS through torch.addmm / _addmm_activation (plain, +bias, bias+relu/gelu_tanh)"),
        KernelImpl("cuda.cublas.gemm_small_m", "gemm", "cuda", _cublas_gemm, _cublas_gemm_bwd, priority=250,
                   dtypes=ALL, features=GEMM_FEATURES, check=_small_m_check, memory=temporaries(2),
                   honours=CUBLAS_HONOURS, description="cuBLAS then torch epilogue, for decode shapes (M <= 64) where cuBLAS wins"),
        KernelImpl("cuda.cublas.swiglu_gemm_small_m", "swiglu_gemm", "cuda", _cublas_swiglu, _cublas_swiglu_bwd,
                   priority=250, dtypes=ALL, features=frozenset({"bias", "batched"}), check=_small_m_check,
                   memory=temporaries(3),
                   honours=CUBLAS_HONOURS, description="one cuBLAS GEMM over [W_g | W_u] then silu(g) * u, for decode shapes (M <= 64)"),
        KernelImpl("cuda.cublas.gemm_epilogue", "gemm", "cuda", _cublas_gemm, _cublas_gemm_bwd,
                   priority=_epilogue_priority(env),
                   dtypes=ALL, features=GEMM_FEATURES, memory=temporaries(2),     # activation / residual temporaries
                   honours=CUBLAS_HONOURS, description="cuBLAS (torch._addmm_activation for bias+relu/gelu_tanh) then torch epilogue"),
        KernelImpl("cuda.cublas.swiglu_gemm", "swiglu_gemm", "cuda", _cublas_swiglu, _cublas_swiglu_bwd, priority=150,
                   dtypes=ALL, features=frozenset({"bias", "batched"}), memory=temporaries(3),     # gate, up, silu
                   honours=CUBLAS_HONOURS, description="one cuBLAS GEMM over [W_g | W_u], then silu(g) * u in torch"),
    ]
