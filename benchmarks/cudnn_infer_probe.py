"""Why was the dispatcher 0.964x SDPA-cuDNN at fwd bf16 b16 h32 s1024 d128 (session 9 suite), when it runs
the same cuDNN kernel?  Times, interleaved (benchmarks' time_interleaved, 5 rounds), at that shape and two
others: SDPA with the cuDNN backend forced (the peer), aten's cuDNN op called directly with and without
the lse (what cuda.sdpa.cudnn runs), the impl's inference forward called directly, and opsadv's op under
no_grad (dispatch included).  Also once with the scale given explicitly to SDPA (ours passes d**-0.5).

    PYTHONPATH=. python3 benchmarks/cudnn_infer_probe.py OUT.json
"""
from __future__ import annotations

import json
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from _probe_log import warm_and_time  # (benchmarks/ is sys.path[0] when run as a script)

import opsadv
from opsadv.registry import get_registry

A = torch.ops.aten


def main(path: str) -> None:
    impl = next(i for i in get_registry().impls_by_op["flash_attention"] if i.id == "cuda.sdpa.cudnn")
    res = {"torch": torch.__version__, "cudnn": torch.backends.cudnn.version(), "cases": []}
    for b, s, d, causal in [(16, 1024, 128, False), (16, 1024, 128, True), (4, 4096, 128, False)]:
        torch.manual_seed(0)
        q, k, v = (torch.randn(b, 32, s, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        scale = d ** -0.5

        def peer():
            with torch.no_grad(), sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

        def peer_scale():
            with torch.no_grad(), sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)

        def aten_nolse():
            return A._scaled_dot_product_cudnn_attention(q, k, v, None, False, 0.0, causal, False, scale=scale)[0]

        def aten_lse():
            return A._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False, scale=scale)[0]

        def impl_infer():
            return impl.inference(None, q, k, v, None, causal, scale)[0]

        def op():
            with torch.no_grad():
                return opsadv.ops.flash_attention(q, k, v, causal=causal)

        fns = dict(peer=peer, peer_scale=peer_scale, aten_nolse=aten_nolse, aten_lse=aten_lse,
                   impl_infer=impl_infer, op=op)
        times = warm_and_time(fns)
        with opsadv.trace() as t:
            op()
        row = {"b": b, "s": s, "d": d, "causal": causal, "op_impls": dict(t.counts),
               "ms": {n: round(v, 5) for n, v in times.items()}}
        print(row, flush=True)
        res["cases"].append(row)
    with open(path, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "cudnn_infer_probe.json")
