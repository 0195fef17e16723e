"""The lm_loss pass: a transformers causal LM's training loss through `opsadv.ops.linear_cross_entropy`, without the
(tokens, vocab) logits in memory.

transformers' *ForCausalLM forward computes `logits = self.lm_head(hidden)` (hidden sliced by `logits_to_keep`) and,
given labels, `loss = self.loss_function(logits, labels, vocab_size, **kwargs)`: ForCausalLMLoss (float32 logits,
labels shifted by one with ignore_index padding or the `shift_labels` kwarg, the mean over the labels kept, or the
sum / `num_items_in_batch` where that is passed); Gemma-2 softcaps the logits first (`final_logit_softcapping`).  At
a 128k vocabulary those logits are b*s*V float32 (4 GiB at b4 s2048).  Three hooks, no modeling code:

- a forward pre-hook (with kwargs) on the model: in training mode with labels, the call's labels become None (so
  the model computes no loss of its own) and are kept for the call with `shift_labels`, `num_items_in_batch` and
  `ignore_index` (those stay in the kwargs: the model passes them on as it did);
- a forward pre-hook on lm_head: while such a call runs, the loss is computed from lm_head's input, weight and bias
  (softcapped where the model's forward reads final_logit_softcapping), and lm_head itself runs on zero tokens, so
  the logits are an empty placeholder and whatever the model does to them costs nothing.  The hook moves to the
  model's current output embeddings at each such call (resize_token_embeddings replaces an untied lm_head);
- a forward hook on the model (always_call: an exception drops the call's state too): the output gets the loss and
  `logits=None`, as Liger-Kernel's fused linear cross-entropy returns them (a tuple output: loss first, no logits).

Under tensor parallelism an lm_head whose weight is split over the vocabulary (ColwiseParallel, transformers'
colwise tp_plan) keeps the fused loss: the op runs vocab-parallel on the DTensor weight (opsadv/distributed/
vocab_parallel.py), with hidden and labels taken whole on the weight's mesh, and lm_head runs on a one-token
placeholder (DTensor's F.linear fails on zero tokens).  Any other tensor-parallel head computes the loss from its
logits (LossSeam.loss_of_logits).

Eval mode, or a call without labels, changes nothing (logits as before).  The pass refuses, with the reason in the
report, a model without an lm_head Linear, one whose loss is not ForCausalLMLoss (another loss_type, a loss_function
of its own), one whose forward does not compute its loss through `self.loss_function`, one that adds a router's
auxiliary loss when labels are passed (Mixtral), and one whose fused loss differs from its own on a probe batch
(a logit scale the fused loss does not apply, e.g. Cohere's logit_scale)."""
from __future__ import annotations

import inspect
import sys
from contextlib import nullcontext

import torch
from torch import nn
from torch.nn import functional as F

from opsadv import ops
from opsadv.core import tuning

from . import tp, validate as _val
from .hf_attention import is_transformers_model
from .modules import quantized_linear
from .report import ConversionReport
from .rotary import _innermost

KIND = "lm_loss"
LABEL = "the model's own loss (logits + transformers' ForCausalLMLoss)"


class _Call:
    """One training call with labels: what its loss needs, and the loss once lm_head's input has given it."""
    __slots__ = ("labels", "shift_labels", "num_items", "ignore_index", "softcap", "loss", "from_logits")

    def __init__(self, labels, shift_labels, num_items, ignore_index, softcap):
        self.labels, self.shift_labels, self.num_items = labels, shift_labels, num_items
        self.ignore_index, self.softcap, self.loss = ignore_index, softcap, None
        self.from_logits = False            # lm_head is tensor-parallel but not split over the vocabulary (or its
                                            # input is not the whole batch): the loss comes from the logits


_known_kwargs: dict[type, frozenset[str]] = {}


