"""The scaled_gemm op (opsadv.ops.scaled_gemm, FP8) in Triton, for the cuda backend (and jetson, which re-registers
it and is refused by its compute capability: Orin is sm_87, and FP8 tensor cores start at sm_89).

Impls:
  cuda.triton.scaled_gemm      200  pointer loads, any strides; sm_89+ (Ada, Hopper)
  cuda.triton.scaled_gemm_tma  210  TMA descriptors, Hopper (sm_90+); K a multiple of 16 (N too where b is row-major)
  cuda.triton.scaled_swiglu_gemm[_tma]  200 / 210  the same kernel with SWIGLU (op scaled_swiglu_gemm): b is
                                    [W_g | W_u] (K, 2N), a gate and an up accumulator per tile, act(g) * u epilogue
The cuda backend's cuBLASLt impl (torch._scaled_mm, cuda/scaled_gemm/cublas.py) ranks above them for the
granularities it takes.  Unmeasured: the lead's H200 run of `opsadv bench --suite fp8` decides the order.

Per call: one launch of scaled_gemm_kernel (kernels.py); with out_fp8 the kernel writes float32 y into a
workspace and reduces the tiles' amax into one float32 by atomic max, then quantize_kernel writes the fp8 result
and its scale (the op's module docstring: current per-tensor scaling needs every tile's amax first).
Tiles: ctx.profile.tiles["scaled_gemm"] ("gemm"; "block" with block scales; "small" for M <= 64; for
scaled_swiglu_gemm "swiglu", "swiglu_block", "swiglu_small": two accumulators per tile): (BLOCK_M,
BLOCK_N, BLOCK_K, warps, stages), the first the default, the list the autotune space; BLOCK_K divides 128 (a block-scale step lies in one
scale block)."""
from __future__ import annotations

import functools
import importlib.util

import torch

from opsadv.core.envvars import env_bool
from opsadv.core.kernel import PRIORITY_TRITON, KernelImpl, cap_tiles, temporaries
from opsadv.core.op_common import len_bucket

from .. import triton_device_types

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP8_FORMAT = {E4M3: (448.0, 3, -6), E5M2: (57344.0, 2, -14)}      # (FMAX, mantissa bits, smallest normal exponent)
FEATURES = frozenset({"scale_a_tensor", "scale_a_row", "scale_a_block", "scale_b_tensor", "scale_b_col",
                      "scale_b_block", "a_e5m2", "b_e5m2", "bias", "residual", "act_relu", "act_gelu",
                      "act_gelu_tanh", "act_silu", "out_fp8", "out_e5m2", "b_row_major"})
SWIGLU_FEATURES = frozenset({"scale_a_tensor", "scale_a_row", "scale_a_block", "scale_b_tensor", "scale_b_col",
                             "scale_b_block", "a_e5m2", "b_e5m2", "bias", "act_gelu_tanh", "out_fp8", "out_e5m2",
                             "b_row_major"})
ACT_IDS = {"none": 0, "relu": 1, "gelu": 2, "gelu_tanh": 3, "silu": 4}     # gemm's (kernels.ACT_IDS)
FP8_MIN_CC = (8, 9)
SMALL_M = 64
GROUP_M = 8
DEFAULT_CONFIGS = {"gemm": [(128, 128, 128, 8, 3)], "block": [(128, 128, 128, 8, 3)], "small": [(64, 64, 128, 4, 3)],
                   # scaled_swiglu_gemm: two accumulators per tile (gate and up), a tile of b per half
                   "swiglu": [(128, 128, 128, 8, 3)], "swiglu_block": [(128, 64, 128, 8, 3)],
                   "swiglu_small": [(64, 64, 128, 4, 3)]}
INTERPRETER_CONFIG = (32, 32, 32, 4, 1)        # the interpreter's cost is per element: small tiles
QUANTIZE_BLOCK = 1024
_K: dict = {}
# no temporaries but, with out_fp8, the float32 workspace of y (4 bytes x M x N)
OUT_FP8_WORKSPACE = temporaries(1.0)


