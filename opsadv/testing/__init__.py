"""The conformance kit: a case catalogue per op, a runner that compares any backend with the
reference backend in float64 (forward and backward), and the backend x op x dtype x shape-class
matrix as JSON / Markdown.

    opsadv conformance --backend NAME [--quick] [--json PATH] [--markdown PATH]
    pytest -p opsadv.testing --opsadv-backend NAME [--opsadv-quick]
"""
from __future__ import annotations

from .cases import BASELINE_FACTOR, CATALOGUE, TOLERANCE, Case
from .runner import Result, default_device, iter_cases, run_case, run_conformance, run_graph_checks

__all__ = ["BASELINE_FACTOR", "CATALOGUE", "TOLERANCE", "Case", "Result", "run_case", "run_conformance", "run_graph_checks",
           "iter_cases", "default_device"]


# ---- pytest plugin (enabled with `pytest -p opsadv.testing`) ---------------------------------------
def pytest_addoption(parser):
    group = parser.getgroup("opsadv", "opsadv conformance")
    group.addoption("--opsadv-backend", action="append", default=[],
                    help="run the opsadv conformance catalogue against this backend (repeatable)")
    group.addoption("--opsadv-quick", action="store_true", help="quick catalogue")
    group.addoption("--opsadv-device", default=None, help="device for the backend's tensors (default: its own)")


def pytest_collection_modifyitems(session, config, items):
    import pytest

    backends = config.getoption("--opsadv-backend")
    if not backends:
        return
    import torch

    quick = config.getoption("--opsadv-quick")
    device = config.getoption("--opsadv-device")

    class ConformanceItem(pytest.Item):
        def __init__(self, *, case, backend, dtype, dev, **kw):
            super().__init__(**kw)
            self.case, self.backend, self.dtype, self.dev = case, backend, dtype, dev

        def runtest(self):
            r = run_case(self.case, self.backend, self.dtype, self.dev or default_device(self.backend))
            if r.status == "skip":
                pytest.skip(r.reason)
            if r.status == "fail":
                raise AssertionError(f"{self.name}: {r.reason} (seed {r.seed}, impl {r.impl})")

        def reportinfo(self):
            return self.path, None, self.name

    dtypes = (torch.float16, torch.float32, torch.bfloat16) if quick else (
        torch.float16, torch.bfloat16, torch.float32, torch.float64)
    for backend in backends:
        for case in iter_cases(quick):
            for dtype in dtypes:
                name = f"conformance[{backend}-{case.op}-{case.shape_class}-{str(dtype).replace('torch.', '')}]"
                items.append(ConformanceItem.from_parent(session, name=name, case=case, backend=backend,
                                                         dtype=dtype, dev=device))
