"""opsadv.convert_model: rewrite a model to run opsadv ops, validate it against the original,
and attach `.opsadv_report` and `.tune_for_hardware()`."""
from __future__ import annotations

import time
import warnings

import torch
from torch import nn

from opsadv.core.errors import InvalidArgumentError
from opsadv.core.policy import Policy, use_backend
from opsadv.core.precision import PrecisionPolicy
from opsadv.core.tuning import seconds_spent
from opsadv.runtime import graphs

from . import (floor as _floor, fp8 as _fp8, fx_rewrite, hf_attention, lm_loss, packing, passes, release, rotary, tp,
               validate as _val)
from .tune import tune_for_hardware
from .report import ConversionReport
from .state import RuntimeState

_CAST = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32, "tf32": torch.float32}
# the rewrite kinds, in application order (convert_model(rewrites={kind: False}) turns one off)
REWRITE_KINDS = ("attention", "rotary", "norm", "residual_norm", "mlp", "qkv", "lm_loss", "fx", "fp8")
# precision="fp8": the policy of everything not in FP8 (bf16 compute, fp32 norm and softmax statistics)
FP8_POLICY = PrecisionPolicy(matmul="bf16", attention="bf16", norm="fp32", softmax="fp32")
_FP8_DICT_KEYS = ("matmul", "matmul_precision", "attention", "attention_proj")


def _check_int(arg: str, value, lo: int, hi: int, allow_none: bool = True) -> None:
    if value is None and allow_none:
        return
    if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
        raise InvalidArgumentError("convert_model", arg, f"an int in [{lo}, {hi}]" + (" or None" if allow_none else ""),
                                   repr(value))


def check_seed_args(opt_level, tile_size, max_streams, mem_opt, use_fp16=None, validate=True) -> None:
    _check_int("opt_level", opt_level, 0, 3, allow_none=False)
    _check_int("tile_size", tile_size, 32, 256)
    if tile_size is not None and tile_size & (tile_size - 1):
        raise InvalidArgumentError("convert_model", "tile_size", "a power of two in [32, 256]", repr(tile_size))
    _check_int("max_streams", max_streams, 1, 8)
    _check_int("mem_opt", mem_opt, 0, 3)
    if use_fp16 is not None and not isinstance(use_fp16, bool):
        raise InvalidArgumentError("convert_model", "use_fp16", "a bool or None", repr(use_fp16))
    if validate not in (True, False, "warn"):
        raise InvalidArgumentError("convert_model", "validate", "True, False or 'warn'", repr(validate))


def check_rewrites(rewrites) -> None:
    if rewrites is None:
        return
    if not isinstance(rewrites, dict) or any(k not in REWRITE_KINDS or not isinstance(v, bool)
                                             for k, v in rewrites.items()):
        raise InvalidArgumentError("convert_model", "rewrites", f"None or a dict {{kind: bool}} over the kinds "
                                   f"{list(REWRITE_KINDS)} (False: not applied)", repr(rewrites))


def split_fp8(precision) -> tuple[object, bool]:
    """(precision without its FP8 part, whether FP8 GEMMs were asked for): "fp8" is the bf16 policy plus FP8 GEMMs; a
    precision dict's {"matmul": "fp8"} asks for FP8 GEMMs over the rest of the dict ({"attention": "fp8"} is taken
    and reported as not wired yet)."""
    if isinstance(precision, str) and precision.lower() == "fp8":
        return "fp8", True
    if isinstance(precision, dict) and any(str(precision.get(k, "")).lower() == "fp8" for k in _FP8_DICT_KEYS):
        if not any(str(precision.get(k, "")).lower() == "fp8" for k in ("matmul", "matmul_precision")):
            raise InvalidArgumentError("convert_model", "precision", "FP8 attention together with FP8 GEMMs "
                                       "({'matmul': 'fp8', 'attention': 'fp8'}): attention alone in FP8 is not wired",
                                       repr(precision))
        return {k: v for k, v in precision.items() if not (k in _FP8_DICT_KEYS and str(v).lower() == "fp8")}, True
    return precision, False


