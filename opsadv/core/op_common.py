"""Argument checks shared by every op and backend: each raises InvalidArgumentError naming
the op, the argument, what was expected and what was given."""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable

import torch

from . import dispatch
from .errors import InvalidArgumentError
from .policy import _scope_arg, _scoped, current_policy, scope_policy
from .train_steps import register_train_step, train_step  # noqa: F401  (the ops register here; tuning reads)

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def dt(d: torch.dtype) -> str:
    return str(d).replace("torch.", "")


def check_tensor(op: str, name: str, t, *, ndim: int | tuple[int, ...] | None = None,
                 min_ndim: int | None = None, dtypes=FLOAT_DTYPES, allow_empty: bool = False) -> None:
    if not isinstance(t, torch.Tensor):
        raise InvalidArgumentError(op, name, "a torch.Tensor", type(t).__name__)
    if ndim is not None:
        ok = t.dim() in ndim if isinstance(ndim, tuple) else t.dim() == ndim
        if not ok:
            raise InvalidArgumentError(op, name, f"a tensor of rank {ndim}", f"rank {t.dim()} (shape {tuple(t.shape)})")
    if min_ndim is not None and t.dim() < min_ndim:
        raise InvalidArgumentError(op, name, f"a tensor of rank >= {min_ndim}", f"rank {t.dim()} (shape {tuple(t.shape)})")
    if dtypes is not None and t.dtype not in dtypes:
        raise InvalidArgumentError(op, name, f"dtype in {[dt(d) for d in dtypes]}", dt(t.dtype))
    if not allow_empty and t.numel() == 0:
        raise InvalidArgumentError(op, name, "a non-empty tensor", f"shape {tuple(t.shape)} with 0 elements")


def is_empty_call(*tensors) -> bool:
    """Some operand has no elements: the op's result follows from the maths without a kernel (each op's
    _empty_result, plain differentiable torch on the empty operands, so gradients are the zero / empty ones)."""
    return any(t is not None and t.numel() == 0 for t in tensors)


def check_same(op: str, ref_name: str, ref: torch.Tensor, **others) -> None:
    """Others must share ref's dtype and device."""
    for name, t in others.items():
        if t is None:
            continue
        if t.dtype != ref.dtype:
            raise InvalidArgumentError(op, name, f"dtype {dt(ref.dtype)} (same as {ref_name})", dt(t.dtype))
        if t.device != ref.device:
            raise InvalidArgumentError(op, name, f"on device {ref.device} (same as {ref_name})", str(t.device))


# ---- the fast path of validation: the common well-formed call recognized in few operations (each op's
# _well_formed accepts a subset of what its full checks accept; anything else takes the full checks)
INF = float("inf")


def same_kind(t, dtype: torch.dtype, device) -> bool:
    """t is a tensor of this dtype on this device."""
    return isinstance(t, torch.Tensor) and t.dtype is dtype and t.device == device


def check_choice(op: str, name: str, value, choices) -> None:
    if value not in choices:
        raise InvalidArgumentError(op, name, f"one of {list(choices)}", repr(value))


def check_scale(op: str, scale) -> None:
    if scale is not None and (not isinstance(scale, (int, float)) or isinstance(scale, bool)
                              or not scale > 0 or scale != scale or scale == float("inf")):
        raise InvalidArgumentError(op, "scale", "None or a finite float > 0", repr(scale))


# Attention ops at the torch.library boundary (what torch.compile / export see) return contiguous
# out, dq, dk, dv, as their fake kernels say: Inductor was measured to expect contiguous outputs of
# these ops in training graphs even when a fake kernel promised another layout.  Eager calls skip
# the boundary and keep the impl's layout (the cuda Triton kernels write (b, s, h, d) memory, which
# transformers transposes back to for free; cuDNN follows q's layout).  The ops also take their
# inputs with the strides seen while tracing (exact-strides tag), so a compiled graph hands cuDNN
# the same q layout the eager call did (its backward assumes out/dout laid out like q).
EXACT_STRIDES = tuple(t for t in (getattr(torch.Tag, "needs_exact_strides", None),) if t is not None)


def bshd_strides(shape) -> tuple:
    """Strides of a (b, h, s, d) tensor stored as contiguous (b, s, h, d)."""
    b, h, s, d = shape
    return (s * h * d, d, h * d, 1)


def empty_bshd(shape, dtype: torch.dtype, device) -> torch.Tensor:
    return torch.empty_strided(tuple(shape), bshd_strides(shape), dtype=dtype, device=device)


