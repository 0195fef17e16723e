"""`opsadv bench` runner: the JSON schema of benchmarks/README.md, merging by case name, the plot and
skipping of suites that do not exist yet (on CPU: the attention suite shrunk to one tiny case,
run through the interpreter; speed is never asserted)."""
import json

import pytest
import torch

import opsadv
from opsadv.bench import runner


def test_write_json_merges_by_case_name(tmp_path):
    path = tmp_path / "r.json"
    head = {"device": "X", "torch": "t", "triton": "3", "commit": "abc", "date": "2026-01-01"}
    runner.write_json(str(path), head, [{"suite": "gemm", "case": "a", "opsadv_ms": 1.0}])
    runner.write_json(str(path), {**head, "commit": "def"}, [{"suite": "attention", "case": "b", "opsadv_ms": 2.0},
                                                            {"suite": "gemm", "case": "a", "opsadv_ms": 0.5}])
    data = json.loads(path.read_text())
    assert data["commit"] == "def"
    assert {c["case"]: c["opsadv_ms"] for c in data["cases"]} == {"a": 0.5, "b": 2.0}


def test_rel_err_pairs_tensors_and_flags_nan():
    a = (torch.ones(3), torch.ones(2))
    assert runner.rel_err(a, (torch.ones(3), torch.ones(2))) == 0.0
    assert runner.rel_err((torch.tensor([float("nan")]),), (torch.ones(1),)) == float("inf")


def test_paired_speedup_cancels_a_drift_between_rounds():
    # the same kernel twice, the clock 10% slower in round 2: per-round ratios stay 1.0, where a ratio of
    # medians over different rounds would not
    ours, peer = [1.0, 1.1, 1.0], [1.0, 1.1, 1.0]
    assert runner.paired_speedup(peer, ours) == (1.0, 1.0, 1.0)
    med, lo, hi = runner.paired_speedup([2.0, 2.4, 1.8], [1.0, 1.0, 1.0])
    assert (med, lo, hi) == (2.0, 1.8, 2.4)
    assert runner.paired_speedup([3.0, 1.0], [1.0, 1.0])[0] == 2.0     # even count: mean of the middle two


def test_run_bench_attention_tiny_on_cpu(tmp_path, monkeypatch, capsys):
    pytest.importorskip("matplotlib")
    import opsadv.bench.suite_attention as S
    monkeypatch.setattr(S, "_grid", lambda quick: [("fp16", 1, 2, 1, 24, 32, True, False)])
    path, png = tmp_path / "b.json", tmp_path / "b.png"
    rc = runner.run_bench(["attention", "nosuchsuite"], True, str(path), str(png), autotune=False)
    out = capsys.readouterr().out
    assert "suite 'nosuchsuite': skipped" in out
    data = json.loads(path.read_text())
    assert {"device", "torch", "triton", "commit", "date", "cases"} <= set(data)
    case = data["cases"][0]
    assert case["case"] == "fwd fp16 b1 h2 kv1 s24 d32 causal gqa"
    assert {"suite", "opsadv_impl", "opsadv_ms", "peers", "unit", "opsadv_rate"} <= set(case)
    if case["peers"]:                  # SDPA's CPU kernels serve some forced backends
        assert case["rel_err"] < 5e-3 and rc == 0
        lo, hi = case["speedup_range"]
        assert lo <= case["speedup"] <= hi
        assert f"{lo:.2f}-{hi:.2f}" in out                              # the printed table shows the range
    assert png.stat().st_size > 0


def test_run_bench_filter_and_parts(tmp_path, monkeypatch):
    """--filter / --part select cases; each finished case is in the JSON (with its commit)."""
    import opsadv.bench.suite_attention as S
    grid = [("fp16", 1, 2, 1, 24, 32, c, False) for c in (False, True)] + [("fp16", 1, 2, 2, 16, 32, False, False)]
    monkeypatch.setattr(S, "_grid", lambda quick: grid)
    monkeypatch.setenv("OPSADV_COMMIT", "abc1234")
    path = tmp_path / "b.json"
    runner.run_bench(["attention"], True, str(path), None, autotune=False, case_filter="gqa")
    names = [c["case"] for c in json.loads(path.read_text())["cases"] if not c["case"].endswith("[own]")]
    assert names == ["fwd fp16 b1 h2 kv1 s24 d32 gqa", "fwd fp16 b1 h2 kv1 s24 d32 causal gqa"]
    path2 = tmp_path / "c.json"
    runner.run_bench(["attention"], True, str(path2), None, autotune=False, part=(2, 2))
    cases = [c for c in json.loads(path2.read_text())["cases"] if not c["case"].endswith("[own]")]
    assert [c["case"] for c in cases] == ["fwd fp16 b1 h2 kv1 s24 d32 causal gqa"]
    assert cases[0]["commit"] == "abc1234"


