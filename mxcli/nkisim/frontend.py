"""The NKI 0.6 front-end check: is everything a kernel reaches inside the meta-programming subset?

The real compiler does not run a kernel with CPython. Its own front end parses the jit entry and
everything reachable from it (helpers, methods, classes, module globals, helpers imported from
other modules) and specializes that in a restricted Python interpreter (NKI language guide;
migration guide "Language restrictions"). The interpreter runs kernels eagerly, so it would
accept any Python; this module closes that gap statically, on the source.

`check_frontend` walks the source with `ast`, resolving every free name through the function's
closure, globals and builtins (and attribute chains through modules and classes), and follows
each user function and class it reaches. Runtime argument values are checked as well: a class
instance passed to the kernel brings its class (and so its methods) into the kernel.

Where the documentation is silent, a construct is allowed only if upstream NKI Library kernels
use it inside kernels (README.md beside this file lists those decisions).
"""

from __future__ import annotations

import ast
import builtins
import dataclasses
import enum
import inspect
import sys
import types
import weakref
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from mxcli.nkisim.rules import NkiRuleError, Rule

__all__ = ["FrontendViolation", "NkiFrontendError", "assert_frontend", "check_frontend"]

# Builtins a kernel may call: the documented value constructors plus those upstream kernels call
# inside kernels (nki-library, AST survey of its kernel modules).
ALLOWED_BUILTINS = frozenset(
    {
        "range",
        "len",
        "min",
        "max",
        "print",
        "str",
        "int",
        "float",
        "bool",
        "tuple",
        "list",
        "dict",
        "isinstance",
        "divmod",
        # AWS's shipped MXFP8 MoE backward (nki-library experimental/moe_mxfp8/bwd): `zip` in
        # blockwise_mm_backward_mxfp8.py `_resolve_phase_configs`, `getattr` / `setattr` in
        # config.py `MXFP8MOEBwdConfig.__post_init__` (README.md beside this file)
        "zip",
        "getattr",
        "setattr",
    }
)
# Modules a kernel may reference besides NKI and user modules: `math` is used by upstream
# kernels; dataclasses / enum / typing only supply decorators, bases and annotations.
_ALLOWED_STDLIB_MODULES = frozenset({"math", "dataclasses", "enum", "typing", "__future__"})
_TORCH_NUMPY_ROOTS = frozenset({"torch", "numpy", "ml_dtypes"})
_NKI_ROOTS = ("mxcli.nkisim", "nki")
# Decorators: `@dataclass` on classes (documented), `@staticmethod` (upstream core kernels) and
# `@property` (AWS's MatmulMxfp8KernelConfig, MXFP8 MoE backward) on methods. Decorators on
# module-level helpers are not checked: the NKI front end ignores them ("The parser frontend
# ignores decorators", nki-library mxfp_utils/mxfp8_utils/common_utils.py:53-56,
# `with_active_sbm`); the function they wrap (``__wrapped__``) is what gets checked.
_CLASS_DECORATORS = frozenset({"dataclass", "dataclasses.dataclass"})
_METHOD_DECORATORS = frozenset({"staticmethod", "property"})
# Methods that run when an instance is built: on the host, before the call, for an instance
# passed as a kernel argument (rebuilt on the NKI side from its __dict__, nki_python_subset.md
# "Classes"); checked only when traced code constructs the class.
_CONSTRUCTION_METHODS = frozenset({"__init__", "__post_init__", "__new__"})
_MAX_VALUE_DEPTH = 8


@dataclasses.dataclass(frozen=True)
class FrontendViolation:
    """One construct outside the subset: where, which rule, and what."""

    rule: Rule
    file: str
    line: int
    message: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.message} [{self.rule.value}]"


class NkiFrontendError(NkiRuleError):
    """The kernel uses Python outside the NKI 0.6 subset; ``.violations`` lists every site."""

    def __init__(self, kernel: str, violations: tuple[FrontendViolation, ...]) -> None:
        shown = "; ".join(str(v) for v in violations[:5])
        more = f"; ... and {len(violations) - 5} more" if len(violations) > 5 else ""
        super().__init__(
            violations[0].rule,
            f"nki front end: {kernel} uses {len(violations)} construct(s) outside the NKI 0.6 "
            f"subset: {shown}{more}",
        )
        self.violations = violations


