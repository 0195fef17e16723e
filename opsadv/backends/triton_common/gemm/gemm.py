"""gemm and swiglu_gemm in Triton (one kernel family; SwiGLU is a flag), shared by the GPU backends.

Impls (priority; the dispatcher's measured choice per bucket overrides it under autotune=True):
  cuda.triton.gemm_persistent  212  the TMA kernel made persistent (one program per SM walks the tiles, the
                                    next tile's loads overlap this tile's epilogue; TMA stores); Hopper+
  cuda.triton.gemm_tma         210  Triton, TMA descriptors, Hopper+, 16-byte aligned K and N; fused epilogue
  cuda.triton.gemm             200  Triton, pointer loads, any strides; fused epilogue
  and for swiglu_gemm: cuda.triton.swiglu_gemm[_tma|_persistent] 200/210/205.
The cuda backend's cuBLAS impls (cuda/gemm/cublas.py) and Gluon impls (cuda/gemm/gluon.py,
cuda/swiglu_gemm/gluon.py) compete with them.
Why (H200, bf16, torch 2.11, triton 3.6): the TMA kernel reaches
0.88-0.96x cuBLAS on plain GEMMs, 0.91-0.98x torch._addmm_activation on bias+gelu_tanh, 1.01-1.08x
addmm+silu on bias+silu and 1.07-1.22x eager on SwiGLU; at M = 8 cuBLAS is 2-5x faster.

Backward (Triton impls): one fused kernel recomputes the pre-activation tile and writes
dz = grad * act'(z) (for SwiGLU: [dgate | dup]); then da = dz @ b^T and db = a^T @ dz run as cuBLAS
GEMMs, dbias = sum(dz) in float32.  With activation "none" dz is the gradient itself.  The persistent
impls run that pass on the TMA kernel (BACKWARD_KERNEL).
(Measured at 16384x12288x4096 bias+gelu_tanh: 7.49 ms vs 7.62 ms for eager autograd.)

fp32 inputs run on tensor cores as tf32, so the Triton impls accept them only under
precision matmul="tf32"."""
from __future__ import annotations

import functools
import importlib.util

import torch

from opsadv.core.errors import InvalidArgumentError
from opsadv.core.kernel import MEMORY_FUSED, PRIORITY_TRITON, KernelImpl, cap_tiles
from opsadv.core.op_common import len_bucket, weight_grad
from opsadv.core.policy import current_policy
from opsadv.core.precision import float32_matmul_scope

from .. import interpreter_bf16_reasons, poisoned as _poisoned, triton_device_types

HALF = (torch.float16, torch.bfloat16)
ALL = (torch.float16, torch.bfloat16, torch.float32)
ACT_FEATURES = frozenset({"act_relu", "act_gelu", "act_gelu_tanh", "act_silu"})
GEMM_FEATURES = ACT_FEATURES | {"bias", "residual", "alpha", "batched"}
_TF32_REASON = "float32 inputs need use_backend(..., precision='tf32') (tensor cores round them to tf32)"

# Tiles come from ctx.profile.tiles["gemm"][kind]: (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages), kinds
# "gemm", "swiglu", "small" (M <= 64, decode), "persistent", "persistent_swiglu" (these add programs per SM and
# EPI_SPLIT: the epilogue in two column halves); the first is the default, the list the autotune space.  The
# tables are the backends' (e.g. opsadv/backends/cuda/profiles.py).  Used when the profile has none for a kind
# (a third-party or future profile):
DEFAULT_CONFIGS = {"gemm": [(64, 64, 32, 4, 2)], "swiglu": [(64, 64, 32, 4, 2)], "small": [(16, 64, 64, 4, 2)],
                   "persistent": [(128, 128, 64, 8, 3, 1, True)], "persistent_swiglu": [(128, 128, 64, 8, 3, 1, True)]}
GROUP_M = 8