def resolve_precision(precision, use_fp16) -> tuple[PrecisionPolicy, torch.dtype | None, str]:
    """(policy, dtype to cast the model to or None, label)."""
    if isinstance(precision, str) and precision.lower() == "fp8":
        if use_fp16:
            raise InvalidArgumentError("convert_model", "use_fp16", f"consistent with precision={precision!r}", "True")
        return FP8_POLICY, torch.bfloat16, "fp8"
    if use_fp16 and precision is not None and precision not in ("fp16", torch.float16):
        raise InvalidArgumentError("convert_model", "use_fp16", f"consistent with precision={precision!r}", "True")
    if precision is None and use_fp16:
        precision = "fp16"
    if precision is None:
        return PrecisionPolicy(), None, "model dtype"
    if isinstance(precision, torch.dtype):
        names = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}
        if precision not in names:
            raise InvalidArgumentError("convert_model", "precision", "fp16, bf16 or fp32", str(precision))
        precision = names[precision]
    if isinstance(precision, PrecisionPolicy):
        return precision, None, str(precision)
    if isinstance(precision, dict):               # the precision dict: the policy only, the model keeps its dtype
        pol = PrecisionPolicy.from_dict(precision)
        return pol, None, ", ".join(f"{k}={v}" for k, v in precision.items())
    if isinstance(precision, str) and precision.lower() in ("float16", "half", "bfloat16", "float32"):
        precision = {"float16": "fp16", "half": "fp16", "bfloat16": "bf16", "float32": "fp32"}[precision.lower()]
    pol = PrecisionPolicy.from_string(precision)   # raises InvalidArgumentError for anything else
    return pol, _CAST[precision.lower()], precision.lower()


def build_policy(backend, precision: PrecisionPolicy, opt_level, tile_size, max_streams, mem_opt,
                 cuda_graphs: bool = False) -> RuntimeState:
    """The state that decides the policy the converted model's ops run under (see state.py).  A model
    that replays CUDA graphs resolves (and tune_for_hardware measures) on GPU time (Policy.timing)."""
    if not isinstance(backend, str):
        raise InvalidArgumentError("convert_model", "backend", "a backend name or 'auto'", repr(backend))
    opts = {k: v for k, v in (("tile_size", tile_size), ("max_streams", max_streams), ("mem_opt", mem_opt))
            if v is not None}
    overrides = {}
    if opts:
        overrides["options"] = opts
    if precision != PrecisionPolicy():
        overrides["precision"] = precision
    if opt_level >= 3:
        overrides["experimental"] = True
    timing = "graph" if cuda_graphs else "wall"
    if cuda_graphs:
        overrides["timing"] = timing
    if backend == "auto":
        return RuntimeState(None, overrides)
    with use_backend(backend):                     # validates the name and availability; no global change
        pass
    return RuntimeState(Policy(backend=backend, experimental=opt_level >= 3, precision=precision,
                               options=tuple(sorted(opts.items())), timing=timing))


def _model_name(model) -> str:
    cfg = getattr(model, "config", None)
    return type(model).__name__ + (f" ({cfg.model_type})" if getattr(cfg, "model_type", None) else "")


class _Tuner:
    """`model.tune_for_hardware(...)`, attached per instance (the model keeps its class): tunes the model in place
    and returns it (`optimized = converted.tune_for_hardware(...)`), the report on `model.opsadv_tune_report`."""

    def __init__(self, model):
        self.model = model

    def __call__(self, device="cuda:0", batch_size: int = 8, seq_len: int | None = None, **kw):
        self.model.opsadv_tune_report = tune_for_hardware(self.model, device=device, batch_size=batch_size,
                                                          seq_len=seq_len, **kw)
        return self.model

    def __reduce__(self):
        # pickle / deepcopy memoize the model before its state, so this is a back-reference, not a copy
        return (_Tuner, (self.model,))


class _Originals:
    """A model's parameters and buffers (the objects and their data) before convert_model casts it: a conversion
    that is refused or fails puts them back exactly, not cast back (fp32 -> fp16 -> fp32 loses bits).  Until then
    the originals stay referenced, so a cast model briefly holds both copies."""

    def __init__(self, model: nn.Module):
        # (a cast changes .data of the parameter objects and of their .grad objects, and replaces buffers)
        self.params = [(m, n, p, p.data, p.grad, None if p.grad is None else p.grad.data)
                       for m in model.modules() for n, p in m._parameters.items() if p is not None]
        self.buffers = [(m, n, b) for m in model.modules() for n, b in m._buffers.items() if b is not None]

    def restore(self) -> None:
        with torch.no_grad():
            for m, n, p, data, grad, grad_data in self.params:
                p.grad = None
                p.data = data
                if grad is not None:
                    grad.data = grad_data
                p.grad = grad
                m._parameters[n] = p
            for m, n, b in self.buffers:
                m._buffers[n] = b