# -- classification of values -------------------------------------------------------------------


def _module_root(name: str | None) -> str:
    return (name or "").split(".")[0]


def _is_nki_name(name: str | None) -> bool:
    return bool(name) and any(name == r or name.startswith(r + ".") for r in _NKI_ROOTS)  # type: ignore[union-attr]


def _origin_module(value: Any) -> str | None:
    """The module that defines `value` (for modules: their own name)."""
    if isinstance(value, types.ModuleType):
        return value.__name__
    try:
        mod = getattr(value, "__module__", None)
    except Exception:  # noqa: BLE001 - arbitrary objects may raise from __getattr__
        mod = None
    if isinstance(mod, str):
        return mod
    return getattr(type(value), "__module__", None)


def _is_nki(value: Any) -> bool:
    if isinstance(value, types.ModuleType) and getattr(value, "__mxcli_nkisim__", False):
        return True
    if _is_nki_name(_origin_module(value)):
        return True
    return _is_nki_name(getattr(type(value), "__module__", None))


def _is_torch_numpy(value: Any) -> bool:
    if isinstance(value, (np.ndarray, np.generic)):
        return True
    for mod in (_origin_module(value), getattr(type(value), "__module__", None)):
        if _module_root(mod) in _TORCH_NUMPY_ROOTS:
            return True
    return False


def _is_nki_dtype(value: Any) -> bool:
    """NKI 0.6 dtypes are strings (the stub's ``DType = str``); ours compare equal to their name."""
    return type(value).__name__ == "DType" and _is_nki(value)


def _is_nki_object_class(cls: type) -> bool:
    return cls.__name__ == "NKIObject" and _is_nki(cls)


def _unwrap_callable(value: Any) -> Any:
    fn = getattr(value, "fn", None)  # an nki.jit Kernel
    if fn is not None and type(value).__name__ == "Kernel" and _is_nki(value):
        value = fn
    return inspect.unwrap(value) if callable(value) else value


# -- source lookup ------------------------------------------------------------------------------


class _Sources:
    """Parsed module files, cached by path and modification time."""

    def __init__(self) -> None:
        self._trees: dict[str, tuple[float, ast.Module]] = {}

    def tree(self, path: str) -> ast.Module | None:
        try:
            mtime = Path(path).stat().st_mtime
        except OSError:
            return None
        hit = self._trees.get(path)
        if hit is not None and hit[0] == mtime:
            return hit[1]
        try:
            tree = ast.parse(Path(path).read_text(encoding="utf-8"), filename=path)
        except (OSError, SyntaxError, UnicodeDecodeError):
            return None
        self._trees[path] = (mtime, tree)
        return tree


_SOURCES = _Sources()


def _first_line(node: ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) -> int:
    return min([node.lineno, *(d.lineno for d in node.decorator_list)])


_Def = ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef


def _find_def(
    tree: ast.Module, name: str, first_line: int, kinds: tuple[type[_Def], ...]
) -> _Def | None:
    for node in ast.walk(tree):
        if isinstance(node, kinds) and node.name == name:
            if first_line in (node.lineno, _first_line(node)):
                return node
    return None


def _function_node(fn: types.FunctionType) -> tuple[str, ast.AST | None]:
    path = fn.__code__.co_filename
    tree = _SOURCES.tree(path)
    if tree is None:
        return path, None
    node = _find_def(
        tree, fn.__name__, fn.__code__.co_firstlineno, (ast.FunctionDef, ast.AsyncFunctionDef)
    )
    return path, node


def _class_node(cls: type) -> tuple[str, ast.AST | None]:
    try:
        path = inspect.getsourcefile(cls) or inspect.getfile(cls)
        _, line = inspect.getsourcelines(cls)
    except (OSError, TypeError):
        return str(getattr(sys.modules.get(cls.__module__), "__file__", "?")), None
    tree = _SOURCES.tree(path)
    if tree is None:
        return path, None
    return path, _find_def(tree, cls.__name__, line, (ast.ClassDef,))


