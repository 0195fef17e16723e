"""Bench suite "models": the model matrix of issue 34, architecture x size x mode, random weights, bf16.

Every entry of model_zoo.ZOO at "0.5b" and "1.5b" (quick: "tiny", short sequences, fp32 on a CPU), in the
modes of its kind (labels in `mode`, the heatmap's columns):
  prefill b1 / prefill    causal LMs b1 and b8 s2048 (last-token logits where the model takes logits_to_keep);
                          encoders b32 s512 with ~30% right padding; ViT b32 images; T5 / BART b8 s512 (~30%
                          padding) with 128 decoder tokens
  decode bN dynamic/static  generate(128 new tokens, greedy) at b1 and b8 from a 512-token prompt, over a
                          DynamicCache and a StaticCache (cache_implementation="static"; generate's own
                          auto-compile of static caches off: disable_compile=True, eager is eager)
  decode bN paged         llama3 1.5b (Llama-3.2-1B's dimensions) only, b1 / b8 / b32, 512-token prompt, 256 new
                          tokens (quick: llama3 tiny b2): the converted model's generate over opsadv.PagedKVCache
                          (prompt + new tokens per sequence, pages of 16) as a user runs it for speed: on CUDA
                          convert_model(cuda_graphs=True) + PagedKVCache(static=True), prefill eager and every decode
                          step a CUDA-graph replay (on a CPU, where graphs do not exist, the static cache eager; the
                          row's `paged` says `cuda_graphs`, `static` and the graph counts of one generate), with
                          `opsadv_eager` (the same converted modules' eager forward over PagedKVCache(static=False),
                          the contender before graphs) as a peer; converted without the floor (its generate
                          timing runs transformers' DynamicCache, never the paged path); against `hf_static_compile` (the baseline:
                          the unconverted model, generate(cache_implementation="static") with its own auto-compile,
                          CompileConfig's defaults on CUDA, the eager backend on a CPU; a peer generate left
                          uncompiled is an error), `unconverted` (DynamicCache, eager) and `liger`; rate in tok/s
                          (new tokens x batch / s); the row's `paged` names the kernel that served decode
                          (cache.explain()) and the calls per generate, `tokens_equal_<peer>` the greedy tokens'
                          agreement (position by position, and `tokens_equal_prefix_<peer>` before the first
                          difference) with the unconverted model's and the baseline's
  train / train padded    forward + backward + AdamW step (lr 1e-6: parameters stay put), causal LMs b4
                          s2048, padded = the last row right-padded by 300 tokens (labels -100 there);
                          causal LMs also "train packed": the same 8192 tokens as one padding-free row of
                          sequences of 256-2048 tokens with their own position ids (DataCollatorWithFlattening's
                          form, model_zoo.packed_inputs), eager and compiled;
                          encoders b32 s512 sequence classification (padded ~30%); ViT b32; T5 / BART b8
                          s512/128
and each again " compiled": compiled converted vs compiled unconverted.  FP8 cells, GPU only (convert_model(precision=
"fp8"), issue 42): "prefill fp8 b8 s2048 llama3 1.5b" and "train fp8 b4 s2048 llama3 1.5b", Llama-3.2-1B's
dimensions, against `opsadv_bf16` (our bf16 conversion of the same model: the baseline) and `unconverted`; the row
carries the conversion's per-block FP8 decision (`fp8`), and a prefill row's rel_err is the KL divergence of its
last-token logits from the peer's (FP8's limit is KL < 0.01; `check` has rel err and top-1 too).  Both again
" compiled": the FP8 conversion and the bf16 one (the baseline) compiled the same way (regional by default).
One more cell, GPU only (left out on a CPU), the causal-LM loss: "train bf16 b4 s2048 llama3 8b-4l", Llama-3-8B's dimensions (hidden 4096, 32/8 heads,
intermediate 14336, untied vocabulary 128256) cut to 4 layers, where the (b*s, V) float32 logits of the unconverted
model's loss are the step's largest tensors (convert_model's lm_loss rewrite and Liger's fused linear cross-entropy
compute the loss without them).  Every train row on a GPU carries each contender's peak memory of one step beyond
what was allocated before it (`<contender>_peak_mib`: opsadv, unconverted / hf_compile, liger).  Compilation (OPSADV_MODELS_COMPILE):
"regional" (default; every repeated block, the model's _no_split_modules, compiled with torch.compile, as
transformers recommends to bound compile time: one layer is compiled, not 24) or "full"
(torch.compile(model)); the row says which (`compile`).  Decode cells compile with dynamic shapes left to
dynamo (the cache grows), the others with dynamic=False.

Contenders, each built with its own config object: opsadv = opsadv.convert_model(copy.deepcopy(base),
validate="warn", example_inputs=a small batch of the cell's kind, floor_inputs=the cell's batch,
floor_mode=the cell's mode, floor_compile=how compiled cells compile) (OPSADV_MODELS_FLOOR=default: convert_model's own floor inputs; =off: no floor,
the quick grid's default: timings of tiny models on a CPU decide nothing);
peers: `unconverted` (the same model, attn_implementation "sdpa" where transformers has it, eager cells),
`hf_compile` (compiled cells), `liger` (eager cells of architectures Liger supports: Liger-patched copy,
built last, its module-level patches swapped in only during its calls, see liger_peer.py; an apply function
that fails makes the peer fail, recorded in peer_errors).  speedup is against `unconverted` (eager) or
`hf_compile` (compiled), `ratios` against every peer.

Correctness per cell: inference rows compare the outputs with the baseline's (opsadv.convert.validate.compare:
rel err, KL, top-1 of logits; rel_err is the runner's); decode rows run the opsadv contender's generate with
its step logits and compare them with the unconverted model's logits on the same tokens (teacher forcing, no
cache); train rows compare the loss and every parameter's gradient of one step with the unconverted eager
model's before timing (grad_max_rel_err, grad_worst; model_zoo.grad_errors), and rel_err is of the losses.
Timing: `calls` single calls per contender and round (CUDA events) in 3 interleaved rounds: prefill 5 calls,
train 3, decode 1 (2 rounds at >= 40 layers).  work is 2 x non-embedding parameters x tokens (x3 training):
the TFLOP/s column is a rough rate, the ratios are the result.  Models live in `_live` for one cell and are
freed (and dynamo reset) when the next cell starts."""
from __future__ import annotations

