"""CPU accounting of what mem_opt=3's release of norm / embedding outputs (opsadv/convert/release.py) does to
the activation peak of a Llama prefill, without a GPU: torch.profiler's memory timeline (tensor create /
destroy events of the forward, weights excluded) gives the peak of live activation bytes, the quantity
torch.cuda.max_memory_allocated measures on a GPU minus the resident weights.

Two peaks per row: the whole forward's, and the one while transformers' rotary step runs (where the H200
trace of session 5 put the converted model's peak; see peaks_mib for why the overall CPU peak is elsewhere).

Llama-1.1B's widths (hidden 2048, 32 heads, 4 KV heads, intermediate 5632) with 2 layers, b1, float32 on CPU
(one hidden state = s * 2048 * 4 bytes), last-token logits, use_cache=False.  Attention runs through
F.scaled_dot_product_attention in both models (the reference backend's oracle materializes the score
matrix, which no GPU kernel does; the stand-in returns a zero lse, unused without gradients).  Rows:
transformers sdpa, converted mem_opt=3 with the releases, and the same model with the releases held off.

    PYTHONPATH=. python3 benchmarks/release_memory_cpu.py [--seq 2048] [--out PATH]
"""
from __future__ import annotations

import argparse
import copy
import json

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile
from torch.profiler._memory_profiler import Action

import opsadv
from opsadv.backends.reference import kernels as ref_kernels
from opsadv.convert import release

LLAMA = dict(hidden_size=2048, num_hidden_layers=2, num_attention_heads=32, num_key_value_heads=4,
             intermediate_size=5632, vocab_size=32000, max_position_embeddings=8192)


def peaks_mib(fn) -> tuple[float, float]:
    """(peak of live bytes created during fn, peak while transformers' apply_rotary_pos_emb runs): tensors
    that existed before are not counted.  The second is where the H200 trace put the converted model's
    peak; on CPU the overall peak sits in the reference backend's SwiGLU oracle (float32 temporaries of
    x @ [W_gate|W_up] per row chunk), which the GPU's fused kernels do not have."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True) as p:
        fn()
    t0 = p.profiler.kineto_results.trace_start_ns()
    rotary = [(e.time_range.start, e.time_range.end) for e in p.events() if e.name.endswith("apply_rotary_pos_emb")]
    cur = peak = rot = 0
    for t, action, _, size in p._memory_profile().timeline:
        if action == Action.CREATE:
            cur += size
        elif action == Action.DESTROY:
            cur -= size
        peak = max(peak, cur)
        us = (t - t0) / 1000
        if any(a <= us <= b for a, b in rotary):
            rot = max(rot, cur)
    return peak / 2 ** 20, rot / 2 ** 20


def sdpa_attention_fwd(ctx, q, k, v, attn_mask, causal, scale):
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=causal and attn_mask is None,
                                         scale=scale, enable_gqa=k.shape[1] != q.shape[1])
    return out, q.new_zeros(q.shape[:3], dtype=torch.float32)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    import transformers as tf
    # before the registry is built (the reference plugin binds its functions when it registers): both
    # models attend through a kernel that keeps no score matrix; validation compares against hf as usual
    ref_kernels.attention_fwd = sdpa_attention_fwd
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(**LLAMA)
    cfg._attn_implementation = "sdpa"
    base = tf.LlamaForCausalLM(cfg).eval()
    conv = opsadv.convert_model(copy.deepcopy(base), mem_opt=3,
                                example_inputs={"input_ids": torch.randint(0, 32000, (2, 64))})
    ids = torch.randint(0, 32000, (1, a.seq))

    def call(m):
        def f():
            with torch.no_grad():
                return m(input_ids=ids, use_cache=False, logits_to_keep=1).logits
        return f

    hidden_mib = a.seq * LLAMA["hidden_size"] * 4 / 2 ** 20
    rows = {"hf_sdpa": peaks_mib(call(base))}
    rels = release.releases(conv)
    before = sum(r.released for r in rels)
    rows["opsadv_mem_opt3"] = peaks_mib(call(conv))
    freed = sum(r.released for r in rels) - before
    for r in rels:
        r.min_bytes = float("inf")                   # hold the releases off
    rows["opsadv_mem_opt3_no_release"] = peaks_mib(call(conv))
    for r in rels:
        r.min_bytes = release.MIN_RELEASE_BYTES
    with torch.no_grad():
        err = ((call(conv)() - call(base)()).norm() / call(base)().norm()).item()
    res = {"seq": a.seq, "hidden_state_mib": hidden_mib,
           "peak_act_mib": {k: round(v[0], 1) for k, v in rows.items()},
           "rotary_step_act_mib": {k: round(v[1], 1) for k, v in rows.items()},
           "rotary_step_in_hidden_states": {k: round(v[1] / hidden_mib, 2) for k, v in rows.items()},
           "outputs_freed_per_call": freed, "rel_err_vs_hf": err, "torch": torch.__version__}
    print(json.dumps(res, indent=1))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
