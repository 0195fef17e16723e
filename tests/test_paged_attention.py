"""The paged_attention op: the reference and the cuda backend's Triton kernels (interpreter on CPU, the GPU where
present) against an independent float64 oracle (pages gathered key by key into contiguous K / V, a softmax per
query head), with odd page tables (shuffled, shared prefix pages, a partly filled last page, NaN in unused slots,
-1 past each table row), seqlens_k of 0 / 1 / page multiples, decode and packed queries with empty segments,
appends across a page boundary, GQA / MQA, forced split-KV, lse; the custom ops against their fakes, compile,
the split heuristic, bad inputs.  The fp8 (e4m3) cache: quantize_kv's round-trip bound, the append kernel's
quantization bit for bit against torch's cast, and the attention against the oracle on the dequantized cache."""
import importlib
import math

import pytest
import torch

import opsadv
from opsadv.errors import InvalidArgumentError
from opsadv.ops.paged_attention import kv_scales, quantize_kv
from opsadv.ops.paged_attention.cases import paged_inputs

from conftest import HAS_CUDA, rel_err, requires_gpu

DEV = "cuda" if HAS_CUDA else "cpu"
PA = importlib.import_module("opsadv.backends.triton_common.paged_attention.paged_attention")
TOL = {torch.float64: 1e-10, torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.5e-2}


