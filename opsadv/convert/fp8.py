"""FP8 GEMMs for converted models: convert_model(precision="fp8") (issue 42).

Which GEMMs: every projection of the model's blocks (q/k/v, our fused [W_q|W_k|W_v] and [W_gate|W_up], o_proj,
down_proj, the dense / fc GEMMs of LinearAct and DenseResidualNorm, any other nn.Linear) runs
opsadv.ops.scaled_gemm; the output embeddings (lm_head) stay bf16 unless Fp8Recipe(lm_head=True), embeddings are
no GEMMs.  Attention (where the model runs opsadv's attention): the calls without key padding or a window run
opsadv.ops.fp8_attention.fp8_attention_from_bf16 in no-grad calls (q, k, v quantized per (batch, head) with current
scaling, the FP8 forward kernel); padded and windowed calls, and training calls (the FP8 attention's backward is not
the recipe's yet), keep the bf16 kernels.  Each block's attention goes FP8 or stays bf16 with the block's GEMMs (the per-block decision below).

Inference (no-grad calls): weights quantized once, e4m3 with one scale per output channel ("col" scales of W^T),
re-quantized only when the weight changes (its version counter or storage); activations quantized per call with
current scaling (e4m3, one scale per token: "row" scales); bias / activation epilogues fused where the rewrite
fuses them (LinearAct's activation, the biases); output in the activation's dtype.  The gated MLPs (SwiGLUMLP,
FusedSwiGLUMLP: SwiGLU and GeGLU) run opsadv.ops.scaled_swiglu_gemm, one FP8 GEMM over [W_gate|W_up] with the
act(g) * u epilogue, so the (tokens, 2 x intermediate) gate_up never reaches memory; where no kernel serves that
op (conversion checks it per site and reports it) they run scaled_gemm for gate_up, then the swiglu op.

Training (grad-recording calls, Fp8Recipe.training): _Fp8Linear, three scaled_gemm calls per GEMM:
  fprop  y  = x @ W^T       x e4m3, one scale per tensor, DELAYED: max of the last `amax_history_len` amaxes of x
                            (the first call: its own amax), the call's amax then enters the history;
                            W e4m3, one scale per tensor from the weight's current amax (one reduction);
  dgrad  dx = dy @ W        dy e5m2, one scale per tensor, delayed from the gradients' own amax history; W's fp8
                            transpose from fprop (W^T row-major: the column-major W cuBLASLt takes);
  wgrad  dW = dy^T @ x      dy^T e5m2 x the saved e4m3 x^T (row-major, read as column-major x), out in W's dtype.
Each operand is cast ONCE, by opsadv.ops.cast_to_fp8_delayed: one pass over x (dy, W) writing its fp8 copy and
the transposed copy its gradient GEMM reads, the scale read from and the amax recorded into the operand's device-side
history (torch's abs / amax / divide / clamp / cast and a transpose copy were ~8 passes with float32 temporaries,
1.7x the bf16 step on the H100; a Python-side ring broke torch.compile's graph at every FP8 GEMM).  Master weights stay in
their dtype (bf16 / fp32) and receive dW; the bias gradient is dy summed in float32.  The saved activation is the
e4m3 x^T (half a bf16 activation's bytes).  Every GEMM goes through scaled_gemm (no bf16 fallback).  The gated MLPs train
with this recipe on the [W_gate|W_up] GEMM and the swiglu op after it (which keeps gate_up, the pre-activations,
for its backward: dgate_up feeds the dgrad / wgrad GEMMs), not with scaled_swiglu_gemm: its forward does not write
gate_up, which the backward needs (recomputing it costs one more GEMM; a second output of the fused kernel would
save one read of gate_up and is not built).

Per-layer decision (fp8_pass): units are the model's blocks (the children of a ModuleList: decoder layers); the
converted bf16 model's output on the validation inputs is the reference, the limits validate.FP8_LIMITS (KL and
top-1 agreement on logits, as validate.compare measures them).  All units in fp8 first; if that fails, each unit
alone in fp8 is measured (its KL, or rel_err for outputs without logits) and the units are ordered from least to
most sensitive; a binary search finds the longest passing prefix of that order, whose units keep fp8 (the rest,
and any unit failing alone, stay bf16).  Cost: 2 forwards when all fp8 passes, else 2 + units + ceil(log2(units
+ 1)) forwards on the validation batch; deterministic (ties by model order)."""
from __future__ import annotations

