"""Bad input gets a clear opsadv.errors exception naming the op, the argument, what was expected."""
import pytest
import torch

import opsadv
from opsadv.errors import InvalidArgumentError, OpsadvError

pytestmark = pytest.mark.usefixtures("reference_backend")
q = torch.randn(2, 4, 8, 16)
kv = torch.randn(2, 2, 8, 16)


@pytest.mark.parametrize("call, arg, fragment", [
    (lambda: opsadv.ops.flash_attention(q[0], kv, kv), "q", "rank 4"),
    (lambda: opsadv.ops.flash_attention(q, torch.randn(2, 2, 8, 32), kv), "k", "head_dim 16"),
    (lambda: opsadv.ops.flash_attention(q, torch.randn(2, 3, 8, 16), torch.randn(2, 3, 8, 16)), "k", "dividing q's 4"),
    (lambda: opsadv.ops.flash_attention(q, kv.half(), kv), "k", "dtype float32"),
    (lambda: opsadv.ops.flash_attention(q, kv, kv, causal=1), "causal", "a bool"),
    (lambda: opsadv.ops.flash_attention(q, kv, kv, scale=-1.0), "scale", "> 0"),
    (lambda: opsadv.ops.flash_attention(q, kv, kv, attn_mask=torch.ones(3, 3, dtype=torch.bool)), "attn_mask", "broadcastable"),
    (lambda: opsadv.ops.flash_attention(q, kv, kv, attn_mask=torch.ones(8, 8, dtype=torch.int32)), "attn_mask", "dtype bool"),
    (lambda: opsadv.ops.flash_attention(q.int(), kv, kv), "q", "dtype in"),
    (lambda: opsadv.ops.flash_attention(q[..., :0], kv[..., :0], kv[..., :0]), "q", "head_dim >= 1"),
    (lambda: opsadv.ops.flash_attention(q, kv, torch.randn(2, 2, 9, 16)), "v", "same as k"),
    (lambda: opsadv.ops.gemm(torch.randn(3, 5), torch.randn(6, 4)), "b", "K = 5"),
    (lambda: opsadv.ops.gemm(torch.randn(3, 5), torch.randn(5, 4), activation="tanh"), "activation", "one of"),
    (lambda: opsadv.ops.gemm(torch.randn(3, 5), torch.randn(5, 4), bias=torch.randn(5)), "bias", "(4,)"),
    (lambda: opsadv.ops.gemm(torch.randn(3, 5), torch.randn(5, 4), residual=torch.randn(3, 5)), "residual", "(3, 4)"),
    (lambda: opsadv.ops.gemm(torch.randn(3, 5), torch.randn(5, 4), alpha=float("nan")), "alpha", "finite"),
    (lambda: opsadv.ops.swiglu_gemm(torch.randn(3, 5), torch.randn(5, 7)), "w_gate_up", "even"),
    (lambda: opsadv.ops.layer_norm(torch.randn(3, 5), torch.randn(4)), "weight", "(5,)"),
    (lambda: opsadv.ops.layer_norm(torch.randn(3, 5), eps=-1.0), "eps", ">= 0"),
    (lambda: opsadv.ops.rms_norm(torch.randn(3, 5), residual=torch.randn(3, 4)), "residual", "(3, 5)"),
    (lambda: opsadv.ops.rms_norm(torch.randn(3, 5), torch.randn(5, dtype=torch.float64)), "weight", "dtype float32"),
    (lambda: opsadv.ops.rms_norm(torch.randn(3, 5), offset="one"), "offset", "finite float"),
    (lambda: opsadv.ops.sparse_attention(q, kv, kv, layout="window"), "layout", "SparseLayout"),
])
def test_bad_input_names_op_and_argument(call, arg, fragment):
    with pytest.raises(InvalidArgumentError) as ei:
        call()
    e = ei.value
    assert e.arg == arg and fragment in str(e) and str(e).startswith("opsadv.")
    assert isinstance(e, OpsadvError) and isinstance(e, ValueError)


def test_mixed_devices_named():
    meta = torch.empty(2, 2, 8, 16, device="meta")
    with pytest.raises(InvalidArgumentError, match="'k' must be on device cpu"):
        opsadv.ops.flash_attention(q, meta, kv)


def test_bad_layout_construction():
    with pytest.raises(InvalidArgumentError, match="block_mask"):
        opsadv.SparseLayout(10, 10, 4, torch.zeros(1, 1, 2, 2, dtype=torch.bool))   # needs 3x3 blocks
    with pytest.raises(InvalidArgumentError, match="cu_seqlens"):
        opsadv.SparseLayout(10, 10, 4, torch.zeros(1, 1, 3, 3, dtype=torch.bool), cu_seqlens=torch.tensor([0, 4, 9]))


def test_unknown_backend_and_option():
    from opsadv.errors import BackendUnavailableError
    with pytest.raises(BackendUnavailableError, match="no backend named 'nope'; known backends"):
        opsadv.use_backend("nope")
    with pytest.raises(InvalidArgumentError, match="precision"):
        opsadv.use_backend("reference", precision="fp8")
    with pytest.raises(InvalidArgumentError, match="takes none"):
        opsadv.use_backend("reference", tile_size=64)
    with pytest.raises(InvalidArgumentError, match="profile"):
        opsadv.use_backend("reference", profile="h100")
