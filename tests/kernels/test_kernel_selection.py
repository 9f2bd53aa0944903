"""``--kernel mxcli|nkilib|MODULE:FUNCTION`` (issue 20): parsing, loading, the launch adapted to
a third-party kernel, and third-party kernels written at test time (a fork of mxcli's NKI kernel
under another module path, and mutated forks with one deliberate bug each) that verify must
pass and fail, naming the tensor and the index. Fresh processes where the CLI is the subject."""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import importlib.util
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from mxcli.errors import InputError
from mxcli.kernels import launcher, selection
from mxcli.kernels.selection import ImplementationChoice, KernelLoadError, KernelUnsupportedError
from tests.kernels.forks import SCALE_TOKEN, SWAP_TOKEN, write_prefill_fork

PREFILL, BWD = "rmsnorm_mx_prefill", "blockwise_mm_bwd_mxfp8"
NKILIB_IMPORTABLE = importlib.util.find_spec("nkilib") is not None


def _inputs(**params):
    from mxcli.kernels.rmsnorm_mx_prefill import inputs as prefill_inputs
    from mxcli.kernels.spec import get_spec

    ki = prefill_inputs.make_prefill_inputs(**params)
    return ki.tensors, get_spec(PREFILL).resolve_kwargs(ki.kwargs)


def _run(tensors, kwargs, backend="sim", nki_kernel=None):
    from mxcli.runs import run_kernel

    return run_kernel(PREFILL, tensors, kwargs, backend=backend, nki_kernel=nki_kernel)


@pytest.fixture(scope="module")
def forks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, ImplementationChoice]:
    root = tmp_path_factory.mktemp("forks")
    specs = {
        "good": write_prefill_fork(root, "mxfork_good"),
        "scale": write_prefill_fork(root, "mxfork_scale", "scale"),
        "swap": write_prefill_fork(root, "mxfork_swap", "swap"),
    }
    return {k: selection.parse_implementation(v, PREFILL, root) for k, v in specs.items()}


# ---- parsing and loading ------------------------------------------------------------------


def test_parse_kernel_forms(tmp_path: Path) -> None:
    assert selection.parse_implementation(None, PREFILL).is_own
    own = selection.parse_implementation("mxcli", BWD)
    assert (own.kind, own.kernel) == ("mxcli", BWD)
    nk = selection.parse_implementation("nkilib", PREFILL)
    assert (nk.kind, nk.module, nk.function) == (
        "nkilib",
        "nkilib.core.rmsnorm",
        "rmsnorm_mx_prefill",
    )
    mod = selection.parse_implementation("my.fork:kern", BWD, tmp_path)
    assert (mod.kind, mod.module, mod.function, mod.path) == (
        "module",
        "my.fork",
        "kern",
        str(tmp_path),
    )
    for bad in ("my.fork", "my fork:k", "pkg:", ":fn", "a..b:c"):
        with pytest.raises(InputError, match="expected mxcli, nkilib or MODULE:FUNCTION"):
            selection.parse_implementation(bad, PREFILL)
    with pytest.raises(InputError, match="is not a folder"):
        selection.parse_implementation("nkilib", PREFILL, tmp_path / "missing")


def test_missing_module_is_one_line_naming_how_to_install() -> None:
    choice = selection.parse_implementation(
        "mxcli_no_such_fork.prefill:rmsnorm_mx_prefill", PREFILL
    )
    with pytest.raises(KernelLoadError) as exc:
        selection.load(choice)
    msg = str(exc.value)
    assert "'mxcli_no_such_fork' is not importable" in msg and "PYTHONPATH" in msg
    assert "\n" not in msg


