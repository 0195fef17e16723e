"""A converted model's policy under torch.compile: the ops' torch.library calls carry the model's scope id
(core.policy.op_scope), so an explicit backend holds in a compiled graph (forward and backward) without a ContextVar
in the traced code, and without leaking into other threads, the process default or exported programs."""
import copy
import pickle
import threading

import pytest
import torch
import torch._dynamo
from torch import nn

import opsadv
from opsadv import ops
from opsadv.convert.state import RuntimeState
from opsadv.core import policy as _policy
from opsadv.core.errors import InvalidArgumentError

from conftest import rel_err


class Scoped(nn.Module):
    """What a converted module does: its ops inside its state's scope (a norm, a GEMM and an activation)."""

    def __init__(self, state, d=24):
        super().__init__()
        self._opsadv_state = state
        g = torch.Generator().manual_seed(3)
        self.w = nn.Parameter(torch.rand(d, generator=g) + 0.5)
        self.lin = nn.Parameter(torch.randn(d, 2 * d, generator=g) / d ** 0.5)

    def forward(self, x):
        with self._opsadv_state.scope():
            y = ops.rms_norm(x, self.w, 1e-6)
            return ops.swiglu(ops.gemm(y, self.lin))


def _plain(m, x):
    """The same math in torch (float64)."""
    x, w, lin = x.double(), m.w.double(), m.lin.double()
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w
    g, u = (y @ lin).chunk(2, -1)
    return torch.nn.functional.silu(g) * u


# the cuda backend (Triton interpreter) on fp32 inputs: its GEMMs need the tf32 precision policy
CUDA_POLICY = _policy.Policy(backend="cuda", precision=opsadv.PrecisionPolicy(matmul="tf32"))


def _backends(counts) -> set:
    return {impl.split(".")[0] for impl in counts}


def _x(seed=0, shape=(2, 5, 24)):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), requires_grad=True)


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_explicit_backend_compiles_to_one_graph_and_holds(fresh_dynamo):
    """Model pinned to reference, run under the cuda backend (Triton interpreter): one graph; every forward and
    backward op runs on reference; values and gradients as torch's."""
    m = Scoped(RuntimeState(_policy.Policy(backend="reference")))
    x = _x(1)
    explained = torch._dynamo.explain(m)(x.detach())
    assert explained.graph_count == 1 and explained.graph_break_count == 0, explained.break_reasons
    torch._dynamo.reset()
    with opsadv.use_backend("cuda", precision="tf32"):
        f = torch.compile(m, fullgraph=True, backend="aot_eager")
        with opsadv.trace() as tf:
            out = f(x)
        with opsadv.trace() as tb:
            out.square().sum().backward()
    assert _backends(tf.counts) == _backends(tb.counts) == {"reference"}, (tf.counts, tb.counts)
    assert sum(tf.counts.values()) == sum(tb.counts.values()) == 3
    assert rel_err(out, _plain(m, x)) < 1e-5
    xd = x.detach().double().requires_grad_()
    _plain(m, xd).square().sum().backward()
    assert rel_err(x.grad, xd.grad) < 1e-4
    assert _policy.TRACE.sid == 0 and _policy._scoped.get() is None


def test_auto_model_follows_the_ambient_policy_compiled(fresh_dynamo):
    """Backend "auto" (no overrides): the ops carry no scope; the compiled graph follows the policy in force at
    each call, as the eager model does (no recompile needed: the scope is no graph constant)."""
    m = Scoped(RuntimeState(None))
    f = torch.compile(m, fullgraph=True, backend="aot_eager")
    x = _x(2).detach()
    for name in ("reference", "cuda", "reference"):
        with opsadv.use_backend(name, **({"precision": "tf32"} if name == "cuda" else {})), opsadv.trace() as t:
            f(x)
        assert _backends(t.counts) == {name}, (name, t.counts)


def test_auto_with_overrides_derives_from_the_ambient_at_run_time(fresh_dynamo):
    """Backend "auto" with the conversion's overrides: the scope id stands for the state, whose policy is derived
    from the ambient one when the op runs (not when it was traced)."""
    st = RuntimeState(None, {"options": {"tile_size": 64}})
    m = Scoped(st)
    f = torch.compile(m, fullgraph=True, backend="aot_eager")
    x = _x(3).detach()
    seen = []
    real = st.effective

    def spy():
        p = real()
        seen.append(p.backend)
        return p
    st.effective = spy
    for name in ("reference", "cuda"):
        with opsadv.use_backend(name, **({"precision": "tf32"} if name == "cuda" else {})), opsadv.trace() as t:
            f(x)
        assert _backends(t.counts) == {name}, (name, t.counts)
    assert "reference" in seen and "cuda" in seen


