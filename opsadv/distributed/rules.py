"""The sharding rule of every opsadv op and its *_backward (docs/distributed.md, "Sharding rules (DTensor)").

Each rule reads one mesh dim (strategy.Call) and returns (output placements, {argument: input placement}).  The
lead argument (q, a / b, x, hidden ...) decides the split; the others follow it or are refused (strategy.plan)."""
from __future__ import annotations

from torch.distributed.tensor.placement_types import Partial, Placement, Shard, _StridedShard

from .strategy import P, R, Arg, Call, register, show

# ---- attention -----------------------------------------------------------------------------------------------


def _whole_groups(c: Call, q: str, k: str, head_dim: int) -> None:
    """Heads split over the mesh keep each GQA group (q heads sharing a kv head) on one rank."""
    hq, hk, n = c[q].shape[head_dim], c[k].shape[head_dim], c.mesh_size
    if hq != hk and hk % n:
        c.refuse(k, f"a kv head count divisible by the mesh size {n} when heads are sharded",
                 f"{hk} kv heads for {hq} q heads", why="each rank must hold whole GQA groups: its q heads and the "
                 "kv heads they read; replicate the heads or use a mesh size dividing the kv heads")


def _broadcast_split(a: Arg | None, target_ndim: int, d: int | None) -> Placement | None:
    """The placement of a tensor broadcast (right-aligned) against a target of rank target_ndim split on dim d:
    Replicate where the dim is absent or of size 1, else sharded with it."""
    if a is None:
        return None
    i = a.ndim - target_ndim + d if d is not None else -1
    return R if i < 0 or a.shape[i] == 1 else Shard(i)


def _dense(c: Call, grads: bool) -> tuple:
    d = c.lead("q", {0: "batch", 1: "heads"})
    if d == 1:
        _whole_groups(c, "q", "k", 1)
    s = R if d is None else Shard(d)
    ins = {"q": s, "k": s, "v": s}
    if c["attn_mask"] is not None:
        ins["attn_mask"] = _broadcast_split(c["attn_mask"], 4, d)
    if grads:
        ins.update(dout=s, out=s, lse=s)
        return (s, s, s), ins
    return (s, s), ins


def flash_attention(c: Call):
    return _dense(c, False)


def fp8_attention(c: Call):
    """As flash_attention (heads or batch); a (b, h) descale splits with its tensor's split dim, a per-tensor one
    (or q's (b, h_kv) FA3 form on a head split) is replicated or refused."""
    d = c.lead("q", {0: "batch", 1: "heads"})
    if d == 1:
        _whole_groups(c, "q", "k", 1)
    s = R if d is None else Shard(d)
    ins: dict[str, Placement] = {"q": s, "k": s, "v": s}
    for name, of in (("q_descale", "q"), ("k_descale", "k"), ("v_descale", "v")):
        a = c[name]
        if d is None or a.ndim < 2:
            ins[name] = R
        elif a.shape[d] == c[of].shape[d]:
            ins[name] = Shard(d)
        else:
            c.refuse(name, f"a per-tensor descale or one of shape (b, h) of {of} when heads are split",
                     f"shape {a.shape}", why="the (b, h_kv) form of q_descale cannot follow q's head split")
    return (s, s), ins


def flash_attention_backward(c: Call):
    return _dense(c, True)


def fp8_attention_backward(c: Call):
    """fp8_attention_from_bf16's backward: as fp8_attention's forward, with dout / out / lse split with q."""
    (s, _), ins = fp8_attention(c)
    ins.update(dout=s, out=s, lse=s)
    return (s, s, s), ins


def _sparse(c: Call, grads: bool) -> tuple:
    packed = c["cu_seqlens"] is not None
    d = c.lead("q", {1: "heads"} if packed else {0: "batch", 1: "heads"})
    if d == 1:
        _whole_groups(c, "q", "k", 1)
    s = R if d is None else Shard(d)
    ins = {"q": s, "k": s, "v": s, "block_mask": _broadcast_split(c["block_mask"], 4, d)}
    if c["key_padding_mask"] is not None:
        ins["key_padding_mask"] = Shard(0) if d == 0 else R
    if packed:
        ins["cu_seqlens"] = R
    if grads:
        ins.update(dout=s, out=s, lse=s)
        return (s, s, s), ins
    return (s, s), ins