def contiguous_lse(lse: torch.Tensor) -> torch.Tensor:
    return lse if lse.is_contiguous() else lse.contiguous()


def _row_exp(s: torch.Tensor):
    """(row max as given, row max with -inf rows at 0, exp(s - max), its row sum): one score-sized temporary."""
    top = s.amax(-1, keepdim=True)
    m = top.masked_fill(torch.isneginf(top), 0.0)
    e = torch.exp(s - m)
    return top, m, e, e.sum(-1, keepdim=True)


def softmax_lse(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row softmax and logsumexp of scores s over the last dim, from the row max: exp(s - lse) drops the row's
    log(n) where |lse| dwarfs it (a row masked with finfo.min, transformers' additive padding mask, then sums to n,
    not 1).  A row of -inf only gives p 0 and lse -inf; a +inf or NaN score gives NaN (the NaN / Inf policy)."""
    _, m, e, total = _row_exp(s)
    return e.div_(total.masked_fill(total == 0, 1.0)), (m + torch.log(total)).squeeze(-1)


def probs_from_lse(s: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """A backward's probabilities exp(s - lse) for the given row normalizer lse (ring attention hands each chunk the
    whole row's; rows of -inf lse give 0, NaN gives NaN), as exp(s - max) times a per-row factor: exp(max - lse),
    or 1 / the row sum where lse is this call's own row logsumexp (to rounding), which stays exact where |lse|
    dwarfs log(n) (see softmax_lse)."""
    top, m, e, total = _row_exp(s)
    lse = lse[..., None]
    own = m + torch.log(total)
    same = torch.isfinite(lse) & ((own - lse).abs() <= 8 * torch.finfo(lse.dtype).eps * lse.abs().clamp_min(1.0))
    gone = torch.isneginf(lse) | torch.isneginf(top)          # no key in the row (here, or in the whole row)
    factor = torch.where(same, 1.0 / total.masked_fill(total == 0, 1.0), torch.exp(m - lse.masked_fill(gone, 0.0)))
    return e.mul_(factor.masked_fill(gone, 0.0))


# ---- the weight gradient's layout (gemm and swiglu_gemm backward) ----------------------------------------------
# b (K, N) is mostly an nn.Linear weight W (N, K) passed as W.t(): its gradient is wanted as W's layout, i.e. with
# b's strides.  Computed as a2^T @ dz it is (K, N) row-major, and autograd's AccumulateGrad then copies it into W's
# layout (a transposing copy of every weight gradient, every step); computed as (dz^T @ a2)^T it is one GEMM of
# the same cost that lands in W's layout (what torch's own mm backward does for a transposed mat2).
def transposed_weight(b: torch.Tensor) -> bool:
    """b (K, N) is the transpose of a row-major (N, K) tensor (weight.t()) and not row-major itself."""
    return b.stride(0) == 1 and b.stride(1) == b.shape[0] and not b.is_contiguous()


def weight_grad(a2: torch.Tensor, dz2: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a2^T @ dz2 (a2 (M, K), dz2 (M, N)) laid out as b: transposed where b is a weight.t(), else row-major."""
    return (dz2.t() @ a2).t() if transposed_weight(b) else a2.t() @ dz2


def empty_weight_grad(b: torch.Tensor) -> torch.Tensor:
    """An empty tensor of b's shape in the layout weight_grad gives (the backward ops' fake kernels)."""
    return b.new_empty((b.shape[1], b.shape[0])).t() if transposed_weight(b) else b.new_empty(b.shape)


def as_weight_grad_layout(db: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """db in the layout empty_weight_grad promises (a copy only where an impl returned another)."""
    if transposed_weight(b):
        return db if db.t().is_contiguous() else db.t().contiguous().t()
    return db if db.is_contiguous() else db.contiguous()


def len_bucket(n: int) -> int:
    """Sequence/row counts bucket to the next power of two (min 16)."""
    return 16 if n <= 16 else 1 << (n - 1).bit_length()


def empty_like_none(ref: torch.Tensor) -> torch.Tensor:
    """custom ops cannot return None: an absent tensor output is a 0-element tensor."""
    return ref.new_empty((0,))


_shared_empties: dict = {}


def shared_empty(ref: torch.Tensor) -> torch.Tensor:
    """A cached 0-element tensor of ref's dtype and device: the stand-in for an absent tensor *input*
    of an eager direct call (impls only read its numel).  Never for outputs or traced calls, where
    the tensor would reach a caller or a graph."""
    key = (ref.dtype, ref.device)
    t = _shared_empties.get(key)
    if t is None:
        t = _shared_empties[key] = ref.new_empty((0,))
    return t


def none_if_empty(t: torch.Tensor | None):
    return None if t is None or t.numel() == 0 else t


_Plain = (torch.Tensor, torch.nn.Parameter)


TORCH_OPS, DIRECT, AUTOGRAD_FN = 0, 1, 2

# eager_mode's global checks, bound once (each attribute hop costs on a path run ~170 times per forward; dynamo
# knows these functions by identity, so it folds is_compiling() to True through the alias too)
is_compiling = torch.compiler.is_compiling
dispatch_modes = torch._C._len_torch_dispatch_stack
function_modes = torch._C._is_torch_function_mode_enabled
functorch_level = torch._C._functorch.peek_interpreter_stack
grad_enabled = torch.is_grad_enabled


def eager_mode(*tensors) -> int:
    """How a public op call runs.  Plain eager tensors outside compile/export tracing, dispatch or
    torch-function modes and functorch transforms skip torch.library's dispatcher (tens of µs per
    call): DIRECT calls the router when no gradient is needed, AUTOGRAD_FN wraps the same router
    and backward in a torch.autograd.Function when one is.  Everything else takes TORCH_OPS, the
    torch.ops path with fake kernels and registered autograd.  Results are identical either way."""
    if is_compiling() or dispatch_modes() or function_modes() or functorch_level() is not None:
        return TORCH_OPS
    mode = DIRECT
    grad = grad_enabled()
    for t in tensors:
        if t is None:
            continue
        if type(t) not in _Plain:
            return TORCH_OPS
        if grad and t.requires_grad:
            mode = AUTOGRAD_FN
    return mode


def eager_fast_path(*tensors) -> bool:
    return eager_mode(*tensors) == DIRECT


def autograd_function(name: str, route, setup_context, backward, *, stats: tuple[int, ...] = ()):
    """A torch.autograd.Function running `route` forward and the op's registered backward
    function: the eager-training twin of torch.library's register_autograd.

    `stats`: indices of outputs that carry no gradient (saved statistics such as mean / rstd).  They
    are marked non-differentiable and, with `stats` given, grads are not materialized: the backward
    gets None for unused outputs (it must handle None), which spares autograd's thread one
    zero-filled tensor per unused output.  A call where no output got a gradient (its consumer's backward
    returned None: a layer whose input gradient is not computed) gives None for every input, as aten's
    formulas do with undefined gradients."""
    def forward(ctx, *inputs):
        out = route(*inputs)
        _after_forward(ctx, inputs, out, setup_context, stats)
        return out

    def backward_or_none(ctx, *grads):
        if all(g is None for g in grads):
            return (None,) * len(ctx.needs_input_grad)
        return backward(ctx, *grads)

    fn = type(name, (torch.autograd.Function,), {"forward": staticmethod(forward),
                                                 "backward": staticmethod(backward_or_none if stats else backward)})
    return fn.apply


def resolved_autograd_function(name: str, setup_context, backward, *, stats: tuple[int, ...] = (),
                               finish: Callable[[Any], Any] | None = None):
    """autograd_function for an op that resolves its impl before it runs (grad-recording calls resolved in
    a train bucket; the norms choose between an impl's `train` forward and this Function from that one
    resolution): apply(r, *inputs) runs r.run(r.ctx, *inputs), where r is a dispatch.Resolved, then
    `finish` on its output (e.g. the attention ops' contiguous lse).  ctx.opsadv_resolved = r, for backwards
    that run the resolved impl's own (pair_backward)."""
    def forward(ctx, r, *inputs):
        ctx.opsadv_resolved = r
        out = r.run(r.ctx, *inputs)
        if finish is not None:
            out = finish(out)
        _after_forward(ctx, inputs, out, setup_context, stats)
        return out

    def resolved_backward(ctx, *grads):
        if all(g is None for g in grads):
            return (None,) * len(ctx.needs_input_grad)
        return (None, *backward(ctx, *grads))

    fn = type(name, (torch.autograd.Function,), {"forward": staticmethod(forward),
                                                 "backward": staticmethod(resolved_backward)})
    return fn.apply


_C_APPLY = torch._C._FunctionBase.__dict__["apply"]
transforms_active = torch._C._are_functorch_transforms_active
unwrap_if_dead = torch._C._functorch.unwrap_if_dead


def raw_apply(apply):
    """The C apply under `apply` (an autograd.Function's .apply), without Function.apply's Python layer (~1.7 us a
    call on the reference CPU: a closure, the setup_context test, unwrap_dead_wrappers' generator).  For Functions
    without setup_context; the caller does the rest of what Function.apply does: it calls `apply` itself while
    transforms_active(), and passes each tensor argument through unwrap_if_dead."""
    return _C_APPLY.__get__(None, apply.__self__)


def _after_forward(ctx, inputs, out, setup_context, stats) -> None:
    setup_context(ctx, inputs, out)
    if stats:
        ctx.set_materialize_grads(False)
        ctx.mark_non_differentiable(*(out[i] for i in stats))


class _OwnPairFn(torch.autograd.Function):
    """One attention-style impl's forward with its own backward, no dispatch (own_pair_train_step)."""

    @staticmethod
    def forward(ctx, impl, rctx, q, k, v, *rest):
        out, lse = impl.fn(rctx, q, k, v, *rest)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.impl, ctx.rctx, ctx.rest = impl, rctx, rest
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = ctx.impl.backward(ctx.rctx, dout, q, k, v, out, lse, *ctx.rest)
        return (None, None, dq, dk, dv) + (None,) * len(ctx.rest)


def own_pair_train_step(impl, rctx, args: tuple) -> Callable[[], Any]:
    """autotune's training step for the attention ops (fn(ctx, q, k, v, *rest) -> (out, lse);
    backward(ctx, dout, q, k, v, out, lse, *rest) -> (dq, dk, dv)): the impl's forward with its own
    backward (an impl with a `train` forward: that forward under torch's autograd, as its calls run).  The call's
    backward then runs that same impl's backward (pair_backward): the pair is what was timed.  (A backward
    dispatched in its own bucket, timed on that forward's out and lse, does not carry over to the call: on the
    H200 such a bucket chose cuDNN's backward after the Gluon forward by a 6% margin, and the pair then ran
    1.13 ms against 0.93 for Gluon + its own backward.)  A traced training call resolves inside the compiled
    forward, under no_grad and on tensors that do not require grad: the step then differentiates detached
    leaves, with grad enabled."""
    q, k, v, *rest = args
    if not (q.requires_grad or k.requires_grad or v.requires_grad):
        q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    args = (q, k, v, *rest)
    train = getattr(impl, "train", None)        # a `train` forward runs under torch's autograd (as the call will)
    fwd = (lambda: train(rctx, *args)) if train is not None else (lambda: _OwnPairFn.apply(impl, rctx, *args))
    return grad_step(fwd, args, 1)


def traced_train(*tensors) -> bool:
    """A torch.ops (traced) call that records grad: the attention ops' train=True argument, under which forward
    and backward resolve in the train bucket and run one impl's pair, as eager training calls do."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def train_pair_backward(r, dout, q, k, v, out, lse, rest: tuple):
    """(dq, dk, dv) from the backward of resolved impl r (a train bucket's choice), or None where there is no
    r or the impl has no backward of its own: the caller dispatches the backward in its own bucket then."""
    if r is None or getattr(r.impl, "backward", None) is None:
        return None
    dispatch.record_call(r.impl.id)
    return r.impl.backward(r.ctx, dout, q, k, v, out, lse, *rest)


def pair_backward(ctx, dout, q, k, v, out, lse, rest: tuple):
    """train_pair_backward for an eager training call (resolved_autograd_function left the train bucket's
    choice in ctx.opsadv_resolved); None for calls that did not come that way."""
    return train_pair_backward(getattr(ctx, "opsadv_resolved", None), dout, q, k, v, out, lse, rest)


_AUTOGRAD_KEYS = tuple(getattr(torch._C.DispatchKey, n) for n in (
    "AutogradFunctionality", "AutogradOther", "AutogradCPU", "AutogradCUDA", "AutogradNestedTensor")
    if hasattr(torch._C.DispatchKey, n))


@contextmanager
def autograd_recording():
    """Grad mode on and the autograd dispatch keys un-excluded: inside a torch.library op's implementation (a
    compiled graph's op call, redispatched below autograd) ops record no graph even under enable_grad, and
    autotune's training step would differentiate nothing ("element 0 of tensors does not require grad")."""
    excluded = torch._C._dispatch_tls_local_exclude_set()
    keep = excluded
    for k in _AUTOGRAD_KEYS:
        keep = keep - torch._C.DispatchKeySet(k)
    with torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), keep), torch.enable_grad():
        yield


def grad_step(forward: Callable[[], Any], args: tuple, n_out: int) -> Callable[[], Any]:
    """forward() + torch.autograd.grad of its first n_out outputs w.r.t. the tensors in args that
    require grad, with fixed random output gradients (drawn once, outside the timed step); recorded even where
    the caller is below autograd (autograd_recording)."""
    with autograd_recording():
        out = forward()
    grads = [torch.randn_like(out[i]) for i in range(n_out)]
    wrt = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]

    def step():
        with autograd_recording():
            o = forward()
            return torch.autograd.grad([o[i] for i in range(n_out)], wrt, grads)
    return step


