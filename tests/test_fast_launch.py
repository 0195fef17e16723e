"""The Triton launch fast path (opsadv.backends.triton_common.utils.FastLaunch): a launch reuses the
compiled kernel only under the same specialization (tensor dtype / 16-byte alignment, int == 1, % 16,
32- vs 64-bit, keywords), passes arguments in signature order, and takes Triton's path otherwise.
CPU: a fake JIT function records what each path receives.  GPU: real kernels, fast vs Triton's path."""
import inspect
import types

import pytest
import torch

from opsadv.backends.triton_common import utils as U


class FakeKernel:
    def __init__(self, log):
        self.log, self.function, self.packed_metadata = log, "fn-handle", "packed"

    def run(self, *a):
        self.log.append(("fast", a))


class FakeJit:
    """Stands in for a JITFunction(x_ptr, n, BLOCK: constexpr, FLAG: constexpr = 7)."""
    arg_names = ["x_ptr", "n", "BLOCK", "FLAG"]
    params = [types.SimpleNamespace(name="x_ptr", default=inspect.Parameter.empty, is_constexpr=False),
              types.SimpleNamespace(name="n", default=inspect.Parameter.empty, is_constexpr=False),
              types.SimpleNamespace(name="BLOCK", default=inspect.Parameter.empty, is_constexpr=True),
              types.SimpleNamespace(name="FLAG", default=7, is_constexpr=True)]

    def __init__(self):
        self.log, self.compiled = [], 0

    def __getitem__(self, grid):
        def launch(*args, **kw):
            self.log.append(("triton", grid, args, kw))
            self.compiled += 1
            return FakeKernel(self.log)
        return launch


@pytest.fixture
def fake(monkeypatch):
    monkeypatch.setattr(U, "_on_gpu", lambda t: isinstance(t, torch.Tensor))
    monkeypatch.setattr(U, "_raw_stream", lambda dev: 1234)
    monkeypatch.setattr(U, "_current_device", lambda: 0)
    jit = FakeJit()
    return jit, U.FastLaunch(jit)


def test_second_launch_is_fast_and_in_signature_order(fake):
    jit, fl = fake
    x = torch.zeros(64, dtype=torch.float16)
    fl[(3,)](x, 40, BLOCK=32)
    fl[(5, 2)](x, 56, BLOCK=32)
    assert [e[0] for e in jit.log] == ["triton", "fast"]
    # grid x/y/z, stream, function, packed metadata, no launch metadata / hooks, then every parameter
    assert jit.log[1][1] == (5, 2, 1, 1234, "fn-handle", "packed", None, None, None, x, 56, 32, 7)


@pytest.mark.parametrize("change", ["misaligned", "dtype", "int_is_one", "int_not_div16", "int64", "constexpr"])
def test_other_specialization_takes_tritons_path(fake, change):
    jit, fl = fake
    x = torch.zeros(64, dtype=torch.float16)
    fl[(1,)](x, 32, BLOCK=32)
    args, kw = [x, 32], {"BLOCK": 32}
    if change == "misaligned":
        args[0] = x[1:]                                 # 2 bytes past an aligned start
    elif change == "dtype":
        args[0] = torch.zeros(64, dtype=torch.float32)
    elif change == "int_is_one":
        args[1] = 1
    elif change == "int_not_div16":
        args[1] = 33
    elif change == "int64":
        args[1] = 2 ** 33
    else:
        kw = {"BLOCK": 64}
    fl[(1,)](*args, **kw)
    assert jit.log[-1][0] == "triton"


def test_runtime_param_by_keyword_is_never_cached(fake):
    jit, fl = fake
    x = torch.zeros(64, dtype=torch.float16)
    fl[(1,)](x, n=32, BLOCK=32)
    fl[(1,)](x, n=48, BLOCK=32)
    assert [e[0] for e in jit.log] == ["triton", "triton"]


def test_other_current_device_takes_tritons_path(fake, monkeypatch):
    jit, fl = fake
    x = torch.zeros(64, dtype=torch.float16)
    fl[(1,)](x, 40, BLOCK=32)
    monkeypatch.setattr(U, "_current_device", lambda: 1)
    fl[(1,)](x, 40, BLOCK=32)
    assert [e[0] for e in jit.log] == ["triton", "triton"]


def test_cpu_tensors_take_tritons_path(monkeypatch):
    jit = FakeJit()
    fl = U.FastLaunch(jit)
    x = torch.zeros(8)
    fl[(1,)](x, 8, BLOCK=8)
    fl[(1,)](x, 8, BLOCK=8)
    assert [e[0] for e in jit.log] == ["triton", "triton"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_fast_path_matches_triton():
    import triton
    import triton.language as tl

    @triton.jit
    def _axpy(x_ptr, y_ptr, n, a, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(y_ptr + i, tl.load(x_ptr + i, mask=i < n) * a + 1.0, mask=i < n)

    fl = U.FastLaunch(_axpy)
    for n in (1, 17, 4096, 4097):
        for off in (0, 1):
            x = torch.randn(n + off, device="cuda")[off:]
            y = torch.full((n + 1,), float("nan"), device="cuda")[1:]
            for _ in range(2):                            # second launch: the fast path
                y.fill_(float("nan"))
                fl[(triton.cdiv(n, 128),)](x, y, n, 0.5, BLOCK=128)
                torch.testing.assert_close(y, x * 0.5 + 1.0)
