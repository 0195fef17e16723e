"""Drop-in modules that run opsadv ops.  Each keeps the parameter names of the module it
replaces (state_dict keys, save_pretrained and from_pretrained are unaffected) and runs its ops
under the converted model's policy (see state.py).

Fused weights ([W_q|W_k|W_v], [W_gate|W_up]) live in one buffer whose row blocks *are* the
original parameters (their .data are views of it): no second copy, and optimizer steps or
load_state_dict (in-place) stay visible.  With gradients enabled the buffer enters the graph as a differentiable
function of the parameters (no copy; the gradient's row blocks become each parameter's .grad), so training
updates the original parameters."""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from opsadv import ops

from . import tp
from .state import scope_of


_is_compiling = torch.compiler.is_compiling
_is_exporting = getattr(torch.compiler, "is_exporting", lambda: False)


def _exporting() -> bool:
    return bool(_is_compiling() or _is_exporting())


def quantized_linear(m) -> str | None:
    """Why nn.Linear `m` holds no plain float weight that a fused GEMM can read (bitsandbytes' Linear4bit /
    Linear8bitLt: packed integer Params4bit / Int8Params; torchao and other tensor-subclass quantizations), else
    None.  Such a layer computes in its own forward; fusing it would read the packed storage as a weight."""
    w = getattr(m, "weight", None)
    if not isinstance(w, torch.Tensor):
        return f"{type(m).__name__} has no weight tensor"
    if tp.is_dtensor(w):
        return None if w.dtype.is_floating_point else f"{type(m).__name__}: a {w.dtype} DTensor weight"
    if type(w) not in (nn.Parameter, torch.Tensor) or not w.dtype.is_floating_point:
        return f"{type(m).__name__} ({type(w).__name__} {str(w.dtype).replace('torch.', '')})"
    return None


class _RowsOf(torch.autograd.Function):
    """buf, whose row blocks the parameters are, as a differentiable function of them: no copy forward (the
    concatenation already exists); backward, the gradient's row blocks, which are views and contiguous where the
    gradient is (a weight gradient in the weight's layout: core/ops/_common.weight_grad), so AccumulateGrad keeps
    them as each parameter's .grad without a copy."""

    @staticmethod
    def forward(ctx, buf, *params):
        ctx.rows = [p.shape[0] for p in params]
        return buf.view_as(buf)

    @staticmethod
    def backward(ctx, grad):
        return (None, *grad.split(ctx.rows, 0))


