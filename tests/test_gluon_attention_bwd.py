"""The Gluon Hopper flash-attention backward (_gluon_fa_bwd_kernel.py, host side gluon_attention_bwd.py).

CPU: every schedule of VARIANTS compiles for sm_90 with no STL/LDL at all (ptxas, no GPU), for d 64/128,
bf16/fp16, causal or not; the warp-specialized schedules' barrier protocol (producer warp, Q/dO ring,
consumer releases) holds under random interleavings and the check fails on a missing barrier or a wrong
parity; the kernel's tile recurrence (K/V tile per CTA, q tiles from m_lo over every q head of
the GQA group, which tiles are masked, lse2 / delta conventions, P and dS rounded to the input dtype
before their GEMMs, dQ accumulated in float32 per K tile and scaled before the add, dK scaled at the
end) emulated in torch against float64 autograd of softmax attention, for fp32 and fp16 inputs, causal
and not, odd lengths, GQA/MQA, s_q != s_k and empty rows; the emulation fails on a wrong mask.
GPU (sm_90 only, TRITON_INTERPRET=0): the real kernel against float64, with NaN-poisoned outputs, the
default schedule on every shape and every schedule on three."""
from __future__ import annotations

import json
import math
import os

import pytest
import torch

# one xdist worker runs this whole module, so its module-scoped fixture is built once (the README's
# `pytest -n auto --dist loadgroup`)
pytestmark = pytest.mark.xdist_group("gluon_attention_bwd")

from barrier_sim import Bar, Ring, run
from conftest import ATTENTION_GPU_CASES, gluon_marks, load_without_gluon

GB = pytest.importorskip("opsadv.backends.cuda.flash_attention.gluon_bwd")
needs_gluon, requires_sm90 = gluon_marks(GB)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BLOCK_M, BLOCK_N = 64, 128          # the kernel's tiles (asserted against the module where it imports)


# ---- float64 autograd reference ------------------------------------------------------------------------
def reference(q, k, v, do, causal, scale):
    """(out, lse, dq, dk, dv) of softmax attention in float64 by autograd.  Bottom-right causal; a row
    that sees no key has out 0, lse -inf and zero gradients.  GQA by repeating K/V (autograd sums the
    repeats back into dK/dV)."""
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    group = q.shape[1] // k.shape[1]
    kr, vr = k64.repeat_interleave(group, 1), v64.repeat_interleave(group, 1)
    s = q64 @ kr.transpose(-1, -2) * scale
    sq, sk = q.shape[2], k.shape[2]
    if causal:
        keep = torch.arange(sk)[None, :] <= torch.arange(sq)[:, None] + (sk - sq)
    else:
        keep = torch.ones(sq, sk, dtype=torch.bool)
    seen = keep.any(-1)[:, None]                                   # rows with at least one key
    s = s.masked_fill(~keep, float("-inf")).masked_fill(~seen, 0.0)
    lse = torch.logsumexp(s, -1)
    p = torch.softmax(s, -1) * seen
    out = p @ vr
    dq, dk, dv = torch.autograd.grad(out, (q64, k64, v64), do.double())
    lse = lse.detach().masked_fill(~seen[:, 0], float("-inf"))
    return out.detach(), lse, dq, dk, dv


