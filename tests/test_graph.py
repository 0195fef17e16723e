"""Every op is a torch.library op: opcheck passes, torch.compile(fullgraph=True) has no graph
break, and torch.export round-trips through a file into a fresh process."""
import importlib
import subprocess
import sys

import pytest
import torch
from torch.library import opcheck

import opsadv

pytestmark = pytest.mark.usefixtures("reference_backend")


def _g(*shape, dtype=torch.float32):
    return torch.randn(*shape, dtype=dtype, requires_grad=True)


def _layout():
    return opsadv.SparseLayout(20, 20, 8, torch.zeros(1, 1, 3, 3, dtype=torch.bool), causal=True, window=(5, 0),
                               key_padding_mask=torch.arange(20)[None] < torch.tensor([[17], [20]]))


OPCHECK = {
    "flash_attention": lambda: (torch.ops.opsadv.flash_attention.default, (_g(2, 4, 5, 8), _g(2, 2, 7, 8), _g(2, 2, 7, 8), None, True, None)),
    "flash_attention_mask": lambda: (torch.ops.opsadv.flash_attention.default, (_g(1, 2, 5, 8), _g(1, 2, 5, 8), _g(1, 2, 5, 8), torch.rand(1, 1, 5, 5) > 0.3, False, 0.5)),
    "sparse_attention": lambda: (torch.ops.opsadv.sparse_attention.default,
                                 (_g(2, 2, 20, 8), _g(2, 1, 20, 8), _g(2, 1, 20, 8), _layout().block_mask,
                                  _layout().key_padding_mask, None, 8, True, 5, 0, 0, None)),
    # train=True: the traced training path (train bucket forward, that impl's own backward)
    "flash_attention_train": lambda: (torch.ops.opsadv.flash_attention.default, (_g(2, 4, 5, 8), _g(2, 2, 7, 8), _g(2, 2, 7, 8), None, True, None, True)),
    "sparse_attention_train": lambda: (torch.ops.opsadv.sparse_attention.default,
                                       (_g(2, 2, 20, 8), _g(2, 1, 20, 8), _g(2, 1, 20, 8), _layout().block_mask,
                                        _layout().key_padding_mask, None, 8, True, 5, 0, 0, None, False, -1, True)),
    "gemm": lambda: (torch.ops.opsadv.gemm.default, (_g(2, 3, 8), _g(8, 6), _g(6), "gelu_tanh", _g(2, 3, 6), 0.5)),
    "swiglu_gemm": lambda: (torch.ops.opsadv.swiglu_gemm.default, (_g(3, 8), _g(8, 12), None)),
    "layer_norm": lambda: (torch.ops.opsadv.layer_norm.default, (_g(3, 16), _g(16), _g(16), 1e-5, _g(3, 16))),
    "rms_norm": lambda: (torch.ops.opsadv.rms_norm.default, (_g(2, 3, 16), _g(16), 1e-6, None, 1.0)),
}


@pytest.mark.parametrize("name", list(OPCHECK))
def test_opcheck(name):
    op, args = OPCHECK[name]()
    opcheck(op, args)


def _block(x, wq, w1, w2, lnw):
    """A tiny transformer block written with opsadv ops only."""
    b, s, d = x.shape
    h, r = opsadv.ops.rms_norm(x, lnw, 1e-6, residual=x * 0.5)
    qkv = opsadv.ops.gemm(h, wq)
    q, k, v = qkv.view(b, s, 3, 2, d // 2).permute(2, 0, 3, 1, 4)
    a = opsadv.ops.flash_attention(q, k, v, causal=True).transpose(1, 2).reshape(b, s, d)
    y = opsadv.ops.layer_norm(a + r, lnw, None, 1e-5)
    return opsadv.ops.gemm(opsadv.ops.swiglu_gemm(y, w1), w2, residual=y)


def _block_args():
    torch.manual_seed(0)
    d = 16
    return torch.randn(2, 5, d), torch.randn(d, 3 * d) * 0.2, torch.randn(d, 4 * d) * 0.2, torch.randn(2 * d, d) * 0.2, torch.randn(d)


def test_compile_fullgraph_no_graph_break():
    args = _block_args()
    torch._dynamo.reset()
    from torch._dynamo.utils import counters
    counters.clear()
    compiled = torch.compile(_block, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(*args), _block(*args))
    assert not counters["graph_break"]


def test_compile_inductor_with_grad():
    args = [a.clone().requires_grad_(True) for a in _block_args()]
    torch._dynamo.reset()
    out = torch.compile(_block, fullgraph=True)(*args)
    out.square().sum().backward()
    ref_args = [a.detach().clone().requires_grad_(True) for a in args]
    _block(*ref_args).square().sum().backward()
    for a, b in zip(args, ref_args):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-5)


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        x, *ws = _block_args()
        self.ws = torch.nn.ParameterList(ws)

    def forward(self, x):
        return _block(x, *self.ws)


def test_export_round_trip_fresh_process(tmp_path):
    m = Block()
    x = _block_args()[0]
    ep = torch.export.export(m, (x,))
    targets = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
    assert {"opsadv.flash_attention.default", "opsadv.gemm.default", "opsadv.rms_norm.default"} <= targets
    path = tmp_path / "block.pt2"
    torch.export.save(ep, path)
    torch.save(x, tmp_path / "x.pt")
    expected = m(x)
    torch.save(expected, tmp_path / "expected.pt")
    code = f"""
import torch, opsadv
opsadv.use_backend("reference")
ep = torch.export.load({str(path)!r})
x = torch.load({str(tmp_path / 'x.pt')!r})
out = ep.module()(x)
exp = torch.load({str(tmp_path / 'expected.pt')!r})
torch.testing.assert_close(out, exp)
print("ROUND TRIP OK")
"""
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert "ROUND TRIP OK" in p.stdout, p.stderr


def test_eager_paths_agree_with_torch_ops_path():
    """The DIRECT / autograd.Function fast paths give exactly what the torch.library path gives."""
    from opsadv.core import op_common as _common
    args = _block_args()
    fast_args = [a.clone().requires_grad_(True) for a in args]
    slow_args = [a.clone().requires_grad_(True) for a in args]
    out_fast = _block(*fast_args)
    orig = _common.eager_mode
    A, G, N = (importlib.import_module(f"opsadv.ops.{m}") for m in ("flash_attention", "gemm", "norm"))
    try:
        for mod in (A, G, N):
            mod.eager_mode = lambda *t: _common.TORCH_OPS
        from opsadv.core import dispatch
        dispatch._fast.clear()            # the ops' fast path would replay the eager calls just made
        out_slow = _block(*slow_args)
    finally:
        for mod in (A, G, N):
            mod.eager_mode = orig
    assert torch.equal(out_fast, out_slow)
    g = torch.randn_like(out_fast)
    out_fast.backward(g)
    out_slow.backward(g)
    for a, b in zip(fast_args, slow_args):
        assert torch.equal(a.grad, b.grad)
    with torch.no_grad():
        assert torch.equal(_block(*args), out_fast)
