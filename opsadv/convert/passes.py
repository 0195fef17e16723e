"""Structural module passes: find norms, MLPs, q/k/v triples and dense+residual+norm blocks by
what they are (attributes, then a numerical behaviour probe), swap in opsadv modules, and keep
an undo log so a refused conversion leaves the model as it was."""
from __future__ import annotations

import inspect

import torch
from torch import nn
from torch.nn import functional as F

from opsadv.core import tuning
from opsadv.runtime import apply_memory_policy

from .modules import (DenseResidualNorm, FusedRows, FusedSwiGLUMLP, LinearAct, NamedGatedMLP, OpsadvNorm, QKVGroup,
                      QKVProjection, SwiGLUMLP, quantized_linear)
from . import tp
from .report import ConversionReport

_EPS_ATTRS = ("variance_epsilon", "eps", "epsilon", "layer_norm_eps")
_ACTS = {"relu": F.relu, "gelu": F.gelu, "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"), "silu": F.silu}


class Undo:
    """Everything a pass changed, in order; `revert()` restores the original modules."""

    def __init__(self):
        self.swaps: list[tuple[nn.Module, str, nn.Module]] = []
        self.fused: list[FusedRows] = []
        self.attn: list[tuple[nn.Module, str]] = []     # (model, attention implementation before)
        self.instance_attrs: list[tuple[object, str]] = []   # attributes set on an instance (e.g. forward)
        self.hooks: list = []                                # module hook handles (release.py)

    def swap(self, parent: nn.Module, name: str, new: nn.Module) -> None:
        self.swaps.append((parent, name, getattr(parent, name)))
        setattr(parent, name, new)

    def empty(self) -> bool:
        return not (self.swaps or self.fused or self.attn or self.instance_attrs or self.hooks)

    def extend(self, other: "Undo") -> None:
        """Append another log (a later step's), so one revert undoes both in reverse order."""
        self.swaps += other.swaps
        self.fused += other.fused
        self.attn += other.attn
        self.instance_attrs += other.instance_attrs
        self.hooks += other.hooks

    def revert(self) -> None:
        for h in self.hooks:
            h.remove()
        for parent, name, old in reversed(self.swaps):
            setattr(parent, name, old)
        for obj, name in reversed(self.instance_attrs):
            obj.__dict__.pop(name, None)          # the class attribute shows through again
        for f in self.fused:                      # parameters stop being views of the fused buffer
            f.unalias()
        for model, before in reversed(self.attn):
            model.set_attn_implementation(before)
        self.swaps.clear()
        self.fused.clear()
        self.attn.clear()
        self.instance_attrs.clear()
        self.hooks.clear()


def _tol(dtype: torch.dtype) -> float:
    return 2e-4 if dtype in (torch.float32, torch.float64) else 4e-2


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _eval_call(mods, fn):
    """Run fn with the given modules in eval mode and without grad (dropout off), restore modes; a probe's shapes
    are not the model's, so nothing is tuned for them (core.tuning.deferred)."""
    modes = [m.training for m in mods]
    try:
        for m in mods:
            m.eval()
        with torch.no_grad(), tuning.deferred():
            return fn()
    finally:
        for m, t in zip(mods, modes):
            m.train(t)


def probe_activation(act) -> str | None:
    """Which of opsadv's epilogue activations `act` computes (checked in float64), else None."""
    if not callable(act):
        return None
    t = torch.linspace(-8, 8, 1601, dtype=torch.float64)
    try:
        y = act(t)
    except Exception:
        return None
    if not isinstance(y, torch.Tensor) or y.shape != t.shape:
        return None
    for name, f in _ACTS.items():
        if torch.allclose(y, f(t), rtol=1e-6, atol=1e-7):
            return name
    return None


def _param_tensor(m, name, ndim):
    t = getattr(m, name, None)
    return t if isinstance(t, nn.Parameter) and t.dim() == ndim else None