def _kernels():
    if not _K:
        from . import kernels
        _K.update(gemm=kernels.scaled_gemm_kernel, quantize=kernels.quantize_kernel)
    return _K


def _configs(ctx, kind: str) -> list[tuple]:
    prof = getattr(ctx, "profile", None)
    tables = (prof.tiles.get("scaled_gemm") if prof is not None else None) or {}
    table = list(tables.get(kind) or DEFAULT_CONFIGS[kind])
    cap = prof.extra.get("tile_size") if prof is not None else None
    return cap_tiles(table, cap) if cap else table


def _meta(cfg: tuple) -> dict:
    return {"BLOCK_M": cfg[0], "BLOCK_N": cfg[1], "BLOCK_K": cfg[2], "GROUP_M": GROUP_M}


_TUNER = None


def _tuner():
    """The kernels' shared ConfigTuner (compiles configs side by side, keeps winners in kernel_configs.json); Triton's
    autotuner keeps nothing on disk for configs with a pre-hook, which the TMA descriptors' block shapes need."""
    global _TUNER
    if _TUNER is None:
        from ..utils import ConfigTuner
        _TUNER = ConfigTuner("scaled_gemm")
    return _TUNER


def _tma_ready(t: torch.Tensor) -> bool:
    return t.stride(1) == 1 and (t.stride(0) * t.element_size()) % 16 == 0 and t.data_ptr() % 16 == 0


def _scale_strides(s: torch.Tensor) -> tuple[int, int]:
    """A 2-D scale's (row stride, column stride), 0 along a dim of size 1 (broadcast); per tensor: (0, 0)."""
    if s.numel() == 1:
        return 0, 0
    s2 = s.reshape(s.shape[0], s.shape[1])
    return s2.stride(0) if s2.shape[0] > 1 else 0, s2.stride(1) if s2.shape[1] > 1 else 0