import math
from contextlib import nullcontext
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from opsadv import ops
from opsadv.core.activations import ACT
from opsadv.core.errors import InvalidArgumentError
from opsadv.core.explain import explain
from opsadv.ops.fp8_attention import quantize_qkv
from opsadv.ops.scaled_gemm import E4M3, E5M2, FP8_MAX, new_amax_history, quantize_fp8

from . import tp, validate as _val
from .modules import DenseResidualNorm, FusedSwiGLUMLP, LinearAct, QKVProjection, SwiGLUMLP, quantized_linear
from .hf_attention import FP8_FLAG, NAME as ATTN_NAME, attention_modules, attention_pass
from .passes import Undo
from .state import scope_of

KIND = "fp8"
LABEL = "bf16 GEMMs (no FP8)"
ATTENTION_WHAT = ("attention -> opsadv fp8_attention_from_bf16 in no-grad calls (e4m3 q / k / v per (batch, head), "
                  "current scaling; padded, windowed and training calls keep bf16)")
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclass(frozen=True)
class Fp8Recipe:
    """How convert_model(precision="fp8") runs the GEMMs.  amax_history_len: the delayed-scaling window of the
    training recipe (activations and gradients); training: grad-recording calls run the FP8 training recipe
    (False: they run bf16 GEMMs, inference stays FP8); lm_head: the output embeddings in FP8 too."""

    amax_history_len: int = 16
    training: bool = True
    lm_head: bool = False

    def __post_init__(self):
        if not isinstance(self.amax_history_len, int) or not 1 <= self.amax_history_len <= 1024:
            raise InvalidArgumentError("Fp8Recipe", "amax_history_len", "an int in [1, 1024]",
                                       repr(self.amax_history_len))


class AmaxHistory:
    """One cast site's delayed-scaling state (a GEMM's activations, or its gradients): the device tensor that
    opsadv.ops.cast_to_fp8_delayed reads its scale from and records the cast's amax into, ring position included,
    so no Python state changes per step (a compiled training step stays one graph).  length 0: current scaling.
    Made with the site, on its weight's device (or the first cast's; a moved model starts a new history)."""

    def __init__(self, length: int, device: torch.device | None = None):
        self.length = length
        self.buf: torch.Tensor | None = None if device is None else self._new(device)

    def tensor(self, device: torch.device) -> torch.Tensor:
        buf = self.buf
        if buf is None or buf.device != device:
            buf = self._new(device)
        return buf

    @torch.compiler.disable
    def _new(self, device: torch.device) -> torch.Tensor:
        # made outside any compiled graph: a history created inside one and mutated by its backward breaks
        # AOTAutograd's partition
        buf = new_amax_history(self.length, device)
        # a fixed address, as a module buffer has, so that CUDA graphs (mode="reduce-overhead") may take the casts'
        # in-place updates as a static input's rather than skip the graph for a mutated input
        torch._dynamo.mark_static_address(buf)
        self.buf = buf
        return buf

    def cast(self, x: torch.Tensor, dtype: torch.dtype, transpose: bool = True):
        """(x_fp8, x_fp8_t, scale) under this site's delayed scale, recording x's amax."""
        return ops.cast_to_fp8_delayed(x, self.tensor(x.device), dtype=dtype, transpose=transpose)


def quantize_rows(x2: torch.Tensor):
    """(x_fp8 e4m3, scale (M, 1)): quantize_fp8(x2, "row")'s result for finite x2 in fewer passes (no finiteness
    mask: a non-finite activation makes a non-finite output either way; no clamp: |x| / (amax / 448) rounds to at
    most 448).  On CUDA it runs compiled (one reduction and one pointwise kernel) where torch.compile works."""
    fn = _compiled_quantize_rows() if x2.is_cuda else None
    return (fn or _quantize_rows)(x2)


def _quantize_rows(x2: torch.Tensor):
    amax = x2.abs().amax(dim=1, keepdim=True).to(torch.float32)
    scale = torch.where(amax > 0, amax / FP8_MAX[E4M3], torch.ones_like(amax))
    return (x2.to(torch.float32) / scale).to(E4M3), scale


_compiled: list = []          # [compiled quantize_rows or None (compilation unavailable)]


def _compiled_quantize_rows():
    if not _compiled:
        try:
            fn = torch.compile(_quantize_rows, dynamic=True, fullgraph=True)
            fn(torch.ones(4, 32, device="cuda", dtype=torch.bfloat16))          # compiles now, or fails here
            _compiled.append(fn)
        except Exception:  # noqa: BLE001 - no Inductor on this host: the eager passes
            _compiled.append(None)
    return _compiled[0]


