"""convert_model's lm_loss rewrite (opsadv.convert.lm_loss): a causal LM in training mode with labels computes its loss
with opsadv.ops.linear_cross_entropy from the final hidden states and returns logits=None; the loss and every
parameter's gradient match the unconverted model's (ForCausalLMLoss: shift, ignore_index, mean or sum /
num_items_in_batch, shift_labels, Gemma-2's final logit softcap); eval mode and calls without labels are unchanged;
torch.compile, deepcopy, exceptions, undo, rewrites={'lm_loss': False} and the models it cannot reach."""
import copy

import pytest
import torch

import opsadv
from opsadv.convert import lm_loss as L, passes
from opsadv.convert.api import build_policy
from opsadv.convert.report import ConversionReport
from opsadv.core.precision import PrecisionPolicy
from opsadv.errors import InvalidArgumentError

tf = pytest.importorskip("transformers")

from opsadv.bench import model_zoo as Z  # noqa: E402

ARCHS = ["llama3", "qwen2", "gemma2", "mistral"]     # (qwen2, gemma2, llama3: tied embeddings; gemma2: softcap 30)
_models: dict = {}


def _orig(arch):
    if arch not in _models:
        _models[arch] = Z.build(arch, "tiny", train=True)
    return copy.deepcopy(_models[arch])


def _batch(cfg, b, s, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (b, s), generator=g)
    labels = ids.clone()
    labels[torch.rand(b, s, generator=g) < 0.25] = -100
    am = torch.ones(b, s, dtype=torch.long)
    if b > 1:
        am[-1, s - 4:] = 0
        labels[-1, s - 4:] = -100
    return {"input_ids": ids, "attention_mask": am}, labels


def _convert(model, **kw):
    x, _ = _batch(model.config, 2, 9, seed=5)
    return opsadv.convert_model(model, backend="reference", example_inputs=x, **kw)


def _grads_match(a, b, tol=1e-4):
    g = Z.grad_errors(a, b)
    assert g["params"] == sum(1 for p in a.parameters() if p.grad is not None) > 0
    assert not g["missing"] and g["max_rel_err"] < tol, g


def _rel(a, b):
    return abs(a.item() - b.item()) / abs(b.item())


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("batch", [1, 3])
def test_training_loss_and_gradients_match(arch, batch):
    orig = _orig(arch)
    conv = _convert(copy.deepcopy(orig)).train()
    assert any(c.kind == "fused" and "linear_cross_entropy" in c.what for c in conv.opsadv_report.changes)
    x, labels = _batch(orig.config, batch, 13)
    ref = orig(**x, labels=labels)
    ref.loss.backward()
    with opsadv.trace() as t:
        out = conv(**x, labels=labels)
    out.loss.backward()
    assert out.logits is None and out.loss.dtype == torch.float32 and out.loss.dim() == 0
    assert "reference.linear_cross_entropy" in t.counts, t.counts
    assert _rel(out.loss, ref.loss) < 1e-5
    _grads_match(orig, conv)
    assert conv._opsadv_lm_loss.calls == []


def test_triton_kernel_through_the_seam():
    """The cuda backend's Triton kernel (the interpreter; tf32 GEMM policy as on a GPU) with Gemma-2's softcap."""
    orig = _orig("gemma2")
    x, labels = _batch(orig.config, 3, 13)
    conv = opsadv.convert_model(copy.deepcopy(orig), backend="cuda", example_inputs=x,
                                precision=PrecisionPolicy(matmul="tf32", attention="fp16")).train()
    with opsadv.trace() as t:
        out = conv(**x, labels=labels)
    out.loss.backward()
    ref = orig(**x, labels=labels)
    ref.loss.backward()
    assert "cuda.triton.linear_cross_entropy" in t.counts, t.counts
    assert out.logits is None and _rel(out.loss, ref.loss) < 1e-4
    _grads_match(orig, conv, tol=1e-2)


