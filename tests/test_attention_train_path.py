"""flash_attention training calls resolved to an impl with a `train` forward (an aten op with torch's own derivative,
as cuda.sdpa.cudnn declares) run that forward under torch's autograd: no opsadv autograd Function, no Python
backward, no backward dispatch (host cost).  A test backend runs torch's CPU flash-attention kernels that way; its
results match the reference backend in float64, forward and gradients, on the full and the fast path, and an impl
without `train` keeps opsadv's Function."""
import dataclasses

import pytest
import torch

import opsadv
from opsadv.core import dispatch
from opsadv.core.kernel import KernelImpl
from opsadv.core.op_common import own_pair_train_step
from opsadv.registry import hookimpl
from opsadv.registry.hookspecs import BackendInfo, ProbeResult

from conftest import rel_err

A = torch.ops.aten


def _fwd(ctx, q, k, v, attn_mask, causal, scale):
    return A._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, attn_mask=None, scale=scale)


def _bwd(ctx, dout, q, k, v, out, lse, attn_mask, causal, scale):
    return A._scaled_dot_product_flash_attention_for_cpu_backward(dout, q, k, v, out, lse, 0.0, causal,
                                                                  attn_mask=None, scale=scale)


def _same_heads(spec, env):
    return [] if spec.shapes[0][1] == spec.shapes[1][1] else ["no GQA"]


class AtenCpu:
    def __init__(self, with_train: bool):
        self.with_train = with_train

    @hookimpl
    def opsadv_backend_info(self):
        return BackendInfo(name="atencpu", device_types=("cpu",), auto_priority=50)

    @hookimpl
    def opsadv_probe(self, env):
        return ProbeResult(True)

    @hookimpl
    def opsadv_register_kernels(self, registry, env):
        registry.add(KernelImpl(id="atencpu.flash_attention", op="flash_attention", backend="atencpu", fn=_fwd,
                                backward=_bwd, train=_fwd if self.with_train else None, priority=400,
                                device_types=("cpu",), dtypes=(torch.float32, torch.float64),
                                features=frozenset({"causal"}), check=_same_heads))


@pytest.fixture(params=[True, False], ids=["train_forward", "function"])
def aten_cpu(request, tmp_path, monkeypatch):
    from opsadv.core import tuning
    from opsadv.registry import reset_registry
    monkeypatch.setenv("OPSADV_CACHE_DIR", str(tmp_path))
    tuning.reload()
    reg = reset_registry(dataclasses.replace(opsadv.detect(), triton_interpret=False))
    reg.register_plugin(AtenCpu(request.param), name="atencpu")
    dispatch.clear_cache()
    yield request.param
    reset_registry()
    dispatch.clear_cache()
    monkeypatch.undo()
    tuning.reload()


def _reference(q, k, v, dout, causal, scale):
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    with opsadv.use_backend("reference"):
        out, lse = opsadv.ops.flash_attention(*leaves, causal=causal, scale=scale, return_lse=True)
    out.backward(dout.double())
    return out, lse, [t.grad for t in leaves]


@pytest.mark.parametrize("causal", [True, False])
def test_training_calls_match_the_reference(aten_cpu, causal):
    torch.manual_seed(3 + causal)
    b, h, s, d = 2, 3, 37, 16
    base = torch.randn(b, s, h, 3 * d)                   # q, k, v as transformers hands them: (b, s, h, d) memory
    q, k, v = (base[..., i * d:(i + 1) * d].transpose(1, 2) for i in range(3))
    dout = torch.randn(b, h, s, d)
    ref_out, ref_lse, ref_grads = _reference(q, k, v, dout, causal, 0.3)
    for call in range(2):                                # the second identical call takes the fast path
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        with opsadv.use_backend("atencpu"), opsadv.trace() as t:
            out, lse = opsadv.ops.flash_attention(*leaves, causal=causal, scale=0.3, return_lse=True)
            out.backward(dout)
        # torch's own autograd node with a `train` forward; opsadv's Function (and its backward dispatch) without
        assert ("FlashAttentionTrainFn" in type(out.grad_fn).__name__) != aten_cpu, type(out.grad_fn).__name__
        assert t.counts["atencpu.flash_attention"] == (1 if aten_cpu else 2), (call, dict(t.counts))
        assert not lse.requires_grad and lse.is_contiguous()
        assert rel_err(out, ref_out) < 1e-5 and rel_err(lse, ref_lse) < 1e-5
        for x, want in zip(leaves, ref_grads):
            assert rel_err(x.grad, want) < 1e-5, call


def test_autotune_times_the_train_forward(aten_cpu):
    """The train bucket's autotune step runs what the calls will run: the `train` forward under torch's autograd."""
    from opsadv.registry import get_registry
    impl = next(i for i in get_registry().impls_by_op["flash_attention"] if i.id == "atencpu.flash_attention")
    calls = []
    spy = dataclasses.replace(impl, train=(lambda *a: calls.append(1) or _fwd(*a)) if aten_cpu else None,
                              fn=lambda *a: calls.append(0) or _fwd(*a))
    q, k, v = (torch.randn(1, 2, 9, 8) for _ in range(3))
    step = own_pair_train_step(spy, None, (q, k, v, None, True, 0.3))
    dq, dk, dv = step()
    assert calls and set(calls) == {1 if aten_cpu else 0}
    assert dq.shape == q.shape and torch.isfinite(dq).all()
