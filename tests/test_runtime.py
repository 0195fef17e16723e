"""opsadv.runtime: memory policy levels and run_batched (chunking, OOM retry, merging) on CPU."""
import collections
import subprocess
import sys

import pytest
import torch

import opsadv
from opsadv.core.errors import InvalidArgumentError
from opsadv.runtime import apply_memory_policy, parse_bytes, parse_level, run_batched

GIB = 1 << 30


def test_runtime_is_lazy():
    code = ("import sys, opsadv; assert 'opsadv.runtime' not in sys.modules; "
            "r = opsadv.runtime; assert r.run_batched and 'opsadv.runtime' in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_parse_bytes_and_level():
    assert parse_bytes("3GiB") == 3 * GIB and parse_bytes("3G") == 3 * GIB and parse_bytes("2GB") == 2 * 10 ** 9
    assert parse_bytes("512 MiB") == 512 << 20 and parse_bytes(4096) == 4096 and parse_bytes("1.5KiB") == 1536
    assert parse_bytes("25%", available=4000) == 1000
    for bad in ("", "GiB", "3 furlongs", 0, -5, 2.5, True, None, "-1MiB"):
        with pytest.raises(InvalidArgumentError, match="memory_budget"):
            parse_bytes(bad)
    with pytest.raises(InvalidArgumentError, match="MemAvailable"):
        parse_bytes("50%")
    assert [parse_level(x) for x in (0, 1, 2, 3, "off", "Conservative", "balanced", "aggressive")] == [0, 1, 2, 3,
                                                                                                        0, 1, 2, 3]
    for bad in (4, -1, "max", 1.0, True):
        with pytest.raises(InvalidArgumentError, match="level"):
            parse_level(bad)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA path")
def test_apply_memory_policy_without_cuda():
    pol = apply_memory_policy("aggressive", memory_budget="1GiB")
    assert pol.level == 3 and pol.name == "aggressive" and pol.budget_bytes == GIB
    assert pol.empty_cache_between_chunks and not pol.applied and any("no CUDA" in s for s in pol.skipped)
    assert opsadv.runtime.current_memory_policy() is pol
    with pytest.raises(InvalidArgumentError, match="level"):
        apply_memory_policy(9)
    apply_memory_policy(0)


# ---- run_batched ------------------------------------------------------------------------------------
class Recorder:
    """fn(x, scale=...) that remembers the chunks it saw and can run out of memory on demand."""

    def __init__(self, oom_above=None, oom_calls=()):
        self.sizes, self.calls, self.oom_above, self.oom_calls = [], 0, oom_above, set(oom_calls)

    def __call__(self, x, mask=None, scale=1.0):
        self.calls += 1
        if (self.oom_above is not None and x.shape[0] > self.oom_above) or self.calls in self.oom_calls:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")
        self.sizes.append(x.shape[0])
        y = x.cumsum(-1) * scale
        return {"y": y, "rows": x.sum(-1), "pair": (y[:, :1], None), "tag": "same"}


def _equal(a, b):
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return type(a) is type(b) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


def test_run_batched_oom_retry_returns_the_unbatched_result(seed):
    x = torch.randn(23, 5)
    want = Recorder()(x, scale=2.0)
    fn = Recorder(oom_above=4)
    st = {}
    got = run_batched(fn, {"x": x, "scale": 2.0}, chunk_size=16, stats=st)
    assert _equal(got, want)
    assert st["retries"] == 2 and max(st["chunks"]) <= 4 and sum(st["chunks"]) == 23 and fn.sizes == st["chunks"]


def test_run_batched_transient_oom_loses_and_duplicates_nothing(seed):
    x = torch.arange(40.0).reshape(20, 2)
    fn = Recorder(oom_calls={2, 5})           # chunks of 6: the 2nd fails (-> 3), later a 3 fails (-> 1)
    st = {}
    got = run_batched(fn, (x, None), chunk_size=6, stats=st)
    assert _equal(got, Recorder()(x)) and st["chunks"] == [6, 3, 3] + [1] * 8 and st["retries"] == 2
    assert got["rows"].tolist() == x.sum(-1).tolist()     # order kept


def test_run_batched_oom_at_one_sample_raises():
    with pytest.raises(torch.OutOfMemoryError):
        run_batched(Recorder(oom_above=0), torch.randn(3, 2), chunk_size=2)


def test_run_batched_bytes_per_sample_prediction():
    fn = Recorder()
    st = {}
    x = torch.randn(10, 3)
    out = run_batched(fn, x, memory_budget=1000, bytes_per_sample=300, stats=st)
    assert _equal(out, Recorder()(x))
    assert fn.sizes == [2, 2, 2, 2, 2]              # 0.85 * 1000 // 300 = 2 samples per chunk


def test_run_batched_plain_tensor_and_namedtuple_outputs(seed):
    Pair = collections.namedtuple("Pair", "a b")
    x = torch.randn(9, 4, 3)
    fn = lambda t: Pair(t.softmax(-1), [t.amax(-1), 3])   # noqa: E731
    got = run_batched(fn, x, chunk_size=2)
    want = fn(x)
    assert type(got) is Pair and torch.equal(got.a, want.a) and torch.equal(got.b[0], want.b[0]) and got.b[1] == 3
    assert torch.equal(run_batched(torch.nn.functional.gelu, x, chunk_size=4), torch.nn.functional.gelu(x))


def test_run_batched_gradients_match(seed):
    w = torch.randn(6, 4, requires_grad=True)
    x = torch.randn(11, 6, requires_grad=True)
    (x @ w).tanh().sum().backward()
    gw, gx = w.grad.clone(), x.grad.clone()
    w.grad = x.grad = None
    run_batched(lambda t: (t @ w).tanh(), x, chunk_size=3).sum().backward()
    assert torch.allclose(w.grad, gw) and torch.allclose(x.grad, gx)


def test_run_batched_validates():
    x = torch.randn(4, 2)
    for bad in (0, 9, True, 2.0):
        with pytest.raises(InvalidArgumentError, match="max_streams"):
            run_batched(lambda t: t, x, max_streams=bad)
    with pytest.raises(InvalidArgumentError, match="chunk_size"):
        run_batched(lambda t: t, x, chunk_size=0)
    with pytest.raises(InvalidArgumentError, match="fn_or_model"):
        run_batched("model", x)
    with pytest.raises(InvalidArgumentError, match="inputs"):
        run_batched(lambda t: t, {"n": 3})
    with pytest.raises(InvalidArgumentError, match="batch reduction"):
        run_batched(lambda t: t.sum(), x, chunk_size=2)
    with pytest.raises(InvalidArgumentError, match="use_cache=False"):
        run_batched(lambda t: (t, type("DynamicCache", (), {})()), x, chunk_size=2)
    with pytest.raises(InvalidArgumentError, match="equal in every chunk"):
        run_batched(lambda t: (t, float(t[0, 0])), torch.arange(8.0).reshape(4, 2), chunk_size=2)
    # max_streams > 1 on CPU tensors: validated, runs on the one CPU stream
    st = {}
    assert torch.equal(run_batched(lambda t: t * 2, x, max_streams=4, chunk_size=1, stats=st), x * 2)
    assert st["streams"] == 1


def test_run_batched_hf_model_and_batch_encoding(seed):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, 97, (5, 12))
    mask = torch.ones(5, 12, dtype=torch.long)
    mask[1, :4] = 0                                          # left padding in one row
    enc = transformers.BatchEncoding({"input_ids": ids, "attention_mask": mask})
    with torch.no_grad():
        want = model(**enc, use_cache=False, output_hidden_states=True)
        fn = Recorder(oom_above=2)
        got = run_batched(lambda **kw: (fn(kw["input_ids"]), model(**kw))[1],
                          {**enc, "use_cache": False, "output_hidden_states": True}, chunk_size=5)
    assert type(got) is type(want) and got.keys() == want.keys()
    assert torch.allclose(got.logits, want.logits, atol=1e-5)
    assert len(got.hidden_states) == len(want.hidden_states)
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(got.hidden_states, want.hidden_states))
    with torch.no_grad(), pytest.raises(InvalidArgumentError, match="use_cache=False"):
        run_batched(model, dict(enc), chunk_size=2)


