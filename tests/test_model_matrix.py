"""The model matrix (issue 34) on a CPU: every architecture of opsadv.bench.model_zoo at "tiny" converts on the
reference backend and validates; a training step of the converted model gives the original's loss and every
parameter's gradient; torch.compile of a converted model runs a training step; Liger's module-level patches
stay inside the Liger peer's calls; the models suite's cells construct, the runner's baseline ratios, the
heatmap and the headline table.  No timing is asserted (the floor is off here, conftest.py)."""
import copy
import json

import pytest
import torch

import opsadv

transformers = pytest.importorskip("transformers")

from opsadv.bench import model_zoo as Z  # noqa: E402
from opsadv.convert.modules import FusedSwiGLUMLP, LinearAct, NamedGatedMLP, QKVProjection, SwiGLUMLP  # noqa: E402

ARCHS = list(Z.ZOO)


def _tiny(arch, train=False):
    m = Z.build(arch, "tiny", train=train)
    return m, Z.inputs(arch, m.config, 2, 16, padded=True, labels=train)


def _convert(model, x):
    return opsadv.convert_model(model, backend="reference", validate=True, example_inputs=Z.without_labels(x))


def _primary(out):
    return out.logits if getattr(out, "logits", None) is not None else out.last_hidden_state


def test_zoo_catalogue():
    assert len(Z.ZOO) >= 11
    assert {e.kind for e in Z.ZOO.values()} == set(Z.KINDS)
    for e in Z.ZOO.values():
        assert set(e.sizes) == set(Z.SIZES) | ({"8b-4l"} if e.name == "llama3" else set()), e.name
        assert e.like.get("0.5b") and e.like.get("1.5b"), e.name
    q = Z.spec("qwen2").config_kwargs("0.5b")
    assert (q["hidden_size"], q["num_hidden_layers"], q["num_attention_heads"], q["num_key_value_heads"],
            q["intermediate_size"], q["vocab_size"]) == (896, 24, 14, 2, 4864, 151936)
    assert q["tie_word_embeddings"]
    # the real sizes build (on the meta device: no memory) at about their parameter counts
    for arch, size, lo, hi in (("qwen2", "0.5b", 0.45, 0.55), ("qwen2", "1.5b", 1.4, 1.7), ("gpt2", "1.5b", 1.5, 1.6)):
        n = Z.n_params(Z.build(arch, size, "meta")) / 1e9
        assert lo < n < hi, (arch, size, n)


def test_every_model_gets_its_own_config():
    a, b = Z.build("llama3", "tiny"), Z.build("llama3", "tiny")
    assert a.config is not b.config
    c = Z.build("llama3", "tiny", config=a.config)
    assert c.config is not a.config and c.config.hidden_size == a.config.hidden_size
    opsadv.convert_model(a, backend="reference")
    assert b.config._attn_implementation == "sdpa"


def test_inputs_per_kind():
    cfg = Z.make_config("llama3", "tiny")
    x = Z.causal_inputs(cfg, 4, 40, pad_tokens=10, labels=True)
    assert int(x["attention_mask"].sum()) == 4 * 40 - 10
    assert (x["labels"][-1, -10:] == -100).all() and (x["labels"][:3] != -100).all()
    assert "attention_mask" not in Z.causal_inputs(cfg, 2, 8)
    e = Z.encoder_inputs(Z.make_config("bert", "tiny"), 32, 64)
    assert 0.2 < 1 - e["attention_mask"].float().mean().item() < 0.4          # ~30% right padding
    am = e["attention_mask"]
    assert (am[:, 1:] <= am[:, :-1]).all()                                    # right padding only
    s = Z.inputs("t5", Z.make_config("t5", "tiny"), 2, 16, dec_seq=6, labels=True)
    assert s["decoder_input_ids"].shape == s["labels"].shape == (2, 6)
    assert (s["decoder_input_ids"][:, 1:] == s["labels"][:, :-1]).all()       # the right shift
    v = Z.inputs("vit", Z.make_config("vit", "tiny"), 3, 0, labels=True)
    assert v["pixel_values"].shape == (3, 3, 32, 32) and v["labels"].shape == (3,)


