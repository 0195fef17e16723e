"""The rotary conversion pass (opsadv.convert.rotary): transformers' apply_rotary_pos_emb -> opsadv.rotary_embedding
per attention instance of the converted model only; checked numerically before it is swapped; undone cleanly;
decoding, training and torch.compile give the original's results."""
import collections
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
QK_NORM_ARCHS = ("qwen3",)
_ROPE_OPS = collections.Counter({"reference.rotary_embedding": 1, "reference.qk_norm_rotary": 1})


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
    op = "qk_norm_rotary" if arch in QK_NORM_ARCHS else "rotary_embedding"      # (Qwen3: its q / k norms fuse)
    assert t.counts.get(f"reference.{op}") == n_layers and len(t.counts & _ROPE_OPS) == 1, t.counts
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


# ---- per-head q / k norms fused into qk_norm_rotary (Qwen3, Gemma-3) ---------------------------------------------
def _tiny_hf(config_cls: str, model_cls: str, **kw):
    """A tiny randomly initialized transformers model (weights perturbed: Gemma's norms start at w = 0)."""
    cfg = getattr(tf, config_cls)(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                  max_position_embeddings=64, **kw)
    torch.manual_seed(0)
    m = getattr(tf, model_cls)(cfg).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.1 * torch.randn_like(p))
    gc = getattr(m, "generation_config", None)
    if gc is not None:
        gc.eos_token_id, gc.pad_token_id = None, 0
    return m


def _ids(batch, seq, vocab=128):
    g = torch.Generator().manual_seed(5)
    return {"input_ids": torch.randint(0, vocab, (batch, seq), generator=g),
            "attention_mask": torch.ones(batch, seq, dtype=torch.long)}


def test_norm_sites_reads_qwen3_and_gemma3_and_refuses_olmo2_and_llama():
    from transformers.models.gemma3 import modeling_gemma3
    from transformers.models.llama import modeling_llama
    from transformers.models.olmo2 import modeling_olmo2
    from transformers.models.qwen3 import modeling_qwen3
    name = "apply_rotary_pos_emb"
    assert R.norm_sites(modeling_qwen3.Qwen3Attention.forward, name) == ({"q": "q_norm", "k": "k_norm"}, "")
    assert R.norm_sites(modeling_gemma3.Gemma3Attention.forward, name) == ({"q": "q_norm", "k": "k_norm"}, "")
    sites, why = R.norm_sites(modeling_olmo2.Olmo2Attention.forward, name)   # a norm over the whole projection
    assert sites is None and "does not come straight from a norm module" in why
    assert R.norm_sites(modeling_llama.LlamaAttention.forward, name)[0] is None


def _qk_norm_class(body: str):
    """A module whose forward(x, cos, sin) runs `body` (which ends in the rotary call) over q_norm / k_norm."""
    name = f"fake_modeling_qknorm_{next(_SERIAL)}"
    mod = types.ModuleType(name)
    sys.modules[name] = mod
    mod.torch, mod.apply_rotary_pos_emb = torch, _half_rope
    src = "def forward(self, x, cos, sin):\n" + "".join(f"    {line}\n" for line in body.strip().splitlines())
    exec(compile(src, f"{name}.py", "exec"), mod.__dict__)
    import linecache                       # (inspect.getsource reads the source through linecache)
    linecache.cache[f"{name}.py"] = (len(src), None, src.splitlines(True), f"{name}.py")

    def init(self):
        nn.Module.__init__(self)
        self.q_norm = tf.models.qwen3.modeling_qwen3.Qwen3RMSNorm(8, eps=1e-6)
        self.k_norm = tf.models.qwen3.modeling_qwen3.Qwen3RMSNorm(8, eps=1e-6)
        with torch.no_grad():
            self.q_norm.weight.normal_()
            self.k_norm.weight.normal_()
    return type("FakeQkAttention", (nn.Module,), {"__init__": init, "forward": mod.forward})


_FUSES = """
q = self.q_norm(x.view(1, 5, 2, 8)).transpose(1, 2)
k = self.k_norm(x.view(1, 5, 2, 8)[:, :, :1]).transpose(1, 2)
q, k = apply_rotary_pos_emb(q, k, cos, sin)
return q, k
"""
_READ_BETWEEN = """
q = self.q_norm(x.view(1, 5, 2, 8)).transpose(1, 2)
k = self.k_norm(x.view(1, 5, 2, 8)[:, :, :1]).transpose(1, 2)
s = q.sum()
q, k = apply_rotary_pos_emb(q, k, cos, sin)
return q + s, k
"""
_LAST_DIM = """
q = self.q_norm(x.view(1, 5, 2, 8)).transpose(1, 2)
k = self.k_norm(x.view(1, 5, 2, 8)[:, :, :1]).transpose(2, 3).transpose(2, 3).transpose(1, 2)
q, k = apply_rotary_pos_emb(q, k, cos, sin)
return q, k
"""


@pytest.mark.parametrize("body,fused", [(_FUSES, True), (_READ_BETWEEN, False), (_LAST_DIM, True)],
                         ids=["fuses", "read_between", "last_dim_transposed"])
