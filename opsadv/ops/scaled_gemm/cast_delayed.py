"""cast_to_fp8_delayed: cast_to_fp8 under a DELAYED scale that the op reads from, and records into, an amax history
held on the device: the whole delayed-scaling cast of FP8 training in one call, with no host state.

    history = new_amax_history(16, device="cuda")              # once per tensor role (a GEMM's x, its gradient)
    x_fp8, x_fp8_t, scale = cast_to_fp8_delayed(x, history, dtype=torch.float8_e4m3fn, transpose=True)

- x (M, N): float16 / bfloat16 / float32 (float64: the reference impl), any strides.
- history: float32 (L + 4,), made by new_amax_history(L) and then written only by this op: L + 1 amax slots, the
  position of the slot this call records into, a started flag, and an arrival counter the kernel uses (0 between
  calls).  L >= 1: delayed scaling over a window of the last L amaxes; L = 0: current scaling (this call's own
  amax, every call).
- Per call (bit for bit cast_to_fp8 with the scale below):
    m     = max of the L window slots (every slot but the current one), or max |x| on the first call (nothing
            recorded yet) and with L = 0
    scale = m / FMAX, 1 where m is 0 or NaN (scale_from_amax)
    x_fp8 = clamp(float32(x) / scale, -FMAX, FMAX) rounded to nearest even (NaN stays NaN); x_fp8_t its transpose
    the current slot gets max |x| (NaN if x holds one); on the first call every window slot gets it too (so the
    first amax stays in the window for L calls, as a recorded one does); the next slot is cleared and becomes the
    current one.
- Returns (x_fp8 (M, N) contiguous, x_fp8_t (N, M) contiguous or None, scale): scale the float32 () dequantization
  scale (x ≈ x_fp8.float() * scale), what scaled_gemm takes with x_fp8.

Why an op of its own: cast_to_fp8 takes the scale as an input, so a delayed-scaling step around it ran the window's
max, the scale, the cast, the reduction of the tiles' amaxes and the history write as ~7 kernels and kept the ring
position in Python, which torch.compile can neither trace inside an autograd.Function (a side effect on a Python
object: a graph break per FP8 GEMM) nor keep without recompiling.  Here the scale, the record and the ring position
live in one device tensor that the op mutates (`mutates_args=("history",)`), so a compiled FP8 training step is one
graph, and the Triton impl does it in one pass over x (plus a max-|x| pass on the first call and with L = 0).

Impl contract:
  fn(ctx, x, history, dtype, transpose) -> (x_fp8, x_fp8_t, scale)   x_fp8_t: (N, M), or an empty (0,) tensor;
  history updated in place as above.
CallSpec: dtype = x's; features "e5m2", "transpose"; bucket (rows<=, N=)."""
from __future__ import annotations

import torch
from torch import Tensor

from opsadv.core import dispatch
from opsadv.core import policy as _policy
from opsadv.core.errors import InvalidArgumentError
from opsadv.core.kernel import CallSpec
from opsadv.core.op_common import (TORCH_OPS, dispatch_modes, dt, eager_mode, function_modes, functorch_level,
                                   grad_enabled, is_compiling)
from opsadv.core.opdef import Case, OpDef, Reference, arg, rand
from opsadv.core.policy import in_scope, op_scope

from . import common as _common
from .cast import tensor_meta, cast_key, cast_spec, check_cast_args
from .reference import E4M3, E5M2, check_fp8_dtype, quantize_with_scale

OP = "cast_to_fp8_delayed"
FEATURES = frozenset({"e5m2", "transpose"})
EXTRA = 3                 # the slots after the amaxes: position, started flag, arrival counter
MAX_WINDOW = 1024


def new_amax_history(length: int, device=None) -> Tensor:
    """The state of one delayed-scaling cast site: a zero float32 (length + 4,) tensor (module docstring; length 0:
    current scaling).  Reset a site by making a new one: the op owns the slots' meaning."""
    if not isinstance(length, int) or isinstance(length, bool) or not 0 <= length <= MAX_WINDOW:
        raise InvalidArgumentError("new_amax_history", "length", f"an int in [0, {MAX_WINDOW}]", repr(length))
    return torch.zeros(length + 1 + EXTRA, dtype=torch.float32, device=device)


