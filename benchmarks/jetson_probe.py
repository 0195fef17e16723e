"""Memory probe for the jetson profile and run_batched (no Jetson here: runs on any CUDA GPU with
use_backend("cuda", profile="jetson"), which forces the memory-frugal profile).

Cases (Llama architecture ~1.1B, random weights, bf16, last-token logits, use_cache=False):
  1. prefill b1 s8192: peak activation memory (max_memory_allocated minus resident weights) of the
     transformers model with attn_implementation="sdpa" (eager) vs the same model converted by
     opsadv.convert_model under the jetson profile; logits compared; times.
  2. prefill b8 s2048 through opsadv.runtime.run_batched with a memory budget: measured peak vs
     the budget, result vs the unbatched call; max_streams 1 / 2 / 4 timed (does pipelining pay?).
  3. the same with many small chunks (b32 s256), where a single stream leaves the GPU idle between
     launches, to give streams their best chance.

  PYTHONPATH=. python3 benchmarks/jetson_probe.py [--json PATH] [--tiny] [--prefill-only] [--seq N]
--tiny: a 2-layer model on CPU under TRITON_INTERPRET=1 (fp16), to exercise the code paths without a
GPU (no memory figures there).  Rows are written to the JSON after every case (default
$OUT/jetson_probe.json, else ./jetson_probe.json); benchmarks/merge_bench.py merges them into the GPU's results file."""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import subprocess
import sys
import time
import traceback

ap = argparse.ArgumentParser()
ap.add_argument("--json", default=None)
ap.add_argument("--tiny", action="store_true")
ap.add_argument("--seq", type=int, default=8192)
ap.add_argument("--prefill-only", action="store_true", help="only case 1 (the peak-activation case)")
ARGS = ap.parse_args()
if ARGS.tiny:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

import opsadv  # noqa: E402
from opsadv.runtime import run_batched  # noqa: E402

MIB = 1 << 20
DEV = "cpu" if ARGS.tiny else "cuda"
CUDA = DEV == "cuda"
DT = torch.float16 if ARGS.tiny else torch.bfloat16
OUT = ARGS.json or (os.path.join(os.environ["OUT"], "jetson_probe.json") if os.environ.get("OUT")
                    else "jetson_probe.json")


def header() -> dict:
    commit = os.environ.get("OPSADV_COMMIT", "")
    if not commit:                  # the GPU host has no .git: OPSADV_COMMIT says what was measured
        try:
            commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                    text=True).stdout.strip()
        except OSError:
            commit = ""
    import transformers
    try:
        import triton
        tv = triton.__version__
    except ImportError:
        tv = None
    return {"device": torch.cuda.get_device_name(0) if CUDA else "cpu (TRITON_INTERPRET=1)", "torch": torch.__version__,
            "triton": tv, "transformers": transformers.__version__, "commit": commit,
            "date": datetime.date.today().isoformat(), "cases": []}


DATA = header()


def save(row: dict) -> None:
    DATA["cases"].append(row)
    os.makedirs(os.path.dirname(os.path.abspath(OUT)), exist_ok=True)
    with open(OUT, "w") as f:
        json.dump(DATA, f, indent=1)
    print(json.dumps(row), flush=True)


def rel(a, b) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def sync():
    if CUDA:
        torch.cuda.synchronize()


def mib(n):
    return None if n is None else round(n / MIB, 1)


def measure(fn, reps: int = 7):
    """(result, peak bytes above what was allocated before, median ms)."""
    gc.collect()
    if CUDA:
        torch.cuda.empty_cache()
        sync()
        torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated() if CUDA else 0
    with torch.no_grad():
        out = fn()
    sync()
    peak = torch.cuda.max_memory_allocated() - before if CUDA else None
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        with torch.no_grad():
            fn()
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    return out, peak, sorted(times)[len(times) // 2]


def build_model():
    import transformers
    if ARGS.tiny:
        cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    else:   # ~1.10B parameters (TinyLlama shape)
        cfg = transformers.LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632,
                                       num_hidden_layers=22, num_attention_heads=32, num_key_value_heads=4,
                                       max_position_embeddings=max(ARGS.seq, 8192))
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(DT)
    try:
        with torch.device(DEV):
            model = transformers.LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(prev)
    return model.eval(), cfg