def _eval_mode(model):
    modes = {m: m.training for m in model.modules()}
    model.eval()
    return modes


def _restore_modes(modes) -> None:
    for m, t in modes.items():
        m.training = t


def convert_model(model: nn.Module, *, backend: str = "auto", precision=None, opt_level: int = 2,
                  tile_size: int | None = None, use_fp16: bool | None = None, max_streams: int | None = None,
                  mem_opt: int | None = None, validate=True, example_inputs=None, pack_padding: bool | None = None,
                  cuda_graphs: bool = False, max_graphs: int = 8, floor: bool | None = None, floor_inputs=None,
                  floor_mode: str = "inference", floor_timer=None, floor_compile=None, floor_cache: bool | None = None,
                  rewrites: dict | None = None, fp8_recipe: "_fp8.Fp8Recipe | None" = None) -> nn.Module:
    """Rewrite `model` in place to run opsadv ops and return it (same object, same class).

    opt_level 0: nothing; 1: attention, rotary embedding and norms; 2: + fused QKV GEMM, dense+residual+norm, MLP GEMM
    epilogues (SwiGLU, GeGLU, GELU); 3: + impls marked experimental.  mem_opt (0-3, None = untouched): >= 2
    runs gated (SwiGLU / GeGLU) MLPs over row chunks and applies the runtime memory policy; 3 also keeps q/k/v as
    three GEMMs (lower activation peak than the fused QKV GEMM) and frees each norm's output after
    its last reader in no-grad calls (readers found by a probe forward; opsadv.convert.release).  The result is validated against the
    original on `example_inputs` (a dict of kwargs, a tuple of args or a tensor; generated for
    transformers models); beyond the limits (see opsadv.convert.validate) the conversion is undone
    and ValidationError raised with the numbers, unless validate="warn" (kept, flagged in the
    report) or False.  `precision` ("fp16"/"bf16"/"fp32") casts the model first (a refused or failed conversion
    puts the original parameters and buffers back, dtypes and values); the seed
    parameters tile_size/max_streams/mem_opt are validated and handed to the kernels as options.

    pack_padding (None = on at opt_level >= 2): BERT-style encoders run padded batches on their real
    tokens only (opsadv.convert.packing; outputs at padded positions are 0).
    cuda_graphs: the forward replays CUDA graphs, one per input signature (at most `max_graphs`,
    least recently used dropped; see opsadv.runtime.graphs).  Inference only: a call with gradients
    enabled or a module in training mode raises InvalidArgumentError.  Outputs are fresh tensors.

    floor (None = on unless OPSADV_CONVERT_FLOOR=0): never slower than before.  Each rewrite kind is
    timed right before and after it is applied and undone where the model got slower; the report says
    so with the numbers (opsadv.convert.floor).  Timed on `floor_inputs` (give the batch you will run;
    default: the validation inputs, and on a GPU a b4 s1024 token batch for transformers text models),
    as `floor_mode` "inference" (no-grad forward), "train" (forward + backward) or "generate"; `floor_timer`
    (fn -> ms) replaces the clock.  floor_compile ("regional" / True, "full"; None: eager): for a model you will
    run under torch.compile, each step is timed compiled that way (a rewrite that wins eager can lose to
    Inductor's own fusion); conversion then compiles once per step.  floor_cache (None = on unless
    OPSADV_CONVERT_FLOOR_CACHE=0): the decisions are stored on disk per machine, model, floor inputs and mode
    (floor.py's docstring), and converting the same model the same way on the same machine again applies them
    without timing (the report marks them "cached"); False measures again and stores the new ones.  The
    "lm_loss" kind (a causal LM's loss from its final hidden states, opsadv.convert.lm_loss) changes only training
    calls with labels: the floor times it in floor_mode "train" alone and applies it untimed otherwise.

    rewrites: {kind: False} leaves that rewrite kind out (kinds: REWRITE_KINDS; True: as opt_level says), e.g.
    rewrites={"lm_loss": False} keeps the model's logits and loss in training.

    precision="fp8" (or a precision dict with {"matmul": "fp8"}): the model is cast to bf16 (the dict keeps its
    dtype), then its GEMMs run opsadv.ops.scaled_gemm in FP8 block by block where validation against the bf16
    conversion keeps them (KL, top-1: validate.FP8_LIMITS); inference in e4m3 with per-channel weight and per-token
    current activation scales, grad-recording calls with the FP8 training recipe (fp8_recipe: Fp8Recipe, delayed
    scaling over an amax history, e5m2 gradients).  Where no FP8 kernel serves the device the GEMMs stay bf16 and
    the report says why; with a pinned backend that raises.  opsadv.convert.fp8 has the details."""
    options = {k: v for k, v in locals().items() if k != "model"}     # (for the model inside a wrapper)
    compiled = compiled_inner(model)
    if compiled is not None:                 # torch.compile(model): convert the model inside, keep the wrapper
        convert_model(compiled, **options)   # (the wrapper's graphs recompile at the next call: its guards see it)
        return model
    inner = peft_base_model(model)
    if inner is not None:                    # a PEFT (LoRA ...) wrapper: convert the transformers model inside it
        convert_model(inner, **options)
        return _adopt(model, inner)
    inner = transformers_inside(model) if example_inputs is None else None
    if inner is not None:                    # SentenceTransformer, CrossEncoder, a head on a transformers backbone:
        cast = resolve_precision(split_fp8(precision)[0], use_fp16)[1]
        before = _Originals(model) if cast is not None else None
        if cast is not None:                 # the wrapper's own layers too (a head in fp32 on bf16 states fails)
            model.to(cast)
        try:
            convert_model(inner, **options)  # the transformers model inside, validated on its own inputs
        except BaseException:
            if before is not None:
                before.restore()
            raise
        return _adopt(model, inner)
    check_seed_args(opt_level, tile_size, max_streams, mem_opt, use_fp16, validate)
    check_rewrites(rewrites)
    _floor.check_args(floor, floor_mode, floor_timer, floor_compile, floor_cache)
    check_graph_args(model, pack_padding, cuda_graphs, max_graphs)
    if not isinstance(model, nn.Module):
        raise InvalidArgumentError("convert_model", "model", "a torch.nn.Module", type(model).__name__)
    check_weights_loaded(model)
    t0 = time.perf_counter()
    precision, use_fp8 = split_fp8(precision)
    if fp8_recipe is not None and not (use_fp8 and isinstance(fp8_recipe, _fp8.Fp8Recipe)):
        raise InvalidArgumentError("convert_model", "fp8_recipe", "an opsadv.convert.Fp8Recipe, with precision='fp8'",
                                   repr(fp8_recipe))
    if use_fp8 and opt_level == 0:
        raise InvalidArgumentError("convert_model", "opt_level", "1 or more with precision='fp8' (opt_level 0 converts "
                                   "nothing)", "0")
    pp, cast, label = resolve_precision(precision, use_fp16)
    if use_fp8 and label != "fp8":
        label = f"fp8 GEMMs, {label}"
    state = build_policy(backend, pp, opt_level, tile_size, max_streams, mem_opt, cuda_graphs)
    prev_state = getattr(model, "_opsadv_state", None)
    if prev_state is not None:
        raise InvalidArgumentError("convert_model", "model", "a model not converted yet", "an opsadv-converted model")
    check_not_wrapped(model)
    before = _Originals(model) if cast is not None else None
    if cast is not None:
        model.to(cast)
    try:
        report = ConversionReport(_model_name(model), opt_level, backend, label)
        if use_fp8:
            report.notes.append("precision fp8: attention as the report's fp8 line says; norms and softmax statistics "
                                "fp32")
        if opt_level >= 3:
            report.notes.append("opt_level 3: experimental kernels allowed")
        is_hf = hf_attention.is_transformers_model(model)
        inputs = example_inputs
        if inputs is None and is_hf:
            inputs = _val.hf_validation_inputs(model)
        if validate and opt_level > 0 and inputs is None:
            raise InvalidArgumentError("convert_model", "example_inputs",
                                       "validation inputs (kwargs dict, args tuple or tensor) for a model that is not a "
                                       "transformers model, or validate=False", None)
        dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
        modes = _eval_mode(model)
        t_val, tune0 = time.perf_counter(), seconds_spent()
        try:
            ref = _val.check_run(model, inputs) if validate and opt_level > 0 else None
            ref32, no_ref32 = None, "not needed"
            if ref is not None and dtype in (torch.float16, torch.bfloat16) and not use_fp8:
                ref32, no_ref32 = _val.fp32_reference(model, inputs)     # (the original's own rounding, see validate)
        finally:
            _restore_modes(modes)
        t_val, val_tuned = time.perf_counter() - t_val, seconds_spent() - tune0
        undo = passes.Undo()
        root = model
        use_floor = opt_level > 0 and (_floor.default_enabled() if floor is None else floor)
        if use_floor and tp.any_dtensor(model):
            use_floor = False
            report.notes.append("floor not measured: tensor-parallel model (each rank would time, and keep or undo "
                                "rewrites, on its own; all ranks must convert alike)")
        gate = None
        if use_floor:
            finputs = floor_inputs if floor_inputs is not None else _default_floor_inputs(model, is_hf, inputs)
            if finputs is None:
                report.notes.append("floor not measured: no inputs to time (pass floor_inputs or example_inputs)")
            else:
                context = (f"backend={backend} precision={label} opt_level={opt_level} mem_opt={mem_opt} "
                           f"tile_size={tile_size} max_streams={max_streams} pack_padding={pack_padding} "
                           f"cuda_graphs={cuda_graphs} rewrites={sorted((rewrites or {}).items())}")
                gate = _floor.Floor(finputs, floor_mode, floor_timer, _floor.compile_mode(floor_compile), model=model,
                                    cache=_floor.cache_default() if floor_cache is None else floor_cache,
                                    context=context, model_name=report.model)
                if gate.compile:
                    report.notes.append(f"floor timed under torch.compile ({gate.compile})")
        t_steps, tune_steps = time.perf_counter(), seconds_spent()
        try:
            fp8 = None
            if use_fp8:
                fp8 = dict(recipe=fp8_recipe or _fp8.Fp8Recipe(), inputs=inputs if validate else None,
                           backend=backend, memo={}, attention=is_hf and opt_level >= 1
                           and (rewrites is None or rewrites.get("attention", True) is not False))
            for kind, label, apply in _steps(is_hf, opt_level, mem_opt, pack_padding, state, fp8):
                if rewrites is not None and rewrites.get(kind, True) is False:
                    report.add("kept", "", label, f"rewrites={{{kind!r}: False}}")
                    continue
                timed = gate is not None and _floor.times(kind, gate.mode)
                n = len(report.changes)
                root = _run_step(root, kind, label, apply, report, undo, gate if timed else None)
                if gate is not None and not timed and any(c.kind != "skipped" for c in report.changes[n:]):
                    report.notes.append(f"floor: {kind} not timed ({_floor.UNTIMED_WHY[kind]} and floor_mode="
                                        f"{gate.mode!r})")
            passes.memory_pass(model, report, mem_opt)
            if mem_opt is not None and mem_opt >= release.RELEASE_MEM_OPT and opt_level >= 1:
                modes = _eval_mode(root)             # probe the model as it will run (after the fx rewrite)
                try:
                    release.release_pass(root, report, undo, inputs, _val.check_run)
                finally:
                    _restore_modes(modes)
            runner = _install_graphs(root, report, undo, max_graphs) if cuda_graphs else None
        except Exception:
            undo.revert()
            raise
        t_steps, steps_tuned = time.perf_counter() - t_steps, seconds_spent() - tune_steps
        t1, tune1 = time.perf_counter(), seconds_spent()
        if ref is not None:
            modes = _eval_mode(root)
            try:
                new = _val.check_run(root, inputs)
            except Exception:
                undo.revert()
                raise
            finally:
                _restore_modes(modes)
            metrics = _val.compare(ref, new, inputs, dtype, limits=_val.FP8_LIMITS if report.fp8 else None)
            if not metrics["passed"] and not report.fp8:
                metrics = (_val.within_own_rounding(metrics, ref, new, ref32, inputs) if ref32 is not None
                           else dict(metrics, no_fp32_reference=no_ref32))
            report.validation = metrics
            if not metrics["passed"]:
                if validate is True:
                    undo.revert()
                    raise _val.ValidationError(report.model, metrics)
                report.status = "converted (validation FAILED; kept because validate='warn')"
                warnings.warn(f"opsadv.convert_model: {report.model} differs from the original beyond the limits: "
                              f"{metrics}", RuntimeWarning, stacklevel=2)
        elif opt_level > 0:
            report.notes.append("not validated (validate=False)")
        if gate is not None:
            report.floor = [d.to_dict() for d in gate.decisions]
            if gate.reused:
                report.notes.append(f"floor: {gate.reused} of {len(gate.decisions)} decisions reused, as measured "
                                    f"before on this machine ({_floor.DECISIONS.path()}); floor_cache=False "
                                    "measures again")
        floor_s, floor_tuned = (gate.seconds, gate.tuning) if gate is not None else (0.0, 0.0)
        v_tuned = val_tuned + seconds_spent() - tune1
        # exclusive phases: autotuning (the first calls of new buckets, wherever they fell) counted on its own
        report.phases = {"floor": floor_s - floor_tuned, "autotune": seconds_spent() - tune0,
                         "validation": max(t_val + time.perf_counter() - t1 - v_tuned, 0.0),
                         "rewrites": max(t_steps - floor_s - (steps_tuned - floor_tuned), 0.0)}
        report.seconds = time.perf_counter() - t0
        root._opsadv_state = state
        root._opsadv_example_inputs = inputs
        root.opsadv_report = report
        root.tune_for_hardware = _Tuner(root)
        if runner is not None:
            root.opsadv_graphs = runner
        return root
    except BaseException:
        if before is not None:      # refused or failed: the model goes back to its own dtypes and values
            before.restore()
        raise