def test_density_plot_written_for_sparse_rows(tmp_path):
    from opsadv.bench.runner import write_plot
    rows = [{"case": f"fwd bf16 b1 h32 s16384 d128 sliding{w} causal", "speedup": 1.1, "density": w / 16384,
             "opsadv_ms": w / 1000, "peers": {"flex": w / 900}} for w in (256, 1024, 4096)]
    rows.append({"case": "fwd bf16 n8 h16 s4096 d128 varlen pad28", "speedup": 1.2, "density": 0.7,
                 "opsadv_ms": 1.0, "peers": {"padded_dense": 1.7}})
    write_plot(str(tmp_path / "h.png"), rows, "t")
    assert (tmp_path / "h.png").stat().st_size > 0
    assert (tmp_path / "h_density.png").stat().st_size > 0
    write_plot(str(tmp_path / "g.png"), rows[-1:], "t")          # no density series: no density plot
    assert not (tmp_path / "g_density.png").exists()


def test_a_case_whose_setup_fails_gives_an_error_row():
    """One case's setup error (e.g. a model that cannot be converted on this machine) is that case's
    error row; it does not end the suite."""
    from opsadv.bench.case import BenchCase

    def boom():
        raise RuntimeError("no such model here")
    case = BenchCase("e2e", "broken case", lambda: torch.zeros(1), {"torch_eager": lambda: torch.zeros(1)}, 1.0,
                     setup=boom)
    (row,) = runner.run_case(case)
    assert row["case"] == "broken case" and row["error"].startswith("setup: RuntimeError: no such model here")


def test_attention_own_row_takes_the_best_own_kernel_that_accepts():
    """The "[own]" row reports the first of OWN (Gluon, then Triton) that accepts the case: under the
    Triton interpreter the Gluon impl refuses (it needs a Hopper GPU), so the Triton kernel is the own one."""
    import opsadv.bench.suite_attention as S
    assert S.OWN[0] == "cuda.gluon.flash_attention" and S.OWN[-1] == "cuda.triton.flash_attention"
    q, k = torch.randn(1, 2, 24, 32, dtype=torch.float16), torch.randn(1, 2, 24, 32, dtype=torch.float16)
    own = S._own(q, k, True, False)
    from opsadv.registry import get_registry
    cuda = get_registry().backends.get("cuda")
    if cuda is None or not cuda.available:
        assert own is None
    else:
        assert own[0].id == "cuda.triton.flash_attention"


def test_own_row_with_a_tuple_of_own_prefixes():
    """The attention suite names its own kernels by a tuple of prefixes (Gluon, Triton): when the dispatcher
    chose a vendor impl, the runner adds the "[own]" row (this crashed on the H200 once: a tuple + "*")."""
    from opsadv.bench.case import BenchCase
    x = torch.randn(5)
    for own_impl in ("cuda.gluon.x", None):
        extra = {"own": lambda: x * 2, "own_prefix": ("cuda.gluon.", "cuda.triton.")}
        if own_impl:
            extra["own_impl"] = own_impl
        case = BenchCase("attention", "tuple prefix case", lambda: x * 2, {"torch_eager": lambda: x * 2}, 1.0,
                         impl=lambda: "cuda.sdpa.cudnn", extra=extra)
        rows = runner.run_case(case)
        assert [r["case"] for r in rows] == ["tuple prefix case", "tuple prefix case [own]"]
        assert rows[1]["opsadv_impl"] == (own_impl or "cuda.gluon.* | cuda.triton.*")
        assert rows[1]["rel_err"] == 0 and "error" not in rows[1]


