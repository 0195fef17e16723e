"""The conversion floor (opsadv.convert.floor): a rewrite kind measured slower is not applied, the
report says so with the numbers; decisions come from a fake timer so they do not depend on this machine."""
import pytest
import torch
from torch import nn

import opsadv
from opsadv.convert.modules import OpsadvNorm, QKVProjection, SwiGLUMLP
from opsadv.errors import InvalidArgumentError

tf = pytest.importorskip("transformers")


def _llama(seed=0):
    torch.manual_seed(seed)
    cfg = tf.LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=96, vocab_size=101, max_position_embeddings=64)
    cfg._attn_implementation = "sdpa"
    return tf.LlamaForCausalLM(cfg).eval()


def _ids(b=2, s=11, seed=1):
    g = torch.Generator().manual_seed(seed)
    return {"input_ids": torch.randint(0, 101, (b, s), generator=g)}


class FakeTimer:
    """ms of a call from the model's state: `cost` maps an opsadv module type to the ms it adds."""

    def __init__(self, model, cost, base=10.0):
        self.model, self.cost, self.base, self.calls = model, cost, base, 0

    def __call__(self, fn):
        fn()                                   # the timed call must run
        self.calls += 1
        ms = self.base
        for m in self.model.modules():
            ms += self.cost.get(type(m), 0.0)
        if self.model.config._attn_implementation == "opsadv":
            ms += self.cost.get("attention", 0.0)
        if any("forward" in m.__dict__ for m in self.model.modules()):      # the rotary pass's rebound forwards
            ms += self.cost.get("rotary", 0.0)
        return ms


def test_slower_rewrite_is_not_applied_and_reported():
    m = _llama()
    ref = m(**_ids()).logits
    timer = FakeTimer(m, {OpsadvNorm: +1.0, SwiGLUMLP: -2.0, "attention": -0.5})
    conv = opsadv.convert_model(m, backend="reference", floor=True, floor_timer=timer,
                                floor_inputs=_ids(3, 17, seed=2))
    rep = conv.opsadv_report
    assert set(rep.phases) == {"floor", "autotune", "validation", "rewrites"} and rep.phases["floor"] > 0
    assert sum(rep.phases.values()) <= rep.seconds and "floor " in str(rep).splitlines()[0]
    assert rep.to_dict()["phases"] == rep.phases
    assert not any(isinstance(x, OpsadvNorm) for x in conv.modules())
    assert any(isinstance(x, SwiGLUMLP) for x in conv.modules())
    assert conv.config._attn_implementation == "opsadv"
    kept = [c for c in rep.changes if c.kind == "kept"]
    assert len(kept) == 1 and "norms" in kept[0].what and "not applied" in kept[0].reason
    assert "0.655x (14.5 ms with it vs 9.5 ms without" in kept[0].reason
    assert not any(c.kind == "replaced" and "norm" in c.what for c in rep.changes)
    by_kind = {d["kind"]: d for d in rep.floor}
    assert by_kind["norm"]["kept"] is False and by_kind["norm"]["ratio"] < 1.0
    assert by_kind["mlp"]["kept"] is True and by_kind["mlp"]["ratio"] > 1.0
    assert "norm 0." in str(rep) and "undone" in str(rep)
    assert rep.to_dict()["floor"] == rep.floor
    torch.testing.assert_close(conv(**_ids()).logits, ref, rtol=1e-4, atol=1e-4)


def test_every_kind_slower_leaves_the_model_as_it_was():
    m = _llama(seed=3)
    inp = _ids(2, 9, seed=4)
    ref = m(**inp).logits
    state = {k: v.clone() for k, v in m.state_dict().items()}
    types = {type(x) for x in m.modules()}
    timer = FakeTimer(m, {OpsadvNorm: 1.0, SwiGLUMLP: 1.0, QKVProjection: 1.0, "attention": 1.0, "rotary": 1.0})
    conv = opsadv.convert_model(m, floor=True, floor_timer=timer)
    assert conv.config._attn_implementation == "sdpa"
    assert {type(x) for x in conv.modules()} == types
    assert not any("forward" in x.__dict__ for x in conv.modules())
    assert all(d["kept"] is False for d in conv.opsadv_report.floor)
    assert {d["kind"] for d in conv.opsadv_report.floor} == {"attention", "rotary", "norm", "mlp", "qkv"}
    for k, v in conv.state_dict().items():
        assert torch.equal(v, state[k]), k
    assert torch.equal(conv(**inp).logits, ref)


