"""opsadv.load refuses .pt2 archives whose entries torch.export would unpickle (issue 37 item 1)."""
import io
import json
import zipfile

import pytest
import torch
from torch import nn

import opsadv
from opsadv.errors import UnsafeArchiveError


class _Small(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.norm = nn.Linear(8, 8), nn.LayerNorm(8)

    def forward(self, x):
        return self.norm(self.lin(x))


class _WritesMarker:
    """Unpickling it creates `path` (stands for any code a pickle can run)."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


@pytest.fixture
def exported(tmp_path, reference_backend):
    torch.manual_seed(0)
    m = _Small().eval()
    x = torch.randn(2, 8)
    path = tmp_path / "small.pt2"
    opsadv.Optimizer(device="cpu").export(m, path, x)
    with torch.no_grad():
        return path, x, m(x)


def _rewrite(src, dst, edit):
    """Copy the zip archive `src` to `dst`, `edit(name, bytes)` returning each entry's new bytes."""
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_STORED) as zout:
        for info in zin.infolist():
            zout.writestr(info.filename, edit(info.filename, zin.read(info.filename)))


def _pickled_weight(src, dst, marker):
    """Mark the first weight use_pickle and make its payload a pickle that writes `marker`."""
    buf = io.BytesIO()
    torch.save(_WritesMarker(marker), buf)
    state = {}

    def edit(name, data):
        if name.endswith("data/weights/model_weights_config.json"):
            cfg = json.loads(data)
            fqn, meta = next(iter(cfg["config"].items()))
            meta["use_pickle"] = True
            state.update(fqn=fqn, file=meta["path_name"])
            return json.dumps(cfg).encode()
        return data

    _rewrite(src, dst, edit)
    tmp = dst.with_suffix(".tmp")
    _rewrite(dst, tmp, lambda n, d: buf.getvalue() if n.endswith("data/weights/" + state["file"]) else d)
    tmp.replace(dst)
    return state["fqn"]


def test_clean_archive_loads(exported):
    path, x, ref = exported
    mod = opsadv.load(path)
    assert torch.allclose(mod(x), ref, atol=1e-5)
    assert mod.exported_program is not None


def test_pickled_weight_is_refused_and_never_unpickled(exported, tmp_path):
    path, _, _ = exported
    marker = tmp_path / "pwned"
    bad = tmp_path / "bad.pt2"
    fqn = _pickled_weight(path, bad, marker)
    with pytest.raises(UnsafeArchiveError) as ei:
        opsadv.load(bad)
    assert fqn in str(ei.value) and "pickled weight" in str(ei.value)
    assert ei.value.entry.startswith(fqn)
    assert not marker.exists()


def test_torch_export_load_would_run_the_pickle(exported, tmp_path):
    """The tampered archive is a real threat: torch.export.load itself runs the pickle."""
    path, _, _ = exported
    marker = tmp_path / "pwned"
    bad = tmp_path / "bad.pt2"
    _pickled_weight(path, bad, marker)
    try:
        torch.export.load(str(bad))
    except Exception:
        pass                    # the loaded object is no tensor; the code already ran
    assert marker.exists()


@pytest.mark.parametrize("prefix,what", [("custom_obj_", "TorchScript"), ("opaque_obj_", "opaque pickled")])
def test_object_constants_are_refused(exported, tmp_path, prefix, what):
    path, _, _ = exported
    bad = tmp_path / "bad.pt2"

    def edit(name, data):
        if name.endswith("data/constants/model_constants_config.json"):
            return json.dumps({"config": {"obj": {"path_name": prefix + "0", "is_param": False,
                                                  "use_pickle": False, "tensor_meta": None}}}).encode()
        return data

    _rewrite(path, bad, edit)
    with pytest.raises(UnsafeArchiveError, match=what) as ei:
        opsadv.load(bad)
    assert ei.value.entry == f"obj ({prefix}0)"


def test_sample_inputs_beyond_tensors_are_refused(exported, tmp_path):
    path, _, _ = exported
    marker = tmp_path / "pwned"
    bad = tmp_path / "bad.pt2"
    buf = io.BytesIO()
    torch.save(_WritesMarker(marker), buf)
    _rewrite(path, bad, lambda n, d: buf.getvalue() if n.endswith("data/sample_inputs/model.pt") else d)
    with pytest.raises(UnsafeArchiveError, match="sample_inputs"):
        opsadv.load(bad)
    assert not marker.exists()