def sparse_attention(c: Call):
    return _sparse(c, False)


def sparse_attention_backward(c: Call):
    return _sparse(c, True)


def _paged(c: Call, append: bool) -> tuple:
    hd = c["q"].ndim - 2                     # q (b, s_q, Hq, D) or packed (total_q, Hq, D)
    d = c.lead("q", {hd: "heads"})
    if d is not None:
        _whole_groups(c, "q", "k_cache", 2)
    s = R if d is None else Shard(d)
    ins = {"q": s, "k_cache": R if d is None else Shard(2), "v_cache": R if d is None else Shard(2),
           "block_table": R, "seqlens_k": R, "cu_seqlens_q": R}
    for name in ("k_scale", "v_scale"):      # per kv head (Hkv,) splits with the heads, one scalar does not
        a = c[name]
        if a is not None:
            ins[name] = Shard(0) if d is not None and a.ndim == 1 and a.shape[0] > 1 else R
    if append:
        for name in ("k_new", "v_new"):
            ins[name] = R if d is None else Shard(c[name].ndim - 2)
        for name in ("k_cache", "v_cache"):  # written in place: a redistributed copy would take the writes
            if c[name].placement != ins[name]:
                c.refuse(name, f"exactly {ins[name]} (the cache is written in place, so DTensor may not copy it)")
    return (s, s), {n: p for n, p in ins.items() if c[n] is not None}


def paged_attention(c: Call):
    return _paged(c, False)


def paged_attention_append(c: Call):
    return _paged(c, True)


def varlen_attention(c: Call):
    d = c.lead("q", {1: "heads"})            # q (total_q, Hq, D): tokens of several sequences are not separable
    if d is not None:
        _whole_groups(c, "q", "k", 1)
    s = R if d is None else Shard(1)
    return (s, s), {"q": s, "k": s, "v": s, "cu_seqlens_q": R, "cu_seqlens_k": R}


def packed_segments(c: Call):
    """The segments of a packed causal mask over its batch rows laid end to end: the whole mask, one cu_seqlens
    (attention's heads may be split; its tokens are not)."""
    return (R,), {"mask": R}


# ---- gemm / swiglu_gemm / swiglu -----------------------------------------------------------------------------


def _like(p: Placement, dim: int) -> Placement:
    """p's kind (Shard or _StridedShard with its split factor) on another tensor dim."""
    return _StridedShard(dim, split_factor=p.split_factor) if isinstance(p, _StridedShard) else Shard(dim)


def _gemm_mode(c: Call, a: str, b: str) -> tuple[str, int | None]:
    """("column" | "row" | "batch" | "replicate", a's split dim) of a @ b, b (K, N)."""
    x, w = c[a], c[b]
    last = x.ndim - 1
    d = x.dim
    if w.dim == 1:
        if d is not None:
            c.refuse(a, "Replicate() when b is sharded on its columns (column-parallel)",
                     why="a and b cannot both be split on one mesh dim")
        return "column", None
    if w.strided:
        c.refuse(b, "Replicate(), Shard(0) (row-parallel) or Shard(1) (column-parallel)")
    if w.dim == 0 or d == last:
        if x.strided or (d is not None and d != last):
            c.refuse(a, f"Shard({last}) (its K dim) when b is sharded on its rows (row-parallel)",
                     why="a and b cannot both be split on different dims of one mesh dim")
        return "row", last
    if x.strided:
        c.refuse(a, f"Replicate() or Shard(d) for d < {last}")
    return ("batch", d) if d is not None else ("replicate", None)


_ROW_ACT = ("'none' when the K dim is sharded (row-parallel: each rank's product is a partial sum, and an activation "
            "must follow the all-reduce); call gemm without it and apply the activation to the reduced output "
            "(grad-recording calls already run it so: the activation is a torch op after the GEMM)")