def _bound_names(node: ast.AST) -> set[str]:
    """Every name bound anywhere inside `node` (parameters, targets, defs, imports)."""
    names: set[str] = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Name) and isinstance(n.ctx, (ast.Store, ast.Del)):
            names.add(n.id)
        elif isinstance(n, ast.arg):
            names.add(n.arg)
        elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(n.name)
        elif isinstance(n, (ast.Import, ast.ImportFrom)):
            for a in n.names:
                names.add((a.asname or a.name).split(".")[0])
        elif isinstance(n, ast.ExceptHandler) and n.name:
            names.add(n.name)
    return names


# -- the walker ---------------------------------------------------------------------------------


class _Scope:
    """How free names resolve in one function or class body: closure, globals, builtins."""

    def __init__(
        self,
        path: str,
        local: set[str],
        closure: Mapping[str, Any],
        globals_: Mapping[str, Any],
    ) -> None:
        self.path = path
        self.local = local
        self.closure = closure
        self.globals = globals_
        b = globals_.get("__builtins__", builtins)
        self.builtins: Mapping[str, Any] = b if isinstance(b, dict) else vars(b)

    def lookup(self, name: str) -> tuple[bool, Any]:
        for table in (self.closure, self.globals):
            if name in table:
                return True, table[name]
        return False, None