def test_compiled_backward_on_another_thread_keeps_the_models_policy(fresh_dynamo):
    """autograd runs device backwards on its own threads, where the caller's ContextVars are not set: the compiled
    backward ops carry the model's scope themselves."""
    m = Scoped(RuntimeState(_policy.Policy(backend="reference")))
    x = _x(4)
    with opsadv.use_backend("cuda", precision="tf32"):
        out = torch.compile(m, fullgraph=True, backend="aot_eager")(x)
    errors = []

    def backward():
        try:
            with opsadv.use_backend("cuda", precision="tf32"):      # another ambient policy on that thread too
                out.sum().backward()
        except Exception as e:       # noqa: BLE001  (reported by the main thread)
            errors.append(repr(e))
    with opsadv.trace(all_threads=True) as t:
        th = threading.Thread(target=backward)
        th.start()
        th.join(120)
    assert not errors, errors
    assert _backends(t.counts) == {"reference"} and sum(t.counts.values()) == 3, t.counts
    assert x.grad is not None


def test_threads_run_compiled_models_of_two_backends_concurrently(fresh_dynamo):
    a = Scoped(RuntimeState(_policy.Policy(backend="reference")))
    b = Scoped(RuntimeState(CUDA_POLICY))
    fa, fb = (torch.compile(m, fullgraph=True, backend="aot_eager") for m in (a, b))
    x = _x(5).detach()
    fa(x), fb(x)                  # compile once, here
    got, errors = {}, []

    def run(name, f):
        try:
            with opsadv.trace() as t:
                for _ in range(4):
                    f(x)
            got[name] = dict(t.counts)
        except Exception as e:       # noqa: BLE001
            errors.append(repr(e))
    ths = [threading.Thread(target=run, args=(n, f)) for n, f in (("reference", fa), ("cuda", fb))]
    for th in ths:
        th.start()
    for th in ths:
        th.join(300)
    assert not errors, errors
    assert _backends(got["reference"]) == {"reference"} and _backends(got["cuda"]) == {"cuda"}, got
    assert opsadv.current_policy() is _policy._global


def test_scope_ids_are_per_state_and_copies_get_their_own():
    p = _policy.Policy(backend="reference")
    st = RuntimeState(p)
    assert _policy.scope_source(st.sid) is st and _policy.scope_policy(st.sid) is p
    for other in (copy.deepcopy(st), pickle.loads(pickle.dumps(st))):
        assert other.sid != st.sid and _policy.scope_source(other.sid) is other
        assert other.policy == p
    m = Scoped(st)
    mc = copy.deepcopy(m)
    assert mc._opsadv_state is not st and mc._opsadv_state.sid != st.sid


def test_an_unknown_scope_id_is_refused_with_the_reason():
    st = RuntimeState(_policy.Policy(backend="reference"))
    sid = st.sid
    del st
    import gc
    gc.collect()
    x, w = torch.randn(3, 8), torch.rand(8)
    with pytest.raises(InvalidArgumentError) as e:
        torch.ops.opsadv.rms_norm(x, w, 1e-6, None, 0.0, sid)
    assert "scope" in str(e.value) and str(sid) in str(e.value)


def test_eager_op_calls_carry_no_scope_and_the_op_path_matches_the_direct_one():
    """Outside tracing op_scope() is 0 (the policy in force, a scope's included); torch.ops calls given a scope id
    run under it."""
    st = RuntimeState(_policy.Policy(backend="reference"))
    assert _policy.op_scope() == 0
    with opsadv.use_backend("reference"):
        assert _policy.op_scope() == 0
    x, w = torch.randn(3, 8), torch.rand(8)
    with opsadv.use_backend("cuda", precision="tf32"), opsadv.trace() as t:
        y, _, _ = torch.ops.opsadv.rms_norm(x, w, 1e-6, None, 0.0, st.sid)
    assert _backends(t.counts) == {"reference"}, t.counts
    assert _policy._scoped.get() is None
    assert rel_err(y, ops.rms_norm(x, w, 1e-6)) < 1e-6


@pytest.mark.parametrize("strict", [False, True])
def test_exported_programs_carry_no_scope(strict, fresh_dynamo):
    """Scope ids are this process's: an exported program (which outlives it) carries none."""
    m = Scoped(RuntimeState(_policy.Policy(backend="reference")))
    with torch.no_grad():
        ep = torch.export.export(m, (_x(6).detach(),), strict=strict)
    nodes = [n for n in ep.graph.nodes if n.op == "call_function" and "opsadv" in str(n.target)]
    assert len(nodes) == 3
    for n in nodes:
        schema = n.target._schema
        i = [a.name for a in schema.arguments].index("scope")
        val = n.args[i] if len(n.args) > i else n.kwargs.get("scope", 0)
        assert val == 0, (n, val)
