"""Impl backwards under torch.compile: a compiled training step runs each op's backward inside the
`opsadv::*_backward` custom op, where autograd records nothing, so no backward may rely on
torch.autograd.grad.  cuda.sdpa.efficient's masked half-precision backward (a recompute through
aten's own autograd of SDPA, kept for its numerics) runs here on CPU tensors: directly, and as the
backward of a test backend's flash_attention under torch.compile."""
import copy
import dataclasses

import pytest
import torch

import opsadv
from opsadv import KernelImpl
from opsadv.backends.cuda.flash_attention import sdpa
from opsadv.ops.flash_attention import reference as K
from opsadv.ops.flash_attention.reference import FEATURES as ATTN_FEATURES
from opsadv.core import dispatch
from opsadv.registry import BackendInfo, ProbeResult, hookimpl

from conftest import rel_err

HALF_CPU = (torch.bfloat16, torch.float16)


def _case(dtype, seed, b=2, hq=4, hk=2, s=29, d=16, causal=True, kind="bool"):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, s, d, generator=g).to(dtype)
    k, v = (torch.randn(b, hk, s, d, generator=g).to(dtype) for _ in range(2))
    dout = torch.randn(b, hq, s, d, generator=g).to(dtype)
    keep = torch.rand(b, 1, s, s, generator=g) > 0.3
    keep[1, :, 3] = False                 # a row the mask empties: zero output, no gradient, never NaN
    keep[0, :, :, s - 5:] = False         # padded keys
    mask = keep if kind == "bool" else torch.zeros(b, 1, s, s).masked_fill(~keep, float("-inf")).to(dtype)
    return q, k, v, dout, mask, causal


def _reference_grads(q, k, v, dout, mask, causal, scale):
    """float64 gradients of the reference impl (its explicit backward)."""
    q64, k64, v64, do64 = (t.double() for t in (q, k, v, dout))
    m64 = mask if mask.dtype == torch.bool else mask.double()
    out, lse = K.attention_fwd(None, q64, k64, v64, m64, causal, scale)
    return K.attention_bwd(None, do64, q64, k64, v64, out, lse, m64, causal, scale)


@pytest.mark.parametrize("dtype", HALF_CPU)
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_masked_recompute_backward_on_cpu(dtype, kind):
    q, k, v, dout, mask, causal = _case(dtype, 11, kind=kind)
    scale = 0.31
    got = sdpa._masked_bwd_recompute(dout, q, k, v, mask, causal, scale)
    want = _reference_grads(q, k, v, dout, mask, causal, scale)
    for name, g, w in zip("qkv", got, want):
        assert g.dtype == dtype and g.shape == w.shape, name
        assert torch.isfinite(g).all(), name
        assert rel_err(g, w) < 2e-2, (name, rel_err(g, w))
    assert (got[0][1, :, 3] == 0).all()             # the emptied row gives no dq


