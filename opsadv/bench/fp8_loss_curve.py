"""FP8 training against bf16 over many steps (issue 42's loss curve): one model, its weights and the same synthetic
batches trained through convert_model(precision="bf16") and convert_model(precision="fp8"), each step's loss kept.

    python -m opsadv.bench.fp8_loss_curve --steps 200 --json benchmarks/results/fp8_loss_curve_h200.json

Model: a models-bench architecture at a size (model_zoo; default llama3 1.5b, Llama-3.2-1B's dimensions) in bf16,
randomly initialized (seed 0).  Data: each sequence repeats a random motif of MOTIF tokens, so the loss has a
structure to fall to (far below log(vocab)); `--batches` fixed batches are cycled, one pass over them is an epoch.
Both runs: AdamW(lr) on the bf16 parameters with the usual schedule (linear warmup over `--warmup` steps, cosine decay
to lr / 10) and gradient-norm clipping at `--clip`, no dropout, the same batch order; the bf16 run first, freed
before the fp8 one.  (Without warmup and clipping the bf16 run of the 1.5b model itself diverged after ~120 steps at
lr 3e-4, and two diverging runs compare chaos, not precision.)  Reported: both curves, the worst per-step relative deviation of fp8 from bf16, the per-epoch deviation of
the mean loss (the issue's bar: within 1%), and each run's median wall time per step (a rough rate from one run,
not the bench's paired timing).  `--plot` draws the curves and the per-step deviation."""
from __future__ import annotations

import argparse
import copy
import gc
import math
import json
import statistics
import sys
import time

import torch

import opsadv

from . import model_zoo as Z
from .runner import _header

MOTIF = 64


def batches(vocab: int, n: int, batch: int, seq: int, seed: int = 0) -> list[torch.Tensor]:
    """n batches of (batch, seq) token ids, each row a random MOTIF-token motif repeated to seq."""
    g = torch.Generator().manual_seed(seed)
    m = min(MOTIF, seq)
    return [torch.randint(0, vocab, (batch, m), generator=g).repeat(1, -(-seq // m))[:, :seq] for _ in range(n)]


def lr_factor(step: int, steps: int, warmup: int) -> float:
    """The schedule's multiplier of lr at `step`: linear warmup to 1 over `warmup` steps, then cosine to 0.1."""
    if step < warmup:
        return (step + 1) / warmup
    t = (step - warmup) / max(1, steps - warmup)
    return 0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, t)))


def train(model, data: list[torch.Tensor], steps: int, lr: float, device, warmup: int = 0,
          clip: float | None = None) -> tuple[list[float], list[float]]:
    """(loss per step, seconds per step): AdamW over the model's parameters under lr_factor's schedule, gradients
    clipped to norm `clip`, data cycled."""
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: lr_factor(i, steps, warmup))
    params = [p for p in model.parameters() if p.requires_grad]
    losses, secs = [], []
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for i in range(steps):
        x = data[i % len(data)].to(device)
        sync()
        t0 = time.perf_counter()
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(params, clip, foreach=True)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())            # (the sync that ends the step)
        secs.append(time.perf_counter() - t0)
    return losses, secs


def deviations(fp8: list[float], bf16: list[float], per_epoch: int) -> dict:
    """The worst per-step relative deviation and each epoch's deviation of the mean loss (fp8 / bf16 - 1)."""
    step = [abs(a - b) / abs(b) for a, b in zip(fp8, bf16)]
    epochs = [sum(fp8[i:i + per_epoch]) / sum(bf16[i:i + per_epoch]) - 1
              for i in range(0, len(bf16) - per_epoch + 1, per_epoch)]
    return {"max_step_dev": max(step), "epoch_dev": [round(e, 6) for e in epochs],
            "max_epoch_dev": max(map(abs, epochs), default=0.0), "step_dev": [round(s, 6) for s in step]}


