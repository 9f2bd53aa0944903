"""One `KernelSpec` per kernel: what the rest of mxcli knows about a kernel, in one place.

Each kernel package defines its spec beside its public function (``rmsnorm_mx_prefill/contract.py``,
``blockwise_moe/contract.py``) and registers it here when imported. A spec holds:

- the argument tables: the tensor arguments (shape legend, stored dtypes) and the scalar kwargs
  (help, JSON/flag parser, JSON dumper), in the order of the public function's signature. Names,
  order, defaults and which tensors are required are read from that signature with `inspect`,
  never retyped; the spec checks that its tables cover the signature exactly;
- ``validate``: binds arguments to that one signature and checks them once, into the kernel's
  frozen call object (`KernelCall`), which every backend takes;
- the output names (every possible return, in API order; a call object knows which it returns);
- the packed output (`PackedOutput`), stored as bytes and compared through its decoded parts;
- the padded dims (`PaddedDims`): which dims of which tensors carry the model's H / I, for runs on
  zero-padded prepared weights;
- the non-finite rule (`NonfiniteRule`): which NaN/Inf outputs the inputs explain;
- the registered NKI implementations (`Implementation`): mxcli's own kernel, AWS's nkilib kernel or
  any ``MODULE:FUNCTION``, each imported only when chosen, and the kernel-specific host side of
  their launch (`NkiLaunch`: planning, argument conversion, the adaptation to third-party
  entry points), which the one launcher (`mxcli.kernels.launcher`) calls.
- its *slice parts* (`KernelSpec.part`): the modules of the kernel's own package that the shared
  floors call, imported only when asked (they sit on the floor of the shared module they plug
  into, above the spec, so the spec names them and never imports them):

  * ``<package>.inputs`` (`InputsPart`): the seeded synthetic generator, its make-inputs
    parameters (`InputParam`), and inputs from a prepared folder;
  * ``<package>.verification`` (`VerificationPart`): the exact-math check, the tolerance rows of
    the ``strict`` and ``hardware`` profiles, the ``verify --suite`` cases;
  * ``<package>.profile`` (`ProfilePart`): the ``profile`` shape flags and inputs from a shape.

Consumers look a kernel up by name or short name (`get_spec`) and ask its spec; none of them
compares kernel name strings, and none holds a kernel's tensor names or defaults.

Registration: a kernel package is one entry of `KERNEL_PACKAGES`; the environment variable
``MXCLI_KERNEL_PACKAGES`` (comma-separated module names) adds packages outside mxcli, imported
after these (a kernel written elsewhere, or at test time, needs no edit of mxcli). A package's
optional ``identity`` module (NAME, SHORT, TITLE: plain strings) lets the CLI list its commands
without importing it, hence without torch (`read_identity`, `kernel_identities`).
"""

from __future__ import annotations

import enum
import functools
import importlib
import importlib.machinery
import importlib.util
import inspect
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, Protocol, cast

from mxcli.errors import InputError, MxcliError
from mxcli.io.jsonfile import loads

if TYPE_CHECKING:  # torch and the file layer load when used: `mxcli --help` reads the registry
    import torch

    from mxcli.io.files import TensorFile

# The kernel packages; importing one registers its spec (and its backends). A new kernel is one
# line here, or one entry of the environment variable below.
KERNEL_PACKAGES = ("mxcli.kernels.rmsnorm_mx_prefill", "mxcli.kernels.blockwise_moe")
PACKAGES_ENV = "MXCLI_KERNEL_PACKAGES"


def kernel_packages() -> tuple[str, ...]:
    """`KERNEL_PACKAGES`, then those of ``MXCLI_KERNEL_PACKAGES`` (comma-separated)."""
    extra = [p.strip() for p in os.environ.get(PACKAGES_ENV, "").split(",") if p.strip()]
    return tuple(dict.fromkeys([*KERNEL_PACKAGES, *extra]))


def _identity(v: Any) -> Any:
    return v


@dataclass(frozen=True)
class TensorArg:
    """A tensor argument of a kernel, as it appears in an input file (named as the argument)."""

    name: str
    shape: str  # legend, e.g. "[B, S, H]"
    dtypes: tuple[torch.dtype, ...]  # accepted stored dtypes
    required: bool = False  # from the signature: no default