@pytest.mark.parametrize("arch", ARCHS)
def test_tiny_converts_and_validates(arch, reference_backend):
    orig, x = _tiny(arch)
    conv = _convert(copy.deepcopy(orig), x)
    rep = conv.opsadv_report
    assert rep.validation["passed"] and rep.validation["rel_err"] < 1e-5, str(rep)
    assert rep.count("attention") == 1 and conv.config._attn_implementation == "opsadv", str(rep)
    assert sorted(conv.state_dict()) == sorted(orig.state_dict())
    with opsadv.trace() as t, torch.no_grad():
        a, b = _primary(orig(**x)), _primary(conv(**x))
    if arch == "gemma2":             # softcapping: no opsadv kernel, the model's own attention, counted
        assert any("softcap" in k for k in conv._opsadv_state.fallbacks), conv._opsadv_state.fallbacks
    else:
        assert any("attention" in k for k in t.counts), t.counts
    if arch == "mistral":            # its sliding window (8 < 16 tokens): causal + window sparse_attention, no dense mask
        assert t.counts.get("reference.sparse_attention") == conv.config.num_hidden_layers, t.counts
        assert "reference.flash_attention" not in t.counts and not conv._opsadv_state.fallbacks, t.counts
        assert "sliding-window layers (window 8)" in str(rep)
    if arch == "modernbert":         # local layers: bidirectional window + key padding sparse_attention, no dense mask
        assert t.counts.get("reference.sparse_attention") == conv.config.num_hidden_layers, t.counts
        assert "reference.flash_attention" not in t.counts and not conv._opsadv_state.fallbacks, t.counts
    if arch == "bart":               # encoder self-attention and cross-attention over the padded encoder: key padding
        assert t.counts.get("reference.sparse_attention") == 4, t.counts     # (2 encoder + 2 cross-attention layers)
    am = x.get("attention_mask")
    keep = am.bool() if am is not None and a.shape[:2] == am.shape else torch.ones(a.shape[:2], dtype=torch.bool)
    assert torch.allclose(a[keep], b[keep], rtol=1e-4, atol=1e-5)
    kinds = {type(m) for m in conv.modules()}
    text = str(rep)
    if arch == "phi3":               # the fused gate_up_proj MLP: converted over its own weight
        assert FusedSwiGLUMLP in kinds and "gate_up_proj" in text
    if arch in ("llama3", "qwen2", "qwen3", "mistral"):
        assert {SwiGLUMLP, QKVProjection} <= kinds
    if arch in ("gpt_neox", "vit", "gpt2", "bert"):
        assert LinearAct in kinds
    if arch == "gemma2":             # GeGLU (gelu_pytorch_tanh): linear over [W_gate|W_up] + swiglu(gelu_tanh)
        mlps = [m for m in conv.modules() if isinstance(m, SwiGLUMLP)]
        assert mlps and all(m.activation == "gelu_tanh" for m in mlps), kinds
        assert "GeGLU MLP" in text
        assert any(k == "reference.swiglu" for k in t.counts), t.counts
    if arch == "t5":                 # T5's gated GELU (wi_0, wi_1): GeGLU over [W_wi_0|W_wi_1], names kept
        assert "T5 gated GeGLU MLP (wi_0, wi_1, wo)" in text and NamedGatedMLP in kinds
        assert any(k == "reference.swiglu" for k in t.counts), t.counts
    if arch == "t5":                 # self-attention fused, cross-attention left alone with the reason
        assert "cross-attention" in text and QKVProjection in kinds
    assert "0 layers" not in text


@pytest.mark.parametrize("arch", ARCHS)
def test_tiny_training_step_matches(arch, reference_backend):
    # (backward ops resolve under the policy in force at .backward(): the reference backend too)
    orig, x = _tiny(arch, train=True)
    conv = _convert(copy.deepcopy(orig), x).train()
    lo = orig(**x).loss
    lo.backward()
    lc = conv(**x).loss
    lc.backward()
    assert abs(lo.item() - lc.item()) <= 1e-5 * abs(lo.item())
    g = Z.grad_errors(orig, conv)
    assert g["params"] == sum(1 for p in orig.parameters() if p.grad is not None) > 0
    assert not g["missing"], g
    assert g["max_rel_err"] < 1e-4, g