def probe_norm(m: nn.Module):
    """(kind, offset, eps, eps_attr) when m is a last-dim LayerNorm/RMSNorm, else None.
    Attributes select candidates (1-D weight, an eps-like number, no children); a numerical probe
    with the module's own weights decides what it computes."""
    if any(True for _ in m.children()):
        return None
    if isinstance(m, nn.LayerNorm) and len(m.normalized_shape) != 1:
        return None
    w = _param_tensor(m, "weight", 1)
    if w is None:
        return None
    eps_attr = next((a for a in _EPS_ATTRS if isinstance(getattr(m, a, None), (int, float))
                     and not isinstance(getattr(m, a), bool)), None)
    if eps_attr is None:
        if isinstance(m, getattr(nn, "RMSNorm", ())) and getattr(m, "eps", 0) is None:
            eps_attr, eps = "eps", torch.finfo(w.dtype).eps
        else:
            return None
    else:
        eps = float(getattr(m, eps_attr))
    b = _param_tensor(m, "bias", 1)
    n = w.shape[0]
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(2, 3, n, generator=gen, dtype=torch.float32) * 1.5 + 0.7).to(device=w.device, dtype=w.dtype)
    try:
        y = _eval_call([m], lambda: m(x))
    except Exception:
        return None
    if not isinstance(y, torch.Tensor) or y.shape != x.shape:
        return None
    xf, wf = x.double(), w.detach().double()
    cands = [("layer", 0.0, F.layer_norm(xf, (n,), wf, b.detach().double() if b is not None else None, eps))]
    if b is None:
        rs = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        cands += [("rms", 0.0, rs * wf), ("rms", 1.0, rs * (1.0 + wf))]
    for kind, off, ref in cands:
        if _rel(y, ref) < _tol(w.dtype):
            return kind, off, eps, eps_attr
    return None


def casts_to_weight_dtype(m: nn.Module) -> bool:
    """Whether a norm with a float16 / bfloat16 weight hands a float32 input back in the weight's dtype (T5's
    T5LayerNorm casts to it; Llama's RMSNorm promotes to float32): run once on a float32 input."""
    w = _param_tensor(m, "weight", 1)
    if w is None or w.dtype not in (torch.float16, torch.bfloat16):
        return False
    x = torch.randn(1, 2, w.shape[0], generator=torch.Generator().manual_seed(0)).to(w.device)
    try:
        y = _eval_call([m], lambda: m(x))
    except Exception:
        return False
    return isinstance(y, torch.Tensor) and y.dtype == w.dtype


def _named_parents(model: nn.Module):
    for pname, parent in list(model.named_modules()):
        for cname, child in list(parent.named_children()):
            yield (f"{pname}.{cname}" if pname else cname), parent, cname, child


def norm_pass(model, report: ConversionReport, undo: Undo, state) -> None:
    seen = {}
    for path, parent, name, child in _named_parents(model):
        if isinstance(child, OpsadvNorm):
            continue
        if id(child) in seen:                       # a shared module: reuse its replacement
            if seen[id(child)] is not None:
                undo.swap(parent, name, seen[id(child)])
            continue
        if tp.is_dtensor(_param_tensor(child, "weight", 1)) and not any(True for _ in child.children()):
            seen[id(child)] = None
            report.add("skipped", path, type(child).__name__, "tensor-parallel norm (a DTensor weight, e.g. "
                       "SequenceParallel): kept as the model's, which its plan's hooks serve")
            continue
        found = probe_norm(child)
        if found is None:
            seen[id(child)] = None
            if _param_tensor(child, "weight", 1) is not None and "norm" in type(child).__name__.lower():
                report.add("skipped", path, type(child).__name__, "looks like a norm but computes neither "
                           "LayerNorm nor RMSNorm over the last dim")
            continue
        kind, off, eps, eps_attr = found
        new = OpsadvNorm(kind, child.weight, getattr(child, "bias", None) if kind == "layer" else None, eps, off,
                         eps_attr, cast_to_weight=casts_to_weight_dtype(child))
        new._opsadv_state = state
        new.train(child.training)
        seen[id(child)] = new
        undo.swap(parent, name, new)
        what = "rms_norm" + (f" (offset {off:g})" if off else "") if kind == "rms" else "layer_norm"
        report.add("replaced", path, f"{type(child).__name__} -> opsadv.{what}")