def test_describe_names_module_file_and_sha256(forks: dict[str, ImplementationChoice]) -> None:
    info = selection.describe(forks["good"])
    path = Path(info["file"])
    assert path.name == "prefill.py" and path.parent.name == "mxfork_good"
    assert info["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
    assert (info["kernel"], info["name"], info["module"]) == (
        forks["good"].label,
        "rmsnorm_mx_prefill",
        "mxfork_good.prefill",
    )
    own = selection.describe(selection.parse_implementation("mxcli", PREFILL))
    assert own["module"] == "mxcli.kernels.rmsnorm_mx_prefill.nki_kernel" and own["sha256"]


@pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")
def test_git_commit_is_the_checkout_s_head(tmp_path: Path) -> None:
    """``commit`` in describe(): git's own answer (``git rev-parse HEAD``) for the folder of the
    kernel's file, also for a file in a subfolder of the checkout; None outside a checkout."""
    (tmp_path / "pkg").mkdir()
    f = tmp_path / "pkg" / "k.py"
    f.write_text("")
    assert selection._git_commit(str(f)) is None  # not in a checkout
    env = {
        "GIT_AUTHOR_NAME": "t",
        "GIT_AUTHOR_EMAIL": "t@t",
        "GIT_COMMITTER_NAME": "t",
        "GIT_COMMITTER_EMAIL": "t@t",
        "PATH": os.environ.get("PATH", ""),
        "HOME": str(tmp_path),
    }

    def git(*args: str) -> str:
        done = subprocess.run(
            ["git", "-C", str(tmp_path), *args], env=env, capture_output=True, text=True
        )
        assert done.returncode == 0, done.stderr
        return done.stdout.strip()

    git("init", "-q")
    git("add", "pkg/k.py")
    git("commit", "-q", "-m", "one")
    first = git("rev-parse", "HEAD")
    assert len(first) == 40 and selection._git_commit(str(f)) == first
    git("pack-refs", "--all")  # the ref now lives in packed-refs only
    f.write_text("x = 1\n")
    git("commit", "-q", "-am", "two")
    second = git("rev-parse", "HEAD")
    assert second != first and selection._git_commit(str(f)) == second


def test_reference_backend_refuses_a_third_party_kernel(
    forks: dict[str, ImplementationChoice],
) -> None:
    tensors, kwargs = _inputs(seq=8, hidden=512, experts=None, seed=1)
    with pytest.raises(InputError, match="backend 'reference' runs mxcli's torch reference"):
        _run(tensors, kwargs, backend="reference", nki_kernel=forks["good"])


# ---- the launch adapts to the kernel ------------------------------------------------------


def test_fork_runs_with_its_own_enum_and_equals_mxcli_kernel(
    forks: dict[str, ImplementationChoice],
) -> None:
    # SOFTMAX routes through the fork's own RouterActFnType (by member name), bit for bit
    tensors, kwargs = _inputs(
        seq=8, hidden=512, experts=8, top_k=2, seed=3, router_act_fn="SOFTMAX"
    )
    mine = _run(tensors, kwargs)
    fork = _run(tensors, kwargs, nki_kernel=forks["good"])
    assert fork.nki_kernel is not None and fork.nki_kernel["module"] == "mxfork_good.prefill"
    assert mine.nki_kernel is not None and mine.nki_kernel["kernel"] == "mxcli"
    assert fork.uninit_reads == []  # mxcli's kernel writes what it reads
    assert list(fork.outputs) == list(mine.outputs)
    for name in mine.outputs:
        assert torch.equal(
            fork.outputs[name].view(torch.uint8), mine.outputs[name].view(torch.uint8)
        ), name


def test_mxcli_only_argument_is_refused_by_name(forks: dict[str, ImplementationChoice]) -> None:
    tensors, kwargs = _inputs(seq=8, hidden=512, experts=None, seed=1)
    with pytest.raises(KernelUnsupportedError, match="hidden_interleaved=True"):
        _run(tensors, {**kwargs, "hidden_interleaved": True}, nki_kernel=forks["good"])


def test_known_refusal_is_reported_before_launching() -> None:
    """nkilib's prefill asserts NOAUX_TC + pack_affinities away; mxcli says so up front."""
    from mxcli.kernels.rmsnorm_mx_prefill.contract import RouterActFnType

    args = {
        "router_weights": torch.zeros(1),
        "router_act_fn": RouterActFnType.NOAUX_TC,
        "pack_affinities": True,
    }
    from mxcli.kernels.spec import get_spec

    refusal = get_spec(PREFILL).implementations["nkilib"].refusal  # the spec's registration
    assert refusal is not None
    why = refusal(args)
    assert why is not None and "NOAUX_TC with pack_affinities" in why
    assert refusal({**args, "pack_affinities": False}) is None


def test_kernel_assert_is_a_refusal_and_hardware_rules_are_not() -> None:
    from mxcli.nkisim import NkiValidationError

    assert selection.is_kernel_refusal(
        AssertionError("[INTERNAL_ERROR] Kernel validation exception: x")
    )
    assert not selection.is_kernel_refusal(NkiValidationError("nc_matmul: stationary too wide"))
    text = "[INTERNAL_ERROR] [NCC_INKI016] Kernel validation exception: top_k (9) must be <= 8 - Please check"
    assert launcher._short(text) == "top_k (9) must be <= 8"


# ---- the bwd config as the module's own class -----------------------------------------------


class _Opt(enum.Enum):
    SHARD_ON_FREE = 0
    SHARD_ON_HIDDEN = 1


class _Quant(enum.Enum):
    WRAPX = "wrapX"
    _1x32 = "1x32"


@dataclasses.dataclass
class _TheirPhase:
    """A module's own phase config: mxcli's fields it has, by name, and one it lacks (tile_n)."""

    M: int = 0
    tile_k: int | None = None
    quant_scheme: _Quant = _Quant.WRAPX
    enable_scale_packing: bool = False
    spill_reload: bool = False


@dataclasses.dataclass
class _TheirConfig:
    shard_option: _Opt = _Opt.SHARD_ON_FREE
    accumulate_hidden_states_grad: bool = True
    phase1_config: _TheirPhase = dataclasses.field(default_factory=_TheirPhase)
    phase2_config: _TheirPhase = dataclasses.field(default_factory=_TheirPhase)
    phase3_config: _TheirPhase = dataclasses.field(default_factory=_TheirPhase)
    phase4_config: _TheirPhase = dataclasses.field(default_factory=_TheirPhase)


def test_module_config_rebuilds_fields_by_name_and_names_a_missing_one() -> None:
    from mxcli.kernels.blockwise_moe import MXFP8MOEBwdConfig
    from mxcli.kernels.blockwise_moe.config import MatmulMxfp8KernelConfig
    from mxcli.kernels.blockwise_moe.nkilib import rebuild

    theirs = rebuild(MXFP8MOEBwdConfig(), _TheirConfig, "config")
    assert isinstance(theirs, _TheirConfig)
    # enums by member name into the module's own enum; mxcli's values, not the module's defaults
    assert theirs.shard_option is _Opt.SHARD_ON_FREE
    assert theirs.accumulate_hidden_states_grad is False
    p1 = theirs.phase1_config  # mxcli fills the phase configs: rebuilt as the module's class
    assert isinstance(p1, _TheirPhase) and (p1.enable_scale_packing, p1.spill_reload) == (
        True,
        True,
    )
    nested = MXFP8MOEBwdConfig(phase1_config=MatmulMxfp8KernelConfig(tile_k=256))
    built = rebuild(nested, _TheirConfig, "config").phase1_config
    assert (built.tile_k, built.quant_scheme) == (256, _Quant.WRAPX)
    with pytest.raises(
        KernelUnsupportedError, match=r"config\.phase1_config\.tile_n: .*no field tile_n"
    ):
        rebuild(
            MXFP8MOEBwdConfig(phase1_config=MatmulMxfp8KernelConfig(tile_n=128)),
            _TheirConfig,
            "config",
        )
    with pytest.raises(
        KernelUnsupportedError, match=r"config\.single_expert_dense: .*no field single_expert_dense"
    ):
        rebuild(
            MXFP8MOEBwdConfig(single_expert_dense=False, accumulate_hidden_states_grad=True),
            _TheirConfig,
            "config",
        )


# ---- verify: the fork passes, the mutated forks fail naming tensor and index ----------------


def test_mutated_forks_fail_naming_the_tensor_and_the_index(
    forks: dict[str, ImplementationChoice],
) -> None:
    from mxcli.verification.policy import compare_outputs

    tensors, kwargs = _inputs(
        seq=8, hidden=512, experts=8, top_k=2, seed=3, router_act_fn="SOFTMAX"
    )
    ref = _run(tensors, kwargs, backend="reference").outputs
    geometry = {"hidden": 512, "num_experts": 8}
    good = compare_outputs(
        PREFILL, _run(tensors, kwargs, nki_kernel=forks["good"]).outputs, ref, kwargs, **geometry
    )
    assert all(r.passed for r in good), [str(r) for r in good if not r.passed]
    for which, tensor, index in (
        ("scale", "norm_quant_packed.scales", [SCALE_TOKEN, 0]),
        ("swap", "expert_index", [SWAP_TOKEN, 0]),
    ):
        reports = compare_outputs(
            PREFILL, _run(tensors, kwargs, nki_kernel=forks[which]).outputs, ref, kwargs, **geometry
        )
        failed = {r.name: r for r in reports if not r.passed}
        assert tensor in failed, (which, sorted(failed))
        assert f"first mismatch at {index}" in failed[tensor].message
        assert "norm_quant_packed.codes" not in failed  # one deliberate bug, nothing else


def test_neuron_backend_names_the_chosen_kernel_when_unavailable(
    forks: dict[str, ImplementationChoice],
) -> None:
    from mxcli.kernels import nki_runtime
    from mxcli.kernels.backends import BackendUnavailableError

    if nki_runtime.neuron_unavailable_reason() is None:
        pytest.skip("a Trainium host: the neuron backend can run")

    tensors, kwargs = _inputs(seq=8, hidden=512, experts=None, seed=1)
    # the same launch path as mxcli's kernels: detection first, naming the chosen kernel
    fork = r"mxfork_good\.prefill:rmsnorm_mx_prefill's rmsnorm_mx_prefill"
    with pytest.raises(BackendUnavailableError, match=rf"cannot run {fork} here: missing .*nki"):
        launcher.run_neuron(PREFILL, **tensors, **kwargs, implementation=forks["good"])
    with pytest.raises(
        BackendUnavailableError, match=r"cannot run nkilib's blockwise_mm_bwd_mxfp8"
    ):
        launcher.run_neuron(BWD, *([None] * 7), implementation="nkilib")


def test_third_party_bwd_gets_its_own_config_and_api_arguments(tmp_path: Path) -> None:
    """The bwd launch: API argument names, int32 ids, num_valid_tokens as a [1] tensor, and
    mxcli's MXFP8MOEBwdConfig rebuilt as the module's own class (its kernel asserts on it)."""
    from mxcli.kernels.blockwise_moe import blockwise_mm_bwd_mxfp8
    from mxcli.kernels.blockwise_moe import inputs as bwd_inputs
    from mxcli.kernels.spec import get_spec
    from tests.kernels.forks import write_bwd_kernel

    spec = selection.parse_implementation(write_bwd_kernel(tmp_path, "mxbwd_third"), BWD, tmp_path)
    ki = bwd_inputs.make_bwd_inputs(
        tokens=128,
        hidden=256,
        intermediate=128,
        experts=1,
        top_k=1,
        block_size=128,
        dense=True,
        seed=2,
    )
    kw = get_spec(BWD).resolve_kwargs(ki.kwargs)
    cfg = kw.pop("config")
    with selection.recording() as launches:
        out = blockwise_mm_bwd_mxfp8(
            **ki.tensors, **kw, config=cfg, num_valid_tokens=100, backend="sim", kernel=spec
        )
    assert [tuple(o.shape) for o in out] == [(128, 256), (128, 1), (1, 256, 2, 128), (1, 128, 256)]
    # block_size and num_valid_tokens arrived; no pre-quantized weights here
    assert out[1][:3, 0].tolist() == [128.0, 100.0, 0.0]
    assert launches and launches[0].kernel["module"] == "mxbwd_third.bwd"
    # a field the module lacks, set away from mxcli's default, is an error naming it
    with pytest.raises(KernelUnsupportedError, match=r"config\.fast_dma_transpose: .*no field"):
        fast = dataclasses.replace(cfg, fast_dma_transpose=True)
        blockwise_mm_bwd_mxfp8(**ki.tensors, **kw, config=fast, backend="sim", kernel=spec)
    # the kernel's own assert on a config value it refuses: "not supported", not a crash
    with pytest.raises(KernelUnsupportedError, match="refused this launch: no skipped init"):
        skip = dataclasses.replace(cfg, skip_grad_initialization=True)
        blockwise_mm_bwd_mxfp8(**ki.tensors, **kw, config=skip, backend="sim", kernel=spec)


def _bwd_case(dense: bool = False):
    from mxcli.kernels.blockwise_moe import inputs as bwd_inputs
    from mxcli.kernels.spec import get_spec

    ki = bwd_inputs.make_bwd_inputs(
        tokens=128,
        hidden=256,
        intermediate=128,
        experts=1,
        top_k=1,
        block_size=128,
        dense=dense,
        seed=2,
    )
    kw = get_spec(BWD).resolve_kwargs(ki.kwargs)
    return ki.tensors, kw, kw.pop("config")


def test_entry_without_config_gets_the_config_as_its_own_keywords(tmp_path: Path) -> None:
    """Issue 29: an entry point with no ``config`` parameter (an older nkilib entry takes the
    knobs as keyword arguments) used to run on its own defaults, mxcli's config dropped without
    a word. The config is now mapped onto its keywords; what it cannot take is refused."""
    from mxcli.kernels.blockwise_moe import MXFP8MOEBwdConfig, blockwise_mm_bwd_mxfp8
    from mxcli.kernels.blockwise_moe.config import MatmulMxfp8KernelConfig, SkipMode
    from tests.kernels.forks import write_bwd_kernel

    spec = selection.parse_implementation(
        write_bwd_kernel(tmp_path, "mxbwd_kw", "kwargs"), BWD, tmp_path
    )
    tensors, kw, cfg = _bwd_case()
    cfg = MXFP8MOEBwdConfig.routed(top_k=1, phase1_config=MatmulMxfp8KernelConfig(tile_k=256))
    assert cfg.skip_dma == SkipMode(skip_token=True) and not cfg.accumulate_hidden_states_grad
    out = blockwise_mm_bwd_mxfp8(**tensors, **kw, config=cfg, backend="sim", kernel=spec)
    # [block_size, skip_token, accumulate, phase-1 tile_k, shard_option, compute bf16, dense,
    # output-grad swizzle]: mxcli's values, not the entry's defaults (skip_dma None, accumulate
    # True, float32)
    assert out[1][:8, 0].tolist() == [128.0, 1.0, 0.0, 256.0, 0.0, 1.0, 0.0, 0.0]
    dense = MXFP8MOEBwdConfig()  # mxcli's default: single-expert dense, PE swizzles
    tensors_d, kw_d, _ = _bwd_case(dense=True)
    out = blockwise_mm_bwd_mxfp8(**tensors_d, **kw_d, config=dense, backend="sim", kernel=spec)
    assert out[1][:8, 0].tolist()[5:] == [1.0, 1.0, 1.0]
    # a config field the entry has no keyword for, away from mxcli's default: refused by name
    with pytest.raises(
        KernelUnsupportedError,
        match=r"config\.fast_dma_transpose=True has no keyword in the entry point "
        r"mxbwd_kw\.bwd\.blockwise_mm_bwd_mxfp8",
    ):
        fast = dataclasses.replace(cfg, fast_dma_transpose=True)
        blockwise_mm_bwd_mxfp8(**tensors, **kw, config=fast, backend="sim", kernel=spec)
    # an API argument the entry has no parameter for, set: refused, not dropped
    with pytest.raises(
        KernelUnsupportedError,
        match=r"num_valid_tokens is set but the entry point mxbwd_kw\.bwd\.blockwise_mm_bwd_mxfp8 "
        r"has no parameter num_valid_tokens",
    ):
        blockwise_mm_bwd_mxfp8(
            **tensors_d, **kw_d, config=dense, num_valid_tokens=100, backend="sim", kernel=spec
        )


def test_entry_without_config_or_its_knobs_refuses_the_config(tmp_path: Path) -> None:
    from mxcli.kernels.blockwise_moe import blockwise_mm_bwd_mxfp8
    from tests.kernels.forks import write_bwd_kernel

    spec = selection.parse_implementation(
        write_bwd_kernel(tmp_path, "mxbwd_bare", "bare"), BWD, tmp_path
    )
    tensors, kw, cfg = _bwd_case()
    with pytest.raises(
        KernelUnsupportedError,
        match=r"config is set but the entry point mxbwd_bare\.bwd\.blockwise_mm_bwd_mxfp8 has no "
        r"parameter config",
    ):
        blockwise_mm_bwd_mxfp8(**tensors, **kw, config=cfg, backend="sim", kernel=spec)


def test_prequantized_bwd_weights_reach_a_third_party_kernel_as_x4(tmp_path: Path) -> None:
    """Issue 29: pre-quantized weights are uint32 x4 words; a third-party kernel (AWS's reads
    'x4' in str(dtype)) must see the interpreter's x4 dtype, else it treats them as unpacked fp8
    (AWS's backward then returned NaN gradients)."""
    from mxcli.kernels.blockwise_moe import blockwise_mm_bwd_mxfp8
    from mxcli.kernels.blockwise_moe import inputs as bwd_inputs
    from mxcli.kernels.spec import get_spec
    from tests.kernels.forks import write_bwd_kernel

    spec = selection.parse_implementation(write_bwd_kernel(tmp_path, "mxbwd_x4"), BWD, tmp_path)
    ki = bwd_inputs.make_bwd_inputs(
        tokens=128,
        hidden=256,
        intermediate=128,
        experts=1,
        top_k=1,
        block_size=128,
        dense=True,
        prequantize=True,
        seed=2,
    )
    assert ki.tensors["gate_up_proj_weight"].dtype == torch.uint32
    kw = get_spec(BWD).resolve_kwargs(ki.kwargs)
    out = blockwise_mm_bwd_mxfp8(**ki.tensors, **kw, backend="sim", kernel=spec)
    assert out[1][2, 0].item() == 1.0


# ---- one mechanism, knowing no kernel (issue 32) ----------------------------------------------


def test_resolve_for_returns_a_choice_or_why_not(forks: dict[str, ImplementationChoice]) -> None:
    good = forks["good"]
    out = selection.resolve_for(good.label, [PREFILL, BWD], good.path)
    assert out[PREFILL] == good
    skipped = out[BWD]
    assert isinstance(skipped, selection.NotRunnable)
    assert skipped.reason == (
        f"not this kernel: {good.label} has no parameter expert_affinities_masked, "
        "token_position_to_id of the blockwise_mm_bwd_mxfp8 API"
    )
    assert selection.resolve_for(None, [PREFILL, BWD]) == {
        PREFILL: selection.parse_implementation("mxcli", PREFILL),
        BWD: selection.parse_implementation("mxcli", BWD),
    }


def test_shared_launch_modules_name_no_kernel_and_no_tensor() -> None:
    """The resolver, the launcher, the backend registry and the NKI runtime are shared: what
    is a kernel's (its name, short name, tensors) lives in its folder and reaches them through
    its spec."""
    import mxcli.kernels.backends
    import mxcli.kernels.launcher
    import mxcli.kernels.nki_runtime
    import mxcli.kernels.nkilib
    from mxcli.kernels.spec import all_specs

    words = {w for s in all_specs() for w in (s.name, s.short, *s.tensor_names)}
    for mod in (
        selection,
        mxcli.kernels.launcher,
        mxcli.kernels.backends,
        mxcli.kernels.nki_runtime,
        mxcli.kernels.nkilib,
    ):
        text = Path(mod.__file__ or "").read_text(encoding="utf-8")
        named = sorted(w for w in words if w in text)
        assert named == [], (mod.__name__, named)


def test_each_kernel_registers_its_adapter_on_its_spec() -> None:
    from mxcli.kernels.blockwise_moe import nkilib as bwd_nkilib
    from mxcli.kernels.rmsnorm_mx_prefill import nkilib as prefill_nkilib
    from mxcli.kernels.spec import get_spec

    for name, adapter in ((PREFILL, prefill_nkilib), (BWD, bwd_nkilib)):
        spec = get_spec(name)
        assert spec.implementations["nkilib"] is adapter.NKILIB_KERNEL
        assert spec.nki is not None and spec.nki.third_party is adapter.THIRD_PARTY
        assert spec.implementations["nkilib"].unavailable_reason() == (
            None if NKILIB_IMPORTABLE else "module 'nkilib' is not importable"
        )


def test_own_kernel_package_is_described_by_its_folder_and_every_module(tmp_path: Path) -> None:
    """A kernel split into a package (the backward's `nki_kernel/`) is identified by all of its
    modules: editing any one of them changes the recorded sha256 (not only `__init__.py`)."""
    from mxcli.kernels.selection import _file_sha256

    pkg = tmp_path / "k"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from .a import f\n")
    (pkg / "a.py").write_text("def f():\n    return 1\n")
    before = _file_sha256(str(pkg))
    (pkg / "a.py").write_text("def f():\n    return 2\n")
    assert _file_sha256(str(pkg)) != before
    assert (
        _file_sha256(str(pkg / "a.py")) == hashlib.sha256(b"def f():\n    return 2\n").hexdigest()
    )
    info = selection.describe(
        selection.parse_implementation("mxcli", "blockwise_mm_bwd_mxfp8", None)
    )
    assert info["file"].endswith("nki_kernel") and len(info["sha256"]) == 64