@pytest.mark.parametrize("arch", ARCHS)
def test_compiled_training_step_every_architecture(arch, reference_backend):
    """torch.compile(converted) (aot_eager: dynamo and AOT autograd through the ops' registered autograd and backward
    ops; Inductor's codegen is test_compiled_converted_training_step's) forward + backward on a padded batch: loss and
    every parameter's gradient as the unconverted model's, T5's relative attention bias included (its gradient
    reaches it through the attention mask).  Padded causal batches run the key-padding kernels (own backward)."""
    import torch._dynamo
    orig, x = _tiny(arch, train=True)
    conv = _convert(copy.deepcopy(orig), x).train()
    orig.train()
    if getattr(conv, "loss_type", "") is None:   # GPT-2: transformers logs its default loss (a graph break) without it
        conv.loss_type = "ForCausalLM"
    try:
        compiled = torch.compile(conv, backend="aot_eager", fullgraph=True)
        with opsadv.trace() as t:
            loss = compiled(**x).loss
            loss.backward()
    finally:
        torch._dynamo.reset()
    ref = orig(**x).loss
    ref.backward()
    assert abs(loss.item() - ref.item()) <= 1e-5 * abs(ref.item())
    g = Z.grad_errors(orig, conv)
    assert g["params"] == sum(1 for p in orig.parameters() if p.grad is not None) > 0
    assert not g["missing"] and g["max_rel_err"] < 1e-4, g
    assert t.counts, "no opsadv op ran inside the compiled step"
    if Z.spec(arch).kind == "causal" and arch != "gemma2":   # (softcapping: the model's own attention)
        assert "reference.sparse_attention" in t.counts, t.counts     # mistral's window too (causal + window layout)


@pytest.mark.xdist_group("model_matrix_compile")
@pytest.mark.parametrize("arch", ["bert"])
def test_compiled_training_step_cuda_kernels(arch):
    """The same compiled step with the cuda backend's Triton kernels (the interpreter; fp32 in, tf32 GEMMs, fp16
    attention) on an encoder's key padding (llama3's: test_compiled_converted_training_step_is_one_graph)."""
    import torch._dynamo
    orig, x = _tiny(arch, train=True)
    conv = _convert_for(orig, x, "cuda").train()
    orig.train()
    try:
        compiled = torch.compile(conv, backend="aot_eager", fullgraph=True)
        with opsadv.trace() as t:
            loss = compiled(**x).loss
            loss.backward()
    finally:
        torch._dynamo.reset()
    ref = orig(**x).loss
    ref.backward()
    assert abs(loss.item() - ref.item()) <= 1e-3 * abs(ref.item())
    g = Z.grad_errors(orig, conv)
    assert not g["missing"] and g["max_rel_err"] < 5e-2, g
    assert _impl_backends(t.counts) == {"cuda"}, t.counts


def test_grad_errors_floor_and_missing():
    a, b = torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)
    b.load_state_dict(a.state_dict())
    a.weight.grad, b.weight.grad = torch.ones(3, 4), torch.ones(3, 4) * (1 + 1e-3)
    a.bias.grad, b.bias.grad = torch.full((3,), 1e-12), torch.full((3,), 3e-12)   # zero in exact arithmetic
    g = Z.grad_errors(a, b)
    assert g["worst"] == "weight" and g["max_rel_err"] == pytest.approx(1e-3, rel=1e-3)
    b.bias.grad = None
    g = Z.grad_errors(a, b)
    assert g["missing"] == ["bias"] and g["max_rel_err"] == float("inf")


@pytest.mark.xdist_group("model_matrix_compile")
def test_compiled_converted_training_step(reference_backend):
    """torch.compile(converted model): forward + backward + AdamW step, loss and gradients as eager."""
    import torch._dynamo
    orig, x = _tiny("llama3", train=True)
    conv = _convert(copy.deepcopy(orig), x).train()
    compiled = torch.compile(conv)
    opt = torch.optim.AdamW(conv.parameters(), lr=1e-6)
    try:
        with opsadv.trace() as t:
            loss = compiled(**x).loss
            loss.backward()
        ref = orig(**x).loss
        ref.backward()
        assert abs(loss.item() - ref.item()) <= 1e-5 * abs(ref.item())
        g = Z.grad_errors(orig, conv)
        assert not g["missing"] and g["max_rel_err"] < 1e-4, g
        assert t.counts, "no opsadv op ran inside the compiled step"
        opt.step()
        opt.zero_grad(set_to_none=True)
        assert torch.isfinite(compiled(**x).loss)
    finally:
        torch._dynamo.reset()