def test_equal_time_keeps_the_rewrite():
    m = _llama()
    conv = opsadv.convert_model(m, backend="reference", floor=True, floor_timer=FakeTimer(m, {}))
    assert all(d["kept"] for d in conv.opsadv_report.floor)
    assert any(isinstance(x, OpsadvNorm) for x in conv.modules())


def test_floor_off_times_nothing(monkeypatch):
    m = _llama()
    timer = FakeTimer(m, {OpsadvNorm: 5.0})
    conv = opsadv.convert_model(m, floor=False, floor_timer=timer)
    assert timer.calls == 0 and conv.opsadv_report.floor is None
    assert any(isinstance(x, OpsadvNorm) for x in conv.modules())
    monkeypatch.setenv("OPSADV_CONVERT_FLOOR", "1")             # default on
    m2 = _llama()
    t2 = FakeTimer(m2, {OpsadvNorm: 5.0})
    opsadv.convert_model(m2, floor_timer=t2)
    assert t2.calls > 0 and not any(isinstance(x, OpsadvNorm) for x in m2.modules())


def test_train_mode_times_backward_and_restores_grads():
    m = _llama()
    seen = []

    def timer(fn):
        fn()
        seen.append(sum(p.grad is not None for p in m.parameters()))
        return 1.0
    conv = opsadv.convert_model(m, backend="reference", floor=True, floor_mode="train", floor_timer=timer)
    assert seen and all(n > 0 for n in seen)                 # the timed call ran a backward
    assert all(p.grad is None for p in conv.parameters())      # and left no gradients behind
    assert not conv.training


def test_non_transformers_model_fx_step():
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(16, 16)
            self.w = nn.Parameter(torch.rand(16) + 0.5)

        def forward(self, x):
            y = torch.nn.functional.gelu(self.lin(x))
            return y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + 1e-6) * self.w

    net = nn.Sequential(Block(), Block())
    x = torch.randn(3, 5, 16)
    ref = net(x)
    def timer(fn):
        fn()
        return 2.0 if type(net[0]).__name__.endswith("_opsadv") else 1.0     # with the rewrite: slower
    conv = opsadv.convert_model(net, example_inputs=(x,), floor=True, floor_timer=timer)
    assert conv is net and isinstance(conv[0], Block)
    assert any(c.kind == "kept" and "graph" in c.what for c in conv.opsadv_report.changes)
    torch.testing.assert_close(conv(x), ref)


@pytest.mark.parametrize("kw,arg", [({"floor": "yes"}, "floor"), ({"floor_mode": "training"}, "floor_mode"),
                                    ({"floor_timer": 3}, "floor_timer"), ({"floor_cache": "yes"}, "floor_cache")])
def test_bad_floor_args(kw, arg):
    with pytest.raises(InvalidArgumentError, match=arg):
        opsadv.convert_model(_llama(), **kw)


def test_generate_mode_times_generate():
    m = _llama()
    lens = []

    def timer(fn):
        out = fn()
        lens.append(out.shape[1])
        return 1.0
    inp = _ids(2, 5)
    opsadv.convert_model(m, backend="reference", floor=True, floor_mode="generate", floor_timer=timer, floor_inputs=inp)
    from opsadv.convert.floor import GENERATE_TOKENS
    assert lens and all(n == 5 + GENERATE_TOKENS for n in lens)