def gemm(c: Call):
    mode, d = _gemm_mode(c, "a", "b")
    last = c["a"].ndim - 1
    ins: dict[str, Placement] = {}
    if mode == "column":
        wp = c["b"].placement
        out = _like(wp, last)
        ins = {"a": R, "b": wp, "bias": _like(wp, 0), "residual": out}
    elif mode == "row":
        if c["activation"] != "none":
            c.refuse("activation", _ROW_ACT)
        out = P                              # bias / residual as partial shares: the reduction adds each once
        ins = {"a": Shard(last), "b": Shard(0), "bias": P, "residual": P}
    elif mode == "batch":
        out = Shard(d)
        ins = {"a": out, "b": R, "bias": R, "residual": out}
    else:
        out = R
        ins = {"a": R, "b": R, "bias": R, "residual": R}
    return (out,), {n: p for n, p in ins.items() if c[n] is not None}


def gemm_backward(c: Call):
    mode, d = _gemm_mode(c, "a", "b")
    last = c["a"].ndim - 1
    has_bias = c["bias"] is not None
    if mode == "column":
        wp = c["b"].placement
        outs, ins = (P, wp, _like(wp, 0) if has_bias else R), {"grad": _like(wp, last), "a": R, "b": wp,
                                                                 "bias": _like(wp, 0)}
    elif mode == "row":
        if c["activation"] != "none":
            c.refuse("activation", _ROW_ACT)
        outs, ins = (Shard(last), Shard(0), R), {"grad": R, "a": Shard(last), "b": Shard(0), "bias": R}
    elif mode == "batch":
        outs, ins = (Shard(d), P, P if has_bias else R), {"grad": Shard(d), "a": Shard(d), "b": R, "bias": R}
    else:
        outs, ins = (R, R, R), {"grad": R, "a": R, "b": R, "bias": R}
    return outs, {n: p for n, p in ins.items() if c[n] is not None}


def _scale_split(scale: Arg, d: int | None, of: str) -> Placement:
    """A dequantization scale's placement when its operand is split on dim d: a per-tensor scale, and a row / column
    scale whose broadcast dim is the split one, stay replicated; a per-row, per-column or block scale splits with
    the operand on the same dim (block scales: the split must fall on whole 128-blocks)."""
    if d is None or scale.ndim == 0 or scale.shape[d] == 1:
        return R
    return Shard(d)


_FP8_OUT = ("out_fp8=None unless the output is replicated (its one per-tensor scale comes from the amax of the "
            "whole result; split, each rank would pick its own); return a bf16 / fp32 output and quantize it after")


def scaled_gemm(c: Call):
    """As gemm's column / row / batch modes; the scales follow their operands (scaled_gemm: a (M, K), b (K, N))."""
    mode, d = _gemm_mode(c, "a", "b")
    if c["out_fp8"] is not None and mode != "replicate":
        c.refuse("out_fp8", _FP8_OUT, repr(c["out_fp8"]))
    ins: dict[str, Placement] = {}
    if mode == "column":
        wp = c["b"].placement
        if not c["b"].sharded:
            c.refuse("b", "Replicate(), Shard(0) (row-parallel) or Shard(1) (column-parallel)")
        out = Shard(1)
        ins = {"a": R, "a_scale": R, "b": wp, "b_scale": _scale_split(c["b_scale"], 1, "b"), "bias": Shard(0),
               "residual": out}
    elif mode == "row":
        if c["activation"] != "none":
            c.refuse("activation", _ROW_ACT.replace("call gemm", "call scaled_gemm"))
        out = P
        ins = {"a": Shard(1), "a_scale": _scale_split(c["a_scale"], 1, "a"), "b": Shard(0),
               "b_scale": _scale_split(c["b_scale"], 0, "b"), "bias": P, "residual": P}
    elif mode == "batch":
        out = Shard(0)
        ins = {"a": out, "a_scale": _scale_split(c["a_scale"], 0, "a"), "b": R, "b_scale": R, "bias": R,
               "residual": out}
    else:
        out = R
        ins = {n: R for n in ("a", "a_scale", "b", "b_scale", "bias", "residual")}
    return (out, R), {n: p for n, p in ins.items() if c[n] is not None}


