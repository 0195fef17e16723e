"""The decode suite's FlashInfer peer: the block table -> FlashInfer page list conversion (CPU), and the peer
against our paged_attention on the GPU where FlashInfer is installed (skipped elsewhere)."""
import pytest
import torch

import opsadv
from opsadv.bench import flashinfer_peer
from opsadv.bench.suite_decode import paged_cache


@pytest.mark.parametrize("lens,page", [([0, 1, 16, 17, 40], 16), ([3, 128, 129], 128), ([5], 4)])
def test_csr_pages_lists_each_sequences_used_pages_in_order(lens, page):
    per = max(-(-n // page) for n in lens) + 1
    b = len(lens)
    g = torch.Generator().manual_seed(0)
    table = torch.randperm(b * per, generator=g).to(torch.int32).view(b, per)
    indptr, indices, last = flashinfer_peer.csr_pages(table, torch.tensor(lens, dtype=torch.int32), page)
    assert indptr.dtype == indices.dtype == last.dtype == torch.int32
    for i, n in enumerate(lens):
        used = -(-n // page)
        assert indptr[i + 1] - indptr[i] == used
        assert indices[indptr[i]:indptr[i + 1]].tolist() == table[i, :used].tolist()
        assert last[i].item() == (n - (used - 1) * page if used else 0)
        if used:
            assert 1 <= last[i].item() <= page


def test_decode_peer_is_none_without_flashinfer_or_cuda():
    q = torch.randn(1, 1, 4, 8)
    kc, vc, table, lens, _, _ = paged_cache(1, 5, 2, 8, 4, torch.float32, "cpu")
    assert flashinfer_peer.decode_peer(q, kc, vc, table, lens) is None


@pytest.mark.skipif(not torch.cuda.is_available() or flashinfer_peer.why_missing() is not None,
                    reason="FlashInfer on a GPU")
@pytest.mark.parametrize("tc", [False, True])
def test_gpu_flashinfer_peer_matches_paged_attention(tc):
    kc, vc, table, lens, _, _ = paged_cache(3, 300, 2, 128, 16, torch.bfloat16, "cuda")
    q = torch.randn(3, 1, 8, 128, device="cuda", dtype=torch.bfloat16)
    want = opsadv.ops.paged_attention(q, kc, vc, table, lens).transpose(1, 2).float()
    got = flashinfer_peer.decode_peer(q, kc, vc, table, lens, tensor_cores=tc)().float()
    assert ((got - want).norm() / want.norm()).item() < 1e-2