def _run(ctx, a, b, a_scale, b_scale, bias, activation, residual, out_dtype, out_fp8, *, tma: bool,
         config: tuple | None = None, swiglu: bool = False):
    """(out, out_scale) per the impl contract.  config: an explicit (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages)
    (tests, probes) instead of the profile's fixed or autotuned one.  swiglu: scaled_swiglu_gemm's call (b is
    [W_g | W_u], the output has half its columns, activation is the gate's)."""
    import triton
    m, k = a.shape
    nb = b.shape[1]                                   # b's columns (2N with swiglu)
    n = nb // 2 if swiglu else nb
    dev = a.device
    poison = dev.type == "cpu" or env_bool("OPSADV_POISON_OUTPUTS")
    # block scales: (M, K/128) for a, (K/128, ceil(N/128)) for b; with K = 128 a's equals its per-row scale
    # (one block along K), while b's (1, ceil(N/128)) still varies per 128 columns: the block path reads it
    a_block = a_scale.dim() == 2 and a_scale.shape[1] > 1
    b_block = b_scale.numel() > 1 and (b_scale.shape[0] > 1 or b_scale.shape[-1] != nb)
    sa = a_scale if a_scale.numel() == 1 else a_scale.reshape(a_scale.shape[0], -1)
    sb = b_scale if b_scale.numel() == 1 else b_scale.reshape(-1, b_scale.shape[-1])
    s_sam, s_sak = _scale_strides(sa)
    s_sbk, s_sbn = _scale_strides(sb)
    shape = (m, n)
    dtype = torch.float32 if out_fp8 is not None else out_dtype
    out = torch.full(shape, float("nan"), dtype=dtype, device=dev) if poison else torch.empty(shape, dtype=dtype,
                                                                                                 device=dev)
    amax = torch.zeros((1,), dtype=torch.float32, device=dev) if out_fp8 is not None else out
    res = residual if residual is not None else out
    bias_ = bias if bias is None or bias.stride(0) == 1 else bias.contiguous()
    b_nk = False
    if tma:
        from triton.tools.tensor_descriptor import TensorDescriptor
        a2 = a if _tma_ready(a) else a.contiguous()
        b_nk = not _tma_ready(b) and _tma_ready(b.t())          # W.t() of an nn.Linear weight: read (N, K) rows
        bt = b.t() if b_nk else (b if _tma_ready(b) else b.contiguous())
        a_desc = b_desc = None                                  # built per config (launch)
        a_ptr, b_ptr, strides = a2, bt, (0, 0, 0, 0)
    else:
        a_desc, b_desc, a_ptr, b_ptr = a, b, a, b
        strides = (a.stride(0), a.stride(1), b.stride(0), b.stride(1))
    # block scales keep a second accumulator tile (each K step's partial): "block" holds the tiles that fit registers
    kind = "small" if m <= SMALL_M else "block" if a_block or b_block else "gemm"
    if swiglu:
        kind = "swiglu" if kind == "gemm" else f"swiglu_{kind}"
    tune = ctx is not None and ctx.profile is not None and ctx.profile.autotune and dev.type == "cuda"
    if config is None and dev.type == "cpu":
        config = INTERPRETER_CONFIG
    if config is None and not tune:
        config = _configs(ctx, kind)[0]
    args = (a_ptr, b_ptr, a_desc, b_desc, out, bias_ if bias_ is not None else out, res,
            sa, sb, amax, m, n, k, len_bucket(m), *strides, out.stride(0), out.stride(1), res.stride(0),
            res.stride(1), s_sam, s_sak, s_sbk, s_sbn)
    flags = dict(TMA=tma, B_NK=b_nk, A_BLOCK=a_block, B_BLOCK=b_block, ACT=ACT_IDS[activation],
                 HAS_BIAS=bias is not None, HAS_RES=residual is not None, OUT_FP8=out_fp8 is not None,
                 SWIGLU=swiglu)

    def launch(cfg):
        ad, bd = a_desc, b_desc
        if tma:         # descriptors of this config's block shapes (tuning launches configs on several threads)
            ad = TensorDescriptor.from_tensor(a_ptr, [cfg[0], cfg[2]])
            bd = TensorDescriptor.from_tensor(b_ptr, [cfg[1], cfg[2]] if b_nk else [cfg[2], cfg[1]])
        grid = (triton.cdiv(m, cfg[0]) * triton.cdiv(n, cfg[1]),)
        _kernels()["gemm"][grid](*args[:2], ad, bd, *args[4:], **flags, **_meta(cfg), num_warps=cfg[3],
                                 num_stages=cfg[4])
    if config is None:
        key = (len_bucket(m), n, k, str(a.dtype), str(b.dtype), str(dtype), *flags.values())
        config = _tuner().pick(key, [{"config": c} for c in _configs(ctx, kind)], lambda c: launch(c["config"]),
                               True)["config"]
    launch(config)
    if out_fp8 is None:
        return out, None
    fmax, mant, emin = FP8_FORMAT[out_fp8]
    q = torch.empty(shape, dtype=out_fp8, device=dev)
    scale = torch.empty((), dtype=torch.float32, device=dev)
    numel = m * n
    _kernels()["quantize"][(triton.cdiv(numel, QUANTIZE_BLOCK),)](out, q, amax, scale, numel, FMAX=fmax, MANT=mant,
                                                                  EMIN=emin, BLOCK=QUANTIZE_BLOCK, num_warps=4)
    return q, scale


