"""opsadv.bench.fp8_loss_curve: the FP8-vs-bf16 training curve job (issue 42) runs end to end on a tiny model on the
CPU (reference backend, FP8 emulated), its deviations are those of its own curves, and it writes the JSON and plot."""
import json

import pytest
import torch

from opsadv.bench import fp8_loss_curve as LC


def test_deviations_are_per_step_and_per_epoch_means():
    d = LC.deviations([1.1, 2.0, 2.9, 4.4], [1.0, 2.0, 3.0, 4.0], per_epoch=2)
    assert d["max_step_dev"] == pytest.approx(0.1)
    assert d["epoch_dev"] == pytest.approx([3.1 / 3.0 - 1, 7.3 / 7.0 - 1], abs=1e-6)
    assert d["max_epoch_dev"] == pytest.approx(7.3 / 7.0 - 1, abs=1e-6)


def test_schedule_warms_up_then_decays_to_a_tenth():
    f = [LC.lr_factor(i, 100, 10) for i in range(100)]
    assert f[0] == pytest.approx(0.1) and f[9] == pytest.approx(1.0) and f[10] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(f[10:], f[11:])) and f[-1] == pytest.approx(0.1, abs=1e-3)


def test_batches_repeat_a_motif():
    b = LC.batches(100, 3, 2, 150)
    assert len(b) == 3 and b[0].shape == (2, 150) and not torch.equal(b[0], b[1])
    assert torch.equal(b[0][:, :LC.MOTIF], b[0][:, LC.MOTIF:2 * LC.MOTIF])


def test_tiny_run_writes_curves_and_plot(tmp_path):
    path = tmp_path / "curve.json"
    assert LC.main(["--size", "tiny", "--steps", "6", "--batch", "2", "--seq", "24", "--batches", "2", "--lr", "3e-3", "--warmup", "2",
                    "--backend", "reference",  # (the auto backend would interpret the Triton kernels here: slow)
                    "--json", str(path)]) == 0
    res = json.loads(path.read_text())
    got, ref = res["losses"]["fp8"], res["losses"]["bf16"]
    assert len(got) == len(ref) == 6 and got != ref                    # two runs, FP8 rounding shows
    assert res["fp8"]["fp8_units"] == 2 and res["fp8"]["recipe"]["training"]
    assert res["max_step_dev"] == pytest.approx(max(abs(a - b) / b for a, b in zip(got, ref)), rel=1e-3)
    assert res["max_step_dev"] < 0.05 and ref[-1] < ref[0]            # it learns, and FP8 follows
    assert len(res["epoch_dev"]) == 3 and (tmp_path / "curve.png").stat().st_size > 10_000


def test_bad_arguments_are_refused(capsys):
    with pytest.raises(SystemExit):
        LC.main(["--steps", "0"])
    assert "--steps must be >= 1, got 0" in capsys.readouterr().err
