"""A convert_model(precision=...) that is refused by validation or fails part-way leaves the model as it was: the
same parameter and buffer objects, in their own dtypes, with their exact values and gradients (issue 37 item 9)."""
import pytest
import torch
from torch import nn

import opsadv
from opsadv.convert import ValidationError, api as _api, validate as _val


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(24, 40)
        self.norm = nn.LayerNorm(40)
        self.bn = nn.BatchNorm1d(40)       # float running stats and an int64 counter
        self.out = nn.Linear(40, 8, bias=False)

    def forward(self, x):
        return self.out(self.bn(self.norm(self.proj(x))))


def _model():
    torch.manual_seed(0)
    m = Net()
    m(torch.randn(6, 24)).sum().backward()   # gradients too, and non-default running stats
    m.eval()
    return m


def _snapshot(m):
    return ({n: (p, p.dtype, p.detach().clone(), p.grad.clone()) for n, p in m.named_parameters()},
            {n: (b, b.dtype, b.clone()) for n, b in m.named_buffers()})


def _assert_unchanged(m, snap):
    params, buffers = snap
    assert set(dict(m.named_parameters())) == set(params)
    for n, p in m.named_parameters():
        obj, dtype, val, grad = params[n]
        assert p is obj and p.dtype == dtype and torch.equal(p.detach(), val), n
        assert p.grad is not None and p.grad.dtype == dtype and torch.equal(p.grad, grad), n
    for n, b in m.named_buffers():
        obj, dtype, val = buffers[n]
        assert b is obj and b.dtype == dtype and torch.equal(b, val), n
    assert not hasattr(m, "_opsadv_state")


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_refused_conversion_restores_dtypes_and_values(monkeypatch, precision):
    m = _model()
    snap = _snapshot(m)
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[precision]
    monkeypatch.setitem(_val.REL_LIMIT, dtype, -1.0)               # every comparison fails
    monkeypatch.setattr(_val, "NOISE_FACTOR", -1.0)                # the float32 rule too
    with pytest.raises(ValidationError):
        opsadv.convert_model(m, backend="reference", precision=precision,
                             example_inputs=torch.randn(5, 24, dtype=dtype), floor=False)
    _assert_unchanged(m, snap)
    y = m(torch.randn(3, 24))
    assert y.dtype == torch.float32


def test_failing_conversion_restores_dtypes_and_values(monkeypatch):
    m = _model()
    snap = _snapshot(m)
    steps = _api._steps

    def failing_steps(*a, **kw):
        for kind, label, apply in steps(*a, **kw):
            yield kind, label, apply
        raise RuntimeError("a pass failed")
    monkeypatch.setattr(_api, "_steps", failing_steps)
    with pytest.raises(RuntimeError, match="a pass failed"):
        opsadv.convert_model(m, backend="reference", precision="fp16", example_inputs=torch.randn(5, 24).half(),
                             floor=False)
    _assert_unchanged(m, snap)


def test_bad_example_inputs_after_the_cast_restore_too():
    m = _model()
    snap = _snapshot(m)
    with pytest.raises(RuntimeError):
        opsadv.convert_model(m, backend="reference", precision="fp16", example_inputs=torch.randn(5, 7).half(),
                             floor=False)
    _assert_unchanged(m, snap)


def test_a_kept_conversion_is_cast():
    m = _model()
    conv = opsadv.convert_model(m, backend="reference", precision="fp16", example_inputs=torch.randn(5, 24).half(),
                                floor=False)
    assert {p.dtype for p in conv.parameters()} == {torch.float16}