class _Checker:
    def __init__(self) -> None:
        self.violations: list[FrontendViolation] = []
        self._seen: set[int] = set()
        self._constructed: set[int] = set()
        self._keep: list[Any] = []  # keeps ids in _seen valid for the walk

    # -- reporting
    def add(self, rule: Rule, path: str, line: int, message: str) -> None:
        v = FrontendViolation(rule, path, line, message)
        if v not in self.violations:
            self.violations.append(v)

    def _first_visit(self, obj: Any) -> bool:
        if id(obj) in self._seen:
            return False
        self._seen.add(id(obj))
        self._keep.append(obj)
        return True

    # -- values reached from source or arguments
    def reach(self, value: Any, where: str, path: str, line: int, depth: int = 0) -> None:
        """Check a value the kernel reaches (a global, an attribute, an argument)."""
        if depth > _MAX_VALUE_DEPTH or value is None or isinstance(value, (bool, int, float, str)):
            return
        if value is Ellipsis:
            return
        if type(value).__name__ == "Kernel" and hasattr(value, "fn"):
            # an @nki.jit sub-kernel: the migration guide asks to drop the decorator, but upstream
            # core kernels call jit-decorated helpers (moe_tkg, moe_cte); its body is checked
            self.check_function(_unwrap_callable(value))
            return
        if _is_nki(value):
            return
        if _is_torch_numpy(value):
            self.add(
                Rule.TORCH_NUMPY,
                path,
                line,
                f"{where} is a {_origin_module(value)} object ({_describe(value)}); no torch or "
                "numpy object or call is allowed while tracing",
            )
            return
        if isinstance(value, (tuple, list)):
            for i, item in enumerate(value):
                self.reach(item, f"{where}[{i}]", path, line, depth + 1)
            return
        if isinstance(value, dict):
            for k, item in value.items():
                if not (isinstance(k, str) or _is_nki_dtype(k)):
                    self.add(Rule.VALUE, path, line, f"{where} is a dict with a non-str key {k!r}")
                self.reach(item, f"{where}[{k!r}]", path, line, depth + 1)
            return
        if isinstance(value, (set, frozenset)):
            self.add(Rule.SET, path, line, f"{where} is a {type(value).__name__}")
            return
        if isinstance(value, types.ModuleType):
            self._reach_module(value, where, path, line)
            return
        if isinstance(value, (staticmethod, classmethod)):
            value = value.__func__
        root = _module_root(_origin_module(value))
        if root in _ALLOWED_STDLIB_MODULES:
            return
        if root in sys.stdlib_module_names and root != "builtins":
            self.add(
                Rule.VALUE,
                path,
                line,
                f"{where} is {_describe(value)} from the Python library module "
                f"{_origin_module(value)}, which NKI kernels cannot use",
            )
            return
        if isinstance(value, types.FunctionType):
            self.check_function(inspect.unwrap(value))
            return
        if isinstance(value, type):
            self.check_class(value, path, line)
            return
        if isinstance(value, enum.Enum):
            self.check_class(type(value), path, line)
            return
        if isinstance(value, (types.BuiltinFunctionType, types.MethodType)):
            if _origin_module(value) == "math" or getattr(value, "__self__", None) is builtins:
                return
            if isinstance(value, types.MethodType) and isinstance(
                value.__func__, types.FunctionType
            ):
                self.reach(value.__self__, f"{where}.__self__", path, line, depth + 1)
                self.check_function(value.__func__)
                return
        cls = type(value)
        if cls.__module__ not in ("builtins",) and isinstance(
            getattr(value, "__dict__", None), dict
        ):
            if self._first_visit(value):
                self.check_class(cls, path, line)
                for k, item in vars(value).items():
                    self.reach(item, f"{where}.{k}", path, line, depth + 1)
            return
        self.add(
            Rule.VALUE,
            path,
            line,
            f"{where} is a {cls.__name__} ({_describe(value)}); NKI values are None, bool, int, "
            "float, str, tensors, tuples, lists, dicts with str keys and NKIObject instances",
        )

    def _reach_module(self, mod: types.ModuleType, where: str, path: str, line: int) -> None:
        name = mod.__name__
        if name in _ALLOWED_STDLIB_MODULES or _is_nki(mod):
            return
        if _module_root(name) in _TORCH_NUMPY_ROOTS:
            self.add(
                Rule.TORCH_NUMPY,
                path,
                line,
                f"{where} is the module {name}; no torch or numpy "
                "object or call is allowed while tracing",
            )
            return
        if _module_root(name) in sys.stdlib_module_names:
            self.add(Rule.VALUE, path, line, f"{where} is the module {name}, not available in NKI")

    # -- functions
    def check_function(self, fn: Any, is_entry: bool = False, method: bool = False) -> None:
        if not isinstance(fn, types.FunctionType) or _is_nki(fn) or not self._first_visit(fn):
            return
        path, node = _function_node(fn)
        line = fn.__code__.co_firstlineno
        if fn.__name__ == "<lambda>":
            self.add(Rule.LAMBDA, path, line, "lambda functions are not supported")
            return
        if node is None:
            self.add(Rule.SOURCE, path, line, f"no parseable source for {fn.__qualname__}")
            return
        closure: dict[str, Any] = {}
        for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or (), strict=False):
            try:
                closure[name] = cell.cell_contents
            except ValueError:  # an empty cell: the enclosing function has not bound it yet
                continue
        scope = _Scope(path, _bound_names(node), closure, fn.__globals__)
        assert isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        if is_entry:
            self._check_signature(node, path, entry=True)
        # decorators of helpers are not checked: the front end ignores them (see above)
        _BodyVisitor(self, scope, is_entry, fn.__name__).visit_function(node)

    def _check_signature(
        self, node: ast.FunctionDef | ast.AsyncFunctionDef, path: str, entry: bool
    ) -> None:
        a = node.args
        what = "a jit entry" if entry else f"{node.name}"
        if a.kwonlyargs:
            self.add(
                Rule.SIGNATURE,
                path,
                a.kwonlyargs[0].lineno,
                f"{what} has keyword-only parameters ({', '.join(k.arg for k in a.kwonlyargs)}); "
                "drop the '*' separator and put parameters with defaults last",
            )
        for va, kind in ((a.vararg, "*"), (a.kwarg, "**")):
            if va is not None:
                self.add(
                    Rule.SIGNATURE,
                    path,
                    va.lineno,
                    f"{what} has a variadic parameter {kind}{va.arg}",
                )

    def _check_decorators(
        self,
        node: ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef,
        scope: _Scope,
        allowed: frozenset[str],
        what: str,
    ) -> None:
        for d in node.decorator_list:
            text = ast.unparse(d.func if isinstance(d, ast.Call) else d)
            if text not in allowed:
                self.add(
                    Rule.DECORATOR,
                    scope.path,
                    d.lineno,
                    f"decorator @{text} on {what} {node.name} (allowed: "
                    f"{', '.join('@' + a for a in sorted(allowed)) or 'none'})",
                )

    # -- classes
    def check_class(self, cls: type, path: str, line: int) -> None:
        if _is_nki(cls) or not self._first_visit(cls):
            return
        if cls.__module__ == "builtins":
            return
        cpath, node = _class_node(cls)
        cline = getattr(node, "lineno", line)
        if not (self._base_ok(cls)):
            bases = ", ".join(b.__qualname__ for b in cls.__bases__)
            self.add(
                Rule.CLASS_BASE,
                cpath,
                cline,
                f"class {cls.__qualname__}({bases}) must derive from NKIObject only (or be an Enum)",
            )
        if node is None:
            self.add(Rule.SOURCE, cpath, cline, f"no parseable source for class {cls.__qualname__}")
            return
        assert isinstance(node, ast.ClassDef)
        mod = sys.modules.get(cls.__module__)
        globals_ = vars(mod) if mod is not None else {}
        scope = _Scope(cpath, set(), {}, globals_)
        self._check_decorators(node, scope, _CLASS_DECORATORS, "class")
        visitor = _BodyVisitor(self, scope, False, class_body=True)
        for stmt in node.body:
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if stmt.name in _CONSTRUCTION_METHODS:
                    continue  # checked by `check_construction` when traced code builds one
                member = cls.__dict__.get(stmt.name)
                method_scope = scope
                self._check_decorators(stmt, method_scope, _METHOD_DECORATORS, "method")
                fn = getattr(member, "__func__", getattr(member, "fget", member))
                if isinstance(fn, types.FunctionType):
                    self.check_function(fn, method=True)
                elif not stmt.decorator_list:
                    self.add(
                        Rule.DECORATOR,
                        cpath,
                        stmt.lineno,
                        f"method {cls.__qualname__}.{stmt.name} is not a plain function",
                    )
            elif isinstance(stmt, ast.ClassDef):
                inner = cls.__dict__.get(stmt.name)
                if isinstance(inner, type):
                    self.check_class(inner, cpath, stmt.lineno)
            else:
                visitor.visit(stmt)
        for base in cls.__bases__:
            if _module_root(base.__module__) not in sys.stdlib_module_names and not _is_nki(base):
                self.check_class(base, cpath, cline)

    def check_construction(self, cls: type) -> None:
        """Traced code builds an instance of `cls`: its ``__init__`` / ``__post_init__`` and
        dataclass ``default_factory`` callables run while tracing and are checked (for an
        instance passed as a kernel argument they ran on the host before the call)."""
        if _is_nki(cls) or cls.__module__ == "builtins" or id(cls) in self._constructed:
            return
        self._constructed.add(id(cls))
        self._keep.append(cls)
        self.check_class(cls, "?", 0)
        for klass in cls.__mro__:
            if (
                klass is object
                or _is_nki(klass)
                or _module_root(klass.__module__) in (sys.stdlib_module_names)
            ):
                continue
            cpath, node = _class_node(klass)
            if not isinstance(node, ast.ClassDef):
                continue
            mod = sys.modules.get(klass.__module__)
            scope = _Scope(cpath, set(), {}, vars(mod) if mod is not None else {})
            for stmt in node.body:
                if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    if stmt.name in _CONSTRUCTION_METHODS:
                        fn = klass.__dict__.get(stmt.name)
                        if isinstance(fn, types.FunctionType):
                            self.check_function(fn, method=True)
                elif isinstance(stmt, (ast.AnnAssign, ast.Assign)):
                    for call in ast.walk(stmt):
                        if isinstance(call, ast.Call):
                            for kw in call.keywords:
                                if kw.arg == "default_factory":
                                    _BodyVisitor(self, scope, False).visit(kw.value)

    @staticmethod
    def _base_ok(cls: type) -> bool:
        if issubclass(cls, enum.Enum):
            return cls.__bases__ == (enum.Enum,)
        if len(cls.__bases__) != 1:
            return False
        base = cls.__bases__[0]
        while base is not object:
            if _is_nki_object_class(base):
                return True
            if len(base.__bases__) != 1:
                return False
            base = base.__bases__[0]
        return False

    # -- kernel arguments
    def check_arguments(
        self,
        fn: Callable[..., Any],
        path: str,
        line: int,
        args: Iterable[Any],
        kwargs: Mapping[str, Any],
    ) -> None:
        try:
            params = list(inspect.signature(fn).parameters)
        except (TypeError, ValueError):
            params = []
        named = [(params[i] if i < len(params) else f"#{i}", a) for i, a in enumerate(args)]
        named += list(kwargs.items())
        for name, value in named:
            self._check_argument(value, f"argument {name!r}", path, line, 0)

    def _check_argument(self, value: Any, where: str, path: str, line: int, depth: int) -> None:
        if isinstance(value, list):
            self.add(
                Rule.LIST_ARGUMENT, path, line, f"{where} is a list; kernels take tuples, not lists"
            )
            return
        if _is_array(value):
            return  # a tensor
        if isinstance(value, tuple) and depth < _MAX_VALUE_DEPTH:
            for i, item in enumerate(value):
                self._check_argument(item, f"{where}[{i}]", path, line, depth + 1)
            return
        self.reach(value, where, path, line)


