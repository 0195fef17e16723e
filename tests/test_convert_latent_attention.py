"""Attention whose V head dim differs from Q / K's (multi-head latent attention: DeepSeek-V2 / V3 hand the attention
function q / k of 192 and v of 128) through the converted model's attention function."""
import pytest
import torch

import opsadv
from opsadv.convert import hf_attention as H

from conftest import rel_err

transformers = pytest.importorskip("transformers")
from transformers import MistralConfig, MistralForCausalLM  # noqa: E402



@pytest.mark.parametrize("d_qk,d_v", [(24, 16), (16, 24)])
@pytest.mark.parametrize("masked", [False, True])
def test_value_head_dim_other_than_query_key(d_qk, d_v, masked):
    """Multi-head latent attention hands the attention function V narrower than Q / K (DeepSeek-V3: 192 vs 128):
    the narrower side is zero-padded for our kernels and the output cut back; outputs and gradients equal
    transformers' sdpa (which takes the two dims as they are), default scale 1/sqrt(d_qk) included."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    torch.manual_seed(0)
    model = MistralForCausalLM(MistralConfig(hidden_size=48, intermediate_size=80, num_hidden_layers=1,
                                             num_attention_heads=4, num_key_value_heads=2, vocab_size=97)).eval()
    conv = opsadv.convert_model(model, backend="reference", floor=False)
    module = conv.model.layers[0].self_attn
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 9, d_qk, generator=g, dtype=torch.float64)
    k = torch.randn(2, 2, 9, d_qk, generator=g, dtype=torch.float64)
    v = torch.randn(2, 2, 9, d_v, generator=g, dtype=torch.float64)
    mask = None
    if masked:                                        # transformers' 4-D bool mask: causal + left padding of row 1
        mask = torch.ones(9, 9, dtype=torch.bool).tril()[None, None].repeat(2, 1, 1, 1)
        mask[1, :, :, :3] = False
        mask[1, :, torch.arange(3), torch.arange(3)] = True
    dout = torch.randn(2, 9, 4, d_v, generator=g, dtype=torch.float64)
    res = []
    for fn in (sdpa_attention_forward, H.opsadv_attention_forward):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        with opsadv.use_backend("reference"):
            out, _ = fn(module, *leaves, mask, scaling=None, is_causal=not masked)
        assert out.shape == (2, 9, 4, d_v)
        out.backward(dout)
        res.append([out.detach()] + [t.grad for t in leaves])
    for name, got, want in zip(("out", "dq", "dk", "dv"), res[1], res[0]):
        assert rel_err(got, want) < 1e-10, (name, rel_err(got, want))
