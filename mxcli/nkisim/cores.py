"""Each logical core's own copy of a kernel's module state under LNC=2 (issue 29).

On the device each logical core runs its own program: what a kernel's modules hold at trace time
(a module-global dict, a cache, a memory manager) belongs to that core's trace alone (python
subset spec, "Reachability": module globals are parsed and compiled by the front end, not shared
by CPython between cores). The interpreter runs the two programs as two threads of one Python
process, which would share those globals: AWS's MXFP8 backward keeps its SBUF stack allocator in
``mxfp_utils/mxfp8_utils/common_utils._state`` and asserts that only one is active, so the second
core's program failed (or, worse, both cores pushed and popped one stack).

`program_entry` gives program ``i >= 1`` a fresh import of the kernel's top-level package (cached
per process, like the original import) and the kernel's arguments rebuilt for it: an argument
object of that package's classes is rebuilt from its ``__dict__`` as the copy's class (python
subset spec, "Classes": an argument instance "is rebuilt on the NKI side from its __dict__"), an
enum member as the copy's member of the same name. mxcli's own modules, the ``nki`` namespace,
the tests' modules and the standard library are never copied: they hold no kernel state.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import sys
import threading
import types
from collections.abc import Callable
from typing import Any

__all__ = ["program_entry"]

# packages whose modules are shared by the programs: mxcli itself (the interpreter is `nki`),
# the interpreter's aliases, and test modules (kernels defined in test files hold no state)
_SHARED_ROOTS = frozenset({"mxcli", "nki", "neuronxcc", "tests", "__main__", "builtins"})

_lock = threading.Lock()
_copies: dict[tuple[str, int, int], dict[str, types.ModuleType]] = {}


def _root(fn: Callable[..., Any]) -> str | None:
    module = getattr(fn, "__module__", None)
    if not isinstance(module, str) or module not in sys.modules:
        return None
    root = module.split(".")[0]
    if root in _SHARED_ROOTS or root in sys.stdlib_module_names:
        return None
    return root


def _in_package(name: str, root: str) -> bool:
    return name == root or name.startswith(root + ".")


def _fresh_modules(fn: Callable[..., Any], root: str, program: int) -> dict[str, types.ModuleType]:
    """The kernel's package imported once more for `program` (sys.modules left as it was)."""
    key = (root, program, id(sys.modules[fn.__module__]))
    with _lock:
        hit = _copies.get(key)
        if hit is not None:
            return hit
        saved = {n: m for n, m in sys.modules.items() if _in_package(n, root)}
        try:
            for n in saved:
                del sys.modules[n]
            importlib.import_module(fn.__module__)
            fresh = {n: m for n, m in sys.modules.items() if _in_package(n, root)}
        finally:
            for n in [n for n in sys.modules if _in_package(n, root)]:
                del sys.modules[n]
            sys.modules.update(saved)
        _copies[key] = fresh
        return fresh


def _lookup(modules: dict[str, types.ModuleType], cls: type) -> Any:
    """`cls`'s counterpart (same module name and qualified name) in `modules`, or None."""
    mod = modules.get(getattr(cls, "__module__", ""))
    if mod is None:
        return None
    obj: Any = mod
    for part in cls.__qualname__.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def _rebuild(value: Any, modules: dict[str, types.ModuleType], root: str) -> Any:
    if isinstance(value, tuple):
        return (
            type(value)(*(_rebuild(v, modules, root) for v in value))
            if hasattr(value, "_fields")
            else tuple(_rebuild(v, modules, root) for v in value)
        )
    if isinstance(value, list):
        return [_rebuild(v, modules, root) for v in value]
    if isinstance(value, dict):
        return {k: _rebuild(v, modules, root) for k, v in value.items()}
    cls = type(value)
    if not _in_package(getattr(cls, "__module__", ""), root):
        return value
    twin = _lookup(modules, cls)
    if twin is None or twin is cls:
        return value
    if isinstance(value, enum.Enum):
        return twin[value.name]
    if hasattr(value, "__dict__"):
        obj = object.__new__(twin)
        for k, v in vars(value).items():
            object.__setattr__(obj, k, _rebuild(v, modules, root))
        return obj
    if dataclasses.is_dataclass(value):  # slots dataclasses
        return twin(
            **{
                f.name: _rebuild(getattr(value, f.name), modules, root)
                for f in dataclasses.fields(value)
            }
        )
    return value


def program_entry(
    fn: Callable[..., Any], program: int, args: list[Any], kwargs: dict[str, Any]
) -> tuple[Callable[..., Any], list[Any], dict[str, Any]]:
    """The function and arguments program `program` runs: `fn` itself for program 0 and for
    kernels of shared packages; else its twin in the program's own import of the package."""
    root = _root(fn)
    if program == 0 or root is None:
        return fn, args, kwargs
    modules = _fresh_modules(fn, root, program)
    mod = modules.get(fn.__module__)
    twin: Any = mod
    for part in getattr(fn, "__qualname__", fn.__name__).split("."):
        twin = getattr(twin, part, None) if twin is not None else None
    if not callable(twin):
        twin = getattr(mod, fn.__name__, None) if mod is not None else None
    if type(twin).__name__ == "Kernel" and callable(getattr(twin, "fn", None)):
        twin = twin.fn  # an @nki.jit kernel of the module: the function it wraps
    if not callable(twin):
        return fn, args, kwargs
    return (
        twin,
        [_rebuild(a, modules, root) for a in args],
        {k: _rebuild(v, modules, root) for k, v in kwargs.items()},
    )
