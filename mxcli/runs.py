"""The run pipeline of ``run-prefill`` / ``run-bwd`` / ``verify --suite``: backend and device
resolution, `run_kernel` (one call on contract-named tensors), `run_file` (read, check, pad,
run, check the outputs, un-pad, write) and `run_suite` (the case matrix of
`mxcli.verification.cases`: inputs, backend vs reference, reference vs exact math).

It sits above `mxcli.inputs`, `mxcli.verification` and `mxcli.weightprep`, and below the
commands: a run's data only flows down. What a kernel takes and returns is its `KernelSpec`
(`mxcli.kernels.spec`); files are `mxcli.io`.
"""

from __future__ import annotations

import contextlib
import os
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from mxcli.errors import InputError, MxcliError
from mxcli.fsutil import check_output_path, refuse_inputs
from mxcli.inputs import layer_run_inputs
from mxcli.io.files import TensorFile, describe_tensors, write_file
from mxcli.io.jsonfile import loads
from mxcli.io.metadata import outputs_metadata
from mxcli.kernels import backends, selection
from mxcli.kernels.spec import KernelSpec, get_spec, read_kernel_file
from mxcli.verification.cases import Case
from mxcli.verification.exact import check_exact
from mxcli.verification.finite import input_nonfinite, unexplained_nonfinite
from mxcli.verification.modes import Outcome
from mxcli.verification.policy import compare_outputs, geometry_args, profile_for_backend
from mxcli.verification.report import CaseResult
from mxcli.weightprep.manifest import load_manifest, padding_problem
from mxcli.weightprep.padding import (
    Padding,
    pad_bwd_inputs,
    pad_dims,
    pad_region_max_abs,
    unpad_bwd_outputs,
)

# --------------------------------------------------------------------------------------------
# Backend and device
# --------------------------------------------------------------------------------------------


def available_backends(kernel: str) -> list[str]:
    """Backends registered for ``kernel`` (``auto`` not included)."""
    return backends.backend_names(get_spec(kernel).name)


def resolve_backend(kernel: str, backend: str) -> str:
    """The concrete backend ``backend`` (``auto`` allowed) names for ``kernel``; a user error
    if it cannot run here."""
    name = get_spec(kernel).name
    concrete = backends.resolve_name(name, backend)
    reason = backends.unavailable_reason(name, concrete)
    if reason is not None:
        raise backends.BackendUnavailableError(
            f"backend: {concrete!r} cannot run {name} here: {reason}"
        )
    return concrete


def resolve_device(device: str) -> torch.device:
    """``cpu``, ``cuda`` or ``cuda:N``; CUDA must be available."""
    text = str(device).strip().lower()
    if not (text == "cpu" or text == "cuda" or (text.startswith("cuda:") and text[5:].isdigit())):
        raise InputError(f"device: expected cpu or cuda (cuda:N), got {device!r}")
    dev = torch.device(text)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise InputError("device: cuda requested but no CUDA device is available here")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise InputError(
                f"device: {text} requested but only {torch.cuda.device_count()} CUDA device(s) exist"
            )
    return dev


# --------------------------------------------------------------------------------------------
# One kernel call
# --------------------------------------------------------------------------------------------


@dataclass
class RunOutcome:
    """Named outputs (stored form, on the CPU) and where and how fast they were computed."""

    outputs: dict[str, torch.Tensor]
    backend: str
    device: str
    seconds: float
    # the NKI kernel that ran (`mxcli.kernels.selection.describe`; None for the reference) and,
    # on mxcli's interpreter, its reads of never-written memory, one line per kernel site
    nki_kernel: dict[str, Any] | None = None
    uninit_reads: list[str] = field(default_factory=list)