# ---- the kernel's recurrence, emulated -----------------------------------------------------------------
def emulate_bwd(q, k, v, out, lse, do, causal, scale, diag_shift=0, m_mid_shift=0):
    """fa_bwd_kernel step by step in float32.  out/lse as the forward gives them (out in q's dtype, lse
    float32 natural log).  diag_shift / m_mid_shift are deliberate bugs for the must-fail tests: the
    causal mask's diagonal moved, the first unmasked q tile moved."""
    b, hq, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    group = hq // hkv
    dt = q.dtype
    qk_scale = scale * 1.4426950408889634
    offset = sk - sq
    # Host preprocess (attention._bwd_pre_kernel): delta = rowsum(dO * O) in float32, lse in log2 units
    # with +inf for empty rows.
    delta = (out.float() * do.float()).sum(-1)
    lse2 = torch.where(torch.isneginf(lse), float("inf"), lse.float() * 1.4426950408889634)
    n_qtiles = -(-sq // BLOCK_M)
    # TMA zero-fill: rows past s_q of Q/dO, past s_k of K/V; lse2 +inf and delta 0 past s_q.
    pad_q, pad_k = n_qtiles * BLOCK_M - sq, (-sk) % BLOCK_N
    qf = torch.nn.functional.pad(q.float(), (0, 0, 0, pad_q))
    dof = torch.nn.functional.pad(do.float(), (0, 0, 0, pad_q))
    kf = torch.nn.functional.pad(k.float(), (0, 0, 0, pad_k))
    vf = torch.nn.functional.pad(v.float(), (0, 0, 0, pad_k))
    lse2 = torch.nn.functional.pad(lse2, (0, pad_q), value=float("inf"))
    delta = torch.nn.functional.pad(delta, (0, pad_q), value=0.0)
    dq_acc = torch.zeros(b, hq, n_qtiles * BLOCK_M, d)            # the float32 atomic target
    dk_out = torch.empty(b, hkv, sk, d, dtype=dt)
    dv_out = torch.empty(b, hkv, sk, d, dtype=dt)
    for n0 in range(0, sk, BLOCK_N):                                # one CTA per (K/V tile, b, kv head)
        keys = torch.arange(n0, n0 + BLOCK_N)
        if causal:
            m_lo = min(max(n0 - offset, 0) // BLOCK_M, n_qtiles)
            m_mid = -(-max(n0 + BLOCK_N - 1 - offset, 0) // BLOCK_M)
            m_mid = min(max(m_mid, m_lo), n_qtiles)
        else:
            m_lo = m_mid = 0
        if n0 + BLOCK_N > sk:
            m_mid = n_qtiles
        m_mid += m_mid_shift
        kt, vt = kf[:, :, n0:n0 + BLOCK_N], vf[:, :, n0:n0 + BLOCK_N]          # (b, hkv, BN, d)
        dk = torch.zeros(b, hkv, BLOCK_N, d)
        dv = torch.zeros(b, hkv, BLOCK_N, d)
        for g in range(group):
            heads = torch.arange(hkv) * group + g                   # q head hk * GROUP + g of each kv head
            for mt in range(m_lo, n_qtiles):
                rows = torch.arange(mt * BLOCK_M, (mt + 1) * BLOCK_M)
                qt, dot = qf[:, heads][:, :, rows], dof[:, heads][:, :, rows]
                s = qt @ kt.transpose(-1, -2)
                p = torch.exp2(s * qk_scale - lse2[:, heads][:, :, rows, None])
                if mt < m_mid:
                    keep = (keys < sk)[None, :]
                    if causal:
                        keep = keep & (keys[None, :] <= rows[:, None] + offset + diag_shift)
                    p = torch.where(keep, p, 0.0)
                p16 = p.to(dt).float()                                  # P through shared memory
                dp = dot.to(dt).float() @ vt.transpose(-1, -2)
                ds = p * (dp - delta[:, heads][:, :, rows, None])
                ds16 = ds.to(dt).float()                                # dS through shared memory
                dv += p16.transpose(-1, -2) @ dot
                dk += ds16.transpose(-1, -2) @ qt
                dq_acc[:, heads, mt * BLOCK_M:(mt + 1) * BLOCK_M] += (ds16 @ kt) * scale
        dk_out[:, :, n0:n0 + BLOCK_N] = (dk * scale).to(dt)[:, :, :min(BLOCK_N, sk - n0)]
        dv_out[:, :, n0:n0 + BLOCK_N] = dv.to(dt)[:, :, :min(BLOCK_N, sk - n0)]
    return dq_acc[:, :, :sq].to(dt), dk_out, dv_out


def grad_err(x, r) -> float:
    """Relative error, with a floor on the denominator: dQ is exactly 0 when each row sees one key
    (softmax of a single score is constant), where a plain relative error would divide 1e-7 by 0."""
    x, r = x.double().cpu(), r.double().cpu()
    return ((x - r).norm() / max(r.norm().item(), 0.05 * math.sqrt(r.numel()))).item()


def _inputs(b, hq, hkv, sq, sk, d, dtype, causal, scale):
    q = torch.randn(b, hq, sq, d).to(dtype)
    k, v = (torch.randn(b, hkv, sk, d).to(dtype) for _ in range(2))
    do = torch.randn(b, hq, sq, d).to(dtype)
    out, lse, *grads = reference(q, k, v, do, causal, scale)
    return q, k, v, do, out.to(dtype), lse.float(), grads


EMULATE_CASES = [  # b, hq, hkv, sq, sk, d, causal
    (1, 2, 2, 1, 1, 64, False),
    (1, 2, 2, 3, 3, 64, True),
    (2, 2, 1, 127, 127, 64, True),          # MQA, one partial K tile, q tiles on and off the diagonal
    (1, 4, 2, 300, 300, 64, True),          # GQA: dK/dV summed over the group; 3 K tiles
    (1, 2, 2, 300, 300, 128, False),        # ragged tail K tile, d128
    (1, 2, 2, 1, 300, 64, True),            # decode: s_q = 1 sees every key
    (1, 4, 2, 130, 400, 64, True),          # s_q < s_k, offset not a multiple of any tile
    (1, 2, 2, 300, 100, 64, True),          # s_q > s_k: the first 200 rows see nothing
    (1, 2, 2, 260, 256, 64, False),         # s_k a multiple of 128, s_q not of 64
    (1, 3, 1, 200, 333, 128, True),         # MQA 3 heads, s_q < s_k, d128
]


@pytest.mark.parametrize("b,hq,hkv,sq,sk,d,causal", EMULATE_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_emulated_recurrence_matches_float64_autograd(b, hq, hkv, sq, sk, d, causal, dtype, seed):
    scale = 0.9 / math.sqrt(d)
    q, k, v, do, out, lse, (rq, rk, rv) = _inputs(b, hq, hkv, sq, sk, d, dtype, causal, scale)
    dq, dk, dv = emulate_bwd(q, k, v, out, lse, do, causal, scale)
    tol = 1e-5 if dtype == torch.float32 else 2e-3      # worst seen: 2.3e-6 fp32, 4.7e-4 fp16
    for name, x, r in (("dq", dq, rq), ("dk", dk, rk), ("dv", dv, rv)):
        assert not torch.isnan(x).any(), name
        assert grad_err(x, r) < tol, (name, grad_err(x, r))
    empty = torch.isneginf(lse)
    assert (dq[empty] == 0).all()                           # rows that saw no key: no gradient


def _wrong_mask_error(**bug):
    torch.manual_seed(0)
    scale = 0.125
    q, k, v, do, out, lse, (rq, rk, rv) = _inputs(1, 2, 2, 200, 200, 64, torch.float32, True, scale)
    dq, dk, dv = emulate_bwd(q, k, v, out, lse, do, True, scale, **bug)
    return max(grad_err(x, r) for x, r in ((dq, rq), (dk, rk), (dv, rv)))


def test_emulation_detects_a_wrong_mask():
    """The comparison can fail: the causal diagonal one key too far, or the mask stopping one q tile
    early (a diagonal tile taking the unmasked step), must both be far outside the tolerance."""
    assert _wrong_mask_error() < 1e-5                       # the same check without the bug passes
    assert _wrong_mask_error(diag_shift=1) > 1e-2
    assert _wrong_mask_error(m_mid_shift=-1) > 1e-2


@needs_gluon
def test_tile_constants_match_the_kernel():
    from opsadv.backends.cuda.flash_attention import gluon_bwd_kernel as KB
    assert (KB.BLOCK_M, KB.BLOCK_N) == (BLOCK_M, BLOCK_N)


# ---- the warp-specialized (ws) barrier protocol, emulated ---------------------------------------------
def emulate_ws_protocol(n_iter, stages, seed, bug=None, dq_writer=False):
    """fa_bwd_kernel's WARP_SPEC protocol under a random interleaving of the producer warp, the two
    consumer warpgroups (one partition: its gl.thread_barrier waits for both) and the TMA completions.
    Producer: K/V on kv_bar, then Q_t and dO_t into slot t % stages after waiting qd_empty.  Each
    warpgroup per tile: wait q_ready (S reads Q), wait do_ready (dP reads dO), write its keys' half of P
    and dS, barrier, GEMMs reading all of P/dS (dQ = dS K) and the Q/dO slot, then _release: barrier and
    one arrive on qd_empty.  dq_writer (DQ_WRITER): each warpgroup also writes its half of dQ_part into the
    one dq buffer after waiting dq_empty and before the release; the producer drains tile t - stages
    (read, arrive dq_empty) after loading tile t, trusting its wait on qd_empty for tile t to mean that
    tile t - stages was released, and drains the last tiles after its loop, each after waiting for that
    tile's release on qd_empty.
    Asserts that no load overwrites a slot still being read or not yet read, that every read finds its
    tile landed, that nobody writes P/dS while the other warpgroup reads them, that the writer reads whole
    dQ tiles in order and nobody overwrites one it has not read, and that nothing deadlocks.  bug: "no_barrier" (the release's thread barrier left out: the first
    warpgroup to finish arrives for both), "parity" (the producer waits on the slot's phase parity
    without the ^1: it blocks on the first lap), "late_dq_store" (a warpgroup stores its dQ_part half
    after the release)."""
    import random
    rnd = random.Random(seed)
    n_wg = 2
    kv_bar = Bar(1)
    q_ready, do_ready = [Bar(1) for _ in range(stages)], [Bar(1) for _ in range(stages)]
    qd_empty = [Bar(1) for _ in range(stages)]
    cta = Bar(n_wg)                                   # the consumer partition's thread barrier
    n_cta = [0] * n_wg                                 # thread barriers passed, per warpgroup
    ps_readers, ps_tile = set(), [None] * n_wg         # who reads P/dS now; tile of each half
    kv_landed = [False]
    ring = Ring(("q", "do"), stages, n_wg)
    load, start_read, end_read = ring.load, ring.start_read, ring.end_read
    tma = ring.in_flight                               # the K/V load ("kv", 0) goes there too
    dq_empty = Bar(1)
    dq_buf = [None] * n_wg                             # tile whose dQ_part each warpgroup's half holds
    dq_drained = []                                    # tiles the writer added to global memory

    def barrier(wg):
        cta.arrive()
        yield cta, n_cta[wg] & 1
        n_cta[wg] += 1

    def drain(j):
        assert dq_buf == [j] * n_wg, f"the writer reads dQ tile {j}: the buffer holds {dq_buf}"
        yield None, None                               # the warp's shared loads and atomics
        assert dq_buf == [j] * n_wg, f"dQ tile {j} overwritten ({dq_buf}) while the writer reads it"
        dq_drained.append(j)
        dq_empty.arrive()

    def producer():
        tma.append(("kv", 0))
        for t in range(n_iter):
            st = t % stages
            parity = (t // stages) & 1
            yield qd_empty[st], parity if bug == "parity" else parity ^ 1
            load("q", t)
            load("do", t)
            if dq_writer and t >= stages:
                yield from drain(t - stages)
        if dq_writer:
            for j in range(max(n_iter - stages, 0), n_iter):
                yield qd_empty[j % stages], (j // stages) & 1
                yield from drain(j)

    def consumer(wg):
        yield kv_bar, 0
        assert kv_landed[0]
        for t in range(n_iter):
            cur, ph = t % stages, (t // stages) & 1
            yield q_ready[cur], ph
            start_read("q", t, wg)                     # S = Q K^T
            yield do_ready[cur], ph
            start_read("do", t, wg)                    # dP = dO V^T
            yield None, None                           # others run while S / dP are in flight
            assert not ps_readers - {wg}, f"wg{wg} writes P/dS of tile {t} while {ps_readers} read them"
            ps_tile[wg] = t                            # this warpgroup's keys of P and dS
            yield from barrier(wg)                     # fence + thread barrier: every key's P/dS stored
            assert ps_tile == [t] * n_wg, f"wg{wg} reads P/dS {ps_tile} for tile {t}"
            ps_readers.add(wg)                         # dV, dK, dQ wgmmas
            yield None, None
            if dq_writer:                              # dQ_part retired: into the dq buffer
                yield dq_empty, (t & 1) ^ 1
                if bug != "late_dq_store":
                    dq_buf[wg] = t
            ps_readers.discard(wg)                     # warpgroup_mma_wait(0)
            end_read("q", t, wg)
            end_read("do", t, wg)
            if bug == "no_barrier":
                if wg == 0:
                    qd_empty[cur].arrive()
            else:
                yield from barrier(wg)                 # _release: every warp's wgmmas retired ...
                if wg == 0:
                    qd_empty[cur].arrive()             # ... then one arrive
                if dq_writer and bug == "late_dq_store":
                    yield None, None
                    dq_buf[wg] = t
        yield from barrier(wg)                         # epilogue

    def land(item):
        kind, st = item
        if kind == "kv":
            kv_landed[0] = True
            kv_bar.arrive()
        else:
            ring.land(kind, st)
            (q_ready if kind == "q" else do_ready)[st].arrive()

    run({"producer": producer(), **{f"wg{w}": consumer(w) for w in range(n_wg)}}, tma, land, rnd)
    for kind in ("q", "do"):
        assert ring.all_read(kind, n_iter), kind
    assert dq_drained == (list(range(n_iter)) if dq_writer else []), dq_drained


@pytest.mark.parametrize("dq_writer", [False, True])
@pytest.mark.parametrize("stages", [1, 2, 3])
def test_emulated_ws_protocol(stages, dq_writer):
    for n_iter in (0, 1, 2, 3, 5, 8):
        for seed in range(40):
            emulate_ws_protocol(n_iter, stages, seed, dq_writer=dq_writer)


def test_emulated_ws_protocol_detects_bugs():
    """The protocol check can fail: a release without the partition's thread barrier lets the producer
    (or the faster warpgroup's next P/dS) overwrite what the slower one still reads; the producer waiting
    on the wrong parity deadlocks."""
    with pytest.raises(AssertionError, match="overwritten|writes P/dS|reads P/dS"):
        for seed in range(300):
            emulate_ws_protocol(6, 2, seed, bug="no_barrier")
    with pytest.raises(AssertionError, match="deadlock"):
        emulate_ws_protocol(3, 2, 0, bug="parity")
    with pytest.raises(AssertionError, match="the writer reads dQ|overwritten"):
        for seed in range(300):
            emulate_ws_protocol(6, 2, seed, bug="late_dq_store", dq_writer=True)


# ---- compile for sm_90 on CPU ------------------------------------------------------------------------
def _compile_report(tmp_path_factory, *flags):
    """benchmarks/gluon_fa/compile_bwd_sm90.py in a fresh interpreter without TRITON_INTERPRET (under it
    gluon.jit functions cannot be compiled): registers and SASS spill counts per compiled kernel."""
    from conftest import run_sm90_compile
    out_dir = tmp_path_factory.mktemp("bwd_sm90")
    run_sm90_compile([os.path.join(ROOT, "benchmarks", "gluon_fa", "compile_bwd_sm90.py"), str(out_dir), *flags])
    with open(out_dir / "summary.json") as f:
        return {r["variant"]: r for r in json.load(f)["results"]}


@pytest.fixture(scope="module")
def bwd_compile_report(tmp_path_factory):
    """Every schedule of VARIANTS at the default ring depth."""
    return _compile_report(tmp_path_factory)


@needs_gluon
def test_bwd_compiles_for_sm90_without_spills(bwd_compile_report):
    # every schedule of VARIANTS x d 128/64 x bf16/fp16 x causal or not
    assert len(bwd_compile_report) == 8 * len(GB.VARIANTS)
    assert {r["schedule"] for r in bwd_compile_report.values()} == set(GB.VARIANTS)
    for tag, r in bwd_compile_report.items():
        assert r["compiled"], (tag, r.get("error"))
        assert r["shared_bytes"] <= 232448, tag             # the sm_90 opt-in limit (227 KB)
        assert r["sass_spills"] == 0, f"{tag}: {r['sass_spills']} STL/LDL ({r['main_loop_spills']} in the main loop)"
        assert r.get("stack") == 0, (tag, r.get("stack"))
        assert r["atomics"] > 0, tag                        # dQ leaves by float32 reductions
        if GB.VARIANTS[r["schedule"]]["WARP_SPEC"]:
            # the GEMM warps get 240 registers, the producer PRODUCER_REGS (setmaxnreg in the PTX)
            levels = {int(n) for _, n in r["setmaxnreg"]}
            assert {240, GB.PRODUCER_REGS} <= levels, (tag, r["setmaxnreg"])
        else:
            assert not r["setmaxnreg"], tag


@needs_gluon
def test_ws_schedules_compile_with_three_stages(tmp_path_factory):
    """The warp-specialized schedules also compile with a 3-stage Q/dO ring."""
    names = [n for n, cfg in GB.VARIANTS.items() if cfg["WARP_SPEC"]]
    report = _compile_report(tmp_path_factory, "--stages=3", "--variants=" + ",".join(names))
    assert len(report) == 8 * len(names)
    for tag, r in report.items():
        assert r["compiled"], (tag, r.get("error"))
        assert r["shared_bytes"] <= 232448, tag
        assert r["sass_spills"] == 0 and r.get("stack") == 0, (tag, r["sass_spills"], r.get("stack"))


@needs_gluon
def test_default_variant_is_the_gpu_measured_schedule():
    """Only a schedule timed on the H200 may be the default: "inline" (the others are compiled only)."""
    assert GB.DEFAULT_VARIANT == "inline"
    assert GB.VARIANTS["inline"] == dict(WARP_SPEC=False, DQ_FIRST=False)


# ---- host side without a GPU -----------------------------------------------------------------------------
def test_unavailable_without_gluon(monkeypatch):
    mod = load_without_gluon(monkeypatch, GB, "flash_attention.gluon_bwd_kernel")
    assert "triton.experimental.gluon" in mod.UNAVAILABLE
    with pytest.raises(RuntimeError, match="not importable"):
        mod.launch_args(*(torch.empty(1, 1, 1, 64),) * 7, torch.empty(1), torch.empty(1), False, 0.1)


def test_impl_backward_follows_the_switch(monkeypatch):
    """impl_backward is the Triton backward until USE_GLUON_BWD_IN_IMPL is flipped (after a GPU check)."""
    from opsadv.backends.triton_common.flash_attention import attention
    calls = []
    monkeypatch.setattr(attention, "flash_bwd", lambda *a: calls.append("triton") or "triton")
    monkeypatch.setattr(GB, "attention_bwd", lambda *a: calls.append("gluon") or "gluon")
    args = (None, "dout", "q", "k", "v", "out", "lse", None, True, 0.1)
    monkeypatch.setattr(GB, "USE_GLUON_BWD_IN_IMPL", False)
    assert GB.impl_backward(*args) == "triton"
    monkeypatch.setattr(GB, "USE_GLUON_BWD_IN_IMPL", True)
    assert GB.impl_backward(*args) == "gluon"
    assert calls == ["triton", "gluon"]


# ---- on an H100/H200 ------------------------------------------------------------------------------------
GPU_CASES = ATTENTION_GPU_CASES


def _gpu_check(b, hq, hkv, sq, sk, d, causal, dtype, bshd=False, variant=None):
    from opsadv.backends.cuda.flash_attention import gluon as GA

    def make(h, s):
        if bshd:   # transformers' projections: (b, s, h, d) memory seen as (b, h, s, d)
            return torch.randn(b, s, h, d, device="cuda", dtype=dtype).transpose(1, 2)
        return torch.randn(b, h, s, d, device="cuda", dtype=dtype)

    q, k, v, do = make(hq, sq), make(hkv, sk), make(hkv, sk), make(hq, sq)
    scale = 0.8 / math.sqrt(d)
    out, lse = GA.attention_fwd(q, k, v, causal, scale)
    dq, dk, dv = GB.attention_bwd(do, q, k, v, out, lse, causal, scale, variant=variant or GB.DEFAULT_VARIANT)
    torch.cuda.synchronize()
    _, rl, rq, rk, rv = reference(q.cpu(), k.cpu(), v.cpu(), do.cpu(), causal, scale)
    for name, x in (("dq", dq), ("dk", dk), ("dv", dv)):
        assert not torch.isnan(x).any(), name
    assert (dq.cpu()[torch.isneginf(rl)] == 0).all()
    tol = 2e-2 if dtype == torch.bfloat16 else 4e-3
    for name, x, r in (("dq", dq, rq), ("dk", dk, rk), ("dv", dv, rv)):
        assert grad_err(x, r) < tol, (name, grad_err(x, r))


@requires_sm90
@pytest.mark.parametrize("b,hq,hkv,sq,sk,d,causal", GPU_CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_bwd_matches_float64(b, hq, hkv, sq, sk, d, causal, dtype, seed, monkeypatch):
    monkeypatch.setenv("OPSADV_POISON_OUTPUTS", "1")      # dq/dk/dv start as NaN: every element must be written
    _gpu_check(b, hq, hkv, sq, sk, d, causal, dtype)


@requires_sm90
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_bshd_inputs(causal, seed, monkeypatch):
    monkeypatch.setenv("OPSADV_POISON_OUTPUTS", "1")
    _gpu_check(2, 4, 2, 333, 333, 128, causal, torch.bfloat16, bshd=True)


@requires_sm90
@pytest.mark.parametrize("variant", sorted(GB.VARIANTS))
@pytest.mark.parametrize("b,hq,hkv,sq,sk,d,causal", [(2, 4, 2, 1000, 1000, 128, True), (1, 4, 4, 2000, 700, 64, True),
                                                     (1, 4, 1, 777, 129, 128, False)])
def test_gpu_every_variant(variant, b, hq, hkv, sq, sk, d, causal, seed, monkeypatch):
    monkeypatch.setenv("OPSADV_POISON_OUTPUTS", "1")
    _gpu_check(b, hq, hkv, sq, sk, d, causal, torch.bfloat16, variant=variant)