def test_deferred_norms_give_the_original_results(body, fused, reference_backend):
    """Sources that read a normed q between the norm and the rotary call keep plain rotary (norm_sites); a
    transpose that moves the last dim runs the norm first (Deferred.transpose); a forward hook on a norm module
    makes the call run the modules (the hook sees its call); every variant gives the original's results."""
    cls = _qk_norm_class(body)
    m = cls()
    x = torch.randn(1, 5, 16)
    _, c, s_ = _qkcs()[1:]
    with torch.no_grad():
        want = m(x, c, s_)
    n, rep, undo = _run_pass(m)
    assert n == 1 and ("qk_norm_rotary" in str(rep)) == fused, str(rep)
    with opsadv.trace() as t, torch.no_grad():
        got = m(x, c, s_)
    assert sum(t.counts.values()) == 1 and ("reference.qk_norm_rotary" in t.counts) == (fused and body == _FUSES)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    if fused:
        seen = []
        h = m.q_norm.register_forward_hook(lambda mod, i, o: seen.append(o.shape))
        with opsadv.trace() as t, torch.no_grad():
            got = m(x, c, s_)
        h.remove()
        assert seen == [(1, 5, 2, 8)] and "reference.rotary_embedding" in t.counts, t.counts
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    undo.revert()
    assert not [k for k in m.__dict__ if k.startswith("_opsadv")]


def test_qwen3_training_gradients_match_with_fused_norms(reference_backend):
    """Loss and every gradient (the q_norm / k_norm weights included) as the unconverted model's."""
    m = Z.build("qwen3", "tiny", train=True)
    with torch.no_grad():                       # (norm weights start at 1: make them matter)
        for name, p in m.named_parameters():
            if "q_norm" in name or "k_norm" in name:
                p.normal_(1.0, 0.3)
    x = Z.inputs("qwen3", m.config, 2, 11, labels=True)
    conv = _convert(copy.deepcopy(m), x).train()
    m.train()
    lo = m(**x).loss
    lo.backward()
    with opsadv.trace() as t:
        lc = conv(**x).loss
        lc.backward()
    assert t.counts["reference.qk_norm_rotary"] == 2 * m.config.num_hidden_layers, t.counts   # fwd + bwd
    assert abs(lo.item() - lc.item()) <= 1e-5 * abs(lo.item())
    g = Z.grad_errors(m, conv)
    assert not g["missing"] and g["max_rel_err"] < 1e-4, g
    qn = conv.model.layers[0].self_attn.q_norm.weight
    assert qn.grad is not None and qn.grad.abs().sum() > 0


def test_qwen3_generate_with_cache_matches(reference_backend):
    m = Z.build("qwen3", "tiny")
    x = Z.inputs("qwen3", m.config, 2, 6)
    kw = dict(max_new_tokens=5, do_sample=False, min_new_tokens=5)
    with torch.no_grad():
        want = m.generate(**x, **kw)
    conv = _convert(copy.deepcopy(m), x)
    twin = copy.deepcopy(conv)               # a deepcopy's deferrals read the copy's own modules
    attn = twin.model.layers[0].self_attn
    assert attn._opsadv_q_norm.__self__ is attn and attn._opsadv_qk_probed["q_norm"][0] is not None
    with opsadv.trace() as t, torch.no_grad():
        got = conv.generate(**x, **kw)
        got2 = twin.generate(**x, **kw)
    assert torch.equal(got, want) and torch.equal(got2, want)
    assert t.counts.get("reference.qk_norm_rotary", 0) >= 2 * 5 * m.config.num_hidden_layers, t.counts
    assert "reference.rotary_embedding" not in t.counts


def test_gemma3_fuses_with_offset_and_olmo2_keeps_rotary(reference_backend):
    """Gemma-3's (1 + w) norms fuse (weight_offset 1); OLMo-2's norms span the whole projection: rotary alone."""
    for cfg, cls, kw, op in (("Gemma3TextConfig", "Gemma3ForCausalLM", {"sliding_window": 8}, "qk_norm_rotary"),
                             ("Olmo2Config", "Olmo2ForCausalLM", {}, "rotary_embedding")):
        m = _tiny_hf(cfg, cls, **kw)
        x = _ids(2, 11)
        with torch.no_grad():
            ref = m(**x).logits
        conv = opsadv.convert_model(copy.deepcopy(m), backend="reference", example_inputs=x)
        with opsadv.trace() as t, torch.no_grad():
            out = conv(**x).logits
        assert t.counts.get(f"reference.{op}") == 2 and len(t.counts & _ROPE_OPS) == 1, (cls, t.counts)
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)


def test_compiled_qwen3_with_fused_norms_is_one_graph(reference_backend):
    import torch._dynamo
    m = Z.build("qwen3", "tiny")
    x = Z.inputs("qwen3", m.config, 2, 7)
    conv = _convert(copy.deepcopy(m), x)
    try:
        with torch.no_grad(), opsadv.trace() as t:
            got = torch.compile(conv, fullgraph=True, backend="aot_eager")(**x).logits
    finally:
        torch._dynamo.reset()
    assert t.counts["reference.qk_norm_rotary"] == m.config.num_hidden_layers, t.counts
    with torch.no_grad():
        torch.testing.assert_close(got, m(**x).logits, rtol=1e-4, atol=1e-5)