def _col_major(t: torch.Tensor) -> torch.Tensor:
    """t with the same shape laid out column-major (cuBLASLt's b; a no-op where it already is)."""
    return t.t().contiguous().t()


class _Fp8Linear(torch.autograd.Function):
    """y = x @ W^T + b with the three GEMMs in FP8 (module docstring: fprop e4m3, dgrad / wgrad e5m2 gradients).
    Each operand is cast once by cast_to_fp8_delayed, which also writes the transpose its gradient GEMM reads; the
    histories come in as tensors (x's, W's of length 0: current scaling, dy's), which the casts update in place."""

    @staticmethod
    def forward(ctx, x2, w, bias, x_hist, w_hist, g_hist, gemm: "Fp8Gemm"):
        out_dtype = x2.dtype if x2.dtype in OUT_DTYPES else torch.bfloat16
        x8, x8t, x_scale = ops.cast_to_fp8_delayed(x2.detach(), x_hist, dtype=E4M3, transpose=True)
        w8, w8t, w_scale = ops.cast_to_fp8_delayed(w.detach(), w_hist, dtype=E4M3, transpose=True)  # (N, K), (K, N)
        y = ops.scaled_gemm(x8, w8.t(), x_scale, w_scale, bias=None if bias is None else bias.detach(),
                            out_dtype=out_dtype)
        ctx.save_for_backward(x8t, x_scale, w8t, w_scale, g_hist)       # the layouts the gradient GEMMs read
        ctx.gemm, ctx.x_dtype, ctx.w_dtype = gemm, x2.dtype, w.dtype
        ctx.has_bias = bias is not None
        return y

    @staticmethod
    def backward(ctx, dy):
        state = ctx.gemm.state
        with state.scope() if state is not None else nullcontext():     # the model's policy, as in forward
            return _Fp8Linear._backward(ctx, dy)

    @staticmethod
    def _backward(ctx, dy):
        x8t, x_scale, w8t, w_scale, g_hist = ctx.saved_tensors
        g8, g8t, g_scale = ops.cast_to_fp8_delayed(dy, g_hist, dtype=E5M2, transpose=True)     # (M, N), (N, M)
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            out = ctx.x_dtype if ctx.x_dtype in OUT_DTYPES else torch.bfloat16
            dx = ops.scaled_gemm(g8, w8t.t(), g_scale, w_scale, out_dtype=out).to(ctx.x_dtype)
        if ctx.needs_input_grad[1]:
            out = ctx.w_dtype if ctx.w_dtype in OUT_DTYPES else torch.float32
            dw = ops.scaled_gemm(g8t, x8t.t(), g_scale, x_scale, out_dtype=out).to(ctx.w_dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = dy.sum(0, dtype=torch.float32)
        return dx, dw, db, None, None, None, None


class Fp8Gemm:
    """One FP8 GEMM site: y = activation(x @ W^T + b) + residual for the weight (N, K) it reads at call time from
    `source` (a FusedRows buffer, or a module's .weight / .bias; Conv1D weights are (K, N)).  Called with x, it
    returns the output, or None where the caller's bf16 path should run (disabled, or a grad-recording call with
    the training recipe off)."""

    def __init__(self, source, bias_source=None, *, conv1d: bool = False, recipe: Fp8Recipe = Fp8Recipe(),
                 state=None):
        self.source, self.bias_source, self.conv1d, self.recipe = source, bias_source, conv1d, recipe
        self.state = state            # the converted model's RuntimeState: the backward GEMMs run under its policy
        self.enabled = True
        dev = self._weight_device()
        self.x_history = AmaxHistory(recipe.amax_history_len, dev)
        self.g_history = AmaxHistory(recipe.amax_history_len, dev)
        self.w_history = AmaxHistory(0, dev)      # the weight: current scaling (its amax as it is now)
        self._w8 = None               # (key, w8 (K, N) column-major, scale (1, N)): the inference weight
        # a [W_gate|W_up] site (gated()): inference runs scaled_swiglu_gemm (fp8_pass sets it where a kernel serves
        # that op), else scaled_gemm and the swiglu op
        self.fused = False
        self.fused_why: str | None = None     # why not (the report)

    def __getstate__(self):          # (copies re-quantize on first use: no second fp8 copy in a pickle)
        return {**self.__dict__, "_w8": None}

    def _weight_device(self) -> torch.device | None:
        """The device of the weight (a FusedRows' first part: no concatenation), None without a source yet (the
        histories are then made on the first call's device)."""
        src = self.source
        w = src.params[0] if hasattr(src, "params") else getattr(src, "weight", None)
        return w.device if isinstance(w, torch.Tensor) else None

    def weight(self) -> torch.Tensor:
        """The (N, K) weight as the model holds it now (differentiable where the parameters are)."""
        src = self.source
        w = src.get() if hasattr(src, "get") else src.weight
        return w.t() if self.conv1d else w

    def bias(self):
        src = self.bias_source
        if src is None:
            return None
        return src.get() if hasattr(src, "get") else src.bias

    def inference_weight(self, w: torch.Tensor):
        """(w8 (K, N) column-major e4m3, scale (1, N)): quantized once per weight version.  A compiled graph reads
        the copy that conversion's validation or the last eager call made (a version check would break the graph:
        dynamo cannot compare data pointers), or quantizes in the graph where there is none."""
        c = self._w8
        if torch.compiler.is_compiling():
            if c is not None:
                return c[1], c[2]
            w8, scale = quantize_fp8(w.detach().t(), "col", E4M3)
            return _col_major(w8), scale
        key = (w.data_ptr(), w._version, w.shape, w.dtype, w.device)
        if c is None or c[0] != key:
            with torch.no_grad():
                w8, scale = quantize_fp8(w.detach().t(), "col", E4M3)      # one scale per output channel
                c = self._w8 = (key, _col_major(w8), scale)
        return c[1], c[2]

    def drop_cache(self) -> None:
        self._w8 = None

    def __call__(self, x: torch.Tensor, activation: str = "none", residual: torch.Tensor | None = None):
        if not self.enabled or x.numel() == 0:
            return None
        w, b = self.weight(), self.bias()
        k = x.shape[-1]
        x2 = x.reshape(-1, k)
        if torch.is_grad_enabled() and (x.requires_grad or w.requires_grad or (b is not None and b.requires_grad)):
            if not self.recipe.training:
                return None
            dev = x2.device
            y = _Fp8Linear.apply(x2, w, b, self.x_history.tensor(dev), self.w_history.tensor(dev),
                                 self.g_history.tensor(dev), self)
            if activation != "none":
                y = ACT[activation](y)
            if residual is not None:
                y = y + residual.reshape(y.shape)
            return y.reshape(*x.shape[:-1], y.shape[-1])
        w8, w_scale = self.inference_weight(w)
        x8, x_scale = quantize_rows(x2)                                     # current scaling, one scale per token
        out_dtype = x.dtype if x.dtype in OUT_DTYPES else torch.bfloat16
        y = ops.scaled_gemm(x8, w8, x_scale, w_scale, bias=b, activation=activation,
                            residual=None if residual is None else residual.reshape(x2.shape[0], -1),
                            out_dtype=out_dtype)
        return y.reshape(*x.shape[:-1], y.shape[-1])

    def gated(self, x: torch.Tensor, activation: str = "silu"):
        """act(g) * u for the [W_gate|W_up] GEMM this site holds (act "silu" or "gelu_tanh"), or None where the
        caller's bf16 path should run.  No-grad calls with self.fused: one scaled_swiglu_gemm (per-token current
        scaling, per-channel weight scales, as __call__'s); otherwise this site's GEMM (__call__: inference, or the
        training recipe's _Fp8Linear) then the swiglu op."""
        if not self.enabled or x.numel() == 0:
            return None
        w, b = self.weight(), self.bias()
        if self.fused and not (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad
                                                            or (b is not None and b.requires_grad))):
            k = x.shape[-1]
            w8, w_scale = self.inference_weight(w)                          # (K, 2N) column-major, (1, 2N)
            x8, x_scale = quantize_rows(x.reshape(-1, k))
            out_dtype = x.dtype if x.dtype in OUT_DTYPES else torch.bfloat16
            h = ops.scaled_swiglu_gemm(x8, w8, x_scale, w_scale, bias=b, activation=activation, out_dtype=out_dtype)
            return h.reshape(*x.shape[:-1], h.shape[-1])
        gu = self(x)
        return None if gu is None else ops.swiglu(gu, activation=activation)