def test_gemm_own_row_prefers_gluon_then_triton():
    """The gemm suite's "[own]" row takes the Gluon GEMM where the policy accepts it, else the Triton
    kernel: under the interpreter Gluon refuses (even with experimental kernels allowed), so Triton."""
    import opsadv
    import opsadv.bench.suite_gemm as S
    from opsadv.ops.gemm import _gemm_spec
    from opsadv.registry import get_registry
    assert S.OWN_PREFIXES == ("cuda.gluon.", "cuda.triton.")
    a, b = torch.randn(64, 32, dtype=torch.float16), torch.randn(32, 48, dtype=torch.float16)
    with opsadv.use_backend("auto", experimental=True):
        own = S.own_impl("gemm", _gemm_spec(a, b, None, "none", None, 1.0, False))
    cuda = get_registry().backends.get("cuda")
    if cuda is None or not cuda.available:
        assert own is None
    else:
        assert own[0].id.startswith("cuda.triton.")


def test_sparse_backward_only_rows_time_autograd_grad_alone():
    """A "bwd" row runs the forward once and then only autograd.grad on its kept graph (the sparse issue's
    backward target), for opsadv and the peers alike; its work is 2.5x the forward's."""
    import opsadv
    from opsadv import SparseLayout
    from opsadv.bench import suite_sparse as S
    lay = SparseLayout.sliding_window(48, 16, causal=True, block_size=16, device="cpu")
    only = S.pattern_case("sliding16 causal", lay, None, h=2, d=32, dtype=torch.float16, bwd="only", dev="cpu")
    fwd = S.pattern_case("sliding16 causal", lay, None, h=2, d=32, dtype=torch.float16, dev="cpu")
    assert only.case.startswith("bwd fp16 b1 h2 s48 d32") and "sdpa_masked" in only.peers
    assert only.work == 2.5 * fwd.work
    with opsadv.trace() as t:
        g1 = only.opsadv()
        g2 = only.opsadv()
    assert sum(t.counts.values()) == 3                       # one forward, two backwards
    assert all(torch.equal(a, b) for a, b in zip(g1, g2)) and len(g1) == 3
    (row,) = runner.run_case(only)
    assert row["case"] == only.case and row["rel_err"] < 2e-2, row


@pytest.mark.parametrize("kw", [dict(s_q=20, s_k=70), dict(s_q=70, s_k=70, window=9)], ids=["cross", "bidir"])
def test_sparse_padding_cases_match_the_dense_mask(kw):
    """The key-padding rows (cross-attention's s_q != s_k; ModernBERT's bidirectional window): opsadv's layout is
    the mask the sdpa_masked peer gets, forward and backward (Triton sparse kernel in the interpreter, fp16)."""
    import opsadv
    from opsadv.bench import suite_sparse as S
    c = S.padding_case(b=3, h=2, d=32, dtype=torch.float16, bwd=True, dev="cpu", **kw)
    assert "key_padding" in c.case and ("cross" in c.case) == ("window" not in kw)
    with opsadv.use_backend("auto"), opsadv.trace() as t:
        mine = c.opsadv()
    assert set(t.counts) == {"cuda.triton.sparse_attention"}, t.counts
    for a, b in zip(mine, c.peers["sdpa_masked"]()):
        assert runner.rel_err(a, b) < 2e-3


def test_flex_peer_stays_compiled_across_cases():
    """The flex peer compiles once per case (shape, mask, grad mode): past dynamo's default recompile
    limit (8) it silently runs unfused, ~200x slower (seen in the window series), and the backward-only
    rows' retain_graph=True needs a compiled backward without donated buffers."""
    import torch._dynamo.config as dynamo_config
    import torch._functorch.config as functorch_config

    from opsadv.bench.case import flex_peer
    flex, make_mask = flex_peer()
    if flex is None:
        pytest.skip("no FlexAttention in this torch")
    assert dynamo_config.recompile_limit >= 64
    assert functorch_config.donated_buffer is False


def test_swiglu_act_rows_run_and_verify():
    """The gemm suite's swiglu-op rows (memory-bound, TB/s): forward and forward+backward run, and opsadv's
    output is checked against the eager peer's."""
    from opsadv.bench.suite_gemm import _swiglu_act_cases
    for case in _swiglu_act_cases("cpu", torch.float32, m=33, n=20):
        (row,) = runner.run_case(case)
        assert row["unit"] == "TB/s" and row["rel_err"] < 1e-5 and row["opsadv_ms"] > 0, row


