"""tune_for_hardware: run the converted model's real shapes with autotuning on, so every op's
shape bucket gets its measured winner persisted (core/tuning.py), and report which kernels ran."""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

import torch

from opsadv.core import dispatch
from opsadv.core.errors import InvalidArgumentError
from opsadv.core.policy import TIMINGS, Policy
from opsadv.registry import get_registry

from . import hf_attention, validate as _val


@dataclass
class TuneReport:
    device: str
    shapes: list[str]
    calls_per_impl: dict[str, int]
    seconds: float
    steps: list[str] = field(default_factory=list)

    @property
    def per_op(self) -> dict[str, dict[str, int]]:
        """op -> {impl id: calls}: the kernels chosen for each op."""
        op_of = {i.id: op for op, impls in get_registry().impls_by_op.items() for i in impls}
        out: dict[str, dict[str, int]] = {}
        for impl, n in self.calls_per_impl.items():
            out.setdefault(op_of.get(impl, "?"), {})[impl] = n
        return out

    def to_dict(self) -> dict:
        return {"device": self.device, "shapes": self.shapes, "steps": self.steps, "seconds": self.seconds,
                "calls_per_impl": self.calls_per_impl, "per_op": self.per_op}

    def __str__(self) -> str:
        rows = [f"opsadv tune_for_hardware on {self.device}: {len(self.steps)} steps, {self.seconds:.2f} s "
                f"(shapes {', '.join(self.shapes)})", "  chosen kernels per op (calls per impl):"]
        for op, impls in sorted(self.per_op.items()):
            rows.append(f"    {op:18} " + ", ".join(f"{i} x{n}" for i, n in sorted(impls.items(), key=lambda kv: -kv[1])))
        return "\n".join(rows)


def _tuning_policy(base: Policy, timing: str | None = None) -> Policy:
    # the model's policy with autotune on (pins, options kept; a graphed model is tuned on GPU time)
    return dataclasses.replace(base, autotune=True, timing=timing or base.timing)


def _hf_steps(model, device, batch_size, seq_len):
    cfg = model.config
    maxpos = getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", None) or 1024
    s = int(seq_len or min(int(maxpos), 1024))
    vocab = int(getattr(cfg, "vocab_size", 1000))
    ids = torch.randint(0, vocab, (batch_size, s), device=device)
    am = torch.ones(batch_size, s, dtype=torch.long, device=device)
    steps = [(f"forward b{batch_size} s{s}", lambda: model(input_ids=ids, attention_mask=am))]
    padded = am.clone()
    padded[batch_size // 2:, s - s // 3:] = 0     # a padded batch exercises the masked / varlen kernels
    steps.append((f"forward padded b{batch_size} s{s}", lambda: model(input_ids=ids, attention_mask=padded)))
    can_gen = getattr(model, "can_generate", lambda: False)()
    if can_gen:
        import inspect
        # transformers >= 5.2x names the KV cache `cache`; earlier versions `past_key_values`
        key = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

        def decode():
            out = model(input_ids=ids, attention_mask=am, use_cache=True)
            nxt = out.logits[:, -1:].argmax(-1)
            am2 = torch.cat([am, am[:, :1]], 1)
            return model(input_ids=nxt, attention_mask=am2, use_cache=True, **{key: getattr(out, key)})
        steps.append((f"decode step b{batch_size} cache {s}", decode))
    return steps, [f"b{batch_size}xs{s}"]


def tune_for_hardware(model, device="cuda:0", batch_size: int = 8, seq_len: int | None = None,
                      example_inputs=None, progress: bool = True, timing: str | None = None) -> TuneReport:
    """Autotune every op of the converted model at its real shapes on `device` (the model is moved
    there).  On CPU it runs through the same path (reference / interpreter impls).
    timing: how candidates are timed (None: the model's policy: "graph" for convert_model(cuda_graphs=True),
    else "wall"); "graph" tunes an eager copy for a model that will replay CUDA graphs (the measured winners
    are kept per timing, see opsadv.core.policy.Policy.timing)."""
    from tqdm.auto import tqdm

    if not isinstance(batch_size, int) or batch_size < 1:
        raise InvalidArgumentError("tune_for_hardware", "batch_size", "an int >= 1", repr(batch_size))
    if seq_len is not None and (not isinstance(seq_len, int) or seq_len < 1):
        raise InvalidArgumentError("tune_for_hardware", "seq_len", "None or an int >= 1", repr(seq_len))
    if timing is not None and timing not in TIMINGS:
        raise InvalidArgumentError("tune_for_hardware", "timing", f"None or one of {list(TIMINGS)}", repr(timing))
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise InvalidArgumentError("tune_for_hardware", "device", "an available device (no CUDA here)", str(device))
    state = getattr(model, "_opsadv_state", None)
    if state is None:
        raise InvalidArgumentError("tune_for_hardware", "model", "a model returned by opsadv.convert_model", "")
    p = next(model.parameters(), None)
    if p is not None and p.device != dev:
        model.to(dev)
    t0 = time.perf_counter()
    is_hf = hf_attention.is_transformers_model(model)
    text = is_hf and getattr(model, "main_input_name", "input_ids") == "input_ids" and not getattr(
        model.config, "is_encoder_decoder", False)
    if text and example_inputs is None:
        steps, shapes = _hf_steps(model, dev, batch_size, seq_len)
    elif is_hf and example_inputs is None:      # vision / audio / encoder-decoder: inputs from the config
        gen = _val.hf_validation_inputs(model, batch=batch_size, seq=seq_len or 128)
        steps = [(f"forward generated b{batch_size}", lambda: _val.run(model, gen))]
        shapes = [", ".join(f"{k} {tuple(v.shape)}" for k, v in gen.items())]
    else:
        inputs = example_inputs if example_inputs is not None else getattr(model, "_opsadv_example_inputs", None)
        if inputs is None:
            raise InvalidArgumentError("tune_for_hardware", "example_inputs", "inputs for a non-transformers model",
                                       None)
        inputs = _to(inputs, dev)
        steps, shapes = [("forward example inputs", lambda: _val.run(model, inputs))], ["example inputs"]
    prev = state.policy
    state.policy = _tuning_policy(state.effective(), timing)
    was_training = model.training
    model.eval()
    names = []
    try:
        with dispatch.Trace() as t, torch.no_grad():
            for name, fn in tqdm(steps, desc="opsadv tune", disable=not progress):
                fn()
                names.append(name)
    finally:
        state.policy = prev
        model.train(was_training)
        dispatch.clear_cache()        # later resolutions pick up the persisted measured winners
    return TuneReport(str(dev), shapes, dict(t.counts), time.perf_counter() - t0, names)


def _to(x, dev):
    if isinstance(x, torch.Tensor):
        return x.to(dev)
    if isinstance(x, dict):
        return {k: _to(v, dev) for k, v in x.items()}
    if isinstance(x, (tuple, list)):
        return type(x)(_to(v, dev) for v in x)
    return x