def compiled_inner(model):
    """The module inside torch.compile's wrapper (OptimizedModule._orig_mod), else None.  The wrapper forwards
    attribute reads to it, so the report and the state read through the wrapper too."""
    inner = getattr(model, "_orig_mod", None)
    if not isinstance(inner, nn.Module):     # (checked first: torch._dynamo is imported only for a wrapper)
        return None
    return inner if isinstance(model, torch._dynamo.eval_frame.OptimizedModule) else None


def check_weights_loaded(model: nn.Module) -> None:
    """Refuse a model with parameters on the meta device: accelerate's offloading (device_map entries "disk" or
    offloaded "cpu", cpu_offload / disk_offload) loads them only inside each module's forward, around calls that
    fused weights and replaced modules would not make; a model built on meta has no weights yet."""
    meta = [n for n, p in model.named_parameters() if p.device.type == "meta"]
    if meta:
        where = getattr(model, "hf_device_map", None)
        disk = isinstance(where, dict) and "disk" in {str(d) for d in where.values()}
        raise InvalidArgumentError(
            "convert_model", "model", "a model whose weights are in memory (no parameter on the meta device)",
            f"{len(meta)} parameters on the meta device, e.g. {meta[0]}"
            + (" (hf_device_map offloads to disk)" if disk else "")
            + ": offloaded weights are loaded only inside each module's own forward, which opsadv's fused weights "
            "and replaced modules would bypass; load the model without offloading (device_map on the GPU), or run "
            "it unconverted")