def test_fp8_swiglu_rows_run_and_verify():
    """The fp8 suite's scaled_swiglu_gemm rows (tiny, reference backend on the CPU): every scaling, the peers run, the
    row's rel_err is against the dequantized operands' silu(g) * u, the speedup against the composed FP8 path."""
    from opsadv.bench import suite_fp8
    assert suite_fp8.SWIGLU_SHAPES == ((16384, 2048, 8192),)
    with opsadv.use_backend("reference"):
        cases = list(suite_fp8.swiglu_cases(False, dev="cpu", shapes=((33, 256, 40),)))
        assert [c.case for c in cases] == [f"fwd e4m3 m33 n2x40 k256 swiglu scale_{s}" for s in ("tensor", "row",
                                                                                                  "block")]
        for c in cases:
            assert c.baseline == "scaled_gemm_swiglu" and c.work == 2.0 * 33 * 256 * 80
            assert {"scaled_gemm_swiglu", "bf16_swiglu_gemm"} <= set(c.peers)
            (row,) = runner.run_case(c)
            assert row["unit"] == "TFLOP/s" and row["opsadv_ms"] > 0 and row["opsadv_impl"] == \
                "reference.scaled_swiglu_gemm", row
            assert row["rel_err"] < 5e-3, row          # bf16 output rounding against the float32 value


def test_fp8_cast_rows_run_and_verify():
    """The fp8 suite's cast_to_fp8 rows (tiny, on the CPU under the interpreter's kernel): both formats, the unfused
    torch cast as the baseline, bit for bit its values (rel_err 0)."""
    from opsadv.bench import suite_fp8
    cases = list(suite_fp8.cast_cases(False, dev="cpu", shapes=((37, 70),)))
    assert [c.case for c in cases] == ["cast bf16 e4m3 m37 n70 transpose", "cast bf16 e5m2 m37 n70 transpose"]
    for c in cases:
        assert c.baseline == "torch_ops" and c.work == 4.0 * 37 * 70 and set(c.peers) == {"torch_ops", "torch_compile"}
        (row,) = runner.run_case(c)
        assert row["unit"] == "TB/s" and row["rel_err"] == 0.0 and row["opsadv_ms"] > 0, row


def test_bench_window_covers_several_calls_of_long_cases():
    """do_bench times rep / est calls: short calls keep the 40 ms window, long ones get >= MIN_CALLS calls
    (a 29 ms case timed once per round read the same kernel 0.95-1.00x its peer)."""
    assert runner.bench_window(0.1) == (10.0, 40.0)
    warmup, rep = runner.bench_window(29.0)
    assert rep / 29.0 >= runner.MIN_CALLS and warmup >= 29.0
    assert runner.bench_window(-1.0) == (10.0, 40.0)


def test_compiled_peers_lift_the_recompile_limit():
    """Every bench case is one more compile of a peer's function: past dynamo's limit (8) the peer silently
    ran eagerly (the norm suite's torch_compile rows read the eager times)."""
    import torch._dynamo.config as dynamo_config

    from opsadv.bench.case import RECOMPILE_LIMIT, compiled_peer
    name = "recompile_limit" if hasattr(dynamo_config, "recompile_limit") else "cache_size_limit"
    old = getattr(dynamo_config, name)
    try:
        setattr(dynamo_config, name, 8)
        compiled_peer(lambda x: x + 1)
        assert getattr(dynamo_config, name) >= RECOMPILE_LIMIT
    finally:
        setattr(dynamo_config, name, old)


def test_norm_suite_backward_only_rows_time_the_backward(monkeypatch):
    """The norm suite's "bwd" rows keep each contender's forward graph and time autograd.grad alone: the forward
    runs once per contender, every timed call returns the same gradients (small shapes, reference backend)."""
    from opsadv.bench import suite_norm
    monkeypatch.setattr(suite_norm, "_grid", lambda quick: [("layer_norm", 5, 48, True, "only"),
                                                             ("rms_norm", 3, 40, False, "only")])
    calls = []
    real = suite_norm._eager
    monkeypatch.setattr(suite_norm, "_eager", lambda op, res: (lambda *a: (calls.append(op), real(op, res)(*a))[1]))
    with opsadv.use_backend("reference"):
        cases = list(suite_norm.cases(False))
        assert [c.case for c in cases] == ["bwd bf16 t5 h48 layer_norm residual", "bwd bf16 t3 h40 rms_norm"]
        for c in cases:
            first, second = c.peers["torch_eager"](), c.peers["torch_eager"]()
            assert all(torch.equal(a, b) for a, b in zip(first, second))
            ours = c.opsadv()
            assert len(ours) == len(first) and all(runner.rel_err(a, b) < 2e-2 for a, b in zip(ours, first))
            assert c.work == suite_norm.bytes_moved(c.case.split()[4], int(c.case.split()[2][1:]),
                                                    int(c.case.split()[3][1:]), "residual" in c.case, "only")
    assert calls == ["layer_norm", "rms_norm"]          # one forward per contender, however many calls