def _tma_check(spec, env) -> list[str]:
    (m, k), (_, n) = spec.shapes
    why = []
    if k % 16:
        why.append(f"TMA needs 16-byte rows: K a multiple of 16, got K={k}")
    if spec.op == "scaled_swiglu_gemm":
        # a row-major [W_g | W_u] is read by rows of 2N, its up half from box column N: a 16-byte aligned offset
        if "b_row_major" in spec.features and (n // 2) % 16:
            why.append(f"TMA reads a row-major w_gate_up's up half from column N: N a multiple of 16, got N={n // 2}")
    elif "b_row_major" in spec.features and n % 16:
        why.append(f"TMA reads a row-major b by rows of N: N a multiple of 16, got N={n}")
    return why


def _swiglu_run(ctx, x, w_gate_up, x_scale, w_scale, bias, activation, out_dtype, out_fp8, *, tma: bool,
                config: tuple | None = None):
    """scaled_swiglu_gemm's impl contract on the same kernel (SWIGLU)."""
    return _run(ctx, x, w_gate_up, x_scale, w_scale, bias, activation, None, out_dtype, out_fp8, tma=tma,
                config=config, swiglu=True)


def impls(env, backend: str = "cuda") -> list[KernelImpl]:
    if importlib.util.find_spec("triton") is None:
        return []
    dev = triton_device_types(env)
    words = "fp8 tl.dot with float32 accumulation; per-tensor / row / column scales in the epilogue, 1x128 / " \
            "128x128 block scales per K step; bias / activation / residual epilogue; fp8 output through a float32 " \
            "workspace, an atomic amax and a quantize pass"
    common = dict(op="scaled_gemm", backend=backend, device_types=dev,
                  dtypes=(torch.bfloat16, torch.float16, torch.float32), features=FEATURES,
                  requires_interpret_or_cuda=True, honours=frozenset({"tile_size"}))
    swiglu_words = "fp8 tl.dot with float32 accumulation, a gate and an up accumulator per tile over [W_g | W_u]; " \
                   "scales as scaled_gemm's; act(g + b_g) * (u + b_u) epilogue (silu / gelu_tanh); fp8 output " \
                   "through a float32 workspace, an atomic amax and a quantize pass"
    swiglu = dict(common, op="scaled_swiglu_gemm", features=SWIGLU_FEATURES)
    return [
        KernelImpl(f"{backend}.triton.scaled_gemm", fn=functools.partial(_run, tma=False), priority=PRIORITY_TRITON,
                   min_cc=FP8_MIN_CC, memory=OUT_FP8_WORKSPACE, deterministic=True,
                   description=f"Triton FP8 GEMM (FP8 tensor cores: sm_89+; not A100 / Jetson Orin), pointer loads, "
                               f"any strides; {words}", **common),
        KernelImpl(f"{backend}.triton.scaled_gemm_tma", fn=functools.partial(_run, tma=True),
                   priority=PRIORITY_TRITON + 10, min_cc=(9, 0), check=_tma_check, memory=OUT_FP8_WORKSPACE,
                   deterministic=True,
                   description=f"Triton FP8 GEMM, TMA descriptors (Hopper), b read as (N, K) rows when column-major; "
                               f"{words}", **common),
        KernelImpl(f"{backend}.triton.scaled_swiglu_gemm", fn=functools.partial(_swiglu_run, tma=False),
                   priority=PRIORITY_TRITON, min_cc=FP8_MIN_CC, memory=OUT_FP8_WORKSPACE, deterministic=True,
                   description=f"Triton FP8 SwiGLU GEMM (sm_89+), pointer loads, any strides; {swiglu_words}",
                   **swiglu),
        KernelImpl(f"{backend}.triton.scaled_swiglu_gemm_tma", fn=functools.partial(_swiglu_run, tma=True),
                   priority=PRIORITY_TRITON + 10, min_cc=(9, 0), check=_tma_check, memory=OUT_FP8_WORKSPACE,
                   deterministic=True, description=f"Triton FP8 SwiGLU GEMM, TMA descriptors (Hopper), w_gate_up "
                   f"read as (2N, K) rows when column-major; {swiglu_words}", **swiglu),
    ]