def oracle(q, kc, vc, bt, lens, cu, causal, scale, k_new=None, v_new=None):
    """float64 (out, lse, k_cache, v_cache after the append): every key gathered one at a time."""
    kc, vc, q = kc.double().cpu().clone(), vc.double().cpu().clone(), q.double().cpu()
    bt, lens = bt.cpu().tolist(), lens.cpu().tolist()
    hq, d = q.shape[-2:]
    ps, hkv = kc.shape[1], kc.shape[2]
    rows = q.reshape(-1, hq, d)
    if cu is not None:
        segs = [(a, b - a) for a, b in zip(cu.tolist(), cu.tolist()[1:])]
    else:
        segs = [(i * q.shape[1], q.shape[1]) for i in range(len(lens))]
    if k_new is not None:
        kn, vn = k_new.double().cpu().reshape(-1, hkv, d), v_new.double().cpu().reshape(-1, hkv, d)
        for b, (r0, n) in enumerate(segs):
            for i in range(n):
                pos = lens[b] - n + i
                kc[bt[b][pos // ps], pos % ps] = kn[r0 + i]
                vc[bt[b][pos // ps], pos % ps] = vn[r0 + i]
    out = torch.zeros(rows.shape, dtype=torch.float64)
    lse = torch.full(rows.shape[:-1], -math.inf, dtype=torch.float64)
    for b, (r0, n) in enumerate(segs):
        L = lens[b]
        if n == 0 or L == 0:
            continue
        K = torch.stack([kc[bt[b][t // ps], t % ps] for t in range(L)])       # (L, Hkv, D)
        V = torch.stack([vc[bt[b][t // ps], t % ps] for t in range(L)])
        for h in range(hq):
            kh = h // (hq // hkv)
            s = rows[r0:r0 + n, h] @ K[:, kh].T * scale                        # (n, L)
            if causal:
                for i in range(n):
                    s[i, max(0, L - n + i + 1):] = -math.inf
            m = torch.logsumexp(s, -1)
            p = torch.softmax(s, -1).nan_to_num(0.0)
            out[r0:r0 + n, h] = p @ V[:, kh]
            lse[r0:r0 + n, h] = m
    return out.reshape(q.shape), lse.reshape(q.shape[:-1]), kc, vc


# name -> paged_inputs arguments (+ causal, splits forced on the cuda impl)
SCENARIOS = {
    "decode_gqa_lens_0_1_page": dict(hq=4, hkv=2, d=32, page=16, lens=[0, 1, 16, 37, 64]),
    "decode_mqa_split": dict(hq=8, hkv=1, d=64, page=8, lens=[300, 5, 64], splits=4),
    "prefill_more_q_than_k_shared": dict(hq=4, hkv=4, d=16, page=8, lens=[5, 40, 3], s_q=5, shared_prefix=1),
    "varlen_append_boundary_split": dict(hq=6, hkv=2, d=40, page=8, lens=[9, 4, 30, 16], q_counts=[2, 0, 7, 1],
                                         append=True, splits=3),
    "noncausal_shared_prefix": dict(hq=2, hkv=1, d=48, page=16, lens=[33, 41, 17], s_q=3, shared_prefix=2,
                                    causal=False),
}


def _build(dtype, seed=0, **sc):
    sc = dict(sc)
    causal, _ = sc.pop("causal", True), sc.pop("splits", None)
    g = torch.Generator().manual_seed(seed)
    args, kw = paged_inputs(dtype, DEV, g, **sc)
    kw.update(causal=causal, return_lse=True)
    return args, kw


def _check(args, kw, out, lse, dtype, kc_before, vc_before):
    q, kc, vc, bt, lens = args
    want, wlse, wkc, wvc = oracle(q, kc_before, vc_before, bt, lens, kw.get("cu_seqlens_q"), kw["causal"],
                                  1 / math.sqrt(q.shape[-1]), kw.get("k_new"), kw.get("v_new"))
    assert out.shape == q.shape and out.dtype == q.dtype and lse.shape == q.shape[:-1]
    assert lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert not out.isnan().any() and not lse.isnan().any()        # the cuda impl poisons its outputs on CPU
    assert torch.equal(torch.isneginf(lse.cpu()), torch.isneginf(wlse))
    fin = torch.isfinite(wlse)
    assert (out.cpu()[~fin] == 0).all()                           # no key seen: zeros
    assert rel_err(out.cpu(), want) < TOL[dtype]
    assert (lse.cpu()[fin].double() - wlse[fin]).abs().max() < TOL[dtype] * 10
    # the cache: appended rows where the oracle put them, every other slot (NaN ones too) untouched
    assert torch.equal(kc.cpu().double().isnan(), wkc.isnan()) and torch.equal(vc.cpu().double().isnan(), wvc.isnan())
    assert torch.equal(kc.cpu().double().nan_to_num(), wkc.to(dtype).double().nan_to_num())
    assert torch.equal(vc.cpu().double().nan_to_num(), wvc.to(dtype).double().nan_to_num())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("name", list(SCENARIOS))
@pytest.mark.parametrize("backend", ["cuda", "reference"])
def test_matches_float64_oracle(backend, name, dtype, monkeypatch):
    sc = SCENARIOS[name]
    monkeypatch.setattr(PA, "SPLITS_OVERRIDE", sc.get("splits"))
    args, kw = _build(dtype, **sc)
    kc_before, vc_before = args[1].clone(), args[2].clone()
    with opsadv.use_backend(backend, strict=True), opsadv.trace() as t:
        out, lse = opsadv.ops.paged_attention(*args, **kw)
    assert t.counts == {f"{backend}.{'triton.' if backend == 'cuda' else ''}paged_attention": 1}
    _check(args, kw, out, lse, dtype, kc_before, vc_before)


def test_reference_float64():
    args, kw = _build(torch.float64, **SCENARIOS["varlen_append_boundary_split"])
    before = args[1].clone(), args[2].clone()
    with opsadv.use_backend("reference"):
        out, lse = opsadv.ops.paged_attention(*args, **kw)
    _check(args, kw, out, lse, torch.float64, *before)


@pytest.mark.parametrize("splits", [1, 2, 7])
def test_split_kv_agrees_with_one_pass(splits, monkeypatch):
    """Forced splits (7 leaves some slices empty) give the one-pass result: the merge is exact up to rounding."""
    args, kw = _build(torch.float32, seed=3, hq=4, hkv=2, d=32, page=16, lens=[200, 0, 70], s_q=2)
    monkeypatch.setattr(PA, "SPLITS_OVERRIDE", 1)
    with opsadv.use_backend("cuda", strict=True):
        o1, l1 = opsadv.ops.paged_attention(*args, **kw)
        monkeypatch.setattr(PA, "SPLITS_OVERRIDE", splits)
        o2, l2 = opsadv.ops.paged_attention(*args, **kw)
    assert rel_err(o2, o1) < 1e-6 and torch.equal(l1.isinf(), l2.isinf())
    fin = l1.isfinite()
    assert (l1[fin] - l2[fin]).abs().max() < 1e-5


def test_split_heuristic():
    """Splits only where batch x kv heads x query blocks leaves the SMs idle, each of >= 256 keys, at most 64."""
    assert PA.num_splits(8, 131072, 132) == 33            # b1, 8 kv heads, 128k: two waves of 132 SMs
    assert PA.num_splits(1, 131072, 132) == 64            # MQA b1: capped
    assert PA.num_splits(64 * 8, 131072, 132) == 1        # b64 fills the GPU
    assert PA.num_splits(8, 1024, 132) == 4               # short contexts: slices of >= 256 keys
    assert PA.num_splits(8, 300, 132) == 1
    assert PA.num_splits(16, 8192, 132) == 16             # from 4096 keys on: slices of >= 512 keys
    assert PA.num_splits(8, 8192, 132) == 16
    assert PA.num_splits(8, 4095, 132) == 15
    assert PA.num_splits(8, 8192, 132, {"min_split_keys": 256}) == 32
    assert PA.num_splits(8, 131072, 132, {"waves": 4, "max_splits": 48}) == 48       # a profile's tiles


def test_decode_loop_appends_one_token_per_step():
    """Three decode steps, each one call appending its token (seqlens_k counts it), against the oracle."""
    g = torch.Generator().manual_seed(5)
    (q, kc, vc, bt, lens), _ = paged_inputs(torch.float32, DEV, g, hq=4, hkv=2, d=16, page=8, lens=[10, 18, 4])
    lens = lens - 3                                           # pages are allocated for the three steps
    ref_kc, ref_vc = kc.clone(), vc.clone()
    with opsadv.use_backend("cuda", strict=True):
        for step in range(3):
            lens = lens + 1                                   # one token per sequence (crosses pages 8 and 16)
            q = torch.randn(3, 1, 4, 16, generator=g).to(DEV)
            kn, vn = torch.randn(3, 1, 2, 16, generator=g).to(DEV), torch.randn(3, 1, 2, 16, generator=g).to(DEV)
            out = opsadv.ops.paged_attention(q, kc, vc, bt, lens, k_new=kn, v_new=vn)
            want, _, ref_kc, ref_vc = oracle(q, ref_kc, ref_vc, bt, lens, None, True, 0.25, kn, vn)
            ref_kc, ref_vc = ref_kc.float(), ref_vc.float()
            assert rel_err(out.cpu(), want) < 1e-5
    assert torch.equal(kc.cpu().nan_to_num(), ref_kc.nan_to_num())
    assert torch.equal(vc.cpu().nan_to_num(), ref_vc.nan_to_num())


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("backend", ["cuda", "reference"])
def test_custom_ops_match_their_fakes(backend, fp8):
    """Both custom ops (plain and appending, whose declared mutation of the caches opcheck verifies); fp8: with an
    e4m3 cache and its scales."""
    shape = dict(hq=4, hkv=2, d=16, page=8, lens=[9, 3], q_counts=[2, 1], append=True)
    (q, kc, vc, bt, lens), kw = _build_fp8(torch.float32, **shape) if fp8 else _build(torch.float32, **shape)
    cu, kn, vn = kw["cu_seqlens_q"], kw["k_new"], kw["v_new"]
    sc = (kw["k_scale"], kw["v_scale"]) if fp8 else ()
    # test_schema's mutation check compares tensors with allclose, which torch 2.13 lacks for float8 on CPU; the
    # schema (and its declared mutation) is the same one the non-fp8 run checks
    utils = ("test_faketensor", "test_autograd_registration") if fp8 else \
        ("test_schema", "test_faketensor", "test_autograd_registration")
    with opsadv.use_backend(backend):
        torch.library.opcheck(torch.ops.opsadv.paged_attention.default, (q, kc, vc, bt, lens, cu, True, 0.25, *sc),
                              test_utils=utils)
        torch.library.opcheck(torch.ops.opsadv.paged_attention_append.default,
                              (q, kc, vc, bt, lens, cu, kn, vn, True, 0.25, *sc), test_utils=utils)


def test_compile_fullgraph_decode_step():
    """A compiled decode step (append + attention) gives the eager result and updates the caller's cache."""
    args, kw = _build(torch.float32, seed=7, hq=4, hkv=1, d=16, page=8, lens=[10, 17], append=True)
    kw.pop("return_lse")
    eager_args = [a.clone() for a in args]
    with opsadv.use_backend("cuda"):
        want = opsadv.ops.paged_attention(*eager_args, **kw)
        torch._dynamo.reset()
        f = torch.compile(lambda q, kc, vc, bt, sk, kn, vn: opsadv.ops.paged_attention(q, kc, vc, bt, sk, k_new=kn,
                                                                                       v_new=vn) * 2,
                          fullgraph=True, backend="aot_eager")
        got = f(*args, kw["k_new"], kw["v_new"])
    assert rel_err(got, want * 2) < 1e-6
    assert torch.equal(args[1].nan_to_num(), eager_args[1].nan_to_num())


@pytest.mark.parametrize("fp8", [False, True])
def test_export_decode_step_keeps_the_cache_write(fp8):
    """torch.export of a decode step: the appending op in the graph, and the exported program writes the cache
    (fp8: quantized, with the scales passed through the op)."""
    shape = dict(seed=8, hq=4, hkv=2, d=16, page=8, lens=[9, 12], append=True)
    args, kw = _build_fp8(torch.float32, **shape) if fp8 else _build(torch.float32, **shape)
    sc = (kw["k_scale"], kw["v_scale"]) if fp8 else (None, None)

    class Step(torch.nn.Module):
        def forward(self, q, kc, vc, bt, sk, kn, vn, ks=None, vs=None):
            return opsadv.ops.paged_attention(q, kc, vc, bt, sk, k_new=kn, v_new=vn, k_scale=ks, v_scale=vs)
    eager = [a.clone() for a in args]
    with opsadv.use_backend("cuda"):
        want = Step()(*eager, kw["k_new"], kw["v_new"], *sc)
        ep = torch.export.export(Step(), (*[a.clone() for a in args], kw["k_new"], kw["v_new"], *sc))
        assert any("paged_attention_append" in str(n.target) for n in ep.graph.nodes)
        got = ep.module()(*args, kw["k_new"], kw["v_new"], *sc)
    assert rel_err(got, want) < 1e-6
    for a, b in ((args[1], eager[1]), (args[2], eager[2])):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)) if fp8 else \
            torch.equal(a.nan_to_num(), b.nan_to_num())


def test_gradients_are_refused_clearly():
    args, kw = _build(torch.float32, hq=2, hkv=1, d=16, page=8, lens=[5])
    q = args[0].requires_grad_()
    with pytest.raises(InvalidArgumentError, match="paged_attention.*'q'.*forward only"):
        opsadv.ops.paged_attention(q, *args[1:], **kw)
    with torch.no_grad():
        opsadv.ops.paged_attention(q, *args[1:], **kw)        # inference: fine


def test_explain_names_the_kernel():
    args, kw = _build(torch.float16, hq=4, hkv=2, d=16, page=8, lens=[5, 9], q_counts=[1, 2], append=True)
    with opsadv.use_backend("cuda"):
        e = opsadv.explain("paged_attention", *args, **kw)
    assert e.chosen == "cuda.triton.paged_attention"
    assert {"gqa", "varlen", "append", "causal"} <= set(e.spec.features)
    with opsadv.use_backend("cuda"):
        e = opsadv.explain("paged_attention", *(a.bfloat16() if a.is_floating_point() else a for a in args),
                           cu_seqlens_q=kw["cu_seqlens_q"])
    assert (e.chosen == "cuda.triton.paged_attention") == HAS_CUDA


def _bad(mut):
    args, kw = _build(torch.float32, hq=4, hkv=2, d=16, page=8, lens=[5, 9])
    d = dict(zip(("q", "k_cache", "v_cache", "block_table", "seqlens_k"), args))
    d.update(kw)
    d.pop("return_lse")
    mut(d)
    return d


BAD = {
    "q rank": (lambda d: d.update(q=d["q"][0]), "q", "rank 4"),
    "packed q without cu": (lambda d: d.update(q=d["q"].flatten(0, 1)), "q", "rank 4"),
    "cache dtype mix": (lambda d: d.update(v_cache=d["v_cache"].half()), "v_cache", "same as q"),
    "page size mismatch": (lambda d: d.update(v_cache=d["v_cache"][:, :4]), "v_cache", "same as k_cache"),
    "page size not pow2": (lambda d: d.update(k_cache=d["k_cache"][:, :6], v_cache=d["v_cache"][:, :6]), "k_cache",
                           "power of two"),
    "heads not dividing": (lambda d: d.update(q=d["q"][:, :, :3]), "k_cache", "dividing"),
    "head dim": (lambda d: d.update(q=d["q"][..., :8]), "k_cache", "head_dim (last dim) 8"),
    "block table dtype": (lambda d: d.update(block_table=d["block_table"].long()), "block_table", "int32"),
    "seqlens shape": (lambda d: d.update(seqlens_k=d["seqlens_k"][:1]), "seqlens_k", "(2,)"),
    "block table out of range": (lambda d: d["block_table"].__setitem__((1, 0), 99), "block_table", "page 99"),
    "seqlens past capacity": (lambda d: d["seqlens_k"].__setitem__(0, 99), "seqlens_k", "seqlens_k[0] = 99"),
    "cu length": (lambda d: d.update(q=d["q"].flatten(0, 1), cu_seqlens_q=torch.tensor([0, 2], dtype=torch.int32)),
                  "cu_seqlens_q", "(3,)"),
    "cu not monotone": (lambda d: d.update(q=d["q"].flatten(0, 1), cu_seqlens_q=torch.tensor([0, 2, 1],
                                                                                             dtype=torch.int32)),
                        "cu_seqlens_q", "non-decreasing"),
    "k_new alone": (lambda d: d.update(k_new=d["q"][:, :, :2]), "v_new", "given together"),
    "k_new heads": (lambda d: d.update(k_new=d["q"], v_new=d["q"]), "k_new", "Hkv = 2"),
    "append more than seqlens": (lambda d: d.update(q=d["q"].expand(2, 6, 4, 16), k_new=torch.zeros(2, 6, 2, 16),
                                                    v_new=torch.zeros(2, 6, 2, 16)), "seqlens_k", ">= the 6 tokens"),
    "causal int": (lambda d: d.update(causal=1), "causal", "a bool"),
    "scale": (lambda d: d.update(scale=-1.0), "scale", "> 0"),
    "fp8 cache without scales": (lambda d: _fp8_cache(d, None), "k_scale", "float32 tensor of shape (2,)"),
    "fp8 cache without v_scale": (lambda d: (_fp8_cache(d), d.pop("v_scale")), "v_scale", "got None"),
    "fp8 k_cache only": (lambda d: d.update(k_cache=d["k_cache"].to(torch.float8_e4m3fn)), "v_cache",
                         "float8_e4m3fn (same as k_cache)"),
    "scales with a float32 cache": (lambda d: d.update(k_scale=torch.ones(2, device=DEV)), "k_scale",
                                    "None (scales go with a float8_e4m3fn cache; this cache is float32)"),
    "fp8 scale dtype": (lambda d: _fp8_cache(d, torch.ones(2, dtype=torch.float64, device=DEV)), "k_scale",
                        "dtype float64"),
    "fp8 scale shape": (lambda d: _fp8_cache(d, torch.ones(3, device=DEV)), "k_scale", "shape (3,)"),
    "fp8 scale device": (lambda d: _fp8_cache(d, torch.ones(2, device="meta")), "k_scale", "on device"),
    "fp8 scale not positive": (lambda d: (_fp8_cache(d), d.update(v_scale=torch.tensor([1.0, 0.0]))), "v_scale",
                               "finite scales > 0"),
    "fp8 k_new dtype": (lambda d: (_fp8_cache(d), d.update(k_new=torch.zeros(2, 1, 2, 16).to(torch.float8_e4m3fn),
                                                           v_new=torch.zeros(2, 1, 2, 16))), "k_new",
                        "got float8_e4m3fn"),
}


def _fp8_cache(d, k_scale=True):
    """d's caches as float8_e4m3fn with unit scales (k_scale: True, or that value)."""
    d.update(k_cache=d["k_cache"].to(torch.float8_e4m3fn), v_cache=d["v_cache"].to(torch.float8_e4m3fn),
             k_scale=torch.ones(2, device=DEV) if k_scale is True else k_scale, v_scale=torch.ones(2, device=DEV))


@pytest.mark.parametrize("name", list(BAD))
def test_bad_inputs_name_op_and_argument(name):
    mut, argname, match = BAD[name]
    d = _bad(mut)
    if DEV != "cpu" and name in ("block table out of range", "seqlens past capacity", "cu not monotone",
                                 "append more than seqlens", "fp8 scale not positive"):
        pytest.skip("value checks run on CPU tensors only")
    with pytest.raises(InvalidArgumentError) as e:
        opsadv.ops.paged_attention(**d)
    msg = str(e.value)
    assert "paged_attention" in msg and f"'{argname}'" in msg and match in msg, msg


def test_fast_path_repeats_the_full_paths_call(monkeypatch):
    """A repeated identical no-grad call runs the stored resolution (no validation: a spy on validate sees one
    call), counts in traces, gives the same result, follows a policy change, and still checks the index values on
    CPU (they are not in the key)."""
    M = importlib.import_module("opsadv.ops.paged_attention")
    args, kw = _build(torch.float32, seed=9, hq=4, hkv=2, d=16, page=8, lens=[5, 9])
    seen = []
    real = M.validate
    monkeypatch.setattr(M, "validate", lambda *a, **k: (seen.append(1), real(*a, **k)))
    with opsadv.use_backend("cuda"), opsadv.trace() as t:
        o1, l1 = opsadv.ops.paged_attention(*args, **kw)
        o2, l2 = opsadv.ops.paged_attention(*args, **kw)
    assert len(seen) == 1 and t.counts == {"cuda.triton.paged_attention": 2}
    assert torch.equal(o1, o2) and torch.equal(l1, l2)
    with opsadv.use_backend("reference"), opsadv.trace() as t:
        opsadv.ops.paged_attention(*args, **kw)
    assert t.counts == {"reference.paged_attention": 1}
    bad = args[3].clone()
    bad[0, 0] = 77
    with opsadv.use_backend("cuda"):
        if DEV == "cpu":        # index values are checked on CPU tensors only (a GPU check would sync)
            with pytest.raises(InvalidArgumentError, match="page 77"):
                opsadv.ops.paged_attention(*args[:3], bad, args[4], **kw)
        with pytest.raises(InvalidArgumentError, match="'k_cache'"):      # other metadata: the full checks
            opsadv.ops.paged_attention(args[0], args[1].double(), *args[2:], **kw)


@pytest.mark.parametrize("backend,splits", [("cuda", 1), ("cuda", 3), ("reference", None)])
def test_nan_and_inf_queries_poison_their_rows_only(backend, splits, monkeypatch):
    """A NaN or +-inf in a query gives NaN out and lse on that (query, head) row alone (flash_attention's policy)."""
    monkeypatch.setattr(PA, "SPLITS_OVERRIDE", splits)
    args, kw = _build(torch.float32, seed=4, hq=4, hkv=2, d=16, page=8, lens=[12, 20], s_q=2)
    q = args[0].clone()
    q[0, 1, 2, 3], q[1, 0, 1, 0] = float("nan"), float("inf")
    with opsadv.use_backend(backend):
        out, lse = opsadv.ops.paged_attention(q, *args[1:], **kw)
    bad = torch.zeros(2, 2, 4, dtype=torch.bool, device=lse.device)
    bad[0, 1, 2] = bad[1, 0, 1] = True
    assert torch.equal(lse.isnan(), bad) and torch.equal(out.isnan().all(-1), bad) and not out[~bad].isnan().any()


def test_empty_batch_and_empty_queries():
    args, kw = _build(torch.float32, hq=2, hkv=1, d=16, page=8, lens=[5, 9], q_counts=[0, 0])
    with opsadv.use_backend("cuda"):
        out, lse = opsadv.ops.paged_attention(*args, **kw)
    assert out.shape == (0, 2, 16) and lse.shape == (0, 2)


_SM90_COMPILE = r"""
import json, os, sys
os.environ.pop("TRITON_INTERPRET", None)
import torch
from opsadv.testing.sm90 import compile_sm90
from opsadv.backends.triton_common.paged_attention import kernels as K, paged_attention as PA
from opsadv.ops.paged_attention import kv_scales, quantize_kv
from opsadv.ops.paged_attention.cases import paged_inputs
FNS = {"attn": K.paged_attn_kernel, "merge": K.merge_kernel, "append": K.append_kernel}
calls = []
class Rec:                                 # records each launch the host wrapper makes
    def __init__(self, name):
        self.name = name
    def __getitem__(self, grid):
        return lambda *args, **kw: calls.append((self.name, args, kw))
PA._K.update({n: Rec(n) for n in FNS})
res = {}
for label, dtype, shape in (
        ("decode gqa bf16 d128 split append", torch.bfloat16, dict(hq=32, hkv=8, d=128, page=16, lens=[4096],
                                                                   append=True)),
        ("decode mqa fp16 d128 page128 split", torch.float16, dict(hq=32, hkv=1, d=128, page=128, lens=[300] * 70)),
        ("prefill gqa bf16 d128", torch.bfloat16, dict(hq=32, hkv=8, d=128, page=16, lens=[600] * 8, s_q=300)),
        ("varlen fp16 d64", torch.float16, dict(hq=8, hkv=2, d=64, page=16, lens=[600, 700], q_counts=[5, 7],
                                                append=True)),
        ("prefill bf16 d256", torch.bfloat16, dict(hq=16, hkv=4, d=256, page=16, lens=[200] * 4, s_q=100)),
        ("decode fp32 d128", torch.float32, dict(hq=32, hkv=8, d=128, page=16, lens=[300] * 2)),
        ("decode gqa bf16 d128 fp8 split append", torch.bfloat16, dict(hq=32, hkv=8, d=128, page=16, lens=[4096],
                                                                       append=True)),
        ("prefill gqa fp16 d128 fp8", torch.float16, dict(hq=32, hkv=8, d=128, page=16, lens=[600] * 8, s_q=300)),
        ("decode gqa fp16 d128 fp8 split", torch.float16, dict(hq=32, hkv=8, d=128, page=16, lens=[4096]))):
    calls.clear()
    args, kw = paged_inputs(dtype, "cpu", torch.Generator().manual_seed(0), **shape)
    if "fp8" in label:
        ks, vs = kv_scales(args[1]), kv_scales(args[2])
        args = (args[0], quantize_kv(args[1], ks), quantize_kv(args[2], vs), *args[3:])
        kw.update(k_scale=ks, v_scale=vs)
    PA.paged_fwd(None, *args, kw.get("cu_seqlens_q"), kw.get("k_new"), kw.get("v_new"), True, 0.1,
                 kw.get("k_scale"), kw.get("v_scale"))
    for name, a, k in calls:
        fn, k = FNS[name], dict(k)
        warps, stages = k.pop("num_warps"), k.pop("num_stages", 3)
        r = compile_sm90(fn, {**dict(zip(fn.arg_names, a)), **k}, warps, stages)
        res[f"{label} {name}"] = r["spill_stores"] + r["spill_loads"]
print(json.dumps(res))
"""


def test_kernels_compile_for_sm90_without_spills():
    """The launches the host wrapper makes (decode with split-KV and append, MQA on 128-token pages, prefill d128 /
    d256, packed fp16, fp32, fp8 caches in decode with append and in prefill) compile for sm_90 (no interpreter)
    without register spills (the fp16-dot fp8 decode tile: at most a few bytes)."""
    import json
    from conftest import run_sm90_compile
    r = json.loads(run_sm90_compile(["-c", _SM90_COMPILE]).strip().splitlines()[-1])
    assert {"decode gqa bf16 d128 split append append", "decode gqa bf16 d128 split append merge",
            "varlen fp16 d64 append", "decode gqa bf16 d128 fp8 split append append",
            "decode gqa bf16 d128 fp8 split append attn", "prefill gqa fp16 d128 fp8 attn",
            "decode gqa fp16 d128 fp8 split attn"} <= set(r)
    # the fp8 decode tile (128 keys widened to fp16) spills a few registers (40 bytes for the bare cast alone);
    # measured on the H100 it still runs 1.18-1.34x the spill-free 64-key tile, so it is bounded, not forbidden
    fp8_decode = {n: r.pop(n) for n in ("decode gqa bf16 d128 fp8 split append attn", "decode gqa fp16 d128 fp8 split attn")}
    assert len(r) == 15 and not any(r.values()) and max(fp8_decode.values()) <= 96, (r, fp8_decode)


@requires_gpu
def test_bf16_on_gpu_long_context_split(monkeypatch):
    """b2 x 4k context, GQA 32 / 8, d128, pages of 16: the heuristic splits; against the oracle of the reference."""
    g = torch.Generator().manual_seed(11)
    args, kw = paged_inputs(torch.bfloat16, "cuda", g, hq=32, hkv=8, d=128, page=16, lens=[4000, 4096], append=True)
    kw["return_lse"] = True
    ref_args = [a.double() if a.is_floating_point() else a for a in args]
    ref_kw = {k: (v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v) for k, v in kw.items()}
    with opsadv.use_backend("reference"):
        want, wlse = opsadv.ops.paged_attention(*ref_args, **ref_kw)
    with opsadv.use_backend("cuda", strict=True):
        out, lse = opsadv.ops.paged_attention(*args, **kw)
    assert rel_err(out, want) < TOL[torch.bfloat16] and (lse.double() - wlse).abs().max() < 1e-2


# ---- the fp8 (e4m3) cache -------------------------------------------------------------------------------------
FP8 = torch.float8_e4m3fn


def _deq(c, scale):
    """An fp8 cache (or rows shaped (..., Hkv, D)) dequantized in float64 on the CPU: fp8 * scale per kv head."""
    return c.cpu().double() * scale.cpu().double().reshape(-1, 1)


def _build_fp8(dtype, seed=0, scalar_scale=False, **sc):
    """_build's inputs with the caches quantized (kv heads of magnitudes 4^h apart, so a wrong head's scale
    shows), k_scale / v_scale per kv head (or one scalar)."""
    args, kw = _build(dtype, seed, **sc)
    q, kc, vc, bt, lens = args
    spread = (4.0 ** torch.arange(kc.shape[2], dtype=torch.float64)).to(dtype=kc.dtype, device=kc.device)
    kc, vc = kc * spread[:, None], vc * spread.flip(0)[:, None]
    ks, vs = kv_scales(kc), kv_scales(vc)
    if scalar_scale:
        ks, vs = ks.max().reshape(()), vs.max().reshape(())
    kw.update(k_scale=ks, v_scale=vs)
    return (q, quantize_kv(kc, ks), quantize_kv(vc, vs), bt, lens), kw


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fp8_round_trip_within_stated_error(dtype):
    """quantize_kv then fp8 * scale: within 2^-4 relative where |x| / scale >= 2^-6 (e4m3's normals), within
    2^-10 * scale below, as the op's docstring states; the bound is also nearly reached (a loose check could not
    tell e4m3 from a finer format).  kv_scales: amax / 448 per head, ignoring NaN, 1 for a head of zeros."""
    g = torch.Generator().manual_seed(21)
    mag = torch.tensor([1e-3, 1.0, 10.0, 0.0], dtype=torch.float64)
    x = (torch.randn(64, 37, 4, 24, generator=g, dtype=torch.float64) * mag[:, None]
         * torch.exp(1.5 * torch.randn(64, 37, 1, 24, generator=g, dtype=torch.float64))).to(dtype)
    x[3, 5, 1, 7] = float("nan")
    s = kv_scales(x)
    xd = x.double()
    assert s.dtype == torch.float32 and s.shape == (4,) and s[3] == 1.0
    amax = xd.nan_to_num(0.0).abs().amax((0, 1, 3))
    assert torch.allclose(s[:3].double(), amax[:3] / 448, rtol=1e-6)
    c = quantize_kv(x, s)
    assert c.dtype == FP8 and c.shape == x.shape and c.double()[3, 5, 1, 7].isnan()
    y, ok = _deq(c, s), ~xd.isnan()
    r = xd.abs() / s.double().reshape(-1, 1)
    err = (y - xd).abs()
    normal, sub = ok & (r >= 2 ** -6), ok & (r < 2 ** -6)
    slack = 1 + 2 ** -20                                                # x / scale is rounded to float32 first
    assert (err[normal] <= 2 ** -4 * slack * xd.abs()[normal]).all()
    assert (err[sub] <= 2 ** -10 * slack * s.double().reshape(-1, 1).expand_as(xd)[sub]).all()
    assert (err[normal] / xd.abs()[normal]).max() > 2 ** -5            # e4m3's bound, not a finer format's
    assert sub[:, :, :3].any() and normal.sum() > 0.6 * ok.sum()        # both regimes exercised
    # past 448 * scale: clamped to +-448 * scale (not NaN, as a bare cast would give)
    big = quantize_kv(torch.tensor([[1e4, -1e4]], dtype=dtype).reshape(1, 2, 1), torch.tensor([1.0, 2.0]))
    assert big.double().flatten().tolist() == [448.0, -448.0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fp8_append_kernel_rounds_like_torch(dtype):
    """The append kernel's e4m3 bytes equal quantize_kv's (torch's cast) for every midpoint between e4m3 values
    (ties to even), values just above / below each, round-ups that carry into the exponent, values past 448
    (clamped) and zeros of both signs, at per-head power-of-two scales; triton 3.6's interpreter cast alone gets
    ties and carries wrong (the kernel rounds before casting)."""
    vals = torch.arange(256, dtype=torch.int16).to(torch.uint8).view(FP8).double()
    vals = vals[vals.isfinite()].sort().values
    mids = (vals[1:] + vals[:-1]) / 2
    x = torch.cat([mids, mids * (1 + 2 ** -6), mids * (1 - 2 ** -6), torch.tensor([124.75, 460.0, -1e4, 0.0, -0.0])])
    d, hkv = 16, 2
    n = -(-x.numel() // d)
    x = torch.cat([x, torch.zeros(n * d - x.numel(), dtype=x.dtype)]).view(1, n, 1, d)
    scales = torch.tensor([0.5, 4.0])
    kn = (x * scales.double().view(1, 1, hkv, 1)).to(dtype)                  # (1, n, Hkv, D): exact in fp16 too
    assert torch.equal(kn.double() / scales.double().view(1, 1, hkv, 1), x.expand(1, n, hkv, d))
    scales, kn = scales.to(DEV), kn.to(DEV)
    g = torch.Generator().manual_seed(2)
    (q, kc, vc, bt, lens), _ = paged_inputs(torch.float32, DEV, g, hq=2, hkv=hkv, d=d, page=8, lens=[n + 5])
    kc8, vc8 = quantize_kv(kc, scales), quantize_kv(vc, scales)
    q = torch.randn(1, n, 2, d, generator=g).to(dtype=dtype, device=DEV)
    caches = {}
    for backend in ("cuda", "reference"):
        k8, v8 = kc8.clone(), vc8.clone()
        with opsadv.use_backend(backend, strict=True):
            out = opsadv.ops.paged_attention(q, k8, v8, bt, lens, k_new=kn, v_new=-kn, k_scale=scales.to(DEV),
                                             v_scale=scales.to(DEV))
        assert not out.isnan().any()
        caches[backend] = (k8.cpu().view(torch.uint8), v8.cpu().view(torch.uint8))
    assert torch.equal(caches["cuda"][0], caches["reference"][0])
    assert torch.equal(caches["cuda"][1], caches["reference"][1])
    # and the reference's rows are torch's cast of x / scale (x holds the cases above: 124.75 -> 128, 460 -> 448)
    pos = torch.arange(5, n + 5)
    rows = caches["reference"][0].view(FP8)[bt[0].cpu().long()[pos // 8], pos % 8]
    assert torch.equal(rows.view(torch.uint8), (x.expand(1, n, hkv, d)[0].float()).clamp(-448, 448).to(FP8)
                       .view(torch.uint8))
    assert 128.0 in rows.double() and 448.0 in rows.double()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("name", list(SCENARIOS))
@pytest.mark.parametrize("backend", ["cuda", "reference"])
def test_fp8_cache_matches_oracle_on_dequantized_cache(backend, name, dtype, monkeypatch):
    """An fp8 cache (per-head scales; one scalar in the non-causal scenario) against the float64 oracle over the
    dequantized cache, at the tolerance of q's dtype: the same values, so the bf16 / fp16 path's accuracy; the
    appended rows land quantized like quantize_kv, the other slots (NaN ones too) untouched."""
    sc = SCENARIOS[name]
    monkeypatch.setattr(PA, "SPLITS_OVERRIDE", sc.get("splits"))
    args, kw = _build_fp8(dtype, seed=1, scalar_scale=name == "noncausal_shared_prefix", **sc)
    q, kc, vc, bt, lens = args
    ks, vs = kw["k_scale"], kw["v_scale"]
    kc0, vc0 = _deq(kc, ks), _deq(vc, vs)
    kn = vn = None
    if "k_new" in kw:
        kn, vn = _deq(quantize_kv(kw["k_new"], ks), ks), _deq(quantize_kv(kw["v_new"], vs), vs)
    with opsadv.use_backend(backend, strict=True), opsadv.trace() as t:
        out, lse = opsadv.ops.paged_attention(*args, **kw)
    assert t.counts == {f"{backend}.{'triton.' if backend == 'cuda' else ''}paged_attention": 1}
    want, wlse, wkc, wvc = oracle(q, kc0, vc0, bt, lens, kw.get("cu_seqlens_q"), kw["causal"],
                                  1 / math.sqrt(q.shape[-1]), kn, vn)
    assert out.shape == q.shape and out.dtype == q.dtype and lse.dtype == torch.float32
    assert not out.isnan().any() and not lse.isnan().any()
    assert torch.equal(torch.isneginf(lse.cpu()), torch.isneginf(wlse))
    fin = torch.isfinite(wlse)
    assert (out.cpu()[~fin] == 0).all()
    assert rel_err(out.cpu(), want) < TOL[dtype]
    assert (lse.cpu()[fin].double() - wlse[fin]).abs().max() < TOL[dtype] * 10
    assert kc.dtype == FP8 and vc.dtype == FP8
    for got, w in ((_deq(kc, ks), wkc), (_deq(vc, vs), wvc)):
        assert torch.equal(got.isnan(), w.isnan()) and torch.equal(got.nan_to_num(), w.nan_to_num())


@pytest.mark.parametrize("name", ["decode_gqa_lens_0_1_page", "varlen_append_boundary_split"])
def test_fp8_cache_bf16_queries_run_fp16_dots(name, monkeypatch):
    """bf16 q over an fp8 cache (the kernel's F16_DOT path: K / V widened to fp16, q shifted into fp16's range by a
    power of two per row): against the float64 oracle over the dequantized cache with queries far past fp16's
    range in one head (exact shift) and an inf in one query row, which makes that row NaN and no other."""
    sc = SCENARIOS[name]
    monkeypatch.setattr(PA, "SPLITS_OVERRIDE", sc.get("splits"))
    monkeypatch.setattr(PA, "F16_DOT", True)
    args, kw = _build_fp8(torch.bfloat16, seed=4, **sc)
    q, kc, vc, bt, lens = args
    q = q.clone()
    q[..., 1, :] *= 3e5                                                 # head 1: |q| ~ 1e5-1e6, over fp16's 65504
    first = (0,) * (q.dim() - 1)                                        # the first row of head 0 (any layout)
    q[first + (3,)] = float("inf")                                      # one element of one row
    args = (q, kc, vc, bt, lens)
    ks, vs = kw["k_scale"], kw["v_scale"]
    kc0, vc0 = _deq(kc, ks), _deq(vc, vs)
    kn = vn = None
    if "k_new" in kw:
        kn, vn = _deq(quantize_kv(kw["k_new"], ks), ks), _deq(quantize_kv(kw["v_new"], vs), vs)
    with opsadv.use_backend("cuda", strict=True), opsadv.trace() as t:
        out, lse = opsadv.ops.paged_attention(*args, **kw)
    assert t.counts == {"cuda.triton.paged_attention": 1}
    qf = q.double().nan_to_num(posinf=0.0)                                # the oracle without the inf
    want, wlse, _, _ = oracle(qf, kc0, vc0, bt, lens, kw.get("cu_seqlens_q"), kw["causal"],
                              1 / math.sqrt(q.shape[-1]), kn, vn)
    bad = torch.zeros(out.shape[:-1], dtype=torch.bool)
    fin = torch.isfinite(wlse)
    bad[first] = bool(fin[first])                                         # the inf row, where it sees any key
    assert torch.equal(out.cpu().isnan().any(-1), bad) and torch.equal(lse.cpu().isnan(), bad)
    ok = ~bad & fin
    assert rel_err(out.cpu()[ok], want[ok]) < TOL[torch.bfloat16]
    assert ((lse.cpu()[ok].double() - wlse[ok]).abs() / wlse[ok].abs().clamp_min(1)).max() < 1e-2


def test_fp8_decode_loop_fast_path_takes_new_scales(monkeypatch):
    """Repeated fp8 decode calls of the same metadata take the fast path (validate runs once) and read each
    call's scales: doubling v_scale doubles out exactly; a scalar scale takes the full path again."""
    M = importlib.import_module("opsadv.ops.paged_attention")
    args, kw = _build_fp8(torch.float32, seed=6, hq=4, hkv=2, d=16, page=8, lens=[5, 9])
    seen = []
    real = M.validate
    monkeypatch.setattr(M, "validate", lambda *a, **k: (seen.append(1), real(*a, **k)))
    with opsadv.use_backend("cuda"), opsadv.trace() as t:
        o1 = opsadv.ops.paged_attention(*args, **kw)[0]
        o2 = opsadv.ops.paged_attention(*args, **{**kw, "v_scale": kw["v_scale"] * 2})[0]
        assert len(seen) == 1
        opsadv.ops.paged_attention(*args, **{**kw, "k_scale": kw["k_scale"].max().reshape(())})
    assert len(seen) == 2 and t.counts == {"cuda.triton.paged_attention": 3}
    assert torch.equal(o2, 2 * o1)


def test_fp8_explain_and_capability():
    """The cuda impl serves feature fp8_kv; on a GPU below sm_89 (A100, Jetson Orin) it refuses it by name."""
    import dataclasses
    from types import SimpleNamespace
    args, kw = _build_fp8(torch.float16, hq=4, hkv=2, d=16, page=8, lens=[5, 9], append=True)
    with opsadv.use_backend("cuda"):
        e = opsadv.explain("paged_attention", *args, **kw)
    assert e.chosen == "cuda.triton.paged_attention" and "fp8_kv" in e.spec.features
    gpu = dataclasses.replace(e.spec, device_type="cuda")
    assert any("compute capability >= (8, 9)" in r for r in PA._check(gpu, SimpleNamespace(compute_capability=(8, 0))))
    assert PA._check(gpu, SimpleNamespace(compute_capability=(9, 0))) == []
    env = SimpleNamespace(triton_interpret=True)
    assert "fp8_kv" not in PA.impls(env, "rocm")[0].features and "fp8_kv" in PA.impls(env)[0].features


@requires_gpu
def test_fp8_cache_on_gpu_long_context_split():
    """bf16 q over an fp8 cache, b2 x 4k context, GQA 32 / 8, d128, with append, split-KV: against the reference
    over the same fp8 cache in float64, and the appended bytes equal to quantize_kv's."""
    g = torch.Generator().manual_seed(12)
    args, kw = paged_inputs(torch.bfloat16, "cuda", g, hq=32, hkv=8, d=128, page=16, lens=[4000, 4096], append=True)
    q, kc, vc, bt, lens = args
    ks, vs = kv_scales(kc) * 1.5, kv_scales(vc) * 0.75
    kc8, vc8 = quantize_kv(kc, ks), quantize_kv(vc, vs)
    kw.update(return_lse=True, k_scale=ks, v_scale=vs)
    rk, rv = kc8.clone(), vc8.clone()
    ref_kw = {k: (v.double() if isinstance(v, torch.Tensor) and v.dtype == torch.bfloat16 else v)
              for k, v in kw.items()}
    with opsadv.use_backend("reference"):
        want, wlse = opsadv.ops.paged_attention(q.double(), rk, rv, bt, lens, **ref_kw)
    with opsadv.use_backend("cuda", strict=True):
        out, lse = opsadv.ops.paged_attention(q, kc8, vc8, bt, lens, **kw)
    assert rel_err(out, want) < TOL[torch.bfloat16] and (lse.double() - wlse).abs().max() < 1e-2
    assert torch.equal(kc8.view(torch.uint8), rk.view(torch.uint8)) and torch.equal(vc8.view(torch.uint8),
                                                                                    rv.view(torch.uint8))