class FusedRows:
    """Row-concatenation of 2-D parameters (and of 1-D biases) kept as one buffer.

    The parameters are read from the modules holding them at call time (`own`): a wrapper that replaces a module's
    parameters (FSDP2's fully_shard, a tensor-parallel plan, load_state_dict(assign=True)) is followed.  Only the
    parameters fused at conversion become row blocks of the buffer; any others are concatenated per call
    (differentiable), and DTensors sharded for tensor parallelism by their local shards (convert/tp.py)."""

    def __init__(self, params: list[nn.Parameter]):
        self.fused = list(params)                 # the parameters fused at conversion
        self.owners: list = [None] * len(self.fused)   # (module, name) holding each one now, where known
        self.sharded = any(tp.is_dtensor(p) for p in self.fused)   # tensor-parallel shards: never aliased
        self.buf: torch.Tensor | None = None
        self._layout: tuple = ()                  # per parameter: (byte offset in buf, numel), set by _rebuild

    def own(self, i: int, module: nn.Module, name: str) -> None:
        """Parameter i is read from module.<name> from now on."""
        self.owners[i] = (module, name)

    @property
    def params(self) -> list:
        return [f if o is None else o[0]._parameters.get(o[1]) for f, o in zip(self.fused, self.owners)]

    def _own_params(self, ps) -> bool:
        for p, f in zip(ps, self.fused):
            if p is not f:
                return False
        return True

    def get(self) -> torch.Tensor:
        ps = self.params
        if self.sharded or not self._own_params(ps):
            # another owner's parameters (FSDP2's unsharded ones, a TP plan's DTensors): never aliased into the
            # buffer (their storage is theirs), concatenated per call; DTensors by this rank's shards
            for p, o in zip(ps, self.owners):
                if o is not None and tp.is_dtensor(p) and tp.is_fsdp_module(o[0]):
                    raise RuntimeError(
                        f"opsadv: a fused weight's part ({type(o[0]).__name__}.{o[1]}) is sharded by FSDP2 on its own "
                        "while another part runs: fully_shard the module that holds the whole fused group (the "
                        "decoder layer, the attention or MLP block), not its projections one by one")
            return torch.cat([tp.local(p) for p in ps], 0)
        if torch.is_grad_enabled():
            for p in ps:                           # (a loop: a generator for any() costs more, per call)
                if p.requires_grad:
                    # differentiable: gradients reach each parameter; the fused buffer itself where the parameters
                    # still are its rows (eager), else a concatenation (traced, or after .to() / a fresh load)
                    if self.buf is not None and not _exporting() and self._aliased():
                        return _RowsOf.apply(self.buf, *ps)
                    return torch.cat(list(ps), 0)
        if _exporting():
            return torch.cat(list(ps), 0)          # traceable
        if self.buf is None or not self._aliased():
            self._rebuild()
        return self.buf

    def get_t(self) -> torch.Tensor:
        """get().t(), the (K, N) operand the GEMMs take; the fused buffer's transposed view is made once
        per buffer (the differentiable / traced one is transposed per call)."""
        buf = self.get()
        if buf is not self.buf:
            return buf.t()
        bt = getattr(self, "_bt", None)
        if bt is None or bt[0] is not buf:
            with torch.inference_mode(False):      # (kept across calls: never an inference tensor)
                bt = self._bt = (buf, buf.t())
        return bt[1]

    def _aliased(self) -> bool:
        """Each parameter is still its row block of buf (a decode step asks twice per layer, so this is
        kept to a few C calls per parameter: address, size, layout, dtype, device index).  buf keeps its
        storage alive, so no other tensor can start at those addresses."""
        buf, layout = self.buf, getattr(self, "_layout", ())
        if len(layout) != len(self.fused):
            return False
        base, dt, dev = buf.data_ptr(), buf.dtype, buf.get_device()
        for p, (off, numel) in zip(self.fused, layout):
            if (p.data_ptr() != base + off or p.numel() != numel or p.dtype is not dt or p.get_device() != dev
                    or not p.is_contiguous()):
                return False
        return True

    def _rebuild(self) -> None:
        # (after .to(), deepcopy or a fresh load the views are gone: fuse again, re-point the params).
        # Never inside inference mode: parameters must not become inference tensors.
        with torch.inference_mode(False), torch.no_grad():
            buf = torch.cat([p.detach() for p in self.fused], 0).contiguous()
            row, layout, step = 0, [], buf.stride(0) * buf.element_size()
            for p in self.fused:
                n = p.shape[0]
                p.data = buf[row:row + n]         # the parameter becomes a view of its rows of buf
                layout.append((row * step, p.numel()))
                row += n
        self.buf, self._layout = buf, tuple(layout)

    def unalias(self) -> None:
        """The fused parameters get their own storage again; the next eager call re-fuses."""
        with torch.no_grad():
            for p in self.fused:
                if p is not None and not tp.is_dtensor(p):
                    p.data = p.data.clone()
        self.buf = None

    def __setstate__(self, state):
        # (a FusedRows pickled before owners existed held its parameters as `params`)
        if "params" in state:
            state["fused"] = state.pop("params")
            state["owners"] = [None] * len(state["fused"])
            state["sharded"] = False
        self.__dict__.update(state)