def _check_equivalent(orig, new, make_inputs, dtype) -> tuple[bool, float]:
    inputs = make_inputs()
    try:
        a = _eval_call([orig], lambda: orig(*inputs))
        b = _eval_call([new], lambda: new(*inputs))
    except Exception as e:  # a structure that does not run like the original is not a match
        return False, float("nan") if not str(e) else float("inf")
    err = _rel(b, a)
    return err < _tol(dtype), err


def _linear(m) -> bool:
    """A Linear whose float weight a fused GEMM may read (not a quantized one: quantized_linear)."""
    return isinstance(m, nn.Linear) and quantized_linear(m) is None


def _conv1d(m) -> bool:
    w = getattr(m, "weight", None)
    return type(m).__name__ == "Conv1D" and isinstance(w, nn.Parameter) and w.dim() == 2


def _rand(w: torch.Tensor, *shape):
    gen = torch.Generator().manual_seed(1)
    return torch.randn(*shape, generator=gen, dtype=torch.float32).to(device=w.device, dtype=w.dtype)


GATED_ACTS = ("silu", "gelu_tanh")      # the swiglu op's activations: SwiGLU, GeGLU (Gemma's gelu_pytorch_tanh)
_GATED_KERNELS = "gated kernels: SiLU (SwiGLU) and tanh GELU (GeGLU)"


_PROJ_NAMES = ("q_proj", "k_proj", "v_proj", "qkv_proj", "query", "key", "value", "query_key_value", "c_attn", "Wqkv")
_MLP_LINEARS = ("gate_proj", "up_proj", "down_proj", "gate_up_proj", "c_fc", "c_proj", "fc1", "fc2", "dense",
                "dense_h_to_4h", "dense_4h_to_h", "wi", "wi_0", "wi_1", "wo", "w1", "w2", "w3")


def _mlp_candidate(m):
    """(new module, description) for a supported MLP structure, else (None, reason or None)."""
    kids = dict(m.named_children())
    wrapped = [n for n, k in kids.items() if _adapter_wrapped(k)]
    if set(wrapped) & {"gate_proj", "up_proj", "gate_up_proj", "c_fc"}:       # an MLP's (not an attention's)
        return None, (f"{', '.join(wrapped)} carry an adapter ({type(kids[wrapped[0]]).__module__.split('.')[0]}: "
                      "LoRA / ...): their own forward adds it, which a fused GEMM would drop")
    quant = {n: why for n, k in kids.items() if n in _MLP_LINEARS and isinstance(k, nn.Linear)
             and (why := quantized_linear(k))}
    if quant and len(set(kids) & set(_MLP_LINEARS)) >= 2 and not set(kids) & set(_PROJ_NAMES):    # an MLP's
        return None, (f"quantized {', '.join(quant)} ({next(iter(quant.values()))}): each computes in its own "
                      "forward, which a fused GEMM over float weights would bypass")
    if all(_linear(kids.get(n)) for n in ("gate_proj", "up_proj", "down_proj")) and hasattr(m, "act_fn"):
        act = probe_activation(m.act_fn)
        g, u = kids["gate_proj"], kids["up_proj"]
        if act not in GATED_ACTS:
            return None, f"gated MLP with activation {type(m.act_fn).__name__} ({_GATED_KERNELS})"
        if g.weight.shape != u.weight.shape or (g.bias is None) != (u.bias is None):
            return None, "gate_proj and up_proj differ in shape or bias"
        if act == "gelu_tanh":
            return (SwiGLUMLP(g, u, kids["down_proj"], activation=act),
                    "GeGLU MLP -> linear([W_gate|W_up]) + opsadv.swiglu(activation='gelu_tanh') + down_proj")
        return SwiGLUMLP(g, u, kids["down_proj"]), "SwiGLU MLP -> opsadv.swiglu_gemm([W_gate|W_up]) + down_proj"
    if _linear(kids.get("dense")) and hasattr(m, "intermediate_act_fn") and \
            set(kids) <= {"dense", "intermediate_act_fn"}:
        act = probe_activation(m.intermediate_act_fn)
        if act is None:
            return None, f"activation {type(m.intermediate_act_fn).__name__} has no gemm epilogue"
        return LinearAct({"dense": kids["dense"]}, "dense", act, conv1d=False), f"dense+{act} -> opsadv.gemm(activation={act!r})"
    if _conv1d(kids.get("c_fc")) and _conv1d(kids.get("c_proj")) and hasattr(m, "act"):
        act = probe_activation(m.act)
        if act is None:
            return None, f"activation {type(m.act).__name__} has no gemm epilogue"
        names = {"c_fc": kids["c_fc"], "c_proj": kids["c_proj"]}
        drop = "dropout" if isinstance(kids.get("dropout"), nn.Dropout) else None
        if drop:
            names["dropout"] = kids["dropout"]
        return (LinearAct(names, "c_fc", act, conv1d=True, down="c_proj", dropout=drop),
                f"Conv1D c_fc+{act} -> opsadv.gemm(activation={act!r}) + c_proj")
    fused_gu = _fused_gate_up(m, kids)
    if fused_gu is not None:
        return fused_gu
    if all(_linear(kids.get(n)) for n in ("wi_0", "wi_1", "wo")):
        return _t5_gated(m, kids)
    return _two_linear_mlp(m, kids)