@pytest.mark.parametrize("arch", ["llama3", "gemma2"])
def test_eval_and_unlabelled_calls_unchanged(arch):
    orig = _orig(arch).eval()
    conv = _convert(copy.deepcopy(orig)).eval()
    x, labels = _batch(orig.config, 2, 11)
    with torch.no_grad():
        ref, got = orig(**x, labels=labels), conv(**x, labels=labels)
        torch.testing.assert_close(got.logits, ref.logits, rtol=1e-4, atol=1e-5)
        assert _rel(got.loss, ref.loss) < 1e-5
        conv.train()
        orig.train()
        plain = conv(**x)                           # training without labels: logits, no loss
        assert plain.loss is None and plain.logits.shape == ref.logits.shape
        torch.testing.assert_close(plain.logits, orig(**x).logits, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("arch", ["llama3", "gemma2"])
def test_num_items_in_batch_shift_labels_and_logits_to_keep(arch):
    orig = _orig(arch)
    conv = _convert(copy.deepcopy(orig)).train()
    x, labels = _batch(orig.config, 3, 12, seed=3)
    g = torch.Generator().manual_seed(9)
    shift = torch.randint(0, orig.config.vocab_size, labels.shape, generator=g)
    shift[:, -3:] = -100
    calls = [dict(labels=labels, num_items_in_batch=torch.tensor(17)), dict(labels=labels, num_items_in_batch=40),
             dict(labels=labels, shift_labels=shift), dict(labels=labels, shift_labels=shift, num_items_in_batch=11),
             dict(labels=labels, shift_labels=shift[:, -4:].contiguous(), logits_to_keep=4),
             dict(labels=labels.masked_fill(labels == -100, -1), ignore_index=-1)]
    for kw in calls:
        for m in (orig, conv):
            m.zero_grad(set_to_none=True)
        ref = orig(**x, **kw)
        ref.loss.backward()
        out = conv(**x, **kw)
        out.loss.backward()
        assert out.logits is None
        assert _rel(out.loss, ref.loss) < 1e-5, kw
        _grads_match(orig, conv)


def test_tuple_output_and_positional_labels():
    orig = _orig("llama3")
    conv = _convert(copy.deepcopy(orig)).train()
    x, labels = _batch(orig.config, 2, 10)
    ref = orig(**x, labels=labels, return_dict=False)
    out = conv(**x, labels=labels, return_dict=False)
    assert isinstance(out, tuple) and out[0].dim() == 0 and _rel(out[0], ref[0]) < 1e-5
    assert len(out) == len(ref) - 1                                # (loss, logits, ...) -> (loss, ...)
    pos = conv(x["input_ids"], x["attention_mask"], None, None, None, labels)
    assert pos.logits is None and _rel(pos.loss, ref[0]) < 1e-5


def test_compiled_training_step():
    """torch.compile(converted, fullgraph=True) with aot_eager: the fused loss inside the graph, loss and gradients
    as the unconverted model's; then Inductor (CPU codegen) without fullgraph."""
    import torch._dynamo
    orig = _orig("llama3")
    conv = _convert(copy.deepcopy(orig)).train()
    x, labels = _batch(orig.config, 2, 16)
    ref = orig(**x, labels=labels)
    ref.loss.backward()
    try:
        with opsadv.trace() as t:
            out = torch.compile(conv, backend="aot_eager", fullgraph=True)(**x, labels=labels)
            out.loss.backward()
        assert out.logits is None and _rel(out.loss, ref.loss) < 1e-5
        assert "reference.linear_cross_entropy" in t.counts, t.counts
        _grads_match(orig, conv)
        conv.zero_grad(set_to_none=True)
        ids = x["input_ids"]
        loss = torch.compile(conv)(ids, labels=ids).loss
        loss.backward()
        assert _rel(loss, orig(ids, labels=ids).loss) < 1e-5
        assert conv._opsadv_lm_loss.calls == []
    finally:
        torch._dynamo.reset()


def test_autocast_runs_the_head_in_the_autocast_dtype():
    orig = _orig("qwen2")
    conv = _convert(copy.deepcopy(orig)).train()
    x, labels = _batch(orig.config, 2, 9)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = orig(**x, labels=labels)
        out = conv(**x, labels=labels)
    out.loss.backward()
    assert out.logits is None and _rel(out.loss, ref.loss) < 2e-2
    assert all(p.grad is None or p.grad.dtype == torch.float32 for p in conv.parameters())


def test_deepcopy_exceptions_and_reentry():
    orig = _orig("mistral")
    conv = _convert(copy.deepcopy(orig)).train()
    twin = copy.deepcopy(conv)
    seam, seam2 = conv._opsadv_lm_loss, twin._opsadv_lm_loss
    assert seam2 is not seam and seam2.state is twin._opsadv_state
    x, labels = _batch(orig.config, 2, 9)
    a, b = conv(**x, labels=labels), twin(**x, labels=labels)
    assert a.logits is None and b.logits is None and _rel(a.loss, b.loss) < 1e-6
    with pytest.raises(InvalidArgumentError, match="labels"):     # labels of another length: the op refuses
        conv(**x, labels=labels[:, :5])
    assert seam.calls == []                                         # the failed call's state is gone
    assert conv(**x).logits is not None and conv(**x, labels=labels).logits is None
    inner = []                         # re-entered: the model called (without labels) inside its own forward

    def reenter(mod, args, kwargs, out):
        if not inner:
            inner.append(None)
            inner[0] = conv(**x)
    h = conv.model.register_forward_hook(reenter, with_kwargs=True)
    try:
        out = conv(**x, labels=labels)
    finally:
        h.remove()
    assert inner[0].logits is not None and out.logits is None and _rel(out.loss, a.loss) < 1e-6
    assert seam.calls == []


@pytest.mark.parametrize("arch", ["llama3", "mistral"])          # tied / untied embeddings
@pytest.mark.parametrize("copied", [False, True])
def test_new_tokens_after_conversion_keep_the_fused_loss(arch, copied):
    """resize_token_embeddings (a chat template's new tokens) replaces lm_head with a larger Linear: the loss follows
    it, and a new token's label is scored against its own row."""
    orig = _orig(arch)
    conv = _convert(copy.deepcopy(orig))
    if copied:
        conv = copy.deepcopy(conv)
    old_head, vocab = conv.lm_head, orig.config.vocab_size + 5
    for m in (orig, conv):
        m.resize_token_embeddings(vocab, mean_resizing=False)
        m.train()
    assert (conv.lm_head is old_head) == (arch == "llama3")     # tied: transformers re-ties the same module
    with torch.no_grad():
        conv.lm_head.weight.copy_(orig.lm_head.weight)
        conv.get_input_embeddings().weight.copy_(orig.get_input_embeddings().weight)
    x, labels = _batch(orig.config, 2, 11)
    x["input_ids"][0, 4] = labels[0, 4] = vocab - 2           # a new token, as input and label
    ref = orig(**x, labels=labels)
    ref.loss.backward()
    with opsadv.trace() as t:
        out = conv(**x, labels=labels)
    out.loss.backward()
    assert out.logits is None and "reference.linear_cross_entropy" in t.counts, t.counts
    assert _rel(out.loss, ref.loss) < 1e-5
    _grads_match(orig, conv)
    assert conv.lm_head is old_head or not old_head._forward_pre_hooks


def _patch_like_trl(model):
    """What TRL's SFTTrainer does to the instance after conversion: a forward that, with fused_lm_head=True, runs
    the backbone and scores the labels against lm_head's weight itself (it needs the labels), else the original."""
    original = model.forward

    def forward(*args, fused_lm_head=False, labels=None, **kwargs):
        if not fused_lm_head:
            return original(*args, labels=labels, **kwargs)
        hidden = model.model(*args, **kwargs).last_hidden_state[:, :-1]
        logits = hidden @ model.get_output_embeddings().weight.T
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels[:, 1:].flatten())
        return tf.modeling_outputs.CausalLMOutput(loss=loss)
    model.forward = forward