def _foreign_kwargs(model, kwargs) -> list[str]:
    """The call's keyword arguments that neither the model class's forward names nor transformers' TransformersKwargs
    lists: arguments for a forward installed over it after conversion (TRL's SFTTrainer patches the instance's
    forward with `fused_lm_head`, which needs the labels), which the seam must leave to that forward."""
    cls = type(model)
    known = _known_kwargs.get(cls)
    if known is None:
        names = set(inspect.signature(cls.forward).parameters)
        try:
            from transformers.utils.generic import TransformersKwargs
            names |= set(getattr(TransformersKwargs, "__annotations__", {}))
        except ImportError:
            pass
        known = _known_kwargs[cls] = frozenset(names | {"shift_labels", "ignore_index", "return_dict"})
    return sorted(k for k in kwargs if k not in known)


class LossSeam:
    """The hooks of one converted causal LM and the state of its calls in flight (a stack: one entry per call of the
    model's forward, None where the call runs unchanged, so a re-entered forward pairs its own hooks)."""

    def __init__(self, state, labels_at: int | None, softcap: bool, causal_loss, loss_mapping):
        self.state = state                  # the converted model's RuntimeState (the op runs under its policy)
        self.labels_at = labels_at          # position of `labels` among the forward's positional arguments
        self.softcap = softcap              # the forward applies config.final_logit_softcapping
        self.causal_loss = causal_loss      # transformers' ForCausalLMLoss
        self.loss_mapping = loss_mapping    # transformers' LOSS_MAPPING (loss_type -> loss function)
        self.calls: list = []
        self.force = False                  # the conversion's probe: the fused path in eval mode
        self.head: nn.Module | None = None  # the lm_head whose pre-hook computes the loss, and that hook's handle
        self.head_handle = None

    def __getstate__(self):
        # a copy of the model starts with no call in flight
        return {**self.__dict__, "calls": [], "force": False}

    def uses_causal_loss(self, model) -> bool:
        """model.loss_function is ForCausalLMLoss (what the property resolves to, without its warning)."""
        fn = getattr(model, "_loss_function", None)
        if fn is not None:
            return fn is self.causal_loss
        return self.loss_mapping.get(getattr(model, "loss_type", None), self.causal_loss) is self.causal_loss

    def model_pre_hook(self, model, args, kwargs):
        at = self.labels_at
        positional = at is not None and len(args) > at
        labels = args[at] if positional else kwargs.get("labels")
        if labels is None or not (model.training or self.force) or not self.uses_causal_loss(model) \
                or not self.follow_head(model):
            self.calls.append(None)
            return None
        foreign = _foreign_kwargs(model, kwargs)
        if foreign:                         # a forward replaced after conversion reads these, and maybe the labels
            self.calls.append(None)         # (TRL's fused_lm_head): it computes the loss its own way
            if self.state is not None:
                self.state.note_fallback(f"lm_loss: arguments the model's forward does not take ({', '.join(foreign)})"
                                         " -> the replaced forward's own loss")
            return None
        softcap = getattr(model.config, "final_logit_softcapping", None) if self.softcap else None
        self.calls.append(_Call(labels, kwargs.get("shift_labels"), kwargs.get("num_items_in_batch"),
                                kwargs.get("ignore_index", -100), softcap))
        if positional:
            return args[:at] + (None,) + args[at + 1:], kwargs
        return args, {**kwargs, "labels": None}

    def hook_head(self, head: nn.Module) -> None:
        if self.head_handle is not None:
            self.head_handle.remove()
        self.head, self.head_handle = head, head.register_forward_pre_hook(self.head_pre_hook)

    def follow_head(self, model) -> bool:
        """The hook is on the model's lm_head now: resize_token_embeddings (new tokens) replaces the module, and the
        new one gets the hook.  False where it is no nn.Linear any more (the call runs unchanged)."""
        head = _head(model)
        if head is self.head:
            return True
        if not isinstance(head, nn.Linear) or _why_not_head(head) is not None:
            return False
        self.hook_head(head)
        return True

    def remove(self) -> None:
        """(An undo hook: the lm_head hook, wherever it is now.)"""
        if self.head_handle is not None:
            self.head_handle.remove()
        self.head = self.head_handle = None

    def head_pre_hook(self, head, args):
        call = self.calls[-1] if self.calls else None
        if call is None or call.loss is not None or len(args) != 1:
            return None                     # not a fused call, or a second lm_head call in it: as it was
        hidden = args[0]
        if tp.is_dtensor(head.weight) and not self.vocab_parallel(hidden, head, call):
            call.from_logits = True         # lm_head runs under its plan, the loss comes from its logits
            return None                     # (model_post_hook)
        call.loss = self.loss(hidden, head, call)
        if tp.is_dtensor(head.weight):
            return (_one_token(hidden),)
        return (hidden.narrow(-2, 0, 0),)   # lm_head on zero tokens: the logits placeholder costs nothing

    @staticmethod
    def vocab_parallel(hidden, head: nn.Linear, call: _Call) -> bool:
        """The fused loss can run vocab-parallel: lm_head's weight is split over the vocabulary (ColwiseParallel,
        transformers' colwise tp_plan) and its input is the whole batch: a DTensor (the plan's input hook ran
        first, or a sequence-parallel norm handed it on), or a plain tensor with every label's token (a plain input
        holding a share of the sequence is the plan's business: its logits and the model's own loss are kept)."""
        if not tp.vocab_split(head.weight, head.bias):
            return False
        if tp.is_dtensor(hidden):
            return hidden.device_mesh == head.weight.device_mesh
        labels = call.shift_labels if call.shift_labels is not None else call.labels
        return tuple(hidden.shape[:-1]) == tuple(labels.shape)

    def model_post_hook(self, model, args, kwargs, output):
        call = self.calls.pop() if self.calls else None
        if call is None or output is None:  # (None: the forward raised; its state is dropped all the same)
            return None
        if call.from_logits:
            return self.loss_of_logits(model, output, call)
        if call.loss is None:
            raise RuntimeError(f"opsadv lm_loss: {type(model).__name__}'s forward did not call its lm_head in a "
                               "training call with labels; convert it with rewrites={'lm_loss': False}")
        return with_loss(output, call.loss)

    def loss_of_logits(self, model, output, call: _Call):
        """The model's own loss of the call, from its logits (a tensor-parallel lm_head: no fused loss)."""
        logits = output[0] if isinstance(output, tuple) else output.logits     # (softcapped by the forward)
        kw = {"ignore_index": call.ignore_index}
        if call.shift_labels is not None:
            kw["shift_labels"] = call.shift_labels
        if call.num_items is not None:
            kw["num_items_in_batch"] = call.num_items
        loss = self.causal_loss(logits, call.labels, model.config.get_text_config().vocab_size, **kw)
        if isinstance(output, tuple):
            return (loss,) + tuple(output)
        return type(output)(**{**output, "loss": loss})

    def loss(self, hidden: torch.Tensor, head: nn.Linear, call: _Call) -> torch.Tensor:
        """ForCausalLMLoss(lm_head(hidden), labels, ...) as transformers computes it, through the fused op."""
        labels = call.shift_labels
        if labels is None:                  # tokens < n predict n; the last one predicts nothing
            labels = F.pad(call.labels, (0, 1), value=call.ignore_index)[..., 1:]
        weight, bias = head.weight, head.bias
        if tp.is_dtensor(weight):           # split over the vocabulary (vocab_parallel): hidden and labels whole
            hidden = _replicated(hidden, weight.device_mesh)
            labels = _replicated(labels.to(hidden.device), weight.device_mesh)
        h = hidden.reshape(-1, hidden.shape[-1])
        labels = labels.reshape(-1).to(h.device)
        dev = h.device.type
        if torch.is_autocast_enabled(dev):  # autocast would run lm_head in its dtype
            dt = torch.get_autocast_dtype(dev)
            h, weight = h.to(dt), weight.to(dt)
            bias = bias.to(dt) if bias is not None else None
        elif h.dtype != weight.dtype:
            h = h.to(weight.dtype)
        reduction = "mean" if call.num_items is None else "sum"
        with self.state.scope() if self.state is not None else nullcontext():
            loss = ops.linear_cross_entropy(h, weight, labels, bias=bias, ignore_index=call.ignore_index,
                                            reduction=reduction, softcap=call.softcap)
        if tp.is_dtensor(loss):             # replicated: every rank of the vocabulary split holds the whole loss
            loss = loss.to_local()
        if call.num_items is not None:
            n = call.num_items
            loss = loss / (n.to(loss.device) if isinstance(n, torch.Tensor) else n)
        return loss