def run_kernel(
    kernel: str,
    tensors: Mapping[str, torch.Tensor],
    kwargs: Mapping[str, Any],
    *,
    backend: str = "auto",
    device: str = "cpu",
    nki_kernel: Any = None,
) -> RunOutcome:
    """Call ``kernel`` on ``backend`` with contract-named tensors and parsed kwargs.

    The arguments are validated once, into the kernel's call object, which the backend takes.
    ``device`` places the tensors for the reference backend (CPU or CUDA); other backends get
    CPU tensors and run where they run (``neuron`` on the Trainium device). ``nki_kernel``: the
    NKI kernel the sim / neuron backends run (``mxcli``, ``nkilib``, ``MODULE:FUNCTION`` or a
    `mxcli.kernels.selection.ImplementationChoice`).
    """
    import warnings

    spec = get_spec(kernel)
    resolved = backends.resolve(spec.name, resolve_backend(spec.name, backend), nki_kernel)
    name = resolved.backend
    dev = resolve_device(device)
    if name != "reference" and dev.type != "cpu":
        raise InputError(
            f"device: --device {device} applies to the reference backend only, not {name!r}"
        )
    moved = {k: v.to(dev) for k, v in tensors.items()}
    call = spec.call(moved, kwargs)
    t0 = time.perf_counter()
    with selection.recording() as launches, warnings.catch_warnings():
        # reads of never-written memory come back counted per site (RunOutcome.uninit_reads)
        warnings.filterwarnings("ignore", message=".*reads memory never written")
        result = resolved.run(call)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    seconds = time.perf_counter() - t0
    named = spec.name_outputs(call, result)
    outputs = {k: spec.stored(k, v) for k, v in named.items()}
    label = "neuron" if name == "neuron" else str(dev)
    info = None
    if name in ("sim", "neuron"):
        info = (
            launches[-1].kernel
            if launches
            else selection.describe(selection.parse_implementation(nki_kernel, spec))
        )
    return RunOutcome(
        outputs=outputs,
        backend=name,
        device=label,
        seconds=seconds,
        nki_kernel=info,
        uninit_reads=[str(r) for launch in launches for r in launch.uninit_reads],
    )


def check_inputs(
    spec: KernelSpec,
    tensors: Mapping[str, torch.Tensor],
    source: str,
    *,
    allow_nonfinite: bool = False,
) -> None:
    """Names, stored dtypes and (unless allowed) finiteness of a run's input tensors."""

    def finite(name: str, t: torch.Tensor) -> None:
        nan, inf = input_nonfinite(name, t, spec.nonfinite.x4_inputs)  # x4 words: NaN codes
        if nan or inf:
            raise InputError(
                f"{name}: contains {nan} NaN and {inf} Inf value(s) "
                "(pass --allow-nonfinite to run anyway)"
            )

    spec.check_tensors(tensors, source, each=None if allow_nonfinite else finite)


# --------------------------------------------------------------------------------------------
# Zero-padded prepared weights: the activations padded to them, the results cut back
# --------------------------------------------------------------------------------------------


def recorded_padding(
    spec: KernelSpec, f: TensorFile, weights: str | os.PathLike[str] | None
) -> Padding | None:
    """The zero padding of prepared weights: from the ``--weights`` manifest, else as recorded
    by ``make-inputs --weights``; None when nothing is padded. The hidden states must have the
    true or the padded H it gives (outputs are cut to the true sizes: a padding that does not
    describe the file would cut real values)."""
    pad = None
    if weights is not None:
        pad = load_manifest(Path(weights)).padding()
    else:
        gen = f.meta_json("generator")
        if isinstance(gen, Mapping) and isinstance(gen.get("padding"), Mapping):
            try:
                pad = Padding.from_dict(gen["padding"])
            except (KeyError, TypeError, ValueError):
                raise InputError(f"{f.path}: __metadata__ generator.padding is malformed") from None
    if pad is None or not pad.any:
        return None
    where = f"the --weights manifest {weights}" if weights else f"{f.path}'s generator.padding"
    problem = padding_problem(pad, "padding")
    if problem is not None:
        raise InputError(f"{f.path}: {problem}, in {where}")
    hs = f.tensors.get(spec.tokens) if spec.tokens is not None else None
    H = pad.hidden_size
    padded = getattr(pad, spec.padded.hidden) if spec.padded is not None else H
    if hs is not None and hs.dim():
        if int(hs.shape[-1]) not in (H, padded):
            raise InputError(
                f"{spec.tokens}: expected H {H} (padded {padded}) as {where} says, "
                f"got {int(hs.shape[-1])}"
            )
        if int(hs.shape[-1]) > H and bool(hs[..., H:].any()):
            raise InputError(
                f"{spec.tokens}: not zero past column {H}, where {where} says it is padding"
            )
    return pad