# ---- floor_compile: the model judged as torch.compile runs it ------------------------------------------------
class CompiledTimer(FakeTimer):
    """Costs as FakeTimer, and a record of how each timed call ran (its blocks compiled, or an OptimizedModule)."""

    def __init__(self, model, cost, compiled_cost=None, base=10.0):
        super().__init__(model, cost, base)
        self.compiled_cost = compiled_cost or {}
        self.seen = []

    def __call__(self, fn):
        blocks = [m for m in self.model.modules() if type(m).__name__ == "LlamaDecoderLayer"]
        compiled = bool(blocks) and all(m._compiled_call_impl is not None for m in blocks)
        self.seen.append(compiled)
        ms = super().__call__(fn)
        if compiled:
            for m in self.model.modules():
                ms += self.compiled_cost.get(type(m), 0.0)
        return ms


def test_compiled_floor_judges_each_step_compiled_and_undoes_the_loser(monkeypatch):
    """A rewrite that wins eager but loses compiled (Inductor fuses the eager norms itself) is not applied when
    floor_compile says the model will be compiled; the blocks are left uncompiled after conversion."""
    from opsadv.convert import floor as F
    monkeypatch.setitem(F.COMPILE_KWARGS, "backend", "eager")   # (dynamo only: no compiler on the test machine)
    m = _llama()
    ref = m(**_ids()).logits
    timer = CompiledTimer(m, {OpsadvNorm: -1.0}, compiled_cost={OpsadvNorm: +3.0})
    conv = opsadv.convert_model(m, backend="reference", floor=True, floor_timer=timer, floor_compile=True)
    assert timer.seen and all(timer.seen)
    by_kind = {d["kind"]: d for d in conv.opsadv_report.floor}
    assert by_kind["norm"]["kept"] is False
    assert not any(isinstance(x, OpsadvNorm) for x in conv.modules())
    assert "floor timed under torch.compile (regional)" in conv.opsadv_report.notes
    assert all(x._compiled_call_impl is None for x in conv.modules())
    torch.testing.assert_close(conv(**_ids()).logits, ref, rtol=1e-4, atol=1e-4)
    # the same costs judged eager keep the norms
    m2 = _llama()
    conv2 = opsadv.convert_model(m2, backend="reference", floor=True, floor_timer=CompiledTimer(m2, {OpsadvNorm: -1.0},
                                                                            compiled_cost={OpsadvNorm: +3.0}))
    assert any(isinstance(x, OpsadvNorm) for x in conv2.modules())


def test_compiled_floor_runs_a_real_compile(monkeypatch):
    """floor_compile="full" times torch.compile(model) (dynamo with the eager backend here): the timed calls run."""
    from opsadv.convert import floor as F
    monkeypatch.setitem(F.COMPILE_KWARGS, "backend", "eager")
    m = _llama()
    calls = []

    def timer(fn):
        out = fn()
        calls.append(out is not None)
        return 1.0
    conv = opsadv.convert_model(m, backend="reference", floor=True, floor_timer=timer, floor_compile="full",
                                floor_inputs=_ids(2, 9))
    assert calls and all(calls)
    assert all(d["kept"] for d in conv.opsadv_report.floor)
    import torch._dynamo
    torch._dynamo.reset()


def test_compiled_floor_blocks_reuse_the_compiled_graphs(monkeypatch):
    """A compiled step's B A A B samples toggle the rewrite back and forth: dynamo's cache serves every sample after
    the first of each side (one graph without the step, one per kept step), so the blocks cost timing only."""
    from torch._dynamo.utils import counters
    from opsadv.convert import floor as F
    monkeypatch.setitem(F.COMPILE_KWARGS, "backend", "eager")   # (dynamo only: no compiler on the test machine)
    flip = iter([0.0, 0.02] * 20)                             # pairs that disagree: a second block for each step

    def timer(fn):
        fn()
        return 10.0 + next(flip)
    torch._dynamo.reset()
    counters.clear()
    conv = opsadv.convert_model(_llama(), backend="reference", floor=True, floor_timer=timer, floor_compile="regional",
                                floor_inputs={**_ids(), "use_cache": False},
                                rewrites={k: False for k in ("attention", "rotary", "qkv", "lm_loss")})
    decisions = conv.opsadv_report.floor
    assert [d["kind"] for d in decisions] == ["norm", "mlp"]
    assert all(len(d["with_samples"]) == 4 for d in decisions)          # two blocks each
    # the model as it was, then each step's model with it (a dropped step's "without" is the graph before it)
    assert counters["stats"]["unique_graphs"] == 1 + len(decisions), (counters["stats"], decisions)
    torch._dynamo.reset()