def _t5_gated(m, kids):
    """T5's gated MLP (T5DenseGatedActDense: wo(dropout(act(wi_0(x)) * wi_1(x)))), its child names kept."""
    g, u, wo = kids["wi_0"], kids["wi_1"], kids["wo"]
    act_mod = getattr(m, "act", None)
    act = probe_activation(act_mod)
    if act not in GATED_ACTS:
        return None, f"gated MLP (wi_0, wi_1) with activation {type(act_mod).__name__} ({_GATED_KERNELS})"
    if g.weight.shape != u.weight.shape or (g.bias is None) != (u.bias is None):
        return None, "wi_0 and wi_1 differ in shape or bias"
    extra = set(kids) - {"wi_0", "wi_1", "wo", "dropout", "act"}
    drop = kids.get("dropout")
    if extra or (drop is not None and not isinstance(drop, nn.Dropout)):
        return None, f"gated MLP (wi_0, wi_1) with other children ({sorted(extra) or type(drop).__name__})"
    kind = "GeGLU" if act == "gelu_tanh" else "SwiGLU"
    how = "linear([W_wi_0|W_wi_1]) + opsadv.swiglu(activation='gelu_tanh')" if act == "gelu_tanh" else \
        "opsadv.swiglu_gemm([W_wi_0|W_wi_1])"
    return (NamedGatedMLP(g, u, wo, ("wi_0", "wi_1", "wo"), activation=act, dropout=drop),
            f"T5 gated {kind} MLP (wi_0, wi_1, wo) -> {how} + wo")


_ACT_ATTRS = ("act", "act_fn", "activation_fn", "activation", "intermediate_act_fn")


def _act_of(m, kids):
    """(attribute name, activation) of an MLP module: a known attribute that is not a Linear."""
    for a in _ACT_ATTRS:
        f = kids.get(a, getattr(m, a, None))
        if f is not None and callable(f) and not isinstance(f, (nn.Linear, nn.Dropout)):
            return a, f
    return None, None


def _fused_gate_up(m, kids):
    """Phi-3-style MLP: one Linear computing [gate | up] (gate_up_proj) and a down projection."""
    gu, down = kids.get("gate_up_proj"), kids.get("down_proj")
    if not (_linear(gu) and _linear(down)):
        return None
    _, act = _act_of(m, kids)
    name = probe_activation(act)
    if name not in GATED_ACTS:
        return None, f"fused gate_up_proj MLP with activation {type(act).__name__} ({_GATED_KERNELS})"
    if gu.out_features % 2 or gu.out_features // 2 != down.in_features:
        return None, "gate_up_proj's output is not [gate | up] of down_proj's input width"
    if name == "gelu_tanh":
        return (FusedSwiGLUMLP(gu, down, activation=name),
                "fused gate_up_proj GeGLU MLP -> gate_up_proj + opsadv.swiglu(activation='gelu_tanh') + down_proj")
    return FusedSwiGLUMLP(gu, down), "fused gate_up_proj SwiGLU MLP -> opsadv.swiglu_gemm(W_gate_up) + down_proj"