# ---- Liger's patches stay inside its peer's calls --------------------------------------------------------
def test_liger_globals_isolated_with_a_fake_module():
    import types

    from opsadv.bench.liger_peer import apply_isolated

    def rope(q):
        return q

    class Norm:
        pass

    mod = types.ModuleType("fake_modeling")
    mod.apply_rotary_pos_emb, mod.Norm, mod.untouched = rope, Norm, 7

    class Model:
        def __init__(self):
            self.forward = "original"

    def fake_apply(model=None):            # what apply_liger_kernel_to_* does: module globals and the instance
        mod.apply_rotary_pos_emb = lambda q: q * 2
        mod.Norm = type("LigerNorm", (), {})
        mod.added = "new import"
        model.forward = "liger"

    m = Model()
    patch = apply_isolated(fake_apply, m, namespaces=[mod])
    assert mod.apply_rotary_pos_emb is rope and mod.Norm is Norm and mod.untouched == 7   # restored at once
    assert m.forward == "liger" and mod.added == "new import"                              # instance / additions
    assert sorted(patch.names()) == ["fake_modeling.Norm", "fake_modeling.apply_rotary_pos_emb"]
    with patch:
        assert mod.apply_rotary_pos_emb(3) == 6 and mod.Norm.__name__ == "LigerNorm"
    assert mod.apply_rotary_pos_emb is rope and mod.Norm is Norm

    def failing(model=None):
        mod.Norm = None
        raise RuntimeError("unsupported transformers version")

    with pytest.raises(RuntimeError):
        apply_isolated(failing, m, namespaces=[mod])
    assert mod.Norm is Norm


def test_liger_patch_leaves_other_models_alone():
    pytest.importorskip("liger_kernel")
    import sys

    from opsadv.bench.liger_peer import apply_isolated, liger_apply_fn
    base = Z.build("qwen2", "tiny")
    modeling = sys.modules[type(base).__module__]
    before = dict(vars(modeling))
    lig = copy.deepcopy(base)
    patch = apply_isolated(liger_apply_fn(Z.spec("qwen2").liger), lig)
    assert patch and "apply_rotary_pos_emb" in " ".join(patch.names())
    assert all(vars(modeling).get(k) is v for k, v in before.items())     # the module as it was
    assert type(base.model.norm).__name__ == "Qwen2RMSNorm"
    assert "forward" in vars(lig) and "forward" not in vars(base)          # the Liger copy itself is patched
    with patch:
        assert modeling.apply_rotary_pos_emb is not before["apply_rotary_pos_emb"]
    assert modeling.apply_rotary_pos_emb is before["apply_rotary_pos_emb"]


# ---- the suite, the runner's baseline, the plots -----------------------------------------------------------
def test_models_suite_quick_cases_construct():
    from opsadv.bench import runner, suite_models as S
    from opsadv.cli import build_parser
    assert "models" in runner.SUITES
    args = build_parser().parse_args(["bench", "--suite", "models", "--part", "1/8", "--json", "x.json"])
    assert args.suite == "models" and args.part == "1/8"
    cases = list(S.cases(True))
    names = [c.case for c in cases]
    assert len(names) == len(set(names)) and {c.extra["arch"] for c in cases} == set(Z.ZOO)
    for c in cases:
        assert c.suite == "models" and c.baseline in c.peers and c.calls and c.setup is not None
        assert c.baseline == ("hf_compile" if c.case.endswith(" compiled") else
                              "hf_static_compile" if " paged " in c.case else "unconverted")
        assert ("liger" in c.peers) == (bool(Z.spec(c.extra["arch"]).liger) and not c.case.endswith(" compiled"))
    full = S.cells(False)
    assert len(full) > 250 and all(c.size in ("0.5b", "1.5b") for c in full if c.size != S.LM_LOSS_SIZE)
    lm = [c for c in full if c.size == S.LM_LOSS_SIZE]         # the causal-LM loss cell, GPU only
    assert [c.name for c in lm] == ["train bf16 b4 s2048 llama3 8b-4l"] and S.LM_LOSS_SIZE in S.GPU_ONLY_SIZES
    cfg = Z.make_config("llama3", S.LM_LOSS_SIZE)
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size, cfg.vocab_size,
            cfg.num_hidden_layers, cfg.tie_word_embeddings) == (4096, 32, 8, 14336, 128256, 4, False)
    assert 1.9 < Z.n_params(Z.build("llama3", S.LM_LOSS_SIZE, "meta")) / 1e9 < 2.0
    if not torch.cuda.is_available():                          # left out on a CPU, not an error row
        assert not any(c.extra["size"] == S.LM_LOSS_SIZE for c in S.cases(False))
    assert "train bf16 b4 s2048 padded llama3 1.5b" in {c.name for c in full}
    assert "decode bf16 b1 new128 static mistral 0.5b" in {c.name for c in full}
    assert "prefill bf16 b8 s2048 qwen2 0.5b compiled" in {c.name for c in full}
    packed = [c.name for c in full if c.packed]                     # one per causal architecture and size
    assert {"train bf16 b1 s8192 packed llama3 0.5b", "train bf16 b1 s8192 packed llama3 0.5b compiled"} <= set(packed)
    assert len(packed) == 2 * sum(2 for e in Z.ZOO.values() if e.kind == "causal")
    pad = next(c for c in full if c.name == "train bf16 b4 s2048 padded llama3 1.5b")
    assert pad.pad_tokens == 300
    fp8 = [c.name for c in full if c.dtype == "fp8"]               # convert_model(precision="fp8"), GPU only
    assert fp8 == ["prefill fp8 b8 s2048 llama3 1.5b", "train fp8 b4 s2048 llama3 1.5b",
                   "prefill fp8 b8 s2048 llama3 1.5b compiled", "train fp8 b4 s2048 llama3 1.5b compiled"]
    if not torch.cuda.is_available():
        assert not any("fp8" in c.extra["mode"] for c in S.cases(False))


