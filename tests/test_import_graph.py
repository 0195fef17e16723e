"""opsadv's own import graph, read from source with ast: no import cycles, a core that imports nothing above
it, and function-level imports of opsadv modules only where LAZY allows them (each with its reason).

The graph counts module-level and function-level imports (`import`, `from ... import`, relative ones
resolved, and `importlib.import_module("opsadv...")` with a literal name).  Importing a.b.c also runs the
__init__ of a.b, so an edge goes to the target and to each of its packages that is not a package of the
importer (those are already being imported when the importer runs)."""
from __future__ import annotations

import ast
import os
import subprocess
import sys
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

TRITON = "triton is optional: the target imports it at module level, the importer does not"
TC, CUDA = "opsadv.backends.triton_common", "opsadv.backends.cuda"
# (importer, target) -> why the import stays inside a function
LAZY: dict[tuple[str, str], str] = {
    ("opsadv", "opsadv.convert"): "`import opsadv` stays light: convert_model / Optimizer / load load on first use",
    ("opsadv", "opsadv.convert.paged_cache"): "`import opsadv` stays light: PagedKVCache imports transformers' cache "
                                              "code on first use",
    ("opsadv", "opsadv.runtime"): "`import opsadv` stays light: opsadv.runtime loads on first use (test_runtime)",
    ("opsadv._hf_seam", "opsadv.convert.hf_attention"): "registered only once transformers' modeling code loads "
                                                         "(test_hf_seam): `import opsadv` stays light",
    ("opsadv.distributed", "opsadv.distributed.rules"): "`import opsadv` stays light: the sharding rules import "
                                                        "torch.distributed.tensor (~0.6 s), loaded when it loads",
    ("opsadv.distributed", "opsadv.distributed.explain"): "as opsadv.distributed.rules (imports torch.distributed.tensor)",
    ("opsadv.distributed", "opsadv.distributed.gate_up"): "as opsadv.distributed.rules (imports torch.distributed.tensor)",
    ("opsadv.distributed", "opsadv.distributed.vocab_parallel"): "as opsadv.distributed.rules (imports "
                                                                 "torch.distributed.tensor)",
    ("opsadv.cli", "opsadv.bench.runner"): "optional CLI part: its ImportError leaves the other commands working",
    ("opsadv.cli", "opsadv.convert.cli"): "optional CLI part: its ImportError leaves the other commands working",
    ("opsadv.cli", "opsadv.convert.floor"): "info --tuning's floor decisions: the conversion stack loads for that flag "
                                             "only",
    ("opsadv.bench.suite_sparse", f"{TC}.sparse_attention.sparse"): TRITON,
    (f"{TC}.gemm.gemm", f"{TC}.gemm.kernels"): TRITON,
    (f"{TC}.gemm.gemm", f"{TC}.utils"): TRITON,
    (f"{TC}.scaled_gemm.scaled_gemm", f"{TC}.utils"): TRITON,
    (f"{TC}.norm.norm", f"{TC}.norm.kernels"): TRITON,
    (f"{TC}.norm.norm", f"{TC}.utils"): TRITON,
    (f"{TC}.rotary_embedding.rotary", f"{TC}.rotary_embedding.kernels"): TRITON,
    (f"{TC}.rotary_embedding.rotary", f"{TC}.utils"): TRITON,
    (f"{TC}.qk_norm_rotary.qk_norm_rotary", f"{TC}.qk_norm_rotary.kernels"): TRITON,
    (f"{TC}.qk_norm_rotary.qk_norm_rotary", f"{TC}.utils"): TRITON,
    (f"{TC}.swiglu.swiglu", f"{TC}.swiglu.kernels"): TRITON,
    (f"{TC}.paged_attention.paged_attention", f"{TC}.paged_attention.kernels"): TRITON,
    (f"{TC}.paged_attention.paged_attention", f"{TC}.utils"): TRITON,
    (f"{TC}.scaled_gemm.scaled_gemm", f"{TC}.scaled_gemm.kernels"): TRITON,
    (f"{TC}.fp8_attention.fp8_attention", f"{TC}.fp8_attention.kernels"): TRITON,
    (f"{TC}.fp8_attention.fp8_attention", f"{TC}.utils"): TRITON,
    (f"{TC}.fp8_attention.fp8_attention", f"{TC}.fp8_attention.bwd_kernels"): TRITON,
    (f"{TC}.fp8_attention.fp8_attention", f"{TC}.flash_attention.bwd_kernels"): TRITON,
    (f"{TC}.linear_cross_entropy.linear_cross_entropy", f"{TC}.linear_cross_entropy.kernels"): TRITON,
    (f"{TC}.swiglu.swiglu", f"{TC}.utils"): TRITON,
    (f"{TC}.attention_merge.attention_merge", f"{TC}.attention_merge.kernels"): TRITON,
    (f"{TC}.attention_merge.attention_merge", f"{TC}.utils"): TRITON,
    (f"{TC}.scaled_gemm.cast", f"{TC}.scaled_gemm.kernels"): TRITON,
    (f"{TC}.scaled_gemm.cast", f"{TC}.utils"): TRITON,
    (f"{TC}.scaled_gemm.cast_delayed", f"{TC}.scaled_gemm.kernels"): TRITON,
    (f"{TC}.scaled_gemm.cast_delayed", f"{TC}.utils"): TRITON,
    (f"{CUDA}.flash_attention.gluon", f"{TC}.flash_attention.attention"): TRITON,
    (f"{CUDA}.flash_attention.gluon", f"{TC}.utils"): TRITON,
    (f"{CUDA}.flash_attention.gluon_bwd", f"{TC}.flash_attention.attention"): TRITON,
    (f"{CUDA}.flash_attention.gluon_bwd", f"{TC}.utils"): TRITON,
    (f"{CUDA}.gemm.gluon", f"{TC}.utils"): TRITON,
    (f"{CUDA}.swiglu_gemm.gluon", f"{TC}.utils"): TRITON,
}
ABOVE_CORE = ("opsadv.backends", "opsadv.convert", "opsadv.cli", "opsadv.bench", "opsadv.registry")
# what `import opsadv` must not load (heavy, optional, or loaded on first use)
NOT_AT_IMPORT = ("transformers", "matplotlib", "triton", "opsadv.convert", "opsadv.runtime", "opsadv.backends",
                 "opsadv.bench", "torch.distributed.tensor", "opsadv.distributed.rules")