class Fp8Linear(nn.Linear):
    """An nn.Linear whose GEMM runs scaled_gemm (Fp8Gemm); the replaced Linear's weight and bias, same names."""

    _opsadv_fx = True                # a leaf for opsadv's fx rewrite

    def __init__(self, linear: nn.Linear, recipe: Fp8Recipe, state=None):
        nn.Module.__init__(self)
        self.weight, self.bias = linear.weight, linear.bias
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self._opsadv_state = state
        self._fp8 = Fp8Gemm(self, self if linear.bias is not None else None, recipe=recipe, state=state)
        self.train(linear.training)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, fp8 e4m3"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with scope_of(self):
            y = self._fp8(x)
        return F.linear(x, self.weight, self.bias) if y is None else y


# ---- the conversion pass ------------------------------------------------------------------------------------
@dataclass
class Site:
    """One FP8 GEMM place: where it is, which block (unit) it belongs to, what it computes, and how it attaches."""

    path: str
    unit: str
    what: str
    gemm: Fp8Gemm
    holder: object                   # the object whose `attr` takes the Fp8Gemm, or the parent of a swapped Linear
    attr: str
    swap: nn.Module | None = None    # the Fp8Linear replacing holder.<attr>
    shape: tuple = ()                # (K, N)
    gated: bool = False              # a [W_gate|W_up] GEMM whose caller runs gemm.gated() (act(g) * u after it)

    def attach(self, undo) -> None:
        if self.swap is not None:
            undo.swap(self.holder, self.attr, self.swap)
        else:
            setattr(self.holder, self.attr, self.gemm)
            undo.instance_attrs.append((self.holder, self.attr))