@pytest.mark.parametrize("family", ["train", "decode"])
def test_models_case_runs_and_reports(family, reference_backend):
    """One quick cell through the runner: the row's fields (not its speed)."""
    from opsadv.bench import runner, suite_models as S
    cell = (S.Cell("qwen2", "tiny", "train", 2, 16, padded=True, pad_tokens=4, dtype="fp32") if family == "train"
            else S.Cell("qwen2", "tiny", "decode", 2, 8, cache="static", new_tokens=3, dtype="fp32"))
    try:
        rows = runner.run_case(S.make_case(cell, "cpu", torch.float32, quick=True))
    finally:
        S._free()
    r = rows[0]
    assert "error" not in r, r
    assert r["baseline"] == "unconverted" and set(r["ratios"]) == set(r["peers"]) and "unconverted" in r["peers"]
    assert r["speedup"] == r["ratios"]["unconverted"]
    assert r["arch"] == "qwen2" and r["mode"] == cell.mode and r["conversion"]
    assert r["impls"] and r["opsadv_impl"].startswith("reference.")
    if family == "train":
        assert r["mode"] == "train padded"
        assert r["grad_max_rel_err"] < 1e-4 and r["loss_rel_err"] < 1e-5 and r["rel_err"] == r["loss_rel_err"]
    else:                            # the cached decode's step logits against a no-cache forward on the same tokens
        assert r["generated_tokens"] == 3 and r["check"]["top1_agreement"] == 1.0 and r["check"]["kl"] < 1e-6
        assert r["rel_err"] == pytest.approx(r["check"]["rel_err"], rel=1e-2) and r["rel_err"] < 1e-5
    json.dumps(r)


def test_models_paged_case_runs_and_reports(reference_backend):
    """The quick grid's paged cell through the runner: the converted model's generate over opsadv.PagedKVCache
    against DynamicCache (eager) and StaticCache under generate's auto-compile (eager backend on a CPU)."""
    from opsadv.bench import runner, suite_models as S
    paged = [c for c in S.cells(True, "fp32") if c.cache == "paged"]
    assert [c.name for c in paged] == ["decode fp32 b2 new4 paged llama3 tiny"]
    full = [c.name for c in S.cells(False) if c.cache == "paged"]
    assert full == [f"decode bf16 b{b} new256 paged llama3 1.5b" for b in (1, 8, 32)]
    cfg = Z.make_config(S.PAGED_ARCH, S.PAGED_SIZE)             # Llama-3.2-1B's dimensions
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
            cfg.intermediate_size, cfg.vocab_size, cfg.tie_word_embeddings) == (2048, 16, 32, 8, 64, 8192, 128256, True)
    try:
        rows = runner.run_case(S.make_case(paged[0], "cpu", torch.float32, quick=True))
    finally:
        S._free()
    r = rows[0]
    assert "error" not in r and set(r.get("peer_errors", {})) <= {"liger"}, r     # (liger_kernel may be missing)
    assert r["unit"] == "tok/s" and r["mode"] == "decode b2 paged"
    assert r["baseline"] == "hf_static_compile" and r["speedup"] == r["ratios"]["hf_static_compile"]
    assert {"hf_static_compile", "unconverted", "opsadv_eager"} <= set(r["peers"]) <= {
        "hf_static_compile", "unconverted", "opsadv_eager", "liger"}
    # a CPU row: the static cache eagerly (graphs are CUDA's); opsadv_eager is the non-static cache's eager generate
    assert r["paged"]["static"] is True and r["paged"]["cuda_graphs"] is False and "graphs_per_generate" not in r["paged"]
    assert "eager" in r["opsadv_contender"] and "static=False" in r["opsadv_eager"]
    assert r["opsadv_rate"] == pytest.approx(2 * 4 / (r["opsadv_ms"] / 1e3), rel=1e-3)     # new tokens x batch / s
    assert r["static_compile"]["backend"] == "eager"
    layers = Z.make_config("llama3", "tiny").num_hidden_layers
    assert r["paged"]["calls_per_generate"] == {"prefill": layers, "decode": layers * 3}
    assert r["paged"]["page_size"] == 16 and r["paged"]["max_cache_len"] == 16 + 4
    assert r["paged"]["decode_kernel"].startswith("reference.") and "paged_attention" in r["opsadv_impl"]
    for peer in ("unconverted", "hf_static_compile"):           # fp32: the same greedy tokens
        assert r[f"tokens_equal_{peer}"] == 1.0 and r[f"tokens_equal_prefix_{peer}"] == 1.0
    assert r["generated_tokens"] == 4 and r["check"]["top1_agreement"] == 1.0 and r["rel_err"] < 1e-5
    json.dumps(r)


