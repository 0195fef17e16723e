"""The CUDA graph API emulated on CPU, for the graph-runner tests (tests/test_graph_static_cache.py,
tests/test_paged_cache_graphs.py).  Capture records the call; replay re-runs it on the graph's static inputs and
writes the results into the captured outputs (what a real replay does to device memory).  Strict about Python
state: a graph state among the arguments (runtime/graphs.py's graph_step protocol, e.g. a static PagedKVCache)
replays with its host counters as they were at capture (a real replay runs no Python), so a position baked into the
graph or a host counter a replay skips shows."""
from __future__ import annotations

import contextlib
import functools

import torch
from torch.utils import _pytree as pytree

from opsadv.runtime import graphs


class FakeGraph:
    active = None                 # the graph being captured
    replaying = False

    def __init__(self):
        self.call = None

    def replay(self):
        fn, args, kwargs, out, frozen = self.call
        live = [(st, st.graph_snapshot()[0]) for st, _, _ in frozen]
        for st, host, view in frozen:   # Python values are those of the capture
            st.graph_restore((host, None))
            st._graph_view = view
        FakeGraph.replaying = True
        try:
            new = fn(*args, **kwargs)
        finally:
            FakeGraph.replaying = False
            for st, host in live:
                st.graph_restore((host, None))
                st._graph_view = False
        for o, n in zip(pytree.tree_leaves(out), pytree.tree_leaves(new)):
            if isinstance(o, torch.Tensor):
                o.copy_(n)


@contextlib.contextmanager
def fake_capture(g):
    FakeGraph.active = g
    try:
        yield
    finally:
        FakeGraph.active = None


class FakeStream:
    def __init__(self, *a, **k):
        pass

    def wait_stream(self, other):
        pass


def recording(fn):
    """fn, its call recorded into the graph being captured (with the graph states' capture-time host values)."""
    @functools.wraps(fn)
    def call(*args, **kwargs):
        g = FakeGraph.active
        frozen = []
        if g is not None:
            states = [x for x in pytree.tree_leaves((args, kwargs)) if graphs.graph_state(x) is not None]
            frozen = [(st, st.graph_snapshot()[0], st._graph_view) for st in states]
        out = fn(*args, **kwargs)
        if g is not None:
            g.call = (fn, args, kwargs, out, frozen)
        return out
    return call


def install(monkeypatch) -> None:
    """torch.cuda's graph, stream and CUDAGraph replaced by the emulation for the test."""
    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", fake_capture)
    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda d=None: FakeStream())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
