"""The house's floors (README "Layout"): imports run down, never in a circle, and no module
outside a kernel's package switches on a kernel's name.

The import graph is read from the source (every ``import`` and ``from ... import``, function-local
ones included; ``if TYPE_CHECKING:`` blocks are left out of the floors, and counted for circles: a
type named only for the checker still ties the two modules together). A package importing its own
submodules is an import like any other (``highlevel -> isa -> isa.vector -> ops -> highlevel`` was a
circle through ``isa/__init__.py``); a submodule naming its own package is structure, not a circle.
"""

from __future__ import annotations

import ast
import functools
import os
import subprocess
import sys
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


def _imports(mod: str, path: Path, mods: dict[str, Path], typing: bool) -> set[str]:
    tree = _tree(path)
    out: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if (
                not typing
                and isinstance(child, ast.If)
                and "TYPE_CHECKING" in ast.unparse(child.test)
            ):
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
                # ``from pkg import sub`` imports the submodule; any other name comes from pkg
                subs = [f"{base}.{a.name}" for a in child.names]
                names = [n for n in subs if n in mods]
                if len(names) < len(subs):
                    names.append(base)
            for n in names:
                target = _resolve(n, mods) if n.startswith("mxcli") else None
                if target and target != mod and not mod.startswith(target + "."):
                    out.add(target)
            visit(child)

    visit(tree)
    return out


@functools.cache
def _graph(typing: bool = False) -> dict[str, set[str]]:
    """Module -> the package modules it imports (`typing`: with ``TYPE_CHECKING`` imports)."""
    mods = _modules()
    return {m: _imports(m, p, mods, typing) for m, p in mods.items()}


# the kernel parts above the kernels' floor (issue 32: a kernel is a vertical slice)
SLICE_PARTS = ("inputs", "verification")


def _floor(mod: str) -> int | None:
    """The floor of `mod`'s top-level part; a kernel's slice part named after a shared floor
    (``mxcli.kernels.<kernel>.inputs``, ``.verification``: what that floor calls, through the
    spec, without importing it) sits on that floor."""
    parts = mod.split(".")
    if len(parts) >= 4 and parts[1] == "kernels" and parts[3] in SLICE_PARTS:
        return FLOORS[parts[3]]
    return FLOORS.get(parts[1]) if len(parts) > 1 else None


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles of `graph` (its strongly connected components of two or more)."""
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
    return sorted(circles)


def test_no_import_circles_anywhere() -> None:
    """Issue 32: no circle anywhere in the package, ``TYPE_CHECKING`` imports included
    (``tensor -> machine -> races -> tensor`` was one)."""
    assert _circles(_graph(typing=True)) == []


def test_the_circle_finder_finds_a_circle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _circles(graph) == [["a", "b", "c"]]


# The NKI interpreter (README "Layout"; mxcli/nkisim/README.md): `mxcli.nkisim.nki` holds the
# modules a kernel's ``import nki...`` resolves to (nki, language, isa, dtype and their helper
# highlevel). They stand on the simulator's state and values only: the machine, tensors, dtypes,
# op tokens, target, rules, errors, and the launcher for ``nki.jit``; never on the observers
# (trace, cost, schedule, races), the front-end check, or the report tables. No simulator module
# imports them, except the package's ``__init__`` that installs them as ``nki``. (Below the
# simulator, the floors rule: `isa.pe` uses `mxcli.mx` for quantize_mx.)
KERNEL_FACING = "mxcli.nkisim.nki"
KERNEL_FACING_STANDS_ON = {
    f"mxcli.nkisim.{m}"
    for m in ("machine", "tensor", "dtypes", "ops", "target", "rules", "errors", "kernel")
}


def test_kernel_facing_nki_modules_stand_on_an_allowed_set_of_the_simulator() -> None:
    graph = _graph(typing=True)
    facing = [m for m in graph if m == KERNEL_FACING or m.startswith(KERNEL_FACING + ".")]
    assert {"mxcli.nkisim.nki.language", "mxcli.nkisim.nki.isa", "mxcli.nkisim.nki.dtype"} <= set(
        facing
    )
    beyond = sorted(
        f"{m} -> {t}"
        for m in facing
        for t in graph[m]
        if t.startswith("mxcli.nkisim.")
        and not t.startswith(KERNEL_FACING)
        and t not in KERNEL_FACING_STANDS_ON
    )
    assert beyond == []
    upward = sorted(
        f"{m} -> {t}"
        for m, targets in graph.items()
        for t in targets
        if t.startswith(KERNEL_FACING)
        and m.startswith("mxcli.nkisim")
        and not m.startswith(KERNEL_FACING)
        and m != "mxcli.nkisim"
    )
    assert upward == []


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


def test_op_tokens_import_alone_and_their_high_level_call_comes_from_nki_language() -> None:
    """`ops` stands below the ISA instructions (no circle): imported alone, its tokens load
    nothing above them, and their high-level call says what to import; with nki.language
    imported, ``nl.add`` is that call."""
    code = (
        "import sys\n"
        "from mxcli.nkisim.ops import add\n"
        "assert not [m for m in sys.modules if m.startswith('mxcli.nkisim.nki')], 'nki loaded'\n"
        "try:\n"
        "    add(1, 2)\n"
        "except TypeError as exc:\n"
        "    print(exc)\n"
        "from mxcli.nkisim.nki import highlevel, language\n"
        "print(language.add is add, type(add).high_level_call is highlevel.call_token)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT.parent)}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True
    ).stdout.splitlines()
    assert out == [
        "nl.add(...): the high-level call needs nki.language imported (mxcli.nkisim.nki.language)",
        "True True",
    ]


# ---- issue 32: shared modules know no kernel -----------------------------------------------

# The shared modules: they iterate the registered specs and ask them, so none names a kernel,
# one of its tensors or one of its defaults. Not shared, and why:
# - ``mxcli.kernels.<kernel>`` packages: the kernels' own slices (everything about one kernel);
# - ``mxcli.weightprep``: turns a checkpoint into *these* kernels' arguments (the router and
#   the expert stacks in their layouts): its layouts are the kernels', not a generic mechanism;
# - ``mxcli.emulate``: emulates the MXFP8 training step of this MoE layer (the two kernels'
#   numerics, by design);
# - ``mxcli.mx``, ``mxcli.nkisim``: below the kernels (numbers, the NKI machine); they cannot
#   import a kernel, and name none;
# - ``mxcli.commands.demo``: the walkthrough of the two built-in kernels on tiny models (its
#   steps are theirs, as the README's are).
SHARED = (
    "mxcli.runs",
    "mxcli.inputs",
    "mxcli.verification",
    "mxcli.inspection",
    "mxcli.commands",
    "mxcli.cli",
    "mxcli.kernels.spec",
    "mxcli.kernels.backends",
    "mxcli.kernels.selection",
    "mxcli.kernels.nki_runtime",
    "mxcli.kernels.profiling",
    "mxcli.io",
)
NOT_SHARED = ("mxcli.commands.demo",)
# the one place a kernel package is named: its registration line
REGISTRATION = "KERNEL_PACKAGES"


def _forbidden() -> tuple[set[str], set[str]]:
    """(kernel names, found anywhere in a string; tensor names, short names and string
    defaults, found as a whole string), read from the registered specs' tables."""
    import enum

    from mxcli.kernels.spec import all_specs

    names: set[str] = set()
    exact: set[str] = set()
    for spec in all_specs():
        names.add(spec.name)
        exact |= {spec.short, *spec.tensor_names, *spec.outputs}
        defaults = [s.default for s in spec.scalars]
        for part in ("inputs", "profile"):
            module = spec.part(part)
            if module is not None:
                defaults += [p.default for p in module.PARAMS]
        for v in defaults:
            if isinstance(v, enum.Enum):
                exact |= {v.name, v.name.lower()}
            elif isinstance(v, str):
                exact.add(v)
    return names, exact