def test_paged_fields_require_graph_replays():
    """A graphed paged row (CUDA) is refused unless one generate ran the prefill eagerly and every decode step as a
    replay; the row says the counts.  (The GPU runs the real cell; the counts' bookkeeping is checked here.)"""
    from types import SimpleNamespace
    from opsadv.bench import suite_models as S
    from opsadv.runtime.graphs import GraphStats
    cell = S.Cell("llama3", "tiny", "decode", 2, 16, cache="paged", new_tokens=4, dtype="fp32")
    model = SimpleNamespace(config=SimpleNamespace(num_hidden_layers=2))
    cache = SimpleNamespace(calls={"prefill": 2, "decode": 6}, page_size=16, num_pages=4, max_cache_len=20,
                            static=True, explain=lambda: SimpleNamespace(chosen="reference.paged_attention"))
    before = GraphStats(captures=1, replays=5, eager=0)
    ok = SimpleNamespace(stats=GraphStats(captures=2, replays=8, eager=1))
    extra: dict = {}
    S._paged_fields(model, cell, cache, extra, True, ok, before)
    assert extra["paged"]["graphs_per_generate"] == {"eager": 1, "replays": 3, "captures": 1}
    assert extra["paged"]["cuda_graphs"] is True and extra["paged"]["static"] is True
    short = SimpleNamespace(stats=GraphStats(captures=2, replays=6, eager=1))
    with pytest.raises(RuntimeError, match="decode steps a replay"):
        S._paged_fields(model, cell, cache, {}, True, short, before)


def test_runner_speedup_against_the_baseline():
    from opsadv.bench import runner
    from opsadv.bench.case import BenchCase
    x = torch.ones(4)
    case = BenchCase("t", "c", lambda: x, {"fast": lambda: x, "slow": lambda: x}, 1.0, baseline="slow", calls=2,
                     rounds=2)
    r = runner.run_case(case)[0]
    assert r["baseline"] == "slow" and set(r["ratios"]) == {"fast", "slow"} and r["speedup"] == r["ratios"]["slow"]
    case = BenchCase("t", "c", lambda: x, {"fast": lambda: x, "broken": _raise}, 1.0, baseline="broken")
    r = runner.run_case(case)[0]
    assert r["baseline_missing"] and "broken" in r["peer_errors"]
    assert "ratios" not in runner.run_case(BenchCase("t", "c", lambda: x, {"p": lambda: x}, 1.0))[0]
    seen: dict = {}
    runner.time_interleaved({"a": lambda: x, "b": lambda: x}, rounds=3, per_round=seen, calls=2)
    assert [len(v) for v in seen.values()] == [3, 3]