def last_logits(model, **kw):
    return lambda: model(**kw, use_cache=False, logits_to_keep=1).logits[:, -1]


def attention_only_fallback(model):
    """Without convert_model: route attention through opsadv.ops.flash_attention (unpadded, causal)."""
    from transformers import AttentionInterface

    def opsadv_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kw):
        out = opsadv.ops.flash_attention(query, key, value, causal=True, scale=scaling)
        return out.transpose(1, 2).contiguous(), None

    AttentionInterface.register("opsadv_probe", opsadv_attention)
    model.set_attn_implementation("opsadv_probe")
    return model, "attention only (AttentionInterface)"


def case_prefill(model, cfg):
    seq = 128 if ARGS.tiny else ARGS.seq
    ids = torch.randint(0, cfg.vocab_size, (1, seq), device=DEV)
    sync()
    weights = torch.cuda.memory_allocated() if CUDA else None
    ref, hf_peak, hf_ms = measure(last_logits(model, input_ids=ids))
    backend = opsadv.use_backend("cuda", profile="jetson")
    how = "opsadv.convert_model"
    try:
        if not hasattr(opsadv, "convert_model"):
            raise AttributeError("opsadv.convert_model does not exist")
        model, unpadded = convert(model, ids, mem_opt=3)
        how += " (validated on unpadded inputs)" if unpadded else ""
        report = str(getattr(model, "opsadv_report", ""))
    except Exception as e:
        traceback.print_exc()
        report = f"convert_model failed ({type(e).__name__}: {e}); "
        model, how = attention_only_fallback(model)
    gc.collect()
    if CUDA:
        torch.cuda.empty_cache()
    resident = torch.cuda.memory_allocated() if CUDA else None
    from opsadv.convert.release import releases
    rels = releases(model)
    before = [(r.released, r.kept) for r in rels]
    with opsadv.trace() as tr:
        got, peak, ms = measure(last_logits(model, input_ids=ids))
    freed = {"released": sum(r.released - b[0] for r, b in zip(rels, before)),
             "kept": sum(r.kept - b[1] for r, b in zip(rels, before)), "installed": len(rels)}
    attn = [k for k in tr.counts if "attention" in k]
    cuda_ms, cuda_peak = cuda_profile_reference(cfg, ids, ref)
    save({"suite": "e2e", "case": f"prefill {str(DT)[6:]} b1 s{seq} llama jetson", "profile": backend.profile,
          "opsadv_impl": attn[0] if attn else None, "impls": dict(tr.counts), "path": how,
          "opsadv_ms": round(ms, 2), "peers": {"hf_sdpa": round(hf_ms, 2)}, "unit": "ms",
          # the same model converted under the default (cuda) profile, default mem_opt: what the frugal
          # profile costs in time and saves in memory (issue 8: "time reported against the cuda profile")
          "cuda_profile_ms": cuda_ms, "cuda_profile_peak_act_mib": cuda_peak,
          "rel_err": rel(got, ref), "peak_act_mib": mib(peak), "hf_sdpa_peak_act_mib": mib(hf_peak),
          "weights_mib": mib(weights), "resident_after_convert_mib": mib(resident),
          "freed_outputs": freed,     # opsadv.convert.release over all timed calls
          "note": "peak_act = max_memory_allocated during the call minus memory allocated before it "
                  "(weights + inputs); use_cache=False; logits_to_keep=1", "report": report[-2000:]})
    return model


def convert(model, ids, **kw):
    """(converted model, validated on unpadded inputs?): convert_model, and when its padded validation batch
    finds no kernel (e.g. a bool mask on the interpreter's CPU tensors), again with unpadded example inputs."""
    try:
        return opsadv.convert_model(model, **kw), False
    except Exception as e:
        print(f"convert_model with padded validation inputs failed: {type(e).__name__}: {e}", file=sys.stderr)
        return opsadv.convert_model(model, example_inputs={"input_ids": ids[:, :64].repeat(2, 1)}, **kw), True