@dataclass(frozen=True)
class ScalarArg:
    """A scalar kwarg: its help, how a JSON/flag value becomes a kernel value and back.

    ``default`` is filled from the public function's signature. The run command's flag
    (``run-<short> --<flag>``) is generated from this row: ``flag`` (default: the name with
    dashes), ``value_type`` of the flag value (default: that of the signature's default; enums and
    None defaults are text unless given), ``shown`` (how the help shows a default that is not a
    plain value, e.g. ``H``), ``file`` (the flag names a JSON file holding the value: what it
    holds, for the messages)."""

    name: str
    help: str
    # JSON/flag value -> kernel value (raises InputError with a readable message)
    parse: Callable[[Any], Any] = _identity
    # kernel value -> JSON value
    dump: Callable[[Any], Any] = _identity
    default: Any = None
    flag: str | None = None
    value_type: type | None = None
    shown: str | None = None
    file: str | None = None

    @property
    def flag_name(self) -> str:
        return self.flag or "--" + self.name.replace("_", "-")

    @property
    def flag_type(self) -> type:
        if self.file is not None:
            return Path
        if self.value_type is not None:
            return self.value_type
        d = self.default
        if isinstance(d, bool):
            return bool
        if isinstance(d, (int, float)) and not isinstance(d, enum.Enum):
            return type(d)
        return str

    def shown_default(self) -> str:
        """The signature's default as help texts show it: ``on``/``off``, an enum member's
        lower-case name, a number or text as written."""
        if self.shown is not None:
            return self.shown
        return show_value(self.default)


def show_value(v: Any) -> str:
    """A default as help texts show it (``on``/``off``, enum members by lower-case name)."""
    if isinstance(v, bool):
        return "on" if v else "off"
    if isinstance(v, enum.Enum):
        return v.name.lower()
    if v is None:
        return "none"
    return str(v)


@dataclass(frozen=True)
class InputParam:
    """A parameter of a kernel's input generator, as a ``make-inputs`` (or ``profile``) flag.

    ``value_type``: int, float, str or bool (a bool is an on/off flag pair unless ``flag`` spells it);
    ``default``: the command's default (None: not given, the generator decides and ``help`` says
    how). ``with_weights``: what ``--weights DIR --layer L`` makes of it: ``"fact"`` (the layer
    fixes it: the flag may repeat the layer's value, not contradict it), ``"refused"`` (the layer's
    own is used), ``"output"`` (a kwarg of the output layout, applied on top of the layer's),
    ``"used"`` (passed to the generator of inputs from weights), ``"weights-only"`` (used, and
    refused without ``--weights``). ``choices``: the accepted values of a text flag."""

    name: str
    help: str
    value_type: type = int
    default: Any = None
    flag: str | None = None
    with_weights: str = "refused"
    choices: tuple[str, ...] = ()

    @property
    def flag_name(self) -> str:
        return self.flag or "--" + self.name.replace("_", "-")


@dataclass(frozen=True)
class PaddedDims:
    """Dims that carry the model's hidden size ``H`` or intermediate size ``I`` (bwd spec §1
    layouts), for runs on zero-padded prepared weights (`mxcli.weightprep.padding`).

    ``inputs`` / ``outputs``: tensor name -> {dim: "H" | "I"} (negative dims count from the end).
    ``hidden``: which padded hidden size the kernel reads, as the attribute of the prepared
    folder's `mxcli.weightprep.padding.Padding` that holds it (``prefill_hidden_size``: Hp, a
    multiple of 512; ``backward_hidden_size``: Hb, a multiple of 128). ``unpad_outputs``: whether results are cut back to
    the model's sizes (the backward's gradients) or kept as written (the next kernel reads them
    padded). ``intermediate_of``: the I of the run's expert stack from its tensors (None when the
    kernel has no I).
    """

    inputs: Mapping[str, Mapping[int, str]]
    outputs: Mapping[str, Mapping[int, str]] = field(default_factory=dict)
    hidden: str = "hidden_size"
    unpad_outputs: bool = False
    intermediate_of: Callable[[Mapping[str, torch.Tensor]], int | None] | None = None


@dataclass(frozen=True)
class NonfiniteRule:
    """Which NaN/Inf outputs the inputs explain (`mxcli.verification.finite`).

    ``x4_inputs``: inputs that may be stored as 32-bit words of four E4M3 codes (pre-quantized
    weights), whose NaN codes count as NaN values.
    ``token_inputs``: inputs whose rows are tokens that the kernel treats independently: a
    non-finite value there explains only its own token's outputs, and any other non-finite input
    explains every output. None: any non-finite input explains every output (the kernel mixes
    all tokens). ``views``: ``(outputs, kwargs, inputs) -> {name: floating tensor}``, the values
    to check (e.g. packed rows decoded); None: every floating output as it is.
    """

    token_inputs: tuple[str, ...] | None = None
    x4_inputs: tuple[str, ...] = ()
    views: (
        Callable[[Mapping[str, torch.Tensor], Mapping[str, Any], Mapping[str, torch.Tensor]], Any]
        | None
    ) = None