def test_masked_recompute_backward_without_autograd_recording():
    """Inside a custom op's kernel (the compiled backward calls one) autograd records nothing: the recompute
    still differentiates (torch.autograd.grad raised 'element 0 of tensors does not require grad' there)."""
    q, k, v, dout, mask, causal = _case(torch.bfloat16, 12)

    @torch.library.custom_op("opsadv_test::masked_recompute", mutates_args=())
    def op(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
           mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        dq, dk, dv = sdpa._masked_bwd_recompute(dout, q, k, v, mask, True, 0.25)
        return dq.clone(), dk.clone(), dv.clone()

    got = op(dout, q, k, v, mask)
    want = _reference_grads(q, k, v, dout, mask, True, 0.25)
    for g, w in zip(got, want):
        assert rel_err(g, w) < 2e-2


def test_autotune_training_step_inside_a_custom_op():
    """autotune times a training bucket's pair (forward + backward) where the call resolves: inside a compiled
    graph's opsadv op, below autograd.  The step must still differentiate (on the H100 a compiled training step's
    tuning of cuda.sdpa.cudnn failed with 'element 0 of tensors does not require grad')."""
    from opsadv.core.op_common import own_pair_train_step
    q, k, v, dout, _, _ = _case(torch.float32, 14)
    impl = KernelImpl(id="t.flash_attention", op="flash_attention", backend="t", fn=K.attention_fwd,
                      backward=K.attention_bwd, device_types=("cpu",))
    tr = KernelImpl(id="t.flash_attention_train", op="flash_attention", backend="t", fn=K.attention_fwd,
                    device_types=("cpu",),
                    train=lambda ctx, q, k, v, m, c, s: (torch.softmax(q @ k.repeat_interleave(2, 1).transpose(-1, -2)
                                                                       * s, -1) @ v.repeat_interleave(2, 1), None))
    grads = []

    @torch.library.custom_op("opsadv_test::tuned_pair", mutates_args=())
    def op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        for i in (impl, tr):
            step = own_pair_train_step(i, None, (q, k, v, None, False, 0.25))
            grads.append(step())
        return q.clone()

    op(q, k, v)
    assert len(grads) == 2
    for dq, dk, dv in grads:
        assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
        assert all(torch.isfinite(g).all() and g.abs().sum() > 0 for g in (dq, dk, dv))


# ---- a test backend whose flash_attention backward is cuda.sdpa.efficient's ------------------------------
class MaskedSdpa:
    """flash_attention with the reference forward and cuda.sdpa.efficient's backward (on CPU, half precision with
    a mask: the recompute path)."""

    @hookimpl
    def opsadv_backend_info(self):
        return BackendInfo(name="maskedsdpa", device_types=("cpu",), auto_priority=50)

    @hookimpl
    def opsadv_probe(self, env):
        return ProbeResult(True)

    @hookimpl
    def opsadv_register_kernels(self, registry, env):
        registry.add(KernelImpl(id="maskedsdpa.flash_attention", op="flash_attention", backend="maskedsdpa",
                                fn=K.attention_fwd, backward=sdpa.efficient_bwd, priority=400, device_types=("cpu",),
                                dtypes=HALF_CPU, features=ATTN_FEATURES,
                                check=lambda spec, env: [] if "attn_mask_bool" in spec.features
                                or "attn_mask_float" in spec.features else ["masked calls only"]))


@pytest.fixture
def masked_sdpa(tmp_path, monkeypatch):
    from opsadv.core import tuning
    from opsadv.registry import reset_registry
    monkeypatch.setenv("OPSADV_CACHE_DIR", str(tmp_path))
    tuning.reload()
    reg = reset_registry(dataclasses.replace(opsadv.detect(), triton_interpret=False))
    reg.register_plugin(MaskedSdpa(), name="maskedsdpa")
    dispatch.clear_cache()
    yield
    reset_registry()
    dispatch.clear_cache()
    monkeypatch.undo()
    tuning.reload()


def _masked_call(q, k, v, mask):
    return opsadv.ops.flash_attention(q, k, v, causal=True, attn_mask=mask, scale=0.3)


@pytest.mark.parametrize("mode", ["eager", "compiled", "compiled_inductor"])
def test_training_step_through_the_masked_sdpa_backward(masked_sdpa, mode):
    q, k, v, dout, mask, _ = _case(torch.bfloat16, 13)
    fn = {"eager": _masked_call, "compiled": torch.compile(_masked_call, backend="aot_eager", fullgraph=True),
          "compiled_inductor": torch.compile(_masked_call, fullgraph=True)}[mode]
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    with opsadv.use_backend("maskedsdpa"), opsadv.trace() as t:
        (fn(*leaves, mask).float() * dout.float()).sum().backward()
    assert t.counts["maskedsdpa.flash_attention"] == 2, str(t)        # its forward and its backward
    want = _reference_grads(q, k, v, dout, mask, True, 0.3)
    for x, w in zip(leaves, want):
        assert torch.isfinite(x.grad).all()
        assert rel_err(x.grad, w) < 2e-2


# ---- a converted model's training step under torch.compile ----------------------------------------------
def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=128, max_position_embeddings=128)
    return LlamaForCausalLM(cfg).eval()


def _batch(b=3, s=21, pads=(0, 6, 11), seed=5):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, 128, (b, s), generator=g)
    am = torch.ones(b, s, dtype=torch.long)
    for i, p in enumerate(pads):
        if p:
            am[i, s - p:] = 0
    return ids, am, ids.masked_fill(am == 0, -100)


def _step(model, ids, am, labels, run=None):
    """loss and every parameter's gradient of one step (run: the callable to step through, e.g. compiled)."""
    model.zero_grad(set_to_none=True)
    loss = (model if run is None else run)(input_ids=ids, attention_mask=am, labels=labels).loss
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("padded", [True, False])
def test_compiled_training_step_of_a_converted_model(padded):
    pytest.importorskip("transformers")
    orig = _llama()
    conv = opsadv.convert_model(copy.deepcopy(orig), backend="reference", floor=False)
    orig.train()
    conv.train()
    ids, am, labels = _batch(pads=(0, 6, 11) if padded else (0, 0, 0))
    want_loss, want = _step(orig, ids, am, labels)
    with opsadv.trace() as t:
        loss, got = _step(conv, ids, am, labels, torch.compile(conv, backend="aot_eager"))
    assert t.counts.get("reference.flash_attention", 0) + t.counts.get("reference.sparse_attention", 0) > 0, str(t)
    assert abs(loss.item() - want_loss.item()) < 1e-5
    assert got.keys() == want.keys()
    for n in want:
        assert torch.isfinite(got[n]).all(), n
        assert rel_err(got[n], want[n]) < 1e-4, (n, rel_err(got[n], want[n]))