class FakeMeter:
    """Simulated device memory: fn declares the transient bytes a chunk needs; above capacity: OOM."""

    def __init__(self, capacity):
        self.alloc, self.top, self.capacity, self.seen = 0, 0, capacity, []

    def allocated(self):
        return self.alloc

    def reset_peak(self):
        self.top = self.alloc

    def peak(self):
        return self.top

    def use(self, nbytes):
        if self.alloc + nbytes > self.capacity:
            raise torch.OutOfMemoryError("simulated")
        self.top = max(self.top, self.alloc + nbytes)
        self.seen.append(nbytes)

    def after_oom(self):
        pass

    def empty_cache(self):
        pass


@pytest.mark.parametrize("capacity,chunks,retries", [
    (10 ** 9, [1, 5, 15, 15, 15, 9], 0),   # probe 1 sample (150 B), fit 1 point, then 2 points: 100 + 50 n
    (700, [1, 5, 7, 7, 7, 7, 7, 7, 7, 5], 1),  # the device holds less than the budget: 15 fails, 7 from then on
])
def test_run_batched_predicts_chunks_from_measured_peaks(monkeypatch, seed, capacity, chunks, retries):
    from opsadv.runtime import batched
    meter = FakeMeter(capacity)
    monkeypatch.setattr(batched, "meter_for", lambda device: meter)
    x = torch.randn(60, 3)

    def fn(t):
        meter.use(100 + 50 * t.shape[0])       # fixed 100 bytes + 50 per sample
        return t * 2

    st = {}
    out = run_batched(fn, x, memory_budget=1000, stats=st)
    assert torch.equal(out, x * 2)
    assert st["chunks"] == chunks and st["retries"] == retries
    assert max(meter.seen) <= 1000 and st["peak_bytes"] <= 1000          # within the budget
    assert st["bytes_per_sample"] == 50 and st["fixed_bytes"] == 100