def _two_linear_mlp(m, kids):
    """down(act(up(x))) with two nn.Linear children and an activation (GPT-NeoX, ViT's fc1/fc2): the up GEMM
    with the activation as its epilogue.  Dropout children are allowed only where they drop nothing (their
    place in the module's forward is unknown here)."""
    lins = {n: k for n, k in kids.items() if _linear(k)}
    if len(lins) != 2:
        return None, None
    try:
        if len(inspect.signature(m.forward).parameters) != 1:
            return None, None
    except (TypeError, ValueError):
        return None, None
    act_name, act = _act_of(m, kids)
    if act is None:
        return None, None
    rest = {n for n in kids if n not in lins and n != act_name}
    if any(not isinstance(kids[n], nn.Dropout) for n in rest):
        return None, None
    if any(kids[n].p > 0 for n in rest):
        return None, "dropout inside the MLP (p > 0): the fused epilogue has no place for it"
    (a, la), (b, lb) = lins.items()
    if not (la.out_features == lb.in_features and lb.out_features == la.in_features) \
            or la.in_features == la.out_features:
        return None, None
    up, down = (a, b) if la.out_features > la.in_features else (b, a)     # the expanding one runs first
    name = probe_activation(act)
    if name is None:
        return None, f"activation {type(act).__name__} has no gemm epilogue"
    return (LinearAct({up: lins[up], down: lins[down]}, up, name, conv1d=False, down=down),
            f"{up}+{name} -> opsadv.gemm(activation={name!r}) + {down}")


def _mlp_in_features(m, new) -> int:
    if isinstance(new, FusedSwiGLUMLP):
        return new._gate_up().in_features
    if isinstance(new, SwiGLUMLP):
        return new.gate_proj.in_features
    up = getattr(new, new._up)
    return up.weight.shape[0] if new.conv1d else up.in_features


def mlp_pass(model, report, undo: Undo, state) -> None:
    for path, parent, name, child in _named_parents(model):
        if isinstance(child, (SwiGLUMLP, LinearAct)):
            continue
        new, desc = _mlp_candidate(child)
        if new is None:
            if desc:
                report.add("skipped", path, type(child).__name__, desc)
            continue
        w = next(child.parameters())
        k_in = _mlp_in_features(child, new)
        new._opsadv_state = state
        new.train(child.training)
        ok, err = _check_equivalent(child, new, lambda: (_rand(w, 2, 5, k_in),), w.dtype)
        if not ok:
            report.add("skipped", path, type(child).__name__, f"rewrite differs from the module (rel err {err:.3g})")
            continue
        if isinstance(new, SwiGLUMLP) and new._w is not None:
            undo.fused += [new._w] + ([new._b] if new._b is not None else [])
        undo.swap(parent, name, new)
        report.add("fused", path, f"{type(child).__name__}: {desc}")


# mem_opt at which q/k/v stay three GEMMs: the fused output is one buffer, so the v view keeps the
# pre-rotary q and k alive next to their rotated copies for the whole attention call (Llama-1.1B b1
# s8192 on the H200: 40 MiB of the 238 MiB activation peak)
QKV_UNFUSED_MEM_OPT = 3


_CROSS = ("encdecattention", "crossattention", "cross_attn", "encoder_attn")


def _adapter_wrapped(m) -> bool:
    """A linear layer inside an adapter (peft's LoRA / IA3 / ... layers keep the wrapped Linear at .base_layer)."""
    return isinstance(getattr(m, "base_layer", None), nn.Linear)


def _qkv_mismatch(names, lins) -> str | None:
    """Why three projections cannot be one GEMM over their stacked weights (None if they can)."""
    def listed(f):
        return ", ".join(f"{n} {f(x)}" for n, x in zip(names, lins))
    if len({x.in_features for x in lins}) != 1:
        return f"different input widths ({listed(lambda x: x.in_features)})"
    if len({x.bias is None for x in lins}) != 1:
        return f"bias on some only ({listed(lambda x: 'with bias' if x.bias is not None else 'without')})"
    if len({(x.weight.dtype, x.weight.device) for x in lins}) != 1:
        return f"different weight dtypes or devices ({listed(lambda x: f'{x.weight.dtype} on {x.weight.device}')})"
    return None


