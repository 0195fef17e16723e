"""The rotary conversion pass (opsadv.convert.rotary): transformers' apply_rotary_pos_emb -> opsadv.rotary_embedding
per attention instance of the converted model only; checked numerically before it is swapped; undone cleanly;
decoding, training and torch.compile give the original's results."""
import copy
import functools
import inspect
import itertools
import sys
import types

import pytest
import torch
from torch import nn

import opsadv
from opsadv.convert import rotary as R
from opsadv.convert.passes import Undo
from opsadv.convert.report import ConversionReport
from opsadv.convert.state import RuntimeState

tf = pytest.importorskip("transformers")

from opsadv.bench import model_zoo as Z  # noqa: E402

_SERIAL = itertools.count()
ROTARY_ARCHS = ["llama3", "qwen2", "qwen3", "mistral", "gemma2", "phi3", "gpt_neox"]


def _convert(model, x, **kw):
    return opsadv.convert_model(model, backend="reference", example_inputs=Z.without_labels(x), **kw)


def _rotary_changes(rep):
    return [c for c in rep.changes if "rotary_embedding" in c.what]


@pytest.mark.parametrize("arch", ROTARY_ARCHS)
def test_every_rotary_architecture_runs_the_op(arch, reference_backend):
    m = Z.build(arch, "tiny")
    x = Z.inputs(arch, m.config, 2, 13)
    with torch.no_grad():
        ref = m(**x).logits
    conv = _convert(copy.deepcopy(m), x)
    rep = conv.opsadv_report
    n_layers = m.config.num_hidden_layers
    assert len(_rotary_changes(rep)) == n_layers, str(rep)
    with opsadv.trace() as t, torch.no_grad():
        out = conv(**x).logits
    assert t.counts.get("reference.rotary_embedding") == n_layers, t.counts
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)


def test_probe_knows_which_functions_rotate_part_of_a_head(reference_backend):
    """GPT-NeoX's and Phi-3's functions rotate cos.shape[-1] features and pass the rest (as the op does);
    Llama's rotates whole heads only, so its partial-width calls would stay on the original."""
    from transformers.models.gpt_neox import modeling_gpt_neox
    from transformers.models.llama import modeling_llama
    from transformers.models.phi3 import modeling_phi3
    assert R._probe(modeling_gpt_neox.apply_rotary_pos_emb)[:2] == (True, True)
    assert R._probe(modeling_phi3.apply_rotary_pos_emb)[:2] == (True, True)
    assert R._probe(modeling_llama.apply_rotary_pos_emb)[:2] == (True, False)
    assert R._probe(_interleaved_rope)[0] is False


def test_only_the_converted_model_changes(reference_backend):
    a, b = Z.build("llama3", "tiny"), Z.build("llama3", "tiny")
    cls = type(a.model.layers[0].self_attn)
    fwd = cls.forward
    glob = inspect.unwrap(fwd).__globals__          # through every decorator (deprecate_kwarg, kernels' hub layer)
    fn = glob["apply_rotary_pos_emb"]
    x = Z.inputs("llama3", a.config, 2, 9)
    _convert(a, x)
    assert cls.forward is fwd and glob["apply_rotary_pos_emb"] is fn        # class and modeling function as they were
    assert "forward" not in b.model.layers[0].self_attn.__dict__
    with opsadv.trace() as t, torch.no_grad():
        b(**x)
    assert "reference.rotary_embedding" not in t.counts


def test_undo_restores_the_class_forward(reference_backend):
    m = Z.build("qwen2", "tiny")
    x = Z.inputs("qwen2", m.config, 2, 9)
    with torch.no_grad():
        ref = m(**x).logits
    undo = Undo()
    from transformers.models.qwen2 import modeling_qwen2

    def aliases():
        return {k for k in vars(modeling_qwen2) if k.startswith("_opsadv_rotary_")}
    before = aliases()                       # (other tests' converted models keep theirs)
    n = R.rotary_pass(m, ConversionReport("m", 2, "reference", "fp32"), undo, RuntimeState())
    assert n == m.config.num_hidden_layers
    assert len(aliases() - before) == 1      # one per converted class
    undo.revert()
    assert not [(p, mod.__dict__["forward"]) for p, mod in m.named_modules() if "forward" in mod.__dict__]
    assert aliases() == before
    with opsadv.trace() as t, torch.no_grad():
        assert torch.equal(m(**x).logits, ref)
    assert not t.counts