def run(arch: str = "llama3", size: str = "1.5b", steps: int = 200, batch: int = 4, seq: int = 2048,
        n_batches: int = 8, lr: float = 3e-4, device: str | None = None, backend: str = "auto", warmup: int = 20,
        clip: float | None = 1.0) -> dict:
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    base = Z.build(arch, size, dev, torch.bfloat16, train=True)
    vocab = base.config.get_text_config().vocab_size
    data = batches(vocab, n_batches, batch, seq)
    out: dict = {**_header(), "arch": arch, "size": size, "steps": steps, "batch": batch, "seq": seq,
                 "batches": n_batches, "lr": lr, "warmup": warmup, "clip": clip, "motif": MOTIF, "losses": {},
                 "ms_per_step": {}}
    for precision in ("bf16", "fp8"):
        model = opsadv.convert_model(copy.deepcopy(base), precision=precision, backend=backend, floor=False)
        if precision == "fp8":
            out["fp8"] = model.opsadv_report.fp8
        torch.manual_seed(0)
        losses, secs = train(model, data, steps, lr, dev, warmup, clip)
        out["losses"][precision] = [round(v, 6) for v in losses]
        out["ms_per_step"][precision] = round(1e3 * statistics.median(secs[min(3, steps - 1):]), 3)
        del model
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    out.update(deviations(out["losses"]["fp8"], out["losses"]["bf16"], n_batches))
    out["speedup"] = round(out["ms_per_step"]["bf16"] / out["ms_per_step"]["fp8"], 4)
    return out


def plot(res: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a, b) = plt.subplots(2, 1, figsize=(8, 6), sharex=True, gridspec_kw={"height_ratios": [3, 1]})
    for k, style in (("bf16", "-"), ("fp8", "--")):
        a.plot(res["losses"][k], style, label=f"{k} ({res['ms_per_step'][k]:.0f} ms/step)")
    a.set_ylabel("training loss")
    a.set_title(f"{res['arch']} {res['size']} b{res['batch']} s{res['seq']} on {res['device']} ({res['commit']}): "
                f"fp8 vs bf16, epochs within {100 * res['max_epoch_dev']:.2f}%", fontsize=9)
    a.legend()
    b.plot([100 * d for d in res["step_dev"]])
    b.set_ylabel("|fp8/bf16 - 1| %")
    b.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m opsadv.bench.fp8_loss_curve", description=__doc__.splitlines()[0])
    p.add_argument("--arch", default="llama3")
    p.add_argument("--size", default="1.5b")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batches", type=int, default=8, help="distinct batches, cycled (one pass is an epoch)")
    p.add_argument("--lr", type=float, default=3e-4, help="peak learning rate")
    p.add_argument("--warmup", type=int, default=20, help="linear warmup steps (then cosine decay to lr / 10)")
    p.add_argument("--clip", type=float, default=1.0, help="gradient-norm clipping (0: none)")
    p.add_argument("--device", default=None)
    p.add_argument("--backend", default="auto")
    p.add_argument("--json", default=None, metavar="PATH")
    p.add_argument("--plot", default=None, metavar="PATH", help="default: the JSON's name with .png")
    a = p.parse_args(argv)
    for name in ("steps", "batch", "seq", "batches"):
        if getattr(a, name) < 1:
            p.error(f"--{name} must be >= 1, got {getattr(a, name)}")
    if a.warmup < 0 or a.clip < 0:
        p.error(f"--warmup and --clip must be >= 0, got {a.warmup} and {a.clip}")
    res = run(a.arch, a.size, a.steps, a.batch, a.seq, a.batches, a.lr, a.device, a.backend, a.warmup,
              a.clip or None)
    print(f"fp8 vs bf16 over {a.steps} steps: worst step {100 * res['max_step_dev']:.2f}%, worst epoch "
          f"{100 * res['max_epoch_dev']:.2f}%, {res['ms_per_step']['fp8']} vs {res['ms_per_step']['bf16']} ms/step "
          f"({res['speedup']}x)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    if a.json or a.plot:
        plot(res, a.plot or a.json.rsplit(".", 1)[0] + ".png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
