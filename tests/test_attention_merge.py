"""attention_merge_ (the lse merge of partial attention results, in place): the cuda backend's Triton kernel (the
interpreter on CPU, the GPU where there is one) against float64 math of the formula on odd shapes, rows without keys
on either side, strided accumulators (a row slice of a bigger buffer poisoned outside it, (b, s, h, d) memory, a
strided last dim), float64 accumulators on the reference impl, repeated calls (the fast path), torch.compile and
opcheck, argument errors; the kernel compiled for sm_90."""
import math

import pytest
import torch

import opsadv
from opsadv.errors import InvalidArgumentError, NoKernelError
from opsadv.ops.attention_merge.cases import merge_inputs

from conftest import HAS_CUDA, requires_gpu

DEV = "cuda" if HAS_CUDA else "cpu"
OP = "opsadv.attention_merge_"
IMPL = "cuda.triton.attention_merge_"


def merge64(acc_out, acc_lse, out, lse):
    """The formula in float64, written on its own: new = logaddexp(a, l), weights exp(a - new), exp(l - new); a side
    with lse -inf weighs 0, and a row with both -inf stays 0 / -inf."""
    a, l = acc_lse.double(), lse.double()
    new = torch.logaddexp(a, l)
    none = torch.isneginf(new)
    safe = torch.where(none, 0.0, new)
    wa = torch.where(torch.isneginf(a), 0.0, torch.exp(a - safe))
    wl = torch.where(torch.isneginf(l), 0.0, torch.exp(l - safe))
    return acc_out.double() * wa[..., None] + out.double() * wl[..., None], new


def _merge(acc_out, acc_lse, out, lse, backend="cuda"):
    with opsadv.use_backend(backend, strict=True), opsadv.trace() as t:
        got = opsadv.ops.attention_merge_(acc_out, acc_lse, out, lse)
    assert got[0] is acc_out and got[1] is acc_lse
    return t.counts


def _check(acc_out, acc_lse, out, lse, backend="cuda"):
    want_out, want_lse = merge64(acc_out, acc_lse, out, lse)
    counts = _merge(acc_out, acc_lse, out, lse, backend)
    assert not acc_out.isnan().any() and not acc_lse.isnan().any()
    assert torch.equal(torch.isneginf(acc_lse), torch.isneginf(want_lse))
    fin = torch.isfinite(want_lse)
    torch.testing.assert_close(acc_lse.double()[fin], want_lse[fin], atol=2e-6, rtol=1e-6)
    torch.testing.assert_close(acc_out.double(), want_out, atol=2e-6, rtol=1e-5)
    return counts


@pytest.mark.parametrize("d", [64, 80, 128])
@pytest.mark.parametrize("s", [1, 3, 127])
def test_kernel_matches_float64_formula(s, d):
    g = torch.Generator().manual_seed(s * 1000 + d)
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        args = merge_inputs(dtype, DEV, g, 2, 3, s, d, empty_rows=s >= 3)
        assert _check(*args) == {IMPL: 1}


def test_rows_without_keys_on_either_side():
    """Row 0: no key in the accumulator yet (acc_lse -inf): it takes out exactly.  Row 1: none in the partial: the
    row stays put exactly.  Row 2: none on either side: 0 / -inf, never NaN (even with NaN-free garbage in acc_out)."""
    g = torch.Generator().manual_seed(1)
    acc_out, acc_lse, out, lse = merge_inputs(torch.float16, DEV, g, 1, 2, 4, 64, empty_rows=True)
    before_out, before_lse = acc_out.clone(), acc_lse.clone()
    _check(acc_out, acc_lse, out, lse)
    assert torch.equal(acc_out[:, :, 0], out[:, :, 0].float()) and torch.equal(acc_lse[:, :, 0], lse[:, :, 0])
    assert torch.equal(acc_out[:, :, 1], before_out[:, :, 1]) and torch.equal(acc_lse[:, :, 1], before_lse[:, :, 1])
    assert acc_out[:, :, 2].eq(0).all() and torch.isneginf(acc_lse[:, :, 2]).all()
    # the ring's start: zeros and -inf, merged with a partial that has no key in row 0 either
    acc_out, acc_lse = torch.zeros(1, 1, 3, 80, device=DEV), torch.full((1, 1, 3), -math.inf, device=DEV)
    out = torch.randn(1, 1, 3, 80, device=DEV).half()
    lse = torch.tensor([[[-math.inf, 0.5, 2.0]]], device=DEV)
    _check(acc_out, acc_lse, out, lse)
    assert acc_out[0, 0, 0].eq(0).all() and torch.isneginf(acc_lse[0, 0, 0])
    assert torch.equal(acc_out[0, 0, 1:], out[0, 0, 1:].float())