def cuda_profile_reference(cfg, ids, ref):
    """(ms, peak activation MiB) of a fresh copy of the model converted under the cuda profile (default
    mem_opt); its logits must match transformers' too.  (None, None) when that conversion fails."""
    try:
        model, _ = build_model()
        with opsadv.use_backend("cuda"):
            model, _ = convert(model, ids)
            got, peak, ms = measure(last_logits(model, input_ids=ids))
        err = rel(got, ref)
        if err > 0.05:
            print(f"cuda profile logits differ from transformers: rel_err {err:.3g}", file=sys.stderr)
        del model
        gc.collect()
        if CUDA:
            torch.cuda.empty_cache()
        return round(ms, 2), mib(peak)
    except Exception:
        traceback.print_exc()
        return None, None


def case_batched(model, cfg, batch, seq, budget_frac, streams_list, tag):
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), device=DEV)
    inputs = {"input_ids": ids, "use_cache": False, "logits_to_keep": 1}
    full, full_peak, full_ms = measure(lambda: model(**inputs).logits[:, -1])
    budget = int(full_peak * budget_frac) if full_peak else 64 * MIB
    rows = []
    for ns in streams_list:
        st: dict = {}
        fn = lambda: run_batched(lambda **kw: model(**kw).logits[:, -1], inputs,  # noqa: E731
                                 memory_budget=budget, max_streams=ns, stats=st)
        got, outer_peak, ms = measure(fn)
        within = st.get("peak_bytes") is not None and st["peak_bytes"] <= budget
        row = {"suite": "e2e", "case": f"prefill {str(DT)[6:]} b{batch} s{seq} llama jetson run_batched "
                                       f"streams{ns} {tag}",
               "opsadv_ms": round(ms, 2), "peers": {"unbatched": round(full_ms, 2)}, "unit": "ms",
               "rel_err": rel(got, full), "budget_mib": mib(budget), "peak_act_mib": mib(st.get("peak_bytes")),
               "unbatched_peak_act_mib": mib(full_peak), "within_budget": within, "chunks": st.get("chunks"),
               "retries": st.get("retries"), "fitted_bytes_per_sample_mib": mib(st.get("bytes_per_sample")),
               "fitted_fixed_mib": mib(st.get("fixed_bytes")), "max_streams": ns, "streams": st.get("streams"),
               "reserved_mib": mib(torch.cuda.memory_reserved()) if CUDA else None,
               "note": "peak_act from run_batched's per-chunk max_memory_allocated windows (it resets peak stats per "
                       "chunk); budget = " + (f"{budget_frac:.0%} of the unbatched peak" if full_peak else "64 MiB")}
        save(row)
        rows.append(row)
    if len(rows) > 1:
        base = rows[0]["opsadv_ms"]
        save({"suite": "e2e", "case": f"streams verdict b{batch} s{seq} {tag}",
              "speedup_vs_1_stream": {r["max_streams"]: round(base / r["opsadv_ms"], 3) for r in rows},
              "pays": any(base / r["opsadv_ms"] > 1.05 for r in rows[1:])})


def main():
    model, cfg = build_model()
    model = case_prefill(model, cfg)
    if ARGS.prefill_only:
        return
    if ARGS.tiny:
        case_batched(model, cfg, 6, 32, 0.5, (1, 2), "tiny")
        return
    for args in ((8, 2048, 0.4, (1, 2, 4), "budget40%"), (32, 256, 0.25, (1, 2, 4), "small-chunks")):
        try:
            case_batched(model, cfg, *args)
        except Exception as e:
            traceback.print_exc()
            save({"suite": "e2e", "case": f"run_batched {args}", "error": f"{type(e).__name__}: {e}"})


if __name__ == "__main__":
    try:
        main()
    finally:
        print(f"wrote {OUT}", file=sys.stderr)