def validate(x, history, dtype, transpose) -> None:
    """Shapes, dtypes, devices and options (no tensor value is read)."""
    check_cast_args(OP, x, dtype, transpose)
    if not isinstance(history, Tensor) or history.dtype != torch.float32 or history.dim() != 1 \
            or history.numel() < 1 + EXTRA or not history.is_contiguous():
        given = f"{dt(history.dtype)} of shape {tuple(history.shape)}" if isinstance(history, Tensor) else \
            type(history).__name__
        raise InvalidArgumentError(OP, "history", "a contiguous float32 (L + 4,) tensor from new_amax_history(L)",
                                   given)
    _common.check_devices(OP, "x", x, history=history)


def _route(x, history, dtype, transpose):
    return dispatch.call(cast_key(OP, x, dtype, transpose), lambda: cast_spec(OP, x, dtype, transpose),
                         (x, history, dtype, transpose))


def reference_cast_delayed(ctx, x, history, dtype, transpose):
    """The oracle: plain torch on the device's values (no host read of the history), any device."""
    fmax = check_fp8_dtype(dtype)
    n = history.numel() - EXTRA                         # amax slots: the window and the current one
    amaxes, pos, started = history[:n], history[n].long(), history[n + 1] > 0
    cur = torch.arange(n, device=history.device) == pos
    amax = x.detach().abs().amax().to(torch.float32) if x.numel() else history.new_zeros(())
    window = torch.where(cur, 0.0, amaxes).amax()       # (NaN propagates; every slot but the current one)
    m = torch.where(started & (n > 1), window, amax)
    scale = torch.where(m > 0, m / fmax, 1.0)
    x8 = quantize_with_scale(x, scale, dtype).contiguous()
    x8t = x8.t().clone(memory_format=torch.contiguous_format) if transpose else x8.new_empty((0,))
    rec = torch.where(cur, torch.maximum(amaxes, amax), amaxes)       # (NaN propagates)
    rec = torch.where(started | cur, rec, amax)         # first call: the whole window holds its amax
    nxt = (pos + 1) % n
    history[:n] = torch.where(torch.arange(n, device=history.device) == nxt, 0.0, rec)
    history[n] = nxt.to(torch.float32)
    if n > 1:                                           # (one slot: current scaling, never "started")
        history[n + 1] = 1.0
    return x8, x8t, scale


@torch.library.custom_op("opsadv::cast_to_fp8_delayed", mutates_args=("history",))
def _cast(x: Tensor, history: Tensor, dtype: torch.dtype, transpose: bool, scope: int = 0) -> tuple[Tensor, Tensor,
                                                                                                      Tensor]:
    """(x_fp8, x_fp8_t or an empty (0,) tensor, scale); history updated.  scope: the converted model's scope id."""
    with in_scope(scope):
        return _route(x, history, dtype, transpose)


@_cast.register_fake
def _(x, history, dtype, transpose, scope=0):
    m, n = x.shape
    return (x.new_empty((m, n), dtype=dtype), x.new_empty((n, m) if transpose else (0,), dtype=dtype),
            x.new_empty((), dtype=torch.float32))


_fast, _tracers, _scoped = dispatch._fast, dispatch._tracers, _policy._scoped