@dataclass(frozen=True)
class Import:
    importer: str
    target: str          # the most specific module of the package the statement names
    line: int
    lazy: bool           # inside a function
    guarded: bool        # inside a try block (an optional import)


def module_index(root: Path, package: str) -> dict[str, tuple[Path, bool]]:
    """module name -> (source file, is a package) for every .py under root/package."""
    out = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        out[".".join(parts[:-1] if is_pkg else parts)] = (path, is_pkg)
    return out


def _owner(name: str, index) -> str | None:
    """The most specific module in index that `name` (a module or an attribute path) lies in."""
    while name and name not in index:
        name = name.rpartition(".")[0]
    return name or None


def _is_type_checking(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and (getattr(test, "id", None) == "TYPE_CHECKING"
                                         or getattr(test, "attr", None) == "TYPE_CHECKING")


def parse_imports(name: str, path: Path, is_pkg: bool, index, package: str) -> tuple[list[Import], set[str]]:
    """(imports of modules of `package`, third-party top-level names imported at module level outside try)."""
    base = name if is_pkg else name.rpartition(".")[0]
    found: list[Import] = []
    third: set[str] = set()

    def add(target: str | None, node, lazy, guarded):
        if target is not None and target != name:
            found.append(Import(name, target, node.lineno, lazy, guarded))

    def visit(node, lazy: bool, guarded: bool):
        for child in ast.iter_child_nodes(node):
            if _is_type_checking(child):
                continue
            if isinstance(child, ast.Import):
                for a in child.names:
                    if a.name == package or a.name.startswith(package + "."):
                        add(_owner(a.name, index), child, lazy, guarded)
                    elif not lazy and not guarded:
                        third.add(a.name.split(".")[0])
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    parts = base.split(".")
                    parts = parts[:len(parts) - (child.level - 1)]
                    src = ".".join(parts + ([child.module] if child.module else []))
                else:
                    src = child.module or ""
                if src == package or src.startswith(package + "."):
                    for a in child.names:
                        sub = f"{src}.{a.name}"
                        add(sub if sub in index else _owner(src, index), child, lazy, guarded)
                elif not lazy and not guarded:
                    third.add(src.split(".")[0])
            elif (isinstance(child, ast.Call) and getattr(child.func, "attr", getattr(child.func, "id", None))
                  == "import_module" and child.args and isinstance(child.args[0], ast.Constant)
                  and isinstance(child.args[0].value, str) and child.args[0].value.startswith(package)):
                add(_owner(child.args[0].value, index), child, lazy, guarded)
            visit(child, lazy or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)),
                  guarded or (isinstance(child, ast.Try) and bool(child.handlers)))

    visit(ast.parse(path.read_text(), str(path)), False, False)
    return found, third


