"""The seed's tile_size / max_streams / mem_opt options through use_backend: validated with clear
errors, tile_size caps the tiles the cuda kernels run with (checked on the resolved context and
by running the capped kernels against the reference), max_streams is run_batched's default."""
from __future__ import annotations

import pytest
import torch

import opsadv
from opsadv.core.errors import InvalidArgumentError, UnknownOptionError
from opsadv.core.kernel import cap_tiles, profile_with_tile_cap


def _cuda_available():
    try:
        with opsadv.use_backend("cuda"):
            return True
    except Exception:
        return False


needs_cuda_backend = pytest.mark.skipif(not _cuda_available(), reason="cuda backend unavailable (no GPU, no interpreter)")


def test_cap_tiles_keeps_fitting_configs_and_clips_otherwise():
    cfgs = [{"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8}, {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 4}]
    assert cap_tiles(cfgs, 64) == [cfgs[1]]
    assert cap_tiles(cfgs, 32) == [{"BLOCK_M": 32, "BLOCK_N": 32, "num_warps": 8}]
    assert cap_tiles([(128, 256, 64, 8, 3), (64, 64, 32, 4, 4)], 128) == [(64, 64, 32, 4, 4)]
    assert cap_tiles([(128, 256, 64, 8, 3)], 32) == [(32, 32, 64, 8, 3)]


def test_profile_with_tile_cap_caps_every_list():
    from opsadv.backends.cuda.profiles import H100
    p = profile_with_tile_cap(H100, 64)
    assert p.extra["tile_size"] == 64 and p.name.startswith("h100")
    for passes in p.tiles["flash_attention"].values():
        for lst in passes.values():
            assert lst and all(c["BLOCK_M"] <= 64 and c["BLOCK_N"] <= 64 for c in lst)
    assert max(c["BLOCK_M"] for c in H100.tiles["flash_attention"]["fwd"][128]) == 128   # the original is untouched


@pytest.mark.parametrize("bad", [16, 48, 512, "64", True])
def test_tile_size_validated(bad):
    if not _cuda_available():
        pytest.skip("cuda backend unavailable")
    with pytest.raises(InvalidArgumentError, match="tile_size"):
        opsadv.use_backend("cuda", tile_size=bad)


@needs_cuda_backend
def test_unknown_cuda_option_named():
    with pytest.raises(UnknownOptionError, match="tile_sizes"):
        opsadv.use_backend("cuda", tile_sizes=64)


@needs_cuda_backend
def test_max_streams_validated():
    with pytest.raises(InvalidArgumentError, match="max_streams"):
        opsadv.use_backend("cuda", max_streams=9)


@needs_cuda_backend
def test_tile_size_reaches_the_kernels_and_stays_correct():
    """Under tile_size=32 the resolved context's profile is capped, the GEMM's fixed config is
    capped, and the capped kernels still match the reference."""
    from opsadv.backends.triton_common.gemm import gemm as G
    torch.manual_seed(0)
    a = torch.randn(37, 70, dtype=torch.float16)
    b = torch.randn(70, 45, dtype=torch.float16)
    x = torch.randn(3, 50, 64, dtype=torch.float16)
    q, k, v = (torch.randn(1, 2, 33, 32, dtype=torch.float16) for _ in range(3))
    with opsadv.use_backend("reference"):
        ref_g = opsadv.ops.gemm(a.double(), b.double())
        ref_a = opsadv.ops.flash_attention(q.double(), k.double(), v.double(), causal=True)
    with opsadv.use_backend("cuda", tile_size=32):
        exp = opsadv.explain("gemm", a, b)
        with opsadv.trace() as t:
            out_g = opsadv.ops.gemm(a, b)
            out_a = opsadv.ops.flash_attention(q, k, v, causal=True)
        assert any(i.startswith("cuda.triton") for i in t.counts), t.counts
        from opsadv.core import dispatch
        # the memo is process-wide: other tests in this worker leave contexts with other tile sizes
        ctxs = [r.ctx for (_, _), r in dispatch._memo.items()
                if r.ctx.profile is not None and r.ctx.options.get("tile_size") == 32]
        assert ctxs and all(c.profile.extra.get("tile_size") == 32 for c in ctxs)
    assert exp is not None
    bm, bn, *_ = G._fixed_config("h100", "gemm", 4096, 4096, 32)
    assert bm <= 32 and bn <= 32
    torch.testing.assert_close(out_g.double(), ref_g, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(out_a.double(), ref_a, atol=2e-2, rtol=2e-2)


def test_run_batched_takes_max_streams_from_the_policy(monkeypatch):
    from opsadv.runtime import batched
    seen = {}
    real = batched._validate

    def spy(fn, max_streams, chunk_size, bytes_per_sample):
        seen["max_streams"] = max_streams
        return real(fn, max_streams, chunk_size, bytes_per_sample)
    monkeypatch.setattr(batched, "_validate", spy)
    x = torch.randn(4, 3)
    if _cuda_available():
        with opsadv.use_backend("cuda", max_streams=3):
            out = batched.run_batched(lambda t: t * 2, x)
        assert seen["max_streams"] == 3
        torch.testing.assert_close(out, x * 2)
    batched.run_batched(lambda t: t * 2, x)
    assert seen["max_streams"] == 1