@pytest.mark.parametrize("ours_ms, want_rounds", [([10, 10, 10.5], 3), ([10, 13, 10], 6), ([10, 10.9, 10], 3)])
def test_runner_adds_rounds_while_paired_ratios_disagree(monkeypatch, ours_ms, want_rounds):
    """Rounds whose peer / ours ratios spread by more than SPREAD get more rounds, up to max_rounds; a run that
    agrees (within 10%) keeps its rounds; one outlier keeps the spread, so that run takes every extra round.
    Times are scripted: ours as listed then 10 ms, the peer 10 ms."""
    from opsadv.bench import runner
    script = iter(ours_ms + [10.0] * 20)
    monkeypatch.setattr(runner, "calls_ms", lambda fn, calls: next(script) if fn == "o" else 10.0)
    seen: dict = {}
    runner.time_interleaved({"o": "o", "p": "p"}, rounds=3, per_round=seen, calls=1, ours="o", max_rounds=6)
    assert [len(v) for v in seen.values()] == [want_rounds, want_rounds]


def test_runner_adds_no_round_past_its_time_cap(monkeypatch):
    from opsadv.bench import runner
    script = iter([10.0, 13.0, 10.0] + [10.0] * 20)
    monkeypatch.setattr(runner, "calls_ms", lambda fn, calls: next(script) if fn == "o" else 10.0)
    monkeypatch.setattr(runner, "EXTRA_ROUNDS_S", 0.0)          # one more round would pass the cap
    seen: dict = {}
    runner.time_interleaved({"o": "o", "p": "p"}, rounds=3, per_round=seen, calls=1, ours="o", max_rounds=6)
    assert [len(v) for v in seen.values()] == [3, 3]


def _raise():
    raise RuntimeError("no")


def _rows():
    out = []
    for arch, size in (("qwen2", "0.5b"), ("bert", "0.5b")):
        for mode, sp in (("prefill", 1.2), ("train padded", 0.9), ("train compiled", 1.05)):
            out.append({"suite": "models", "case": f"{mode} {arch} {size}", "arch": arch, "size": size,
                        "mode": mode, "speedup": sp, "ratios": {"unconverted": sp, "liger": sp - 0.1}})
    out.append({"suite": "models", "case": "decode b1 dynamic qwen2 1.5b", "arch": "qwen2", "size": "1.5b",
                "mode": "decode b1 dynamic", "error": "setup: ValueError"})
    out.append({"suite": "models", "case": "train fp8 b4 s2048 qwen2 1.5b", "arch": "qwen2", "size": "1.5b",
                "mode": "train fp8", "speedup": 0.8, "ratios": {"opsadv_bf16": 0.8}})
    return out


def test_heatmap_and_headline_from_the_json(tmp_path):
    from opsadv.bench import model_report as R
    path = tmp_path / "models.json"
    path.write_text(json.dumps({"device": "NVIDIA H200", "torch": "2.11", "commit": "abc", "cases": _rows()}))
    md = R.headline_markdown(str(path))
    assert "| prefill | 2 | 1.20x |" in md
    assert "| train padded | 2 | 0.90x | 0.90x (train padded qwen2 0.5b) | 0/2 | 0.80x (2 cells) |" in md
    assert "| decode | 0 (+1 failed) |" in md and "train compiled" in md
    assert "| train fp8 | 1 | 0.80x |" in md                  # apart: its baseline is our bf16 conversion
    pytest.importorskip("matplotlib")
    png = tmp_path / "h.png"
    assert R.write_heatmap(str(path), str(png)) == 8 and png.stat().st_size > 0
    assert R.main([str(path), "--heatmap", str(tmp_path / "h2.png")]) == 0


# (arch, the model's backend at conversion, the ambient policy the compiled model runs under): an explicit backend
# must hold under another ambient one, in the compiled forward and backward as in eager calls.  (Backend "auto"
# training: test_compiled_converted_training_step; the cuda kernels run in the Triton interpreter: training only.)
ONE_GRAPH = [("llama3", "auto", "reference"), ("bert", "auto", "reference"), ("llama3", "reference", "cuda"),
             ("bert", "reference", "cuda")]
ONE_GRAPH_TRAIN = [("llama3", "reference", "cuda"), ("llama3", "cuda", "reference")]


def _convert_for(orig, x, backend):
    kw = {}
    if backend == "cuda":            # fp32 inputs: tensor-core GEMM (tf32) and attention (fp16) in the interpreter
        kw["precision"] = opsadv.PrecisionPolicy(matmul="tf32", attention="fp16")
    return opsadv.convert_model(copy.deepcopy(orig), backend=backend, example_inputs=Z.without_labels(x), **kw)


def _impl_backends(counts) -> set:
    return {impl.split(".")[0] for impl in counts}