def test_a_forward_replaced_after_conversion_keeps_its_arguments_and_labels():
    """A call with arguments the model's forward does not take (TRL's fused_lm_head) is left to the forward that
    replaced it, labels included, and counted; a call without them still takes the fused loss."""
    orig = _orig("llama3")
    conv = _convert(copy.deepcopy(orig))
    for m in (orig, conv):
        _patch_like_trl(m)
        m.train()
    x, labels = _batch(orig.config, 2, 11)
    ref = orig(**x, labels=labels, fused_lm_head=True)
    ref.loss.backward()
    with opsadv.trace() as t:
        out = conv(**x, labels=labels, fused_lm_head=True)
    out.loss.backward()
    assert "reference.linear_cross_entropy" not in t.counts and _rel(out.loss, ref.loss) < 1e-5
    _grads_match(orig, conv)
    assert any("fused_lm_head" in k for k in conv._opsadv_state.fallbacks), conv._opsadv_state.fallbacks
    for m in (orig, conv):
        m.zero_grad(set_to_none=True)
    ref = orig(**x, labels=labels)
    ref.loss.backward()
    with opsadv.trace() as t:
        out = conv(**x, labels=labels)
    out.loss.backward()
    assert "reference.linear_cross_entropy" in t.counts and _rel(out.loss, ref.loss) < 1e-5
    _grads_match(orig, conv)
    assert conv._opsadv_lm_loss.calls == []