def _packages(target: str, importer: str) -> list[str]:
    """target and its packages that are not packages of importer (importing target runs their __init__)."""
    out = [target]
    pkg = target.rpartition(".")[0]
    while pkg and not (importer == pkg or importer.startswith(pkg + ".")):
        out.append(pkg)
        pkg = pkg.rpartition(".")[0]
    return out


def build_graph(imports: list[Import]) -> dict[str, dict[str, Import]]:
    """importer -> {module it runs: the import statement that runs it}."""
    g: dict[str, dict[str, Import]] = {}
    for imp in imports:
        edges = g.setdefault(imp.importer, {})
        for t in _packages(imp.target, imp.importer):
            if t != imp.importer:
                edges.setdefault(t, imp)
    return g


def find_cycles(graph) -> list[list[str]]:
    """One cycle [a, b, ..., a] per strongly connected component of more than one module (Tarjan, iterative)."""
    nodes = set(graph) | {t for e in graph.values() for t in e}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    sccs: list[list[str]] = []
    for start in sorted(nodes):
        if start in index:
            continue
        work = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on.add(start)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                scc = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    scc.append(w)
                    if w == v:
                        break
                if len(scc) > 1:
                    sccs.append(sorted(scc))
    return [_cycle_through(graph, scc) for scc in sorted(sccs)]


def _cycle_through(graph, scc: list[str]) -> list[str]:
    """A shortest cycle from scc[0] back to itself inside the component."""
    members, first = set(scc), scc[0]
    prev: dict[str, str] = {}
    todo = deque([first])
    while todo:
        v = todo.popleft()
        for w in sorted(graph.get(v, ())):
            if w == first:
                path = [v]
                while path[-1] != first:
                    path.append(prev[path[-1]])
                return path[::-1] + [first]
            if w in members and w not in prev:
                prev[w] = v
                todo.append(w)
    raise AssertionError(f"no cycle through {first} in {scc}")


def describe(graph, cycle: list[str]) -> str:
    steps = []
    for a, b in zip(cycle, cycle[1:]):
        imp = graph[a][b]
        how = "imports" if imp.target == b else f"imports {imp.target}, which runs"
        steps.append(f"{a}:{imp.line} {how} {b}{' (in a function)' if imp.lazy else ''}")
    return " -> ".join(cycle) + "\n    " + "\n    ".join(steps)


def load(root: Path = ROOT, package: str = "opsadv"):
    index = module_index(root, package)
    imports, third = [], {}
    for name, (path, is_pkg) in index.items():
        found, top = parse_imports(name, path, is_pkg, index, package)
        imports += found
        third[name] = top
    return index, imports, third


@pytest.fixture(scope="module")
def opsadv_graph():
    return load()


# ---- the checker itself --------------------------------------------------------------------------------
def test_cycle_finder_on_fake_graphs():
    def g(edges):
        return {a: {b: Import(a, b, 1, False, False) for b in bs} for a, bs in edges.items()}
    assert find_cycles(g({"a": ["b"], "b": ["c"], "c": []})) == []
    assert find_cycles(g({"a": ["b"], "b": ["c"], "c": ["a"], "d": ["a"]})) == [["a", "b", "c", "a"]]
    two = find_cycles(g({"a": ["b", "x"], "b": ["a"], "x": ["y"], "y": ["z"], "z": ["x"]}))
    assert two == [["a", "b", "a"], ["x", "y", "z", "x"]]
    assert find_cycles(g({"a": ["b", "c"], "b": ["d"], "c": ["a"], "d": ["a"]})) == [["a", "c", "a"]]