def qkv_pass(model, report, undo: Undo, state, mem_opt: int | None = None) -> None:
    for path, m in list(model.named_modules()):
        for names in (("q_proj", "k_proj", "v_proj"), ("query", "key", "value"), ("q", "k", "v")):
            lins = [getattr(m, n, None) for n in names]
            if not all(_linear(x) for x in lins):
                wrapped = [n for n, x in zip(names, lins) if _adapter_wrapped(x)]
                quant = {n: why for n, x in zip(names, lins) if isinstance(x, nn.Linear) and (why := quantized_linear(x))}
                if quant and all(isinstance(x, nn.Linear) for x in lins):
                    report.add("skipped", path, "q/k/v projections", f"quantized {', '.join(quant)} "
                               f"({next(iter(quant.values()))}): each computes in its own forward, which one fused "
                               "GEMM over float weights would bypass")
                elif wrapped and all(_linear(x) or _adapter_wrapped(x) for x in lins):
                    report.add("skipped", path, "q/k/v projections", f"{', '.join(wrapped)} carry an adapter "
                               f"({type(getattr(m, wrapped[0])).__module__.split('.')[0]}: LoRA / ...): their own "
                               "forward adds it, which one fused GEMM would drop")
                continue
            if any(c in path.lower() for c in _CROSS):
                report.add("skipped", path, "q/k/v projections", "cross-attention: q reads the decoder's states, k and "
                           "v the encoder's (one fused GEMM would compute k and v of the wrong input, then discard it)")
                continue
            why = _k_or_v_first(m, names)
            if why is not None:
                report.add("skipped", path, "q/k/v projections", why)
                continue
            if mem_opt is not None and mem_opt >= QKV_UNFUSED_MEM_OPT:
                report.add("skipped", path, "q/k/v projections",
                           f"mem_opt={mem_opt}: kept as three GEMMs (a fused q|k|v output stays alive as one "
                           "buffer while q and k are rotated and attended: more peak memory)")
                continue
            q, k, v = lins
            why = _qkv_mismatch(names, lins)
            if why is not None:
                report.add("skipped", path, "q/k/v projections", why)
                continue
            why = _tp_qkv_why_not(lins)
            if why is not None:
                report.add("skipped", path, "q/k/v projections", why)
                continue
            group = QKVGroup(q, k, v)
            undo.fused += [group.weight] + ([group.bias] if group.bias is not None else [])
            for role, (n, lin) in enumerate(zip(names, lins)):
                new = QKVProjection(lin, role, group)
                new._opsadv_state = state
                new.train(lin.training)
                undo.swap(m, n, new)
            report.add("fused", path, f"{type(m).__name__}: {'|'.join(names)} -> one opsadv.gemm over [W_q|W_k|W_v]")


def _k_or_v_first(m: nn.Module, names) -> str | None:
    """Why not to fuse where the module's forward calls k or v before q (ConvBERT: key, value, then query): the fused
    GEMM runs at q's call, so k and v would run twice and the fused output would outlive the forward.  None where
    q comes first or the source does not show the calls (a dynamic call order: the runtime still falls back per
    call)."""
    try:
        src = inspect.getsource(type(m).forward)
    except (OSError, TypeError):
        return None
    pos = [src.find(f"self.{n}(") for n in names]
    if min(pos) < 0 or pos[0] < min(pos[1:]):
        return None
    first = names[1] if pos[1] < pos[2] else names[2]
    return (f"{type(m).__name__}.forward calls {first} before {names[0]}: one fused GEMM runs at {names[0]}'s call, "
            f"so {names[1]} and {names[2]} would run twice; kept as three projections")