import copy
import dataclasses
import gc
import inspect
import os
import time
from dataclasses import dataclass
from typing import Any, Iterator

import torch

import opsadv
from opsadv.convert import validate as _val
from opsadv.convert import floor as floor_mod
from opsadv.convert.floor import repeated_blocks

from . import model_zoo as Z
from .case import BenchCase, allow_recompiles, peak_mib
from .liger_peer import apply_isolated, liger_apply_fn

SIZES = ("0.5b", "1.5b")
PREFILL_BATCHES = (1, 8)
SEQ = 2048
ENC = (32, 512)                # encoders: batch, seq
VISION_BATCH = 32
S2S = (8, 512, 128)            # T5: batch, encoder seq, decoder seq
DECODE_BATCHES = (1, 8)
PROMPT, NEW_TOKENS = 512, 128
TRAIN = (4, 2048)
# the causal-LM loss cell (see the module docstring): model_zoo's llama3 "8b-4l", GPU only
LM_LOSS_SIZE = "8b-4l"
GPU_ONLY_SIZES = (LM_LOSS_SIZE,)
PAD_TOKENS = 300               # padded causal training: the last row right-padded by this many tokens
LR = 1e-6
ROUNDS = 3
CALLS = {"prefill": 5, "decode": 1, "train": 3}
DEEP = 40                      # layers from which decode cells take 2 rounds (a generate call is seconds)
# decode over opsadv.PagedKVCache (issue 39): llama3 "1.5b" is Llama-3.2-1B's dimensions (model_zoo's `like`)
PAGED_ARCH, PAGED_SIZE = "llama3", "1.5b"
PAGED_BATCHES = (1, 8, 32)
PAGED_PROMPT, PAGED_NEW = 512, 256
PAGE_SIZE = 16
# convert_model(precision="fp8") cells (issue 42), GPU only: llama3 "1.5b", prefill b8 s2048 and train b4 s2048
FP8_ARCH, FP8_SIZE = "llama3", "1.5b"

QUICK = dict(sizes=("tiny",), prefill_batches=(2,), seq=32, enc=(4, 32), vision_batch=4, s2s=(2, 32, 8),
             decode_batches=(2,), prompt=16, new_tokens=4, train=(2, 32), pad_tokens=8, rounds=2, calls=1,
             compiled_archs=("llama3",), compiled_modes=("prefill", "train"), paged_size="tiny", paged_batches=(2,))

COMPILE = os.environ.get("OPSADV_MODELS_COMPILE", "regional")
FLOOR = os.environ.get("OPSADV_MODELS_FLOOR")     # "cell" (default), "default", "off" (quick's default)

_live: dict = {}


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _free() -> None:
    for st in _live.values():
        st.clear()
    _live.clear()
    try:
        torch._dynamo.reset()               # compiled code keeps the models it was traced from alive
    except Exception:
        pass
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