def test_graph_of_a_fake_package(tmp_path):
    """Relative and absolute imports, function-level ones, importlib with a literal, implied package __init__s."""
    files = {
        "fk/__init__.py": "",
        "fk/a.py": "from . import b\nfrom .sub import c\n",
        "fk/b.py": "import os\n\ndef f():\n    from .a import thing\n",
        "fk/sub/__init__.py": "from .d import x\n",
        "fk/sub/c.py": "from ..b import g\n",
        "fk/sub/d.py": "import importlib\n\ndef h():\n    return importlib.import_module('fk.b')\n",
        "fk/e.py": "try:\n    import fk.sub.d\n    import numpy\nexcept ImportError:\n    pass\nimport json\n",
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    index, imports, third = load(tmp_path, "fk")
    assert set(index) == {"fk", "fk.a", "fk.b", "fk.sub", "fk.sub.c", "fk.sub.d", "fk.e"}
    lazy = {(i.importer, i.target) for i in imports if i.lazy}
    assert lazy == {("fk.b", "fk.a"), ("fk.sub.d", "fk.b")}
    assert {(i.importer, i.target) for i in imports if i.guarded} == {("fk.e", "fk.sub.d")}
    assert third["fk.e"] == {"json"} and third["fk.b"] == {"os"}
    graph = build_graph(imports)
    assert set(graph["fk.a"]) == {"fk.b", "fk.sub.c", "fk.sub"}        # fk.sub.c runs fk/sub/__init__ too
    assert set(graph["fk.sub.c"]) == {"fk.b"}                          # fk.sub is its own package
    cycles = find_cycles(graph)
    assert cycles == [["fk.a", "fk.b", "fk.a"]], cycles
    assert "fk.b:4 imports fk.a (in a function)" in describe(graph, cycles[0])


# ---- opsadv ---------------------------------------------------------------------------------------------
def test_no_import_cycles(opsadv_graph):
    _, imports, _ = opsadv_graph
    graph = build_graph(imports)
    cycles = find_cycles(graph)
    assert not cycles, "import cycles in opsadv:\n" + "\n".join(describe(graph, c) for c in cycles)


# backend -> the other backends it may import; opsadv.backends.triton_common (the shared Triton kernels) is no
# backend: any backend may import it, and it imports none
BACKEND_IMPORTS_ALLOWED = {"jetson": {"cuda"}}
SHARED = "triton_common"


def _backend_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[:2] == ["opsadv", "backends"] else None


def backend_violations(imports) -> list[str]:
    """Imports from one backend into another that BACKEND_IMPORTS_ALLOWED does not allow."""
    bad = []
    for i in imports:
        src, dst = _backend_of(i.importer), _backend_of(i.target)
        if src is None or dst is None or src == dst or dst == SHARED:
            continue
        if src == SHARED or dst not in BACKEND_IMPORTS_ALLOWED.get(src, set()):
            bad.append(f"{i.importer}:{i.line} imports {i.target}")
    return bad


def test_backends_import_no_other_backend(opsadv_graph):
    """rocm, ascend, reference (and cuda) import no other backend; jetson alone builds on cuda; the shared
    Triton kernels import no backend at all."""
    index, imports, _ = opsadv_graph
    assert {"cuda", "rocm", "jetson", "ascend", "reference", SHARED} <= {_backend_of(m) for m in index}
    bad = backend_violations(imports)
    assert not bad, "a backend imports another backend:\n" + "\n".join(bad)


def test_backend_rule_on_fake_imports():
    fake = [Import("opsadv.backends.rocm.kernels", "opsadv.backends.cuda", 3, False, False),
            Import("opsadv.backends.jetson.kernels", "opsadv.backends.cuda", 4, False, False),
            Import(f"{TC}.gemm.gemm", f"{CUDA}.profiles", 5, True, False),
            Import("opsadv.backends.rocm.kernels", "opsadv.backends.triton_common", 6, False, False),
            Import("opsadv.backends.ascend.gemm", "opsadv.backends.ascend.norm", 7, False, False)]
    assert backend_violations(fake) == ["opsadv.backends.rocm.kernels:3 imports opsadv.backends.cuda",
                                        f"{TC}.gemm.gemm:5 imports opsadv.backends.cuda.profiles"]


def test_core_imports_nothing_above_it(opsadv_graph):
    """opsadv.core imports only opsadv.core (a registry fact it needs comes through core.hooks)."""
    _, imports, _ = opsadv_graph
    bad = [f"{i.importer}:{i.line} imports {i.target}" for i in imports
           if i.importer.startswith("opsadv.core") and not i.target.startswith("opsadv.core")]
    assert not bad, "opsadv.core imports from above it:\n" + "\n".join(bad)
    above = [i for i in imports if i.importer.startswith("opsadv.core") and i.target.startswith(ABOVE_CORE)]
    assert not above


def test_op_folders_import_only_core_and_ops(opsadv_graph):
    """opsadv.ops (the op folders: definitions, reference impls, cases) stands on core alone: no backend, registry,
    testing or convert import, so every backend and the conformance kit can import the ops."""
    _, imports, _ = opsadv_graph
    bad = [f"{i.importer}:{i.line} imports {i.target}" for i in imports
           if i.importer.startswith("opsadv.ops") and not i.target.startswith(("opsadv.core", "opsadv.ops"))]
    assert not bad, "opsadv.ops imports from above it:\n" + "\n".join(bad)


def test_function_level_imports_only_where_allowed(opsadv_graph):
    _, imports, _ = opsadv_graph
    lazy = [i for i in imports if i.lazy]
    pairs = {(i.importer, i.target) for i in lazy}
    unexpected = sorted(f"{i.importer}:{i.line} imports {i.target} inside a function" for i in lazy
                        if (i.importer, i.target) not in LAZY)
    assert not unexpected, ("function-level imports of opsadv modules (move them to the module top, or add them to "
                            "LAZY with the reason):\n" + "\n".join(unexpected))
    stale = sorted(f"{a} -> {b}" for a, b in LAZY if (a, b) not in pairs)
    assert not stale, "LAZY entries no longer needed:\n" + "\n".join(stale)
    assert len(pairs) <= len(LAZY)


def _loads_at_import(name: str, third, imports) -> set[str]:
    """Third-party top-level names `import name` loads: its module-level, unguarded imports, transitively."""
    edges: dict[str, set[str]] = {}
    for i in imports:
        if not i.lazy and not i.guarded:
            edges.setdefault(i.importer, set()).update(_packages(i.target, i.importer))
    seen, todo, out = set(), [name, *[p for p in _packages(name, "")[1:]]], set()
    while todo:
        m = todo.pop()
        if m in seen:
            continue
        seen.add(m)
        out |= third.get(m, set())
        todo += edges.get(m, ())
    return out


def test_lazy_triton_imports_are_needed(opsadv_graph):
    """Each TRITON entry of LAZY: the target loads triton at import and the importer does not (else the import
    belongs at the module top)."""
    _, imports, third = opsadv_graph
    wrong = []
    for (importer, target), why in LAZY.items():
        if why != TRITON:
            continue
        if "triton" not in _loads_at_import(target, third, imports):
            wrong.append(f"{target} does not import triton at module level")
        if "triton" in _loads_at_import(importer, third, imports):
            wrong.append(f"{importer} imports triton at module level already (import {target} at the top)")
    assert not wrong, "\n".join(wrong)


def test_import_opsadv_stays_light():
    code = ("import sys, opsadv\n"
            f"print(' '.join(m for m in {NOT_AT_IMPORT!r} if m in sys.modules))\n"
            "from opsadv.core import hooks\n"
            "from opsadv.registry import get_registry\n"
            "assert hooks._get_registry is get_registry\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env,
                         timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.strip() == "", f"`import opsadv` loaded {res.stdout.split()}"


def test_registry_reset_empties_the_dispatch_memo():
    """The registry reports a rebuild through core.hooks; dispatch forgets its memoized choices."""
    from opsadv.core import dispatch, hooks
    from opsadv.registry import get_registry, reset_registry
    dispatch._memo[("test_import_graph",)] = object()
    reset_registry()
    assert ("test_import_graph",) not in dispatch._memo
    assert hooks.get_registry() is get_registry()