@pytest.mark.parametrize("bad", ["yes", 1, "max-autotune"])
def test_floor_compile_refuses_unknown_values(bad):
    with pytest.raises(InvalidArgumentError, match="floor_compile"):
        opsadv.convert_model(_llama(), floor=True, floor_compile=bad)


def _drifting_timer(model, effect_ms: float, drift_ms: float = 0.1):
    """Every sample drift_ms slower than the one before (a machine warming up, a host getting busier), and the
    opsadv norms change a call by effect_ms."""
    n = {"calls": 0}

    def timer(fn):
        fn()
        n["calls"] += 1
        on = any(isinstance(m, OpsadvNorm) for m in model.modules())
        return 10.0 + drift_ms * n["calls"] + (effect_ms if on else 0.0)
    return timer, n


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("effect,kept", [(-0.05, True), (+0.05, False)])
def test_floor_cancels_drift(monkeypatch, effect, kept, compiled):
    """B A A B blocks: a drift 2x larger than a rewrite's effect per sample still leaves the decision to the effect
    (an A-B-A floor judging against a stale sample would keep or undo by the drift's sign).  Compiled floors too:
    they once compared one sample with the step against a "without" taken several compilations earlier."""
    kw = {}
    if compiled:
        from opsadv.convert import floor as F
        monkeypatch.setitem(F.COMPILE_KWARGS, "backend", "eager")   # (dynamo only: no compiler on the test machine)
        kw = dict(floor_compile="regional", rewrites={k: False for k in ("attention", "rotary", "mlp", "qkv")})
    m = _llama()
    timer, n = _drifting_timer(m, effect)
    conv = opsadv.convert_model(m, backend="reference", floor=True, floor_timer=timer, floor_inputs=_ids(3, 17, seed=2),
                                **kw)
    (norm,) = [d for d in conv.opsadv_report.floor if d["kind"] == "norm"]
    assert norm["kept"] is kept
    assert any(isinstance(x, OpsadvNorm) for x in conv.modules()) is kept
    assert len(norm["without_samples"]) == len(norm["with_samples"]) == 2 * len(norm["block_ratios"])
    assert n["calls"] == sum(len(d["without_samples"]) + len(d["with_samples"]) for d in conv.opsadv_report.floor)


def test_eager_floor_adds_blocks_while_samples_disagree():
    """A block whose two pairs disagree on the side of 1 gets a second block (MAX_BLOCKS); agreeing samples decide
    after one block; a step is kept only when every block ratio is >= 1: blocks on both sides are inconclusive and
    the rewrite is not applied, the report saying so."""
    from opsadv.convert import floor as F

    def run(pattern, effect=-0.1):
        m = _llama()
        noise = iter(pattern * 40)

        def timer(fn):
            fn()
            on = any(isinstance(x, OpsadvNorm) for x in m.modules())
            return 10.0 + next(noise) + (effect if on else 0.0)
        conv = opsadv.convert_model(m, backend="reference", floor=True, floor_timer=timer,
                                    floor_inputs=_ids(3, 17, seed=2))
        floor = conv.opsadv_report.floor
        run.report = conv.opsadv_report
        return floor, next(d for d in floor if d["kind"] == "norm")
    floor, norm = run([0.0, 3.0, -3.0, 0.0])            # pairs disagree, blocks agree: two blocks
    assert all(len(d["block_ratios"]) == 2 for d in floor) and norm["kept"]
    floor, norm = run([0.0, 3.0, -2.0, 0.0, 0.0, 2.0, -3.0, 0.0, 0.0, 3.0, -2.0, 0.0])  # blocks disagree too
    assert F.MAX_BLOCKS == 2 and all(len(d["block_ratios"]) == 2 for d in floor)
    assert min(norm["block_ratios"]) < 1.0 <= max(norm["block_ratios"])
    assert not norm["kept"] and norm["inconclusive"]
    why = [c.reason for c in run.report.changes if c.kind == "kept" and "norm rewrite" in (c.reason or "")]
    assert why and "inconclusive" in why[0]
    floor, norm = run([0.0])                            # no noise: one block
    assert all(len(d["block_ratios"]) == 1 for d in floor) and norm["kept"]
    floor, norm = run([0.0], effect=+0.1)
    assert not norm["kept"] and norm["ratio"] < 1.0