@dataclass(frozen=True)
class Cell:
    arch: str
    size: str
    family: str               # "prefill" | "decode" | "train"
    batch: int
    seq: int                  # sequence (causal / encoder / T5 encoder), prompt for decode, image side for ViT
    padded: bool = False
    packed: bool = False      # train: one padding-free row of sequences (model_zoo.packed_inputs), batch x seq tokens
    cache: str | None = None  # decode: "dynamic" | "static" | "paged" (opsadv.PagedKVCache vs static-compiled)
    dec_seq: int | None = None
    new_tokens: int = 0
    pad_tokens: int = 0
    compiled: bool = False
    dtype: str = "bf16"       # the label; "fp8": convert_model(precision="fp8") against our bf16 conversion

    @property
    def kind(self) -> str:
        return Z.spec(self.arch).kind

    @property
    def mode(self) -> str:
        """The heatmap's column: shapes left out, so kinds share columns."""
        if self.family == "prefill":
            m = "prefill b1" if self.kind == "causal" and self.batch == 1 else "prefill"
        elif self.family == "decode":
            m = f"decode b{self.batch} {self.cache}"
        else:
            m = "train padded" if self.padded else "train packed" if self.packed else "train"
        return m + (" fp8" if self.dtype == "fp8" else "") + (" compiled" if self.compiled else "")

    @property
    def name(self) -> str:
        k, dt = self.kind, self.dtype
        if self.family == "decode":
            head = f"decode {dt} b{self.batch} new{self.new_tokens} {self.cache}"
        else:
            shape = f"b{self.batch} img{self.seq}" if k == "vision" else f"b{self.batch} s{self.seq}"
            if k == "seq2seq":
                shape += f" dec{self.dec_seq}"
            head = f"{self.family} {dt} {shape}" + (" padded" if self.padded else " packed" if self.packed else "")
        return f"{head} {self.arch} {self.size}" + (" compiled" if self.compiled else "")


def cells(quick: bool, dtype: str = "bf16") -> list[Cell]:
    """The grid, in the order the runner's --part takes every n-th cell of."""
    q = QUICK if quick else None
    sizes = q["sizes"] if q else SIZES
    out: list[Cell] = []
    for arch, e in Z.ZOO.items():
        for size in sizes:
            base: list[Cell] = []
            kw = dict(arch=arch, size=size, dtype=dtype)
            if e.kind == "causal":
                s = q["seq"] if q else SEQ
                base += [Cell(family="prefill", batch=b, seq=s, **kw) for b in (q["prefill_batches"] if q else
                                                                                 PREFILL_BATCHES)]
            elif e.kind == "encoder":
                b, s = q["enc"] if q else ENC
                base.append(Cell(family="prefill", batch=b, seq=s, padded=True, **kw))
            elif e.kind == "vision":
                side = int(e.config_kwargs(size).get("image_size", 224))
                base.append(Cell(family="prefill", batch=q["vision_batch"] if q else VISION_BATCH, seq=side, **kw))
            else:
                b, s, d = q["s2s"] if q else S2S
                base.append(Cell(family="prefill", batch=b, seq=s, dec_seq=d, padded=True, **kw))
            if e.kind in ("causal", "seq2seq"):
                p, n = (q["prompt"], q["new_tokens"]) if q else (PROMPT, NEW_TOKENS)
                for cache in ("dynamic", "static"):
                    base += [Cell(family="decode", batch=b, seq=p, cache=cache, new_tokens=n, **kw)
                             for b in (q["decode_batches"] if q else DECODE_BATCHES)]
            for padded in (False, True):
                if e.kind == "causal":
                    b, s = q["train"] if q else TRAIN
                    pt = (q["pad_tokens"] if q else PAD_TOKENS) if padded else 0
                    base.append(Cell(family="train", batch=b, seq=s, padded=padded, pad_tokens=pt, **kw))
                elif e.kind == "encoder":
                    b, s = q["enc"] if q else ENC
                    base.append(Cell(family="train", batch=b, seq=s, padded=padded, **kw))
                elif e.kind == "vision":
                    if not padded:
                        side = int(e.config_kwargs(size).get("image_size", 224))
                        base.append(Cell(family="train", batch=q["vision_batch"] if q else VISION_BATCH, seq=side,
                                         **kw))
                else:
                    b, s, d = q["s2s"] if q else S2S
                    base.append(Cell(family="train", batch=b, seq=s, dec_seq=d, padded=padded, **kw))
            out += base
            if e.kind == "causal" and (not q or arch in q["compiled_archs"]):
                b, s = q["train"] if q else TRAIN      # the same tokens as the train cell, packed
                packed = Cell(family="train", batch=1, seq=b * s, packed=True, **kw)
                out += [packed, Cell(**{**packed.__dict__, "compiled": True})]
            if arch == PAGED_ARCH and size == (q["paged_size"] if q else PAGED_SIZE):
                p, n = (q["prompt"], q["new_tokens"]) if q else (PAGED_PROMPT, PAGED_NEW)
                out += [Cell(family="decode", batch=b, seq=p, cache="paged", new_tokens=n, **kw)
                        for b in (q["paged_batches"] if q else PAGED_BATCHES)]
            for c in base:
                if q and (arch not in q["compiled_archs"] or c.mode not in q["compiled_modes"]):
                    continue
                out.append(Cell(**{**c.__dict__, "compiled": True}))
    if not q:
        b, s = TRAIN
        out.append(Cell(arch="llama3", size=LM_LOSS_SIZE, family="train", batch=b, seq=s, dtype=dtype))
        fp8 = [Cell(arch=FP8_ARCH, size=FP8_SIZE, family="prefill", batch=PREFILL_BATCHES[-1], seq=SEQ, dtype="fp8"),
               Cell(arch=FP8_ARCH, size=FP8_SIZE, family="train", batch=b, seq=s, dtype="fp8")]
        out += fp8 + [Cell(**{**c.__dict__, "compiled": True}) for c in fp8]
    return out


