"""DTensor sharding rules (opsadv.distributed): each op's forward and backward on DTensors over a 2-rank gloo mesh
equals the unsharded call on the full tensors (float64, reference backend, odd sizes), and bad placements raise
ShardingError.  Spawning costs seconds, so one spawn runs every case (the workers return their verdicts) and the
tests below read them."""
from __future__ import annotations

import socket
import traceback

import pytest
import torch

pytestmark = pytest.mark.xdist_group("distributed")

DT = torch.float64
TOL = 1e-9
HD = 8                 # attention head dim (the interpreter pass uses one the Triton kernels take)


def _split_fp8_out(mesh, world):
    import opsadv
    from opsadv.ops.scaled_gemm import quantize_fp8
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    a8, sa = quantize_fp8(torch.randn(5, 32), "tensor")
    b8, sb = quantize_fp8(torch.randn(32, 16 * world), "tensor")
    d = (lambda t, p: distribute_tensor(t, mesh, [p], src_data_rank=None))
    return opsadv.ops.scaled_gemm(d(a8, Replicate()), d(b8, Shard(1)), d(sa, Replicate()), d(sb, Replicate()),
                                  out_fp8=True)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- the cases: each builds full tensors, the DTensor call and the plain call -----------------------------------
def _close(name, got, want, out: dict, tol: float | None = None) -> None:
    from torch.distributed.tensor import DTensor
    g = got.full_tensor() if isinstance(got, DTensor) else got
    err = (g.double() - want.double()).abs().max().item() if want.numel() else 0.0
    if not (g.shape == want.shape and err <= (TOL if tol is None else tol)):
        out.setdefault("fail", []).append(f"{name}: shape {tuple(g.shape)} vs {tuple(want.shape)}, max err {err:.3g}")


def _check(op_name, fn, inputs: dict, placements: dict, mesh, out_placements=None, grad_of=None, tol=None):
    """fn(**inputs) on plain tensors vs on DTensors placed as `placements` (name -> list of placements); grads of
    every float input that requires grad, for a random output gradient."""
    from torch.distributed.tensor import DTensor, distribute_tensor
    res: dict = {}
    plain = {n: (t.detach().clone().requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor) else t)
             for n, t in inputs.items()}
    dist_in = {n: (distribute_tensor(t.detach(), mesh, placements[n]).requires_grad_(t.requires_grad)
                   if isinstance(t, torch.Tensor) else t) for n, t in inputs.items()}
    want = fn(**plain)
    got = fn(**dist_in)
    want = want if isinstance(want, tuple) else (want,)
    got = got if isinstance(got, tuple) else (got,)
    if out_placements is not None:
        seen = [tuple(g.placements) for g in got]
        if seen != [tuple(p) for p in out_placements]:
            res.setdefault("fail", []).append(f"output placements {seen}, expected {out_placements}")
    for i, (g, w) in enumerate(zip(got, want)):
        _close(f"out{i}", g, w, res, tol)
    grads = [torch.randn_like(w) for w in want] if grad_of is None else grad_of(want)
    leaves = [n for n, t in plain.items() if isinstance(t, torch.Tensor) and t.requires_grad]
    if leaves:
        torch.autograd.backward([w for w, gr in zip(want, grads) if gr is not None], [gr for gr in grads if gr is not None])
        full = [g.full_tensor() if isinstance(g, DTensor) else g for g in got]
        torch.autograd.backward([f for f, gr in zip(full, grads) if gr is not None], [gr for gr in grads if gr is not None])
        for n in leaves:
            _close(f"grad {n}", dist_in[n].grad, plain[n].grad, res, tol)
    return res.get("fail", [])