def _tp_qkv_why_not(lins) -> str | None:
    """Why tensor-parallel q/k/v projections cannot fuse (None: they can, or are not tensor-parallel).  The fused
    module serves one layout (convert/tp.py): each weight (and bias) Shard(0) on one 1-D mesh, each projection
    handing on plain local columns of a replicated input (ColwiseParallel with use_local_output=True), which a
    probe call of each projection checks (the same seeded input on every rank)."""
    ps = [t for lin in lins for t in (lin.weight, lin.bias) if t is not None]
    if not any(tp.is_dtensor(t) for t in ps):
        return None
    mesh = tp.colwise_mesh(ps)
    if mesh is None:
        return ("tensor-parallel q/k/v not all column-parallel (DTensor Shard(0)) on one 1-D mesh: the fused GEMM "
                "would mix their shards; kept as three projections under their plan")
    x = _rand(lins[0].weight, 2, 3, lins[0].in_features)
    for lin in lins:
        try:
            got = _eval_call([lin], lambda: lin(x))
        except Exception as e:  # noqa: BLE001 - a plan the probe input does not fit
            return f"tensor-parallel q/k/v: the probe call of a projection failed ({type(e).__name__}: {e})"[:300]
        want = F.linear(x, tp.local(lin.weight).detach(), None if lin.bias is None else tp.local(lin.bias).detach())
        if tp.is_dtensor(got) or got.shape != want.shape or _rel(got, want) > _tol(want.dtype):
            return ("tensor-parallel q/k/v whose plan does not hand on each rank's columns as a plain tensor of the "
                    "replicated input (ColwiseParallel with use_local_output=True): kept as three projections")
    return None


def residual_norm_pass(model, report, undo: Undo, state) -> None:
    for path, parent, name, child in _named_parents(model):
        kids = dict(child.named_children())
        norm_name = next((n for n in ("LayerNorm", "layer_norm", "norm") if n in kids), None)
        if set(kids) != {"dense", "dropout", norm_name} or not _linear(kids["dense"]) \
                or not isinstance(kids["dropout"], nn.Dropout):
            continue
        try:
            params = list(inspect.signature(child.forward).parameters)
        except (TypeError, ValueError):
            continue
        if len(params) != 2:
            continue
        norm = kids[norm_name]
        if not isinstance(norm, OpsadvNorm) or norm.kind != "layer":
            continue
        new = DenseResidualNorm(kids["dense"], norm, kids["dropout"], norm_name)
        new._opsadv_state = state
        new.train(child.training)
        w = kids["dense"].weight
        d_in, d_out = kids["dense"].in_features, kids["dense"].out_features
        ok, err = _check_equivalent(child, new, lambda: (_rand(w, 2, 5, d_in), _rand(w, 2, 5, d_out) * 0.5), w.dtype)
        if not ok:
            report.add("skipped", path, type(child).__name__, f"dense+residual+norm rewrite differs (rel err {err:.3g})")
            continue
        undo.swap(parent, name, new)
        report.add("fused", path, f"{type(child).__name__}: dense -> opsadv.gemm(bias), residual add -> "
                   "opsadv.layer_norm(residual=)")


__all__ = ["Undo", "norm_pass", "mlp_pass", "qkv_pass", "residual_norm_pass", "probe_norm", "probe_activation"]


# bytes the MLP intermediate may take at once, per mem_opt level (None: no chunking)
MLP_CHUNK_BYTES = {0: None, 1: None, 2: 64 << 20, 3: 16 << 20}


def memory_pass(model, report, mem_opt: int | None) -> None:
    """mem_opt >= 2: SwiGLU MLPs run over row chunks bounded by MLP_CHUNK_BYTES; on CUDA the
    runtime's memory policy of that level is applied (allocator cap, see opsadv.runtime)."""
    if mem_opt is None:
        return
    limit = MLP_CHUNK_BYTES[mem_opt]
    mlps = [m for m in model.modules() if isinstance(m, SwiGLUMLP)]
    if limit and mlps:
        for m in mlps:
            m.row_chunk_bytes = limit
        report.add("memory", "<mlp>", f"SwiGLU MLPs run over row chunks of <= {limit >> 20} MiB intermediate "
                   f"(mem_opt={mem_opt}) [{len(mlps)}x]")
    dev = next((p.device for p in model.parameters()), None)
    if dev is not None and dev.type == "cuda":
        pol = apply_memory_policy(mem_opt, dev)
        report.add("memory", "<runtime>", f"memory policy level {mem_opt} applied: {pol}")