def _unit_of(path: str, lists: set[str]) -> str:
    """The block a module path belongs to: the deepest ModuleList child on its path (e.g. "model.layers.3")."""
    parts = path.split(".")
    for i in range(len(parts) - 1, 0, -1):
        if ".".join(parts[:i]) in lists:
            return ".".join(parts[:i + 1])
    return path


def find_sites(model: nn.Module, recipe: Fp8Recipe, report, state) -> list[Site]:
    lists = {p for p, m in model.named_modules() if isinstance(m, nn.ModuleList)}
    out_emb = None
    get_out = getattr(model, "get_output_embeddings", None)
    if callable(get_out):
        try:
            out_emb = get_out()
        except Exception:  # noqa: BLE001 - a model without output embeddings
            out_emb = None
    covered: set[int] = set()
    sites: list[Site] = []

    def add(path, what, gemm, holder, attr, swap=None, k=0, n=0, gated=False):
        sites.append(Site(path, _unit_of(path, lists), what, gemm, holder, attr, swap, (k, n), gated))

    for path, m in model.named_modules():
        if isinstance(m, QKVProjection):
            g = m.group
            covered.add(id(m))
            if m.role != 0 or g.weight.sharded or tp.is_dtensor(m.weight):
                continue
            parent = path.rsplit(".", 1)[0] if "." in path else ""
            add(parent, "fused q|k|v projection", Fp8Gemm(g.weight, g.bias, recipe=recipe, state=state), g, "fp8",
                k=m.in_features, n=sum(g.splits))
        elif isinstance(m, FusedSwiGLUMLP):
            gu = m._gate_up()
            covered.add(id(gu))
            if not tp.is_dtensor(gu.weight):
                add(path, f"{m._names[0]} ([W_gate|W_up], {m.activation} gate)",
                    Fp8Gemm(gu, gu if gu.bias is not None else None, recipe=recipe, state=state), m, "_fp8",
                    k=gu.in_features, n=gu.out_features, gated=True)
        elif isinstance(m, SwiGLUMLP):
            covered.update((id(m.gate_proj), id(m.up_proj)))
            if not (m._w.sharded or tp.is_dtensor(m.gate_proj.weight)):
                add(path, f"fused gate|up projection ({m.activation} gate)",
                    Fp8Gemm(m._w, m._b, recipe=recipe, state=state), m, "_fp8", k=m.gate_proj.in_features,
                    n=2 * m.gate_proj.out_features, gated=True)
        elif isinstance(m, LinearAct):
            up = getattr(m, m._up)
            covered.add(id(up))
            k, n = (up.weight.shape if m.conv1d else up.weight.shape[::-1])
            add(path, f"{m._up} + {m.activation} epilogue", Fp8Gemm(up, up if up.bias is not None else None,
                conv1d=m.conv1d, recipe=recipe, state=state), m, "_fp8", k=k, n=n)
        elif isinstance(m, DenseResidualNorm):
            covered.add(id(m.dense))
            add(path, "dense (+ bias)", Fp8Gemm(m.dense, m.dense if m.dense.bias is not None else None,
                recipe=recipe, state=state), m, "_fp8", k=m.dense.in_features, n=m.dense.out_features)
    for path, parent, name, child in _named_children(model):
        if type(child) is not nn.Linear or id(child) in covered or quantized_linear(child):
            continue
        covered.add(id(child))
        if child is out_emb and not recipe.lm_head:
            report.add("skipped", path, "lm_head (output embeddings)", "kept bf16 by default (Fp8Recipe(lm_head="
                       "True) puts it in FP8): the logits' precision")
            continue
        if tp.is_dtensor(child.weight):
            report.add("skipped", path, "Linear", "tensor-parallel weight: FP8 GEMMs of DTensor shards not wired")
            continue
        new = Fp8Linear(child, recipe, state)
        add(path, "Linear", new._fp8, parent, name, swap=new, k=child.in_features, n=child.out_features)
    return sites


