"""A third-party plugin that adds a NEW op, as a user would write one: scaled_tanh(x, alpha=1.0) = tanh(alpha * x).

The op's OpDef (public function, torch.library ops with fakes and autograd, reference impl, spec builder,
conformance cases) comes back from `opsadv_register_ops`; the kernel that serves it from
`opsadv_register_kernels`, like any other impl.  The kernel computes tanh through expm1 (a different code path from
the reference's torch.tanh) and takes float32 / float64 only."""
import torch
from torch import Tensor

from opsadv import KernelImpl
from opsadv.core import dispatch
from opsadv.core.errors import InvalidArgumentError
from opsadv.core.kernel import CallSpec
from opsadv.core.op_common import acc, carry_policy, check_tensor, len_bucket
from opsadv.core.opdef import Case, OpDef, Reference, arg, rand
from opsadv.registry import BackendInfo, ProbeResult, hookimpl

OP = "scaled_tanh"
NAME = "toyop"


# ---- the op ---------------------------------------------------------------------------------------------------
def validate(x, alpha) -> None:
    check_tensor(OP, "x", x, min_ndim=1)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        raise InvalidArgumentError(OP, "alpha", "a float", repr(alpha))


def _spec(x: Tensor, backward: bool) -> CallSpec:
    rows = x.numel() // x.shape[-1]
    return CallSpec(OP, x.device.type, x.dtype, frozenset(), (len_bucket(rows), x.shape[-1]),
                    shapes=(tuple(x.shape),), backward=backward, bucket_names=("rows<=", "N="))


def _key(x: Tensor, backward: bool) -> tuple:
    return (OP, backward, x.device.type, x.dtype, len_bucket(x.numel() // x.shape[-1]), x.shape[-1])


@torch.library.custom_op("opsadv_toyop::scaled_tanh", mutates_args=())
def _scaled_tanh(x: Tensor, alpha: float) -> Tensor:
    return dispatch.call(_key(x, False), lambda: _spec(x, False), (x, alpha))


@_scaled_tanh.register_fake
def _(x, alpha):
    return torch.empty_like(x)


@torch.library.custom_op("opsadv_toyop::scaled_tanh_backward", mutates_args=())
def _scaled_tanh_backward(grad: Tensor, x: Tensor, alpha: float) -> Tensor:
    return dispatch.call(_key(x, True), lambda: _spec(x, True), (grad, x, alpha))


@_scaled_tanh_backward.register_fake
def _(grad, x, alpha):
    return torch.empty_like(x)


def _setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])
    ctx.alpha = inputs[1]


def _backward(ctx, grad):
    (x,) = ctx.saved_tensors
    return torch.ops.opsadv_toyop.scaled_tanh_backward(grad, x, ctx.alpha), None


_setup, _backward = carry_policy(_setup, _backward)
_scaled_tanh.register_autograd(_backward, setup_context=_setup)


def scaled_tanh(x: Tensor, *, alpha: float = 1.0) -> Tensor:
    """tanh(alpha * x), elementwise; gradients flow to x."""
    validate(x, alpha)
    return torch.ops.opsadv_toyop.scaled_tanh(x, float(alpha))


# ---- reference, cases, definition -----------------------------------------------------------------------------
def reference_fwd(ctx, x, alpha):
    return torch.tanh(alpha * acc(x)).to(x.dtype)


def reference_bwd(ctx, grad, x, alpha):
    t = torch.tanh(alpha * acc(x))
    return (acc(grad) * alpha * (1 - t * t)).to(x.dtype)


def _case(shape, alpha, strided=False):
    def build(dtype, device, g):
        x = rand((shape[0], 2 * shape[1]), dtype, device, g)[:, ::2] if strided else rand(shape, dtype, device, g)
        return (x,), {"alpha": alpha}
    return build


def explain_spec(args: tuple, kwargs: dict, backward: bool) -> CallSpec:
    x = arg(args, kwargs, 0, "x")
    validate(x, kwargs.get("alpha", 1.0))
    return _spec(x, backward)


def demo(device, dtype, g, big):
    return (rand((4096, 4096) if big else (100, 96), dtype, device, g),), {"alpha": 0.5}


OPDEF = OpDef(OP, scaled_tanh, Reference(reference_fwd, reference_bwd), explain_spec,
              custom_ops=(_scaled_tanh, _scaled_tanh_backward),
              cases=(Case(OP, "one", _case((1, 1), 1.0), (0,)), Case(OP, "odd", _case((3, 127), 0.7), (0,)),
                     Case(OP, "strided", _case((17, 33), -2.0, strided=True), (0,), quick=False)),
              demo=demo, description="tanh(alpha * x) (test fixture)")


# ---- the kernel -----------------------------------------------------------------------------------------------
def _tanh(z):
    # sign(z) expm1(2|z|) / (expm1(2|z|) + 2): accurate near 0, where 2 sigmoid(2z) - 1 loses the digits a
    # one-element case compares (0.3% of random draws failed its float32 floor that way)
    e = torch.expm1((2 * z.abs()).clamp(max=40.0))
    return torch.sign(z) * e / (e + 2)


def kernel_fwd(ctx, x, alpha):
    return _tanh(alpha * x)


def kernel_bwd(ctx, grad, x, alpha):
    y = _tanh(alpha * x)
    return grad * alpha * (1 - y * y)


# ---- the hooks ------------------------------------------------------------------------------------------------
@hookimpl
def opsadv_backend_info():
    return BackendInfo(name=NAME, vendor="Example Corp", device_types=("cpu",), version="0.1.0", auto_priority=0)


@hookimpl
def opsadv_probe(env):
    return ProbeResult(True, ("runs on any CPU",))


@hookimpl
def opsadv_register_ops():
    return [OPDEF]


@hookimpl
def opsadv_register_kernels(registry, env):
    registry.add(KernelImpl(id="toyop.scaled_tanh", op=OP, backend=NAME, fn=kernel_fwd, backward=kernel_bwd,
                            priority=150, device_types=("cpu",), dtypes=(torch.float32, torch.float64),
                            deterministic=True))