@dataclass(frozen=True)
class PackedOutput:
    """An output whose bytes hold several quantities (the prefill's packed rows: codes, scale
    bytes, an affinity tail, unspecified holes). It is stored as bytes (``as_bytes``), and
    compared and checked through its decoded parts, never byte by byte.

    ``decode(packed, kwargs, hidden, num_experts)`` -> an object with ``codes``, ``scales``,
    ``values`` and ``affinities`` (None when absent); ``geometry(kwargs, packed)`` -> (hidden,
    num_experts or None) when the file records no geometry.
    """

    name: str
    decode: Callable[[torch.Tensor, Mapping[str, Any], int, int | None], Any]
    geometry: Callable[[Mapping[str, Any], torch.Tensor], tuple[int, int | None]]
    as_bytes: Callable[[torch.Tensor], torch.Tensor]
    parts: tuple[str, ...] = ("codes", "scales", "values", "affinities")
    # (kwargs, hidden, num_experts, row_bytes) -> [row_bytes] bool: the bytes the API defines;
    # the others (holes, pads) a kernel may leave unwritten: excluded from comparisons, counted
    defined: Callable[[Mapping[str, Any], int, int | None, int], torch.Tensor] | None = None


@dataclass(frozen=True)
class Implementation:
    r"""An NKI implementation of a kernel that the ``sim`` and ``neuron`` backends launch (the
    ``--kernel`` choice; `mxcli.kernels.selection` resolves it, `mxcli.kernels.launcher`
    launches it).

    ``kernel``: the entry point, ``"module:function"``, imported only when chosen. ``own``:
    mxcli's own kernel, launched with its planned arguments (`NkiLaunch.prepare`); any other
    takes the API reference's arguments (`ThirdParty`). ``probe``: None when the implementation
    can run here, else a one-line reason (an optional package such as nkilib), checked before
    importing it. ``modules``: further modules where ``function`` may live (newer layouts of
    the same package). ``refusal``: (API-named arguments) -> why the implementation refuses
    them (its own ``kernel_assert``\ s, known ahead), or None. ``install_hint``: how to make
    it importable. ``distributions``: package names its version is looked up under.
    """

    name: str
    kernel: str
    own: bool = False
    probe: Callable[[], str | None] | str | None = None
    modules: tuple[str, ...] = ()
    refusal: Callable[[Mapping[str, Any]], str | None] | None = None
    install_hint: str = "put its package on PYTHONPATH or pass --kernel-path DIR"
    distributions: tuple[str, ...] = ()
    doc: str = ""

    @property
    def module(self) -> str:
        return self.kernel.partition(":")[0]

    @property
    def function(self) -> str:
        return self.kernel.partition(":")[2]

    def unavailable_reason(self) -> str | None:
        """None when this implementation can run here, else why not (never raises)."""
        return probe_reason(self.probe, f"{self.name} probe")


@dataclass(frozen=True)
class ThirdParty:
    """How a kernel's validated call reaches a third-party entry point written against the API
    reference (``nkilib`` or any ``MODULE:FUNCTION``); the generic adaptation (only the entry's
    parameters, enums as its own) is `mxcli.kernels.selection`'s.

    ``arguments``: call -> the API reference's arguments by name, as NKI takes them (dtypes
    as `mxcli.kernels.nki_runtime.DTypeName`, scalars that are tensors in the API as tensors).
    ``signature_keys``: parameters that tell an entry point of this kernel from another's.
    ``mxcli_only``: mxcli's arguments the API reference lacks, with their defaults (dropped
    at the default, refused otherwise). ``convert``: ``(entry, name, value) -> {keyword:
    value}`` or None (not this hook's argument), for arguments that need the entry's own
    classes (the backward's config). ``interpreter_arguments``: ``(API arguments, keyword
    arguments)``, adjusting the latter in place for mxcli's interpreter (typed x4 data).
    """

    arguments: Callable[[Any], dict[str, Any]] | str
    signature_keys: tuple[str, ...] = ()
    mxcli_only: tuple[tuple[str, Any], ...] = ()
    convert: Callable[[Any, str, Any], dict[str, Any] | None] | str | None = None
    interpreter_arguments: Callable[[Mapping[str, Any], dict[str, Any]], None] | str | None = None


@dataclass(frozen=True)
class NkiLaunch:
    """The kernel-specific host side of an NKI launch, which the one launcher
    (`mxcli.kernels.launcher`) calls for every implementation on ``sim`` and ``neuron``. Hooks
    are callables or ``"module:function"`` (imported at the first launch).

    ``as_call``: the kernel's call object, given as such or as the public function's arguments
    (validated). ``prepare``: call -> ``(args, kwargs)`` of mxcli's own kernel, planned and
    converted on the host before tracing. ``finish``: ``(call, outputs)`` -> the reference's
    outputs (dtype views, the caller's device). ``result``: the reference's sequence type.
    ``lnc``: the simulator's default LNC degree. ``third_party``: the adaptation to other
    implementations (None: only mxcli's kernel).
    """

    as_call: Callable[..., Any] | str
    prepare: Callable[[Any], tuple[Sequence[Any], Mapping[str, Any]]] | str
    finish: Callable[[Any, list[torch.Tensor]], Sequence[torch.Tensor]] | str
    result: type = list
    lnc: int = 1
    third_party: ThirdParty | None = None

    def hook(self, name: str) -> Callable[..., Any]:
        """The hook `name` (``as_call``, ``prepare``, ``finish``), loaded."""
        return load_target(getattr(self, name), f"launch {name}")


