"""FlashInfer as the decode suite's serving peer: BatchDecodeWithPagedKVCacheWrapper over the same paged cache.

FlashInfer is optional and never a dependency: where `import flashinfer` fails (not installed, no CUDA) the suite
runs without this peer and says why once.  FlashInfer compiles its kernels with the host's nvcc on first use
(JIT, ~30 s per kernel family); the arch list defaults to the GPU's own ("9.0a" on Hopper) so that build is for
this GPU alone.

Layout: our cache is (pages, page_size, Hkv, D) per K and V, FlashInfer's "NHD" paged layout; the block table
becomes FlashInfer's CSR page list (indptr, indices, last_page_len).  plan() runs at setup (FlashInfer's serving
loop plans once per step and reuses it across layers); the timed call is run() alone."""
from __future__ import annotations

import os
from typing import Callable

import torch

WORKSPACE_BYTES = 128 << 20          # FlashInfer's float workspace for split-KV partials (its examples' size)
_state: dict = {}                    # "module" / "why" (import outcome), "workspace" (one per process)


def _import():
    if "module" not in _state:
        try:
            if torch.cuda.is_available():
                major, minor = torch.cuda.get_device_capability()
                arch = f"{major}.{minor}" + ("a" if major >= 9 else "")
                os.environ.setdefault("FLASHINFER_CUDA_ARCH_LIST", arch)
            import flashinfer                                    # noqa: PLC0415 - optional peer
            _state["module"], _state["why"] = flashinfer, None
        except Exception as e:  # noqa: BLE001 - any import failure means "no peer", reported by why_missing()
            _state["module"], _state["why"] = None, f"{type(e).__name__}: {e}"
    return _state["module"]


def why_missing() -> str | None:
    """None where FlashInfer imports, else why not."""
    _import()
    return _state["why"]


def version() -> str | None:
    fi = _import()
    return getattr(fi, "__version__", None) if fi is not None else None


def csr_pages(table: torch.Tensor, lens: torch.Tensor, page: int):
    """FlashInfer's page list for a block table (b, pages_per_seq) and seqlens_k (b,): (indptr (b+1,),
    indices (used pages, in order), last_page_len (b,)), all int32.  A sequence of length 0 holds no page."""
    used = (lens.long() + page - 1) // page
    indptr = torch.zeros(table.shape[0] + 1, dtype=torch.int32, device=table.device)
    indptr[1:] = torch.cumsum(used, 0).to(torch.int32)
    cols = torch.arange(table.shape[1], device=table.device)
    indices = table[cols[None, :] < used[:, None]].to(torch.int32).contiguous()
    last = torch.where(used > 0, lens.long() - (used - 1) * page, torch.zeros_like(used)).to(torch.int32)
    return indptr, indices, last


def decode_peer(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, table: torch.Tensor, lens: torch.Tensor,
                *, tensor_cores: bool = False, k_scale: float | None = None,
                v_scale: float | None = None) -> Callable | None:
    """A call of FlashInfer's paged decode (its "fa2" backend) for q (b, 1, Hq, D) over (kc, vc) (pages, page, Hkv,
    D), returning (b, Hq, 1, D) as the suite's other peers do; None where FlashInfer is missing.  tensor_cores:
    its prefill kernel serves the decode (FlashInfer's advice for GQA groups of 4 and more).  An fp8 cache takes
    per-tensor k_scale / v_scale (FlashInfer's scales are scalars)."""
    fi = _import()
    if fi is None or not q.is_cuda:
        return None
    if "workspace" not in _state:
        _state["workspace"] = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=q.device)
    b, _, hq, d = q.shape
    _, page, hkv, _ = kc.shape
    indptr, indices, last = csr_pages(table, lens, page)
    try:
        wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(_state["workspace"], "NHD", use_tensor_cores=tensor_cores,
                                                   backend="fa2")
        wrapper.plan(indptr, indices, last, hq, hkv, d, page, pos_encoding_mode="NONE", q_data_type=q.dtype,
                     kv_data_type=kc.dtype, o_data_type=q.dtype)
    except Exception as e:        # a shape it does not serve (its CUDA-core decode: GQA groups up to 8): the
        err = e                   # runner records the peer's error for this case; the suite goes on

        def refused():
            raise err
        return refused
    q3 = q.reshape(b, hq, d)
    scales = {} if k_scale is None else {"k_scale": k_scale, "v_scale": v_scale}

    def run():
        return wrapper.run(q3, (kc, vc), **scales).unsqueeze(2)
    return run
