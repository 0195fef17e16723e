"""Optimizer: convert with a device/precision/opt-level preset, and export to a torch.export
program (.pt2) whose graph calls opsadv::* ops.  `load` reads it back with torch.export's .pt2 reader in
any process that can `import opsadv` (which registers the ops), after refusing every entry that reader
would unpickle (no pickled code runs: docs/security.md)."""
from __future__ import annotations

import difflib
import inspect
import io
from pathlib import Path

import torch
from torch import nn

from opsadv.core.device_check import check_device
from opsadv.core.errors import InvalidArgumentError, UnknownOptionError, UnsafeArchiveError
from opsadv.core.precision import PrecisionPolicy

from opsadv import ops as _ops  # noqa: F401  (registers the opsadv::* ops a loaded program calls)

from . import floor as _floor, hf_attention
from .api import _check_int, check_graph_args, check_rewrites, check_seed_args, convert_model, split_fp8
from .modules import unalias_fused
from .tune import _to
from .validate import hf_validation_inputs


class _PlainOutputs(nn.Module):
    """Exports return plain tensors / dicts of tensors: a program must load without transformers'
    output classes being registered with pytree in the loading process."""

    def __init__(self, model: nn.Module, fixed: dict):
        super().__init__()
        self.model, self.fixed = model, fixed

    def forward(self, *args, **kwargs):
        out = self.model(*args, **kwargs, **self.fixed)
        if isinstance(out, (torch.Tensor, tuple, list)):
            return out
        if isinstance(out, dict):                 # transformers ModelOutput is an OrderedDict
            return {k: v for k, v in out.items() if isinstance(v, torch.Tensor)}
        return out


def _named(model: nn.Module, fixed: dict, names: list[str], keyword: bool) -> _PlainOutputs:
    """_PlainOutputs whose forward names its inputs (keyword-only `names`, or positional ones): torch.export
    matches dynamic_shapes to the forward's parameter names and cannot match entries of **kwargs / *args."""
    kind = inspect.Parameter.KEYWORD_ONLY if keyword else inspect.Parameter.POSITIONAL_OR_KEYWORD

    class Named(_PlainOutputs):
        def forward(self, *args, **kwargs):
            return super().forward(*args, **kwargs)
    Named.forward.__signature__ = inspect.Signature(
        [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)] + [inspect.Parameter(n, kind) for n in names])
    return Named(model, fixed)


# what "auto" makes dynamic, by input name: the batch dim and, for token inputs, the (decoder) sequence dim
_TOKENS = (0, 1)
AUTO_DIMS = {"input_ids": _TOKENS, "attention_mask": _TOKENS, "token_type_ids": _TOKENS, "position_ids": _TOKENS,
             "decoder_input_ids": _TOKENS, "decoder_attention_mask": _TOKENS, "pixel_values": (0,),
             "input_features": (0,)}


def auto_dynamic_shapes(inputs: dict) -> dict:
    """The batch and sequence dims of a transformers model's inputs (AUTO_DIMS) as torch.export dims; other
    inputs static.  Dim.DYNAMIC: export keeps what the model's code leaves dynamic (and its bounds: a learned
    position table caps the sequence; inputs that must agree, e.g. ids and mask, are unified) instead of failing,
    and Optimizer.export reports any dim the model's code fixed."""
    dyn = torch.export.Dim.DYNAMIC
    return {k: ({d: dyn for d in AUTO_DIMS[k] if d < v.dim()} if k in AUTO_DIMS and isinstance(v, torch.Tensor)
                else None) for k, v in inputs.items()}


def _pinned_dims(ep, names: list[str], shapes: dict) -> list[str]:
    """The dims asked to be dynamic that the exported program fixed (the model's code specialized them)."""
    nodes = {n.name: n for n in ep.graph.nodes if n.op == "placeholder"}
    out = []
    for name, node in zip(names, ep.graph_signature.user_inputs):
        val = nodes[node].meta.get("val") if node in nodes else None
        spec = shapes.get(name)
        if isinstance(spec, dict) and isinstance(val, torch.Tensor):
            out += [f"{name} dim {d} (fixed at {val.shape[d]})" for d in spec if isinstance(val.shape[d], int)]
    return out