def cast_to_fp8_delayed(x: Tensor, history: Tensor, *, dtype: torch.dtype = E4M3, transpose: bool = False):
    """x (M, N) in fp8 under the delayed scale of `history` (new_amax_history), recording x's amax there (module
    docstring): (x_fp8, x_fp8_t or None, scale)."""
    fk = hit = None
    # the fast path (as cast_to_fp8's): an identical no-grad call's resolution, every layer of every step
    if type(transpose) is bool and not (is_compiling() or dispatch_modes() or function_modes()) \
            and functorch_level() is None:
        try:
            if not (grad_enabled() and x.requires_grad):
                fk = (OP, (_scoped.get() or _policy._global).serial, dtype, transpose, tensor_meta(x), tensor_meta(history))
                hit = _fast.get(fk)
        except (AttributeError, TypeError):
            fk = hit = None
    if hit is not None:
        if _tracers:
            dispatch.record(hit.impl.id)
        x8, x8t, scale = hit.run(hit.ctx, x, history, dtype, transpose)
        return x8, (x8t if transpose else None), scale
    validate(x, history, dtype, transpose)
    _common.refuse_grad(OP, x=x, history=history)
    if x.numel() == 0:                  # M or N of 0: plain torch, no kernel (the amax recorded is 0)
        x8, x8t, scale = reference_cast_delayed(None, x, history, dtype, transpose)
    elif eager_mode(x, history) == TORCH_OPS:
        x8, x8t, scale = torch.ops.opsadv.cast_to_fp8_delayed(x, history, dtype, transpose, op_scope())
    else:
        x8, x8t, scale = _route(x, history, dtype, transpose)
        dispatch.learn(fk, cast_key(OP, x, dtype, transpose))
    return x8, (x8t if transpose else None), scale


# ---- the op's definition -----------------------------------------------------------------------------------
def explain_spec(args: tuple, kwargs: dict, backward: bool) -> CallSpec:
    x, history = arg(args, kwargs, 0, "x"), arg(args, kwargs, 1, "history")
    dtype, transpose = kwargs.get("dtype", E4M3), kwargs.get("transpose", False)
    validate(x, history, dtype, transpose)
    return cast_spec(OP, x, dtype, transpose)


def _case(m, n, *, dtype=E4M3, transpose=True, strided=False, window=4, state="recorded", specials=False):
    """x (m, n) with rows of different magnitudes and a history in `state`: "fresh" (the first call), "recorded"
    (a window whose max is half x's amax, so some values saturate; the current slot mid-ring), "current" (L = 0);
    specials: +-inf and -0.0 in x."""
    def build(cell_dtype, device, g):
        x = rand((m, n), torch.float64, "cpu", g) * 2.0 ** (torch.arange(m) % 7 - 3.0)[:, None]
        if specials and x.numel() >= 4:
            # (no NaN: triton 3.6's interpreter casts it to a number; tests/test_cast_to_fp8_delayed.py has NaN)
            x.view(-1)[:3] = torch.tensor([float("inf"), float("-inf"), -0.0], dtype=torch.float64)
        big = x[torch.isfinite(x)].abs().amax().item()
        hist = new_amax_history(0 if state == "current" else window)
        if state == "recorded":
            slots = window + 1
            hist[:slots] = torch.linspace(big / 8, big / 2, slots)
            hist[2 % slots] = 0.0                       # the current slot (cleared by the call before)
            hist[slots], hist[slots + 1] = float(2 % slots), 1.0
        x = x.to(device=device, dtype=cell_dtype)
        if strided:
            x = x.t().contiguous().t()
        return (x, hist.to(device)), {"dtype": dtype, "transpose": transpose}
    return build


CASES = [
    Case(OP, "one_element_fresh", _case(1, 1, state="fresh"), (), kept=frozenset({1}), mutates=(1,)),
    # (specials with a recorded scale: +-inf clamp to +-FMAX; as this call's amax an inf would make the scale inf)
    Case(OP, "odd_127x3_recorded_specials", _case(127, 3, specials=True), (), kept=frozenset({1}), mutates=(1,)),
    Case(OP, "strided_e5m2_window1", _case(37, 160, dtype=E5M2, strided=True, window=1), (), kept=frozenset({1}),
         mutates=(1,)),
    Case(OP, "current_no_transpose", _case(65, 129, transpose=False, state="current"), (), kept=frozenset({1}),
         mutates=(1,)),
    Case(OP, "fresh_window16", _case(40, 70, window=16, state="fresh"), (), kept=frozenset({1}), mutates=(1,),
         quick=False),
]

OPDEF = OpDef(OP, cast_to_fp8_delayed, Reference(reference_cast_delayed, None, FEATURES), explain_spec,
              custom_ops=(_cast,), cases=tuple(CASES), demo=None,
              description="cast_to_fp8 under a delayed scale read from, and recorded into, a device-side amax "
                          "history (the ring position included): delayed-scaling FP8 training's cast in one op")