def test_rotary_suite_cases_match_transformers_expression(monkeypatch):
    """The rotary suite's contenders agree (fwd and fwd+bwd, full and partial width) on small shapes; the rows are
    against transformers' expression (the baseline), bytes as documented."""
    from opsadv.bench import suite_rotary
    monkeypatch.setattr(suite_rotary, "SHAPES", (("tiny", 2, 5, 4, 2, 8, 8), ("tiny-partial", 1, 3, 2, 2, 8, 4)))
    with opsadv.use_backend("reference"):
        cases = list(suite_rotary.cases(False))
        assert [c.case for c in cases] == ["fwd bf16 tiny b2 s5 h4/2 d8", "fwd bf16 tiny-partial b1 s3 h2/2 d8 r4",
                                           "fwd+bwd bf16 tiny b2 s5 h4/2 d8", "fwd+bwd bf16 tiny-partial b1 s3 h2/2 d8 r4"]
        for c in cases:
            assert c.baseline == "torch_eager" and set(c.peers) == {"torch_eager"}      # CPU: no compile / Liger
            ours, ref = c.opsadv(), c.peers["torch_eager"]()
            assert len(ours) == 2 and all(runner.rel_err(a, b) < 1e-2 for a, b in zip(ours, ref))
    assert cases[0].work == suite_rotary.bytes_moved(2, 5, 4, 2, 8, 8, False) == 2 * (2 * 5 * 6 * 8 * 2) + 2 * 2 * 5 * 8 * 2


def test_rotary_suite_qk_norm_rows_match_qwen3_expression():
    """The qk_norm rows (GPU only in the suite): opsadv's qk_norm_rotary and transformers' Qwen3 lines (norms on
    the (b, s, h, d) projections, transpose, rotary) agree, forward and every gradient, on a small CPU shape."""
    from opsadv.bench import suite_rotary
    with opsadv.use_backend("reference"):
        cases = list(suite_rotary.qk_cases(False, "cpu", shapes=(("tiny", 2, 5, 4, 2, 8),)))
        assert [c.case for c in cases] == ["fwd fp32 qk_norm tiny b2 s5 h4/2 d8", "fwd+bwd fp32 qk_norm tiny b2 s5 h4/2 d8"]
        for c in cases:
            assert c.baseline == "torch_eager" and set(c.peers) == {"torch_eager"}
            ours, ref = c.opsadv(), c.peers["torch_eager"]()
            assert len(ours) == len(ref) and all(runner.rel_err(a, b) < 1e-5 for a, b in zip(ours, ref))
    assert cases[0].work == suite_rotary.qk_bytes_moved(2, 5, 4, 2, 8, False) == 2 * (2 * 5 * 6 * 8 * 2) + 2 * 2 * 5 * 8 * 2