# ---- inputs -------------------------------------------------------------------------------------------
def cell_inputs(cell: Cell, cfg, device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The batch a cell runs (decode: the prompt; train: with labels)."""
    train = cell.family == "train"
    if cell.family == "decode":
        if cell.kind == "seq2seq":
            x = Z.encoder_inputs(cfg, cell.batch, cell.seq, pad_fraction=0.0, device=device)
        else:
            x = Z.causal_inputs(cfg, cell.batch, cell.seq, device=device)
            x["attention_mask"] = torch.ones_like(x["input_ids"])
        return x
    if cell.packed:
        return Z.packed_inputs(cfg, cell.seq, labels=train, device=device)
    if cell.kind == "causal":
        return Z.causal_inputs(cfg, cell.batch, cell.seq, pad_tokens=cell.pad_tokens, labels=train, device=device)
    return Z.inputs(cell.arch, cfg, cell.batch, cell.seq, padded=cell.padded, labels=train, device=device,
                    dtype=dtype, dec_seq=cell.dec_seq)


def validation_inputs(cell: Cell, cfg, device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """A small batch of the cell's kind for convert_model's validation (padded where the kind pads)."""
    if cell.packed:
        return Z.without_labels(Z.packed_inputs(cfg, min(128, cell.seq), device=device, seed=1))
    seq = min(64, cell.seq) if cell.kind != "vision" else cell.seq
    dec = min(16, cell.dec_seq or 16)
    x = Z.inputs(cell.arch, cfg, 2, seq, padded=cell.kind != "vision", device=device, dtype=dtype, dec_seq=dec,
                 pad_tokens=max(1, seq // 4), seed=1)
    return Z.without_labels(x)


def _takes(model, arg: str) -> bool:
    try:
        return arg in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


# ---- building ------------------------------------------------------------------------------------------
def compile_model(model, dynamic: bool | None):
    """torch.compile as OPSADV_MODELS_COMPILE says: "regional" compiles each of the model's repeated blocks in
    place (its _no_split_modules classes) and returns the model; "full" returns torch.compile(model)."""
    allow_recompiles()
    import torch._functorch.config as functorch_config
    if hasattr(functorch_config, "donated_buffer"):
        functorch_config.donated_buffer = False
    if COMPILE != "full":
        blocks = repeated_blocks(model)
        if blocks:
            for m in blocks:
                m.compile(dynamic=dynamic)
            return model
    return torch.compile(model, dynamic=dynamic)


def _report_fields(conv, extra: dict) -> None:
    rep = conv.opsadv_report
    extra["conversion"] = rep.summary()
    extra["conversion_phases_s"] = {k: round(v, 2) for k, v in rep.phases.items()}
    groups: dict = {}
    for c in rep.changes:
        if c.kind in ("kept", "skipped"):
            key = f"{c.kind}: {c.what}" + (f" ({c.reason})" if c.reason else "")
            groups[key] = groups.get(key, 0) + 1
    extra["conversion_kept_skipped"] = [k + (f" [{n}x]" if n > 1 else "") for k, n in groups.items()]
    if rep.floor:
        extra["floor"] = rep.floor
    v = rep.validation or {}
    extra["validation"] = {k: (float(f"{x:.4g}") if isinstance(x, float) else x) for k, x in v.items()
                           if k != "limits" and isinstance(x, (int, float, str, bool))}
    extra["conversion_status"] = rep.status
    if rep.notes:
        extra["conversion_notes"] = list(rep.notes)


def convert(base, cell: Cell, x: dict, val_in: dict, extra: dict, precision: str | None = None,
            cuda_graphs: bool = False):
    """opsadv.convert_model of a deep copy of base, validated on val_in, the floor timed on the cell's batch."""
    kw: dict[str, Any] = {"precision": precision} if precision else {}
    if cuda_graphs:
        kw["cuda_graphs"] = True
        extra["conversion_options"] = {"cuda_graphs": True}
    # paged cells: the floor times generate over transformers' DynamicCache, which never runs the paged path (it
    # undid the attention rewrite the paged cache needs); the cell itself measures the whole against its peers
    floor = FLOOR or ("off" if cell.size == "tiny" or cell.cache == "paged" else "cell")
    extra["floor_inputs"] = floor
    if floor == "off":
        kw["floor"] = False
    else:
        kw["floor_cache"] = False       # every cell measures its floor (conversion_s: a first conversion's cost)
    if floor == "cell":
        kw["floor_mode"] = {"prefill": "inference", "decode": "generate", "train": "train"}[cell.family]
        kw["floor_inputs"] = x
    if cell.compiled and floor != "off":
        kw["floor_compile"] = "full" if COMPILE == "full" else "regional"      # judged as it will run
    t0 = time.perf_counter()
    # the floor compiles as the cell's contenders do (compile_model: static shapes except decode)
    saved = dict(floor_mod.COMPILE_KWARGS)
    floor_mod.COMPILE_KWARGS["dynamic"] = None if cell.family == "decode" else False
    try:
        conv = opsadv.convert_model(copy.deepcopy(base), validate="warn", example_inputs=val_in, **kw)
    finally:
        floor_mod.COMPILE_KWARGS.clear()
        floor_mod.COMPILE_KWARGS.update(saved)
    _sync()
    extra["conversion_s"] = round(time.perf_counter() - t0, 2)
    _report_fields(conv, extra)
    return conv


def liger_copy(base, arch: str):
    """(Liger-patched deep copy of base, its SwappedGlobals) or (None, error text)."""
    e = Z.spec(arch)
    try:
        fn = liger_apply_fn(e.liger)
        lig = copy.deepcopy(base)
        patch = apply_isolated(fn, lig)
        return lig, patch
    except Exception as ex:
        return None, f"{type(ex).__name__}: {str(ex)[:300]}"


# ---- the calls -----------------------------------------------------------------------------------------
def _primary(out):
    for k in ("logits", "last_hidden_state"):
        t = getattr(out, k, None)
        if isinstance(t, torch.Tensor):
            return t
    return out[0]


def forward_fn(model, x: dict, keep_last: bool, patch=None):
    kw = {"logits_to_keep": 1} if keep_last else {}
    if "use_cache" not in x and _takes_cache(model):
        kw["use_cache"] = False

    def f():
        with torch.no_grad(), (patch if patch is not None else _nullctx()):
            return _primary(model(**x, **kw))
    return f


def _takes_cache(model) -> bool:
    m = getattr(model, "_orig_mod", model)
    return _takes(m, "use_cache")


class _nullctx:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None


def generate_kwargs(cell: Cell) -> dict:
    kw = dict(max_new_tokens=cell.new_tokens, do_sample=False, use_cache=True, disable_compile=True)
    if cell.cache == "static":
        kw["cache_implementation"] = "static"
    return kw


def cache_kwarg(model) -> str:
    """generate's cache argument: transformers newer than 5.17 renamed past_key_values to cache."""
    return "cache" if _takes(getattr(model, "_orig_mod", model), "cache") else "past_key_values"


def paged_cache(model, cell: Cell, static: bool = True):
    """A paged cell's cache: prompt + new tokens per sequence, pages of PAGE_SIZE (static: the opsadv contender's,
    whose decode steps replay CUDA graphs under convert_model(cuda_graphs=True); not static: `opsadv_eager`'s)."""
    return opsadv.PagedKVCache(model, max_cache_len=cell.seq + cell.new_tokens, page_size=PAGE_SIZE,
                               max_batch_size=cell.batch, static=static)


def eager_view(model):
    """The same modules with the eager forward (a converted model's CUDA-graph runner left out): `opsadv_eager`."""
    m = copy.copy(model)                      # shallow: shares every submodule and parameter
    m.__dict__.pop("forward", None)           # the runner is an instance attribute (convert_model's undo removes it too)
    return m


def paged_generate_fn(model, x: dict, cell: Cell, cache):
    kw = {**generate_kwargs(cell), cache_kwarg(model): cache}
    gen = getattr(model, "_orig_mod", model).generate

    def f():
        cache.reset()                         # every call generates from an empty cache (its pages stay allocated)
        with torch.no_grad():
            return gen(**x, **kw)
    return f


def static_compile_config():
    """generate's auto-compile of the StaticCache peer: transformers' CompileConfig defaults (inductor,
    reduce-overhead) on CUDA; on a CPU the eager backend, forced on (CPU runs check the code path, not speed)."""
    from transformers import CompileConfig
    if torch.cuda.is_available():
        return CompileConfig()
    cc = CompileConfig(backend="eager", mode=None)      # (the eager backend takes no mode)
    cc._compile_all_devices = True            # transformers auto-compiles on accelerators only unless this is set
    return cc


def static_compile_generate_fn(model, x: dict, cell: Cell, cc):
    """transformers' StaticCache under torch.compile: generate(cache_implementation="static") with its own
    auto-compile of the decode step (compile_config cc)."""
    kw = dict(max_new_tokens=cell.new_tokens, do_sample=False, use_cache=True, cache_implementation="static",
              compile_config=cc, disable_compile=False)
    gen = getattr(model, "_orig_mod", model).generate

    def f():
        with torch.no_grad():
            return gen(**x, **kw)
    return f


def generate_fn(model, x: dict, cell: Cell, patch=None):
    kw = generate_kwargs(cell)
    gen = getattr(model, "_orig_mod", model).generate

    def f():
        with torch.no_grad(), (patch if patch is not None else _nullctx()):
            return gen(**x, **kw)
    return f


def train_fn(model, opt, x: dict, patch=None):
    def f():
        with (patch if patch is not None else _nullctx()):
            out = model(**x)
            out.loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return out.loss.detach()
    return f


def _optimizer(model):
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)