def test_row_slice_of_a_poisoned_accumulator():
    """The ring's step over rows 5:42 of (b, h, 50, d) accumulators whose other rows hold NaN: only the view's
    elements change (the NaN rows stay NaN bit for bit, no NaN leaks into the view); out in (b, s, h, d) memory and
    lse a strided slice too."""
    g = torch.Generator().manual_seed(2)
    b, h, total, d, lo, hi = 2, 3, 50, 80, 5, 42
    big_out = torch.full((b, h, total, d), math.nan, device=DEV)
    big_lse = torch.full((b, h, total), math.nan, device=DEV)
    src = merge_inputs(torch.bfloat16, DEV, g, b, h, hi - lo, d, empty_rows=True, bshd_out=True)
    acc_out, acc_lse = big_out[:, :, lo:hi], big_lse[:, :, lo:hi]
    acc_out.copy_(src[0])
    acc_lse.copy_(src[1])
    lse = torch.randn(b, h, 2 * (hi - lo), device=DEV)[:, :, ::2]
    lse[:, :, 1:3] = -math.inf
    assert not src[2].is_contiguous() and not lse.is_contiguous()
    _check(acc_out, acc_lse, src[2], lse)
    for t in (big_out, big_lse):
        assert t[:, :, :lo].isnan().all() and t[:, :, hi:].isnan().all()


def test_transposed_accumulators_and_strided_last_dim():
    """Accumulators stored as (b, s, h, d) and viewed as (b, h, s, d); out with a last-dim stride of 2."""
    g = torch.Generator().manual_seed(3)
    acc_out, acc_lse, _, lse = merge_inputs(torch.float32, DEV, g, 2, 4, 33, 64, bshd_acc=True)
    out = torch.randn(2, 4, 33, 128, device=DEV, dtype=torch.float16)[..., ::2]
    assert acc_out.stride()[1:] == (64, 4 * 64, 1) and out.stride(-1) == 2
    _check(acc_out, acc_lse, out, lse)


def test_two_d_tiles_and_float64_out():
    g = torch.Generator().manual_seed(4)
    _check(*merge_inputs(torch.float16, DEV, g, 1, 2, 9, 256, empty_rows=True))
    acc_out, acc_lse, _, lse = merge_inputs(torch.float32, DEV, g, 1, 2, 5, 96)
    _check(acc_out, acc_lse, torch.randn(1, 2, 5, 96, device=DEV, dtype=torch.float64), lse)


def test_repeated_calls_take_the_fast_path():
    """Merging the same partial again and again (as the bench does): each call gives the formula's result on the
    state before it, through the fast path after the first call."""
    g = torch.Generator().manual_seed(5)
    acc_out, acc_lse, out, lse = merge_inputs(torch.bfloat16, DEV, g, 1, 2, 7, 64)
    for _ in range(3):
        want_out, want_lse = merge64(acc_out, acc_lse, out, lse)
        assert _merge(acc_out, acc_lse, out, lse) == {IMPL: 1}
        torch.testing.assert_close(acc_out.double(), want_out, atol=2e-6, rtol=1e-5)
        torch.testing.assert_close(acc_lse.double(), want_lse, atol=2e-6, rtol=1e-6)


def test_float64_accumulators_take_the_reference():
    """float64 accumulators: the Triton impl declares float32 only, so the cuda backend refuses them with that reason
    (explain, and a strict call), and auto serves them with the reference impl (the torch formula)."""
    g = torch.Generator().manual_seed(6)
    args = merge_inputs(torch.float64, DEV, g, 1, 2, 3, 64, empty_rows=True)
    with opsadv.use_backend("cuda", strict=True):
        exp = opsadv.explain("attention_merge_", *args)
        assert exp.chosen is None
        why = {c.impl.id: c.reasons for c in exp.candidates}
        assert "dtype float64 not in ['float32']" in why[IMPL]
        with pytest.raises(NoKernelError, match="dtype float64 not in"):
            opsadv.ops.attention_merge_(*args)
    assert _check(*args, backend="reference") == {"reference.attention_merge_": 1}
    with opsadv.use_backend("cuda"):
        assert opsadv.explain("attention_merge_", *merge_inputs(torch.float16, DEV, g, 1, 2, 3, 64)).chosen == IMPL


def test_empty_rows_need_no_kernel():
    acc_out, acc_lse = torch.zeros(1, 2, 0, 64, device=DEV), torch.zeros(1, 2, 0, device=DEV)
    assert _merge(acc_out, acc_lse, torch.zeros(1, 2, 0, 64, device=DEV), torch.zeros(1, 2, 0, device=DEV)) == {}


def test_compile_fullgraph_and_opcheck():
    g = torch.Generator().manual_seed(7)
    args = merge_inputs(torch.float16, DEV, g, 1, 2, 5, 64, empty_rows=True)
    want = merge64(*args)

    def step(acc_out, acc_lse, out, lse):
        return opsadv.ops.attention_merge_(acc_out, acc_lse, out, lse)

    with opsadv.use_backend("cuda", strict=True):
        acc_out, acc_lse = args[0].clone(), args[1].clone()
        torch._dynamo.reset()
        torch.compile(step, fullgraph=True, backend="aot_eager")(acc_out, acc_lse, *args[2:])
        torch.testing.assert_close(acc_out.double(), want[0], atol=2e-6, rtol=1e-5)
        torch.testing.assert_close(acc_lse.double(), want[1], atol=2e-6, rtol=1e-6)
        torch.library.opcheck(torch.ops.opsadv.attention_merge_.default, (*(t.clone() for t in args), 0),
                              test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))