# convert_model's keywords that Optimizer sets itself (the rest are seed parameters it passes on)
_OWN = ("backend", "precision", "opt_level", "validate", "example_inputs")
_ALIASES = {"num_streams": "max_streams", "streams": "max_streams", "mem_policy": "mem_opt", "tile": "tile_size"}


def _check_seeds(seeds: dict, opt_level: int) -> None:
    """Refuse at construction what convert_model would refuse at .compile (unknown names, bad values)."""
    params = inspect.signature(convert_model).parameters
    known = [n for n, p in params.items() if p.kind is p.KEYWORD_ONLY and n not in _OWN]
    for name in seeds:
        if name not in known:
            hint = _ALIASES.get(name) or next(iter(difflib.get_close_matches(name, known, 1)), None)
            raise UnknownOptionError("Optimizer", name, f"a keyword of convert_model ({', '.join(known)})",
                                     f"{name}={seeds[name]!r}" + (f" -- did you mean {hint}={seeds[name]!r}?"
                                                                  if hint else ""))
    get = lambda n: seeds.get(n, params[n].default)  # noqa: E731
    try:
        check_seed_args(opt_level, get("tile_size"), get("max_streams"), get("mem_opt"), get("use_fp16"))
        check_graph_args(None, get("pack_padding"), get("cuda_graphs"), get("max_graphs"))
        _floor.check_args(get("floor"), get("floor_mode"), get("floor_timer"), get("floor_compile"),
                          get("floor_cache"))
        check_rewrites(get("rewrites"))
    except InvalidArgumentError as e:   # the same check, named after what the user called
        raise type(e)("Optimizer", e.arg, e.expected, e.given) from None