def peft_base_model(model):
    """The transformers model inside a PEFT wrapper (peft.PeftModel: LoRA and the other adapters keep it at
    get_base_model()), else None.  Duck-typed: peft is not imported."""
    if not type(model).__module__.startswith("peft.") or not callable(getattr(model, "get_base_model", None)):
        return None
    inner = model.get_base_model()
    return inner if inner is not model and hf_attention.is_transformers_model(inner) else None


def _adopt(model: nn.Module, inner: nn.Module) -> nn.Module:
    """The wrapper of a converted inner model shows its report, state, tuner and graphs."""
    for name in ("_opsadv_state", "opsadv_report", "tune_for_hardware", "opsadv_graphs"):
        if name in vars(inner):
            model.__dict__[name] = vars(inner)[name]
    return model


def transformers_inside(model):
    """The one transformers model inside a module that is none itself (sentence-transformers' SentenceTransformer
    and CrossEncoder, a task head around a backbone), which convert_model converts when given no example_inputs
    (it generates that model's inputs); None where the module is a transformers model or holds none.  Several
    (a dual encoder) raise: each is converted by its own call.  Data-parallel wrappers are not holders (the main
    path refuses them: check_not_wrapped)."""
    if (not isinstance(model, nn.Module) or hf_attention.is_transformers_model(model)
            or isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)) or tp.fsdp_managed(model)):
        return None
    found: list[tuple[str, nn.Module]] = []
    for path, m in model.named_modules():
        if hf_attention.is_transformers_model(m) and not any(path.startswith(p + ".") for p, _ in found):
            found.append((path, m))
    if len(found) > 1:
        raise InvalidArgumentError(
            "convert_model", "model", "a transformers model, one module holding one, or example_inputs for the "
            "whole module", f"{type(model).__name__} holding {len(found)} transformers models "
            f"({', '.join(p for p, _ in found)}): convert each, e.g. opsadv.convert_model(model.{found[0][0]})")
    return found[0][1] if found else None