def _kernel_strings(tree: ast.Module, names: set[str], exact: set[str]) -> list[tuple[int, str]]:
    """(line, string) of each string constant in `tree` naming a kernel, one of its tensors or
    one of its defaults; docstrings, ``__all__`` and the registration line are not code that
    decides anything."""
    skip: set[int] = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr):
            if isinstance(body[0].value, ast.Constant):
                skip.add(id(body[0].value))  # a docstring
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id in ("__all__", REGISTRATION) for t in node.targets
        ):
            skip |= {id(c) for c in ast.walk(node.value)}
    return [
        (node.lineno, node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and id(node) not in skip
        and (node.value in exact or any(n in node.value for n in names))
    ]


def _shared(mod: str) -> bool:
    inside = any(mod == s or mod.startswith(s + ".") for s in SHARED)
    return inside and not any(mod == s or mod.startswith(s + ".") for s in NOT_SHARED)


def test_no_shared_module_names_a_kernel_its_tensors_or_its_defaults() -> None:
    """Issue 32: a kernel's knowledge lives in its folder; shared modules ask its spec."""
    names, exact = _forbidden()
    assert {"rmsnorm_mx_prefill", "blockwise_mm_bwd_mxfp8"} <= names
    assert {"hidden_states", "gamma", "norm_quant_packed", "softmax"} <= exact
    found = [
        f"{mod}:{line}: {text!r}"
        for mod, path in sorted(_modules().items())
        if _shared(mod)
        for line, text in _kernel_strings(_tree(path), names, exact)
    ]
    assert found == []


def test_the_shared_module_check_catches_a_planted_name() -> None:
    """The check above fails on each kind of violation (and passes docstrings, __all__ and the
    registration line)."""
    names, exact = _forbidden()
    planted = ast.parse(
        '"""A docstring may say hidden_states and rmsnorm_mx_prefill."""\n'
        "__all__ = ['prefill']\n"
        "KERNEL_PACKAGES = ('mxcli.kernels.rmsnorm_mx_prefill',)\n"
        "def f(t, kind):\n"
        "    x = t['hidden_states']\n"
        "    if kind == 'bwd':\n"
        "        return 'mxcli.kernels.rmsnorm_mx_prefill.nki_kernel'\n"
        "    return {'router_act': 'softmax'}\n"
    )
    assert [line for line, _ in _kernel_strings(planted, names, exact)] == [5, 6, 7, 8]