GATE_UP = "_StridedShard(1, split_factor=2) (opsadv.distributed.shard_gate_up): each rank holds matching W_g and W_u columns"


def _swiglu_gemm_mode(c: Call) -> tuple[str, int | None]:
    x, w = c["x"], c["w_gate_up"]
    last = x.ndim - 1
    if w.strided:
        if w.dim != 1 or w.placement.split_factor != 2:
            c.refuse("w_gate_up", GATE_UP)
        if x.sharded or x.strided:
            c.refuse("x", "Replicate() when w_gate_up is split on its columns (column-parallel)")
        return "column", None
    if w.sharded:
        c.refuse("w_gate_up", f"Replicate() or {GATE_UP}",
                 why="a plain Shard(1) of [W_g | W_u] gives one rank gate columns and the other up columns; Shard(0) "
                     "(K) makes the product a partial sum, which the SiLU cannot take")
    d = c.lead("x", {i: "tokens" for i in range(last)})
    return ("batch", d) if d is not None else ("replicate", None)


def swiglu_gemm(c: Call):
    mode, d = _swiglu_gemm_mode(c)
    last = c["x"].ndim - 1
    if mode == "column":
        out, ins = Shard(last), {"x": R, "w_gate_up": c["w_gate_up"].placement, "bias": _like(c["w_gate_up"].placement, 0)}
    else:
        out = R if d is None else Shard(d)
        ins = {"x": out, "w_gate_up": R, "bias": R}
    return (out,), {n: p for n, p in ins.items() if c[n] is not None}


def swiglu_gemm_backward(c: Call):
    mode, d = _swiglu_gemm_mode(c)
    last = c["x"].ndim - 1
    has_bias = c["bias"] is not None
    if mode == "column":
        wp = c["w_gate_up"].placement
        outs, ins = (P, wp, _like(wp, 0) if has_bias else R), {"grad": Shard(last), "x": R, "w_gate_up": wp,
                                                                 "bias": _like(wp, 0)}
    elif mode == "batch":
        outs, ins = (Shard(d), P, P if has_bias else R), {"grad": Shard(d), "x": Shard(d), "w_gate_up": R, "bias": R}
    else:
        outs, ins = (R, R, R), {"grad": R, "x": R, "w_gate_up": R, "bias": R}
    return outs, {n: p for n, p in ins.items() if c[n] is not None}


def scaled_swiglu_gemm(c: Call):
    """As swiglu_gemm's column (w_gate_up as [W_g,r | W_u,r] per rank) and token modes; the scales follow their
    operands.  A split FP8 output is refused (its one per-tensor scale is the whole result's)."""
    mode, d = _swiglu_gemm_mode(c)
    if c["out_fp8"] is not None and mode != "replicate":
        c.refuse("out_fp8", _FP8_OUT, repr(c["out_fp8"]))
    if mode == "column":
        wp = c["w_gate_up"].placement
        ws = c["w_scale"]
        if ws.ndim == 0 or ws.shape[1] == 1:
            wsp = R
        elif c["w_scale"].shape[1] == c["w_gate_up"].shape[1]:
            wsp = wp                              # per-column scales: split exactly as the columns
        else:
            c.refuse("w_scale", "a per-tensor, per-row or per-column scale when w_gate_up's columns are split",
                     f"shape {ws.shape}", why="a block scale's 128 columns do not follow the [W_g,r | W_u,r] split")
        out = Shard(c["x"].ndim - 1)
        ins = {"x": R, "x_scale": R, "w_gate_up": wp, "w_scale": wsp, "bias": _like(wp, 0)}
    else:
        out = R if d is None else Shard(d)
        ins = {"x": out, "x_scale": _scale_split(c["x_scale"], d, "x"), "w_gate_up": R, "w_scale": R, "bias": R}
    return (out, R), {n: p for n, p in ins.items() if c[n] is not None}