def check_not_wrapped(model) -> None:
    """Data-parallel wrappers come after conversion: FSDP2's fully_shard leaves each module's parameters sharded
    outside its forward (the conversion's probes and fused weights would read shards), and DDP registered its
    gradient hooks for the module it wraps."""
    if tp.fsdp_managed(model):
        raise InvalidArgumentError("convert_model", "model", "a model not sharded by FSDP2 yet: convert first, then "
                                   "fully_shard (docs/distributed.md)", "a model wrapped by fully_shard")
    if isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
        kind = type(model).__name__
        raise InvalidArgumentError("convert_model", "model", f"a model not wrapped in {kind} yet: convert it first, "
                                   "then wrap it (docs/distributed.md)", f"a {kind}")


def check_graph_args(model, pack_padding, cuda_graphs, max_graphs) -> None:
    if pack_padding is not None and not isinstance(pack_padding, bool):
        raise InvalidArgumentError("convert_model", "pack_padding", "a bool or None", repr(pack_padding))
    if not isinstance(cuda_graphs, bool):
        raise InvalidArgumentError("convert_model", "cuda_graphs", "a bool", repr(cuda_graphs))
    _check_int("max_graphs", max_graphs, 1, 64, allow_none=False)
    if cuda_graphs and isinstance(model, nn.Module):
        dev = next((p.device for p in model.parameters()), None)
        if dev is None or dev.type != "cuda":
            raise InvalidArgumentError("convert_model", "cuda_graphs", "a model on a CUDA device (CUDA graphs)",
                                       f"a model on {dev}")