def _is_array(value: Any) -> bool:
    if isinstance(value, np.ndarray):
        return True
    mod = type(value).__module__
    return (_module_root(mod) == "torch" and type(value).__name__ in ("Tensor", "Parameter")) or (
        type(value).__name__ == "NkiTensor" and _is_nki(value)
    )


def _describe(value: Any) -> str:
    text = getattr(value, "__qualname__", None) or repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


# Syntax outside the NKI 0.6 subset (migration guide "Language restrictions"; constructs no
# upstream kernel uses): AST node type -> (rule, message, whether its children are checked too).
_BANNED_SYNTAX: dict[str, tuple[Rule, str, bool]] = {
    "Try": (Rule.TRY, "try/except is not supported; check with assert", True),
    "TryStar": (Rule.TRY, "try/except is not supported; check with assert", True),
    "Raise": (Rule.RAISE, "raise is not supported; check with assert", False),
    "With": (Rule.WITH, "with statements are not supported", True),
    "AsyncWith": (Rule.SYNTAX, "async with is not supported", False),
    "AsyncFor": (Rule.SYNTAX, "async for is not supported", False),
    "Await": (Rule.SYNTAX, "await is not supported", False),
    "Match": (Rule.SYNTAX, "match statements are not supported", False),
    "Lambda": (Rule.LAMBDA, "lambda is not supported; define a function", False),
    "Set": (Rule.SET, "set literals are not supported; use a tuple or list", True),
    "SetComp": (Rule.SET, "set comprehensions are not supported", True),
    "GeneratorExp": (Rule.GENERATOR, "generator expressions are not supported; use a loop", True),
    "ListComp": (
        Rule.COMPREHENSION,
        "list comprehensions are not used by NKI kernels; use a loop",
        True,
    ),
    "DictComp": (
        Rule.COMPREHENSION,
        "dict comprehensions are not used by NKI kernels; use a loop",
        True,
    ),
    "Global": (Rule.GLOBAL, "global statements are not supported", False),
    "Nonlocal": (Rule.GLOBAL, "nonlocal statements are not supported", False),
    "Yield": (Rule.YIELD, "yield is not supported", True),
    "YieldFrom": (Rule.YIELD, "yield from is not supported", True),
    "Delete": (Rule.DELETE, "del is not supported", False),
    "NamedExpr": (Rule.WALRUS, "assignment expressions (:=) are not supported", True),
    "Import": (Rule.IMPORT, "import inside a kernel function; import at module level", False),
    "ImportFrom": (Rule.IMPORT, "import inside a kernel function; import at module level", False),
}