def carry_policy(setup_context, backward):
    """Wrap an op's (setup_context, backward) so the backward resolves under the forward's policy and
    counts in the forward's traces: autograd runs CUDA backwards on its own thread, where a
    `with use_backend(...)` scope or `opsadv.trace()` of the caller's thread is not visible."""
    return _carry(setup_context, backward, False)


def carry_scope(setup_context, backward):
    """carry_policy for an op's registered autograd (torch.library), whose last input is the scope id the call
    carried (core.policy.op_scope): the op's setup / backward see the other inputs, the backward runs under that
    scope's policy (0: the forward's policy in force) and its torch.ops calls carry the same id, so a compiled
    graph's backward op runs under its model's policy as the forward did."""
    return _carry(setup_context, backward, True)


def _carry(setup_context, backward, scoped: bool):
    def setup(ctx, inputs, output):
        if scoped:
            ctx.opsadv_scope = inputs[-1]
            inputs = inputs[:-1]
        setup_context(ctx, inputs, output)
        ctx.opsadv_policy = current_policy()
        ctx.opsadv_traces = dispatch._local.get()

    def bwd(ctx, *grads):
        sid = ctx.opsadv_scope if scoped else 0
        token = _scoped.set(scope_policy(sid) if sid else ctx.opsadv_policy)
        stoken = _scope_arg.set(sid) if scoped else None
        carried = getattr(ctx, "opsadv_traces", ())
        if carried:     # the forward's traces still open, plus this thread's own (each counted once)
            here = dispatch._local.get()
            traces = here + tuple(t for t in carried if t in dispatch._tracers and t not in here)
            ttoken = dispatch._local.set(traces)
        try:
            grads = backward(ctx, *grads)
            if not scoped:
                return grads
            return (*grads, None) if isinstance(grads, tuple) else (grads, None)   # none for the scope id
        finally:
            _scoped.reset(token)
            if scoped:
                _scope_arg.reset(stoken)
            if carried:
                dispatch._local.reset(ttoken)

    return setup, bwd


