"""Packed padded encoders (opsadv.convert.packing), the device-side tile index used under CUDA-graph
capture (layout._build_tile_index static mode), and the CUDA-graph runner (opsadv.runtime.graphs):
refusals and signature logic on CPU, capture/replay on a GPU (skipped without one)."""
import copy

import pytest
import torch

import opsadv
from opsadv import SparseLayout
from opsadv.core import sparse_tiles as layout_mod
from opsadv.errors import InvalidArgumentError
from opsadv.runtime import graphs

from conftest import rel_err, requires_gpu

tf = pytest.importorskip("transformers")


def tiny_bert(dtype=torch.float32, device="cpu", layers=2):
    torch.manual_seed(0)
    cfg = tf.BertConfig(hidden_size=64, num_hidden_layers=layers, num_attention_heads=4, intermediate_size=128,
                        vocab_size=100, max_position_embeddings=160)
    cfg._attn_implementation = "sdpa"
    return tf.BertModel(cfg).to(device=device, dtype=dtype).eval()


def padded_batch(device="cpu", b=3, s=37, lens=(37, 20, 5)):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 100, (b, s), generator=g).to(device)
    am = (torch.arange(s)[None, :] < torch.tensor(lens)[:, None]).long().to(device)
    return ids, am


def hidden(m, ids, am):
    with torch.no_grad():
        return m(input_ids=ids, attention_mask=am).last_hidden_state