def _named_children(model):
    for pname, parent in list(model.named_modules()):
        for cname, child in list(parent.named_children()):
            yield (f"{pname}.{cname}" if pname else cname), parent, cname, child


def kernel_check(device: torch.device, k: int, n: int, backend: str, op: str = "scaled_gemm") -> str | None:
    """Why no FP8 kernel serves a (tokens, K) x (K, N) `op` call (scaled_gemm, or scaled_swiglu_gemm with N = 2 x
    intermediate) on this device under the policy in force (None: one does): the explanation of a probe call with
    the operand layouts the sites use (nothing runs)."""
    a = torch.empty(16, k, dtype=E4M3, device=device)
    b = torch.empty(n, k, dtype=E4M3, device=device).t()
    sa = torch.ones(16, 1, dtype=torch.float32, device=device)
    sb = torch.ones(1, n, dtype=torch.float32, device=device)
    return why_no_fp8(explain(op, a, b, sa, sb), device.type, backend, op)


def why_no_fp8(exp, device_type: str, backend: str, op: str = "scaled_gemm") -> str | None:
    """The reason in an `op` explanation (scaled_gemm, scaled_swiglu_gemm) that no FP8 kernel serves, or None.  The
    reference impl (dequantize + matmul) counts on the CPU, where it is the only one, and where the user pinned
    backend="reference"; on an accelerator it would be slower than the bf16 GEMMs it replaces."""
    chosen = next((c for c in exp.candidates if c.chosen), None)
    refused = "; ".join(f"{c.impl.id}: {', '.join(c.reasons)}" for c in exp.candidates if not c.accepted)
    if chosen is None:
        return f"no {op} kernel serves {device_type} ({refused or exp.why})"
    if chosen.impl.backend == "reference" and device_type != "cpu" and backend != "reference":
        return (f"only the reference {op} (dequantize + matmul) serves {device_type}: no FP8 "
                "tensor-core kernel" + (f" ({refused})" if refused else ""))
    return None


def _sensitivity(m: dict) -> float:
    v = m.get("kl", m.get("rel_err", math.inf))
    return math.inf if v is None or v != v else float(v)


def _nums(m: dict) -> str:
    keys = ("kl", "top1_agreement", "rel_err")
    return ", ".join(f"{k}={m[k]:.3g}" for k in keys if isinstance(m.get(k), float))


def decide_units(units: list[str], set_fp8, measure) -> tuple[set[str], dict[str, tuple[str, dict]], int]:
    """(units kept in fp8, {unit: (why, metrics)} for the others, forwards run).  set_fp8(units) turns exactly those
    units' GEMMs to fp8; measure() -> validate.compare metrics against the bf16 reference (the module docstring's
    greedy, bounded search)."""
    runs = 0
    set_fp8(set(units))
    m_all = measure()
    runs += 1
    if m_all["passed"]:
        return set(units), {}, runs
    alone: dict[str, dict] = {}
    for u in units:
        set_fp8({u})
        alone[u] = measure()
        runs += 1
    order = sorted(units, key=lambda u: (_sensitivity(alone[u]), units.index(u)))
    ok = [u for u in order if alone[u]["passed"]]
    lo, hi = 0, len(ok)                   # the longest prefix of `ok` (least sensitive first) that passes
    while lo < hi:
        mid = (lo + hi + 1) // 2
        set_fp8(set(ok[:mid]))
        runs += 1
        if measure()["passed"]:
            lo = mid
        else:
            hi = mid - 1
    best = lo
    kept = set(ok[:best])
    why = {}
    for u in units:
        if u in kept:
            continue
        if not alone[u]["passed"]:
            why[u] = ("fails the FP8 limits alone", alone[u])
        else:
            why[u] = (f"the {len(ok) - best} most sensitive of the blocks that pass alone: with them in FP8 the model "
                      f"fails the limits", alone[u])
    set_fp8(kept)
    return kept, why, runs


