"""Output formats as registered `Exporter`s, and the manifest and export records as typed
records (issue 32): the registry is where ``--output-format`` comes from, a format registered
at test time is planned, written and verified with no other file touched, and a record read
and written again gives the same bytes."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from mxcli.errors import InputError
from mxcli.weightprep import export
from mxcli.weightprep.export.base import Exporter, register, unregister
from mxcli.weightprep.manifest import (
    MANIFEST_NAME,
    ExportRecord,
    ManifestRecord,
    read_export_record,
    read_manifest,
    write_export_record,
    write_manifest,
)
from mxcli.weightprep.plan import PrepOptions
from mxcli.weightprep.runner import prepare_weights
from mxcli.weightprep.synthetic import build_checkpoint


@pytest.fixture(scope="module")
def src(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("exporters")
    return build_checkpoint("qwen3_moe", root / "src", num_layers=2, intermediate_size=256).path


def _help(*args: str) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MXCLI_")}
    env["COLUMNS"] = "400"  # one help paragraph per line: names are not wrapped apart
    r = subprocess.run([sys.executable, "-m", "mxcli", *args, "--help"], capture_output=True,
                       text=True, env=env, timeout=120)  # fmt: skip
    assert r.returncode == 0, r.stderr
    return re.sub(r"\s+", " ", r.stdout)


def test_registry_names_are_the_output_format_choices() -> None:
    """Every registered exporter is a ``--output-format`` choice in ``prep-weights --help``,
    and ``--formats auto`` says each one's default (a fresh process: the real CLI)."""
    assert export.names() == ("mxcli", "compressed-tensors", "nxdi")
    text = _help("prep-weights")
    assert export.choices_help() in text
    for name in export.names():
        e = export.get(name)
        assert f"{name} (" in text
        assert (
            f"{'both' if len(e.default_formats) > 1 else e.default_formats[0]} for {name}" in text
        )
    with pytest.raises(
        InputError, match=r"expected one of mxcli, compressed-tensors, nxdi, got 'x'"
    ):
        PrepOptions(output_format="x")


def test_each_format_defaults_from_its_exporter() -> None:
    """``--scale-rule auto`` and the exporter-only rules and options, asked of the exporter."""
    assert PrepOptions().scale_rule == "neuron"
    assert PrepOptions(output_format="compressed-tensors").scale_rule == "ct"
    assert PrepOptions(output_format="compressed-tensors", fp8_range=240).scale_rule == "ocp"
    assert PrepOptions(output_format="nxdi").scale_rule == "neuron"
    with pytest.raises(InputError, match=r"--scale-rule ct: for --output-format compressed-tensors only \(got --output-format nxdi; its outputs take neuron or ocp\)"):  # fmt: skip
        PrepOptions(output_format="nxdi", scale_rule="ct")
    with pytest.raises(
        InputError, match=r"--nxdi-base: for --output-format nxdi only \(got mxcli\)"
    ):
        PrepOptions(nxdi_base="/x")


# -- a format registered at test time --------------------------------------------------------------

TOY = "toy-format"


def _toy_write(plan: Any, out: Path, force: bool, progress: Any) -> dict[str, Any]:
    from mxcli.weightprep.export.folder import export_folder, write_record

    out = Path(out)
    with export_folder(out, plan.source, force) as tmp:
        (tmp / "toy.txt").write_text(f"{plan.model.family.name} {plan.layers}\n")
        result = {"output": str(out), "output_format": TOY, "layers": plan.layers}
        write_record(tmp, plan, TOY, result)
    return result


def _toy_verify(out: Path, against: Path, hashes_only: bool) -> dict[str, Any]:
    return {"checkpoint": str(out), "output_format": TOY, "passed": (out / "toy.txt").is_file()}


@pytest.fixture()
def toy() -> Iterator[Exporter]:
    seen: list[Any] = []
    exp = register(
        Exporter(
            name=TOY,
            summary=f"{TOY} (a test's)",
            default_formats=("bf16",),
            verify=_toy_verify,
            scale_rules=("neuron", "ocp", "rceil"),
            check_plan=seen.append,
            dry_run_view=lambda plan: {
                "outputs_per_layer": {"toy": []},
                "write_per_layer": 7,
                "write_total": 7 * len(plan.layers),
                "note": "a toy",
            },  # fmt: skip
            write=_toy_write,
        )
    )
    try:
        yield exp
    finally:
        unregister(TOY)
    assert TOY not in export.names()