def _swiglu_split(c: Call) -> Placement:
    """gate_up's placement: any non-last dim, or the last one as _StridedShard(last, 2) ([g_r | u_r] per rank)."""
    g = c["gate_up"]
    last = g.ndim - 1
    if g.strided and g.dim == last and g.placement.split_factor == 2:
        return g.placement
    if (g.sharded and g.dim == last) or g.strided:
        c.refuse("gate_up", f"Replicate(), Shard(d) for d < {last}, or _StridedShard({last}, split_factor=2)",
                 why=f"a plain Shard({last}) of [g | u] puts gate features on one rank and up features on another")
    d = c.lead("gate_up", {i: "tokens" for i in range(last)})
    return R if d is None else Shard(d)


def swiglu(c: Call):
    p = _swiglu_split(c)
    return ((Shard(p.dim) if isinstance(p, _StridedShard) else p),), {"gate_up": p}


def swiglu_backward(c: Call):
    p = _swiglu_split(c)
    return (p,), {"grad": Shard(p.dim) if isinstance(p, _StridedShard) else p, "gate_up": p}


# ---- norms ---------------------------------------------------------------------------------------------------


def _tokens(c: Call, x: str) -> int | None:
    a = c[x]
    last = a.ndim - 1
    if a.dim == last:
        c.refuse(x, f"Replicate() or Shard(d) for d < {last} (tokens: sequence parallel)",
                 why="the norm reduces over the hidden (last) dim, which must stay whole on every rank")
    return c.lead(x, {i: "tokens" for i in range(last)})


def layer_norm(c: Call):
    d = _tokens(c, "x")
    s = R if d is None else Shard(d)
    has_res = c["residual"] is not None
    ins = {"x": s, "weight": R, "bias": R, "residual": s}
    return (s, s if has_res else R, s, s), {n: p for n, p in ins.items() if c[n] is not None}


def layer_norm_backward(c: Call):
    d = _tokens(c, "xin")
    s = R if d is None else Shard(d)
    red = R if d is None else P              # weight / bias gradients: each rank sums its own tokens
    ins = {"dy": s, "dsum": R if c["dsum"].empty else s, "xin": s, "weight": R, "bias": R, "mean": s, "rstd": s}
    return (s, red if c["weight"] is not None else R, red if c["bias"] is not None else R), \
        {n: p for n, p in ins.items() if c[n] is not None}


def rms_norm(c: Call):
    d = _tokens(c, "x")
    s = R if d is None else Shard(d)
    ins = {"x": s, "weight": R, "residual": s}
    return (s, s if c["residual"] is not None else R, s), {n: p for n, p in ins.items() if c[n] is not None}


def rms_norm_backward(c: Call):
    d = _tokens(c, "xin")
    s = R if d is None else Shard(d)
    ins = {"dy": s, "dsum": R if c["dsum"].empty else s, "xin": s, "weight": R, "rstd": s}
    return (s, (R if d is None else P) if c["weight"] is not None else R), \
        {n: p for n, p in ins.items() if c[n] is not None}


# ---- rotary ----------------------------------------------------------------------------------------------------


def _rotary_split(c: Call, q: str, k: str) -> tuple[Placement, dict[str, Placement]]:
    d = c.lead(q, {0: "batch", 1: "heads"})
    s = R if d is None else Shard(d)
    ins = {q: s, k: s}
    for name in ("cos", "sin"):              # (S, R) / (P, R): shared; (B, S, R) splits with a split batch
        a = c[name]
        ins[name] = Shard(0) if d == 0 and a.ndim == 3 and a.shape[0] > 1 else R
    pos = c["position_ids"]
    if pos is not None:
        ins["position_ids"] = Shard(0) if d == 0 and pos.ndim == 2 and pos.shape[0] > 1 else R
    return s, ins


def rotary_embedding(c: Call):
    s, ins = _rotary_split(c, "q", "k")
    return (s, s), ins


def rotary_embedding_backward(c: Call):
    s, ins = _rotary_split(c, "gq", "gk")
    return (s, s), ins


def qk_norm_rotary(c: Call):
    s, ins = _rotary_split(c, "q", "k")
    return (s, s), {**ins, "q_weight": R, "k_weight": R}


def qk_norm_rotary_backward(c: Call):
    s, ins = _rotary_split(c, "q", "k")
    red = R if s == R else P
    return (s, s, red, red), {**ins, "gq": s, "gk": s, "q_weight": R, "k_weight": R}