def grad_check(ref_model, model, x: dict, extra: dict) -> None:
    """One forward + backward of each on x: loss and every parameter's gradient against the reference's."""
    for m in (ref_model, model):
        m.zero_grad(set_to_none=True)
    lr = ref_model(**x).loss
    lr.backward()
    lc = model(**x).loss
    lc.backward()
    _sync()
    a, b = float(lr.detach().float()), float(lc.detach().float())
    extra["loss_ref"], extra["loss"] = round(a, 6), round(b, 6)
    extra["loss_rel_err"] = float(f"{abs(a - b) / max(abs(a), 1e-30):.3g}")
    g = Z.grad_errors(ref_model, getattr(model, "_orig_mod", model))
    extra["grad_max_rel_err"] = float(f"{g['max_rel_err']:.3g}") if g["max_rel_err"] != float("inf") else "inf"
    extra["grad_worst"] = g["worst"]
    extra["grad_params"] = g["params"]
    if g["missing"]:
        extra["grad_missing"] = g["missing"][:10]
    for m in (ref_model, model):
        m.zero_grad(set_to_none=True)


def _metrics(ref, new, inputs, dtype, what: str = "logits") -> dict:
    """validate.compare's numbers; `what` names the tensors ("logits": KL and top-1 too)."""
    m = _val.compare({what: ref}, {what: new}, inputs, dtype)
    return {k: (float(f"{v:.4g}") if isinstance(v, float) else v) for k, v in m.items()
            if k in ("rel_err", "kl", "top1_agreement", "top1_ties", "min_cosine", "passed", "tokens")}


