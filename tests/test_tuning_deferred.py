"""tuning.deferred(): calls in the block measure nothing new and leave no memoized choice behind, so the bucket's
first call outside still tunes; convert_model validates under it (validation inputs are not the shapes the model
will run)."""
import pytest
import torch

import opsadv
from opsadv.backends.triton_common import utils as tu
from opsadv.core import dispatch, tuning

tf = pytest.importorskip("transformers")


@pytest.fixture
def autotune_spy(monkeypatch):
    """Every tuning.autotune call's op and shapes (the spy measures nothing: the priority choice stands)."""
    seen = []
    monkeypatch.setattr(tuning, "autotune", lambda exp, r, args, timing="wall": seen.append(
        (exp.spec.op, tuple(map(tuple, exp.spec.shapes)))) or None)
    dispatch.clear_cache()
    yield seen
    dispatch.clear_cache()


def _rms(x):
    return opsadv.ops.rms_norm(x, torch.ones(x.shape[-1]), eps=1e-6)


def test_deferred_calls_tune_nothing_and_memoize_nothing(autotune_spy):
    x = torch.randn(3, 37)
    with opsadv.use_backend("reference", autotune=True):
        with tuning.deferred():
            a = _rms(x)
            b = _rms(x)                       # a second call in the block: still not tuned, still correct
            assert tuning.is_deferred()
        assert not tuning.is_deferred() and autotune_spy == []
        c = _rms(x)                           # the bucket's first call outside the block tunes it
        assert [op for op, _ in autotune_spy] == ["rms_norm"]
        _rms(x)                               # memoized now
        assert len(autotune_spy) == 1
    want = x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-6)
    for y in (a, b, c):
        torch.testing.assert_close(y.double(), want, rtol=1e-5, atol=1e-6)


def test_deferred_config_pick_takes_the_default_and_keeps_nothing(monkeypatch):
    tuner = tu.ConfigTuner("test.deferred")
    tuned = []
    monkeypatch.setattr(tuner, "_tune", lambda key, configs, launch: tuned.append(key) or configs[-1])
    monkeypatch.setattr(tu, "_disk_load", lambda: {})
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)     # (a CPU build cannot ask)
    configs = [{"BLOCK": 16}, {"BLOCK": 32}]
    with tuning.deferred():
        assert tuner.pick(("k",), configs, lambda c: None, True) == configs[0]
    assert tuned == [] and ("k",) not in tuner.best
    assert tuner.pick(("k",), configs, lambda c: None, True) == configs[-1]      # outside: tuned
    assert tuned == [("k",)]


def test_convert_model_validates_without_tuning_the_validation_shapes(autotune_spy):
    """The validation runs (original and converted model) tune nothing; the shapes the model then runs do."""
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=96, vocab_size=101, max_position_embeddings=64)
    cfg._attn_implementation = "sdpa"
    model = tf.LlamaForCausalLM(cfg).eval()
    val = {"input_ids": torch.randint(0, 101, (2, 11))}
    with opsadv.use_backend("auto", autotune=True):
        conv = opsadv.convert_model(model, floor=False, example_inputs=val)
        assert conv.opsadv_report.validation["passed"] and autotune_spy == []
        with torch.no_grad():
            conv(input_ids=torch.randint(0, 101, (3, 17)))
    assert autotune_spy and {s[0][:2] for _, s in autotune_spy if s and len(s[0]) >= 2} >= {(3, 17)}