# ---- linear_cross_entropy --------------------------------------------------------------------------------------


def _replicated_head(c: Call, why: str) -> None:
    """The projection (weight, bias) of a loss op runs replicated; any split of it is refused with `why`."""
    for name in ("weight", "bias"):
        a = c[name]
        if a is not None and (a.sharded or a.strided):
            c.refuse(name, "Replicate()", why=why)


def _lce_split(c: Call) -> int | None:
    _replicated_head(c, "a split of the hidden dim makes the logits partial sums, and cross entropy is not linear in "
                        "them; a vocabulary split (Shard(0)) runs vocab-parallel through opsadv.ops.linear_cross_entropy "
                        "(opsadv/distributed/vocab_parallel.py), not through this custom op")
    a = c["hidden"]
    if a.dim == 1:
        c.refuse("hidden", "Replicate() or Shard(0) (tokens)",
                 why="a split hidden dim makes the logits partial sums, and cross entropy is not linear in them")
    d = c.lead("hidden", {0: "tokens"})
    if d is not None and c["reduction"] == "mean":
        c.refuse("reduction", "'sum' or 'none' when the tokens are sharded", repr("mean"),
                 why="each rank would divide by its own count of non-ignored tokens; use reduction='sum' and divide "
                     "by (labels != ignore_index).sum() over all tokens")
    return d


def linear_cross_entropy(c: Call):
    d = _lce_split(c)
    s = R if d is None else Shard(0)
    red = R if d is None else P
    loss = s if c["reduction"] == "none" else red
    g = c["grads_in_forward"]
    outs = (loss, s, s if g else R, red if g else R, red if g and c["bias"] is not None else R)
    ins = {"hidden": s, "weight": R, "labels": s, "bias": R}
    return outs, {n: p for n, p in ins.items() if c[n] is not None}


def linear_cross_entropy_backward(c: Call):
    d = _lce_split(c)
    s = R if d is None else Shard(0)
    red = R if d is None else P
    ins = {"grad": s if c["reduction"] == "none" else R, "hidden": s, "weight": R, "labels": s, "bias": R, "lse": s}
    return (s, red, red if c["bias"] is not None else R), {n: p for n, p in ins.items() if c[n] is not None}


def _stats_split(c: Call) -> int | None:
    _replicated_head(c, "each rank would read its rows as the slice starting at the same vocab_start; a vocabulary "
                        "split runs through opsadv.ops.linear_cross_entropy (vocab-parallel, "
                        "opsadv/distributed/vocab_parallel.py), which gives each rank its own vocab_start")
    return c.lead("hidden", {0: "tokens"})


def linear_cross_entropy_stats(c: Call):
    """Tokens (hidden's rows) split: stats (3, tokens) split on its token dim; the vocabulary slice replicated."""
    d = _stats_split(c)
    s = R if d is None else Shard(0)
    ins = {"hidden": s, "weight": R, "labels": s, "bias": R}
    return (R if d is None else Shard(1),), {n: p for n, p in ins.items() if c[n] is not None}


def linear_cross_entropy_stats_backward(c: Call):
    d = _stats_split(c)
    s = R if d is None else Shard(0)
    st = R if d is None else Shard(1)
    red = R if d is None else P
    ins = {"grad": st, "hidden": s, "weight": R, "labels": s, "bias": R, "stats": st}
    return (s, red, red if c["bias"] is not None else R), {n: p for n, p in ins.items() if c[n] is not None}


# ---- the lse merge ----------------------------------------------------------------------------------------------


def attention_merge_(c: Call):
    """Rows are independent: acc_out leads (batch, heads or rows), acc_lse / out / lse split with it.  The
    accumulators are written in place, so they must already be placed so (a redistributed copy would take the
    writes): acc_lse exactly as acc_out, and neither Partial."""
    for name in ("acc_out", "acc_lse"):
        if c[name].placement.is_partial():
            c.refuse(name, "Replicate() or a Shard (it is written in place: reducing a Partial would copy it)")
    d = c.lead("acc_out", {0: "batch", 1: "heads", 2: "rows"})
    s = R if d is None else Shard(d)
    if c["acc_lse"].placement != s:
        c.refuse("acc_lse", f"exactly {show(s)} (as acc_out: it is written in place, so DTensor may not copy it)")
    return (), {"acc_out": s, "acc_lse": s, "out": s, "lse": s}


