"""Tensor parallelism as the fused modules see it.

torch's `parallelize_module` (ColwiseParallel / RowwiseParallel) and transformers' `tp_plan` shard a Linear's
parameters as DTensors and wrap its calls (hooks, or an instance forward) so that the Linear's input, output and
gradients take the plan's layouts.  A fused module computes several Linears in one GEMM and bypasses those wrappers,
so it serves one layout itself, the column-parallel one of q/k/v and gate/up in a Llama-style plan: every weight
(and bias) sharded on its output dim, Shard(0), over the same 1-D mesh, the input replicated; each rank then runs the
GEMM over the concatenation of its own row blocks ([q_r|k_r|v_r], [gate_r|up_r]: the same columns of each part), the
output is this rank's columns of every part (what ColwiseParallel hands on with use_local_output=True), and the
input's gradient, a partial sum on each rank, is all-reduced over the mesh (what ColwiseParallel's input DTensor does
in backward).  Anything else runs the original Linears, whose wrappers apply the plan.  A column-parallel lm_head
(its weight split over the vocabulary: vocab_split) is the lm_loss pass's: the fused loss runs vocab-parallel."""
from __future__ import annotations

import sys

import torch

_DT = "torch.distributed.tensor"


def is_dtensor(t) -> bool:
    # (no DTensor can exist before torch.distributed.tensor is imported: a dict lookup, not an import)
    return _DT in sys.modules and isinstance(t, sys.modules[_DT].DTensor)


def any_dtensor(module: torch.nn.Module) -> bool:
    return _DT in sys.modules and any(is_dtensor(p) for p in module.parameters())


def colwise_mesh(params):
    """The 1-D mesh when every tensor of `params` (None entries skipped) is a DTensor sharded on dim 0 of that one
    mesh (a ColwiseParallel Linear's weight and bias); else None."""
    if _DT not in sys.modules:
        return None
    Shard = sys.modules[_DT].Shard
    mesh = None
    for p in params:
        if p is None:
            continue
        if not is_dtensor(p) or p.device_mesh.ndim != 1 or p.placements != (Shard(0),):
            return None
        if mesh is None:
            mesh = p.device_mesh
        elif p.device_mesh != mesh:
            return None
    return mesh


def vocab_split(weight, bias=None) -> bool:
    """`weight` (V, H) is a DTensor split over its vocabulary on one mesh dim (Shard(0): ColwiseParallel on lm_head,
    transformers' colwise tp_plan) and replicated on any other, its bias (if any) the same: the head whose loss
    opsadv.ops.linear_cross_entropy computes vocab-parallel."""
    if not is_dtensor(weight):
        return False
    Shard = sys.modules[_DT].Shard
    ps = tuple(weight.placements)
    if sum(p == Shard(0) for p in ps) != 1 or not all(p == Shard(0) or p.is_replicate() for p in ps):
        return False
    return bias is None or (is_dtensor(bias) and bias.device_mesh == weight.device_mesh
                            and tuple(bias.placements) == ps)


def rowwise_on(weight, mesh) -> bool:
    """`weight` is a RowwiseParallel Linear's weight on `mesh`: sharded on its input dim (Shard(1))."""
    return is_dtensor(weight) and weight.device_mesh == mesh and weight.placements == (sys.modules[_DT].Shard(1),)


def local(t):
    """The rank's shard of a DTensor (differentiable: its gradient becomes the DTensor's), else t itself."""
    return t.to_local() if t is not None and is_dtensor(t) else t


class _AllReduceGrad(torch.autograd.Function):
    """x forward; backward, the sum of the ranks' gradients (each rank's is partial: its columns' share)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        torch.distributed.all_reduce(grad, group=ctx.group)
        return grad, None


def colwise_input(x: torch.Tensor, mesh) -> tuple[torch.Tensor, bool]:
    """(x as this rank's GEMM input, whether x came as a DTensor).  A DTensor input (a ColwiseParallel hook made it)
    is replicated first and its gradient marked partial, so the DTensor's own backward all-reduces it; a plain
    input is taken as replicated and its gradient all-reduced here."""
    if is_dtensor(x):
        Replicate, Partial = sys.modules[_DT].Replicate, sys.modules[_DT].Partial
        if x.device_mesh != mesh:
            raise ValueError(f"opsadv: a column-parallel projection got an input on mesh {x.device_mesh}, its weights "
                             f"are on {mesh}")
        if x.placements != (Replicate(),):
            x = x.redistribute(placements=[Replicate()])
        return x.to_local(grad_placements=[Partial()]), True
    if torch.is_grad_enabled() and x.requires_grad and mesh.size() > 1:
        x = _AllReduceGrad.apply(x, mesh.get_group())
    return x, False


def input_key(x: torch.Tensor) -> tuple:
    """What identifies the tensor a projection was called with (held: it stays alive while compared): x itself;
    for a DTensor, the local tensor a ColwiseParallel hook wrapped (each hook call wraps it in a fresh view, so:
    the view's base and geometry, and the placements)."""
    if not is_dtensor(x):
        return (x,)
    lt = x._local_tensor
    base = lt._base if lt._base is not None else lt
    return (base, lt.storage_offset(), tuple(lt.shape), lt.stride(), tuple(x.placements))


def same_input(a: tuple, b: tuple) -> bool:
    return len(a) == len(b) and a[0] is b[0] and a[1:] == b[1:]


def colwise_output(out: torch.Tensor, mesh, width: int, as_dtensor: bool) -> torch.Tensor:
    """This rank's output columns as the caller expects them: plain (ColwiseParallel's use_local_output=True, or no
    hook), or a DTensor sharded on its last dim with the projection's full width (a ColwiseParallel hook
    redistributes it as the plan says)."""
    if not as_dtensor:
        return out
    DTensor, Shard = sys.modules[_DT].DTensor, sys.modules[_DT].Shard
    shape = (*out.shape[:-1], width)
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(out, mesh, [Shard(out.dim() - 1)], run_check=False, shape=shape, stride=stride)


def _fsdp_class():
    fsdp = sys.modules.get("torch.distributed.fsdp")
    return getattr(fsdp, "FSDPModule", None) if fsdp is not None else None


def is_fsdp_module(module: torch.nn.Module) -> bool:
    """`module` was wrapped by FSDP2's fully_shard (its class is then an FSDPModule)."""
    cls = _fsdp_class()
    return cls is not None and isinstance(module, cls)


def fsdp_managed(module: torch.nn.Module) -> bool:
    """`module` or a submodule was wrapped by FSDP2's fully_shard."""
    cls = _fsdp_class()
    return cls is not None and any(isinstance(m, cls) for m in module.modules())