def fp8_pass(root: nn.Module, report, undo, state, *, recipe: Fp8Recipe, inputs, backend: str, memo: dict,
             attention: bool = False) -> None:
    """Put the model's GEMMs on scaled_gemm, and its attention on the FP8 attention, where an FP8 kernel serves and
    the per-block validation keeps them (module docstring).  `memo` carries the decision across a floor's
    re-application of this step.  attention: where the model does not run opsadv's attention (the attention step
    measured no gain in bf16 and was undone), this step installs it, for the FP8 attention it brings: the floor then
    times both together, FP8 GEMMs and FP8 attention against the bf16 GEMMs and the model's own attention."""
    sites = find_sites(root, recipe, report, state)
    dev = next((p.device for p in root.parameters()), torch.device("cpu"))
    dtype = next((p.dtype for p in root.parameters() if p.is_floating_point()), torch.float32)
    attn, attn_why = find_attention_sites(root), None
    if not attn and attention and attention_modules(root):
        with state.scope():
            why = attention_kernel_check(dev, attention_modules(root)[0][1], dtype, backend)
        if why is None and attention_pass(root, report, undo, state):
            report.notes.append("precision fp8: the fp8 step installed opsadv's attention for the FP8 attention "
                                "(the floor times them together with the FP8 GEMMs)")
            attn = find_attention_sites(root)
    if attn:
        with state.scope():
            attn_why = attention_kernel_check(dev, attn[0].module, dtype, backend)
        if attn_why is not None:
            attn = []
    else:
        attn_why = "the model does not run opsadv's attention (no attention rewrite, or it was undone)"
    if not sites and not attn:
        report.notes.append("precision fp8: no GEMM to put in FP8")
        return
    why_not: dict[tuple, str | None] = {}
    with state.scope():
        for s in sites:
            if s.shape not in why_not:
                why_not[s.shape] = kernel_check(dev, *s.shape, backend)
        # the gated MLPs: the fused FP8 SwiGLU GEMM where a kernel serves it, else scaled_gemm then swiglu
        fused_not: dict[tuple, str | None] = {}
        for s in sites:
            if s.gated and why_not[s.shape] is None:
                if s.shape not in fused_not:
                    fused_not[s.shape] = kernel_check(dev, *s.shape, backend, op="scaled_swiglu_gemm")
                s.gemm.fused = fused_not[s.shape] is None
                s.gemm.fused_why = fused_not[s.shape]
    refused = [s for s in sites if why_not[s.shape] is not None]
    if refused and backend != "auto":
        raise InvalidArgumentError("convert_model", "precision", f"'fp8' with an FP8 GEMM kernel on backend "
                                   f"{backend!r} (pinned)", why_not[refused[0].shape])
    for s in refused:
        report.add("kept", s.path, f"{s.what}: {LABEL}", why_not[s.shape])
    sites = [s for s in sites if why_not[s.shape] is None]
    if not sites and not attn:
        return
    units = list(dict.fromkeys([s.unit for s in sites] + [a.unit for a in attn]))
    if "decision" not in memo:
        memo["decision"] = _decide(root, sites, units, inputs, report, attn)
    kept, why, runs = memo["decision"]
    for s in sites:
        s.gemm.enabled = True
        if s.unit not in kept:
            s.gemm.drop_cache()
    for s in (s for s in sites if s.unit in kept):
        s.attach(undo)
        report.add("fp8", s.path, f"{s.what} -> {_target(s)} (e4m3: per-channel weights, per-token current "
                   f"scaling)")
    for a in (a for a in attn if a.unit in kept):
        a.attach(undo)
        report.add("fp8", a.path, ATTENTION_WHAT)
    for u in units:
        if u in why:
            reason, m = why[u]
            report.add("kept", u, f"{LABEL} in this block", f"{reason}: alone in FP8 {_nums(m)} (limits "
                       f"{_val.FP8_LIMITS})")
    n_attn = sum(a.unit in kept for a in attn)
    report.fp8 = {"units": len(units), "fp8_units": len(kept), "bf16_units": sorted(why, key=units.index),
                  "validation_forwards": runs,
                  "attention": f"fp8 in {n_attn} of {len(attn)} blocks" if attn else f"bf16 ({attn_why})",
                  "recipe": vars(recipe).copy(), "unit_metrics": {u: _short(m) for u, (_, m) in why.items()}}


