"""Numerics at the edges (issue 37 item 7): the interpreter refuses bf16 dots with a reason, one NaN / Inf
policy for every backend (docs/conformance.md, "Numerics at the edges"), and empty tensors give the empty /
zero result and gradients on every backend without launching a kernel."""
import pytest
import torch
import torch.nn.functional as F

import opsadv
from opsadv.core.errors import NoKernelError
from opsadv.core.layout import SparseLayout

BACKENDS = ("reference", "cuda")     # cuda: its Triton kernels under the interpreter (conftest)


# ---- bf16 under the Triton interpreter ------------------------------------------------------------------
def _bf16_call(op):
    g = torch.Generator().manual_seed(0)
    a = torch.randn(5, 64, generator=g).bfloat16()
    w = torch.randn(64, 32, generator=g).bfloat16()
    return (a, w)


@pytest.mark.parametrize("op", ["gemm", "swiglu_gemm"])
def test_interpreter_refuses_bf16_dots_with_the_reason(op):
    """The interpreter's bf16 tl.dot is wrong (error ~8e10): the Triton GEMMs refuse it, so cuda raises with
    the reasons and "auto" takes another impl -- no garbage result."""
    args = _bf16_call(op)
    fn = getattr(opsadv.ops, op)
    with opsadv.use_backend("cuda"):
        exp = opsadv.explain(op, *args)
        with pytest.raises(NoKernelError) as e:
            fn(*args)
    triton = [c for c in exp.candidates if c.impl.id.startswith("cuda.triton.")]
    assert triton and all(any("Triton interpreter" in r and "bf16" in r for r in c.reasons) for c in triton)
    assert "bf16 tl.dot is wrong" in str(e.value)
    with opsadv.use_backend("auto"):
        got = fn(*args)
    want = args[0].double() @ args[1].double()
    if op == "swiglu_gemm":
        gate, up = want.chunk(2, -1)
        want = F.silu(gate) * up
    assert (got.double() - want).norm() / want.norm() < 2e-2


def test_interpreter_bf16_reason_is_shared_by_the_attention_impls():
    q = torch.randn(1, 2, 33, 32).bfloat16()
    lay = SparseLayout(33, 33, 16, torch.ones(1, 1, 3, 3, dtype=torch.bool), causal=True)
    with opsadv.use_backend("cuda"):
        for op, args in (("flash_attention", (q, q, q)), ("sparse_attention", (q, q, q, lay))):
            exp = opsadv.explain(op, *args)
            c = next(c for c in exp.candidates if c.impl.id == f"cuda.triton.{op}")
            assert any("bf16 tl.dot is wrong" in r for r in c.reasons), (op, c.reasons)