@pytest.mark.xdist_group("model_matrix_compile")
@pytest.mark.parametrize("arch,backend,ambient", ONE_GRAPH)
def test_compiled_converted_forward_is_one_graph(arch, backend, ambient):
    """fullgraph=True: no converted module (norms, MLPs, rotary, attention) breaks torch.compile's graph, under
    backend "auto" (the ambient policy) and under an explicit one (the ops carry the model's scope id); each op
    runs under the model's policy, as many times as in the eager converted model."""
    import torch._dynamo
    orig, x = _tiny(arch)
    conv = _convert_for(orig, x, backend)
    want_backend = ambient if backend == "auto" else backend
    try:
        with opsadv.use_backend(ambient), torch.no_grad():
            with opsadv.trace() as te:
                eager = _primary(conv(**x))
            with opsadv.trace() as t:
                got = _primary(torch.compile(conv, fullgraph=True, backend="aot_eager")(**x))
            want = _primary(orig(**x))
    finally:
        torch._dynamo.reset()
    assert _impl_backends(t.counts) == {want_backend}, t.counts
    assert t.counts == te.counts
    am = x.get("attention_mask")
    keep = am.bool() if am is not None and got.shape[:2] == am.shape else torch.ones(got.shape[:2], dtype=torch.bool)
    tol = dict(rtol=2e-3, atol=2e-3) if backend == "cuda" else dict(rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got[keep], want[keep], **tol)
    torch.testing.assert_close(got[keep], eager[keep], **tol)
    assert opsadv.core.policy.TRACE.sid == 0 and opsadv.core.policy._scoped.get() is None     # nothing leaked


@pytest.mark.xdist_group("model_matrix_compile")
@pytest.mark.parametrize("arch,backend,ambient", ONE_GRAPH_TRAIN)
def test_compiled_converted_training_step_is_one_graph(arch, backend, ambient):
    """A training step of torch.compile(converted, fullgraph=True) under an explicit backend: one graph, forward
    and backward ops all on the model's backend (the backward ops carry the forward's scope), loss and every
    gradient as the unconverted model's."""
    import torch._dynamo
    orig, x = _tiny(arch, train=True)
    conv = _convert_for(orig, x, backend).train()
    want_backend = ambient if backend == "auto" else backend
    try:
        with opsadv.use_backend(ambient):
            compiled = torch.compile(conv, fullgraph=True, backend="aot_eager")
            with opsadv.trace() as tf:
                loss = compiled(**x).loss
            with opsadv.trace() as tb:
                loss.backward()
    finally:
        torch._dynamo.reset()
    ref = orig(**x).loss
    ref.backward()
    tol = 2e-3 if backend == "cuda" else 1e-5
    assert abs(loss.item() - ref.item()) <= tol * abs(ref.item())
    g = Z.grad_errors(orig, conv)
    assert not g["missing"] and g["max_rel_err"] < (1e-2 if backend == "cuda" else 1e-4), g
    assert _impl_backends(tf.counts) == _impl_backends(tb.counts) == {want_backend}, (tf.counts, tb.counts)
    for op in ("rms_norm", "rotary_embedding", "swiglu", "gemm", "attention", "linear_cross_entropy"):
        assert any(op in impl for impl in tf.counts), (op, tf.counts)     # every converted kind ran
    # one backward per op call, but linear_cross_entropy's: its forward computes the gradients (mean reduction)
    fwd = sum(n for impl, n in tf.counts.items() if "linear_cross_entropy" not in impl)
    assert sum(tb.counts.values()) == fwd, (tf.counts, tb.counts)


def test_packed_inputs():
    """The packed cell's batch: one row of `total` tokens, sequences of total/32..total/4 tokens whose position ids
    restart at 0, labels -100 exactly there, no cache."""
    cfg = Z.make_config("llama3", "tiny")
    x = Z.packed_inputs(cfg, 8192, labels=True)
    pos = x["position_ids"][0]
    starts = torch.nonzero(pos == 0).flatten().tolist() + [8192]
    lens = [b - a for a, b in zip(starts, starts[1:])]
    assert x["input_ids"].shape == (1, 8192) and x["use_cache"] is False and sum(lens) == 8192
    assert all(256 <= n <= 2048 for n in lens[:-1]) and 1 <= lens[-1] <= 2048
    assert torch.equal(pos, torch.cat([torch.arange(n) for n in lens]))
    assert torch.equal(x["labels"][0] == -100, pos == 0)
