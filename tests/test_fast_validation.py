"""The public ops' fast validation (a few comparisons for the common well-formed call, issue #6) never
accepts what the full checks refuse: every bad call below fails the fast test and raises the full
check's InvalidArgumentError naming the argument.  Plus the fused-weight buffer's cheap aliasing
check (convert/modules.py FusedRows): reused while each parameter is its row block, rebuilt otherwise."""
import importlib

import pytest
import torch

from opsadv.convert.modules import FusedRows
from opsadv.core.errors import InvalidArgumentError

G = importlib.import_module("opsadv.ops.gemm")
A = importlib.import_module("opsadv.ops.flash_attention")

a, b = torch.randn(2, 3, 8), torch.randn(8, 6)
GEMM_OK = dict(a=a, b=b, bias=torch.randn(6), activation="gelu", residual=torch.randn(2, 3, 6), alpha=2.0)
GEMM_BAD = [
    ("a", dict(a=torch.randn(())), "rank"),
    ("a", dict(a=torch.ones(2, 8, dtype=torch.int64)), "dtype"),
    ("b", dict(b=torch.randn(8, 6, 1)), "rank"),
    ("b", dict(b=torch.randn(7, 6)), "K = 8"),
    ("b", dict(b=torch.randn(8, 6, dtype=torch.float16)), "dtype"),
    ("b", dict(b=torch.randn(8, 6, device="meta")), "device"),
    ("bias", dict(bias=torch.randn(5)), "shape"),
    ("bias", dict(bias=torch.randn(6, dtype=torch.float64)), "dtype"),
    ("residual", dict(residual=torch.randn(3, 2, 6)), "shape"),
    ("activation", dict(activation="tanh"), "one of"),
    ("alpha", dict(alpha=float("nan")), "finite"),
    ("alpha", dict(alpha=True), "finite"),
]


@pytest.mark.parametrize("arg,change,words", GEMM_BAD, ids=[f"{a}-{w}" for a, _, w in GEMM_BAD])
def test_gemm(arg, change, words):
    call = {**GEMM_OK, **change}
    args = tuple(call[k] for k in ("a", "b", "bias", "activation", "residual", "alpha"))
    assert not G._gemm_well_formed(*args)
    with pytest.raises(InvalidArgumentError) as e:
        G.validate_gemm(*args)
    assert e.value.arg == arg and words in str(e.value)


def test_gemm_common_calls_are_fast():
    assert G._gemm_well_formed(*GEMM_OK.values())
    assert G._gemm_well_formed(a, b, None, "none", None, 1.0)
    assert not G._gemm_well_formed(a, b, None, "none", None, 1)      # int alpha: full checks (which accept it)
    G.validate_gemm(a, b, None, "none", None, 1)


SWIGLU_BAD = [
    ("w_gate_up", dict(w=torch.randn(8, 7)), "even"),
    ("w_gate_up", dict(w=torch.randn(9, 6)), "K = 8"),
    ("w_gate_up", dict(w=torch.randn(8, 6, dtype=torch.float64)), "dtype"),
    ("bias", dict(bias=torch.randn(3)), "gate|up"),
]


@pytest.mark.parametrize("arg,change,words", SWIGLU_BAD, ids=[f"{a}-{w}" for a, _, w in SWIGLU_BAD])
def test_swiglu(arg, change, words):
    call = {**dict(x=a, w=b, bias=None), **change}
    args = (call["x"], call["w"], call["bias"])
    assert not G._swiglu_well_formed(*args)
    with pytest.raises(InvalidArgumentError) as e:
        G.validate_swiglu(*args)
    assert e.value.arg == arg and words in str(e.value)
    assert G._swiglu_well_formed(a, b, torch.randn(6))


q, k = torch.randn(2, 8, 3, 16), torch.randn(2, 2, 5, 16)
ATT_BAD = [
    ("q", dict(q=torch.randn(8, 3, 16)), "rank"),
    ("k", dict(k=torch.randn(2, 3, 5, 16), v=torch.randn(2, 3, 5, 16)), "dividing"),
    ("k", dict(k=torch.randn(2, 2, 5, 8), v=torch.randn(2, 2, 5, 8)), "head_dim"),
    ("v", dict(v=torch.randn(2, 2, 4, 16)), "(batch, heads, seq)"),
    ("v", dict(v=torch.randn(2, 2, 5, 8)), "head_dim"),
    ("k/v", dict(k=torch.randn(1, 2, 5, 16), v=torch.randn(1, 2, 5, 16)), "batch"),
    ("k", dict(k=torch.randn(2, 2, 5, 16, dtype=torch.float64)), "dtype"),
    ("q", dict(q=torch.randn(2, 8, 3, 0)), "head_dim >= 1"),
    ("causal", dict(causal=1), "a bool"),
    ("scale", dict(scale=0.0), "> 0"),
    ("scale", dict(scale=float("inf")), "finite"),
    ("attn_mask", dict(attn_mask=torch.ones(2, 1, 3, 4, dtype=torch.bool)), "broadcastable"),
]


@pytest.mark.parametrize("arg,change,words", ATT_BAD, ids=[f"{a}-{w}" for a, _, w in ATT_BAD])
def test_attention(arg, change, words):
    call = {**dict(q=q, k=k, v=k.clone(), attn_mask=None, causal=True, scale=None), **change}
    args = tuple(call[n] for n in ("q", "k", "v", "attn_mask", "causal", "scale"))
    assert not A._well_formed(*args)
    with pytest.raises(InvalidArgumentError) as e:
        A.validate(*args)
    assert e.value.arg == arg and words in str(e.value)


def test_attention_common_calls_are_fast():
    assert A._well_formed(q, k, k, None, False, None) and A._well_formed(q, k, k, None, True, 0.25)
    assert not A._well_formed(q, k, k, torch.ones(3, 5, dtype=torch.bool), False, None)   # masks: full checks
    A.validate(q, k, k, torch.ones(3, 5, dtype=torch.bool), False, None)


def test_fused_rows_reused_while_aliased_rebuilt_otherwise():
    ps = [torch.nn.Parameter(torch.randn(r, 4)) for r in (3, 1, 2)]
    f = FusedRows(ps)
    with torch.no_grad():
        buf = f.get()
        assert f.get() is buf and all(p.data_ptr() == buf[i].data_ptr() for p, i in zip(ps, (0, 3, 4)))
        ps[1].data = ps[1].data.clone()                          # replaced storage (e.g. load_state_dict(assign))
        buf2 = f.get()
        assert buf2 is not buf and torch.equal(buf2[3:4], ps[1].detach())
        ps[2].data = buf2[4:5]                                   # a view of buf, but not its full row block
        buf3 = f.get()
        assert buf3 is not buf2 and buf3.shape == (5, 4)
        ps[0].data = ps[0].data.double()                        # another dtype
        assert f.get().dtype == torch.float64
        ps[0].data = f.get()[0:3].t().contiguous().t()          # same values, another (column-major) layout
        assert f.get().shape == (5, 4) and all(p.is_contiguous() for p in ps)
    biases = [torch.nn.Parameter(torch.randn(n)) for n in (3, 2)]
    fb = FusedRows(biases)
    with torch.no_grad():
        bb = fb.get()
        assert fb.get() is bb and biases[1].data_ptr() == bb[3:].data_ptr()
