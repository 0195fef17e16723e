"""opsadv.distributed: DTensor sharding rules and context parallelism (ring attention) on torch.distributed."""
from .ring_attention import ring_attention  # noqa: F401
from .ring_layout import zigzag_shard, zigzag_unshard  # noqa: F401
