"""The conformance kit: a case catalogue per op, a runner that compares any backend with the
reference backend in float64 (forward and backward), and the backend x op x dtype x shape-class
matrix as JSON / Markdown.

    opsadv conformance --backend NAME [--quick] [--json PATH] [--markdown PATH]
    pytest --opsadv-backend NAME [--opsadv-quick]      (installed opsadv: the pytest11 entry point)
    pytest -p opsadv.testing --opsadv-backend NAME     (a source checkout on PYTHONPATH)
"""
from __future__ import annotations

from pytest_opsadv import add_options

from .cases import BASELINE_FACTOR, CATALOGUE, TOLERANCE, Case
from .runner import Result, default_device, iter_cases, run_case, run_conformance, run_graph_checks

__all__ = ["BASELINE_FACTOR", "CATALOGUE", "TOLERANCE", "Case", "Result", "run_case", "run_conformance", "run_graph_checks",
           "iter_cases", "default_device"]


# ---- pytest plugin: `pytest -p opsadv.testing`, or without -p where opsadv is installed (its pytest11 entry point,
# the top-level module pytest_opsadv, adds the same options and collects through collect_conformance_items)
def pytest_addoption(parser):
    add_options(parser)


def pytest_collection_modifyitems(session, config, items):
    collect_conformance_items(session, config, items)


def collect_conformance_items(session, config, items):
    """One pytest item per (backend, case, dtype) of --opsadv-backend's catalogue."""
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