def test_generate_matches_with_cache(reference_backend):
    """Decode steps rotate one token at its cache position (cos / sin of that position)."""
    m = Z.build("llama3", "tiny")
    x = Z.inputs("llama3", m.config, 2, 6)
    kw = dict(max_new_tokens=5, do_sample=False, min_new_tokens=5)
    with torch.no_grad():
        want = m.generate(**x, **kw)
    conv = _convert(copy.deepcopy(m), x)
    with opsadv.trace() as t, torch.no_grad():
        got = conv.generate(**x, **kw)
    assert torch.equal(got, want)
    assert t.counts.get("reference.rotary_embedding", 0) >= 5 * m.config.num_hidden_layers


def test_deepcopy_runs_under_the_copy_policy(reference_backend):
    m = Z.build("llama3", "tiny")
    x = Z.inputs("llama3", m.config, 2, 9)
    conv = _convert(m, x)
    twin = copy.deepcopy(conv)
    attn = twin.model.layers[0].self_attn
    assert attn.forward.__self__ is attn and attn._opsadv_state is twin._opsadv_state
    with opsadv.trace() as t, torch.no_grad():
        torch.testing.assert_close(twin(**x).logits, conv(**x).logits)
    assert t.counts["reference.rotary_embedding"] == 2 * m.config.num_hidden_layers


def test_training_gradients_match(reference_backend):
    m = Z.build("phi3", "tiny", train=True)              # partial rotary + fused qkv_proj
    x = Z.inputs("phi3", m.config, 2, 11, labels=True)
    conv = _convert(copy.deepcopy(m), x).train()
    m.train()
    lo = m(**x).loss
    lo.backward()
    lc = conv(**x).loss
    lc.backward()
    assert abs(lo.item() - lc.item()) <= 1e-5 * abs(lo.item())
    g = Z.grad_errors(m, conv)
    assert not g["missing"] and g["max_rel_err"] < 1e-4, g


# ---- the seams: numerical check, decorator chains --------------------------------------------------------------
def _interleaved_rope(q, k, cos, sin, unsqueeze_dim=1):
    """A rotation of (x[2i], x[2i+1]) pairs: not what the half-layout op computes."""
    def rot(x):
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack((-x2, x1), -1).flatten(-2)
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return q * cos + rot(q) * sin, k * cos + rot(k) * sin


def _half_rope(q, k, cos, sin, unsqueeze_dim=1):
    def rot(x):
        h = x.shape[-1] // 2
        return torch.cat((-x[..., h:], x[..., :h]), -1)
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return q * cos + rot(q) * sin, k * cos + rot(k) * sin


def _fake_attention_class(rope, decorate=None):
    """A class whose forward calls `apply_rotary_pos_emb` from its own module globals (as transformers' do)."""
    name = f"fake_modeling_rope_{next(_SERIAL)}"
    mod = types.ModuleType(name)
    sys.modules[name] = mod                    # (torch.compile imports a function's module by its name)
    mod.torch = torch
    mod.apply_rotary_pos_emb = rope
    src = ("def forward(self, q, k, cos, sin):\n"
           "    return apply_rotary_pos_emb(q, k, cos, sin)\n")
    exec(compile(src, f"{name}.py", "exec"), mod.__dict__)
    fwd = mod.forward if decorate is None else decorate(mod.forward)
    return type("FakeAttention", (nn.Module,), {"forward": fwd}), mod