def test_decode_suite_grid_and_tiny_cases_on_cpu():
    """The decode suite's grid (44 cases, 4 quick; b64 x 128k left out) and its contenders agreeing on tiny shapes:
    the paged cache and the peers' contiguous copy hold the same K / V.  fp8 rows: after their case's row, against
    opsadv's own kernel over the dequantized cache (agreeing closely), and close to the bf16 row's output (the
    quantization's error only); 1 byte per K / V element of work; two of the quick grid's cases get one."""
    from opsadv.bench import suite_decode
    full, quick = suite_decode.grid(False), suite_decode.grid(True)
    assert len(full) == 2 * 2 * 3 * 4 - 2 * 2 and len(quick) == 4 and set(quick) <= set(full)
    assert ("gqa", 32, 8, 16, 1, 131072) in full and not any(b == 64 and s == 131072 for *_, b, s in full)
    assert {(lab, p, b, s) for lab, _, _, p, b, s in quick} >= set(suite_decode.QUICK_FP8)
    shapes = [("gqa", 4, 2, 16, 2, 37, 16), ("mqa", 4, 1, 8, 1, 50, 16)]
    with opsadv.use_backend("reference"):
        cases = list(suite_decode.cases(False, shapes=shapes))
        assert [c.case for c in cases] == ["fwd fp32 decode gqa b2 ctx37 h4/2 d16 page16",
                                           "fwd fp32 fp8kv decode gqa b2 ctx37 h4/2 d16 page16",
                                           "fwd fp32 decode mqa b1 ctx50 h4/1 d16 page8",
                                           "fwd fp32 fp8kv decode mqa b1 ctx50 h4/1 d16 page8"]
        for c, c8 in zip(cases[::2], cases[1::2]):
            assert c.unit == "TB/s" and set(c.peers) == {"sdpa"} and c.baseline == "sdpa"
            ours = c.opsadv()
            assert runner.rel_err(ours, c.peers["sdpa"]()) < 1e-5
            assert set(c8.peers) == {"opsadv_bf16"} and c8.baseline == "opsadv_bf16" and c8.unit == "TB/s"
            ours8 = c8.opsadv()
            assert runner.rel_err(ours8, c8.peers["opsadv_bf16"]()) < 1e-6
            assert 1e-3 < runner.rel_err(ours8, ours) < 5e-2                 # e4m3's error, not a bf16 copy's
        assert [c.case for c in suite_decode.cases(False, shapes=shapes, fp8_shapes=shapes[1:])][1:] == \
            ["fwd fp32 decode mqa b1 ctx50 h4/1 d16 page8", "fwd fp32 fp8kv decode mqa b1 ctx50 h4/1 d16 page8"]
    assert cases[0].work == suite_decode.bytes_moved(2, 37, 4, 2, 16, 4) == 2 * 2 * 37 * 2 * 16 * 4 + 2 * 2 * 4 * 16 * 4
    assert cases[1].work == suite_decode.bytes_moved(2, 37, 4, 2, 16, 4, kv_es=1) == \
        2 * 2 * 37 * 2 * 16 * 1 + 2 * 2 * 4 * 16 * 4


def test_decode_flex_paged_peer_on_cpu():
    """The flex_paged contender (FlexAttention over the paged cache in place, block mask from the block table through
    torch's PagedAttention helper), built with eager flex_attention on CPU: opsadv's paged_attention's output over
    shuffled pages, sequences of unequal lengths (one ending mid-page), GQA."""
    pytest.importorskip("torch.nn.attention.experimental._paged_attention")
    import warnings

    from torch.nn.attention.flex_attention import flex_attention

    from opsadv.bench import suite_decode
    kc, vc, table, lens, _, _ = suite_decode.paged_cache(2, 40, 2, 16, 16, torch.float32, "cpu")
    lens = torch.tensor([40, 23], dtype=torch.int32)
    q = torch.randn(2, 1, 4, 16, generator=torch.Generator().manual_seed(2))
    run = suite_decode.flex_paged_peer(flex_attention, q, kc, vc, table, lens)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")                       # eager flex warns that it is not compiled
        got = run()
    with opsadv.use_backend("reference"), torch.no_grad():
        want = opsadv.ops.paged_attention(q, kc, vc, table, lens).transpose(1, 2)
    assert runner.rel_err(got, want) < 1e-5


def test_fp8_cast_delayed_rows_run_and_verify():
    """The fp8 suite's cast_to_fp8_delayed rows (tiny, on the CPU under the interpreter's kernel): the recipe's
    previous steps (cast_to_fp8 and a Python ring) as the baseline, bit for bit torch's cast under the scale the
    started history gives (rel_err 0)."""
    from opsadv.bench import suite_fp8
    cases = list(suite_fp8.cast_delayed_cases(True, dev="cpu", shapes=((37, 70),)))
    (c,) = cases
    assert c.case == "cast delayed bf16 e4m3 m37 n70 transpose"
    assert c.baseline == "cast_steps" and c.work == 4.0 * 37 * 70 and set(c.peers) == {"cast_steps", "torch_ops"}
    with opsadv.use_backend("cuda"):
        (row,) = runner.run_case(c)
    assert row["unit"] == "TB/s" and row["rel_err"] == 0.0 and row["opsadv_ms"] > 0, row
    assert row["opsadv_impl"] == "cuda.triton.cast_to_fp8_delayed", row
