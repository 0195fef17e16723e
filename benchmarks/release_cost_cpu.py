"""Host cost of mem_opt=3 releases (opsadv/convert/release.py) on CPU: a 22-layer narrow Llama on the reference
backend, forward time (median of 20) with mem_opt=2, with the releases, and with them installed but never firing.
    python benchmarks/release_cost_cpu.py"""
import time, torch, transformers, opsadv
from opsadv.convert.release import releases
cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=22,
                               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
cfg._attn_implementation = "sdpa"
torch.manual_seed(0)
def run(mem_opt, min_bytes=None):
    m = transformers.LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, 256, (1, 256))
    m = opsadv.convert_model(m, mem_opt=mem_opt, example_inputs={"input_ids": ids})
    rels = releases(m)
    if min_bytes is not None:
        for r in rels: r.min_bytes = min_bytes
    f = lambda: m(input_ids=ids, use_cache=False, logits_to_keep=1)
    with torch.no_grad():
        for _ in range(3): f()
        ts = []
        for _ in range(20):
            t0 = time.perf_counter(); f(); ts.append(time.perf_counter() - t0)
    ts.sort()
    return ts[10] * 1e3, len(rels), sum(r.released for r in rels)
with opsadv.use_backend("reference"):
    print("mem_opt=2", run(2))
    print("mem_opt=3 releases", run(3, 0))
    print("mem_opt=3 releases never (min_bytes huge)", run(3, 1 << 60))
