"""A third kernel is one folder and one registration line (issue 32).

The test writes a toy kernel package at test time (its contract with the public signature, a
torch reference, its spec with the argument tables, its input generator, its exact check,
tolerance rows and one verification case), registers it with the one line
``MXCLI_KERNEL_PACKAGES=toykern``, and drives the CLI as fresh processes: ``run-toy``,
``make-inputs toy``, ``verify --suite``, ``verify OUT --inputs IN`` and each one's ``--help``
work for it, and no file of mxcli is touched (the package tree's bytes are compared before and
after).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import mxcli
from mxcli.io.files import read_file

ROOT = Path(mxcli.__file__).resolve().parent

TOY = {
    "__init__.py": '''
        """A toy kernel: y = alpha * x (+ bias), optionally ReLU'd."""
        from mxcli.kernels import backends
        from toykern.reference import toy_scale_reference
        from toykern.spec import SPEC

        backends.register(SPEC.name, "reference", toy_scale_reference)
    ''',
    "contract.py": '''
        from dataclasses import dataclass

        import torch

        from mxcli.errors import InputError


        @dataclass(frozen=True)
        class ToyCall:
            x: torch.Tensor
            bias: torch.Tensor | None
            alpha: float
            relu: bool

            @property
            def output_names(self):
                return ("y",)


        def validate(x, bias=None, alpha=3.0, relu=False, *, backend="reference"):
            if x.dim() != 2:
                raise InputError(f"x: expected [T, D], got shape {tuple(x.shape)}")
            if bias is not None and tuple(bias.shape) != (x.shape[1],):
                raise InputError(f"bias: expected [{x.shape[1]}], got {tuple(bias.shape)}")
            return ToyCall(x, bias, float(alpha), bool(relu))


        def toy_scale(x, bias=None, alpha=3.0, relu=False, *, backend="reference"):
            """y = alpha * x (+ bias), ReLU'd with relu, in bf16."""
            from mxcli.kernels import backends

            return backends.get("toy_scale", backend)(validate(x, bias, alpha, relu))
    ''',
    "reference.py": """
        import torch


        def toy_scale_reference(call):
            y = call.alpha * call.x.float()
            if call.bias is not None:
                y = y + call.bias.float()
            if call.relu:
                y = torch.relu(y)
            return (y.to(torch.bfloat16),)
    """,
    "spec.py": """
        import torch

        from mxcli.io.kwargs import typed
        from mxcli.kernels.spec import KernelSpec, ScalarArg, TensorArg, register_spec
        from toykern.contract import toy_scale, validate

        SPEC = register_spec(
            KernelSpec(
                toy_scale,
                short="toy",
                tensors=(
                    TensorArg("x", "[T, D]", (torch.bfloat16,)),
                    TensorArg("bias", "[D]", (torch.bfloat16,)),
                ),
                scalars=(
                    ScalarArg("alpha", "Scale factor.", typed(float, "alpha")),
                    ScalarArg("relu", "Clamp negatives to zero.", typed(bool, "relu")),
                ),
                outputs=("y",),
                validate=validate,
                package="toykern",
                title="A toy kernel: y = alpha * x + bias.",
            )
        )
    """,
    "inputs.py": """
        import torch

        from mxcli.inputs import KernelInputs, check_positive, normal, seeded
        from mxcli.kernels.spec import InputParam
        from toykern.spec import SPEC

        PARAMS = (
            InputParam("tokens", "Tokens T.", int, 8, with_weights="used"),
            InputParam("width", "Width D.", int, 16),
            InputParam("with_bias", "Draw a bias.", bool, False, flag="--with-bias"),
            InputParam("seed", "Random seed: the same flags give the same bytes.", int, 0),
        )


        def generate(*, tokens=8, width=16, with_bias=False, seed=0):
            check_positive(tokens=tokens, width=width)
            g = seeded(seed)
            tensors = {"x": normal(g, (tokens, width), 1.0).to(torch.bfloat16)}
            if with_bias:
                tensors["bias"] = normal(g, (width,), 0.5).to(torch.bfloat16)
            generator = {"source": "synthetic", "seed": seed, "tokens": tokens, "width": width}
            return KernelInputs(SPEC.name, tensors, {}, generator)


        def from_flags(flags):
            return generate(tokens=flags["tokens"], width=flags["width"],
                            with_bias=flags["with_bias"], seed=flags["seed"])
    """,
    "verification.py": """
        from mxcli.kernels.spec import get_spec
        from mxcli.verification.cases import Case
        from mxcli.verification.compare import Tolerance, compare_tensors
        from mxcli.verification.exact import CHECK, F64
        from toykern.spec import SPEC

        # one bf16 rounding of the exact value
        STRICT = {"y": Tolerance("close", rtol=2.0**-7, atol=1e-6)}
        HARDWARE = {"y": Tolerance("close", rtol=1e-2, atol=1e-3)}
        CASES = (Case("toy/bias-relu", SPEC.name, {"tokens": 8, "width": 16, "with_bias": True,
                                                  "seed": 3}, quick=True),)


        def check_exact(inputs, kwargs, outputs, weights, source):
            spec = get_spec(SPEC.name)
            y = spec.value(kwargs, "alpha") * inputs["x"].to(F64)
            if "bias" in inputs:
                y = y + inputs["bias"].to(F64)
            if spec.value(kwargs, "relu"):
                y = y.clamp_min(0)
            return [compare_tensors("y", outputs["y"].to(F64), y, STRICT["y"], check=CHECK)]
    """,
}


def _write_toy(folder: Path) -> None:
    pkg = folder / "toykern"
    pkg.mkdir()
    for name, text in TOY.items():
        (pkg / name).write_text(textwrap.dedent(text).lstrip(), encoding="utf-8")


def _tree_digest() -> str:
    h = hashlib.sha256()
    for p in sorted(ROOT.rglob("*.py")):
        h.update(str(p.relative_to(ROOT)).encode() + p.read_bytes())
    return h.hexdigest()


@pytest.fixture(scope="module")
def toy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("toy")
    _write_toy(folder)
    return folder


def _mxcli(toy: Path, *args: object) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MXCLI_")}
    env["PYTHONPATH"] = os.pathsep.join(
        [str(toy), str(ROOT.parent), *filter(None, [env.get("PYTHONPATH")])]
    )
    env["MXCLI_KERNEL_PACKAGES"] = "toykern"  # the one registration line
    return subprocess.run(
        [sys.executable, "-m", "mxcli", *map(str, args)],
        capture_output=True,
        text=True,
        env=env,
        cwd=toy,
        timeout=600,
    )


def _make_and_run(toy: Path, tmp_path: Path) -> tuple[Path, Path]:
    inp, out = tmp_path / "in.safetensors", tmp_path / "out.safetensors"
    r = _mxcli(toy, "make-inputs", "toy", "-o", inp, "--tokens", 4, "--with-bias", "--json")
    assert r.returncode == 0, r.stderr
    made = json.loads(r.stdout)
    assert made["kernel"] == "toy_scale" and made["kwargs"] == {"alpha": 3.0, "relu": False}
    assert made["tensors"]["x"]["shape"] == [4, 16] and made["tensors"]["bias"]["shape"] == [16]

    r = _mxcli(toy, "run-toy", inp, "-o", out, "--alpha", 0.5, "--relu", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["kernel"] == "toy_scale"
    f_in, f_out = read_file(inp), read_file(out)
    expected = torch.relu(0.5 * f_in.tensors["x"].float() + f_in.tensors["bias"].float())
    assert torch.equal(f_out.tensors["y"], expected.to(torch.bfloat16))
    return inp, out


def test_a_toy_kernel_registered_by_one_line_makes_inputs_and_runs(
    toy: Path, tmp_path: Path
) -> None:
    """The fast case: make-inputs toy and run-toy (3 processes)."""
    before = _tree_digest()
    _make_and_run(toy, tmp_path)
    help_run = " ".join(_mxcli(toy, "run-toy", "--help").stdout.split())
    # the API's defaults, read from the toy's signature
    assert "Scale factor (kernel API: 3.0)." in help_run
    assert "Clamp negatives to zero (kernel API: off)." in help_run
    assert _tree_digest() == before  # no file of mxcli was touched


@pytest.mark.slow
def test_a_toy_kernel_registered_by_one_line_runs_through_the_cli(
    toy: Path, tmp_path: Path
) -> None:
    """Every command the issue names: make-inputs, run, verify OUT --inputs IN, verify --suite,
    and --help of each (about 10 fresh processes)."""
    before = _tree_digest()
    inp, out = _make_and_run(toy, tmp_path)
    # another kernel's flag is refused for the toy, naming the kernels it belongs to
    r = _mxcli(toy, "make-inputs", "toy", "-o", tmp_path / "x.st", "--intermediate", 128)
    assert r.returncode == 2 and "--intermediate applies to make-inputs bwd only" in r.stderr

    r = _mxcli(toy, "verify", out, "--inputs", inp, "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "toy_scale" in r.stdout and '"y"' in r.stdout

    r = _mxcli(toy, "verify", "--suite", "quick", "--case", "toy/*", "--backend", "reference",
               "--json")  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    report = json.loads(r.stdout)
    assert "toy/bias-relu" in json.dumps(report)
    assert report["summary"]["cases_failed"] == 0, report

    helps = {}
    for command in ("run-toy", "make-inputs", "verify", "profile", ""):
        r = _mxcli(toy, *command.split(), "--help")
        assert r.returncode == 0, (command, r.stderr)
        helps[command] = " ".join(r.stdout.split())
    assert "Scale factor (kernel API: 3.0)." in helps["run-toy"]
    assert "{prefill|bwd|toy}" in helps["make-inputs"] and "toy: Width D." in helps["make-inputs"]
    # a flag whose default differs between kernels: each kernel's own applies, the help says so
    assert "Default: prefill 128, bwd 128, toy 8." in helps["make-inputs"]
    assert "run-toy" in helps[""]
    assert _tree_digest() == before  # no file of mxcli was touched


def test_the_toy_is_unknown_without_its_registration_line(toy: Path, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MXCLI_")}
    env["PYTHONPATH"] = os.pathsep.join([str(toy), str(ROOT.parent)])
    r = subprocess.run(
        [sys.executable, "-m", "mxcli", "make-inputs", "toy", "-o", tmp_path / "x.st"],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert r.returncode == 2 and "toy" in r.stderr and "prefill" in r.stderr