def _one_token(hidden):
    """A vocab-split lm_head's placeholder input: one token of hidden, detached (its logits are dropped).  Not zero
    tokens: DTensor's sharding propagation of F.linear fails on a zero-sized dim (the view back to (b, 0, V) divides
    by it), so the plan's lm_head gets (b, 1, H) and gathers (b, 1, V) logits.  A DTensor hidden gives its local
    first token as a replicated DTensor (a narrow of a sequence-split DTensor would communicate)."""
    if not tp.is_dtensor(hidden):
        return hidden.detach().narrow(-2, 0, 1)
    loc = hidden.to_local().detach()
    one = loc.narrow(-2, 0, 1) if loc.shape[-2] else loc.new_zeros((*loc.shape[:-2], 1, loc.shape[-1]))
    mesh = hidden.device_mesh
    return sys.modules[tp._DT].DTensor.from_local(one, mesh, [sys.modules[tp._DT].Replicate()] * mesh.ndim,
                                                  run_check=False)


def _replicated(t, mesh):
    """t as a DTensor replicated on `mesh`: a plain tensor every rank holds whole is wrapped (its gradient, a partial
    sum on each rank, is reduced by DTensor); a DTensor is redistributed (a sequence-parallel hidden is all-gathered,
    as lm_head's plan would do it)."""
    r = [sys.modules[tp._DT].Replicate()] * mesh.ndim
    if tp.is_dtensor(t):
        return t if tuple(t.placements) == tuple(r) else t.redistribute(placements=r)
    return sys.modules[tp._DT].DTensor.from_local(t, mesh, r, run_check=False)