@dataclass
class AttentionSite:
    """An attention module whose block may run the FP8 attention (hf_attention.FP8_FLAG)."""

    path: str
    unit: str
    module: nn.Module

    def set(self, on: bool) -> None:
        if on:
            self.module.__dict__[FP8_FLAG] = True
        else:
            self.module.__dict__.pop(FP8_FLAG, None)

    def attach(self, undo) -> None:
        self.set(True)
        undo.instance_attrs.append((self.module, FP8_FLAG))


def find_attention_sites(model: nn.Module) -> list[AttentionSite]:
    """The attention modules that call opsadv's attention function (the attention rewrite applied)."""
    lists = {p for p, m in model.named_modules() if isinstance(m, nn.ModuleList)}
    root_cfg = getattr(model, "config", None)
    out = []
    for path, m in attention_modules(model):
        cfg = getattr(m, "config", None) or root_cfg
        if getattr(cfg, "_attn_implementation", None) == ATTN_NAME:
            out.append(AttentionSite(path, _unit_of(path, lists), m))
    return out


def attention_kernel_check(device: torch.device, module: nn.Module, dtype: torch.dtype, backend: str) -> str | None:
    """Why no FP8 attention kernel serves this module's calls (None: one does): the explanation of a probe call
    with its head counts and head dim (nothing runs)."""
    cfg = module.config
    hq = cfg.num_attention_heads
    hkv = getattr(cfg, "num_key_value_heads", None) or hq
    d = getattr(module, "head_dim", None) or getattr(cfg, "head_dim", None) or cfg.hidden_size // hq
    q = torch.ones(1, hq, 16, d, device=device, dtype=dtype)
    k = torch.ones(1, hkv, 16, d, device=device, dtype=dtype)
    args = quantize_qkv(q, k, k)
    out_dtype = dtype if dtype in OUT_DTYPES else torch.bfloat16
    return why_no_fp8(explain("fp8_attention", *args, causal=True, out_dtype=out_dtype), device.type, backend,
                      "fp8_attention")


def _target(s: Site) -> str:
    """What a site's no-grad calls run, for the report."""
    if not s.gated:
        return "opsadv.scaled_gemm"
    if s.gemm.fused:
        return "opsadv.scaled_swiglu_gemm (one FP8 GEMM, gated epilogue; training: scaled_gemm + opsadv.swiglu)"
    return f"opsadv.scaled_gemm + opsadv.swiglu (no fused FP8 SwiGLU kernel: {s.gemm.fused_why})"


def _short(m: dict) -> dict:
    return {k: m[k] for k in ("kl", "top1_agreement", "rel_err", "passed") if k in m}


def _decide(root, sites, units, inputs, report, attn=()):
    """Attach every site for the trial, search, detach: (kept units, why per bf16 unit, forwards)."""
    if inputs is None:
        report.notes.append("precision fp8: GEMMs not validated per block (no validation inputs): all kept in FP8")
        return set(units), {}, 0
    trial = Undo()
    for s in sites:
        s.attach(trial)
    modes = {m: m.training for m in root.modules()}
    root.eval()
    try:
        for s in sites:
            s.gemm.enabled = False
        ref = _val.check_run(root, inputs)          # the bf16 conversion: what FP8 is judged against
        dtype = next((p.dtype for p in root.parameters() if p.is_floating_point()), torch.float32)

        def set_fp8(on: set[str]) -> None:
            for s in sites:
                s.gemm.enabled = s.unit in on
            for a in attn:
                a.set(a.unit in on)

        def measure() -> dict:
            return _val.compare(ref, _val.check_run(root, inputs), inputs, dtype, limits=_val.FP8_LIMITS)
        kept, why, runs = decide_units(units, set_fp8, measure)
        return kept, why, runs + 1
    finally:
        for a in attn:
            a.set(False)
        for m, t in modes.items():
            m.training = t
        trial.revert()
