"""swiglu_gemm's fused weight [W_g | W_u] laid out for column parallelism (opsadv.distributed.shard_gate_up)."""
from __future__ import annotations

from torch.distributed.tensor import DTensor, Replicate, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard


def gate_up_placement(dim: int = 1) -> _StridedShard:
    """[g | u] split in two halves first, then each half over the mesh dim: rank r holds [g_r | u_r]."""
    return _StridedShard(dim, split_factor=2)


def shard_gate_up(w_gate_up, mesh, mesh_dim: int = 0) -> DTensor:
    placements = [Replicate()] * mesh.ndim
    placements[mesh_dim] = gate_up_placement(1)
    if isinstance(w_gate_up, DTensor):
        return w_gate_up.redistribute(mesh, placements)
    return distribute_tensor(w_gate_up, mesh, placements)