def _configs(tables, kind: str, tile_cap: int | None) -> list[tuple]:
    """The autotune space of a profile's gemm tables, capped by the seed's tile_size (use_backend(tile_size=))."""
    table = tables.get(kind) or DEFAULT_CONFIGS[kind]
    return cap_tiles(table, tile_cap) if tile_cap else list(table)


def _fixed_config(profile_name: str, kind: str, m: int, n: int, tile_cap: int | None = None, tables=None) -> tuple:
    """One config without autotuning: the profile's first choice (tables: its gemm tables), bounded for
    jetson/interpreter."""
    if profile_name == "interpreter":                 # tiny tiles: the interpreter's cost is per element
        cfg = (16 if m <= 16 else 32, 32, 32, 4, 1)
    elif profile_name == "jetson":                    # tiles <= 64, <= 2 stages (small smem, no autotune)
        cfg = (16 if m <= 16 else 64, 64 if n > 32 else 32, 32, 4, 2)
    else:
        small = m <= 64 and not kind.startswith("persistent")     # the persistent kernel has one table
        return _configs(tables or {}, "small" if small else kind, tile_cap)[0]
    if kind.startswith("persistent"):
        cfg += (1, True)                              # one program per SM, epilogue in two halves
    return cap_tiles([cfg], tile_cap)[0] if tile_cap else cfg


def _tile_cap(ctx) -> int | None:
    return ctx.profile.extra.get("tile_size") if ctx.profile is not None else None


def _pname(ctx) -> str:
    return ctx.profile.name if ctx.profile is not None else "rtx"


def _tables(ctx):
    return ctx.profile.tiles.get("gemm", {}) if ctx.profile is not None else {}


def _check_precision(ctx, dtype) -> None:
    prec = ctx.options.get("precision")
    if dtype == torch.float32 and (prec is None or prec.matmul != "tf32"):
        raise InvalidArgumentError(ctx.spec.op, "a", "float16/bfloat16, or float32 under precision='tf32'",
                                   "float32 with precision matmul=" + (prec.matmul if prec else "fp32"))


def _tf32_check(spec, env) -> list[str]:
    """The Triton GEMM impls' dispatch check: float32 only as tf32, and no bf16 dot in the interpreter."""
    if spec.dtype == torch.float32 and current_policy().precision.matmul != "tf32":
        return [_TF32_REASON]
    return interpreter_bf16_reasons(spec)


def _tma_check(spec, env) -> list[str]:
    why = _tf32_check(spec, env)
    (a_shape, b_shape) = spec.shapes
    per16 = 16 // (2 if spec.dtype in HALF else 4)          # elements per 16 bytes: TMA row alignment
    # SwiGLU reads the up half at column N of [W_g | W_u]: a TMA box offset, 16-byte aligned too
    n = b_shape[1] // 2 if spec.op == "swiglu_gemm" else b_shape[1]
    if a_shape[-1] % per16 or n % per16:
        why.append(f"TMA needs K and N multiples of {per16} (16-byte rows), got K={a_shape[-1]} N={n}")
    return why


# ---- launching the Triton kernels ----------------------------------------------------------------
KERNELS = ("ptr", "tma", "persistent")       # pointer loads / TMA loads / persistent TMA