def with_loss(output, loss):
    """The model's output with `loss` set and no logits (a tuple: the placeholder logits in front replaced)."""
    if isinstance(output, tuple):
        return (loss,) + tuple(output[1:])
    rest = {k: v for k, v in output.items() if k not in ("loss", "logits")}
    return type(output)(loss=loss, **rest)


def seam_of(model) -> LossSeam | None:
    return model.__dict__.get("_opsadv_lm_loss")


def _head(model):
    try:
        head = model.get_output_embeddings()
    except Exception:                       # noqa: BLE001 - a model without one
        head = None
    return head if head is not None else getattr(model, "lm_head", None)


def _is_lm(model) -> bool:
    try:
        if model.can_generate():
            return True
    except Exception:                       # noqa: BLE001 - (older transformers: an instance method that may raise)
        pass
    name = type(model).__name__
    return "CausalLM" in name or "LMHead" in name


def _why_not_head(head) -> str | None:
    if not isinstance(head, nn.Linear):
        return (f"no lm_head nn.Linear (output embeddings: {type(head).__name__}); the fused loss reads the output "
                "projection's weight")
    quantized = quantized_linear(head)
    if quantized:
        return f"lm_head is quantized ({quantized}): the fused loss reads a float weight"
    if tp.is_dtensor(head.weight) and not tp.vocab_split(head.weight, head.bias):
        return (f"lm_head is tensor-parallel with weight placements {tuple(head.weight.placements)}: the fused loss "
                "takes a whole weight or one split over the vocabulary (Shard(0) on one mesh dim, bias alike); the "
                "model's logits and loss are kept")
    return None


def _why_not(model, head, code) -> str | None:
    from transformers.modeling_utils import PreTrainedModel
    why = _why_not_head(head)
    if why is not None:
        return why
    if inspect.getattr_static(type(model), "loss_function", None) is not \
            inspect.getattr_static(PreTrainedModel, "loss_function"):
        return f"{type(model).__name__} defines its own loss_function"
    if "loss_function" not in code.co_names:
        return "its forward computes the loss without self.loss_function (transformers' ForCausalLMLoss seam)"
    if any("aux_loss" in n for n in code.co_names + code.co_varnames):
        return "its forward adds a router's auxiliary loss to the loss when labels are passed"
    return None


