"""Optimizer.compile / export -> .pt2 whose graph calls opsadv::* ops; opsadv.load in a fresh
process (torch.export.load: no pickled code) gives the same outputs."""
import json
import os
import subprocess
import sys

import pytest
import torch

import opsadv
from opsadv.convert.export import opsadv_op_counts

transformers = pytest.importorskip("transformers")
from transformers import BertConfig, BertModel, LlamaConfig, LlamaForCausalLM  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _fresh_process_run(path, inputs: dict, out_path):
    code = (
        "import json, sys, torch, opsadv\n"
        "opsadv.use_backend('reference')\n"
        f"mod = opsadv.load({str(path)!r})\n"
        f"kw = {{k: torch.tensor(v) for k, v in json.loads({json.dumps(json.dumps({k: v.tolist() for k, v in inputs.items()}))}).items()}}\n"
        "out = mod(**kw)\n"
        "key = 'logits' if 'logits' in out else 'last_hidden_state'\n"
        f"torch.save(out[key], {str(out_path)!r})\n"
        "print('transformers' in sys.modules)\n")
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout.strip().splitlines()[-1], torch.load(out_path)


@pytest.mark.parametrize("arch", ["llama", "bert"])
def test_export_and_load_in_fresh_process(tmp_path, arch, reference_backend):
    torch.manual_seed(0)
    if arch == "llama":
        m = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, vocab_size=128)).eval()
    else:
        m = BertModel(BertConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                                 vocab_size=128)).eval()
    ids = torch.randint(0, 128, (2, 11))
    am = torch.ones(2, 11, dtype=torch.long)
    am[1, 8:] = 0
    x = {"input_ids": ids, "attention_mask": am}
    with torch.no_grad():
        out = m(**x)
    ref = out.logits if arch == "llama" else out.last_hidden_state
    path = tmp_path / f"{arch}.pt2"
    ep = opsadv.Optimizer(device="cpu", precision="fp32", opt_level=2).export(m, path, x)
    counts = opsadv_op_counts(ep)
    assert any("flash_attention" in k or "sparse_attention" in k for k in counts), counts
    assert any("gemm" in k for k in counts) and any("norm" in k for k in counts), counts
    assert path.exists() and m.opsadv_report.validation["passed"]
    loaded_tf, got = _fresh_process_run(path, x, tmp_path / "out.pt")
    assert loaded_tf == "False"             # the program loads without transformers being imported
    keep = am.bool()
    assert torch.allclose(got[keep], ref[keep], rtol=1e-4, atol=1e-5)


def test_optimizer_arguments():
    with pytest.raises(opsadv.errors.InvalidArgumentError, match="opt_level"):
        opsadv.Optimizer(opt_level=7)
    with pytest.raises(opsadv.errors.InvalidArgumentError, match="precision"):
        opsadv.Optimizer(precision="int4")
    assert "bf16" in repr(opsadv.Optimizer(device="cpu", precision="bf16"))


def test_optimizer_compile_casts_precision(reference_backend):
    torch.manual_seed(0)
    m = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                                     num_attention_heads=4, num_key_value_heads=2, vocab_size=128)).eval()
    c = opsadv.Optimizer(device="cpu", precision="fp16", opt_level=2, backend="reference").compile(m)
    assert next(c.parameters()).dtype == torch.float16
    v = c.opsadv_report.validation
    assert v["passed"] and v["limits"]["rel_err"] == 1e-2, v