def unalias_fused(model: nn.Module) -> None:
    """Give every fused parameter its own storage again (serializers that group tensors by storage,
    e.g. torch.export.save, want that); the next eager call re-fuses."""
    seen = set()
    for m in model.modules():
        rows = [m._w, m._b] if isinstance(m, SwiGLUMLP) else \
            [m.group.weight, m.group.bias] if isinstance(m, QKVProjection) else []
        for f in rows:
            if f is not None and id(f) not in seen:
                seen.add(id(f))
                f.unalias()


class OpsadvNorm(nn.Module):
    """LayerNorm / RMSNorm over the last dim via opsadv.ops.layer_norm / rms_norm."""

    cast_to_weight = False   # (class default: a module pickled before the attribute existed)

    def __init__(self, kind: str, weight, bias, eps: float, offset: float = 0.0, eps_attr: str = "eps",
                 cast_to_weight: bool = False):
        super().__init__()
        self.kind, self.eps, self.offset = kind, float(eps), float(offset)
        # T5LayerNorm's rule: a half-precision weight turns a float32 input's output into the weight's dtype
        self.cast_to_weight = cast_to_weight
        self.weight = weight
        self.bias = bias
        if eps_attr != "eps":
            setattr(self, eps_attr, float(eps))   # code that reads e.g. .variance_epsilon keeps working

    def extra_repr(self) -> str:
        return f"{self.kind}, {tuple(self.weight.shape) if self.weight is not None else None}, eps={self.eps}"

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        w, b = self.weight, self.bias
        if w is not None and w.dtype != x.dtype:   # e.g. fp32 residual stream, bf16 weight: promote like torch does
            dt = torch.promote_types(w.dtype, x.dtype)
            x, w, b = x.to(dt), w.to(dt), (b.to(dt) if b is not None else None)
            residual = residual.to(dt) if residual is not None else None
        with scope_of(self):
            if self.kind == "rms":
                out = ops.rms_norm(x, w, self.eps, residual=residual, offset=self.offset)
            else:
                out = ops.layer_norm(x, w, b, self.eps, residual=residual)
        if not self.cast_to_weight:
            return out
        wdt = self.weight.dtype if self.weight is not None else None
        if wdt in (torch.float16, torch.bfloat16):
            if isinstance(out, tuple):              # (normalized, residual sum): the residual stream keeps its dtype
                return (out[0].to(wdt), *out[1:])
            return out.to(wdt)
        return out