def _probe(model, seam: LossSeam, dtype, kwargs: dict) -> str | None:
    """The model's own loss and the fused one on a small batch (eval mode, no grad), within the conversion's
    validation limit (validate.REL_LIMIT); why they differ, or None."""
    modes = {m: m.training for m in model.modules()}
    try:
        x = {**_val.hf_validation_inputs(model, batch=2, seq=11), **kwargs}
        labels = x["input_ids"].masked_fill(x["attention_mask"] == 0, -100)
        labels[0, 3] = -100
        model.eval()
        with torch.no_grad(), tuning.deferred():        # (a probe's shapes: nothing tuned for them)
            ref = model(**x, labels=labels)
            seam.force = True
            try:
                got = model(**x, labels=labels)
            finally:
                seam.force = False
    except Exception as e:                  # noqa: BLE001 - a model the seam cannot serve
        return f"the probe call failed: {type(e).__name__}: {str(e)[:200]}"
    finally:
        for m, t in modes.items():
            m.training = t
    a, b = getattr(ref, "loss", None), getattr(got, "loss", None)
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        return "the probe call returned no loss"
    if getattr(got, "logits", None) is not None:
        return "the probe call still returned logits"
    err = (abs(float(a) - float(b)) / max(abs(float(a)), 1e-30))
    if not err <= _val.REL_LIMIT.get(dtype, 3e-2):
        return (f"the fused loss differs from the model's own on a probe batch (rel err {err:.3g}): its forward "
                "does more to the logits than lm_head and final_logit_softcapping")
    return None


def lm_loss_pass(model: nn.Module, report: ConversionReport, undo, state) -> bool:
    """Install the seam on a transformers causal LM (see the module docstring); True where installed.  Models whose
    forward takes no labels, and models with labels but neither output embeddings nor a language model's name or
    generate (classifiers), are left without a word (no language model's loss to compute)."""
    if not is_transformers_model(model) or seam_of(model) is not None:
        return False
    try:
        params = list(inspect.signature(type(model).forward).parameters.values())
    except (TypeError, ValueError):
        return False
    names = [p.name for p in params]
    if "labels" not in names:
        return False
    what = f"{type(model).__name__}: logits + ForCausalLMLoss"
    head = _head(model)
    if head is None and not _is_lm(model):
        return False                        # a classification head's labels: not a language model's loss
    code = _innermost(type(model).forward)[-1].__code__
    why = _why_not(model, head, code)
    from transformers.loss.loss_utils import LOSS_MAPPING, ForCausalLMLoss
    p = params[names.index("labels")]
    labels_at = names.index("labels") - 1 if p.kind is p.POSITIONAL_OR_KEYWORD else None     # (- self)
    seam = LossSeam(state, labels_at, "final_logit_softcapping" in code.co_names, ForCausalLMLoss, LOSS_MAPPING)
    _foreign_kwargs(model, {})              # (the class's known arguments, read now: not while dynamo traces a call)
    if why is None and not seam.uses_causal_loss(model):
        why = f"loss_type {getattr(model, 'loss_type', None)!r}: its loss is not ForCausalLMLoss"
    if why is not None:
        report.add("skipped", "", what, why)
        return False
    seam.hook_head(head)
    hooks = [model.register_forward_pre_hook(seam.model_pre_hook, with_kwargs=True), seam,
             model.register_forward_hook(seam.model_post_hook, with_kwargs=True, always_call=True)]
    dtype = head.weight.dtype
    why = _probe(model, seam, dtype, {"use_cache": False} if "use_cache" in names else {})
    if why is not None:
        for h in hooks:
            h.remove()
        report.add("skipped", "", what, why)
        return False
    undo.hooks += hooks
    model.__dict__["_opsadv_lm_loss"] = seam
    undo.instance_attrs.append((model, "_opsadv_lm_loss"))
    where = next((n for n, m in model.named_modules() if m is head), "lm_head")
    report.add("fused", where, f"{what} -> opsadv.linear_cross_entropy from the final hidden states "
               "(training calls with labels; they return logits=None)")
    return True


__all__ = ["lm_loss_pass", "LossSeam", "seam_of", "with_loss", "KIND", "LABEL"]