class Optimizer:
    """`Optimizer(device="cuda", precision="bf16", opt_level=2).compile(model)`; `.export(model, path)` writes a
    .pt2 (batch and sequence dims dynamic for transformers models)."""

    def __init__(self, device=None, precision="fp32", opt_level: int = 2, backend: str = "auto", **seeds):
        _check_int("opt_level", opt_level, 0, 3, allow_none=False)
        if isinstance(precision, dict):
            try:
                PrecisionPolicy.from_dict(split_fp8(precision)[0])
            except InvalidArgumentError as e:       # the same check, named after what the user called
                raise type(e)("Optimizer", e.arg, e.expected, e.given) from None
        elif not (precision is None or isinstance(precision, PrecisionPolicy)
                  or (isinstance(precision, str) and precision.lower() in ("fp16", "bf16", "fp32", "tf32", "fp8"))):
            raise InvalidArgumentError("Optimizer", "precision", "'fp16', 'bf16', 'fp32', 'tf32', 'fp8', a precision dict "
                                       "or a PrecisionPolicy", repr(precision))
        self.device = check_device(device, "Optimizer")
        _check_seeds(seeds, opt_level)
        self.precision, self.opt_level, self.backend, self.seeds = precision, opt_level, backend, seeds

    def __repr__(self) -> str:
        return (f"Optimizer(device={self.device}, precision={self.precision!r}, opt_level={self.opt_level}, "
                f"backend={self.backend!r})")

    def compile(self, model: nn.Module, example_inputs=None, validate=True) -> nn.Module:
        if getattr(model, "_opsadv_state", None) is not None:
            return model                          # already converted
        if self.device is not None:
            model.to(self.device)
        if example_inputs is not None and self.device is not None:
            example_inputs = _to(example_inputs, self.device)
        return convert_model(model, backend=self.backend, precision=self.precision, opt_level=self.opt_level,
                             validate=validate, example_inputs=example_inputs, **self.seeds)

    def export(self, model: nn.Module, path, example_inputs=None, validate=True,
               dynamic_shapes="auto") -> torch.export.ExportedProgram:
        """Convert (if needed), torch.export the model on `example_inputs` (kwargs dict, args tuple or a
        tensor; None: generated for transformers models, as convert_model validates them) and save the program to
        `path` (.pt2).  Returns the ExportedProgram.

        dynamic_shapes: "auto" (default): for a transformers model the batch and sequence dims of its inputs are
        dynamic (token ids and masks: batch and sequence; decoder ids: batch and decoder sequence; pixel_values /
        input_features: batch), so the program runs at other batch sizes and lengths; other models get fixed
        shapes.  None: fixed shapes.  Anything else is handed to torch.export.export as is (keyed by input name
        for a kwargs dict, by position for an args tuple)."""
        if isinstance(dynamic_shapes, str) and dynamic_shapes != "auto":
            raise InvalidArgumentError("Optimizer.export", "dynamic_shapes", "'auto', None, or torch.export "
                                       "dynamic shapes (a dict by input name, a tuple by position)",
                                       repr(dynamic_shapes))
        compiled = self.compile(model, example_inputs=example_inputs, validate=validate)
        dev = next(compiled.parameters()).device
        is_hf = hf_attention.is_transformers_model(compiled)
        if example_inputs is None:
            example_inputs = getattr(compiled, "_opsadv_example_inputs", None)
            if example_inputs is None and is_hf:
                example_inputs = hf_validation_inputs(compiled)
            if example_inputs is None:
                raise InvalidArgumentError("Optimizer.export", "example_inputs", "inputs to trace the model on (kwargs "
                                           "dict, args tuple or tensor) for a model that is not a transformers model",
                                           None)
        inputs = _to(example_inputs, dev)
        if isinstance(inputs, dict):
            args, kwargs = (), dict(inputs)
        else:
            args, kwargs = (tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)), {}
        if isinstance(dynamic_shapes, str):
            dynamic_shapes = auto_dynamic_shapes(kwargs) if is_hf and kwargs else None
        fixed = {}
        try:
            if "use_cache" in inspect.signature(compiled.forward).parameters and "use_cache" not in kwargs:
                fixed["use_cache"] = False        # a KV cache object is no program output
        except (TypeError, ValueError):
            pass
        if dynamic_shapes is None:
            wrapper = _PlainOutputs(compiled, fixed)
        elif kwargs:
            wrapper = _named(compiled, fixed, list(kwargs), keyword=True)
        else:
            wrapper = _named(compiled, fixed, [f"arg{i}" for i in range(len(args))], keyword=False)
            if isinstance(dynamic_shapes, (tuple, list)):
                dynamic_shapes = {f"arg{i}": d for i, d in enumerate(dynamic_shapes)}
        was = compiled.training
        compiled.eval()
        unalias_fused(compiled)
        try:
            with torch.no_grad():
                ep = torch.export.export(wrapper, args, kwargs, strict=False, dynamic_shapes=dynamic_shapes)
        finally:
            compiled.train(was)
        n_ops = sum(1 for n in ep.graph.nodes if n.op == "call_function" and "opsadv" in str(n.target))
        if n_ops == 0:
            raise InvalidArgumentError("Optimizer.export", "model", "a model whose conversion replaced something",
                                       "an exported graph without opsadv ops")
        torch.export.save(ep, str(Path(path)))
        report = getattr(compiled, "opsadv_report", None)
        if report is not None:
            shapes = "fixed shapes"
            if dynamic_shapes is not None and isinstance(dynamic_shapes, dict) and kwargs:
                pinned = _pinned_dims(ep, list(kwargs), dynamic_shapes)
                dyn = sorted({f"{k} dim {d}" for k, v in dynamic_shapes.items() if isinstance(v, dict) for d in v})
                shapes = "dynamic " + ", ".join(dyn) + (f"; the model's code fixed {', '.join(pinned)}" if pinned
                                                        else "")
            elif dynamic_shapes is not None:
                shapes = "dynamic shapes as given"
            report.notes.append(f"exported to {path}: {n_ops} opsadv op calls in the graph ({shapes})")
        return ep


