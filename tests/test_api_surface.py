"""The Python surface refuses mistakes where they are made, with the valid choices named (issue 36):
explain's keywords, Optimizer's seed parameters and devices."""
import pytest
import torch

import opsadv
from opsadv.core.opdef import OPS
from opsadv.errors import InvalidArgumentError, OpsadvError, UnknownKeywordError


def test_explain_refuses_a_misspelled_keyword_with_the_valid_ones():
    q = torch.randn(1, 2, 8, 16)
    with pytest.raises(UnknownKeywordError) as ei:
        opsadv.explain("flash_attention", q, q, q, causl=True)
    msg = str(ei.value)
    assert isinstance(ei.value, TypeError) and isinstance(ei.value, OpsadvError)   # as the op itself raises
    assert "causl" in msg and "causal" in msg and "attn_mask" in msg and "did you mean causal?" in msg
    with pytest.raises(TypeError):
        opsadv.ops.flash_attention(q, q, q, causl=True)
    assert opsadv.explain("flash_attention", q, q, q, causal=True).chosen      # valid keywords still work
    assert opsadv.explain("flash_attention", q, q, q, causal=True, backward=True).spec.backward


@pytest.mark.parametrize("op", OPS)
def test_explain_checks_every_ops_keywords(op):
    with pytest.raises(UnknownKeywordError, match=f"opsadv.ops.{op}"):
        opsadv.explain(op, torch.ones(2, 2), no_such_keyword=1)


@pytest.mark.parametrize("seeds, arg", [({"tile_size": 48}, "tile_size"), ({"tile_size": 16}, "tile_size"),
                                        ({"max_streams": 9}, "max_streams"), ({"mem_opt": 4}, "mem_opt"),
                                        ({"floor_mode": "fast"}, "floor_mode"), ({"cuda_graphs": 1}, "cuda_graphs")])
def test_optimizer_validates_seed_values_at_construction(seeds, arg):
    with pytest.raises(InvalidArgumentError, match=f"opsadv.Optimizer: argument '{arg}'"):
        opsadv.Optimizer(**seeds)


def test_optimizer_refuses_unknown_seed_names_at_construction():
    with pytest.raises(InvalidArgumentError) as ei:
        opsadv.Optimizer(num_streams=4)
    msg = str(ei.value)
    assert "num_streams" in msg and "did you mean max_streams=4?" in msg and "tile_size" in msg
    assert "\n" not in msg
    opsadv.Optimizer(tile_size=64, max_streams=4, mem_opt=2)        # valid ones still construct


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_optimizer_refuses_cuda_without_cuda_in_one_line():
    with pytest.raises(InvalidArgumentError) as ei:
        opsadv.Optimizer(device="cuda")
    msg = str(ei.value)
    assert "\n" not in msg and "device" in msg and "'cpu'" in msg
    with pytest.raises(InvalidArgumentError, match="a torch device such as"):
        opsadv.Optimizer(device="gpu")