def _cases(mesh, world: int):
    """name -> a thunk returning a list of failures (empty: passed)."""
    import opsadv
    from opsadv.distributed import shard_gate_up
    from opsadv.ops.sparse_attention.layout import SparseLayout
    from torch.distributed.tensor import Partial, Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard
    ops = opsadv.ops
    Rp, S = [Replicate()], (lambda d: [Shard(d)])

    def rnd(*shape, grad=True):
        return torch.randn(*shape, dtype=DT, requires_grad=grad)

    h = 3 * world                                  # 3 heads per rank
    cases = {}

    def attn(split, hkv, mask=None):
        def run():
            q, k, v = rnd(2, h, 37, HD), rnd(2, hkv, 29, HD), rnd(2, hkv, 29, HD)
            ins, pl = dict(q=q, k=k, v=v), dict(q=S(split), k=S(split), v=S(split))
            if mask is not None:
                ins["attn_mask"], pl["attn_mask"] = mask(), Rp
            return _check("flash_attention", lambda **a: ops.flash_attention(**a, causal=True), ins, pl, mesh,
                          out_placements=[S(split)])
        return run

    cases["flash_attention heads"] = attn(1, h)
    cases["flash_attention heads gqa"] = attn(1, world)
    cases["flash_attention batch"] = attn(0, h)
    cases["flash_attention heads additive mask broadcast on heads"] = attn(
        1, h, mask=lambda: torch.randn(2, 1, 37, 29, dtype=DT))

    def sparse():
        q, k, v = rnd(1, h, 40, HD), rnd(1, h, 40, HD), rnd(1, h, 40, HD)
        bm = torch.rand(1, 1, 5, 5) > 0.4
        bm[..., torch.arange(5), torch.arange(5)] = True
        plain = SparseLayout(block_mask=bm, block_size=8, seq_q=40, seq_k=40, causal=True)
        from torch.distributed.tensor import distribute_tensor
        dlay = SparseLayout(block_mask=distribute_tensor(bm, mesh, Rp), block_size=8, seq_q=40, seq_k=40, causal=True)
        return _check("sparse_attention",
                      lambda q, k, v: ops.sparse_attention(q, k, v, dlay if hasattr(q, "placements") else plain),
                      dict(q=q, k=k, v=v), dict(q=S(1), k=S(1), v=S(1)), mesh, out_placements=[S(1)])
    cases["sparse_attention heads, layout replicated"] = sparse

    def varlen():
        cu = torch.tensor([0, 11, 30, 37], dtype=torch.int32)
        cuk = torch.tensor([0, 13, 30, 41], dtype=torch.int32)
        q, k, v = rnd(37, h, 8, grad=False), rnd(41, world, 8, grad=False), rnd(41, world, 8, grad=False)
        return _check("varlen_attention", lambda q, k, v, cu, cuk: ops.varlen_attention(q, k, v, cu, cuk, causal=True),
                      dict(q=q, k=k, v=v, cu=cu, cuk=cuk), dict(q=S(1), k=S(1), v=S(1), cu=Rp, cuk=Rp), mesh,
                      out_placements=[S(1)])
    cases["varlen_attention heads gqa"] = varlen

    def gemm(kind, act="none", bias=True, residual=False):
        def run():
            a, b = rnd(3, 37, 12), rnd(12, 6 * world + 4)
            ins = dict(a=a, b=b)
            col = {"column": S(1), "row": S(0), "batch": Rp}[kind]
            pl = dict(a={"column": Rp, "row": S(2), "batch": S(1)}[kind], b=col)
            if bias:
                ins["bias"], pl["bias"] = rnd(b.shape[1]), (S(0) if kind == "column" else Rp)
            if residual:
                ins["residual"] = rnd(3, 37, b.shape[1])
                pl["residual"] = {"column": S(2), "row": Rp, "batch": S(1)}[kind]
            outp = {"column": S(2), "row": [Partial()], "batch": S(1)}[kind]
            return _check("gemm", lambda **x: ops.gemm(**x, activation=act, alpha=0.5), ins, pl, mesh,
                          out_placements=None if act != "none" else [outp])
        return run

    cases["gemm column-parallel bias residual"] = gemm("column", residual=True)
    cases["gemm column-parallel gelu"] = gemm("column", act="gelu")
    cases["gemm row-parallel bias residual (Partial)"] = gemm("row", residual=True)
    cases["gemm row-parallel gelu training (activation after the reduction)"] = gemm("row", act="gelu")
    cases["gemm batch-parallel bias"] = gemm("batch")

    def scaled_gemm(kind):
        """FP8 operands with row / column / block scales, placed without communication (gloo carries no fp8)."""
        def run():
            from opsadv.ops.scaled_gemm import quantize_fp8
            from torch.distributed.tensor import DTensor, distribute_tensor
            a8, sa = quantize_fp8(torch.randn(37, 256), "block1x128" if kind == "row" else "row")
            b8, sb = quantize_fp8(torch.randn(256, 16 * world), "block128x128" if kind == "row" else "col")
            bias, res = torch.randn(16 * world), torch.randn(37, 16 * world)
            pl = {"column": dict(a=Rp, sa=Rp, b=S(1), sb=S(1), bias=S(0), res=S(1)),
                  "row": dict(a=S(1), sa=S(1), b=S(0), sb=S(0), bias=Rp, res=Rp),
                  "batch": dict(a=S(0), sa=S(0), b=Rp, sb=Rp, bias=Rp, res=S(0))}[kind]
            full = dict(a=a8, sa=sa, b=b8, sb=sb, bias=bias, res=res)
            placed = {n: distribute_tensor(t, mesh, pl[n], src_data_rank=None) for n, t in full.items()}

            def call(x):
                return ops.scaled_gemm(x["a"], x["b"], x["sa"], x["sb"], bias=x["bias"], residual=x["res"],
                                       out_dtype=torch.float32)
            want, got = call(full), call(placed)
            outp = {"column": S(1), "row": [Partial()], "batch": S(0)}[kind]
            fails = [] if list(got.placements) == outp else [f"output placements {got.placements}, expected {outp}"]
            err = (got.full_tensor() - want).abs().max().item()
            return fails + ([] if err <= 1e-4 * want.abs().max().item() else [f"max err {err:.3g}"])
        return run

    def fp8_attention(split):
        """FP8 q / k / v with (b, h) descales, placed without communication (gloo carries no fp8)."""
        def run():
            from opsadv.ops.fp8_attention import quantize_qkv
            from torch.distributed.tensor import distribute_tensor
            q, k, v = (torch.randn(2, h, 37, 16) for _ in range(3))
            full = dict(zip(("q", "k", "v", "qd", "kd", "vd"), quantize_qkv(q, k, v)))
            pl = {n: S(split) for n in full}
            placed = {n: distribute_tensor(t, mesh, pl[n], src_data_rank=None) for n, t in full.items()}

            def call(x):
                return ops.fp8_attention(x["q"], x["k"], x["v"], x["qd"], x["kd"], x["vd"], causal=True,
                                         out_dtype=torch.float32)
            want, got = call(full), call(placed)
            fails = [] if list(got.placements) == S(split) else [f"output placements {got.placements}"]
            err = (got.full_tensor() - want).abs().max().item()
            return fails + ([] if err <= 1e-5 else [f"max err {err:.3g}"])
        return run

    def paged(append):
        """paged_attention split over heads: caches on their head dim (appended in place on each rank's shard)."""
        def run():
            from opsadv.ops.paged_attention.cases import paged_inputs
            from torch.distributed.tensor import distribute_tensor
            g = torch.Generator().manual_seed(7)
            (q, kc, vc, bt, lens), kw = paged_inputs(DT, "cpu", g, hq=h, hkv=world, d=8, page=8, lens=[13, 30, 1],
                                                     append=append)
            kc, vc = kc.nan_to_num(), vc.nan_to_num()        # (slots past each length hold NaN; DTensor compares)
            full = dict(q=q, k_cache=kc, v_cache=vc, block_table=bt, seqlens_k=lens, **kw)
            pl = {n: (S(2) if n in ("q", "k_cache", "v_cache", "k_new", "v_new") else Rp) for n in full}
            placed = {n: distribute_tensor(t.clone(), mesh, pl[n]) for n, t in full.items()}
            ref = {n: t.clone() for n, t in full.items()}
            want = ops.paged_attention(**ref, return_lse=True)
            got = ops.paged_attention(**placed, return_lse=True)
            fails = [] if list(got[0].placements) == S(2) else [f"output placements {got[0].placements}"]
            for name, g_, w in (("out", got[0], want[0]), ("lse", got[1], want[1])):
                err = (g_.full_tensor() - w).abs().max().item()
                if not err <= TOL:
                    fails.append(f"{name} max err {err:.3g}")
            if append and not torch.equal(placed["k_cache"].full_tensor(), ref["k_cache"]):
                fails.append("the appended k_cache differs")
            return fails
        return run

    cases["paged_attention heads"] = paged(False)
    cases["paged_attention heads with append (cache written in place)"] = paged(True)
    cases["fp8_attention heads"] = fp8_attention(1)
    cases["fp8_attention batch"] = fp8_attention(0)
    cases["scaled_gemm column-parallel col scales"] = scaled_gemm("column")
    cases["scaled_gemm row-parallel block scales (Partial)"] = scaled_gemm("row")
    cases["scaled_gemm batch-parallel row scales"] = scaled_gemm("batch")

    def swiglu_gemm(kind):
        def run():
            x, w, bias = rnd(37, 12), rnd(12, 2 * (3 * world)), rnd(2 * 3 * world)
            if kind == "column":
                pl = dict(x=Rp, w_gate_up=[_StridedShard(1, split_factor=2)], bias=[_StridedShard(0, split_factor=2)])
            else:
                pl = dict(x=S(0), w_gate_up=Rp, bias=Rp)
            fails = _check("swiglu_gemm", lambda **a: ops.swiglu_gemm(**a), dict(x=x, w_gate_up=w, bias=bias), pl, mesh,
                           out_placements=[S(1) if kind == "column" else S(0)])
            with torch.no_grad():                # the no-grad call runs the fused op itself
                fails += _check("swiglu_gemm", lambda **a: ops.swiglu_gemm(**a),
                                dict(x=x.detach(), w_gate_up=w.detach(), bias=bias.detach()), pl, mesh)
            if kind == "column":
                from torch.distributed.tensor import distribute_tensor
                d = shard_gate_up(w.detach(), mesh)
                if not torch.equal(d.full_tensor(), w.detach()) or d.placements[0] != _StridedShard(1, split_factor=2):
                    fails.append("shard_gate_up: wrong global value or placement")
                n = w.shape[1] // 2
                loc = d.to_local()
                r = torch.distributed.get_rank()
                if not torch.equal(loc, torch.cat([w[:, r * n // world:(r + 1) * n // world],
                                                   w[:, n + r * n // world:n + (r + 1) * n // world]], 1).detach()):
                    fails.append("shard_gate_up: a rank's shard is not [W_g,r | W_u,r]")
                del distribute_tensor
            return fails
        return run

    cases["swiglu_gemm column-parallel (gate/up strided)"] = swiglu_gemm("column")
    cases["swiglu_gemm token-parallel"] = swiglu_gemm("batch")

    def swiglu(pl, outp):
        def run():
            return _check("swiglu", lambda gate_up: ops.swiglu(gate_up), dict(gate_up=rnd(5, 37, 4 * world)),
                          dict(gate_up=pl), mesh, out_placements=[outp])
        return run
    cases["swiglu tokens"] = swiglu(S(1), S(1))
    cases["swiglu last dim as [g_r | u_r]"] = swiglu([_StridedShard(2, split_factor=2)], S(2))

    def norm(which, residual):
        def run():
            x = rnd(37, 5, 24)
            ins, pl = dict(x=x, weight=rnd(24)), dict(x=S(0), weight=Rp)
            if which == "layer_norm":
                ins["bias"], pl["bias"] = rnd(24), Rp
            if residual:
                ins["residual"], pl["residual"] = rnd(37, 5, 24), S(0)
            fn = getattr(ops, which)
            return _check(which, lambda **a: fn(**a), ins, pl, mesh,
                          out_placements=[S(0), S(0)] if residual else [S(0)])
        return run
    for which in ("layer_norm", "rms_norm"):
        cases[f"{which} sequence-parallel"] = norm(which, False)
        cases[f"{which} sequence-parallel residual"] = norm(which, True)

    def rotary(split, qknr=False):
        def run():
            q, k = rnd(2, h, 37, 16), rnd(2, world, 37, 16)
            cos, sin = torch.randn(37, 16, dtype=DT), torch.randn(37, 16, dtype=DT)
            ins = dict(q=q, k=k, cos=cos, sin=sin)
            pl = dict(q=S(split), k=S(split), cos=Rp, sin=Rp)
            if qknr:
                ins.update(q_weight=rnd(16), k_weight=rnd(16))
                pl.update(q_weight=Rp, k_weight=Rp)
                return _check("qk_norm_rotary", lambda **a: ops.qk_norm_rotary(**a), ins, pl, mesh,
                              out_placements=[S(split), S(split)])
            return _check("rotary_embedding", lambda **a: ops.rotary_embedding(**a), ins, pl, mesh,
                          out_placements=[S(split), S(split)])
        return run
    cases["rotary_embedding heads"] = rotary(1)
    cases["rotary_embedding batch"] = rotary(0)
    cases["qk_norm_rotary heads"] = rotary(1, True)
    cases["qk_norm_rotary batch"] = rotary(0, True)

    def lce(reduction):
        def run():
            hid, w, bias = rnd(37, 12), rnd(23, 12), rnd(23)
            labels = torch.randint(0, 23, (37,))
            labels[::5] = -100
            outp = [Partial()] if reduction == "sum" else S(0)
            return _check("linear_cross_entropy",
                          lambda **a: ops.linear_cross_entropy(**a, reduction=reduction),
                          dict(hidden=hid, weight=w, labels=labels, bias=bias),
                          dict(hidden=S(0), weight=Rp, labels=S(0), bias=Rp), mesh, out_placements=[outp])
        return run
    cases["linear_cross_entropy tokens sum (Partial)"] = lce("sum")
    cases["linear_cross_entropy tokens none"] = lce("none")

    def lce_stats():
        """The per-shard statistics op itself with its tokens split (a slice of the vocabulary from row 5)."""
        def run():
            hid, w, bias = rnd(37, 12), rnd(23, 12), rnd(23)
            labels = torch.randint(0, 40, (37,))
            labels[::5] = -100
            return _check("linear_cross_entropy_stats",
                          lambda **a: ops.linear_cross_entropy_stats(**a, vocab_start=5, softcap=3.0),
                          dict(hidden=hid, weight=w, labels=labels, bias=bias),
                          dict(hidden=S(0), weight=Rp, labels=S(0), bias=Rp), mesh, out_placements=[S(1)])
        return run
    cases["linear_cross_entropy_stats tokens"] = lce_stats()

    def fp8_train(split):
        """fp8_attention_from_bf16 (FP8 forward, differentiable) with heads / batch split: out and q / k / v's
        gradients through fp8_attention and fp8_attention_backward's rules (no communication: gloo carries no fp8)."""
        def run():
            from opsadv.ops.fp8_attention import fp8_attention_from_bf16
            q, k, v = (torch.randn(2, h, 37, 16, requires_grad=True) for _ in range(3))
            return _check("fp8_attention_from_bf16", lambda **a: fp8_attention_from_bf16(**a, causal=True),
                          dict(q=q, k=k, v=v), dict(q=S(split), k=S(split), v=S(split)), mesh,
                          out_placements=[S(split)], tol=1e-5)
        return run
    cases["fp8_attention_from_bf16 heads training"] = fp8_train(1)

    def scaled_swiglu(kind):
        """FP8 x (row scales) and [W_g | W_u] (column scales), placed without communication."""
        def run():
            from opsadv.ops.scaled_gemm import quantize_fp8
            from torch.distributed.tensor import distribute_tensor
            x8, sx = quantize_fp8(torch.randn(37, 64), "row")
            w8, sw = quantize_fp8(torch.randn(64, 2 * 8 * world), "col")
            bias = torch.randn(2 * 8 * world)
            strided = [_StridedShard(1, split_factor=2)]
            pl = {"column": dict(x=Rp, sx=Rp, w=strided, sw=strided, bias=[_StridedShard(0, split_factor=2)]),
                  "tokens": dict(x=S(0), sx=S(0), w=Rp, sw=Rp, bias=Rp)}[kind]
            full = dict(x=x8, sx=sx, w=w8, sw=sw, bias=bias)
            placed = {n: distribute_tensor(t, mesh, pl[n], src_data_rank=None) for n, t in full.items()}

            def call(a):
                return ops.scaled_swiglu_gemm(a["x"], a["w"], a["sx"], a["sw"], bias=a["bias"], out_dtype=torch.float32)
            want, got = call(full), call(placed)
            outp = S(1) if kind == "column" else S(0)
            fails = [] if list(got.placements) == outp else [f"output placements {got.placements}, expected {outp}"]
            err = (got.full_tensor() - want).abs().max().item()
            return fails + ([] if err <= 1e-5 * want.abs().max().item() else [f"max err {err:.3g}"])
        return run
    cases["scaled_swiglu_gemm column-parallel (gate/up strided, column scales)"] = scaled_swiglu("column")
    cases["scaled_swiglu_gemm token-parallel row scales"] = scaled_swiglu("tokens")

    def vocab_parallel(vocab, bias=True, return_lse=False, **kw):
        """The weight split over its vocabulary (uneven: 23 = 12 + 11 rows), hidden and labels replicated: the loss
        and every gradient of the unsplit call, without gathering the weight (grad weight stays Shard(0))."""
        def run():
            hid, w = rnd(2, 19, 12), rnd(vocab, 12)
            labels = torch.randint(0, vocab, (2, 19))
            labels[:, ::5] = -100
            ins, pl = dict(hidden=hid, weight=w, labels=labels), dict(hidden=Rp, weight=S(0), labels=Rp)
            if bias:
                ins["bias"], pl["bias"] = rnd(vocab), S(0)
            outp = [Rp, Rp] if return_lse else [Rp]
            fails = _check("linear_cross_entropy",
                           lambda **a: ops.linear_cross_entropy(**a, return_lse=return_lse, **kw), ins, pl, mesh,
                           out_placements=outp, grad_of=(lambda o: [torch.randn_like(o[0]), None]) if return_lse
                           else None)
            from torch.distributed.tensor import distribute_tensor
            wd = distribute_tensor(w.detach(), mesh, S(0)).requires_grad_()
            loss = ops.linear_cross_entropy(distribute_tensor(hid.detach(), mesh, Rp), wd,
                                            distribute_tensor(labels, mesh, Rp), **kw)
            loss = loss[0] if return_lse else loss
            loss.sum().backward()
            if list(wd.grad.placements) != S(0):
                fails.append(f"grad weight placements {wd.grad.placements}, expected [Shard(0)]")
            return fails
        return run
    cases["linear_cross_entropy vocab-parallel mean bias"] = vocab_parallel(23)
    cases["linear_cross_entropy vocab-parallel sum softcap"] = vocab_parallel(23, reduction="sum", softcap=3.0)
    cases["linear_cross_entropy vocab-parallel none smoothing z_loss lse"] = vocab_parallel(
        23, bias=False, return_lse=True, reduction="none", label_smoothing=0.1, z_loss=1e-2, softcap=5.0)
    cases["linear_cross_entropy vocab-parallel one row (an empty shard)"] = vocab_parallel(1, z_loss=0.1)

    def merge(dim):
        """attention_merge_ on accumulators split over `dim` (heads, rows): each rank merges its rows in place, the
        DTensors given are the ones updated."""
        def run():
            from opsadv.ops.attention_merge.cases import merge_inputs
            from torch.distributed.tensor import distribute_tensor
            g = torch.Generator().manual_seed(11)
            names = ("acc_out", "acc_lse", "out", "lse")
            full = dict(zip(names, merge_inputs(DT, "cpu", g, 2, h, 4 * world + 1, 8, empty_rows=True)))
            placed = {n: distribute_tensor(t.clone(), mesh, S(dim)) for n, t in full.items()}
            ref = {n: t.clone() for n, t in full.items()}
            ops.attention_merge_(**ref)
            got = ops.attention_merge_(**placed)
            fails = [] if got[0] is placed["acc_out"] and got[1] is placed["acc_lse"] else ["not the tensors given"]
            for n in ("acc_out", "acc_lse"):
                a, b = placed[n].full_tensor(), ref[n]
                fin = b.isfinite()
                if list(placed[n].placements) != S(dim) or not torch.equal(a.isfinite(), fin) \
                        or (a[fin] - b[fin]).abs().max().item() > TOL:
                    fails.append(f"{n} differs ({placed[n].placements})")
            return fails
        return run
    def cast(dim):
        """cast_to_fp8 of x split over `dim`: the fp8 copy split with it, the transpose on the other dim, the amax a
        Partial max that reduces to the global one."""
        def run():
            from torch.distributed.tensor import distribute_tensor
            x = torch.randn(4 * world + 3, 2 * world + 1) * torch.arange(1, 2 * world + 2)
            scale = torch.tensor(0.01)
            want = ops.cast_to_fp8(x, scale, dtype=torch.float8_e5m2, transpose=True)
            got = ops.cast_to_fp8(distribute_tensor(x, mesh, S(dim)), distribute_tensor(scale, mesh, Rp),
                                  dtype=torch.float8_e5m2, transpose=True)
            fails = [] if (list(got[0].placements), list(got[1].placements)) == (S(dim), S(1 - dim)) else \
                [f"placements {got[0].placements}, {got[1].placements}"]
            rank = torch.distributed.get_rank()          # (gloo gathers no fp8: each rank checks its own shard)
            for name, g_, w, d in (("x_fp8", got[0], want[0], dim), ("x_fp8_t", got[1], want[1], 1 - dim)):
                if not torch.equal(g_.to_local().view(torch.uint8), w.chunk(world, d)[rank].view(torch.uint8)):
                    fails.append(f"{name}: rank {rank}'s shard differs")
            if not torch.equal(got[2].full_tensor(), want[2]):
                fails.append(f"amax {got[2].full_tensor()} vs {want[2]}")
            return fails
        return run
    def cast_delayed():
        """cast_to_fp8_delayed of a replicated x and history: every rank's result and history as the local call's."""
        def run():
            from torch.distributed.tensor import distribute_tensor
            from opsadv.ops.scaled_gemm import new_amax_history
            torch.manual_seed(0)                          # (the same x on every rank)
            x = torch.randn(3 * world + 1, 5) * 7
            h_local, h_dt = new_amax_history(2), distribute_tensor(new_amax_history(2), mesh, Rp)
            fails = []
            for _ in range(3):
                want = ops.cast_to_fp8_delayed(x, h_local, transpose=True)
                got = ops.cast_to_fp8_delayed(distribute_tensor(x, mesh, Rp), h_dt, transpose=True)
                if not all(torch.equal(g_.to_local().view(torch.uint8), w.view(torch.uint8))
                           for g_, w in zip(got[:2], want[:2])) or not torch.equal(got[2].to_local(), want[2]):
                    fails.append("outputs differ")
                if not torch.equal(h_dt.to_local(), h_local):
                    fails.append(f"history {h_dt.to_local().tolist()} vs {h_local.tolist()}")
            return fails
        return run
    cases["cast_to_fp8_delayed replicated"] = cast_delayed()
    cases["cast_to_fp8 rows"] = cast(0)
    cases["cast_to_fp8 columns"] = cast(1)
    cases["attention_merge_ heads (accumulators written in place)"] = merge(1)
    cases["attention_merge_ rows"] = merge(2)
    cases.update(_refusals(mesh, world))
    return cases


def _refusals(mesh, world: int):
    """name -> a thunk returning failures: the call must raise ShardingError naming the op and the argument."""
    import opsadv
    from opsadv.errors import ShardingError
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    ops = opsadv.ops

    def d(t, *p):
        return distribute_tensor(t, mesh, list(p))

    def r(*s):
        return torch.randn(*s, dtype=DT)

    h = 3 * world
    wants = {
        "refuse flash_attention head_dim": (lambda: ops.flash_attention(d(r(2, h, 9, 8), Shard(3)), d(r(2, h, 9, 8), Shard(3)),
                                                                         d(r(2, h, 9, 8), Shard(3))),
                                            "flash_attention: argument 'q'", "Shard(3)"),
        "refuse flash_attention kv heads not divisible": (
            lambda: ops.flash_attention(d(r(2, h, 9, 8), Shard(1)), d(r(2, 1, 9, 8), Shard(1)),
                                        d(r(2, 1, 9, 8), Shard(1))), "argument 'k'", "whole GQA groups"),
        "refuse flash_attention mask sharded on heads": (
            lambda: ops.flash_attention(*(d(r(2, h, 9, 8), Shard(1)) for _ in range(3)),
                                        attn_mask=d(r(2, h, 9, 9), Shard(2))), "argument 'attn_mask'", "Shard(1)"),
        "refuse gemm row-parallel no-grad activation": (
            lambda: ops.gemm(d(r(5, 8), Shard(1)), d(r(8, 4), Shard(0)), activation="gelu"),
            "gemm: argument 'activation'", "follow the all-reduce"),
        "refuse scaled_gemm split fp8 output": (
            lambda: _split_fp8_out(mesh, world), "scaled_gemm: argument 'out_fp8'", "per-tensor scale"),
        "refuse swiglu_gemm plain Shard(1)": (
            lambda: ops.swiglu_gemm(d(r(5, 8), Replicate()), d(r(8, 4 * world), Shard(1))),
            "swiglu_gemm: argument 'w_gate_up'", "_StridedShard(1, split_factor=2)"),
        "refuse swiglu last dim plain Shard": (lambda: ops.swiglu(d(r(5, 4 * world), Shard(1))),
                                               "swiglu: argument 'gate_up'", "gate features"),
        "refuse layer_norm hidden dim": (lambda: ops.layer_norm(d(r(5, 8), Shard(1)), d(r(8), Replicate())),
                                         "layer_norm: argument 'x'", "hidden (last) dim"),
        "refuse rms_norm hidden dim": (lambda: ops.rms_norm(d(r(5, 8), Shard(1)), d(r(8), Replicate())),
                                       "rms_norm: argument 'x'", "Shard(1)"),
        "refuse rotary cos sharded": (
            lambda: ops.rotary_embedding(d(r(2, h, 8, 8), Shard(1)), d(r(2, h, 8, 8), Shard(1)), d(r(8, 8), Shard(0)),
                                         d(r(8, 8), Replicate())), "rotary_embedding: argument 'cos'", "Replicate()"),
        "refuse linear_cross_entropy mean over sharded tokens": (
            lambda: ops.linear_cross_entropy(d(r(6, 4), Shard(0)), d(r(7, 4), Replicate()),
                                             d(torch.randint(0, 7, (6,)), Shard(0))),
            "linear_cross_entropy: argument 'reduction'", "reduction='sum'"),
        "refuse linear_cross_entropy tokens and vocabulary on one mesh dim": (
            lambda: ops.linear_cross_entropy(d(r(6, 4), Shard(0)), d(r(8, 4), Shard(0)),
                                             d(torch.randint(0, 7, (6,)), Shard(0)), reduction="sum"),
            "linear_cross_entropy: argument 'hidden'", "Replicate() on the vocabulary's mesh dim", "Shard(0)"),
        "refuse attention_merge_ accumulator to copy": (
            lambda: ops.attention_merge_(d(r(2, h, 5, 8), Shard(1)), d(r(2, h, 5), Replicate()), d(r(2, h, 5, 8), Shard(1)),
                                         d(r(2, h, 5), Shard(1))), "attention_merge_: argument 'acc_lse'", "written in place"),
        "refuse linear_cross_entropy_stats vocabulary split": (
            lambda: ops.linear_cross_entropy_stats(d(r(6, 4), Replicate()), d(r(8, 4), Shard(0)),
                                                   d(torch.randint(0, 7, (6,)), Replicate())),
            "linear_cross_entropy_stats: argument 'weight'", "vocab_start", "Shard(0)"),
        "refuse cast_to_fp8_delayed sharded x": (
            lambda: ops.cast_to_fp8_delayed(d(r(4 * world, 6), Shard(0)), d(torch.zeros(7), Replicate())),
            "cast_to_fp8_delayed: argument 'x'", "Replicate()", "Shard(0)"),
        "refuse linear_cross_entropy hidden-split weight": (
            lambda: ops.linear_cross_entropy(d(r(6, 4), Replicate()), d(r(8, 4), Shard(1)),
                                             d(torch.randint(0, 7, (6,)), Replicate())),
            "linear_cross_entropy: argument 'weight'", "partial sums", "Shard(1)"),
    }

    def thunk(call, *needles, error=ShardingError):
        def run():
            try:
                call()
            except error as e:
                return [f"message lacks {n!r}: {e}" for n in needles if n not in str(e)]
            return [f"no {error.__name__} raised"]
        return run
    out = {name: thunk(call, *needles) for name, (call, *needles) in wants.items()}
    from opsadv.errors import InvalidArgumentError
    out["refuse linear_cross_entropy vocab-parallel plain labels"] = thunk(
        lambda: ops.linear_cross_entropy(d(r(6, 4), Replicate()), d(r(9, 4), Shard(0)), torch.randint(0, 9, (6,))),
        "linear_cross_entropy: argument 'labels'", "a DTensor on the weight's device mesh", "plain Tensor",
        error=InvalidArgumentError)
    return out


def _explain_case(mesh):
    import opsadv
    from torch.distributed.tensor import Shard, distribute_tensor
    q = distribute_tensor(torch.randn(2, 6, 9, 8, dtype=DT), mesh, [Shard(1)])
    e = opsadv.explain("flash_attention", q, q, q, causal=True)
    text = str(e)
    fails = [f"explain lacks {n!r}:\n{text}" for n in ("q [Shard(1)]", "out [Shard(1)]") if n not in text]
    if e.spec.shapes[0] != (2, 3, 9, 8):
        fails.append(f"explain's spec is not the local call's: {e.spec.shapes}")
    return fails


def _explain_vocab_parallel_case(mesh, chosen="reference.linear_cross_entropy_stats"):
    import opsadv
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    h = distribute_tensor(torch.randn(2, 9, 8, dtype=DT), mesh, [Replicate()])
    w = distribute_tensor(torch.randn(23, 8, dtype=DT), mesh, [Shard(0)])
    labels = distribute_tensor(torch.randint(0, 23, (2, 9)), mesh, [Replicate()])
    e = opsadv.explain("linear_cross_entropy", h, w, labels, reduction="sum")
    text = str(e)
    fails = [f"explain lacks {n!r}:\n{text}" for n in
             ("weight [Shard(0)]", "hidden [Replicate()]", "loss [Replicate()]", "vocab-parallel over mesh dim 0",
              "grad hidden [Partial()]", "grad weight [Shard(0)]", "each rank runs linear_cross_entropy_stats")
             if n not in text]
    rows = 12 if torch.distributed.get_rank() == 0 else 11
    if e.op != "linear_cross_entropy_stats" or e.chosen != chosen or e.spec.shapes[1] != (rows, 8):
        fails.append(f"explain: op {e.op}, chosen {e.chosen}, local weight {e.spec.shapes[1]} (expected "
                     f"linear_cross_entropy_stats, {chosen}, ({rows}, 8))")
    return fails


def _vocab_parallel_interpreted(mesh, n, vocab, bias, reduction, **kw):
    """The vocab-parallel loss on the cuda backend's Triton kernels (interpreter, float32; uneven shards of a
    vocabulary that is no multiple of the kernel's block) against the unsharded loss in float64 (F.cross_entropy of
    the whole logits, autograd): loss and the gradients of hidden, the weight shard and the bias shard."""
    import opsadv
    from opsadv.ops.linear_cross_entropy.reference import lce_plain
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    Rp, S0 = [Replicate()], [Shard(0)]
    hid, w = torch.randn(n, 16, dtype=torch.float64), torch.randn(vocab, 16, dtype=torch.float64) / 4
    b = torch.randn(vocab, dtype=torch.float64) * 0.5 if bias else None
    labels = torch.randint(0, vocab, (n,))
    labels[1::3] = -100                        # (the one-token case keeps its token)
    leaves = [t.clone().requires_grad_() for t in (hid, w, b) if t is not None]
    want = lce_plain(leaves[0], leaves[1], labels, leaves[2] if bias else None, -100, kw.get("label_smoothing", 0.0),
                     reduction, kw.get("z_loss", 0.0), kw.get("softcap"))
    g = torch.randn(want.shape, dtype=torch.float64)
    want_grads = torch.autograd.grad(want, leaves, g)
    dleaves = [distribute_tensor(t.detach().float(), mesh, Rp if i == 0 else S0).requires_grad_()
               for i, t in enumerate(leaves)]
    with opsadv.trace() as t:
        got = opsadv.ops.linear_cross_entropy(dleaves[0], dleaves[1], distribute_tensor(labels, mesh, Rp),
                                              bias=dleaves[2] if bias else None, reduction=reduction, **kw)
        got.backward(distribute_tensor(g.float(), mesh, Rp))
    fails = []
    if t.counts.get("cuda.triton.linear_cross_entropy_stats") != 2:
        fails.append(f"the Triton stats kernels did not run forward and backward: {dict(t.counts)}")
    for name, a, ref in [("loss", got, want)] + list(zip(("grad hidden", "grad weight", "grad bias"),
                                                          (x.grad for x in dleaves), want_grads)):
        a = a.full_tensor().double()
        err = ((a - ref).norm() / ref.norm().clamp_min(1e-30)).item()
        if a.shape != ref.shape or not err < 1e-5:
            fails.append(f"{name}: shape {tuple(a.shape)} vs {tuple(ref.shape)}, rel err {err:.3g}")
    if [list(x.grad.placements) for x in dleaves[1:]] != [S0] * (len(dleaves) - 1):
        fails.append(f"grad weight / bias placements {[x.grad.placements for x in dleaves[1:]]}, expected Shard(0)")
    return fails


VP_INTERPRETED = {
    "vocab-parallel 127 tokens, 203 rows, bias, sum, smoothing, z_loss, softcap": (
        127, 203, True, "sum", dict(label_smoothing=0.1, z_loss=1e-3, softcap=5.0)),
    "vocab-parallel 3 tokens, 37 rows, none, z_loss": (3, 37, False, "none", dict(z_loss=1e-2)),
    "vocab-parallel 1 token, 37 rows, bias, mean, softcap": (1, 37, True, "mean", dict(softcap=3.0)),
}


def _worker(rank: int, world: int, port: int, results) -> None:
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        import opsadv
        from torch.distributed.device_mesh import init_device_mesh
        opsadv.use_backend("reference")
        mesh = init_device_mesh("cpu", (world,))
        cases = _cases(mesh, world)
        cases["explain shows the placements"] = lambda: _explain_case(mesh)
        cases["explain shows the vocab-parallel placements"] = lambda: _explain_vocab_parallel_case(mesh)
        out = {}
        for i, (name, run) in enumerate(cases.items()):
            torch.manual_seed(1000 + i)          # the same inputs on every rank, fresh per case
            try:
                out[name] = run()
            except Exception:                    # noqa: BLE001 - a case's crash is its failure
                out[name] = [traceback.format_exc(limit=6)]
        # the cuda backend's Triton kernels (the interpreter) on the local shards, float32
        global DT, TOL, HD
        DT, TOL, HD = torch.float32, 2e-3, 32
        cases = _cases(mesh, world)
        with opsadv.use_backend("cuda", strict=True, precision={"matmul": "tf32", "attention": "fp16"}):
            for i, name in enumerate(INTERPRETED):
                torch.manual_seed(2000 + i)
                try:
                    with opsadv.trace() as t:
                        fails = cases[name]()
                    if not any(k.startswith("cuda.") for k in t.counts):
                        fails = fails + [f"no cuda kernel ran: {dict(t.counts)}"]
                    out["interpreter: " + name] = fails
                except Exception:                # noqa: BLE001
                    out["interpreter: " + name] = [traceback.format_exc(limit=6)]
            vp = {n: (lambda a=a: _vocab_parallel_interpreted(mesh, *a[:4], **a[4]))
                  for n, a in VP_INTERPRETED.items()}
            vp["explain shows the vocab-parallel kernel"] = lambda: _explain_vocab_parallel_case(
                mesh, "cuda.triton.linear_cross_entropy_stats")
            for i, (name, run) in enumerate(vp.items()):
                torch.manual_seed(3000 + i)
                try:
                    out["interpreter: " + name] = run()
                except Exception:                # noqa: BLE001
                    out["interpreter: " + name] = [traceback.format_exc(limit=6)]
        results[rank] = out
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def verdicts():
    import torch.multiprocessing as mp
    world = 2
    with mp.Manager() as m:
        results = m.dict()
        mp.spawn(_worker, args=(world, _port(), results), nprocs=world)
        return {rank: dict(v) for rank, v in results.items()}


INTERPRETED = ("flash_attention heads gqa", "gemm column-parallel bias residual", "gemm row-parallel bias residual (Partial)",
               "rms_norm sequence-parallel residual", "rotary_embedding heads", "sparse_attention heads, layout replicated")


def _names():
    return ["flash_attention heads", "flash_attention heads gqa", "flash_attention batch",
            "flash_attention heads additive mask broadcast on heads", "sparse_attention heads, layout replicated",
            "varlen_attention heads gqa", "gemm column-parallel bias residual", "gemm column-parallel gelu",
            "gemm row-parallel bias residual (Partial)",
            "gemm row-parallel gelu training (activation after the reduction)", "gemm batch-parallel bias",
            "paged_attention heads", "paged_attention heads with append (cache written in place)",
            "fp8_attention heads", "fp8_attention batch", "scaled_gemm column-parallel col scales", "scaled_gemm row-parallel block scales (Partial)",
            "scaled_gemm batch-parallel row scales", "refuse scaled_gemm split fp8 output",
            "swiglu_gemm column-parallel (gate/up strided)", "swiglu_gemm token-parallel", "swiglu tokens",
            "swiglu last dim as [g_r | u_r]", "layer_norm sequence-parallel", "layer_norm sequence-parallel residual",
            "rms_norm sequence-parallel", "rms_norm sequence-parallel residual", "rotary_embedding heads",
            "rotary_embedding batch", "qk_norm_rotary heads", "qk_norm_rotary batch",
            "linear_cross_entropy tokens sum (Partial)", "linear_cross_entropy tokens none",
            "linear_cross_entropy_stats tokens", "fp8_attention_from_bf16 heads training",
            "scaled_swiglu_gemm column-parallel (gate/up strided, column scales)",
            "scaled_swiglu_gemm token-parallel row scales", "refuse linear_cross_entropy_stats vocabulary split",
            "linear_cross_entropy vocab-parallel mean bias", "linear_cross_entropy vocab-parallel sum softcap",
            "linear_cross_entropy vocab-parallel none smoothing z_loss lse",
            "linear_cross_entropy vocab-parallel one row (an empty shard)",
            "refuse flash_attention head_dim", "refuse flash_attention kv heads not divisible",
            "refuse flash_attention mask sharded on heads", "refuse gemm row-parallel no-grad activation",
            "refuse swiglu_gemm plain Shard(1)", "refuse swiglu last dim plain Shard", "refuse layer_norm hidden dim",
            "refuse rms_norm hidden dim", "refuse rotary cos sharded",
            "refuse linear_cross_entropy mean over sharded tokens",
            "refuse linear_cross_entropy tokens and vocabulary on one mesh dim",
            "refuse linear_cross_entropy hidden-split weight",
            "refuse linear_cross_entropy vocab-parallel plain labels",
            "attention_merge_ heads (accumulators written in place)", "attention_merge_ rows",
            "refuse attention_merge_ accumulator to copy", "cast_to_fp8 rows", "cast_to_fp8 columns",
            "cast_to_fp8_delayed replicated", "refuse cast_to_fp8_delayed sharded x",
            "explain shows the placements", "explain shows the vocab-parallel placements"] + \
        ["interpreter: " + n for n in (*INTERPRETED, *VP_INTERPRETED, "explain shows the vocab-parallel kernel")]


def test_every_case_ran(verdicts):
    for rank, v in verdicts.items():
        assert sorted(v) == sorted(_names()), f"rank {rank}: the worker's cases and this file's list differ"


@pytest.mark.parametrize("case", _names())
def test_case(verdicts, case):
    for rank, v in sorted(verdicts.items()):
        assert v.get(case) == [], f"rank {rank}: " + "\n".join(v.get(case) or ["not run"])


def test_a_failing_registration_warns_instead_of_breaking_the_import(monkeypatch):
    """DTensor internals that moved in another torch must not make `import torch.distributed.tensor` raise."""
    import opsadv.distributed as D
    from opsadv.distributed import rules

    def broken():
        raise AttributeError("ShardingPropagator has no register_op_strategy")
    monkeypatch.setattr(rules, "register_all", broken)
    monkeypatch.setattr(D, "_registered", False)
    with pytest.warns(RuntimeWarning, match="sharding rules not registered.*register_op_strategy"):
        D.register()


def test_every_op_has_a_sharding_rule():
    """A new torch.library op without a rule would fail on DTensors with DTensor's own 'no sharding strategy'."""
    import opsadv.ops  # noqa: F401  (registers the ops)
    from opsadv.distributed import rules
    names = {n.split("::", 1)[1].split(".", 1)[0] for n in torch._C._dispatch_get_all_op_names()
             if n.startswith("opsadv::")}
    assert names, "no opsadv ops registered"
    assert sorted(names - set(rules.ALL)) == []