def _shared_for(spec: KernelSpec, tensors: Mapping[str, torch.Tensor], pad: Padding) -> bool | None:
    """Whether the run's weights are the routed (False) or the shared (True) expert stack of
    `pad`; None when their I is neither (the padding does not describe them)."""
    of = spec.padded.intermediate_of if spec.padded is not None else None
    i = of(tensors) if of is not None else None
    if i is not None and i == pad.padded_intermediate_size:
        return False
    if i is not None and i == pad.padded_shared_intermediate_size:
        return True
    return None


def pad_hidden(
    tensors: Mapping[str, torch.Tensor], dims: Mapping[str, Mapping[int, str]], size: int
) -> dict[str, torch.Tensor]:
    """`tensors` with each H dim of `dims` (`PaddedDims.inputs`) smaller than `size` zero-padded
    to it (an H dim of `size` or more is left as it is)."""
    out = dict(tensors)
    for name, which in dims.items():
        t = tensors.get(name)
        if t is not None and t.dim():
            grow = {d % t.dim(): size for d, k in which.items() if k == "H" and t.shape[d] < size}
            if grow:
                out[name] = pad_dims(t, grow)
    return out


def pad_run_inputs(
    spec: KernelSpec, tensors: Mapping[str, torch.Tensor], pad: Padding
) -> dict[str, torch.Tensor]:
    """A run's activations at the model's true sizes, zero-padded to the prepared weights'."""
    if spec.padded is None:
        return dict(tensors)
    if spec.padded.intermediate_of is None:  # H alone is padded: grow it to the kernel's H
        return pad_hidden(tensors, spec.padded.inputs, getattr(pad, spec.padded.hidden))
    shared = _shared_for(spec, tensors, pad)
    return dict(tensors) if shared is None else pad_bwd_inputs(tensors, pad, shared)