def test_rewrites_off_and_undo():
    orig = _orig("llama3")
    x, labels = _batch(orig.config, 2, 9)
    off = _convert(copy.deepcopy(orig), rewrites={"lm_loss": False}).train()
    out = off(**x, labels=labels)
    assert out.logits is not None and L.seam_of(off) is None
    assert any(c.kind == "kept" and "rewrites={'lm_loss': False}" in c.reason for c in off.opsadv_report.changes)
    with pytest.raises(InvalidArgumentError, match="rewrites"):
        opsadv.convert_model(copy.deepcopy(orig), rewrites={"loss": False})
    # the pass's undo log: hooks and the seam gone, logits and loss as before
    m = copy.deepcopy(orig).train()
    undo, report = passes.Undo(), ConversionReport("m", 2, "reference", "fp32")
    assert L.lm_loss_pass(m, report, undo, build_policy("reference", PrecisionPolicy(), 2, None, None, None))
    assert m(**x, labels=labels).logits is None
    undo.revert()
    assert L.seam_of(m) is None and not m._forward_pre_hooks and not m._forward_hooks
    assert not m.lm_head._forward_pre_hooks
    back = m(**x, labels=labels)
    assert back.logits is not None and _rel(back.loss, orig.train()(**x, labels=labels).loss) < 1e-6


def test_refused_conversion_leaves_no_hooks(monkeypatch):
    from opsadv.convert import validate as _val
    m = _orig("qwen2")
    monkeypatch.setitem(_val.REL_LIMIT, torch.float32, -1.0)       # validation refuses every conversion
    with pytest.raises(opsadv.convert.ValidationError):
        _convert(m)
    assert L.seam_of(m) is None and not m._forward_pre_hooks and not m._forward_hooks
    x, labels = _batch(m.config, 2, 9)
    assert m.train()(**x, labels=labels).logits is not None