def _work(model, cell: Cell) -> float:
    if cell.cache == "paged":                 # tok/s: the runner's rate is work / ms / 1e9
        return cell.batch * cell.new_tokens * 1e12
    emb = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Embedding))
    n = max(Z.n_params(model) - emb, 1)
    if cell.family == "decode":
        tokens = cell.batch * cell.new_tokens
    elif cell.kind == "vision":
        cfg = model.config
        tokens = cell.batch * ((int(cfg.image_size) // int(cfg.patch_size)) ** 2 + 1)
    else:
        tokens = cell.batch * (cell.seq + (cell.dec_seq or 0))
    return 2.0 * n * tokens * (3 if cell.family == "train" else 1)


def _warm(fn, name: str, extra: dict, impls: dict | None = None):
    t0 = time.perf_counter()
    if impls is None:
        out = fn()
    else:
        with opsadv.trace() as t:
            out = fn()
        impls.update(t.counts)
    _sync()
    extra.setdefault("warmup_s", {})[name] = round(time.perf_counter() - t0, 2)
    return out


# ---- the case ------------------------------------------------------------------------------------------
def make_case(cell: Cell, device: str, dtype: torch.dtype, quick: bool = False) -> BenchCase:
    e = Z.spec(cell.arch)
    paged = cell.cache == "paged"
    # paged cells: against transformers' StaticCache under torch.compile (issue 39's target), DynamicCache eager too
    fp8 = cell.dtype == "fp8"
    baseline = ("opsadv_bf16" if fp8 else "hf_compile" if cell.compiled else "hf_static_compile" if paged
                else "unconverted")
    peer_names = [baseline] + (["unconverted"] if paged or (fp8 and not cell.compiled) else []) + (
        ["opsadv_eager"] if paged else []) + (["liger"] if e.liger and not cell.compiled and not fp8 else [])
    graphed = paged and device == "cuda"      # CUDA graphs are a CUDA feature: a CPU row runs the static cache eagerly
    st: dict = {}
    extra: dict[str, Any] = {"arch": cell.arch, "size": cell.size, "mode": cell.mode, "like": e.like.get(cell.size, "")}
    if cell.compiled:
        extra["compile"] = COMPILE

    def peer(name):
        def f():
            fn = st.get("fn_" + name)
            if fn is None:
                raise RuntimeError(st.get("err_" + name) or f"{name} was not built")
            return fn()
        return f

    def run_opsadv():
        return st["fn_opsadv"]()

    def setup():
        _free()
        _live[cell.name] = st
        train = cell.family == "train"
        base = Z.build(cell.arch, cell.size, device, dtype, train=train)
        cfg = base.config
        extra["params_b"] = round(Z.n_params(base) / 1e9, 3)
        case.work = _work(base, cell)
        x = cell_inputs(cell, cfg, device, dtype)
        if "attention_mask" in x and cell.family != "decode":
            extra["padding_fraction"] = round(1 - x["attention_mask"].float().mean().item(), 3)
        val_in = validation_inputs(cell, cfg, device, dtype)
        floor_x = x if cell.family != "prefill" else Z.without_labels(x)
        conv = convert(base, cell, floor_x, val_in, extra, "fp8" if fp8 else None, cuda_graphs=graphed)
        contenders = {"opsadv": conv}
        if fp8:
            extra["fp8"] = conv.opsadv_report.fp8
            bf16_extra: dict = {}
            contenders["opsadv_bf16"] = convert(base, cell, floor_x, val_in, bf16_extra)
            extra["opsadv_bf16_conversion"] = bf16_extra.get("conversion")
        if train:
            for m in contenders.values():
                m.train()
        if cell.compiled and fp8:       # FP8 compiled against our bf16 conversion compiled the same way
            contenders = {name: compile_model(m, False) for name, m in contenders.items()}
        elif cell.compiled:
            hf = copy.deepcopy(base)
            dyn = None if cell.family == "decode" else False
            contenders = {"opsadv": compile_model(conv, dyn), "hf_compile": compile_model(hf, dyn)}
        else:
            contenders["unconverted"] = base
        if paged:
            st["paged"] = paged_cache(conv, cell, static=True)
            contenders["opsadv_eager"] = eager_view(conv)
            st["paged_eager"] = paged_cache(contenders["opsadv_eager"], cell, static=False)
            extra["opsadv_contender"] = ("convert_model(cuda_graphs=True) + PagedKVCache(static=True): decode steps "
                                         "replay CUDA graphs" if graphed else "PagedKVCache(static=True), eager "
                                         "(no CUDA graphs on a CPU)")
            extra["opsadv_eager"] = "the converted modules' eager forward + PagedKVCache(static=False)"
            contenders["hf_static_compile"] = copy.deepcopy(base)
            cc = static_compile_config()
            extra["static_compile"] = cc.to_dict()
        patches: dict = {}
        if "liger" in peer_names:              # built last: after the other models exist
            lig, patch = liger_copy(base, cell.arch)
            if lig is None:
                st["err_liger"] = patch
            else:
                contenders["liger"] = lig
                patches["liger"] = patch
                extra["liger_patched_globals"] = len(patch.changes)
        st["base"], st["x"] = base, x
        keep_last = cell.family == "prefill" and cell.kind == "causal" and _takes(base, "logits_to_keep")
        if cell.family == "prefill" and cell.kind == "causal":
            extra["logits"] = "last" if keep_last else "full"
        if train:
            grad_check(base, contenders["opsadv"], x, extra)
        impls: dict = {}
        for name, m in contenders.items():
            p = patches.get(name)
            if cell.family == "prefill":
                fn = forward_fn(m, x, keep_last, p)
            elif paged and name == "opsadv":
                fn = paged_generate_fn(m, x, cell, st["paged"])
            elif name == "opsadv_eager":
                fn = paged_generate_fn(m, x, cell, st["paged_eager"])
            elif name == "hf_static_compile":
                fn = static_compile_generate_fn(m, x, cell, cc)
            elif cell.family == "decode":
                fn = generate_fn(m, x, cell, p)
            else:
                fn = train_fn(m, _optimizer(getattr(m, "_orig_mod", m)), x, p)
            runner_ = getattr(m, "opsadv_graphs", None) if paged and name == "opsadv" else None
            before = None if runner_ is None else dataclasses.replace(runner_.stats)
            try:
                _warm(fn, name, extra, impls if name == "opsadv" else None)
                if name == "hf_static_compile" and not hasattr(m, "_compiled_call"):
                    raise RuntimeError("generate ran the StaticCache peer uncompiled (its auto-compile criteria "
                                       "were not met)")
                if paged and name == "opsadv":
                    _paged_fields(m, cell, st["paged"], extra, graphed, runner_, before)
                if train and device == "cuda":
                    extra[f"{name}_peak_mib"] = peak_mib(fn)      # one more step (after the warm-up's)
            except Exception as ex:
                if name == "opsadv":
                    raise
                st["err_" + name] = f"{type(ex).__name__}: {str(ex)[:300]}"
                continue
            st["fn_" + name] = fn
        st["impls"] = impls
        extra["impls"] = dict(sorted(impls.items()))
        st["models"] = contenders

    def impl() -> str:
        return " + ".join(sorted(st.get("impls", {}))) or "(no opsadv op ran)"

    def compare(out, ref) -> float:
        if cell.family == "train":
            # the setup's paired step (same parameters, before any optimizer step); the losses of the timed
            # calls come after each contender's own number of steps and are recorded apart
            a, b = float(out.float()), float(ref.float())
            extra["loss_after_timing_rel_err"] = float(f"{abs(a - b) / max(abs(a), abs(b), 1e-30):.3g}")
            # a gradient that never reaches a parameter is a wrong training step whatever the loss says
            return float("inf") if extra.get("grad_missing") else extra["loss_rel_err"]
        if cell.family == "prefill":
            m = _metrics(ref, out, st["x"] if cell.kind != "causal" or out.shape[1] != 1 else {}, dtype,
                         "last_hidden_state" if cell.kind in ("encoder", "vision") else "logits")
            extra["check"] = m
            return m["kl"] if fp8 else m["rel_err"]
        return _decode_check(cell, st, extra, dtype, ref)

    rounds, calls = (QUICK["rounds"], QUICK["calls"]) if quick else (ROUNDS, CALLS[cell.family])
    if cell.family == "decode" and _layers(e, cell.size) >= DEEP:
        rounds = min(rounds, 2)
    case = BenchCase("models", cell.name, run_opsadv, {p: peer(p) for p in peer_names}, 1.0,
                     "tok/s" if paged else "TFLOP/s",
                     impl=impl, compare=compare, extra=extra, setup=setup, rounds=rounds, baseline=baseline,
                     calls=calls)
    return case


def _layers(e, size: str) -> int:
    kw = e.config_kwargs(size)
    return int(kw.get("num_hidden_layers") or kw.get("n_layer") or kw.get("num_layers") or 0) + \
        int(kw.get("num_decoder_layers") or 0)


def _paged_fields(model, cell: Cell, cache, extra: dict, graphed: bool = False, runner_=None, before=None) -> None:
    """The paged cache's shape and what served its one (warm-up) generate; raises unless paged_attention served
    every layer's prefill and each decode step (no other attention path may have run) and, with CUDA graphs, unless
    the prefill ran eagerly and every decode step replayed a graph."""
    layers = model.config.num_hidden_layers
    want = {"prefill": layers, "decode": layers * (cell.new_tokens - 1)}    # the last new token is not fed back
    if cache.calls != want:
        raise RuntimeError(f"PagedKVCache served {cache.calls} paged_attention calls in one generate, expected {want}")
    extra["paged"] = {"page_size": cache.page_size, "num_pages": cache.num_pages, "max_cache_len": cache.max_cache_len,
                      "static": cache.static, "cuda_graphs": graphed,
                      "calls_per_generate": dict(cache.calls), "decode_kernel": cache.explain().chosen}
    if graphed:
        if runner_ is None:
            raise RuntimeError("the opsadv contender was converted with cuda_graphs=True but has no graph runner")
        s = runner_.stats
        got = {"eager": s.eager - before.eager, "replays": s.replays - before.replays,
               "captures": s.captures - before.captures}
        if got["eager"] != 1 or got["replays"] != cell.new_tokens - 1:
            raise RuntimeError(f"one graphed generate ran {got}: expected the prefill eager and each of the "
                               f"{cell.new_tokens - 1} decode steps a replay")
        extra["paged"]["graphs_per_generate"] = got


def _decode_check(cell: Cell, st: dict, extra: dict, dtype, ref=None) -> float:
    """The opsadv contender's generate, its step logits against the unconverted model's logits on the same
    tokens (one forward over prompt + generated tokens, no cache): the cached decode path checked.  Paged cells
    also compare the greedy tokens with the unconverted model's (DynamicCache, eager) and with the baseline's
    (`ref`): the share of equal new tokens, and the share before each row's first differing token."""
    m = st["models"]["opsadv"]
    gen = getattr(m, "_orig_mod", m).generate
    x, base = st["x"], st["base"]
    kw = generate_kwargs(cell)
    if cell.cache == "paged":
        st["paged"].reset()
        kw[cache_kwarg(m)] = st["paged"]
    with torch.no_grad():
        out = gen(**x, **kw, output_logits=True, return_dict_in_generate=True)
        new = torch.stack(out.logits, 1)
        seq = out.sequences
        if cell.kind == "seq2seq":
            ref_logits = base(**x, decoder_input_ids=seq[:, :-1]).logits
        else:
            p = x["input_ids"].shape[1]
            ids = seq[:, :-1]
            keep = ids.shape[1] - p + 1             # the positions compared (logits of the prompt's rows not made)
            kw_keep = {"logits_to_keep": keep} if _takes(base, "logits_to_keep") else {}
            ref_logits = base(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False,
                              **kw_keep).logits[:, -keep:]
    extra["generated_tokens"] = int(new.shape[1])
    if cell.cache == "paged":
        p = x["input_ids"].shape[1]
        with torch.no_grad():
            want = base.generate(**x, **generate_kwargs(cell))          # DynamicCache (no cache_implementation)
        extra.update(_token_agreement(seq[:, p:], want[:, p:], "unconverted"))
        if isinstance(ref, torch.Tensor) and ref.shape == seq.shape:
            extra.update(_token_agreement(seq[:, p:], ref[:, p:], "hf_static_compile"))
    mt = _metrics(ref_logits, new, {}, dtype)    # (compared a chunk of rows at a time: b32 x 256 x 128k logits)
    extra["check"] = mt
    return mt["rel_err"]


def _token_agreement(got: torch.Tensor, want: torch.Tensor, peer: str) -> dict:
    """Greedy new tokens against a peer's: the share equal position by position, and the share before each row's
    first difference (one differing token changes every later step's input)."""
    eq = (got == want)
    first = torch.where(eq.all(1), eq.shape[1], (~eq).int().argmax(1))
    n = eq.numel()
    return {f"tokens_equal_{peer}": round(eq.sum().item() / n, 4),
            f"tokens_equal_prefix_{peer}": round(first.sum().item() / n, 4)}


def cases(quick: bool) -> Iterator[BenchCase]:
    """quick: the "tiny" sizes, short sequences, fp32 on a CPU, compiled cells only for QUICK's few."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    label = "bf16" if dtype == torch.bfloat16 else "fp32"
    for cell in cells(quick, label):
        if (cell.size in GPU_ONLY_SIZES or cell.dtype == "fp8") and dev != "cuda":
            continue                        # (an 8B-wide step, or FP8 without FP8 tensor cores, measures nothing)
        yield make_case(cell, dev, dtype, quick)
    _free()