def _meta(cfg: tuple) -> dict:
    """A config tuple as the kernel's block constexprs (+ the persistent kernel's PER_SM, EPI_SPLIT)."""
    bm, bn, bk = cfg[:3]
    meta = {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": GROUP_M}
    if len(cfg) > 5:
        meta.update(PER_SM=cfg[5], EPI_SPLIT=cfg[6])
    return meta


_TUNERS: dict = {}


def _tuner(kernel: str):
    t = _TUNERS.get(kernel)
    if t is None:
        from ..utils import ConfigTuner
        t = _TUNERS[kernel] = ConfigTuner(f"triton_gemm.{kernel}")
    return t


def _tuned_config(ctx, kernel: str, configs: list[tuple], a2, b, out, bias, res2, grad2, act: str, alpha: float,
                  swiglu: bool, bwd: bool) -> tuple:
    """The config measured for this call's bucket (rows bucket, N, K, dtype, epilogue, B layout) among the profile's
    table, by the kernels' shared ConfigTuner: compiled side by side, timed in rotated rounds, the winner kept in
    kernel_configs.json (Triton's own autotuner keeps nothing on disk for configs with a pre-hook, which the TMA
    descriptors' block shapes need, so every process re-tuned every bucket one compile after another)."""
    if len(configs) == 1:
        return configs[0]
    m, k = a2.shape
    key = (str(a2.dtype), len_bucket(m), b.shape[1], k, act, bias is not None, res2 is not None, swiglu, bwd,
           b.stride(0) == 1)

    def launch(c):
        _launch(ctx, a2, b, out, bias, res2, grad2, act, alpha, swiglu, bwd, kernel, config=c["config"])
    return _tuner(kernel).pick(key, [{"config": c} for c in configs], launch, True)["config"]


@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


INTERPRETER_PROGRAMS = 2     # on CPU (interpreter) 2 persistent programs: each walks several tiles


def _tma_ready(t: torch.Tensor) -> bool:
    es = t.element_size()
    return t.stride(1) == 1 and (t.stride(0) * es) % 16 == 0 and t.data_ptr() % 16 == 0


def _launch(ctx, a2, b, out, bias, res2, grad2, act: str, alpha: float, swiglu: bool, bwd: bool, kernel: str,
            config: tuple | None = None):
    """out (M, N[*2 for swiglu backward]) <- the fused GEMM; a2 (M, K), b (K, N or 2N).
    kernel: one of KERNELS; config: an explicit config tuple (probes, tests) instead of the
    profile's fixed or autotuned one."""
    import triton
    from . import kernels as K_
    m, k = a2.shape
    n = b.shape[1] // 2 if swiglu else b.shape[1]
    persistent = kernel == "persistent"
    if persistent and bwd:
        raise ValueError("gemm: the backward's dz pass runs on the TMA kernel (BACKWARD_KERNEL), not the persistent one")
    kind = ("persistent_swiglu" if swiglu else "persistent") if persistent else "swiglu" if swiglu else "gemm"
    prof = ctx.profile
    pname = _pname(ctx)
    tune = prof is not None and prof.autotune and a2.device.type == "cuda"
    dummy = out                                         # never read when its flag is off
    r = res2 if res2 is not None else dummy
    g = grad2 if grad2 is not None else dummy
    flags = dict(ACT=K_.ACT_IDS[act], HAS_BIAS=bias is not None, HAS_RES=res2 is not None, SWIGLU=swiglu, BWD=bwd)
    tail = (out.stride(0), out.stride(1), r.stride(0), r.stride(1), g.stride(0), g.stride(1), float(alpha))
    if bias is not None and bias.stride(0) != 1:
        bias = bias.contiguous()                        # the epilogue reads bias + offs_n (unit stride)
    bias_ = bias if bias is not None else dummy
    cap = _tile_cap(ctx)
    tables = _tables(ctx)
    if not persistent and m <= 64:
        kind = "small"
    if config is None:
        config = (_tuned_config(ctx, kernel, _configs(tables, kind, cap), a2, b, out, bias, res2, grad2, act, alpha,
                                swiglu, bwd) if tune else _fixed_config(pname, kind, m, n, cap, tables))
    flags.update(_meta(config), num_warps=config[3], num_stages=config[4])
    kern = {"ptr": K_._gemm_kernel, "tma": K_._gemm_tma_kernel, "persistent": K_._gemm_persistent_kernel}[kernel]
    if kernel == "ptr":
        grid = lambda meta: (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]),)  # noqa: E731
        kern[grid](a2, b, out, bias_, r, g, m, n, k, len_bucket(m),
                   a2.stride(0), a2.stride(1), b.stride(0), b.stride(1), *tail, **flags)
        return out
    from triton.tools.tensor_descriptor import TensorDescriptor
    if not _tma_ready(a2):
        a2 = a2.contiguous()                            # e.g. a sliced / transposed a: TMA needs unit-stride rows
    b_nk = not _tma_ready(b) and _tma_ready(b.t())      # nn.Linear weight.t(): read it as (N, K) rows
    bt = b.t() if b_nk else (b if _tma_ready(b) else b.contiguous())
    bm, bn, bk = flags["BLOCK_M"], flags["BLOCK_N"], flags["BLOCK_K"]
    a_desc = TensorDescriptor.from_tensor(a2, [bm, bk])
    b_desc = TensorDescriptor.from_tensor(bt, [bn, bk] if b_nk else [bk, bn])
    if not persistent:
        grid = lambda meta: (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]),)  # noqa: E731
        kern[grid](a_desc, b_desc, out, bias_, r, g, m, n, k, len_bucket(m), *tail, B_NK=b_nk, **flags)
        return out
    tma_store = not bwd and _tma_ready(out)            # the forward's tile leaves through a TMA descriptor
    c_desc = TensorDescriptor.from_tensor(out, [bm, bn]) if tma_store else None
    if c_desc is not None:
        c_desc.block_shape = [bm, bn // 2 if flags["EPI_SPLIT"] else bn]
    progs = _num_sms(out.device.index or 0) if out.is_cuda else INTERPRETER_PROGRAMS

    def grid(meta):
        tiles = triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"])
        return (min(tiles, progs * meta["PER_SM"]),)
    kern[grid](a_desc, b_desc, c_desc, out, bias_, r, g, m, n, k, len_bucket(m), *tail,
               B_NK=b_nk, TMA_STORE=tma_store, **flags)
    return out


# ---- impl functions ----------------------------------------------------------------------------
def _triton_gemm(ctx, a, b, bias, activation, residual, alpha, *, kernel="ptr"):
    _check_precision(ctx, a.dtype)
    k, n = b.shape
    a2 = a.reshape(-1, k)
    out = _poisoned((a2.shape[0], n), a)
    res2 = residual.reshape(-1, n) if residual is not None else None
    _launch(ctx, a2, b, out, bias, res2, None, activation, alpha, False, False, kernel)
    return out.reshape(*a.shape[:-1], n)


def _grads_from_dz(a2, b, dz, alpha, bias, a_shape):
    """da = alpha dz b^T, db = alpha a^T dz (cuBLAS; db in b's layout, _common.weight_grad), dbias = sum dz
    (float32 accumulation)."""
    da = dz @ b.t()
    db = weight_grad(a2, dz, b)
    if alpha != 1.0:
        da.mul_(alpha)
        db.mul_(alpha)
    dbias = dz.sum(0, dtype=torch.float32).to(bias.dtype) if bias is not None else a2.new_empty((0,))
    return da.reshape(a_shape), db, dbias


def _triton_gemm_bwd(ctx, grad, a, b, bias, activation, alpha, *, kernel="ptr"):
    _check_precision(ctx, a.dtype)
    k, n = b.shape
    a2, g2 = a.reshape(-1, k), grad.reshape(-1, n)
    if activation == "none":
        dz = g2                                         # the pre-activation's gradient is grad itself
    else:
        dz = _launch(ctx, a2, b, _poisoned(g2.shape, a), bias, None, g2, activation, alpha, False, True, kernel)
    return _grads_from_dz(a2, b, dz, alpha, bias, a.shape)


def _triton_swiglu(ctx, x, w, bias, *, kernel="ptr"):
    _check_precision(ctx, x.dtype)
    k, n2 = w.shape
    x2 = x.reshape(-1, k)
    out = _poisoned((x2.shape[0], n2 // 2), x)
    _launch(ctx, x2, w, out, bias, None, None, "none", 1.0, True, False, kernel)
    return out.reshape(*x.shape[:-1], n2 // 2)


def _triton_swiglu_bwd(ctx, grad, x, w, bias, *, kernel="ptr"):
    _check_precision(ctx, x.dtype)
    k, n2 = w.shape
    x2, g2 = x.reshape(-1, k), grad.reshape(-1, n2 // 2)
    dgu = _launch(ctx, x2, w, _poisoned((x2.shape[0], n2), x), bias, None, g2, "none", 1.0, True, True, kernel)
    return _grads_from_dz(x2, w, dgu, 1.0, bias, x.shape)


TRITON_HONOURS = frozenset({"tile_size", "matmul"})   # tiles capped by tile_size; fp32 only under tf32 (_tf32_check)


# The persistent kernel beat the TMA kernel at all 7 shapes measured
# (H200: 1.04-1.14x), so it ranks above it; below the cuBLAS
# epilogue path, which it beats with an activation (BERT FFN1 bias+erf-GELU 1.07x addmm+gelu, bias+silu
# 1.02x) but not on bias-only GEMMs (0.80-0.82x cuBLAS): measured tuning picks per bucket.  Its SwiGLU
# is unmeasured and stays below the TMA kernel's.  Under autotune=True the tuner still picks cuBLAS+gelu
# at FFN1 (0.1436 ms vs 0.2234 ms): it times each impl eagerly,
# and the TMA impls' host work per call (descriptors, autotuner, JIT binding) outlasts the L2 flush, while
# Triton's own per-config timing of the same kernel reads 0.1353 ms.  Under CUDA graphs the kernel time
# is what counts; the tuner does not time that way yet.
PERSISTENT_PRIORITY = PRIORITY_TRITON + 12
# The backward's dz pass (pointer-store epilogue reading grad) runs on the TMA kernel: on the persistent
# kernel at its 128x256 tile it needs 245784 B of shared memory (H200 limit 232448; the probe's odd run).
BACKWARD_KERNEL = {"persistent": "tma"}


def impls(env, backend: str = "cuda") -> list[KernelImpl]:
    out: list[KernelImpl] = []
    if importlib.util.find_spec("triton") is None:
        return out
    dev = triton_device_types(env)
    # kernel: (id suffix, gemm priority, swiglu priority, dispatch checks, words)
    variants = {"ptr": ("", PRIORITY_TRITON, PRIORITY_TRITON, dict(check=_tf32_check), "pointer loads, any strides"),
                "tma": ("_tma", PRIORITY_TRITON + 10, PRIORITY_TRITON + 10, dict(min_cc=(9, 0), check=_tma_check),
                        "TMA descriptors (Hopper+)"),
                "persistent": ("_persistent", PERSISTENT_PRIORITY, PRIORITY_TRITON + 5,
                               dict(min_cc=(9, 0), check=_tma_check),
                               "persistent TMA kernel, one program per SM, TMA stores (Hopper+)")}
    for kernel, (sfx, prio, sprio, extra, what) in variants.items():
        bwd = BACKWARD_KERNEL.get(kernel, kernel)
        out += [
            KernelImpl(f"{backend}.triton.gemm{sfx}", "gemm", backend, functools.partial(_triton_gemm, kernel=kernel),
                       functools.partial(_triton_gemm_bwd, kernel=bwd), priority=prio, device_types=dev, dtypes=ALL,
                       features=GEMM_FEATURES, requires_interpret_or_cuda=True, memory=MEMORY_FUSED, **extra,
                       honours=TRITON_HONOURS,
                       description=f"Triton GEMM, fused bias/activation/residual/alpha epilogue, {what}"),
            KernelImpl(f"{backend}.triton.swiglu_gemm{sfx}", "swiglu_gemm", backend,
                       functools.partial(_triton_swiglu, kernel=kernel),
                       functools.partial(_triton_swiglu_bwd, kernel=bwd), priority=sprio, device_types=dev, dtypes=ALL,
                       features=frozenset({"bias", "batched"}), requires_interpret_or_cuda=True, memory=MEMORY_FUSED,
                       **extra, honours=TRITON_HONOURS,
                       description=f"Triton GEMM over [W_g | W_u], two accumulators, silu(g)*u epilogue, {what}"),
        ]
    return out