def _qkcs(r=8):
    g = torch.Generator().manual_seed(3)
    q, k = torch.randn(1, 2, 5, 8, generator=g), torch.randn(1, 1, 5, 8, generator=g)
    ang = torch.randn(1, 5, r // 2, generator=g)
    return q, k, torch.cat((ang, ang), -1).cos(), torch.cat((ang, ang), -1).sin()


def _kwarg_renamer(fn):
    @functools.wraps(fn)
    def wrapper(*a, **kw):
        kw.pop("old_name", None)
        return fn(*a, **kw)
    return wrapper


class _CallableWrapper:
    """A decorator object (not a closure): a copy would lose it, so the pass refuses."""

    def __init__(self, fn):
        self.fn = fn
        functools.update_wrapper(self, fn)

    def __call__(self, *a, **kw):
        return self.fn(*a, **kw)


def _run_pass(model):
    rep, undo = ConversionReport("m", 2, "reference", "fp32"), Undo()
    return R.rotary_pass(model, rep, undo, RuntimeState()), rep, undo


@pytest.mark.parametrize("decorate", [None, _kwarg_renamer], ids=["plain", "functools.wraps closure"])
def test_fake_module_swapped_through_decorators(decorate, reference_backend):
    cls, mod = _fake_attention_class(_half_rope, decorate)
    m = nn.Sequential(cls(), cls())
    n, rep, undo = _run_pass(m)
    assert n == 2 and len(_rotary_changes(rep)) == 2
    q, k, c, s = _qkcs()
    with opsadv.trace() as t:
        got = m[0](q, k, c, s)
    assert t.counts == {"reference.rotary_embedding": 1}
    for a, b in zip(got, _half_rope(q, k, c, s)):
        torch.testing.assert_close(a, b)
    assert mod.apply_rotary_pos_emb is _half_rope
    undo.revert()
    with opsadv.trace() as t:
        m[0](q, k, c, s)
    assert not t.counts


def test_other_computations_are_skipped_with_the_reason(reference_backend):
    cls, _ = _fake_attention_class(_interleaved_rope)
    n, rep, undo = _run_pass(nn.Sequential(cls()))
    assert n == 0 and undo.empty()
    (c,) = [c for c in rep.changes if c.kind == "skipped"]
    assert "another rotation" in c.reason


def test_a_non_closure_decorator_is_refused(reference_backend):
    cls, _ = _fake_attention_class(_half_rope, _CallableWrapper)
    n, rep, undo = _run_pass(nn.Sequential(cls()))
    assert n == 0 and undo.empty()
    (c,) = [c for c in rep.changes if c.kind == "skipped"]
    assert "wrapped by a decorator opsadv cannot copy" in c.reason


def test_full_width_only_function_keeps_partial_calls_on_the_original(reference_backend):
    """Llama's function cannot rotate part of a head (a broadcast error): such calls go to the original."""
    def full_only(q, k, cos, sin, unsqueeze_dim=1):
        if cos.shape[-1] != q.shape[-1]:
            raise RuntimeError("full width only")
        return _half_rope(q, k, cos, sin, unsqueeze_dim)
    cls, _ = _fake_attention_class(full_only)
    m = nn.Sequential(cls())
    n, _, _ = _run_pass(m)
    assert n == 1
    q, k, c, s = _qkcs(r=4)
    with pytest.raises(RuntimeError, match="full width only"):
        m[0](q, k, c, s)


def test_compiled_forward_uses_the_op(reference_backend):
    import torch._dynamo
    cls, _ = _fake_attention_class(_half_rope, _kwarg_renamer)
    m = nn.Sequential(cls())
    _run_pass(m)
    q, k, c, s = _qkcs()
    try:
        with opsadv.trace() as t:
            got = torch.compile(m[0], fullgraph=True, backend="aot_eager")(q, k, c, s)
        assert t.counts == {"reference.rotary_embedding": 1}, t.counts
    finally:
        torch._dynamo.reset()
    for a, b in zip(got, _half_rope(q, k, c, s)):
        torch.testing.assert_close(a, b)