class QKVProjection(nn.Linear):
    """One of q/k/v.  The q projection runs one GEMM over [W_q|W_k|W_v] and leaves k and v (either order) for the
    next calls made on the *same* input tensor; any other input (cross-attention, an unexpected call order) gets
    its own plain projection, so results never depend on order, and no output outlives its forward.

    An nn.Linear (its own weight and bias, no Linear code run) so that a tensor-parallel plan applied after
    conversion takes it as the Linear it replaces.  With q, k and v column-parallel (convert/tp.py) each rank's GEMM
    runs over its own row blocks [q_r|k_r|v_r] and each projection hands on its columns; other layouts run each
    projection as the Linear it is, under the plan's hooks."""

    def __init__(self, linear: nn.Linear, role: int, group: "QKVGroup"):
        nn.Module.__init__(self)
        self.weight, self.bias = linear.weight, linear.bias
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.role, self.group = role, group
        group.weight.own(role, self, "weight")
        if group.bias is not None:
            group.bias.own(role, self, "bias")

    def extra_repr(self) -> str:
        return f"{'qkv'[self.role]} of fused qkv, in={self.in_features}, out={self.out_features}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g = self.group
        if g.weight.sharded or type(self.weight) is not nn.Parameter and tp.is_dtensor(self.weight):
            return self._forward_sharded(x)
        if self.role == 0:
            with scope_of(self):
                full = g.fp8(x) if g.fp8 is not None else None
                if full is None:
                    full = ops.gemm(x, g.weight.get_t(), bias=g.bias.get() if g.bias is not None else None)
            g.stash = (x, full, frozenset({1, 2}))
            return self._slice(full)
        st = g.stash
        if st is not None:
            if st[0] is x and self.role in st[2]:
                rest = st[2] - {self.role}
                g.stash = (x, st[1], rest) if rest else None     # the last of k / v releases the activation
                return self._slice(st[1])
            g.stash = None       # another input's: nothing is held past the call that could have used it
        return F.linear(x, self.weight, self.bias)

    def _slice(self, full: torch.Tensor) -> torch.Tensor:
        lo = sum(self.group.splits[:self.role])
        return full[..., lo:lo + self.out_features]

    def _forward_sharded(self, x: torch.Tensor) -> torch.Tensor:
        """Tensor-parallel weights: column-parallel q, k and v fuse into this rank's GEMM; any other layout runs the
        Linear as DTensor math (the plan's hooks, if any, made x a DTensor)."""
        g = self.group
        ws = g.weight.params
        bs = g.bias.params if g.bias is not None else []
        mesh = tp.colwise_mesh(ws + bs)
        if mesh is None:
            if not tp.is_dtensor(x):
                raise RuntimeError(f"opsadv: fused {'qkv'[self.role]} projection with tensor-parallel weights of a "
                                   f"layout it does not serve ({[tuple(w.placements) for w in ws]}) got a plain "
                                   "input; parallelize q/k/v with ColwiseParallel, or convert with "
                                   "rewrites={'qkv': False}")
            return F.linear(x, self.weight, self.bias)
        key = tp.input_key(x)
        if self.role == 0:
            xl, as_dt = tp.colwise_input(x, mesh)
            with scope_of(self):
                w = g.weight.get()                # this rank's [q_r|k_r|v_r]
                full = ops.gemm(xl, w.t(), bias=g.bias.get() if g.bias is not None else None)
            splits = tuple(tp.local(p).shape[0] for p in ws)
            g.stash = (key, full, splits, as_dt)
            return tp.colwise_output(full[..., :splits[0]], mesh, self.out_features, as_dt)
        st = g.stash
        if st is not None and tp.same_input(st[0], key):
            full, splits = st[1], st[2]
            lo = splits[0] if self.role == 1 else splits[0] + splits[1]
            if self.role == 2:
                g.stash = None
            return tp.colwise_output(full[..., lo:lo + splits[self.role]], mesh, self.out_features, st[3])
        xl, as_dt = tp.colwise_input(x, mesh)
        out = F.linear(xl, tp.local(self.weight), tp.local(self.bias))
        return tp.colwise_output(out, mesh, self.out_features, as_dt)


class QKVGroup:
    fp8 = None               # convert_model(precision="fp8"): the Fp8Gemm of [W_q|W_k|W_v] (convert/fp8.py)

    def __init__(self, q: nn.Linear, k: nn.Linear, v: nn.Linear):
        self.splits = (q.out_features, k.out_features, v.out_features)
        self.weight = FusedRows([q.weight, k.weight, v.weight])
        self.bias = FusedRows([q.bias, k.bias, v.bias]) if q.bias is not None else None
        self.stash = None        # (input, fused output, the roles still to take their columns) within one forward


# the activations in torch (the unfused paths: tensor-parallel layouts the fused modules do not serve, children
# replaced after conversion)
_ACTIVATIONS = {"silu": F.silu, "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"), "gelu": F.gelu,
                "relu": F.relu, "none": lambda t: t}


def remember_children(module: nn.Module, names) -> None:
    """Note which child modules a fused module's weights were read from (see children_replaced)."""
    module.__dict__["_opsadv_built_on"] = tuple((n, module._modules[n]) for n in names)