def _ok():
    return merge_inputs(torch.float16, "cpu", torch.Generator().manual_seed(8), 1, 2, 3, 16)


def _with(i, f):
    def make():
        args = list(_ok())
        args[i] = f(args[i])
        return args
    return make


BAD = {
    "acc_out half": (_with(0, lambda t: t.half()), "acc_out", "dtype in"),
    "acc_out rank 3": (_with(0, lambda t: t[0]), "acc_out", "rank 4"),
    "acc_lse float64": (_with(1, lambda t: t.double()), "acc_lse", "same as acc_out"),
    "acc_lse shape": (_with(1, lambda t: t[:, :, :2]), "acc_lse", "acc_out's (b, h, s, d) without d"),
    "out int32": (_with(2, lambda t: t.to(torch.int32)), "out", "dtype in"),
    "out shape": (_with(2, lambda t: t[..., :8]), "out", "same as acc_out"),
    "lse bf16": (_with(3, lambda t: t.bfloat16()), "lse", "dtype in"),
    "lse shape": (_with(3, lambda t: t[:, :1]), "lse", "same as acc_lse"),
    "lse device": (_with(3, lambda t: t.to("meta")), "lse", "on device cpu"),
    "acc_out broadcast": (_with(0, lambda t: t[:, :1].expand(1, 2, 3, 16)), "acc_out", "broadcast"),
    "acc_out grad": (_with(0, lambda t: t.requires_grad_()), "acc_out", "does not require grad"),
}


@pytest.mark.parametrize("backend", ["cuda", "reference"])
@pytest.mark.parametrize("case", list(BAD))
def test_bad_inputs_name_the_op_and_argument(case, backend):
    make, arg, words = BAD[case]
    args = make()
    with opsadv.use_backend(backend), pytest.raises(InvalidArgumentError) as ei:
        opsadv.ops.attention_merge_(*args)
    msg = str(ei.value)
    assert msg.startswith(f"{OP}: argument '{arg}' must be") and words in msg, msg


@requires_gpu
def test_gpu_ring_sized_merge():
    """b1 h32 s4096 d128 (the ring bench's step), bf16 out in (b, s, h, d) memory, into a row slice."""
    g = torch.Generator().manual_seed(9)
    acc_out, acc_lse, out, lse = merge_inputs(torch.bfloat16, "cuda", g, 1, 32, 4096, 128, empty_rows=True,
                                              bshd_out=True, row_slice=(128, 4096 + 256))
    _check(acc_out, acc_lse, out, lse)


_SM90 = r"""
import json, torch
from opsadv.testing.sm90 import compile_sm90
from opsadv.backends.triton_common.attention_merge import kernels as K, attention_merge as A
res = {}
for d in (64, 128, 256):
    b, h, s = 1, 32, 4096
    acc, out = torch.empty(b, h, s, d), torch.empty(b, s, h, d, dtype=torch.bfloat16).transpose(1, 2)
    lse = torch.empty(b, h, s)
    bs, bd = A.tiles(s, d)
    kw = dict(ACC_O=acc, ACC_L=lse, O=out, L=lse, S=s, H=h, NBLK=s // bs,
              **dict(zip(("s_ab", "s_ah", "s_as", "s_ad"), acc.stride())),
              **dict(zip(("s_lb", "s_lh", "s_ls"), lse.stride())),
              **dict(zip(("s_ob", "s_oh", "s_os", "s_od"), out.stride())),
              **dict(zip(("s_2b", "s_2h", "s_2s"), lse.stride())), D=d, BLOCK_S=bs, BLOCK_D=bd)
    r = compile_sm90(K.merge_kernel, kw, num_warps=4, num_stages=1)
    res[d] = {"spills": r["spill_stores"] + r["spill_loads"], "registers": r["registers"],
              "v4": len(__import__("re").findall(r"ld\.global(?:\.\w+)*\.v4", r["ptx"]))}
print(json.dumps(res))
"""


def test_kernel_compiles_for_sm90_without_spills():
    """The kernel for the H100 (sm_90), d 64 / 128 / 256 (two tiles), contiguous float32 accumulators and bf16 out
    in (b, s, h, d) memory: no spills, 16-byte vector loads."""
    import json
    from conftest import run_sm90_compile
    r = json.loads(run_sm90_compile(["-c", _SM90]).strip().splitlines()[-1])
    assert set(r) == {"64", "128", "256"}
    for d, v in r.items():
        assert v["spills"] == 0 and v["v4"] > 0, (d, v)
