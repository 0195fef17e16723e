"""`import opsadv` makes attn_implementation="opsadv" available in transformers without importing transformers
itself: registered when transformers' modeling code loads (before or after opsadv).  Each case runs in a fresh
interpreter (the registration is process state)."""
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("transformers")

BUILD = """
import torch
from transformers import LlamaConfig, LlamaForCausalLM
cfg = LlamaConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=1, vocab_size=64, attn_implementation="opsadv")
m = LlamaForCausalLM(cfg).eval()
with opsadv.use_backend("reference"), opsadv.trace() as t, torch.no_grad():
    m(torch.randint(0, 64, (1, 5)))
assert m.config._attn_implementation == "opsadv", m.config._attn_implementation
assert t.counts.get("reference.flash_attention") == 1, t.counts
print("ok")
"""


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("order", ["opsadv first", "transformers first"])
def test_attn_implementation_opsadv_just_works(order):
    head = ("import sys, opsadv\nassert 'transformers' not in sys.modules\n" if order == "opsadv first"
            else "import transformers.modeling_utils\nimport opsadv\n")
    r = _run(head + BUILD)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]


def test_import_opsadv_alone_leaves_transformers_unloaded():
    r = _run("import sys, opsadv\nprint('transformers' in sys.modules, any(type(f).__name__ == '_Finder' "
             "for f in sys.meta_path))")
    assert r.returncode == 0 and r.stdout.split() == ["False", "True"], r.stderr[-2000:]