# ---- the fp8 cast -----------------------------------------------------------------------------------------------


def cast_to_fp8(c: Call):
    """Elementwise under one replicated per-tensor scale: x_fp8 splits with x, its transpose on the other dim, and
    the amax is each rank's max over its shard (Partial("max"): reduced on use, so every rank records the global
    one).  A Partial x (partial sums) is refused: the max of partial sums is not the sum's max."""
    if c["x"].placement.is_partial():
        c.refuse("x", "Replicate() or a Shard (the cast of a partial sum is not the partial of a cast)")
    d = c.lead("x", {0: "rows", 1: "columns"})
    s = R if d is None else Shard(d)
    t = R if d is None or not c["transpose"] else Shard(1 - d)
    return (s, t, R if d is None else Partial("max")), {"x": s, "scale": R}


def cast_to_fp8_delayed(c: Call):
    """Replicated only: each rank would record its own shard's amax into its history, so sharded ranks would drift
    to different scales; a sharded x takes cast_to_fp8 with its Partial("max") amax (reduced on use).  The history
    is written in place, so it is refused unless already replicated (a redistributed copy would take the write)."""
    for name in ("x", "history"):
        if c[name].placement != R:
            c.refuse(name, "Replicate()", why="the history records this call's amax in place: a shard's would be "
                     "one rank's; cast a sharded x with cast_to_fp8 and a Partial('max') amax")
    return (R, R, R), {"x": R, "history": R}


# op overload name -> (rule, the arguments that are gradients: placed by autograd, redistributed freely)
ALL = {
    "flash_attention": (flash_attention, ()),
    "flash_attention_backward": (flash_attention_backward, ("dout",)),
    "fp8_attention": (fp8_attention, ()),
    "fp8_attention_backward": (fp8_attention_backward, ("dout",)),
    "sparse_attention": (sparse_attention, ()),
    "sparse_attention_backward": (sparse_attention_backward, ("dout",)),
    "paged_attention": (paged_attention, ()),
    "paged_attention_append": (paged_attention_append, ()),
    "varlen_attention": (varlen_attention, ()),
    "packed_segments": (packed_segments, ()),
    "gemm": (gemm, ()),
    "gemm_backward": (gemm_backward, ("grad",)),
    "scaled_gemm": (scaled_gemm, ()),
    "swiglu_gemm": (swiglu_gemm, ()),
    "swiglu_gemm_backward": (swiglu_gemm_backward, ("grad",)),
    "scaled_swiglu_gemm": (scaled_swiglu_gemm, ()),
    "swiglu": (swiglu, ()),
    "swiglu_backward": (swiglu_backward, ("grad",)),
    "layer_norm": (layer_norm, ()),
    "layer_norm_backward": (layer_norm_backward, ("dy", "dsum")),
    "rms_norm": (rms_norm, ()),
    "rms_norm_backward": (rms_norm_backward, ("dy", "dsum")),
    "rotary_embedding": (rotary_embedding, ()),
    "rotary_embedding_backward": (rotary_embedding_backward, ("gq", "gk")),
    "qk_norm_rotary": (qk_norm_rotary, ()),
    "qk_norm_rotary_backward": (qk_norm_rotary_backward, ("gq", "gk")),
    "linear_cross_entropy": (linear_cross_entropy, ()),
    "linear_cross_entropy_backward": (linear_cross_entropy_backward, ("grad",)),
    "linear_cross_entropy_stats": (linear_cross_entropy_stats, ()),
    "linear_cross_entropy_stats_backward": (linear_cross_entropy_stats_backward, ("grad",)),
    "attention_merge_": (attention_merge_, ()),
    "cast_to_fp8": (cast_to_fp8, ()),
    "cast_to_fp8_delayed": (cast_to_fp8_delayed, ()),
}


def register_all() -> None:
    for name, (rule, free) in ALL.items():
        register(name, rule, free)