class _BodyVisitor(ast.NodeVisitor):
    """Rejects syntax outside the subset and resolves free names of one function or class body."""

    def __init__(
        self,
        checker: _Checker,
        scope: _Scope,
        is_entry: bool,
        function: str = "",
        class_body: bool = False,
    ) -> None:
        self.c = checker
        self.s = scope
        self.is_entry = is_entry
        self.function = function
        self.class_body = class_body

    def add(self, rule: Rule, node: ast.AST, message: str) -> None:
        self.c.add(rule, self.s.path, getattr(node, "lineno", 0), message)

    def visit_function(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        if isinstance(node, ast.AsyncFunctionDef):
            self.add(Rule.SYNTAX, node, "async functions are not supported")
        if not self.is_entry:
            self.c._check_signature(node, self.s.path, entry=False)
        for default in [*node.args.defaults, *node.args.kw_defaults]:
            if default is not None:
                self.visit(default)
        for stmt in node.body:
            self.visit(stmt)

    # -- nested definitions: same scope tables (names bound in the enclosing body are local)
    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        self.c._check_decorators(node, self.s, frozenset(), "nested function")
        self.c._check_signature(node, self.s.path, entry=False)
        for default in [*node.args.defaults, *node.args.kw_defaults]:
            if default is not None:
                self.visit(default)
        for stmt in node.body:
            self.visit(stmt)

    def visit_AsyncFunctionDef(self, node: ast.AsyncFunctionDef) -> None:
        self.add(Rule.SYNTAX, node, "async functions are not supported")

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self.add(Rule.SYNTAX, node, f"class {node.name} is defined inside a kernel function")

    # -- annotations are never evaluated by the NKI front end's specialization
    def visit_arg(self, node: ast.arg) -> None:
        return

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        self.visit(node.target)
        if node.value is not None:
            self.visit(node.value)

    # -- statements and expressions outside the subset (`_BANNED_SYNTAX`)
    def visit(self, node: ast.AST) -> None:
        banned = _BANNED_SYNTAX.get(type(node).__name__)
        if banned is None:
            super().visit(node)
            return
        rule, message, look_inside = banned
        if rule is Rule.RAISE and self.function == "__post_init__":
            # dataclass validation raises while the instance is built, at specialization time
            # like an assert: AWS's MXFP8MOEBwdConfig.__post_init__ (nki-library
            # experimental/moe_mxfp8/bwd/config.py:135-141, `raise TypeError`); the exception
            # class is not a value the kernel computes with, its message arguments are checked
            exc = getattr(node, "exc", None)
            if isinstance(exc, ast.Call):
                for a in [*exc.args, *(k.value for k in exc.keywords)]:
                    self.visit(a)
            return
        self.add(rule, node, message)
        if look_inside:  # names inside still reach helpers and globals that need checking
            self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        if self.class_body:
            # dataclass field(default_factory=f): f runs when an instance is built
            self.visit(node.func)
            for a in node.args:
                self.visit(a)
            for kw in node.keywords:
                if kw.arg != "default_factory":
                    self.visit(kw.value)
            return
        cls = self._resolve(node.func)
        if isinstance(cls, type) and not issubclass(cls, enum.Enum):
            self.c.check_construction(cls)
        self.generic_visit(node)

    def _resolve(self, node: ast.AST) -> Any:
        """The value a `Name` or `a.b.c` chain names here (None when local or unknown)."""
        chain: list[str] = []
        while isinstance(node, ast.Attribute):
            chain.append(node.attr)
            node = node.value
        if not isinstance(node, ast.Name) or node.id in self.s.local:
            return None
        found, value = self.s.lookup(node.id)
        if not found:
            return None
        for attr in reversed(chain):
            if not isinstance(value, (types.ModuleType, type)):
                return None
            try:
                value = inspect.getattr_static(value, attr)
            except AttributeError:
                return None
        return value

    def visit_Constant(self, node: ast.Constant) -> None:
        if isinstance(node.value, (bytes, complex)):
            self.add(Rule.VALUE, node, f"{type(node.value).__name__} literals are not NKI values")

    def visit_Compare(self, node: ast.Compare) -> None:
        left = node.left
        for op, right in zip(node.ops, node.comparators, strict=True):
            if isinstance(op, (ast.Is, ast.IsNot)) and not (_is_none(left) or _is_none(right)):
                word = "is" if isinstance(op, ast.Is) else "is not"
                self.add(
                    Rule.IDENTITY,
                    node,
                    f"'{ast.unparse(left)} {word} {ast.unparse(right)}': identity comparison is "
                    "allowed only against None; use == / !=",
                )
            left = right
        self.generic_visit(node)

    # -- names
    def visit_Name(self, node: ast.Name) -> None:
        if not isinstance(node.ctx, ast.Load) or node.id in self.s.local:
            return
        found, value = self.s.lookup(node.id)
        if found:
            self.c.reach(value, f"name {node.id!r}", self.s.path, node.lineno)
            return
        if node.id in self.s.builtins:
            self._builtin(node, node.id)

    def _builtin(self, node: ast.AST, name: str) -> None:
        if name in ALLOWED_BUILTINS:
            return
        if name in ("set", "frozenset"):
            self.add(Rule.SET, node, f"{name}() is not supported")
        elif name in ("True", "False", "None", "Ellipsis", "NotImplemented"):
            return
        else:
            self.add(
                Rule.BUILTIN,
                node,
                f"builtin {name!r} is not used by NKI kernels (allowed: "
                f"{', '.join(sorted(ALLOWED_BUILTINS))})",
            )

    def visit_Attribute(self, node: ast.Attribute) -> None:
        chain: list[str] = []
        base: ast.AST = node
        while isinstance(base, ast.Attribute):
            chain.append(base.attr)
            base = base.value
        if not isinstance(base, ast.Name) or not isinstance(node.ctx, ast.Load):
            self.generic_visit(node)
            return
        self.visit(base)
        if base.id in self.s.local:
            return
        found, value = self.s.lookup(base.id)
        if not found:
            return
        where = base.id
        for attr in reversed(chain):
            if _is_nki(value) or not isinstance(value, (types.ModuleType, type)):
                return  # attributes of NKI objects, instances and values are not resolved here
            try:
                value = inspect.getattr_static(value, attr)
            except AttributeError:
                return
            where = f"{where}.{attr}"
            self.c.reach(value, f"name {where!r}", self.s.path, node.lineno)


def _is_none(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and node.value is None


# -- public API ---------------------------------------------------------------------------------

_static_cache: weakref.WeakKeyDictionary[Any, tuple[FrontendViolation, ...]] = (
    weakref.WeakKeyDictionary()
)


def _entry_function(kernel: Any) -> Any:
    return _unwrap_callable(kernel)


def check_frontend(
    kernel: Any,
    args: Iterable[Any] | None = None,
    kwargs: Mapping[str, Any] | None = None,
) -> tuple[FrontendViolation, ...]:
    """Every construct outside the NKI 0.6 subset that `kernel` reaches, as violations.

    kernel: an ``@nki.jit`` kernel or a plain function (the jit entry). args / kwargs: the
    launch's arguments, when known; class instances among them bring their classes in, and a list
    argument or a torch/numpy non-tensor value is itself a violation. Returns an empty tuple when
    the kernel conforms. The source walk is cached per function object.
    """
    fn = _entry_function(kernel)
    if not isinstance(fn, types.FunctionType):
        raise TypeError(f"check_frontend: expected a function or an nki.jit kernel, got {fn!r}")
    static = _static_cache.get(fn)
    if static is None:
        checker = _Checker()
        checker.check_function(fn, is_entry=True)
        static = tuple(checker.violations)
        _static_cache[fn] = static
    if args is None and not kwargs:
        return static
    dynamic = _Checker()
    dynamic._seen.add(id(fn))
    dynamic.check_arguments(
        fn, fn.__code__.co_filename, fn.__code__.co_firstlineno, args or (), kwargs or {}
    )
    extra = tuple(v for v in dynamic.violations if v not in static)
    return static + extra


def assert_frontend(
    kernel: Any,
    args: Iterable[Any] | None = None,
    kwargs: Mapping[str, Any] | None = None,
) -> None:
    """Raise `NkiFrontendError` (listing every site) when `check_frontend` finds violations."""
    violations = check_frontend(kernel, args, kwargs)
    if violations:
        name = getattr(_entry_function(kernel), "__qualname__", repr(kernel))
        raise NkiFrontendError(name, violations)