def test_a_format_registered_at_test_time_is_planned_written_and_verified(
    toy: Exporter, src: Path, tmp_path: Path
) -> None:
    from mxcli.verification.checkpoints import verify_checkpoint

    opts = PrepOptions(output_format=TOY, formats=("bf16",), scale_rule="rceil")
    assert opts.scale_rule == "rceil"  # its own rule, refused for mxcli's layout
    with pytest.raises(InputError, match=f"for --output-format compressed-tensors or {TOY} only"):
        PrepOptions(scale_rule="rceil")
    dry = prepare_weights(src, tmp_path / "out", opts, dry_run=True)["plan"]
    assert dry["outputs_per_layer"] == {"toy": []} and dry["output_bytes"] == 14
    assert dry["notes"][-1] == "a toy"
    with pytest.raises(InputError, match=f"--resume: not available with --output-format {TOY}"):
        prepare_weights(src, tmp_path / "out", opts, resume=True)
    res = prepare_weights(src, tmp_path / "out", opts)
    assert res == {"output": str(tmp_path / "out"), "output_format": TOY, "layers": [0, 1]}
    assert (tmp_path / "out" / "toy.txt").read_text() == "qwen3_moe [0, 1]\n"
    rec = read_export_record(tmp_path / "out" / "mxcli-export.json")
    assert rec.output_format == TOY and rec.files == ["toy.txt"]
    assert rec.settings["output_format"] == TOY and rec.settings["scale_rule"] == "rceil"
    assert verify_checkpoint(tmp_path / "out", src)["passed"] is True


# -- the records ----------------------------------------------------------------------------------


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {
        p.relative_to(folder).as_posix(): p.read_bytes()
        for p in sorted(folder.rglob("*.json"))
        if not p.name.startswith(".")
    }


def test_manifest_write_read_write_is_byte_identical(src: Path, tmp_path: Path) -> None:
    """What prep-weights wrote, read as a `ManifestRecord` and written again: the same bytes,
    the rank views and indexes too (a sharded run's ``shards`` included)."""
    out = tmp_path / "out"
    prepare_weights(src, out, PrepOptions(tp=2, layers="0"))
    prepare_weights(src, out, PrepOptions(tp=2, layers="1"), resume=True)
    before = _snapshot(out)
    assert set(before) == {"manifest.json", "rank0/manifest.json", "rank1/manifest.json",
                           "rank0/model.safetensors.index.json",
                           "rank1/model.safetensors.index.json"}  # fmt: skip
    rec = read_manifest(out / MANIFEST_NAME)
    assert rec.source.family == "qwen3_moe" and sorted(rec.layers) == ["0", "1"]
    assert (rec.model.hidden_size, rec.model.padded_hidden_size) == (
        256,
        512,
    ) and rec.shards is None
    for p in out.rglob("*.json"):
        p.unlink()
    write_manifest(out, rec)
    assert _snapshot(out) == before

    from mxcli.weightprep.shards import Shard

    sh = tmp_path / "sharded"
    for i in range(2):
        prepare_weights(src, sh, PrepOptions(), shard=Shard(i, 2))
    rec = read_manifest(sh / MANIFEST_NAME)
    assert rec.shards is not None and (rec.shards.count, rec.shards.complete) == (2, True)
    assert rec.shards.layers == [0, 1]
    again = tmp_path / "again.json"
    again.write_text(json.dumps(rec.to_dict(), indent=2) + "\n")
    assert again.read_bytes() == (sh / MANIFEST_NAME).read_bytes()


def test_records_keep_absent_and_unknown_keys(src: Path, tmp_path: Path) -> None:
    """An older manifest (no ``padding``, no ``model.padded_hidden_size``) and a newer one (a
    key this version does not know) are written back as they were read; a key set after
    reading is written."""
    out = tmp_path / "out"
    prepare_weights(src, out, PrepOptions(layers="0"))
    data = json.loads((out / MANIFEST_NAME).read_text())
    del data["padding"], data["model"]["padded_hidden_size"]
    data["from_a_newer_version"] = {"x": 1}
    text = json.dumps(data, indent=2) + "\n"
    rec = ManifestRecord.from_dict(json.loads(text))
    assert rec.padding is None and "padding" not in rec.to_dict()
    assert json.dumps(rec.to_dict(), indent=2) + "\n" == text
    rec.padding = {"hidden_size": 1}
    assert list(rec.to_dict())[7] == "padding"  # in its place, not at the end

    ex = ExportRecord.from_dict({"format": "mxcli.export", "output_format": "nxdi", "result": {}})
    assert ex.to_dict() == {"format": "mxcli.export", "output_format": "nxdi", "result": {}}
    ex.files = ["a"]
    assert list(ex.to_dict()) == ["format", "output_format", "result", "files"]


def test_export_record_write_read_write_is_byte_identical(src: Path, tmp_path: Path) -> None:
    out = tmp_path / "nx"
    prepare_weights(src, out, PrepOptions(output_format="nxdi", formats=("bf16",)))
    path = out / "mxcli-export.json"
    before = path.read_bytes()
    rec = read_export_record(path)
    assert rec.output_format == "nxdi" and rec.files == ["weights/tp0_moe_only.safetensors"]
    assert rec.model.moe_layers == [0, 1] and rec.result["experts_format"] == "bf16"
    copy = tmp_path / "copy.json"
    write_export_record(copy, rec)
    assert copy.read_bytes() == before
