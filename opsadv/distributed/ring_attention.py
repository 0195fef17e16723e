"""ring_attention: context-parallel attention over a torch.distributed group (each rank holds a share of the
sequence; see docs/distributed.md, "Context parallel (ring attention)").

Every rank passes its own share of q, k, v, (b, h, s_local, d) as flash_attention takes them; the result is the
rank's share of attention over the whole sequence (out, and lse with return_lse=True).  Full / causal attention
runs the ring of .ring_steps; a sliding window exchanges tails between neighbours (.ring_window)."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from opsadv.core.errors import InvalidArgumentError
from opsadv.core.op_common import check_scale
from opsadv.ops.flash_attention import default_scale

from .ring_group import RingGroup
from .ring_layout import RingLayout
from .ring_steps import RingAttentionFunction
from .ring_window import window_attention

OP = "distributed.ring_attention"
_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _local_problem(q, k, v) -> InvalidArgumentError | None:
    """What is wrong with this rank's operands on their own (None: nothing)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor) or t.dim() != 4:
            return InvalidArgumentError(OP, name, "a 4-D tensor (batch, heads, seq, head_dim)",
                                        tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__)
        if t.dtype not in _DTYPES or t.dtype != q.dtype or t.device != q.device:
            return InvalidArgumentError(OP, name, f"a float tensor of q's dtype and device ({q.dtype}, {q.device})",
                                        f"{t.dtype} on {t.device}")
    b, hq, s, d = q.shape
    if k.shape != v.shape or k.shape[0] != b or k.shape[2] != s or k.shape[3] != d:
        return InvalidArgumentError(OP, "k/v", f"shaped (b={b}, h_kv, s={s}, d={d}) alike (this rank's share of "
                                    "the same tokens as q)", f"k {tuple(k.shape)}, v {tuple(v.shape)}")
    if k.shape[1] < 1 or hq % k.shape[1]:
        return InvalidArgumentError(OP, "k", f"a number of heads dividing q's {hq} (GQA/MQA)", k.shape[1])
    return None


def _plan_problem(layout: RingLayout, lengths: list[int]) -> InvalidArgumentError | None:
    if layout.seq_len < layout.n_chunks:
        return InvalidArgumentError(OP, "q", f"a sequence of at least {layout.n_chunks} tokens in all "
                                    f"({layout.describe()}: one per chunk)", f"{layout.seq_len} tokens")
    want = [layout.local_len(r) for r in range(layout.world)]
    if lengths != want:
        helper = "zigzag_shard" if layout.zigzag else "torch.tensor_split(x, world_size, dim=2)"
        return InvalidArgumentError(OP, "q", f"every rank's share of the sequence as {helper} cuts it "
                                    f"({layout.describe()}: {want} tokens by rank)", f"{lengths} tokens by rank")
    return None


def _agree(q, k, v, group, world: int, rank: int, zigzag: bool, seq_len: int | None) -> RingLayout:
    """The group's layout; every rank raises the same error when any rank's operands are wrong (seq_len given:
    the local checks only, no collective)."""
    local = _local_problem(q, k, v)
    if seq_len is not None:
        if local is not None:
            raise local
        layout = RingLayout(seq_len, world, zigzag)
        want = layout.local_len(rank) if seq_len >= layout.n_chunks else None
        if want != q.shape[2]:
            _raise(_plan_problem(layout, [q.shape[2] if r == rank else layout.local_len(r) for r in range(world)]))
        return layout
    # one small all_gather: shapes, dtype and any local problem of every rank, so that all raise together
    dev = q.device if isinstance(q, Tensor) else torch.device("cpu")
    facts = [1, 0, 0, 0, 0, 0, 0]
    if local is None:
        facts = [0, q.shape[0], q.shape[1], k.shape[1], q.shape[3], q.shape[2], _DTYPES.index(q.dtype)]
    mine = torch.tensor(facts, dtype=torch.int64, device=dev)
    every = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(every, mine, group=group)
    every = [t.tolist() for t in every]
    bad = [r for r, f in enumerate(every) if f[0]]
    if local is not None:
        raise local
    if bad:
        raise InvalidArgumentError(OP, "q/k/v", "well formed on every rank of the group",
                                   f"rank(s) {bad} refused theirs (see the error on those ranks)")
    shapes = [tuple(f[1:5]) + (_DTYPES[f[6]],) for f in every]
    if len(set(shapes)) > 1:
        raise InvalidArgumentError(OP, "q/k/v", "the same (batch, q heads, kv heads, head_dim, dtype) on every rank",
                                   "; ".join(f"rank {r}: {s}" for r, s in enumerate(shapes)))
    lengths = [f[5] for f in every]
    layout = RingLayout(sum(lengths), world, zigzag)
    _raise(_plan_problem(layout, lengths))
    return layout


