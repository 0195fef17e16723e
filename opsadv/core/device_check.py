"""check_device: refuse a device this torch build / machine cannot use with one clear line (a raw
`torch.device("cuda")` on a CPU-only build fails deep inside torch with an AssertionError)."""
from __future__ import annotations

from .errors import InvalidArgumentError


def _why_unusable(dev) -> str | None:
    """None when tensors can live on `dev` here, else why not (with what to do instead)."""
    import torch
    t = dev.type
    if t in ("cpu", "meta"):
        return None
    if t == "cuda":
        if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
            return (f"a device this torch build can use: torch {torch.__version__} is built without CUDA "
                    "(install a CUDA build of torch, or use device 'cpu')")
        if not torch.cuda.is_available():
            return ("a device this machine has: torch sees no CUDA GPU (check the driver and CUDA_VISIBLE_DEVICES, "
                    "or use device 'cpu')")
        n = torch.cuda.device_count()
        if dev.index is not None and dev.index >= n:
            return f"a CUDA device index below {n} (the GPUs torch sees here), e.g. 'cuda:0'"
        return None
    if t == "npu":
        npu = getattr(torch, "npu", None)
        if npu is None:
            return "a device this torch build can use: torch_npu is not installed (pip install torch-npu), or 'cpu'"
        return None if npu.is_available() else "a device this machine has: torch_npu sees no NPU, or use 'cpu'"
    if t == "mps":
        return None if torch.backends.mps.is_available() else "a device this machine has: no MPS here, or use 'cpu'"
    mod = getattr(torch, t, None)
    avail = getattr(mod, "is_available", None)
    if callable(avail) and not avail():
        return f"a device this machine has: torch sees no {t} device, or use 'cpu'"
    return None


def check_device(device, where: str, arg: str = "device"):
    """`device` (str / torch.device / None) as a torch.device, or InvalidArgumentError naming `where`
    (e.g. "Optimizer") and why the device cannot be used here."""
    import torch
    if device is None:
        return None
    try:
        dev = device if isinstance(device, torch.device) else torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise InvalidArgumentError(where, arg, "a torch device such as 'cpu', 'cuda' or 'cuda:1'",
                                   repr(device)) from None
    why = _why_unusable(dev)
    if why is not None:
        raise InvalidArgumentError(where, arg, why, repr(str(device)))
    return dev