def _install_graphs(root, report, undo, max_graphs):
    hint = packing.graph_hint(root) if any(c.kind == "packed" for c in report.changes) else None
    runner = graphs.install(root, max_graphs=max_graphs, hint=hint)
    undo.instance_attrs.append((root, "forward"))
    report.add("graphs", "", f"{type(root).__name__}.forward replays CUDA graphs (one per input signature, "
               f"<= {max_graphs} kept; outputs are fresh tensors)" +
               ("; padded batches keyed by their real-token bucket (one host read of the mask per call)"
                if hint is not None else ""),
               "inference only: gradients enabled or training mode raise")
    return runner


def _steps(is_hf: bool, opt_level: int, mem_opt, pack_padding, state, fp8: dict | None = None):
    """(kind, what stays if the step is undone, apply(root, report, undo) -> root), in application order.  fp8:
    fp8_pass's keywords under precision="fp8" (the GEMMs go FP8 last, over the modules the other steps made)."""
    def each(fn):
        def apply(root, report, undo):
            fn(root, report, undo)
            return root
        return apply
    out = []
    pack = is_hf and opt_level >= 1 and (pack_padding or (pack_padding is None and opt_level >= 2))

    def attention(m, r, u):
        # packing pays only with opsadv's attention (the varlen path): one step, judged together
        if hf_attention.attention_pass(m, r, u, state) and pack:
            packing.packing_pass(m, r, u)
    if opt_level >= 1:
        if is_hf:
            out.append(("attention", "the model's own attention implementation" + (" (and padded batches run "
                        "padded)" if pack else ""), each(attention)))
        if is_hf:
            out.append(("rotary", "transformers' rotary embedding (apply_rotary_pos_emb)",
                        each(lambda m, r, u: rotary.rotary_pass(m, r, u, state))))
        out.append(("norm", "the model's own norms", each(lambda m, r, u: passes.norm_pass(m, r, u, state))))
    if opt_level >= 2:
        out.append(("residual_norm", "the model's own dense + residual + norm blocks",
                    each(lambda m, r, u: passes.residual_norm_pass(m, r, u, state))))
        out.append(("mlp", "the model's own MLPs", each(lambda m, r, u: passes.mlp_pass(m, r, u, state))))
        out.append(("qkv", "separate q / k / v projections",
                    each(lambda m, r, u: passes.qkv_pass(m, r, u, state, mem_opt))))
        if is_hf:
            out.append((lm_loss.KIND, lm_loss.LABEL, each(lambda m, r, u: lm_loss.lm_loss_pass(m, r, u, state))))
    if opt_level >= 1 and not is_hf:
        out.append(("fx", "the model's own graph (no torch.fx rewrite)",
                    lambda m, r, u: fx_rewrite.fx_pass(m, r, u, state, opt_level)))
    if fp8 is not None:
        out.append((_fp8.KIND, _fp8.LABEL, each(lambda m, r, u: _fp8.fp8_pass(m, r, u, state, **fp8))))
    return out


