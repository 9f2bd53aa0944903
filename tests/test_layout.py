"""The house's floors (README "Layout"): imports run down, never in a circle, and no module
outside a kernel's package switches on a kernel's name.

The import graph is read from the source (every ``import`` and ``from ... import``, function-local
ones included, ``if TYPE_CHECKING:`` blocks excluded). A package importing its own submodules,
and a submodule importing its package, are structure, not circles.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import mxcli

ROOT = Path(mxcli.__file__).resolve().parent

# floor of each top-level part of the package (a module may import its own floor and below)
FLOORS = {
    "errors": 0,
    "fsutil": 0,
    "memory": 0,
    "io": 0,
    "mx": 1,
    "nkisim": 1,
    "kernels": 2,
    "weightprep": 3,
    "inputs": 4,
    "verification": 4,
    "inspection": 5,
    "runs": 5,
    "demo": 5,
    "commands": 6,
    "cli": 6,
    "__main__": 6,
}
KERNEL_NAMES = ("rmsnorm_mx_prefill", "blockwise_mm_bwd_mxfp8")


@functools.cache
def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"))


@functools.cache
def _modules() -> dict[str, Path]:
    mods = {}
    for p in ROOT.rglob("*.py"):
        parts = list(p.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = p
    return mods


def _resolve(name: str, mods: dict[str, Path]) -> str | None:
    while name and name not in mods:
        name = name.rpartition(".")[0]
    return name or None


def _imports(mod: str, path: Path, mods: dict[str, Path]) -> set[str]:
    tree = _tree(path)
    out: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue
            names: list[str] = []
            if isinstance(child, ast.Import):
                names = [a.name for a in child.names]
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    pkg = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
                    for _ in range(child.level - 1):
                        pkg = pkg.rpartition(".")[0]
                    base = f"{pkg}.{base}" if base else pkg
                names = [f"{base}.{a.name}" for a in child.names] + [base]
            for n in names:
                target = _resolve(n, mods) if n.startswith("mxcli") else None
                if target and target != mod:
                    structural = target.startswith(mod + ".") or mod.startswith(target + ".")
                    if not structural:
                        out.add(target)
            visit(child)

    visit(tree)
    return out


@functools.cache
def _graph() -> dict[str, set[str]]:
    mods = _modules()
    return {m: _imports(m, p, mods) for m, p in mods.items()}


def _floor(mod: str) -> int | None:
    parts = mod.split(".")
    return FLOORS.get(parts[1]) if len(parts) > 1 else None


# the floors whose circles this test forbids (issue 19: the middle floors and what they stand on)
NO_CIRCLES = ("mxcli.io", "mxcli.kernels.spec", "mxcli.inputs", "mxcli.verification", "mxcli.runs")


def test_no_import_circles_through_the_middle_floors() -> None:
    graph = _graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []

    def strong(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                circles.append(sorted(comp))

    for v in graph:
        if v not in index:
            strong(v)
    assert [c for c in circles if any(m.startswith(NO_CIRCLES) for m in c)] == []


def test_imports_run_down_the_floors() -> None:
    up = sorted(
        f"{m} -> {t}"
        for m, targets in _graph().items()
        for t in targets
        if _floor(m) is not None and _floor(t) is not None and _floor(t) > _floor(m)  # type: ignore[operator]
    )
    assert up == []


def test_no_module_outside_a_kernel_package_compares_kernel_names() -> None:
    """Kernel identity is the `KernelSpec`; only the kernel's own package may spell its name in a
    comparison."""
    found = []
    for mod, path in _modules().items():
        if mod.startswith(("mxcli.kernels.rmsnorm_mx_prefill", "mxcli.kernels.blockwise_moe")):
            continue
        for node in ast.walk(_tree(path)):
            if isinstance(node, ast.Compare):
                consts = [
                    c.value
                    for c in ast.walk(node)
                    if isinstance(c, ast.Constant) and c.value in KERNEL_NAMES
                ]
                if consts:
                    found.append(f"{mod}:{node.lineno}")
    assert found == []
