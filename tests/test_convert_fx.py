"""torch.fx rewrite of arbitrary nn.Modules: attention, LayerNorm/RMSNorm written in primitives,
Linear+activation; state_dict unchanged; untraceable modules skipped with a reason."""
import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import opsadv


class Block(nn.Module):
    def __init__(self, d=32, h=4, act="gelu"):
        super().__init__()
        self.h, self.act = h, act
        self.qkv, self.o = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.w, self.b = nn.Parameter(torch.rand(d) + 0.5), nn.Parameter(torch.randn(d) * 0.1)
        self.g = nn.Parameter(torch.rand(d) + 0.5)
        self.fc1, self.fc2 = nn.Linear(d, 48), nn.Linear(48, d)

    def forward(self, x, mask):
        B, S, D = x.shape
        mu = x.mean(-1, keepdim=True)
        var = ((x - mu) ** 2).mean(-1, keepdim=True)
        y = (x - mu) / torch.sqrt(var + 1e-5) * self.w + self.b                  # LayerNorm in primitives
        q, k, v = self.qkv(y).view(B, S, 3, self.h, D // self.h).permute(2, 0, 3, 1, 4)
        a = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(D // self.h) + mask, dim=-1) @ v
        x = x + self.o(a.transpose(1, 2).reshape(B, S, D))
        z = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.g     # RMSNorm in primitives
        h = self.fc1(z)
        h = F.gelu(h, approximate="tanh") if self.act == "gelu_tanh" else F.silu(h) if self.act == "silu" else F.gelu(h)
        return x + self.fc2(h)


class Net(nn.Module):
    def __init__(self, act="gelu"):
        super().__init__()
        self.blocks = nn.ModuleList([Block(act=act), Block(act=act)])
        self.head = nn.Linear(32, 11)

    def forward(self, x, mask):
        for b in self.blocks:
            x = b(x, mask)
        return self.head(x)


class MaskedFillAttention(nn.Module):
    def forward(self, q, k, v, pad):
        s = torch.matmul(q, k.transpose(-1, -2)) * 0.125
        s = s.masked_fill(pad, float("-inf"))
        return F.softmax(s, dim=-1) @ v


class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        if x.sum() > 0:                      # data-dependent control flow: not traceable
            return F.relu(self.lin(x))
        return self.lin(x)


def _inputs(b=2, s=13):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(b, s, 32, generator=g)
    mask = torch.zeros(b, 1, s, s)
    mask[-1, ..., s - 4:] = float("-inf")
    return x, mask


@pytest.mark.parametrize("act", ["gelu", "gelu_tanh", "silu"])
def test_fx_rewrites_blocks(reference_backend, act):
    torch.manual_seed(0)
    orig = Net(act)
    x, mask = _inputs()
    conv = opsadv.convert_model(copy.deepcopy(orig), example_inputs=(x, mask))
    assert type(conv) is Net                                     # the root keeps its class; blocks rewritten
    rep = conv.opsadv_report
    text = str(rep)
    for what in ("opsadv.flash_attention", "opsadv.layer_norm", "opsadv.rms_norm", f"activation='{act}'"):
        assert what in text, text
    assert rep.validation["passed"]
    assert sorted(conv.state_dict()) == sorted(orig.state_dict())
    with opsadv.trace() as t, torch.no_grad():
        out = conv(x, mask)
    ref = orig(x, mask)
    assert torch.allclose(out, ref, rtol=1e-4, atol=1e-5)
    assert sum(t.counts.values()) == 2 * 4


def test_fx_gradients(reference_backend):
    torch.manual_seed(1)
    orig = Net()
    x, mask = _inputs()
    conv = opsadv.convert_model(copy.deepcopy(orig), example_inputs=(x, mask))
    orig(x, mask).square().mean().backward()
    conv(x, mask).square().mean().backward()
    for (n, po), (_, pc) in zip(orig.named_parameters(), conv.named_parameters()):
        assert torch.allclose(po.grad, pc.grad, rtol=1e-4, atol=1e-6), n


def test_fx_masked_fill_and_root_rewrite(reference_backend):
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, 3, 7, 16, generator=g) for _ in range(3))
    pad = torch.zeros(2, 1, 1, 7, dtype=torch.bool)
    pad[0, ..., 5:] = True
    m = MaskedFillAttention()
    ref = m(q, k, v, pad)
    conv = opsadv.convert_model(m, example_inputs=(q, k, v, pad))
    assert isinstance(conv, torch.fx.GraphModule)                # its own forward was the pattern
    assert "GraphModule" in " ".join(conv.opsadv_report.notes)
    assert torch.allclose(conv(q, k, v, pad), ref, atol=1e-5)


def test_fx_untraceable_is_skipped_with_reason(reference_backend):
    m = Branchy()
    conv = opsadv.convert_model(m, example_inputs=(torch.randn(3, 8),))
    assert conv is m
    assert any(c.kind == "skipped" and "torch.fx cannot trace" in c.reason for c in conv.opsadv_report.changes)


def test_generic_module_needs_example_inputs():
    with pytest.raises(opsadv.errors.InvalidArgumentError, match="example_inputs"):
        opsadv.convert_model(Net(), backend="reference")