def _run_step(root, kind, label, apply, report, undo, gate):
    """Apply one rewrite step into `undo`; with the floor on, time it both ways and undo it where slower.

    The floor times B A A B blocks (floor.py's docstring): the step is reverted and re-applied between the sides,
    a second block while its samples disagree, and it stays applied only if every block ratio is >= 1.  Compiled
    floors too: each side compiles once, and its later samples reuse dynamo's cached graphs."""
    first = len(report.changes)
    notes = len(report.notes)
    state = {"step": passes.Undo(), "on": True}
    new_root = apply(root, report, state["step"])
    if gate is None or state["step"].empty():
        undo.extend(state["step"])
        return new_root

    def drop():
        state["step"].revert()
        del report.changes[first:]
        del report.notes[notes:]
        state["on"] = False

    def turn(on: bool):
        nonlocal new_root
        if on == state["on"]:
            return
        if on:
            state["step"] = passes.Undo()
            new_root = apply(root, report, state["step"])
            state["on"] = True
        else:
            drop()

    def sample(on: bool) -> float:
        turn(on)
        try:
            return gate.time(new_root if on else root)
        except Exception:
            if state["on"]:
                drop()
            raise

    step = [str(c) for c in report.changes[first:]]
    d = gate.recall(kind, label, step)
    if d is not None:                                      # measured before: decided without timing
        if d.kept:
            undo.extend(state["step"])
            return new_root
        drop()
        _report_undone(report, kind, label, d, gate.mode)
        return root
    without, with_ = [], []
    while True:
        for on in (True, False, False, True):              # B A A B: one toggle per side change
            (with_ if on else without).append(sample(on))
        pairs = list(zip(without[-2:], with_[-2:]))
        blocks = [(sum(without[i:i + 2]), sum(with_[i:i + 2])) for i in range(0, len(without), 2)]
        if len(blocks) >= _floor.MAX_BLOCKS or not (_floor.blocks_disagree(pairs) if len(blocks) == 1
                                                      else _floor.blocks_disagree(blocks)):
            break
    d = gate.decide_blocks(kind, label, without, with_, step)
    if d.kept:
        turn(True)
        undo.extend(state["step"])
        return new_root
    if state["on"]:
        drop()
    _report_undone(report, kind, label, d, gate.mode)
    return root


def _report_undone(report, kind: str, label: str, d, mode: str) -> None:
    blocks = ", ".join(f"{r:.3f}x" for r in d.block_ratios)
    report.add("kept", "", label, f"opsadv's {kind} rewrite measured {d.ratio:.3f}x ({d.ms_with:.4g} ms with it vs "
               f"{d.ms_without:.4g} ms without, {mode}"
               + (f", {len(d.block_ratios)} blocks" if d.block_ratios else "")
               + ("; cached decision" if d.measured_at is not None else "") + ")"
               + (f", inconclusive: blocks on both sides of 1.0 ({blocks})" if d.inconclusive else "")
               + ": not applied")


def _default_floor_inputs(model, is_hf: bool, inputs):
    """The validation inputs; for a transformers text model on a GPU, a b4 s1024 token batch (the validation
    batch is too small there to time anything but host overhead)."""
    dev = next((p.device for p in model.parameters()), None)
    if is_hf and dev is not None and dev.type == "cuda" and isinstance(inputs, dict) and "input_ids" in inputs:
        cfg = model.config
        maxpos = getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", None) or 1024
        big = _val.hf_validation_inputs(model, batch=4, seq=min(1024, int(maxpos)))
        big["attention_mask"].fill_(1)
        return big
    return inputs