def _raise(problem: InvalidArgumentError | None) -> None:
    if problem is not None:
        raise problem


def ring_attention(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = False, scale: float | None = None,
                   group=None, load_balance: bool = True, window: int | None = None, seq_len: int | None = None,
                   return_lse: bool = False):
    """Attention of this rank's queries over the whole sequence, which the ranks of `group` (None: the default
    group) hold in shares; a collective call: every rank of the group calls it, in the same order.

    q (b, h_q, s, d), k / v (b, h_kv, s, d): this rank's share (the same tokens for all three; GQA when h_kv
    divides h_q).  load_balance=True: the shares are zigzag_shard's (chunks r and 2W-1-r of 2W: causal work is even
    over the ranks); False: contiguous, torch.tensor_split(x, W, dim=2)[r].  Odd lengths are fine (tensor_split's
    uneven chunks).  causal is over the global positions.  window (with causal=True): sliding-window attention,
    query i sees keys i - window .. i; window <= the shortest chunk (only neighbours exchange).
    seq_len: the total length, when known: skips the check across ranks (one all_gather and a host sync per call);
    a rank whose share is then wrong raises alone while the others wait in the ring until the group's timeout.
    Returns out (b, h_q, s, d), or (out, lse) with return_lse=True (lse (b, h_q, s), not differentiable).
    Gradients flow to q, k, v (the backward runs the ring again; every rank must run it)."""
    for name, flag in (("causal", causal), ("load_balance", load_balance), ("return_lse", return_lse)):
        if not isinstance(flag, bool):
            raise InvalidArgumentError(OP, name, "a bool", repr(flag))
    check_scale(OP, scale)
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 0):
        raise InvalidArgumentError(OP, "window", "None or an int >= 0 (keys i - window .. i)", repr(window))
    if window is not None and not causal:
        raise InvalidArgumentError(OP, "window", "used with causal=True (the window looks back only)", window)
    if seq_len is not None and (isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1):
        raise InvalidArgumentError(OP, "seq_len", "None or the total sequence length, an int >= 1", repr(seq_len))
    if not dist.is_available() or not dist.is_initialized():
        raise InvalidArgumentError(OP, "group", "a group of an initialized torch.distributed "
                                   "(dist.init_process_group first)", "no process group")
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if rank < 0:
        raise InvalidArgumentError(OP, "group", "a group this rank belongs to", f"global rank {dist.get_rank()} is "
                                   "not in it")
    layout = _agree(q, k, v, group, world, rank, load_balance, seq_len)
    ring = RingGroup(group, rank, world, layout)
    s = default_scale(q, scale)
    if window is not None:
        # every chunk's predecessor must hold the window (tensor_split: the later chunks are the shorter ones)
        shortest = min((layout.chunk_len(c) for c in range(layout.n_chunks - 1)), default=window)
        if window > shortest:
            raise InvalidArgumentError(OP, "window", f"<= the shortest chunk, {shortest} tokens ({layout.describe()}): "
                                       "a window reaches back into one neighbouring chunk only", window)
        out, lse = window_attention(q, k, v, ring, window, s)
        lse = lse.detach()
    else:
        out, lse = RingAttentionFunction.apply(q, k, v, ring, causal, s)
    return (out, lse) if return_lse else out