def _check_archive(data: bytes, path: str) -> None:
    """Refuse every entry torch.export's loader would unpickle or execute: pickled weights / tensor
    constants (torch.load(weights_only=False)), TorchScript and opaque objects, legacy pickled payloads,
    AOTInductor libraries, sample inputs that are more than tensors.  Reads only JSON and raw bytes."""
    import json

    from torch.export.pt2_archive import constants as C
    from torch.export.pt2_archive._package import PT2ArchiveReader

    def refuse(entry, reason):
        raise UnsafeArchiveError(path, entry, reason)

    try:
        reader = PT2ArchiveReader(io.BytesIO(data))
    except Exception as e:      # not a zip / not a PyTorch archive
        raise InvalidArgumentError("load", "path", "a .pt2 written by Optimizer.export", f"{path} ({e})") from None
    with reader as r:
        names = r.get_file_names()
        for n in names:
            if n.startswith(C.AOTINDUCTOR_DIR):
                refuse(n, "is AOTInductor compiled code (a shared library loading would run)")
        models = [n[len(C.MODELS_DIR):-len(".json")] for n in names
                  if n.startswith(C.MODELS_DIR) and n.endswith(".json")]
        if not models:
            raise InvalidArgumentError("load", "path", "a .pt2 written by Optimizer.export",
                                       f"{path} (no {C.MODELS_DIR}*.json program in the archive)")
        for m in models:
            for legacy in (f"{C.WEIGHTS_DIR}{m}.pt", f"{C.CONSTANTS_DIR}{m}.pt"):
                if legacy in names:
                    refuse(legacy, "is a legacy pickled payload (torch.load(weights_only=False))")
            for cfg_name, kind in ((C.WEIGHTS_CONFIG_FILENAME_FORMAT.format(m), "weight"),
                                   (C.CONSTANTS_CONFIG_FILENAME_FORMAT.format(m), "constant")):
                if cfg_name not in names:
                    continue
                try:
                    cfg = json.loads(r.read_string(cfg_name)).get("config", {})
                    items = list(cfg.items())
                except (ValueError, AttributeError) as e:
                    refuse(cfg_name, f"is no payload config ({e})")
                for fqn, meta in items:
                    file = str(meta.get("path_name", "")) if isinstance(meta, dict) else ""
                    if not isinstance(meta, dict) or meta.get("use_pickle") is not False:
                        refuse(f"{fqn} ({file or cfg_name})", f"is a pickled {kind} (use_pickle: loading it "
                               "runs torch.load(weights_only=False), which can execute code)")
                    if kind == "constant" and not file.startswith(C.TENSOR_CONSTANT_FILENAME_PREFIX):
                        what = ("a TorchScript object" if file.startswith(C.CUSTOM_OBJ_FILENAME_PREFIX) else
                                "an opaque pickled Python object" if file.startswith(C.OPAQUE_OBJ_FILENAME_PREFIX)
                                else "not a tensor")
                        refuse(f"{fqn} ({file})", f"is {what} (loading it unpickles code)")
            sample = C.SAMPLE_INPUTS_FILENAME_FORMAT.format(m)
            if sample in names:
                blob = r.read_bytes(sample)
                if blob:
                    try:       # torch.export falls back to weights_only=False where this fails
                        torch.load(io.BytesIO(blob), weights_only=True)
                    except Exception as e:
                        refuse(sample, f"holds more than tensors ({type(e).__name__}: {str(e)[:200]})")


def load(path):
    """Load a .pt2 written by Optimizer.export.  Returns a callable module (ExportedProgram.module())
    with the program as `.exported_program`.  Refuses (UnsafeArchiveError, naming the entry) archives
    holding anything but plain tensors: loading those would unpickle code (docs/security.md)."""
    from torch.export.pt2_archive._package import load_pt2

    data = Path(path).read_bytes()        # one read: the checked bytes are the loaded bytes
    _check_archive(data, str(path))
    # load_pt2, not torch.export.load: that one falls back to a legacy zip reader that unpickles
    eps = load_pt2(io.BytesIO(data)).exported_programs
    if "model" not in eps:
        raise InvalidArgumentError("load", "path", "a .pt2 written by Optimizer.export",
                                   f"{path} (programs {sorted(eps)}, no 'model')")
    ep = eps["model"]
    mod = ep.module()
    mod.exported_program = ep
    return mod


def opsadv_op_counts(ep) -> dict[str, int]:
    """opsadv op name -> number of calls in an exported program's graph."""
    counts: dict[str, int] = {}
    for n in ep.graph.nodes:
        if n.op == "call_function" and "opsadv" in str(n.target):
            k = str(n.target)
            counts[k] = counts.get(k, 0) + 1
    return counts
