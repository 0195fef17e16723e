"""Four CPU backends, each the reference kernels with one planted error of the size a wrong kernel has:
`planted_out` scales every op's output by 1.01, `planted_eps` runs rms_norm with eps x 1e4, `planted_softmax`
runs attention with the softmax scale off by 1%, `planted_grad` scales every op's first input gradient by 1.01.
Conformance must fail every cell each of them serves (tests/test_conformance_rule.py)."""
import torch

from opsadv import KernelImpl
from opsadv.ops.flash_attention import reference as FA
from opsadv.ops.gemm import reference as GM
from opsadv.ops.norm import reference as NM
from opsadv.ops.rotary_embedding import reference as RO
from opsadv.ops.sparse_attention import reference as SP
from opsadv.ops.swiglu import reference as SW
from opsadv.registry import BackendInfo, ProbeResult, hookimpl

DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# op: (forward, backward, features) -- the reference impls each op folder's reference.py holds, and their features
OPS = {"flash_attention": (FA.attention_fwd, FA.attention_bwd, FA.FEATURES),
       "sparse_attention": (SP.sparse_fwd, SP.sparse_bwd, SP.FEATURES),
       "gemm": (GM.gemm_fwd, GM.gemm_bwd, GM.FEATURES),
       "swiglu_gemm": (GM.swiglu_fwd, GM.swiglu_bwd, GM.SWIGLU_FEATURES),
       "swiglu": (SW.swiglu_act_fwd, SW.swiglu_act_bwd, SW.FEATURES),
       "layer_norm": (NM.layer_norm_fwd, NM.layer_norm_bwd, NM.FEATURES),
       "rms_norm": (NM.rms_norm_fwd, NM.rms_norm_bwd, NM.FEATURES),
       "rotary_embedding": (RO.rotary_fwd, RO.rotary_bwd, RO.FEATURES)}
ERR = 1.01


def _scaled(fn, first_only=True):
    """fn with its first output (or every output) times ERR."""
    def run(*args):
        out = fn(*args)
        if isinstance(out, tuple):
            return (out[0] * ERR, *out[1:]) if first_only else tuple(o * ERR for o in out)
        return out * ERR
    return run


def _rms_eps(fn, at):
    """rms_norm forward / backward with eps (argument `at`) x 1e4."""
    def run(*args):
        args = list(args)
        args[at] = args[at] * 1e4
        return fn(*args)
    return run


def _attn_scale(fn, at):
    """An attention forward / backward with the softmax scale (argument `at`) off by 1%."""
    def run(*args):
        args = list(args)
        args[at] = args[at] * ERR
        return fn(*args)
    return run


class Planted:
    def __init__(self, name, impls, dtypes=DTYPES):
        self.name, self._impls, self.dtypes = name, impls, dtypes

    @hookimpl
    def opsadv_backend_info(self):
        return BackendInfo(name=self.name, vendor="test fixture", device_types=("cpu",), version="0.1.0",
                           auto_priority=0)

    @hookimpl
    def opsadv_probe(self, env):
        return ProbeResult(True, ("runs on any CPU",))

    @hookimpl
    def opsadv_register_kernels(self, registry, env):
        for op, (fwd, bwd) in self._impls.items():
            registry.add(KernelImpl(id=f"{self.name}.{op}", op=op, backend=self.name, fn=fwd, backward=bwd,
                                    device_types=("cpu",), dtypes=self.dtypes, features=OPS[op][2]))

    @hookimpl
    def opsadv_profiles(self):
        return []


OUT = Planted("planted_out", {op: (_scaled(f), b) for op, (f, b, _) in OPS.items()})
# eps x 1e4 (a 0.25-0.5% output scale at unit variance) and a 1% gradient are within 3x bf16's rounding noise (its
# ulp is 0.4-0.8%) in some small cells: these two serve float16 / float32 / float64, where every cell must fail
SHARP = (torch.float16, torch.float32, torch.float64)
EPS = Planted("planted_eps", {"rms_norm": (_rms_eps(NM.rms_norm_fwd, 3), NM.rms_norm_bwd)}, SHARP)
# scale is the last argument of the attention forwards (before sparse's optional dense_blocks / max_seqlen)
SOFTMAX = Planted("planted_softmax", {"flash_attention": (_attn_scale(FA.attention_fwd, 6), _attn_scale(FA.attention_bwd, 9)),
                                      "sparse_attention": (_attn_scale(SP.sparse_fwd, 12), _attn_scale(SP.sparse_bwd, 15))})
GRAD = Planted("planted_grad", {op: (f, _scaled(b)) for op, (f, b, _) in OPS.items()}, SHARP)
BACKENDS = (OUT, EPS, SOFTMAX, GRAD)