def test_floor_times_lm_loss_in_train_mode_only():
    orig = _orig("llama3")
    x, _ = _batch(orig.config, 2, 9)

    def timer(fn):
        fn()
        return 1.0
    inf = opsadv.convert_model(copy.deepcopy(orig), backend="reference", floor=True, floor_timer=timer,
                               floor_inputs=x)
    assert "lm_loss" not in {d["kind"] for d in inf.opsadv_report.floor} and L.seam_of(inf) is not None
    assert any("lm_loss not timed" in n for n in inf.opsadv_report.notes)
    tr = opsadv.convert_model(copy.deepcopy(orig), backend="reference", floor=True, floor_timer=timer,
                              floor_inputs=x, floor_mode="train")
    d = next(d for d in tr.opsadv_report.floor if d["kind"] == "lm_loss")       # (equal times: kept)
    assert d["kept"] and L.seam_of(tr) is not None
    m = copy.deepcopy(orig)

    def slower(fn):                    # the fused loss measured slower: undone, hooks and all
        fn()
        return 2.0 if L.seam_of(m) is not None else 1.0
    slow = opsadv.convert_model(m, backend="reference", floor=True, floor_timer=slower, floor_inputs=x,
                                floor_mode="train")
    d = next(d for d in slow.opsadv_report.floor if d["kind"] == "lm_loss")
    assert not d["kept"] and L.seam_of(slow) is None and not slow._forward_hooks and not slow.lm_head._forward_pre_hooks
    assert any(c.kind == "kept" and c.what == L.LABEL for c in slow.opsadv_report.changes)
    _, labels = _batch(orig.config, 2, 9)
    assert slow.train()(**x, labels=labels).logits is not None


def _report_of(model):
    undo, report = passes.Undo(), ConversionReport("m", 2, "reference", "fp32")
    ok = L.lm_loss_pass(model, report, undo, build_policy("reference", PrecisionPolicy(), 2, None, None, None))
    return ok, [c for c in report.changes if c.kind == "skipped"]


def _tiny_cfg(cls, **kw):
    return cls(**{**dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=97, max_position_embeddings=64), **kw})


def test_models_it_cannot_reach_are_reported_with_the_reason():
    torch.manual_seed(0)
    custom = tf.LlamaForCausalLM(_tiny_cfg(tf.LlamaConfig))
    custom.loss_type = "ForMaskedLM"
    no_head = tf.LlamaForCausalLM(_tiny_cfg(tf.LlamaConfig))
    no_head.lm_head = torch.nn.Sequential(no_head.lm_head)         # not a Linear: its weight is not at hand
    cases = [(custom, "loss_type 'ForMaskedLM'"),
             (tf.MixtralForCausalLM(_tiny_cfg(tf.MixtralConfig, num_local_experts=2, num_experts_per_tok=1)),
              "auxiliary loss"),
             (tf.CohereForCausalLM(_tiny_cfg(tf.CohereConfig, logit_scale=0.25)), "differs from the model's own"),
             (no_head, "no lm_head nn.Linear")]
    for model, why in cases:
        ok, skipped = _report_of(model)
        assert not ok and len(skipped) == 1 and why in skipped[0].reason, (type(model).__name__, skipped)
        assert L.seam_of(model) is None and not model._forward_pre_hooks and not model._forward_hooks
    bert = tf.BertForSequenceClassification(tf.BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                                          intermediate_size=64, vocab_size=97))
    for model in (tf.LlamaModel(_tiny_cfg(tf.LlamaConfig)), bert):  # no labels / a classifier's: nothing to say
        ok, skipped = _report_of(model)
        assert not ok and not skipped
    custom.loss_type = "ForCausalLM"                 # a loss changed after conversion is honoured per call
    ok, _ = _report_of(custom)
    custom.train()
    x, labels = _batch(custom.config, 2, 7)
    assert ok and custom(**x, labels=labels).logits is None
    custom.loss_function = lambda logits, labels, vocab_size, **kw: logits.float().mean()
    out = custom(**x, labels=labels)
    assert out.logits is not None and torch.equal(out.loss, out.logits.float().mean())
