"""The fp8_attention op (opsadv.ops.fp8_attention) in Triton, for the cuda backend (and jetson, which re-registers
it and is refused by its compute capability: Orin is sm_87; FP8 tensor cores start at sm_89).

Impl:
  cuda.triton.fp8_attention   200  FA2-style forward, FP8 QK^T and FP8 P V (kernels.py); backward (bwd_kernels.py:
                                   FP8 QK^T recomputation, the other GEMMs in the gradients' bf16 / fp16 with the
                                   e4m3 operands converted exactly); sm_89+ (Ada, Hopper)

Per call: one launch of fp8_attention_fwd_kernel, plus, for configs with V_T (the profile's Hopper default), a
transposed copy of V ((b, h_kv, d, s_k), seq contiguous: the K-major operand of the FP8 P @ V wgmma; 2 bytes read
and written per element of V, small beside the attention for long sequences) unless V already has a unit seq
stride.  Tiles: ctx.profile.tiles["fp8_attention"]["fwd"][head-dim class] as flash_attention's (BLOCK_M, BLOCK_N,
warps, stages, TMA, V_T), the first the default, the list the autotune space (GPU with profile.autotune).
Backward per call: flash_attention's preprocess kernel (delta, lse in log2 units), then the dK/dV and dQ kernels
(side by side on two streams on a GPU); tiles ctx.profile.tiles["fp8_attention"]["bwd_kv" / "bwd_q"].
Unmeasured: the lead's H200 run of `opsadv bench --suite fp8` decides the defaults."""
from __future__ import annotations

import importlib.util

import torch

from opsadv.core.kernel import MEMORY_FLASH, PRIORITY_TRITON, KernelImpl
from opsadv.core.op_common import empty_bshd
from opsadv.core.envvars import env_bool

from .. import interpreter_bf16_reasons, triton_device_types
from ..tma import TensorDescriptor, desc_bhsd, desc_ok, run_side_by_side, sm90_plus   # (descriptors: guarded)

E4M3 = torch.float8_e4m3fn
FP8_MIN_CC = (8, 9)
HEAD_DIMS = (32, 64, 96, 128, 256)
FEATURES = frozenset({"causal", "gqa", "cross_length", "q_descale_tensor", "q_descale_head", "q_descale_kv_head",
                      "k_descale_tensor", "k_descale_head", "v_descale_tensor", "v_descale_head"})
LOG2E = 1.4426950408889634
MIN_BLOCK = 32                    # an FP8 dot's K (head dim for QK^T, BLOCK_N for P V) is at least 32
DEFAULT_TILE = {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2, "TMA": False, "V_T": False}
DEFAULT_BWD_TILE = {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2}
BWD_DTYPES = (torch.bfloat16, torch.float16)      # the gradients' dtype = the non-FP8 GEMMs' operand dtype
_K: dict = {}


def _kernels():
    if not _K:
        from . import bwd_kernels, kernels
        from ..flash_attention.bwd_kernels import _bwd_pre_kernel
        from ..utils import ConfigTuner
        _K.update(fwd=kernels.fp8_attention_fwd_kernel, tuner=ConfigTuner("fp8_attention.fwd"),
                  pre=_bwd_pre_kernel, kv=bwd_kernels.fp8_bwd_kv_kernel, q=bwd_kernels.fp8_bwd_q_kernel,
                  tuner_kv=ConfigTuner("fp8_attention.bwd_kv"), tuner_q=ConfigTuner("fp8_attention.bwd_q"))
    return _K


def _dclass(d: int) -> int:
    return 64 if d <= 64 else (128 if d <= 128 else 256)


def _configs(ctx, d: int, which: str = "fwd") -> list[dict]:
    """The profile's configs of a pass ("fwd", "bwd_kv", "bwd_q") for the head-dim class (already capped by the
    seed's tile_size: dispatch does it)."""
    prof = getattr(ctx, "profile", None)
    tiles = (prof.tiles.get("fp8_attention") if prof is not None else None) or {}
    default = DEFAULT_TILE if which == "fwd" else DEFAULT_BWD_TILE
    return [dict(default, **c) for c in tiles.get(which, {}).get(_dclass(d), [])] or [dict(default)]


def _descale_args(t: torch.Tensor, b: int) -> tuple[torch.Tensor, int, int, int]:
    """(tensor, batch stride, head stride, heads) of a descale: per tensor (strides 0, 1 head) or (b, h)."""
    if t.numel() == 1 and t.dim() <= 1:
        return t.reshape(()), 0, 0, 1
    return t, (t.stride(0) if b > 1 else 0), t.stride(1), t.shape[1]


