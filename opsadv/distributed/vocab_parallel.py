"""Vocab-parallel linear_cross_entropy: the LM loss of a head whose weight (V, H) is split over its vocabulary
(Shard(0) on one mesh dim: what ColwiseParallel on lm_head and transformers' tp_plan make), without gathering the
weight and without the (tokens, V) logits (docs/distributed.md, "Vocab-parallel cross entropy").

`opsadv.ops.linear_cross_entropy` takes this path when its weight is such a DTensor (installed by
opsadv.distributed.register).  Each rank of the vocabulary's mesh dim holds rows [v0, v0 + V_r) of the weight (and
bias) and every token (hidden replicated on that dim).  It runs the op linear_cross_entropy_stats on its shard
(opsadv/ops/linear_cross_entropy/stats.py): per token, of its shard's logits z_r = h W_r^T (+ b_r) (softcapped where
asked), lse_r = logsumexp(z_r), the target logit z_y where the label falls in [v0, v0 + V_r) (else 0) and sum(z_r)
(label smoothing).  One all_gather over that mesh dim (torch.distributed._functional_collectives) brings every rank's
(lse_r, z_y, sum z_r); each rank combines them alike: lse = logsumexp_r(lse_r), z_y = sum_r, sum z = sum_r, so
    loss = (1 - eps) (lse - z_y) + eps (lse - sum z / V) + z_loss lse^2,
exactly the single-device loss.  The backward hands that op's backward the gradients of its three statistics
(stats_grads), which make the shard's d loss / d z_r = g (softmax_r (1 + 2 z_loss lse) - eps / V - (1 - eps) onehot_r)
against the global lse, times 1 - tanh^2 under a softcap; the op recomputes each chunk's logits: grad hidden = dz_r W_r
is a partial sum (DTensor Partial(), all-reduced by DTensor), grad W_r = dz_r^T h and grad b_r stay on their rank
(Shard(0)).

Other mesh dims may split the tokens (hidden Shard(d) for d < its last dim, labels alike); the weight is replicated
there and its gradient is Partial() (each rank's tokens).  reduction "mean" over split tokens is refused, as the
DTensor rule of the unsplit op refuses it.

What runs where: linear_cross_entropy_stats dispatches like every op (opsadv.explain on the vocab-parallel call
shows its candidates for this rank's shards).  Where the device runs Triton (cuda / rocm / jetson backends on a GPU,
and CPU tensors under TRITON_INTERPRET=1) that is "<backend>.triton.linear_cross_entropy_stats": per chunk of tokens
the logits GEMM (torch.mm) in the inputs' dtype and a Triton kernel storing three float32 numbers per token (no
float32 logits); its backward overwrites the recomputed chunk logits with their gradient and runs the dh / dW GEMMs,
as the single-device Triton impl does.  Elsewhere (CPU, ascend, float64) the reference impl: the same statistics in
plain torch on float32 logits of the whole shard; under a device backend that is dispatch's reference fallback,
which warns once.  The combine and the all_gather are torch ops on three numbers per token."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor
from torch.distributed import _functional_collectives as funcol
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard, _StridedShard

from opsadv.core.errors import InvalidArgumentError, ShardingError
from opsadv.ops.linear_cross_entropy import install_vocab_parallel
from opsadv.ops.linear_cross_entropy.stats import linear_cross_entropy_stats, stats_backward

from .strategy import _Placed, show

OP = "linear_cross_entropy"
R = Replicate()
# (torch 2.13 renamed all_gather_tensor, which now warns)
_all_gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor


def _plain_shard(p: Placement) -> bool:
    return isinstance(p, Shard) and not isinstance(p, _StridedShard)


def vocab_dims(placements) -> list[int]:
    """The mesh dims on which a (V, H) weight is split over its vocabulary (Shard(0))."""
    return [i for i, p in enumerate(placements) if _plain_shard(p) and p.dim % 2 == 0]


def is_vocab_split(weight) -> bool:
    return isinstance(weight, DTensor) and bool(vocab_dims(weight.placements))


def _seq(ps) -> str:
    return "[" + ", ".join(show(p) for p in ps) + "]"


@dataclass(frozen=True)
class VocabPlan:
    """How a vocab-parallel call runs over the whole mesh: the placements each argument runs with, the outputs', and
    those of the local gradients handed back to DTensor."""
    vdim: int                                         # the vocabulary's mesh dim
    inputs: dict[str, tuple[Placement, ...]]          # hidden, weight, labels (, bias)
    loss: tuple[Placement, ...]
    lse: tuple[Placement, ...]
    grads: dict[str, tuple[Placement, ...]]           # placements of the local gradients of hidden, weight, bias

    def describe(self, given: dict[str, tuple[Placement, ...]], vocab: int, mesh_size: int) -> str:
        ins = ", ".join(f"{n} {_seq(given[n])}" + (f" -> {_seq(p)}" if tuple(p) != tuple(given[n]) else "")
                        for n, p in self.inputs.items())
        return (f"{ins} => loss {_seq(self.loss)}, lse {_seq(self.lse)}; vocab-parallel over mesh dim {self.vdim} "
                f"({vocab} vocabulary rows on {mesh_size} ranks; each rank's per-token (lse, target logit, logit sum) "
                f"all-gathered over that dim; backward: grad hidden {_seq(self.grads['hidden'])} (DTensor reduces "
                f"it), grad weight {_seq(self.grads['weight'])})")


def _refuse(name: str, expected: str, given, md: int, why: str = "") -> ShardingError:
    return ShardingError(OP, name, f"{expected} on mesh dim {md}" + (f" ({why})" if why else ""), given)


def plan(values: dict[str, _Placed | None], reduction: str) -> VocabPlan:
    """The placements of a call whose weight is split over its vocabulary.  values: hidden, weight, labels, bias as
    (global shape, placements) (bias None when absent).  Raises ShardingError for a layout it cannot run."""
    w = values["weight"]
    vd = vocab_dims(w.placements)
    if len(vd) != 1:
        raise _refuse("weight", "Shard(0) on exactly one mesh dim (the vocabulary's) and Replicate() on the others",
                      _seq(w.placements), vd[1] if vd else 0,
                      why="a vocabulary split over two mesh dims is not supported; flatten them into one")
    v = vd[0]
    hid, lab, bias = values["hidden"], values["labels"], values["bias"]
    last = len(hid.shape) - 1
    ins: dict[str, list[Placement]] = {n: [] for n in ("hidden", "weight", "labels", "bias") if values[n] is not None}
    loss, lse = [], []
    grads: dict[str, list[Placement]] = {n: [] for n in ("hidden", "weight", "bias")}
    token_split = False
    for md in range(len(w.placements)):
        hp, wp, lp = hid.placements[md], w.placements[md], lab.placements[md]
        bp = bias.placements[md] if bias is not None else None
        if md == v:
            if not (hp.is_replicate() or hp.is_partial()):
                raise _refuse("hidden", "Replicate() on the vocabulary's mesh dim", show(hp), md,
                              why="every rank of the vocabulary split needs all of the tokens: all-gather them first "
                                  "with hidden.redistribute(placements=...) (what ColwiseParallel does with a "
                                  "sequence-parallel input), or split the tokens over another mesh dim")
            if not lp.is_replicate():
                raise _refuse("labels", "Replicate() on the vocabulary's mesh dim", show(lp), md,
                              why="labels go with hidden, which every rank of the vocabulary split holds whole")
            if bp is not None and not (bp.is_replicate() or bp.is_partial() or bp == Shard(0)):
                raise _refuse("bias", "Shard(0) (with the weight's rows) or Replicate()", show(bp), md)
            ins["hidden"].append(R)
            ins["weight"].append(Shard(0))
            ins["labels"].append(R)
            if bp is not None:
                ins["bias"].append(Shard(0))
            loss.append(R)
            lse.append(R)
            grads["hidden"].append(Partial())
            grads["weight"].append(Shard(0))
            grads["bias"].append(Shard(0))
            continue
        if not (wp.is_replicate() or wp.is_partial()):
            raise _refuse("weight", "Replicate() off the vocabulary's mesh dim", show(wp), md,
                          why=f"the vocabulary is split over mesh dim {v}; a split of the hidden dim makes the logits "
                              "partial sums, and cross entropy is not linear in them")
        if bp is not None and not (bp.is_replicate() or bp.is_partial()):
            raise _refuse("bias", "Replicate() off the vocabulary's mesh dim", show(bp), md)
        d = None
        if _plain_shard(hp):
            d = hp.dim % len(hid.shape)
            if d == last:
                raise _refuse("hidden", f"Replicate() or Shard(d) for d < {last} (tokens)", show(hp), md,
                              why="a split hidden dim makes the logits partial sums")
        elif not (hp.is_replicate() or hp.is_partial()):
            raise _refuse("hidden", f"Replicate() or Shard(d) for d < {last} (tokens)", show(hp), md)
        want = R if d is None else Shard(d)
        if lp != want and not lp.is_replicate():
            raise _refuse("labels", f"{show(want)} (as hidden)", show(lp), md)
        ins["hidden"].append(want)
        ins["weight"].append(R)
        ins["labels"].append(want)
        if bp is not None:
            ins["bias"].append(R)
        token_split = token_split or d is not None
        lse.append(want)
        loss.append(want if reduction == "none" else (R if d is None else Partial()))
        grads["hidden"].append(want)
        grads["weight"].append(R if d is None else Partial())
        grads["bias"].append(R if d is None else Partial())
    if token_split and reduction == "mean":
        raise ShardingError(OP, "reduction", "'sum' or 'none' when the tokens are sharded",
                            repr("mean") + " (each rank would divide by its own count of non-ignored tokens; use "
                            "reduction='sum' and divide by (labels != ignore_index).sum() over all tokens)")
    return VocabPlan(v, {n: tuple(p) for n, p in ins.items()}, tuple(loss), tuple(lse),
                     {n: tuple(p) for n, p in grads.items()})


def local_vocab(weight: DTensor) -> tuple[int, int]:
    """(this rank's first vocabulary row, its row count) of a vocab-split weight (uneven splits included)."""
    shape, offset = compute_local_shape_and_global_offset(weight.shape, weight.device_mesh, weight.placements)
    return offset[0], shape[0]


# ---- the local computation ---------------------------------------------------------------------------------------
def combine(gathered: Tensor, world: int) -> tuple[Tensor, Tensor, Tensor]:
    """Every rank's (3, N) statistics, stacked (3 * world, N), into the global (lse, target logit, logit sum)."""
    g = gathered.view(world, 3, -1)
    return torch.logsumexp(g[:, 0], 0), g[:, 1].sum(0), g[:, 2].sum(0)


def _row_grads(grad, labels, ignore_index, reduction, adt):
    if reduction == "none":
        g = grad.reshape(-1).to(adt)
    else:
        g = grad.to(adt).expand(labels.shape[0])
        if reduction == "mean":
            g = g / (labels != ignore_index).sum().to(adt)
    return torch.where(labels != ignore_index, g, torch.zeros_like(g))


def stats_grads(rg, lse, stats, eps, z_loss, vocab) -> Tensor:
    """The gradients (3, N) of this shard's (lse_r, target logit, logit sum) for per-token loss gradients rg (0 where
    ignored): d loss / d lse_r = rg (1 + 2 z_loss lse) exp(lse_r - lse) (so the kernel's softmax over the shard
    becomes the global one), d / d z_y = -(1 - eps) rg, d / d sum z = -eps / V rg."""
    g = torch.empty((3, rg.shape[0]), dtype=rg.dtype, device=rg.device)
    torch.mul(rg * (1.0 + 2.0 * z_loss * lse), torch.exp(stats[0] - lse), out=g[0])   # (lse_r = -inf: 0)
    torch.mul(rg, -(1.0 - eps), out=g[1])
    torch.mul(rg, -eps / vocab, out=g[2])
    return g


class _VocabParallelCE(torch.autograd.Function):
    """The loss of this rank's tokens against the whole vocabulary, from its shard of the weight (local tensors)."""

    @staticmethod
    def forward(ctx, h, w, b, labels, group, world, start, vocab, ignore_index, eps, reduction, z_loss, softcap):
        stats = linear_cross_entropy_stats(h, w, labels, bias=b, ignore_index=ignore_index, softcap=softcap,
                                           vocab_start=start)
        gathered = funcol.wait_tensor(_all_gather(stats.contiguous(), 0, group))
        lse, tgt, zsum = combine(gathered, world)
        per = (1.0 - eps) * (lse - tgt)
        if eps:
            per = per + eps * (lse - zsum / vocab)
        if z_loss:
            per = per + z_loss * lse * lse
        valid = labels != ignore_index
        per = torch.where(valid, per, torch.zeros_like(per))
        if reduction == "none":
            loss = per
        else:
            loss = per.sum()
            if reduction == "mean":
                loss = loss / valid.sum()           # (no valid token: nan, as torch)
        ctx.save_for_backward(h, w, b, labels, lse, stats)
        ctx.args = (ignore_index, eps, reduction, z_loss, softcap, start, vocab)
        ctx.mark_non_differentiable(lse)
        return loss, lse

    @staticmethod
    def backward(ctx, grad, _grad_lse):
        h, w, b, labels, lse, stats = ctx.saved_tensors
        ignore_index, eps, reduction, z_loss, softcap, start, vocab = ctx.args
        rg = _row_grads(grad, labels, ignore_index, reduction, stats.dtype)
        n = labels.shape[0]
        post = 1.0
        if h.dtype == torch.float16 and reduction != "none" and n:
            # d logits of about softmax / n_valid underflow float16 (as the single-device impls: fold n, scale after)
            rg, post = rg * n, 1.0 / n
        dh, dw, db = stats_backward(stats_grads(rg, lse, stats, eps, z_loss, vocab), h, w, labels, b, stats,
                                    ignore_index, softcap, start)
        if post != 1.0:
            for t in (dh, dw, db):
                if t is not None:
                    t.mul_(post)
        needs = ctx.needs_input_grad
        return (dh if needs[0] else None, dw if needs[1] else None, db if needs[2] else None, *(None,) * 10)


def _local_shape(shape, mesh, placements) -> tuple[int, ...]:
    return tuple(compute_local_shape_and_global_offset(shape, mesh, list(placements))[0])


def _as_placed(name, t, mesh) -> _Placed | None:
    if t is None:
        return None
    if not isinstance(t, DTensor):
        raise InvalidArgumentError(OP, name, "a DTensor on the weight's device mesh (the weight is split over the "
                                   "vocabulary: DTensor.from_local(t, mesh, [Replicate()]) for a tensor every rank "
                                   "holds whole)", f"a plain {type(t).__name__}")
    if t.device_mesh != mesh:
        raise InvalidArgumentError(OP, name, f"a DTensor on the weight's mesh {mesh}", f"one on {t.device_mesh}")
    return _Placed(tuple(t.shape), tuple(t.placements))


def vocab_parallel(hidden, weight, labels, bias, ignore_index, label_smoothing, reduction, z_loss, softcap,
                   return_lse):
    """opsadv.ops.linear_cross_entropy on a weight split over its vocabulary (validated arguments); None when the
    weight has no vocabulary split (the call takes the op's DTensor rule, or no DTensor at all)."""
    if not is_vocab_split(weight):
        return None
    mesh = weight.device_mesh
    given = {"hidden": _as_placed("hidden", hidden, mesh), "weight": _as_placed("weight", weight, mesh),
             "labels": _as_placed("labels", labels, mesh), "bias": _as_placed("bias", bias, mesh)}
    p = plan(given, reduction)

    def placed(t, name):
        want = p.inputs[name]
        return t if tuple(t.placements) == want else t.redistribute(placements=want)

    h = placed(hidden, "hidden").to_local(grad_placements=p.grads["hidden"])
    w = placed(weight, "weight").to_local(grad_placements=p.grads["weight"])
    b = placed(bias, "bias").to_local(grad_placements=p.grads["bias"]) if bias is not None else None
    lab = placed(labels, "labels").to_local()
    start, _ = local_vocab(weight)
    lead = lab.shape
    loss, lse = _VocabParallelCE.apply(h.reshape(-1, h.shape[-1]), w, b, lab.reshape(-1), (mesh, p.vdim),
                                       mesh.size(p.vdim), start, weight.shape[0], ignore_index, label_smoothing,
                                       reduction, z_loss, softcap)
    tok_shape = tuple(labels.shape)
    stride = torch.empty(tok_shape, device="meta").stride()
    if reduction == "none":
        loss = DTensor.from_local(loss.reshape(lead), mesh, p.loss, run_check=False, shape=tok_shape, stride=stride)
    else:
        loss = DTensor.from_local(loss, mesh, p.loss, run_check=False, shape=(), stride=())
    if not return_lse:
        return loss
    lse = DTensor.from_local(lse.reshape(lead), mesh, p.lse, run_check=False, shape=tok_shape, stride=stride)
    return loss, lse


def explain_plan(hidden, weight, labels, bias, reduction, ignore_index=-100, softcap=None) -> tuple[tuple, dict, str]:
    """For opsadv.explain: the (args, kwargs) of the linear_cross_entropy_stats call this rank runs on its shards
    (zeros of the shard's shape where the call would redistribute an argument: explain does not communicate) and
    the placements text."""
    mesh = weight.device_mesh
    given = {"hidden": _as_placed("hidden", hidden, mesh), "weight": _as_placed("weight", weight, mesh),
             "labels": _as_placed("labels", labels, mesh), "bias": _as_placed("bias", bias, mesh)}
    p = plan(given, reduction)
    local = {}
    for n, t in (("hidden", hidden), ("weight", weight), ("labels", labels), ("bias", bias)):
        if t is None:
            continue
        if tuple(t.placements) == p.inputs[n]:
            local[n] = t.to_local()
        else:
            lt = t.to_local()
            local[n] = torch.zeros(_local_shape(t.shape, mesh, p.inputs[n]), dtype=lt.dtype, device=lt.device)
    text = p.describe({n: v.placements for n, v in given.items() if v is not None}, weight.shape[0],
                      mesh.size(p.vdim))
    start, _ = local_vocab(weight)
    kwargs = {"bias": local.get("bias"), "ignore_index": ignore_index, "softcap": softcap, "vocab_start": start}
    return (local["hidden"], local["weight"], local["labels"]), kwargs, text


STATS_OP = "linear_cross_entropy_stats"
NOTE = ("vocab-parallel: each rank runs linear_cross_entropy_stats on its shard of the weight (the table: its "
        "candidates for this rank's local shards; a Triton kernel where the device runs Triton, the torch reference "
        "elsewhere), all-gathers the three statistics per token and combines them in torch; the backward runs that "
        "op's backward against the global lse (opsadv/distributed/vocab_parallel.py)")


def install() -> None:
    install_vocab_parallel(vocab_parallel)