def test_wall_timer_times_a_long_call_once(monkeypatch):
    """A call longer than the target window is timed once after its warm-up; short calls get MIN_REPS or more."""
    import time as _time
    from opsadv.convert import floor as F
    monkeypatch.setattr(F, "TARGET_S", 0.02)
    timer = F.wall_timer(torch.device("cpu"))
    n = {"long": 0, "short": 0}

    def long():
        n["long"] += 1
        _time.sleep(0.03)

    def short():
        n["short"] += 1
    assert timer(long) >= 30.0 and n["long"] == 3             # warm-up, the estimate, one timed call
    timer(short)
    assert n["short"] >= 2 + F.MIN_REPS


# ---- decisions kept on disk: the same model converted again is not timed again -------------------------------
def _machine_timer(monkeypatch, timer):
    """The floor's own clock (the one whose decisions are cached) replaced by `timer`."""
    from opsadv.convert import floor as F
    monkeypatch.setattr(F, "wall_timer", lambda device: timer)


def test_decisions_are_reused_by_the_next_conversion_of_the_same_model(monkeypatch, tmp_path):
    from opsadv.convert import floor as F
    monkeypatch.setenv("OPSADV_CACHE_DIR", str(tmp_path))
    inp = {**_ids(2, 9), "attention_mask": torch.ones(2, 9, dtype=torch.long)}
    m1 = _llama()
    t1 = FakeTimer(m1, {OpsadvNorm: 1.0})              # norms measured slower on this "machine"
    _machine_timer(monkeypatch, t1)
    opsadv.convert_model(m1, backend="reference", floor=True, floor_inputs=inp)
    assert t1.calls > 0 and not any(isinstance(x, OpsadvNorm) for x in m1.modules())
    assert (tmp_path / "floor_decisions.json").exists() and not m1.opsadv_report.notes[-1].startswith("floor: 5")

    m2 = _llama()                                       # same model, same inputs: no timing, the same decisions
    t2 = FakeTimer(m2, {OpsadvNorm: -1.0})              # (a clock that would now keep the norms is never read)
    _machine_timer(monkeypatch, t2)
    opsadv.convert_model(m2, backend="reference", floor=True, floor_inputs=inp)
    rep = m2.opsadv_report
    assert t2.calls == 0 and not any(isinstance(x, OpsadvNorm) for x in m2.modules())
    assert [d["kind"] for d in rep.floor] == [d["kind"] for d in m1.opsadv_report.floor]
    assert all("cached" in d for d in rep.floor) and not any("cached" in d for d in m1.opsadv_report.floor)
    assert any(n.startswith(f"floor: {len(rep.floor)} of {len(rep.floor)} decisions reused") for n in rep.notes)
    norm, norm1 = (next(c for c in r.changes if c.kind == "kept" and "norms" in c.what)
                   for r in (rep, m1.opsadv_report))
    assert norm.reason == norm1.reason.replace(" blocks)", " blocks; cached decision)")
    assert rep.validation["passed"]
    text = F.report()                                   # `opsadv info --tuning`'s floor part
    assert "LlamaForCausalLM (llama) [inference] norm: not applied (0.667x" in text, text
    assert "LlamaForCausalLM (llama) [inference] attention: kept (1.000x" in text, text

    m3 = _llama()                                       # floor_cache=False measures again, and stores what it saw
    t3 = FakeTimer(m3, {OpsadvNorm: -1.0})
    _machine_timer(monkeypatch, t3)
    opsadv.convert_model(m3, backend="reference", floor=True, floor_inputs=inp, floor_cache=False)
    assert t3.calls > 0 and any(isinstance(x, OpsadvNorm) for x in m3.modules())
    m4 = _llama()
    t4 = FakeTimer(m4, {OpsadvNorm: 1.0})
    _machine_timer(monkeypatch, t4)
    opsadv.convert_model(m4, backend="reference", floor=True, floor_inputs=inp)
    assert t4.calls == 0 and any(isinstance(x, OpsadvNorm) for x in m4.modules())

    monkeypatch.setenv(F.CACHE_ENV, "0")                # the environment's default: measure every time
    m5 = _llama()
    t5 = FakeTimer(m5, {})
    _machine_timer(monkeypatch, t5)
    opsadv.convert_model(m5, backend="reference", floor=True, floor_inputs=inp)
    assert t5.calls > 0


