"""Host-side helpers of the Triton attention kernels (dense backward, sparse forward and backward): when tiles may
be loaded through TMA descriptors, the (b, h, s, d) descriptor they use, and two independent kernels launched
side by side on two streams."""
from __future__ import annotations

import functools

import torch

try:  # host-side TMA descriptors (Triton >= 3.4)
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover
    TensorDescriptor = None


@functools.lru_cache(maxsize=None)
def sm90_plus(device_index) -> bool:
    """Hopper or newer (TMA); read once per device.  Never on ROCm, whose MI300 reports capability 9.4."""
    return torch.version.hip is None and torch.cuda.get_device_capability(device_index) >= (9, 0)


def desc_ok(t: torch.Tensor) -> bool:
    """t addressable by a TMA descriptor: 16-byte aligned base and strides, unit stride along the last dim."""
    es = t.element_size()
    return t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and all(st * es % 16 == 0 for st in t.stride()[:-1])


def tma_tiles_ok(ctx, d: int, block_d: int, *ts: torch.Tensor) -> bool:
    """Tiles of ts loadable through (b, h, s, d) descriptors: host descriptors, an unpadded head dim,
    descriptor-addressable tensors, on Hopper or under the interpreter (which runs descriptor loads, so the CPU
    tests cover the path)."""
    if TensorDescriptor is None or d != block_d or not all(desc_ok(t) for t in ts):
        return False
    if ts[0].device.type == "cuda":
        return sm90_plus(ts[0].device.index)
    return bool(getattr(getattr(ctx, "env", None), "triton_interpret", False))


def desc_bhsd(t: torch.Tensor, rows: int) -> "TensorDescriptor":
    """A (b, h, s, d) descriptor of t loading (rows, d) tiles of one head (rows past s are zero)."""
    return TensorDescriptor(t, list(t.shape), list(t.stride()), [1, 1, rows, t.shape[-1]])


@functools.lru_cache(maxsize=None)
def side_stream(device: torch.device) -> "torch.cuda.Stream":
    """One side stream per device (created once: stream creation is not free)."""
    return torch.cuda.Stream(device)


def run_side_by_side(device: torch.device, first, second) -> None:
    """first() on the caller's stream and second() on a side stream, concurrently, for two kernels that share
    only inputs (a backward's dK/dV and dQ kernels).  Fork / join on the caller's stream, so CUDA-graph capture
    and the caching allocator see one order: the side stream waits for the caller's work before it starts and
    the caller waits for it before anything after this call."""
    main = torch.cuda.current_stream(device)
    side = side_stream(device)
    side.wait_stream(main)
    with torch.cuda.stream(side):
        second()
    first()
    main.wait_stream(side)