def _tma_ok(q, k, v_op, d: int, block_d: int, v_t: bool) -> bool:
    """Full kv blocks through descriptors: host descriptors, an unpadded head dim, contiguous K and V operand
    (descriptor views (b*h_kv*s_k, d) / (b*h_kv*d, s_k)), 16-byte rows; Hopper, or the interpreter."""
    if TensorDescriptor is None or d != block_d or not (k.is_contiguous() and v_op.is_contiguous()):
        return False
    if not (desc_ok(k) and desc_ok(v_op)):
        return False
    return sm90_plus(q.device.index) if q.device.type == "cuda" else True


def fp8_fwd(ctx, q, k, v, q_descale, k_descale, v_descale, causal, scale, out_dtype, *, config: dict | None = None):
    """(out, lse) per the impl contract.  config: an explicit tile dict (tests, probes) instead of the profile's."""
    import triton
    K = _kernels()
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k.stride(-1) != 1:
        k = k.contiguous()
    b, hq, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    block_d = max(MIN_BLOCK, triton.next_power_of_2(d))
    dev = q.device
    poison = dev.type == "cpu" or env_bool("OPSADV_POISON_OUTPUTS")
    out = empty_bshd(q.shape, out_dtype, dev)             # (b, s, h, d) memory, as flash_attention's kernels
    lse = torch.empty((b, hq, sq), dtype=torch.float32, device=dev)
    if poison:
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
    qd, s_qdb, s_qdh, qd_heads = _descale_args(q_descale, b)
    kd, s_kdb, s_kdh, _ = _descale_args(k_descale, b)
    vd, s_vdb, s_vdh, _ = _descale_args(v_descale, b)
    q_descale_group = hq // qd_heads if qd_heads > 1 else 1
    if qd_heads == 1:
        s_qdh = 0
    sm_scale_log2 = scale * LOG2E
    v_cache: dict = {}

    def v_operand(v_t: bool) -> torch.Tensor:
        """V as the kernel reads it: (b, h_kv, s_k, d) with unit stride along d, or with V_T seq contiguous."""
        if v_t not in v_cache:
            if v_t:
                v_cache[v_t] = v if v.stride(2) == 1 else v.transpose(2, 3).contiguous().transpose(2, 3)
            else:
                v_cache[v_t] = v if v.stride(3) == 1 else v.contiguous()
        return v_cache[v_t]

    def launch(cfg):
        bm, bn = cfg["BLOCK_M"], cfg["BLOCK_N"]
        v_t = bool(cfg["V_T"])
        vo = v_operand(v_t)
        vt_view = vo.transpose(2, 3) if v_t else vo       # (b, h_kv, d, s_k) contiguous with V_T
        tma = bool(cfg["TMA"]) and _tma_ok(q, k, vt_view, d, block_d, v_t)
        dk_ = dv_ = None
        if tma:
            desc = TensorDescriptor
            dk_ = desc(k, [b * hkv * sk, d], [d, 1], [bn, d])
            dv_ = desc(vt_view, [b * hkv * d, sk], [sk, 1], [d, bn]) if v_t else \
                desc(vo, [b * hkv * sk, d], [d, 1], [bn, d])
        grid = (triton.cdiv(sq, bm), b * hq)
        K["fwd"][grid](q, k, vo, out, lse, qd, kd, vd, dk_, dv_,
                       q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
                       vo.stride(0), vo.stride(1), vo.stride(2), vo.stride(3),
                       out.stride(0), out.stride(1), out.stride(2),
                       s_qdb, s_qdh, s_kdb, s_kdh, s_vdb, s_vdh,
                       hq, hq // hkv, q_descale_group, sq, sk, sk - sq, sm_scale_log2,
                       HEAD_DIM=d, BLOCK_D=block_d, BLOCK_M=bm, BLOCK_N=bn, CAUSAL=causal, EVEN_M=sq % bm == 0,
                       V_T=v_t, TMA=tma, ROUND_P=dev.type == "cpu", num_warps=cfg["num_warps"],
                       num_stages=cfg["num_stages"])

    if config is not None:
        cfg = dict(DEFAULT_TILE, **config)
    else:
        from ..utils import bucket
        tune = dev.type == "cuda" and ctx is not None and ctx.profile is not None and ctx.profile.autotune
        key = (d, causal, hq // hkv, bucket(sq), bucket(sk), bucket(b * hq), str(out_dtype), v.stride(2) == 1)
        cfg = K["tuner"].pick(key, _configs(ctx, d), launch, tune)
    launch(cfg)
    return out, lse


def _half(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t in dtype with a unit stride along head_dim (what the kernels index)."""
    t = t.to(dtype)
    return t if t.stride(-1) == 1 else t.contiguous()


def _bwd_configs(ctx, d: int, which: str, causal: bool, dev: torch.device, tma_ok: bool) -> list[dict]:
    """The profile's configs (TMA ones without TMA where descriptors cannot serve, duplicates dropped), plus (dK/dV
    kernel, causal, GPU) each again with the longest-first launch order."""
    cfgs: list[dict] = []
    for c in _configs(ctx, d, which):
        c = dict(c, TMA=bool(c.get("TMA")) and tma_ok, **({"LPT": bool(c.get("LPT"))} if which == "bwd_kv" else {}))
        if c not in cfgs:
            cfgs.append(c)
    if which == "bwd_kv" and causal and dev.type == "cuda":
        cfgs += [dict(c, LPT=True) for c in cfgs if not c["LPT"] and dict(c, LPT=True) not in cfgs]
    return cfgs


def _bwd_tma_ok(d: int, block_d: int, *ts: torch.Tensor) -> bool:
    """The backward's streamed tiles loadable through (b, h, s, d) descriptors: host descriptors, an unpadded head
    dim, descriptor-addressable tensors; Hopper, or the interpreter (CPU tensors)."""
    if TensorDescriptor is None or d != block_d or not all(desc_ok(t) for t in ts):
        return False
    return sm90_plus(ts[0].device.index) if ts[0].device.type == "cuda" else True


def fp8_bwd(ctx, dout, q, k, v, q_descale, k_descale, v_descale, out, lse, causal, scale, *,
            configs: tuple[dict, dict] | None = None):
    """(dq, dk, dv) per the op's backward contract: the gradients with respect to the dequantized q, k, v, in
    dout's dtype (bf16 / fp16: the non-FP8 GEMMs' operand dtype), (b, s, h, d) memory.  configs: explicit
    (dK/dV, dQ) tile dicts (tests, probes) instead of the profile's."""
    import triton
    K = _kernels()
    cdt = dout.dtype
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    dout, out = _half(dout, cdt), _half(out, out.dtype)
    lse = lse.float().contiguous()
    b, hq, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    group = hq // hkv
    block_d = max(MIN_BLOCK, triton.next_power_of_2(d))
    dev = q.device
    poison = dev.type == "cpu" or env_bool("OPSADV_POISON_OUTPUTS")
    delta = torch.empty((b, hq, sq), dtype=torch.float32, device=dev)
    lse2 = torch.empty_like(delta)
    dq = empty_bshd(q.shape, cdt, dev)
    dk = empty_bshd(k.shape, cdt, dev)
    dv = empty_bshd(v.shape, cdt, dev)
    if poison:      # an element no kernel writes shows as NaN
        for t in (delta, lse2, dq, dk, dv):
            t.fill_(float("nan"))
    pre_bm = 64
    K["pre"][(triton.cdiv(sq, pre_bm), b * hq)](
        out, dout, lse, delta, lse2, out.stride(0), out.stride(1), out.stride(2),
        dout.stride(0), dout.stride(1), dout.stride(2), hq, sq, HEAD_DIM=d, BLOCK_D=block_d, BLOCK_M=pre_bm)
    qd, s_qdb, s_qdh, qd_heads = _descale_args(q_descale, b)
    kd, s_kdb, s_kdh, _ = _descale_args(k_descale, b)
    vd, s_vdb, s_vdh, _ = _descale_args(v_descale, b)
    q_descale_group = hq // qd_heads if qd_heads > 1 else 1
    descales = (qd, kd, vd)
    descale_strides = (s_qdb, s_qdh if qd_heads > 1 else 0, s_kdb, s_kdh, s_vdb, s_vdh)
    common = (hq, group, q_descale_group, sq, sk, sk - sq, scale * LOG2E, scale)
    tma_ok = _bwd_tma_ok(d, block_d, q, k, v, dout)

    def launch_kv(cfg):
        bm, bn = cfg["BLOCK_M"], cfg["BLOCK_N"]
        lpt, tma = bool(cfg.get("LPT")), bool(cfg.get("TMA")) and tma_ok
        q_desc, do_desc = (desc_bhsd(q, bm), desc_bhsd(dout, bm)) if tma else (None, None)
        grid = (b * hkv, triton.cdiv(sk, bn)) if lpt else (triton.cdiv(sk, bn), b * hkv)
        K["kv"][grid](q, k, v, dout, dk, dv, lse2, delta, *descales, q_desc, do_desc,
                      q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
                      v.stride(0), v.stride(1), v.stride(2), dout.stride(0), dout.stride(1), dout.stride(2),
                      dk.stride(0), dk.stride(1), dk.stride(2), dv.stride(0), dv.stride(1), dv.stride(2),
                      *descale_strides, *common,
                      HEAD_DIM=d, BLOCK_D=block_d, BLOCK_M=bm, BLOCK_N=bn, CAUSAL=causal, EVEN_M=sq % bm == 0,
                      EVEN_N=sk % bn == 0, LPT=lpt, TMA=tma, num_warps=cfg["num_warps"],
                      num_stages=cfg["num_stages"])

    def launch_q(cfg):
        bm, bn = cfg["BLOCK_M"], cfg["BLOCK_N"]
        tma = bool(cfg.get("TMA")) and tma_ok
        k_desc, v_desc = (desc_bhsd(k, bn), desc_bhsd(v, bn)) if tma else (None, None)
        K["q"][(triton.cdiv(sq, bm), b * hq)](
            q, k, v, dout, dq, lse2, delta, *descales, k_desc, v_desc,
            q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2), dout.stride(0), dout.stride(1), dout.stride(2),
            dq.stride(0), dq.stride(1), dq.stride(2), *descale_strides, *common,
            HEAD_DIM=d, BLOCK_D=block_d, BLOCK_M=bm, BLOCK_N=bn, CAUSAL=causal, EVEN_M=sq % bm == 0, TMA=tma,
            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])

    if configs is not None:
        cfg_kv, cfg_q = dict(DEFAULT_BWD_TILE, **configs[0]), dict(DEFAULT_BWD_TILE, **configs[1])
        if (cfg_kv.get("TMA") or cfg_q.get("TMA")) and not tma_ok:     # an explicit request: never silently off
            raise ValueError(f"fp8_attention backward: TMA configs need descriptor-addressable q, k, v, dO with an "
                             f"unpadded head dim on Hopper or the interpreter (head_dim {d}, device {dev})")
    else:
        from ..utils import bucket
        tune = dev.type == "cuda" and ctx is not None and ctx.profile is not None and ctx.profile.autotune
        key = (d, causal, group, bucket(sq), bucket(sk), bucket(b * hq), str(cdt), tma_ok)
        cfg_kv = K["tuner_kv"].pick(key, _bwd_configs(ctx, d, "bwd_kv", causal, dev, tma_ok), launch_kv, tune)
        cfg_q = K["tuner_q"].pick(key, _bwd_configs(ctx, d, "bwd_q", causal, dev, tma_ok), launch_q, tune)
    if dev.type == "cuda":      # the two kernels share only inputs: side by side on two streams
        run_side_by_side(dev, lambda: launch_kv(cfg_kv), lambda: launch_q(cfg_q))
    else:
        launch_kv(cfg_kv)
        launch_q(cfg_q)
    return dq, dk, dv