@pytest.mark.parametrize("change", ["padding", "mode", "config", "trainable", "backend"])
def test_a_different_model_batch_or_mode_is_measured_again(monkeypatch, tmp_path, change):
    monkeypatch.setenv("OPSADV_CACHE_DIR", str(tmp_path))
    inp = {**_ids(2, 9), "attention_mask": torch.ones(2, 9, dtype=torch.long)}
    kw = dict(backend="reference", floor=True, floor_inputs=inp)
    m1 = _llama()
    _machine_timer(monkeypatch, FakeTimer(m1, {}))
    opsadv.convert_model(m1, **kw)
    m2 = _llama(seed=5)                                 # other weights: the same model, cached
    t2 = FakeTimer(m2, {})
    _machine_timer(monkeypatch, t2)
    opsadv.convert_model(m2, **kw)
    assert t2.calls == 0
    m3 = _llama()
    if change == "padding":
        mask = inp["attention_mask"].clone()
        mask[1, 6:] = 0
        kw["floor_inputs"] = {**inp, "attention_mask": mask}
    elif change == "mode":
        kw["floor_mode"] = "train"
    elif change == "config":
        m3 = tf.LlamaForCausalLM(tf.LlamaConfig(**{**m3.config.to_dict(), "intermediate_size": 128})).eval()
    elif change == "trainable":
        m3.model.embed_tokens.weight.requires_grad_(False)
    elif change == "backend":
        kw["backend"] = "auto"
    t3 = FakeTimer(m3, {})
    _machine_timer(monkeypatch, t3)
    opsadv.convert_model(m3, **kw)
    assert t3.calls > 0


def test_a_custom_timer_neither_reads_nor_writes_the_decisions(monkeypatch, tmp_path):
    monkeypatch.setenv("OPSADV_CACHE_DIR", str(tmp_path))
    m = _llama()
    opsadv.convert_model(m, backend="reference", floor=True, floor_timer=FakeTimer(m, {}))
    assert not (tmp_path / "floor_decisions.json").exists()


def test_default_floor_inputs_are_reused_too(monkeypatch, tmp_path):
    """Without floor_inputs the floor times the generated validation batch (seeded): the next conversion finds it."""
    monkeypatch.setenv("OPSADV_CACHE_DIR", str(tmp_path))
    m1 = _llama()
    _machine_timer(monkeypatch, FakeTimer(m1, {}))
    opsadv.convert_model(m1, backend="reference", floor=True)
    m2 = _llama()
    t2 = FakeTimer(m2, {})
    _machine_timer(monkeypatch, t2)
    opsadv.convert_model(m2, backend="reference", floor=True)
    assert t2.calls == 0 and all("cached" in d for d in m2.opsadv_report.floor)