def unpad_run_outputs(
    spec: KernelSpec,
    outputs: Mapping[str, torch.Tensor],
    tensors: Mapping[str, torch.Tensor],
    pad: Padding,
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """``(outputs, metadata)`` of a padded run.

    Kernels whose results are cut back (the backward's gradients: `PaddedDims.unpad_outputs`):
    the outputs at the true H and I_TP, with ``pad_max_abs`` (the largest ``|value|`` found in
    the dropped pad rows and columns: 0.0 when the padding was exact, which `verify` checks).
    Others (prefill): the outputs as the kernel wrote them (the next kernel reads them padded).
    """
    meta: dict[str, Any] = {**pad.to_dict()}
    unpads = spec.padded is not None and spec.padded.unpad_outputs
    if unpads:
        shared = _shared_for(spec, tensors, pad)
        if shared is not None:
            meta.update(
                outputs="unpadded",
                expert_stack="shared" if shared else "routed",
                pad_max_abs=pad_region_max_abs(outputs, pad, shared),
            )
            return unpad_bwd_outputs(outputs, pad, shared), meta
    meta["outputs"] = (
        "as computed (the weights do not match the recorded padding)"
        if unpads
        else f"padded: H columns past unpadded_hidden_size={pad.hidden_size} are padding"
    )
    return dict(outputs), meta


# --------------------------------------------------------------------------------------------
# A run on files
# --------------------------------------------------------------------------------------------


def _merge_objects(spec: KernelSpec, layers: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A kwarg given as a JSON object (`ScalarArg.file`: the backward's ``config``) in later
    layers updates that of earlier ones field by field."""
    out = [dict(layer) for layer in layers]
    for name in (s.name for s in spec.scalars if s.file is not None):
        merged: dict[str, Any] | None = None
        for layer in out:
            value = layer.get(name)
            if isinstance(value, str):
                value = loads(value, name)
            if isinstance(value, Mapping):
                merged = _deep_merge(merged or {}, value)
                layer[name] = merged
    return out


def _deep_merge(base: Mapping[str, Any], top: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in top.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), Mapping):
            out[k] = _deep_merge(out[k], v)
        else:
            out[k] = v
    return out


def run_file(
    kernel: str,
    input_path: str | os.PathLike[str],
    output_path: str | os.PathLike[str],
    *,
    overrides: Mapping[str, Any] | None = None,
    backend: str = "auto",
    device: str = "cpu",
    weights: str | os.PathLike[str] | None = None,
    layer: int | None = None,
    allow_nonfinite: bool = False,
    force: bool = False,
    step: Callable[[str], Any] | None = None,
    verify_hashes: bool = True,
    nki_kernel: Any = None,
) -> dict[str, Any]:
    """``run-prefill`` / ``run-bwd``: read, check, run, write; returns a JSON-ready summary.

    The ``--weights`` layer is checked against its manifest (shapes, zero padding and, unless
    not `verify_hashes`, sha256: `mxcli.weightprep.manifest`).

    Kwargs: kernel defaults < the ``--weights`` manifest < the input file's metadata <
    ``overrides`` (the flags). Every check runs before the kernel, and the output is written
    atomically, so a failed run leaves no output file.
    """
    step = step or (lambda _d: contextlib.nullcontext())
    spec = get_spec(kernel)
    kernel = spec.name
    out = check_output_path(output_path, force)
    refuse_inputs(out, [("input", input_path)], [("--weights folder", weights)])
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    with step(f"Reading {input_path}"):
        f = read_kernel_file(input_path)
        if f.kernel not in (None, kernel):
            raise InputError(f"{f.path}: input file is for {f.kernel}, not {kernel}")
        tensors = dict(f.tensors)
        layers: list[dict[str, Any]] = []
        pad = recorded_padding(spec, f, weights)
        if weights is not None:
            if layer is None:
                raise InputError("layer: --weights needs --layer L")
            w_tensors, w_kwargs = layer_run_inputs(
                kernel, weights, layer, verify_hashes=verify_hashes
            )
            both = sorted(set(w_tensors) & set(tensors))
            if both:
                raise InputError(
                    f"{f.path}: tensor(s) {', '.join(both)} given both in the file and by --weights"
                )
            tensors.update(w_tensors)
            layers.append(w_kwargs)
        elif layer is not None:
            raise InputError("layer: --layer needs --weights DIR")
        layers.append(spec.metadata_kwargs(f.metadata))
        layers.append({k: v for k, v in (overrides or {}).items() if v is not None})
        if pad is not None:  # prepared weights are zero-padded: pad the activations to match
            tensors = pad_run_inputs(spec, tensors, pad)
        check_inputs(spec, tensors, str(f.path), allow_nonfinite=allow_nonfinite)
        kwargs = spec.resolve_kwargs(*_merge_objects(spec, layers))
    timings["read"] = time.perf_counter() - t0
    with step(f"Running {kernel} on {backend}"):
        outcome = run_kernel(
            kernel, tensors, kwargs, backend=backend, device=device, nki_kernel=nki_kernel
        )
    timings["run"] = outcome.seconds
    # checked at the kernel's (padded) sizes, where inputs and outputs line up
    nonfinite = unexplained_nonfinite(kernel, tensors, outcome.outputs, kwargs)
    outputs, extra = outcome.outputs, spec.geometry(tensors)
    if pad is not None:  # bwd gradients are cut back to the model's sizes
        outputs, extra["padding"] = unpad_run_outputs(spec, outputs, tensors, pad)
    if outcome.nki_kernel is not None:
        extra["nki_kernel"] = outcome.nki_kernel
    if outcome.uninit_reads:
        extra["uninit_reads"] = outcome.uninit_reads
    t1 = time.perf_counter()
    with step(f"Writing {out}"):
        meta = outputs_metadata(
            kernel,
            spec.dump_kwargs(kwargs),
            backend=outcome.backend,
            device=outcome.device,
            inputs=tensors,
            input_file=str(f.path.name),
            extra=extra,
        )
        write_file(out, outputs, meta, force=force)
    timings["write"] = time.perf_counter() - t1
    return {
        "kernel": kernel,
        "input": str(f.path),
        "output": str(out),
        "backend": outcome.backend,
        "device": outcome.device,
        "kwargs": spec.dump_kwargs(kwargs),
        "outputs": describe_tensors(outputs),
        "nonfinite": nonfinite,  # output -> NaN/Inf count the inputs do not explain
        **({"nki_kernel": outcome.nki_kernel} if outcome.nki_kernel is not None else {}),
        **({"uninit_reads": outcome.uninit_reads} if outcome.uninit_reads else {}),
        "timing_s": {k: round(v, 6) for k, v in timings.items()},
        **({"padding": extra["padding"]} if "padding" in extra else {}),
    }


# --------------------------------------------------------------------------------------------
# ``verify --suite``: for every case, generate inputs, run the backend, compare with the
# reference, and check the reference against independent exact math
# --------------------------------------------------------------------------------------------


def resolve_backends(backend: str, cases: Sequence[Case]) -> dict[str, str]:
    """The concrete backend per kernel of ``cases``; raises a user error if one cannot run."""
    return {
        kernel: resolve_backend(kernel, backend) for kernel in sorted({c.kernel for c in cases})
    }


def run_case(
    case: Case, backend: str, *, device: str = "cpu", nki_kernel: Any = None
) -> CaseResult:
    """One case: inputs, reference (on ``device``), backend vs reference, reference vs exact.

    ``nki_kernel``: the NKI kernel the sim / neuron backend runs (`mxcli.kernels.selection`); a
    combination it refuses marks the case skipped ("not supported by this kernel")."""
    result = CaseResult(case=case.name, kernel=case.kernel)
    t0 = time.perf_counter()
    try:
        inputs = case.make()
        spec = get_spec(case.kernel)
        kwargs = spec.resolve_kwargs(inputs.kwargs)
        ref = run_kernel(case.kernel, inputs.tensors, kwargs, backend="reference", device=device)
        result.info["reference_s"] = round(ref.seconds, 4)
        geometry = geometry_args(spec.geometry(inputs.tensors).get("geometry"))
        if backend != "reference":
            try:
                got = run_kernel(
                    case.kernel, inputs.tensors, kwargs, backend=backend, nki_kernel=nki_kernel
                )
            except selection.KernelUnsupportedError as exc:
                result.skipped = f"not supported by this kernel: {exc}"
                result.seconds = time.perf_counter() - t0
                return result
            result.info[f"{backend}_s"] = round(got.seconds, 4)
            if got.nki_kernel is not None:
                result.info["nki_kernel"] = got.nki_kernel.get("kernel")
            if got.uninit_reads:
                result.info["uninit_reads"] = got.uninit_reads
            result.reports += compare_outputs(
                case.kernel, got.outputs, ref.outputs, kwargs,
                profile=profile_for_backend(backend), check=f"{backend} vs reference", **geometry,
            )  # fmt: skip
        else:
            result.info["note"] = "backend is the reference: only the exact-math check applies"
        result.reports += check_exact(
            case.kernel, inputs.tensors, kwargs, ref.outputs, weights=inputs.extras.get("weights")
        )
    except MxcliError as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    except Exception as exc:  # a backend bug fails its case, not the whole suite
        result.error = f"{type(exc).__name__}: {exc}"
        result.info["traceback"] = _traceback()
    result.seconds = time.perf_counter() - t0
    return result


def _traceback() -> str:
    return traceback.format_exc(limit=8)


def run_suite(
    cases: Sequence[Case],
    backend: str = "auto",
    *,
    device: str = "cpu",
    on_case: Callable[[Case, CaseResult | None], None] | None = None,
    nki_kernel: Any = None,
) -> list[CaseResult]:
    """Run ``cases`` on ``backend`` (``auto`` allowed); ``on_case`` is told before and after each.

    ``nki_kernel``: the NKI kernel (``mxcli``, ``nkilib``, ``MODULE:FUNCTION``), or a mapping
    kernel -> choice or the reason it cannot run that kernel's cases
    (`mxcli.kernels.selection.resolve_for`: a choice or a `NotRunnable`, whose kernel's cases
    are skipped with its reason)."""
    names = resolve_backends(backend, cases)
    results = []
    for case in cases:
        if on_case is not None:
            on_case(case, None)
        choice = nki_kernel.get(case.kernel) if isinstance(nki_kernel, dict) else nki_kernel
        if isinstance(choice, selection.NotRunnable):
            res = CaseResult(case=case.name, kernel=case.kernel, skipped=choice.reason)
        else:
            res = run_case(case, names[case.kernel], device=device, nki_kernel=choice)
        res.info["backend"] = names[case.kernel]
        results.append(res)
        if on_case is not None:
            on_case(case, res)
    return results


def verify_suite(
    suite: str,
    cases: Sequence[Case],
    *,
    backend: str = "auto",
    device: str = "cpu",
    kernel: str = "mxcli",
    kernel_path: str | None = None,
    on_case: Callable[[Case, CaseResult | None], None] | None = None,
) -> Outcome:
    """``verify --suite``: `cases` (of `suite`, `mxcli.verification.cases.select`) on `backend`
    with NKI kernel `kernel`, as an `Outcome` (`mxcli.verification.modes`; it lives here, not
    there, because it runs kernels). The device, the backends and the kernel are checked
    before the first case runs: a bad one is a user error, not a failed suite."""
    resolve_device(device)
    names = resolve_backends(backend, cases)
    kernels = sorted({c.kernel for c in cases})
    for k in kernels:  # a non-default kernel needs a backend that runs NKI kernels
        selection.backend_kwargs(
            selection.parse_implementation(kernel, k, kernel_path), names[k], k
        )
    choices = selection.resolve_for(kernel, kernels, kernel_path)
    described = {
        k: selection.describe(c)
        for k, c in choices.items()
        if isinstance(c, selection.ImplementationChoice)
    }
    results = run_suite(cases, backend, device=device, on_case=on_case, nki_kernel=choices)
    title = f"mxcli verify --suite {suite} (backend: {', '.join(sorted(set(names.values())))})"
    if kernel != selection.MXCLI or any(n in ("sim", "neuron") for n in names.values()):
        title += "; " + "; ".join(
            f"kernel: {selection.describe_line(info)}" for info in described.values()
        )
    reads = [f"{r.case}: {line}" for r in results for line in r.info.get("uninit_reads", ())]
    fields = {
        "mode": "suite",
        "suite": suite,
        "backends": names,
        "device": device,
        "nki_kernels": described,
        "uninit_reads": reads,
    }
    return Outcome(
        results, title, fields, [f"never-written memory read at {line}" for line in reads]
    )


__all__ = [
    "RunOutcome",
    "resolve_backends",
    "run_case",
    "run_suite",
    "verify_suite",
    "available_backends",
    "check_inputs",
    "pad_run_inputs",
    "recorded_padding",
    "resolve_backend",
    "resolve_device",
    "run_file",
    "run_kernel",
    "unpad_run_outputs",
]