def _check(spec, env) -> list[str]:
    """The backward's limits: its non-FP8 GEMMs run in the gradients' dtype (bf16 / fp16), and the interpreter's
    bf16 dot is wrong."""
    if not spec.backward:
        return []
    if spec.dtype not in BWD_DTYPES:
        return [f"backward: gradients in {str(spec.dtype).replace('torch.', '')}; the FP8 backward's non-FP8 GEMMs "
                "run in the gradients' dtype, bfloat16 or float16 (train in bf16 / fp16, or backward='bf16')"]
    return interpreter_bf16_reasons(spec)


def impls(env, backend: str = "cuda") -> list[KernelImpl]:
    if importlib.util.find_spec("triton") is None:
        return []
    return [KernelImpl(
        id=f"{backend}.triton.fp8_attention", op="fp8_attention", backend=backend, fn=fp8_fwd, backward=fp8_bwd,
        priority=PRIORITY_TRITON, device_types=triton_device_types(env),
        dtypes=(torch.bfloat16, torch.float16, torch.float32), head_dims=HEAD_DIMS, min_cc=FP8_MIN_CC,
        features=FEATURES, deterministic=True, requires_interpret_or_cuda=True, memory=MEMORY_FLASH,
        honours=frozenset({"tile_size"}), check=_check,
        description="Triton FP8 attention (FP8 tensor cores: sm_89+; not A100 / Jetson Orin): FA2-style online "
                    "softmax, e4m3 QK^T with the descales folded into the softmax scale, P scaled by 256 and rounded "
                    "to e4m3 for an FP8 P V, float32 accumulators, GQA by index, bottom-right causal; V transposed "
                    "(K-major) and TMA on Hopper per the profile.  Backward (bf16 / fp16 gradients): FP8 QK^T "
                    "recomputation, dV / dP / dQ / dK in the gradients' dtype with the e4m3 operands converted "
                    "exactly, deterministic")]