def children_replaced(module: nn.Module) -> bool:
    """A child the fusion read its weights from was replaced after conversion (peft's get_peft_model wraps it in a
    LoRA layer, a user swaps it): the fused GEMM would skip the new module's own forward, so the children run as
    they are now."""
    return any(module._modules.get(n) is not m for n, m in module.__dict__.get("_opsadv_built_on", ()))

MIN_CHUNK_ROWS = 64          # row chunks below this make the GEMMs inefficient


class SwiGLUMLP(nn.Module):
    """down_proj(act(gate_proj(x)) * up_proj(x)) over [W_gate|W_up], then down_proj.  act silu (SwiGLU): no-grad
    calls run swiglu_gemm (one GEMM with the silu(g) * u epilogue), grad-recording calls torch's linear then the
    swiglu op.  act gelu_tanh (GeGLU, Gemma's MLP): torch's linear then swiglu(activation="gelu_tanh") in both
    (swiglu_gemm's epilogue is silu only)."""

    activation = "silu"      # (class default: a module pickled before GeGLU support has no instance attribute)
    _fp8 = None              # convert_model(precision="fp8"): the Fp8Gemm of [W_gate|W_up] (convert/fp8.py), gated()

    def __init__(self, gate_proj: nn.Linear, up_proj: nn.Linear, down_proj: nn.Module, activation: str = "silu"):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = gate_proj, up_proj, down_proj
        self.activation = activation
        self._fuse(gate_proj, up_proj)
        remember_children(self, ("gate_proj", "up_proj"))

    def _fuse(self, gate: nn.Linear, up: nn.Linear) -> None:
        """[W_gate|W_up] (and the biases) as FusedRows read from the two Linears."""
        self._w = FusedRows([gate.weight, up.weight])
        self._b = FusedRows([gate.bias, up.bias]) if gate.bias is not None else None
        for i, lin in enumerate((gate, up)):
            self._w.own(i, lin, "weight")
            if self._b is not None:
                self._b.own(i, lin, "bias")

    def extra_repr(self) -> str:
        return f"activation={self.activation}"

    # mem_opt >= 2 sets this: the (rows, intermediate) activation never exceeds it; the MLP runs over
    # row chunks (swiglu_gemm + down_proj per chunk), so its intermediate is never whole in memory
    row_chunk_bytes: int | None = None

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        if children_replaced(self):
            return self._down(_ACTIVATIONS[self.activation](self.gate_proj(x)) * self.up_proj(x))
        if self._w.sharded or tp.is_dtensor(self.gate_proj.weight):
            return self._mlp_sharded(x)
        with scope_of(self):
            # FP8 (convert/fp8.py): inference one scaled_swiglu_gemm, training the FP8 [W_g|W_u] GEMM + swiglu
            h = self._fp8.gated(x, self.activation) if self._fp8 is not None else None
            if h is None and (self.activation != "silu" or self._trains(x)):
                # training: the [W_g|W_u] GEMM as torch's linear (cuBLAS forward and backward; the mlp bench suite
                # measured opsadv's gemm backward slower at small hidden sizes), the gate as the swiglu op; GeGLU
                # runs so in inference too (no bf16 fused-epilogue GEMM for gelu_tanh)
                b = self._b.get() if self._b is not None else None
                h = ops.swiglu(F.linear(x, self._w.get(), b), activation=self.activation)
            elif h is None:
                h = ops.swiglu_gemm(x, self._w.get_t(), bias=self._b.get() if self._b is not None else None)
        return self._down(h)

    def _down(self, h: torch.Tensor) -> torch.Tensor:
        return self.down_proj(h)

    def _mlp_sharded(self, x: torch.Tensor) -> torch.Tensor:
        """Tensor-parallel weights: gate and up column-parallel and down_proj row-parallel on one mesh run this
        rank's [gate_r|up_r] GEMM, whose output columns are down_proj's input shard; any other layout runs the
        three projections as they are (under the plan's hooks)."""
        ws = self._w.params
        mesh = tp.colwise_mesh(ws + (self._b.params if self._b is not None else []))
        if mesh is None or tp.is_dtensor(x) or not tp.rowwise_on(self.down_proj.weight, mesh):
            act = _ACTIVATIONS[self.activation]
            return self._down(act(self.gate_proj(x)) * self.up_proj(x))
        xl, _ = tp.colwise_input(x, mesh)
        w = self._w.get()                         # this rank's [gate_r|up_r]
        b = self._b.get() if self._b is not None else None
        with scope_of(self):
            if self.activation != "silu" or self._trains(x):
                h = ops.swiglu(F.linear(xl, w, b), activation=self.activation)
            else:
                h = ops.swiglu_gemm(xl, w.t(), bias=b)
        return self._down(h)

    def _n_ff(self) -> int:
        return self.gate_proj.out_features

    def _trains(self, x: torch.Tensor) -> bool:
        return torch.is_grad_enabled() and (x.requires_grad or self.gate_proj.weight.requires_grad)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        limit = self.row_chunk_bytes
        n_ff = self._n_ff()
        rows = x.numel() // x.shape[-1]
        if not limit or rows * n_ff * x.element_size() <= limit:
            return self._mlp(x)
        step = max(MIN_CHUNK_ROWS, limit // (n_ff * x.element_size()))
        x2 = x.reshape(rows, x.shape[-1])
        if self._trains(x):
            out = torch.cat([self._mlp(x2[i:i + step]) for i in range(0, rows, step)])
        else:                                     # no graph to keep: write each chunk into one output
            first = self._mlp(x2[:step])
            out = first.new_empty((rows, first.shape[-1]))
            out[:step] = first
            for i in range(step, rows, step):
                out[i:i + step] = self._mlp(x2[i:i + step])
        return out.reshape(*x.shape[:-1], out.shape[-1])


class NamedGatedMLP(SwiGLUMLP):
    """SwiGLUMLP for a gated MLP whose children have other names (T5's wi_0 / wi_1 / wo: the names, hence the
    state_dict keys, are kept), with the module's dropout between the product and the down projection (identity in
    eval) and the product cast to the down projection's dtype first (T5 keeps `wo` in float32 under float16)."""

    def __init__(self, gate: nn.Linear, up: nn.Linear, down: nn.Linear, names: tuple[str, str, str],
                 activation: str = "silu", dropout: nn.Module | None = None):
        nn.Module.__init__(self)
        self._names = names
        self.activation = activation
        for n, m in zip(names, (gate, up, down)):
            self.add_module(n, m)
        if dropout is not None:
            self.dropout = dropout
        self._fuse(gate, up)
        remember_children(self, names[:2])

    @property
    def gate_proj(self) -> nn.Linear:
        return getattr(self, self._names[0])

    @property
    def up_proj(self) -> nn.Linear:
        return getattr(self, self._names[1])

    @property
    def down_proj(self) -> nn.Linear:
        return getattr(self, self._names[2])

    def _down(self, h: torch.Tensor) -> torch.Tensor:
        drop = self._modules.get("dropout")
        if drop is not None:
            h = drop(h)
        down = self.down_proj
        if h.dtype != down.weight.dtype:
            h = h.to(down.weight.dtype)
        return down(h)


class FusedSwiGLUMLP(SwiGLUMLP):
    """down_proj(act(g) * u) for an MLP whose gate and up projections already are one Linear whose output is
    [g | u] (Phi-3's gate_up_proj): its weight, transposed, is swiglu_gemm's [W_gate|W_up] as it stands (no
    second buffer); the child names of the replaced module are kept.  act silu or gelu_tanh, as SwiGLUMLP."""

    def __init__(self, gate_up_proj: nn.Linear, down_proj: nn.Module, names=("gate_up_proj", "down_proj"),
                 activation: str = "silu"):
        nn.Module.__init__(self)
        self._names = names
        self.activation = activation
        self.add_module(names[0], gate_up_proj)
        self.add_module(names[1], down_proj)
        self._w = self._b = None
        remember_children(self, names[:1])

    def _gate_up(self) -> nn.Linear:
        return getattr(self, self._names[0])

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        gu = self._gate_up()
        with scope_of(self):
            # FP8 (convert/fp8.py): inference one scaled_swiglu_gemm, training the FP8 gate_up GEMM + swiglu
            # (a gate_up_proj replaced after conversion, or tensor-parallel weights: it runs as the module it is)
            replaced = children_replaced(self)
            h = self._fp8.gated(x, self.activation) if self._fp8 is not None and not replaced else None
            if h is None and (replaced or self.activation != "silu" or self._trains(x) or tp.is_dtensor(gu.weight)):
                h = ops.swiglu(gu(x), activation=self.activation)
            elif h is None:
                h = ops.swiglu_gemm(x, gu.weight.t(), bias=gu.bias)
        return getattr(self, self._names[1])(h)

    def _n_ff(self) -> int:
        return self._gate_up().out_features // 2

    def _trains(self, x: torch.Tensor) -> bool:
        return torch.is_grad_enabled() and (x.requires_grad or self._gate_up().weight.requires_grad)


class LinearAct(nn.Module):
    """activation(x @ W + b) in one gemm with an epilogue.  `conv1d` weights are (in, out) (GPT-2's
    Conv1D); nn.Linear weights are (out, in).  Optional `down` projection and dropout after it
    (GPT-2's MLP); the child names of the replaced module are kept."""

    def __init__(self, names: dict[str, nn.Module], up: str, activation: str, conv1d: bool,
                 down: str | None = None, dropout: str | None = None):
        super().__init__()
        for n, m in names.items():
            self.add_module(n, m)
        self._up, self._down, self._drop = up, down, dropout
        self.activation, self.conv1d = activation, conv1d
        remember_children(self, (up,))

    _fp8 = None              # convert_model(precision="fp8"): the Fp8Gemm of the up projection (convert/fp8.py)

    def extra_repr(self) -> str:
        return f"activation={self.activation}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        up = getattr(self, self._up)
        if children_replaced(self):
            h = _ACTIVATIONS[self.activation](up(x))
        else:
            with scope_of(self):
                h = self._fp8(x, self.activation) if self._fp8 is not None else None
                if h is None:
                    h = ops.gemm(x, up.weight if self.conv1d else up.weight.t(), bias=up.bias,
                                 activation=self.activation)
        if self._down is not None:
            h = getattr(self, self._down)(h)
        if self._drop is not None:
            h = getattr(self, self._drop)(h)
        return h


class DenseResidualNorm(nn.Module):
    """LayerNorm(dropout(dense(h)) + input) (BERT's SelfOutput/Output): gemm with bias, then the
    residual add fused into layer_norm."""

    def __init__(self, dense: nn.Linear, norm: nn.Module, dropout: nn.Module, norm_name: str = "LayerNorm"):
        super().__init__()
        self.dense, self.dropout = dense, dropout
        self.add_module(norm_name, norm)
        self._norm = norm_name
        remember_children(self, ("dense",))

    _fp8 = None              # convert_model(precision="fp8"): the Fp8Gemm of dense (convert/fp8.py)

    def forward(self, hidden_states: torch.Tensor, input_tensor: torch.Tensor) -> torch.Tensor:
        norm = getattr(self, self._norm)
        if children_replaced(self):
            h = self.dense(hidden_states)
        else:
            with scope_of(self):
                h = self._fp8(hidden_states) if self._fp8 is not None else None
                if h is None:
                    h = ops.gemm(hidden_states, self.dense.weight.t(), bias=self.dense.bias)
        h = self.dropout(h)
        if isinstance(norm, OpsadvNorm):
            return norm(h, residual=input_tensor)[0]
        return norm(h + input_tensor)