# ---- reference impls (opsadv/ops/<op>/reference.py): plain torch, written for clarity; half inputs compute in
# float32, float64 stays float64, outputs come back in the input dtype
def acc(t: torch.Tensor | None) -> torch.Tensor | None:
    """t in its accumulation dtype (float64 stays float64, anything else float32)."""
    if t is None:
        return None
    return t if t.dtype == torch.float64 else t.float()


def acc_dtype(t: torch.Tensor) -> torch.dtype:
    """The dtype of saved statistics (lse, mean, rstd) for inputs like t."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


# ---- the precision policy as the reference impls honour it (PrecisionPolicy; float64 inputs stay float64) ------
_HALF = {"fp16": torch.float16, "bf16": torch.bfloat16}


def precision_of(ctx):
    opts = getattr(ctx, "options", None)
    return opts.get("precision") if opts else None


def round_tf32(x: torch.Tensor) -> torch.Tensor:
    """float32 -> the nearest TF32 value (10 mantissa bits, what tensor cores read), still float32."""
    bits = (x.contiguous().view(torch.int32) + 0x1000) & -0x2000
    return torch.where(torch.isfinite(x), bits.view(torch.float32), x)


def operand(ctx, t: torch.Tensor | None, field: str) -> torch.Tensor | None:
    """A float32 operand as the policy's `field` ("matmul" / "attention") has the GEMMs read it: rounded to
    tf32 / fp16 / bf16, products accumulated in float32 (tensor cores); other dtypes as acc."""
    if t is None or t.dtype != torch.float32:
        return acc(t)
    want = getattr(precision_of(ctx), field, "fp32")
    if want == "tf32":
        return round_tf32(t)
    return t.to(_HALF[want]).float() if want in _HALF else t


def stats_dtype(ctx, x: torch.Tensor, field: str) -> torch.dtype | None:
    """The dtype the policy asks statistics in (norm="fp64", softmax="bf16"); None: the default."""
    if x.dtype == torch.float64:
        return None
    want = getattr(precision_of(ctx), field, "fp32")
    return {"fp64": torch.float64, "bf16": torch.bfloat16}.get(want)
