"""The package's imports run one way: no cycle among its modules, counting imports made inside functions, and a
function-local import of a project module only where it defers an optional heavy dependency (allow-list below).
Read with `ast`, nothing is imported."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "lightning_npu"

# (importing module, imported module): why it is deferred
DEFERRED_ALLOWED: dict[tuple[str, str], str] = {
    ("lightning_npu.ops.functional", "lightning_npu.ops.library"): "registers the C++ kernels' torch ops (the build)",
    ("lightning_npu.ops.functional", "lightning_npu.ops.npu"): "torch_npu's fused ops, imported only on an NPU",
}


def _modules() -> dict[str, Path]:
    out = {}
    for f in PKG.rglob("*.py"):
        parts = f.relative_to(PKG.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return out


def _target(name: str, modules: dict[str, Path]) -> str | None:
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _imports(module: str, path: Path, modules: dict[str, Path]) -> list[tuple[str, int, bool]]:
    """(imported module, line, deferred) for every import of a project module in `path`."""
    tree = ast.parse(path.read_text())
    top = {id(n) for n in tree.body}
    is_pkg = path.name == "__init__.py"
    out = []
    for node in ast.walk(tree):
        deferred = id(node) not in top
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".") if is_pkg else module.split(".")[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            names = [f"{base}.{a.name}" for a in node.names] or [base]
        else:
            continue
        for name in names:
            if name.split(".")[0] != "lightning_npu":
                continue
            target = _target(name, modules)
            if target and target != module:
                out.append((target, node.lineno, deferred))
    return out


def _graph():
    modules = _modules()
    edges: dict[str, set[str]] = defaultdict(set)
    deferred = []
    for module, path in modules.items():
        for target, line, is_deferred in _imports(module, path, modules):
            if target != module.rpartition(".")[0] and not module.startswith(target + "."):
                edges[module].add(target)  # a package's own __init__ is the parent, not a dependency
            if is_deferred:
                deferred.append((module, target, f"{path.relative_to(PKG.parent)}:{line}"))
    return modules, edges, deferred


def _cycles(nodes, edges) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(nodes):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle_counting_deferred_imports():
    modules, edges, _ = _graph()
    assert _cycles(modules, edges) == []


def test_function_local_imports_of_project_modules_are_only_the_allowed_ones():
    _, _, deferred = _graph()
    unexpected = sorted(f"{where}: {m} -> {t}" for m, t, where in deferred if (m, t) not in DEFERRED_ALLOWED)
    assert unexpected == []


def test_no_folder_holds_more_than_twelve_modules():
    for folder in [PKG, *(p for p in PKG.rglob("*") if p.is_dir() and (p / "__init__.py").exists())]:
        modules = list(folder.glob("*.py"))  # the package's __init__ counted, as in any module count
        assert len(modules) <= 12, f"{folder.relative_to(PKG.parent)} holds {len(modules)} modules"