def probe_reason(probe: Callable[[], str | None] | str | None, what: str = "probe") -> str | None:
    """What `probe` (a callable or ``"module:function"``; None: nothing to probe) says: None
    when something can run here, else a one-line reason. Never raises: a probe that fails
    reports its exception as the reason."""
    if probe is None:
        return None
    try:
        return load_target(probe, what)()  # type: ignore[no-any-return]
    except Exception as exc:  # detection must never crash: treat as unavailable
        return f"{type(exc).__name__}: {exc}"


def load_target(target: Callable[..., Any] | str, what: str = "target") -> Callable[..., Any]:
    """A callable, or ``"module:function"`` imported now (``module:Class.method`` allowed)."""
    if callable(target):
        return target
    module_name, sep, attr = str(target).partition(":")
    if not sep or not module_name or not attr:
        raise InputError(f"{what}: expected MODULE:FUNCTION, got {target!r}")
    obj: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    if not callable(obj):
        raise InputError(f"{what}: {target} is not callable")
    return obj  # type: ignore[no-any-return]


@functools.cache
def _signature(fn: Callable[..., Any]) -> inspect.Signature:
    return inspect.signature(fn)


def bind_arguments(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> dict[str, Any]:
    """Every parameter of `fn` for a call with these arguments (positional, by name, then the
    signature's defaults), by name: how a kernel's validation reads its public signature.
    A call `fn` itself would refuse raises the same `TypeError`."""
    try:
        bound = _signature(fn).bind(*args, **kwargs)
    except TypeError as exc:
        raise TypeError(f"{fn.__name__}(): {exc}") from None
    bound.apply_defaults()
    return dict(bound.arguments)


class KernelCall(Protocol):
    """What every kernel's frozen call object offers (`PrefillCall`, `BwdCall`): the names of
    the outputs this call returns, in order."""

    @property
    def output_names(self) -> tuple[str, ...]: ...


class KernelSpec:
    """A kernel's argument tables, outputs, padding and non-finite rules, and implementations.

    `api` is the public function: the only place holding the kernel's signature (the API
    reference's). Its positional-or-keyword parameters are the kernel arguments; its
    keyword-only ones (``backend``, ...) are options of the call, not kernel arguments.
    """

    def __init__(
        self,
        api: Callable[..., Any],
        *,
        short: str,
        tensors: Sequence[TensorArg],
        scalars: Sequence[ScalarArg],
        outputs: Sequence[str],
        validate: Callable[..., KernelCall],
        required_outputs: Callable[[Mapping[str, Any], Any], Sequence[str]] | None = None,
        padded: PaddedDims | None = None,
        nonfinite: NonfiniteRule | None = None,
        packed: PackedOutput | None = None,
        geometry: Callable[[Mapping[str, torch.Tensor]], dict[str, Any]] | None = None,
        implementations: Iterable[Implementation] = (),
        nki: NkiLaunch | None = None,
        package: str | None = None,
        title: str = "",
        tokens: str | None = None,
    ) -> None:
        self.api = api
        # the kernel's package (its slice parts are submodules of it; see `part`)
        self.package: str = package or api.__module__.rpartition(".")[0]
        # one line for the run command's help (``run-<short>``)
        self.title = title
        # the tensor argument whose leading dims count the tokens (``[..., H]``), if any
        self.tokens = tokens
        self.name: str = api.__name__
        self.short = short
        self.signature = _signature(api)
        params = {
            n: p
            for n, p in self.signature.parameters.items()
            if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD
        }
        self.arguments: tuple[str, ...] = tuple(params)
        names = [t.name for t in tensors] + [s.name for s in scalars]
        by_name = set(names)
        if by_name != set(params) or len(by_name) != len(names):
            raise TypeError(
                f"{self.name}: the spec's argument tables {sorted(by_name)} do not match the "
                f"signature {sorted(params)}"
            )

        def has_default(n: str) -> bool:
            return params[n].default is not inspect.Parameter.empty

        # tables in signature order, with defaults and requiredness read from the signature
        self.tensors: tuple[TensorArg, ...] = tuple(
            replace(t, required=not has_default(t.name))
            for t in sorted(tensors, key=lambda t: self.arguments.index(t.name))
        )
        self.scalars: tuple[ScalarArg, ...] = tuple(
            replace(s, default=params[s.name].default if has_default(s.name) else None)
            for s in sorted(scalars, key=lambda s: self.arguments.index(s.name))
        )
        self.outputs: tuple[str, ...] = tuple(outputs)
        self._validate = validate
        self._required_outputs = required_outputs
        self.padded = padded
        self.nonfinite = nonfinite or NonfiniteRule()
        self.packed = packed
        self._geometry = geometry
        self.implementations: dict[str, Implementation] = {}
        for impl in implementations:
            self.register_implementation(impl)
        self.nki = nki

    def __repr__(self) -> str:
        return f"KernelSpec({self.name})"

    # -- arguments ---------------------------------------------------------------------------

    @property
    def tensor_names(self) -> list[str]:
        return [t.name for t in self.tensors]

    @property
    def scalar_names(self) -> list[str]:
        return [s.name for s in self.scalars]

    def default(self, name: str) -> Any:
        """The signature's default of kwarg `name`."""
        return self.signature.parameters[name].default

    def value(self, kwargs: Mapping[str, Any], name: str) -> Any:
        """``kwargs[name]``, or the signature's default when not given (absent or None)."""
        v = kwargs.get(name)
        return self.default(name) if v is None else v

    def check_tensors(
        self,
        tensors: Mapping[str, torch.Tensor],
        source: str,
        *,
        each: Callable[[str, torch.Tensor], None] | None = None,
    ) -> None:
        """Names and stored dtypes of a file's tensors; `each(name, tensor)` then runs on every
        given argument in order (e.g. a finiteness check).

        Shapes are the kernel's to validate (its messages give the expected and actual shapes).
        """
        known = self.tensor_names
        extra = [n for n in tensors if n not in known]
        if extra:
            raise InputError(
                f"{source}: unexpected tensor(s) {', '.join(extra)} for {self.name}; "
                f"expected names: {', '.join(known)}"
            )
        missing = [
            f"{t.name} {t.shape}" for t in self.tensors if t.required and t.name not in tensors
        ]
        if missing:
            raise InputError(f"{source}: missing tensor(s) {', '.join(missing)} for {self.name}")
        hs = tensors.get(self.tokens) if self.tokens is not None else None
        if hs is not None and hs.dim() >= 2 and 0 in hs.shape[:-1]:
            # the kernel API takes it (empty outputs), but the NKI kernel cannot allocate
            # [0, ...] tiles, and a run of no token is never what a file meant
            raise InputError(
                f"{self.tokens}: expected at least one token, got shape {tuple(hs.shape)}"
            )
        for arg in self.tensors:
            t = tensors.get(arg.name)
            if t is None:
                continue
            if t.dtype not in arg.dtypes:
                allowed = " or ".join(str(d).removeprefix("torch.") for d in arg.dtypes)
                raise InputError(
                    f"{arg.name}: expected dtype {allowed}, got {str(t.dtype).removeprefix('torch.')}"
                )
            if each is not None:
                each(arg.name, t)

    def metadata_kwargs(self, metadata: Mapping[str, str]) -> dict[str, Any]:
        """Raw (JSON) scalar kwargs recorded in a file's metadata: per-key entries, then the
        ``kwargs`` object."""
        from mxcli.io.kwargs import json_or_raw

        names = self.scalar_names
        out: dict[str, Any] = {n: json_or_raw(metadata[n]) for n in names if n in metadata}
        raw_kwargs = metadata.get("kwargs")
        if raw_kwargs is not None:
            obj = loads(raw_kwargs, "__metadata__['kwargs']")
            if not isinstance(obj, Mapping):
                raise InputError("__metadata__['kwargs']: expected a JSON object")
            unknown = sorted(k for k in obj if k not in names)
            if unknown:
                raise InputError(
                    f"__metadata__['kwargs']: unknown kwarg(s) {', '.join(unknown)} for {self.name}"
                )
            out.update(obj)
        return out

    def resolve_kwargs(self, *layers: Mapping[str, Any]) -> dict[str, Any]:
        """Every scalar kwarg as a kernel value: the signature's defaults, overridden by each
        layer in turn.

        ``None`` in a layer means "not given" (so an unset flag keeps the file's value), except
        for kwargs whose default is None.
        """
        raw: dict[str, Any] = {s.name: s.default for s in self.scalars}
        for layer in layers:
            for name, value in layer.items():
                if name not in raw:
                    raise InputError(f"{name}: not a kwarg of {self.name}")
                if value is not None:
                    raw[name] = value
        return {s.name: s.parse(raw[s.name]) for s in self.scalars}

    def dump_kwargs(self, kwargs: Mapping[str, Any]) -> dict[str, Any]:
        """JSON-ready kwargs (enums by name, the bwd config as a dict)."""
        return {s.name: s.dump(kwargs[s.name]) for s in self.scalars if s.name in kwargs}

    def bind(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """Every parameter of a call of the public function, by name (`bind_arguments`)."""
        return bind_arguments(self.api, *args, **kwargs)

    def validate(self, *args: Any, **kwargs: Any) -> Any:
        """Check a call's arguments once (the kernel's own rules and messages) and return the
        kernel's frozen call object, which every backend takes."""
        return self._validate(*args, **kwargs)

    def call(
        self, tensors: Mapping[str, Any], kwargs: Mapping[str, Any], **options: Any
    ) -> KernelCall:
        """The call object of contract-named tensors and scalar kwargs (`validate`)."""
        return self.validate(**tensors, **kwargs, **options)  # type: ignore[no-any-return]

    # -- outputs -----------------------------------------------------------------------------

    def name_outputs(self, call: KernelCall, result: Any) -> dict[str, torch.Tensor]:
        """A backend's return value (a list or tuple in API order, a dict, a named tuple) by the
        contract's names; absent (None) outputs are dropped."""
        if isinstance(result, Mapping):
            named = dict(result)
        elif hasattr(result, "_asdict"):
            named = dict(result._asdict())
        else:
            values = list(result) if isinstance(result, (list, tuple)) else [result]
            names = list(call.output_names)
            if len(names) != len(values):
                raise MxcliError(
                    f"{self.name} returned {len(values)} tensors, expected {len(names)} "
                    f"({', '.join(names)})"
                )
            named = dict(zip(names, values, strict=True))
        return {k: v for k, v in named.items() if v is not None}

    def required_outputs(
        self, kwargs: Mapping[str, Any], input_names: Iterable[str] | None = None
    ) -> list[str]:
        """The outputs a run with these (resolved) kwargs must have written, given the names of
        its input tensors (when unknown, those the kwargs alone decide): what `verify`
        requires."""
        if self._required_outputs is None:
            return list(self.outputs)
        return list(
            self._required_outputs(kwargs, None if input_names is None else list(input_names))
        )

    def order(self, names: Iterable[str]) -> list[str]:
        """`names` sorted as the kernel's arguments, then its returns, then the rest."""
        rank = {n: i for i, n in enumerate([*self.tensor_names, *self.outputs])}
        return sorted(names, key=lambda n: rank.get(n, len(rank)))

    def stored(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """Output `name` as it is stored on disk (`mxcli.io.files`): on the CPU, contiguous; the
        packed output as fp8 bytes whatever view it came back in (uint8, bf16, fp32)."""
        import torch

        t = t.detach().cpu().contiguous()
        if self.packed is not None and name == self.packed.name and t.dtype != torch.float8_e4m3fn:
            t = self.packed.as_bytes(t).view(torch.float8_e4m3fn)
        return t

    def geometry(self, inputs: Mapping[str, torch.Tensor]) -> dict[str, Any]:
        """Sizes a reader of the outputs needs besides the kwargs (``{}`` when none)."""
        return {} if self._geometry is None else self._geometry(inputs)

    # -- slice parts --------------------------------------------------------------------------

    def part(self, name: str) -> Any | None:
        """The kernel's ``<package>.<name>`` module (``inputs``, ``verification``, ``profile``),
        imported now; None when the kernel has no such part."""
        module = f"{self.package}.{name}"
        if importlib.util.find_spec(module) is None:
            return None
        return importlib.import_module(module)

    def inputs(self) -> InputsPart:
        """The kernel's inputs part; an `InputError` when it has none."""
        return cast(InputsPart, self._required_part("inputs", "synthetic inputs"))

    def verification(self) -> VerificationPart | None:
        """The kernel's verification part (exact check, tolerance rows, cases), or None."""
        return cast("VerificationPart | None", self.part("verification"))

    def profile(self) -> ProfilePart | None:
        """The kernel's profile part (shape flags, inputs from a shape), or None."""
        return cast("ProfilePart | None", self.part("profile"))

    def _required_part(self, name: str, what: str) -> ModuleType:
        module = self.part(name)
        if module is None:
            raise InputError(f"kernel: {self.name} has no {what} ({self.package}.{name})")
        return cast(ModuleType, module)

    # -- implementations (``--kernel``) --------------------------------------------------------

    def register_implementation(self, impl: Implementation) -> None:
        """Register an NKI implementation under ``impl.name`` (``mxcli``, ``nkilib``, ...)."""
        self.implementations[impl.name] = impl

    def implementation(self, name: str = "mxcli") -> Implementation:
        """A registered implementation, or an ad-hoc one for a ``MODULE:FUNCTION`` target
        (nothing is imported until it is loaded)."""
        impl = self.implementations.get(name)
        if impl is not None:
            return impl
        if ":" in name:
            return Implementation(name, name, doc=f"{name} (MODULE:FUNCTION)")
        known = ", ".join([*self.implementations, "MODULE:FUNCTION"])
        raise InputError(
            f"kernel: unknown implementation {name!r} of {self.name}; expected {known}"
        )

    @property
    def own_implementation(self) -> Implementation | None:
        """mxcli's own NKI kernel (``own``), if it has one."""
        return next((i for i in self.implementations.values() if i.own), None)


# --------------------------------------------------------------------------------------------
# The registry of specs
# --------------------------------------------------------------------------------------------

_SPECS: dict[str, KernelSpec] = {}


def register_spec(spec: KernelSpec) -> KernelSpec:
    """Register `spec` under its name and short name (done by each kernel package); a package
    with an identity module (`read_identity`) must say what its spec says."""
    ident = read_identity(spec.package)
    if ident is not None and ident != (says := KernelIdentity.of(spec)):
        raise TypeError(f"{spec.package}.{IDENTITY} says {ident}, its spec {says}")
    _SPECS[spec.name] = spec
    _SPECS[spec.short] = spec
    return spec


def _load_all() -> None:
    for package in kernel_packages():
        _import_package(package)


def _import_package(package: str) -> None:
    """Import a kernel package; a package named by ``MXCLI_KERNEL_PACKAGES`` that does not exist
    is the user's input: an `InputError` naming the variable (not a traceback)."""
    try:
        importlib.import_module(package)
    except ModuleNotFoundError as exc:
        missing = exc.name or ""
        if package in KERNEL_PACKAGES or not (
            package == missing or package.startswith(missing + ".")
        ):
            raise  # mxcli's own packages, or an import inside the package: a real defect
        raise InputError(
            f"{PACKAGES_ENV}: no module {package!r} (expected importable kernel packages, "
            f"comma-separated; got {os.environ.get(PACKAGES_ENV, '')!r})"
        ) from None


def find_spec(kernel: str | None) -> KernelSpec | None:
    """The spec of `kernel` (name or short name), or None."""
    if kernel is None:
        return None
    if kernel not in _SPECS:
        _load_all()
    return _SPECS.get(kernel)


def get_spec(kernel: str | KernelSpec) -> KernelSpec:
    """The spec of `kernel` (name, short name or spec); an `InputError` naming the known ones."""
    if isinstance(kernel, KernelSpec):
        return kernel
    spec = find_spec(kernel)
    if spec is None:
        raise InputError(
            f"kernel: unknown kernel {kernel!r}; expected one of "
            + ", ".join(s.name for s in all_specs())
        )
    return spec


def all_specs() -> list[KernelSpec]:
    """Every kernel's spec: those of `kernel_packages()` in that order, then any other."""
    _load_all()
    packages = kernel_packages()

    def rank(spec: KernelSpec) -> int:
        hits = [i for i, p in enumerate(packages) if spec.package == p]
        return hits[0] if hits else len(packages)

    return sorted(dict.fromkeys(_SPECS.values()), key=rank)


# ---- what the CLI lists of a kernel without loading it ----
# A kernel package's optional ``identity`` module holds NAME (the public function's), SHORT and
# TITLE as plain strings and imports nothing: `read_identity` runs that one file without
# importing the package (whose ``__init__`` loads torch), so that `mxcli --help` lists
# ``run-<short>`` of every kernel in a fraction of a second. Its spec takes SHORT and TITLE from
# it; `register_spec` checks that all three agree with the spec.
IDENTITY = "identity"
SLICE_PARTS = ("inputs", "verification", "profile")


@dataclass(frozen=True)
class KernelIdentity:
    """A kernel as the CLI lists it: name, short name, title, package and the slice parts the
    package has (`KernelSpec.part`)."""

    name: str
    short: str
    title: str
    package: str
    parts: tuple[str, ...]

    @classmethod
    def of(cls, spec: KernelSpec) -> KernelIdentity:
        parts = tuple(p for p in SLICE_PARTS if _findable(f"{spec.package}.{p}"))
        return cls(spec.name, spec.short, spec.title, spec.package, parts)


def _findable(module: str) -> bool:
    """Whether `module` exists (its parent packages are imported, it is not)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package that is not importable
        return False


def read_identity(package: str) -> KernelIdentity | None:
    """The identity of kernel package `package` from its ``identity`` module, read without
    importing the package; None when it has none."""
    try:
        found = importlib.util.find_spec(package)  # imports the parent packages only
    except (ImportError, ValueError):
        return None
    where = None if found is None else found.submodule_search_locations
    if not where:
        return None
    finder = importlib.machinery.PathFinder
    source = finder.find_spec(f"{package}.{IDENTITY}", list(where))
    if source is None or source.loader is None:
        return None
    module = importlib.util.module_from_spec(source)  # not entered in sys.modules
    source.loader.exec_module(module)
    parts = tuple(p for p in SLICE_PARTS if finder.find_spec(f"{package}.{p}", list(where)))
    return KernelIdentity(module.NAME, module.SHORT, module.TITLE, package, parts)


def kernel_identities() -> list[KernelIdentity]:
    """Every registered kernel's identity, in the order of `all_specs`: read from the packages'
    identity modules when every package of `kernel_packages()` has one (no kernel is loaded),
    else from the loaded specs."""
    idents = [read_identity(p) for p in kernel_packages()]
    found = [i for i in idents if i is not None]
    if len(found) < len(idents):
        return [KernelIdentity.of(s) for s in all_specs()]
    packages = {i.package for i in found}
    others = [s for s in dict.fromkeys(_SPECS.values()) if s.package not in packages]
    return [*found, *(KernelIdentity.of(s) for s in others)]


def kernel_order(kernel: str | None, names: Iterable[str]) -> list[str]:
    """`names` in the order of `kernel`'s arguments and returns (unchanged for no kernel)."""
    spec = find_spec(kernel)
    return list(names) if spec is None else spec.order(names)


def read_kernel_file(path: str | os.PathLike[str]) -> TensorFile:
    """`read_file`, with the tensors in the order of the recorded kernel's arguments and
    returns (safetensors stores names sorted)."""
    from mxcli.io.files import read_file

    return read_file(path, order=kernel_order)


# --------------------------------------------------------------------------------------------
# What the shared floors call in a kernel's slice parts (modules of the kernel's package)
# --------------------------------------------------------------------------------------------


class InputsPart(Protocol):
    """``<package>.inputs``: the kernel's inputs (`mxcli.inputs` calls it).

    ``PARAMS``: the make-inputs flags. ``generate(**params)``: seeded synthetic inputs (the
    Python generator; the verification cases call it). ``from_flags(flags)``: synthetic inputs
    from make-inputs' flag values (by `InputParam.name`). Optional: ``from_layer(manifest,
    layer)`` -> (tensors, kwargs) a prepared layer supplies to a run (``run --weights``);
    ``from_weights(manifest, weights, layer, rank, flags)`` -> inputs for make-inputs
    ``--weights``; ``layer_facts(manifest, layer, rank)`` -> what a layer fixes, by flag name."""

    PARAMS: tuple[InputParam, ...]

    def generate(self, **params: Any) -> Any: ...

    def from_flags(self, flags: Mapping[str, Any]) -> Any: ...


class VerificationPart(Protocol):
    """``<package>.verification``: ``check_exact(inputs, kwargs, outputs, weights, source)`` ->
    reports against exact math; ``STRICT`` / ``HARDWARE``: output name -> `Tolerance` of each
    profile; ``CASES``: the ``verify --suite`` cases (`mxcli.verification.cases.Case`)."""

    STRICT: Mapping[str, Any]
    HARDWARE: Mapping[str, Any]
    CASES: Sequence[Any]

    def check_exact(
        self,
        inputs: Mapping[str, torch.Tensor],
        kwargs: Mapping[str, Any],
        outputs: Mapping[str, torch.Tensor],
        weights: Mapping[str, Any] | None,
        source: str,
    ) -> Any: ...


class ProfilePart(Protocol):
    """``<package>.profile``: ``PARAMS`` (the ``profile <short>`` shape flags; a None default is
    required without an input file) and ``inputs(shape)`` -> (tensors, kwargs) of that shape;
    optional ``HELP`` (the command's help), ``plan_padding(tensors, kwargs)`` and
    ``launch_kwargs(implementation, tensors, kwargs)`` (the kwargs an implementation is profiled
    with: a third-party kernel's own tuned config at the shape its authors measured)."""

    PARAMS: tuple[InputParam, ...]

    def inputs(self, shape: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]: ...


__all__ = [
    "KERNEL_PACKAGES",
    "PACKAGES_ENV",
    "InputParam",
    "IDENTITY",
    "InputsPart",
    "KernelIdentity",
    "ProfilePart",
    "VerificationPart",
    "kernel_packages",
    "show_value",
    "Implementation",
    "KernelCall",
    "KernelSpec",
    "NkiLaunch",
    "NonfiniteRule",
    "PackedOutput",
    "PaddedDims",
    "ScalarArg",
    "TensorArg",
    "ThirdParty",
    "all_specs",
    "bind_arguments",
    "find_spec",
    "get_spec",
    "kernel_identities",
    "kernel_order",
    "load_target",
    "probe_reason",
    "read_identity",
    "read_kernel_file",
    "register_spec",
]