def test_default_budget_follows_the_jetson_option(tmp_path):
    from opsadv.registry import reset_registry
    from opsadv.runtime import default_budget
    from test_jetson import ORIN, fake_env
    try:
        reset_registry(fake_env(tmp_path, "orin", ORIN))
        with opsadv.use_backend("jetson", memory_budget="1GiB"):
            assert default_budget(torch.device("cpu")) == (GIB, "use_backend(memory_budget=...)")
        with opsadv.use_backend("jetson"):           # the MemAvailable snapshot is not a user budget
            assert default_budget(torch.device("cpu"))[0] is None
    finally:
        reset_registry()


def test_run_batched_retries_a_legacy_oom_runtime_error(seed):
    """Older torch builds and some extensions raise a plain RuntimeError for an out-of-memory: retried the same."""
    calls = []

    def fn(x):
        calls.append(x.shape[0])
        if x.shape[0] > 3:
            raise RuntimeError("CUDA out of memory. Tried to allocate 20.00 MiB (GPU 0; legacy message)")
        return x * 2
    x = torch.randn(10, 4)
    st = {}
    assert torch.equal(run_batched(fn, x, chunk_size=8, stats=st), x * 2)
    assert st["retries"] == 2 and sum(st["chunks"]) == 10 and max(st["chunks"]) <= 3     # 8 -> 4 -> 2
    with pytest.raises(RuntimeError, match="shape mismatch"):          # any other RuntimeError is the caller's
        run_batched(lambda x: (_ for _ in ()).throw(RuntimeError("shape mismatch")), x, chunk_size=8)
    with pytest.raises(RuntimeError, match="out of memory"):            # and one sample that does not fit raises
        run_batched(lambda x: (_ for _ in ()).throw(RuntimeError("CUDA error: out of memory")), x, chunk_size=1)


@pytest.mark.parametrize("where", ["tensor", "dict"])
def test_run_batched_refuses_chunks_of_another_dtype(where):
    """A later chunk in another dtype (autocast toggled, a dtype chosen per input) raises instead of being cast."""
    seen = []

    def fn(x):
        seen.append(1)
        y = x.cumsum(-1)
        y = y if len(seen) == 1 else y.half()
        return y if where == "tensor" else {"y": y, "n": x.shape[1]}
    with pytest.raises(InvalidArgumentError, match=r"float32 in every chunk.*float16 for samples 4:8"):
        run_batched(fn, torch.randn(10, 3), chunk_size=4)