def test_bucket_rows_bounds():
    from opsadv.convert.packing import bucket_rows
    seen = set()
    for n in range(1, 16385, 7):
        r = bucket_rows(n, 16384)
        assert n <= r <= 16384
        assert r - n <= max(256, r // 8)          # filler stays a small fraction
        seen.add(r)
    assert len(seen) < 40                         # few graphs cover every count
    assert bucket_rows(5, 100) == 100             # never more rows than the batch has


@pytest.mark.parametrize("rows", [None, 62, 80, 111])
def test_packed_bert_matches_original(reference_backend, rows):
    """Real-token outputs equal the unconverted model's; padded positions are 0; the layers ran on
    packed rows (exact eager count, or a static row count with filler rows as under capture)."""
    from opsadv.convert import packing
    base = tiny_bert()
    conv = opsadv.convert_model(copy.deepcopy(base))
    assert conv.opsadv_report.count("packed") == 1
    ids, am = padded_batch()
    tok = packing.static_rows.set(rows)
    try:
        seen = []
        hook = conv.encoder.layer[0].register_forward_pre_hook(lambda m, a: seen.append(tuple(a[0].shape)))
        with opsadv.trace() as t:
            y = hidden(conv, ids, am)
        hook.remove()
    finally:
        packing.static_rows.reset(tok)
    ref = hidden(base, ids, am)
    keep = am.bool()
    assert seen == [(1, rows or int(am.sum()), 64)]
    assert t.counts["reference.sparse_attention"] == 2
    assert rel_err(y[keep], ref[keep]) < 1e-5
    assert (y[~keep] == 0).all()


def test_packing_off_and_undo(reference_backend):
    base = tiny_bert()
    conv = opsadv.convert_model(copy.deepcopy(base), pack_padding=False)
    assert conv.opsadv_report.count("packed") == 0
    assert "forward" not in conv.encoder.__dict__
    conv2 = opsadv.convert_model(copy.deepcopy(base), opt_level=1)   # packing is an opt_level 2 rewrite
    assert conv2.opsadv_report.count("packed") == 0
    from opsadv.convert import packing, passes, report as rep
    m = copy.deepcopy(base)
    m.set_attn_implementation("opsadv")
    undo = passes.Undo()
    assert packing.packing_pass(m, rep.ConversionReport("x", 2, "auto", "fp32"), undo) == 1
    assert isinstance(m.encoder.__dict__["forward"], packing.PackedEncoderForward)
    undo.revert()
    assert "forward" not in m.encoder.__dict__


def test_packing_refuses_relative_positions():
    from opsadv.convert import packing
    m = tiny_bert()
    m.config.position_embedding_type = "relative_key"
    m.config._attn_implementation = "opsadv"
    assert "position_embedding_type" in packing.candidate(m, m.encoder)


def _index_lists(ti):
    """{(b, h, row): (n_partial, sorted partial ids, sorted full ids)} of a TileIndex."""
    out = {}
    rows, cols = ti.rows, ti.cols
    for idx in torch.cartesian_prod(*[torch.arange(n) for n in rows.shape[:3]]).tolist():
        npart, nall = rows[tuple(idx)].tolist()
        c = cols[tuple(idx)][:nall].tolist()
        out[tuple(idx)] = (npart, sorted(c[:npart]), sorted(c[npart:]))
    return out


@pytest.mark.parametrize("make", [
    lambda: SparseLayout.from_padding_mask(torch.tensor([[1] * 50 + [0] * 17, [1] * 3 + [0] * 64]), block_size=16),
    lambda: SparseLayout(70, 70, 16, torch.ones(1, 1, 5, 5, dtype=torch.bool),
                         cu_seqlens=torch.tensor([0, 20, 20, 51, 70], dtype=torch.int32)),
])
def test_static_tile_index_lists_same_tiles(monkeypatch, make):
    """The capture-time (static) tile index lists exactly the tiles of the host-built one, in
    wider rows, and needs no host read (bm mode 2 unless read eagerly before)."""
    lay = make()
    ref = layout_mod._build_tile_index(lay.block_mask, lay.key_padding_mask, lay.cu_seqlens, lay.block_size, False,
                                       -1, -1, 0, lay.seq_q, lay.seq_k, 32, 16)
    monkeypatch.setattr(layout_mod, "capturing", lambda t: True)
    monkeypatch.setattr(layout_mod, "_bm_modes", layout_mod.ValueCache())
    st = layout_mod._build_tile_index(lay.block_mask, lay.key_padding_mask, lay.cu_seqlens, lay.block_size, False,
                                      -1, -1, 0, lay.seq_q, lay.seq_k, 32, 16)
    assert st.cols.shape[-1] == -(-lay.seq_k // 16) and st.tiles == -1 and st.bm_mode == 2
    assert _index_lists(st) == _index_lists(ref)


def test_static_packed_layout_kernel_matches_reference(monkeypatch):
    """The cuda backend's sparse kernel (Triton interpreter) over a packed layout with a filler
    segment and a statically built tile index equals the reference on the real rows."""
    pytest.importorskip("opsadv.backends.triton_common.sparse_attention.sparse")
    torch.manual_seed(0)
    n, rows = 51, 70
    cu = torch.tensor([0, 20, 20, 51, rows], dtype=torch.int32)
    lay = SparseLayout(rows, rows, 16, torch.ones(1, 1, 5, 5, dtype=torch.bool), cu_seqlens=cu)
    q, k, v = (torch.randn(1, 2, rows, 32, dtype=torch.float16) for _ in range(3))
    with opsadv.use_backend("reference"):
        ref = opsadv.ops.sparse_attention(q.float(), k.float(), v.float(), lay)
    monkeypatch.setattr(layout_mod, "capturing", lambda t: True)
    with opsadv.use_backend("cuda"):
        out = opsadv.ops.sparse_attention(q, k, v, lay)
    assert rel_err(out[:, :, :n], ref[:, :, :n]) < 5e-3


def test_graph_runner_refusals():
    with pytest.raises(InvalidArgumentError, match="CUDA"):
        graphs.CudaGraphRunner(lambda x: x, device="cpu")
    with pytest.raises(InvalidArgumentError, match="max_graphs"):
        graphs.CudaGraphRunner(lambda x: x, device="cuda", max_graphs=0)
    m = torch.nn.Linear(2, 2)
    r = graphs.CudaGraphRunner(m.forward, device="cuda", module=m)
    m.eval()
    with pytest.raises(InvalidArgumentError, match="no_grad"):
        r.check_mode()                            # gradients enabled: inference only
    m.train()
    with torch.no_grad(), pytest.raises(InvalidArgumentError, match="training"):
        r.check_mode()
    m.eval()
    with torch.no_grad():
        r.check_mode()
    with pytest.raises(InvalidArgumentError, match="cuda_graphs"):
        opsadv.convert_model(tiny_bert(), cuda_graphs=True)     # a CPU model
    with pytest.raises(InvalidArgumentError, match="cuda_graphs"):
        opsadv.convert_model(tiny_bert(), cuda_graphs="yes")


def test_signature_specializes_on_values_and_layout():
    a = torch.zeros(2, 3)
    s1 = graphs.signature([a, 1, None])
    assert s1 == graphs.signature([torch.ones(2, 3), 1, None])
    assert s1 != graphs.signature([a, 2, None])
    assert s1 != graphs.signature([a.t().contiguous().t(), 1, None])      # other strides
    assert s1 != graphs.signature([a.half(), 1, None])
    with pytest.raises(InvalidArgumentError, match="constants"):
        graphs.signature([a, [1, 2]])


@requires_gpu
def test_graphed_bert_on_gpu():
    """Capture/replay: outputs equal the eager converted model for several masks (a new bucket
    captures, a new mask in the same bucket replays with new values); grad mode refuses."""
    base = tiny_bert(torch.float16, "cuda", layers=2)
    eager = opsadv.convert_model(copy.deepcopy(base))
    conv = opsadv.convert_model(copy.deepcopy(base), cuda_graphs=True)
    assert conv.opsadv_report.count("graphs") == 1
    for lens in ((37, 20, 5), (37, 21, 5), (10, 10, 10), (37, 37, 37)):
        ids, am = padded_batch("cuda", lens=lens)
        y, ref = hidden(conv, ids, am), hidden(eager, ids, am)
        keep = am.bool()
        assert rel_err(y[keep], ref[keep]) < 2e-3
        assert (y[~keep] == 0).all()
    assert conv.opsadv_graphs.stats.replays >= 4
    with pytest.raises(InvalidArgumentError, match="no_grad"):
        conv(input_ids=ids, attention_mask=am)


def test_replays_count_the_captured_impls_in_trace(monkeypatch):
    """opsadv.trace() under graph replay reports the impls the captured forward ran (CUDA graph API
    faked: capture runs the function, replay does nothing)."""
    import contextlib

    import opsadv
    from opsadv.runtime import graphs

    class FakeGraph:
        def replay(self):
            pass

    class FakeStream:
        def __init__(self, *a, **k):
            pass

        def wait_stream(self, other):
            pass
    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", lambda g: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda d=None: FakeStream())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    w = torch.randn(8)

    def fwd(x):
        return opsadv.ops.rms_norm(x, w, 1e-6)
    r = graphs.CudaGraphRunner(fwd, device="cuda")
    monkeypatch.setattr(r, "_check_devices", lambda tensors: None)
    x = torch.randn(3, 8)
    with opsadv.use_backend("reference"), torch.no_grad():
        with opsadv.trace() as t:
            r(x)
            r(x)
    assert r.stats.captures == 1 and r.stats.replays == 2
    assert t.counts["reference.rms_norm"] == 2 + 1 + 2   # two warm-ups, the capture, two replays
    (g,) = r.graphs.values()
    assert g.impls == {"reference.rms_norm": 1}
