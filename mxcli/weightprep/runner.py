"""Running a conversion: output-folder policy, resume, workers, progress, the manifest.

`prepare_weights` is the whole ``mxcli prep-weights`` command without its argument parsing:

1. plan (`build_plan`; validates everything, reads no tensor data); ``dry_run`` stops here;
2. refuse an existing output folder unless ``force`` (start over) or ``resume`` (keep the
   layers whose files still match the manifest's sha256, redo the others);
3. convert the selected layers, one at a time or ``workers`` at a time in separate processes;
   each finished layer is recorded in the manifest at once (written atomically), so an
   interrupted run loses at most the layers in flight and ``--resume`` picks up from there;
4. optionally ``check`` each layer against the source; hash the source files meanwhile.

Across processes or hosts (`mxcli.weightprep.shards`): each process converts its shard's layers
into the shared folder with ``--resume`` semantics, recording them in ``manifest.json`` under the
lock; the per-rank indexes and rank-view manifests are written once, by the process that finds
every selected layer recorded (the last to finish) or by ``finalize``, which refuses while
shards are missing and names them.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import fcntl
import hashlib
import multiprocessing as mp
import os
import re
import resource
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from mxcli.errors import InputError, MxcliError, OutputExistsError, raise_terminated
from mxcli.fsutil import default_mode, hold_folder, refuse_inputs, remove_stale_temporaries
from mxcli.io.files import tensor_sha256
from mxcli.weightprep import export
from mxcli.weightprep.checkpoint import INDEX_NAME, Checkpoint, open_safetensors
from mxcli.weightprep.manifest import (
    MANIFEST_NAME,
    ManifestError,
    ManifestRecord,
    ShardsRecord,
    SourceFile,
    new_manifest,
    read_manifest,
    write_manifest,
)
from mxcli.weightprep.plan import Plan, PrepOptions, build_plan, layer_file
from mxcli.weightprep.reporter import Reporter
from mxcli.weightprep.shards import Shard, describe, partition

LOCK_NAME = ".prep-weights.lock"
# held for a whole run (`hold_folder`): exclusively by a run that starts the folder (new, or
# --force), shared by --resume runs, which may share it on disjoint --layers
RUN_LOCK_NAME = ".prep-weights.run.lock"
_BUSY = "another prep-weights run is writing this folder (--resume runs may share it)"


# -- source hashing -----------------------------------------------------------------------------


def _file_sha256(path: Path, bufsize: int = 1 << 20) -> str:
    h = hashlib.sha256()
    buf = bytearray(bufsize)
    view = memoryview(buf)
    with path.open("rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


def _stat_entry(path: Path) -> SourceFile:
    st = path.stat()
    return SourceFile(size=st.st_size, mtime_ns=st.st_mtime_ns)


class SourceHasher(threading.Thread):
    """sha256 of the source files in a background thread (hashlib and file reads release the GIL)."""

    def __init__(self, root: Path, files: dict[str, SourceFile]) -> None:
        super().__init__(daemon=True, name="prep-weights-hash")
        self.root = root
        self.files = files
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            for name, entry in self.files.items():
                if entry.sha256 is None:
                    entry.sha256 = _file_sha256(self.root / name)
        except BaseException as exc:  # reported by the caller
            self.error = exc


# -- manifest -----------------------------------------------------------------------------------


def save_manifest(out: Path, manifest: ManifestRecord, indexes: bool = True) -> None:
    """`mxcli.weightprep.manifest.write_manifest` (the manifest, and per rank its index and
    rank view)."""
    write_manifest(out, manifest, indexes)


@contextlib.contextmanager
def _locked(out: Path) -> Iterator[None]:
    """Exclusive lock on the output folder (runs on several hosts may share it with --resume).

    The lock file is removed at the end of a run (`_remove_lock`), so a lock taken on a file
    that was removed meanwhile is no lock: take it again on the file the path now names.
    """
    path = out / LOCK_NAME
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, default_mode())
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                current = os.path.samestat(os.fstat(fd), os.stat(path))
            except FileNotFoundError:
                current = False
            if current:
                break
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)
    try:
        yield
    finally:
        os.close(fd)  # releases the lock


def _remove_lock(out: Path) -> None:
    """Remove the lock file at the end of a run (under the lock: see `_locked`)."""
    if not (out / LOCK_NAME).exists():
        return
    with contextlib.suppress(OSError), _locked(out):
        (out / LOCK_NAME).unlink()


# the files of an output folder whose temporaries a run may clean (`_remove_stale`)
_OUR_FILES = re.compile(
    r"manifest\.json|layer_\d+\.safetensors|" + re.escape(INDEX_NAME)
)  # fmt: skip


def _remove_stale(out: Path, plan: Plan) -> None:
    """Temporaries that a killed run left; those another live run is writing are kept, and
    so is any file that is not a temporary of one of the folder's own files."""
    remove_stale_temporaries(out, _OUR_FILES)
    for rk in plan.ranks:
        remove_stale_temporaries(out / rk.dir, _OUR_FILES)


def _merge_from_disk(out: Path, manifest: ManifestRecord) -> None:
    """Add the layers and source files that parallel runs recorded meanwhile (under the lock)."""
    path = out / MANIFEST_NAME
    if not path.is_file():
        return
    on_disk = read_manifest(path)
    for k, v in on_disk.layers.items():
        manifest.layers.setdefault(k, v)
    for name, f in on_disk.source.files.items():
        mine = manifest.source.files.setdefault(name, f)  # other shards' source files
        if mine.sha256 is None and f.sha256:
            mine.sha256 = f.sha256


def _record_layer(
    out: Path, manifest: ManifestRecord, record: dict[str, Any], indexes: bool = True
) -> None:
    """Merge one finished layer into the manifest on disk (re-read under the lock, so parallel
    runs on other layers are kept) and into `manifest`."""
    with _locked(out):
        _merge_from_disk(out, manifest)
        manifest.layers[str(record["layer"])] = record
        save_manifest(out, manifest, indexes)


# -- output folder policy -----------------------------------------------------------------------

_COMPARED_SETTINGS = (
    "tp",
    "ep",
    "formats",
    "scale_layout",
    "scale_rule",
    "elem",
    "quant_scheme",
    "tile_k",
    "fp8_range",
)
# settings absent from the manifests of older versions, as those versions wrote them
_SETTING_DEFAULTS = {"fp8_range": 448}


def _check_writable(out: Path) -> None:
    parent = out if out.exists() else out.parent
    if not parent.exists():
        raise MxcliError(f"{out}: parent folder {parent} does not exist")
    if not parent.is_dir():
        raise MxcliError(f"{out}: cannot write there, {parent} is not a folder")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise MxcliError(f"{out}: output folder {parent} is not writable")


def _make_folder(
    out: Path, plan: Plan, resume: bool, force: bool, shard: Shard | None = None
) -> bool:
    """Check the output folder's place and create it when absent; whether this run made it.
    (Of runs racing to make it, one does; `hold_folder` then decides which of them runs.)"""
    if resume and force:
        raise InputError("--resume and --force exclude each other (--force starts over)")
    if shard is not None and shard.count > 1:
        if force:
            raise InputError(
                f"--force with shard {shard} of {shard.count} ({shard.source}): every shard would "
                "delete the others' layers; remove the output folder first to start over"
            )
        resume = True
    refuse_inputs(out, folders=[("checkpoint folder", plan.source)])
    _check_writable(out)
    try:
        out.mkdir()
    except FileExistsError:
        if not out.is_dir():
            raise OutputExistsError(f"{out}: exists and is not a folder") from None
        return False
    return True


def _open_output(
    out: Path,
    plan: Plan,
    source_files: dict[str, SourceFile],
    resume: bool,
    force: bool,
    shard: Shard | None = None,
) -> ManifestRecord:
    """Reuse the output folder (made by `_make_folder`, held by this run); return the manifest
    to extend. A shard of several joins the folder the other shards share, as ``--resume``."""
    fresh = new_manifest(plan, source_files)
    if shard is not None and shard.count > 1:
        return _join_shards(out, plan, fresh, shard)
    mpath = out / MANIFEST_NAME
    if resume and mpath.is_file():
        old = read_manifest(mpath)  # replaced atomically: always whole
        _check_compatible(old, fresh, plan)
        _check_shards(old, shard)
        _continue(out, plan, old, fresh)
        return fresh
    if _not_empty(out) and not (resume or force):
        raise OutputExistsError(
            f"{out}: output folder exists and is not empty (use --force to overwrite or --resume to continue)"
        )
    if force:
        _remove_previous_outputs(out, plan)
    return fresh


def _continue(out: Path, plan: Plan, old: ManifestRecord, fresh: ManifestRecord) -> None:
    """Carry the recorded layers, shards and source hashes of `old` over into `fresh`."""
    if old.shards:
        fresh.shards = old.shards
    _remove_stale(out, plan)
    fresh.layers = dict(old.layers)
    for name, f in old.source.files.items():
        if name in fresh.source.files and f.sha256:
            fresh.source.files[name].sha256 = f.sha256


def _join_shards(out: Path, plan: Plan, fresh: ManifestRecord, shard: Shard) -> ManifestRecord:
    """A shard of several joins the folder as ``--resume`` does. The first to come records the
    selection in the manifest at once (under the lock, so shards starting together see it);
    every later one must repeat it and every option that shapes the bytes, else it is refused
    naming the difference: a shard converting other layers would leave some selected layer
    unconverted while the manifest calls the model complete."""
    mpath = out / MANIFEST_NAME
    fresh.shards = ShardsRecord(count=shard.count, complete=False, layers=list(plan.layers))
    with _locked(out):
        if not mpath.is_file():
            save_manifest(out, fresh, indexes=False)
            return fresh
        old = read_manifest(mpath)
        where = f"shard {shard} ({shard.source})"
        _check_compatible(old, fresh, plan, where, "every shard must run with the same options")
        _check_shards(old, shard)
        _check_selection(old, plan, where, mpath)
        _continue(out, plan, old, fresh)
    return fresh


def _check_selection(old: ManifestRecord, plan: Plan, where: str, mpath: Path) -> None:
    """The layers the first shard recorded (``shards.layers``) against this run's."""
    recorded = old.shards.layers if old.shards else None
    if recorded is None:  # an older version's folder: it recorded none
        return
    if [int(x) for x in recorded] != list(plan.layers):
        raise InputError(
            f"{where}: --layers selects layers {describe(plan.layers)}, the first shard recorded "
            f"layers {describe([int(x) for x in recorded])} in {mpath} (every shard must select "
            "the same layers)"
        )


def _not_empty(out: Path) -> bool:
    """Anything in the folder but the lock files of a run in progress."""
    return any(p.name not in (LOCK_NAME, RUN_LOCK_NAME) for p in out.iterdir())


def would_refuse(
    out: Path, source: Path, resume: bool, force: bool, plan: Plan | None = None
) -> str | None:
    """What the real run would refuse about the output folder (for ``--dry-run``), or None.
    With `plan` and ``force``: also a file --force would have to replace that mxcli did not
    write (`_previous_outputs`, or an export's `check_replaceable`)."""
    try:
        refuse_inputs(out, folders=[("checkpoint folder", source)])
        _check_writable(out)
        if plan is not None and force and out.is_dir() and not out.is_symlink():
            if not export.get(plan.options.output_format).resumable:  # an export folder
                from mxcli.weightprep.export.folder import check_replaceable

                if any(out.iterdir()):
                    check_replaceable(out)
            else:
                _previous_outputs(out, plan)
    except MxcliError as exc:
        return f"the real run would refuse: {exc}"
    if out.exists() and not out.is_dir():
        return f"the real run would refuse: {out} exists and is not a folder"
    if out.is_dir() and _not_empty(out) and not (resume or force):
        return (
            f"{out}: output folder exists and is not empty; the real run would refuse "
            "(use --force to overwrite or --resume to continue)"
        )
    return None


def _previous_outputs(out: Path, plan: Plan) -> set[Path]:
    """--force: the files an earlier run wrote here, as its manifest lists them (each path
    confined to the folder, `mxcli.weightprep.manifest.check_paths`). Refuses, naming it, a
    file this run would replace that no manifest lists: mxcli did not write it."""
    mpath = out / MANIFEST_NAME
    listed: set[Path] = set()
    if os.path.lexists(mpath):
        old = read_manifest(mpath)  # a foreign or corrupt manifest.json: refused, named
        listed.add(mpath)
        for rk in old.ranks:
            listed |= {out / rk["dir"] / INDEX_NAME, out / rk["dir"] / MANIFEST_NAME}
        for entry in old.layers.values():
            listed |= {out / fe["file"] for fe in entry["ranks"].values()}
    for p in [mpath, *_planned_files(out, plan)]:
        if os.path.lexists(p) and p not in listed:
            raise OutputExistsError(
                f"{p}: this run would replace it, and no manifest here says mxcli wrote it "
                "(--force replaces only what mxcli wrote; move it away)"
            )
    return listed


def _planned_files(out: Path, plan: Plan) -> list[Path]:
    """The files a run of `plan` writes (besides OUT/manifest.json)."""
    names = [layer_file(L) for L in plan.layers] + [INDEX_NAME, MANIFEST_NAME]
    return [out / rk.dir / n for rk in plan.ranks for n in names]


def _remove_files(out: Path, files: set[Path]) -> None:
    """Delete `files` (the manifest last, so that an interrupted removal is still described)
    and the folders they leave empty inside `out`."""
    mpath = out / MANIFEST_NAME
    for p in sorted(files - {mpath}):
        p.unlink(missing_ok=True)
    for d in sorted({p.parent for p in files}, key=lambda d: -len(d.parts)):
        if d != out:
            with contextlib.suppress(OSError):  # not empty: it holds files mxcli did not write
                d.rmdir()
    if mpath in files:
        mpath.unlink(missing_ok=True)


def _remove_previous_outputs(out: Path, plan: Plan) -> None:
    """--force: delete what an earlier prep-weights run wrote here (its manifest lists it),
    and nothing else."""
    _remove_stale(out, plan)
    _remove_files(out, _previous_outputs(out, plan))


def _check_shards(old: ManifestRecord, shard: Shard | None) -> None:
    """Shards of one folder must agree on N (the split of the layers depends on it)."""
    n_old = int(old.shards.count or 1) if old.shards else 1
    n = shard.count if shard is not None else 1
    if shard is not None and n > 1 and n_old > 1 and n != n_old:
        raise InputError(
            f"shard {shard} ({shard.source}): this output is being prepared in {n_old} shards, "
            f"this run asks {n} (use the same N on every process)"
        )


def _check_compatible(
    old: ManifestRecord | dict[str, Any],
    fresh: ManifestRecord | dict[str, Any],
    plan: Plan,
    where: str = "--resume",
    hint: str = "use --force to start over",
) -> None:
    """`old` (the manifest on disk) against `fresh` (this run's): one line naming the first
    difference that would give other bytes."""
    if isinstance(old, dict):
        old = ManifestRecord.from_dict(old)
    if isinstance(fresh, dict):
        fresh = ManifestRecord.from_dict(fresh)
    if old.source.family != fresh.source.family:
        raise InputError(
            f"{where}: the output was made from a {old.source.family} model, this source is {fresh.source.family} ({hint})"
        )
    hub_a, hub_b = old.source.hub or {}, fresh.source.hub or {}
    if hub_a.get("commit") and hub_b.get("commit") and hub_a["commit"] != hub_b["commit"]:
        raise InputError(
            f"{where}: the output was made from commit {hub_a['commit']} of "
            f"{hub_a.get('repo_id')}, this run reads commit {hub_b['commit']} ({hint})"
        )
    for key in _COMPARED_SETTINGS:
        a = old.settings.get(key, _SETTING_DEFAULTS.get(key))
        b = fresh.settings.get(key)
        if a != b:
            raise InputError(
                f"{where}: the output was written with {key}={a}, this run asks {key}={b} ({hint})"
            )
    for name, f in fresh.source.files.items():
        o = old.source.files.get(name)
        if o is not None and (o.size != f.size or o.mtime_ns != f.mtime_ns):
            raise InputError(
                f"{where}: source file {name} changed since the output was written ({hint})"
            )


def layer_is_complete(out: Path, record: dict[str, Any] | None, plan: Plan) -> bool:
    """True when every rank file of the layer exists and each tensor matches its sha256."""
    if record is None:
        return False
    expected = {
        str(rk.rank): {o.key for o in outs}
        for rk, outs in zip(plan.ranks, plan.outputs, strict=True)
    }
    if set(record.get("ranks", {})) != set(expected):
        return False
    for r, fe in record["ranks"].items():
        path = out / fe["file"]
        if set(fe["tensors"]) != expected[r] or not path.is_file():
            return False
        try:
            with open_safetensors(path) as f:
                for t in fe["tensors"].values():
                    if tensor_sha256(f.get_tensor(t["name"])) != t["sha256"]:
                        return False
        except Exception:
            return False
    return True


# -- workers ------------------------------------------------------------------------------------


@contextlib.contextmanager
def _torch_threads(n: int) -> Iterator[None]:
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


_WORKER: dict[str, Any] = {}


def _worker_init(source: str, opts: PrepOptions, threads: int, queue: Any) -> None:
    import signal

    import torch

    # the parent terminates its workers when it is interrupted: unwind, removing temporaries.
    # Ctrl-C reaches the whole process group; the parent alone decides what happens then.
    signal.signal(signal.SIGTERM, raise_terminated)
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    torch.set_num_threads(threads)
    ckpt = Checkpoint(source, require_shards=False)
    _WORKER.update(ckpt=ckpt, plan=build_plan(source, opts, ckpt), queue=queue)


def _worker_layer(layer: int, out: str) -> dict[str, Any]:
    queue = _WORKER["queue"]
    return convert_and_check(
        _WORKER["plan"], _WORKER["ckpt"], layer, Path(out), lambda n: queue.put(n)
    )


def convert_and_check(
    plan: Plan,
    ckpt: Checkpoint,
    layer: int,
    out: Path,
    progress: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """Convert one layer (and check it when the options ask); its manifest record."""
    from mxcli.weightprep.convert import convert_layer

    with ckpt.reader() as rd:
        record = convert_layer(plan, rd, layer, out, progress)
    record["check"] = None
    record["routing_check"] = None
    if plan.options.check:
        from mxcli.weightprep.check import check_layer, check_routing

        with ckpt.reader() as rd:
            record["check"] = check_layer(plan, rd, layer, out)
            record["routing_check"] = check_routing(plan, rd, layer, out)
    record["peak_rss_bytes"] = peak_rss_bytes()
    return record


def peak_rss_bytes() -> int:
    """Peak resident memory of this process.

    Linux ``VmHWM`` where available: ``ru_maxrss`` of a child process also counts the memory its
    parent had when it forked, which would hide what the child itself used.
    """
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB


# -- the run ------------------------------------------------------------------------------------


def _run_export(plan: Any, out: Any, force: bool, reporter: Any = None) -> dict[str, Any]:
    """Write `plan` in its ``options.output_format``; the result as a JSON-able dict.
    `reporter` (a `mxcli.weightprep.reporter.Reporter`) gets the bf16 expert bytes as they go."""
    exp = export.get(plan.options.output_format)
    if exp.write is None:
        raise ValueError(f"{exp.name}: written by mxcli.weightprep.runner, not an export")
    exp.check_plan(plan)  # before the bar starts and before any byte is written
    rep = reporter or Reporter()
    rep.start(plan, plan.layers, [])
    try:
        return exp.write(plan, out, force, rep.advance)
    finally:
        rep.finish()


def prepare_weights(
    source: str | Path,
    output: str | Path | None,
    options: PrepOptions,
    *,
    dry_run: bool = False,
    resume: bool = False,
    force: bool = False,
    reporter: Reporter | None = None,
    revision: str | None = None,
    shard: Shard | None = None,
    finalize: bool = False,
) -> dict[str, Any]:
    """Plan (``dry_run``) or run a conversion; returns the plan or the result as a JSON-able dict.

    `source`: a checkpoint folder, or a Hugging Face repo id (`mxcli.weightprep.hub`, with
    `revision`), of which only config, index and the selected layers' shards are fetched.
    `shard`: convert only this process's share of the selected layers (`shards.partition`) into
    a folder the other shards share. `finalize`: convert nothing; write the indexes and the
    final manifest once every shard's layers are recorded (else refuse, naming the shards).
    """
    from mxcli.weightprep.hub import open_source

    root, hub = open_source(source, revision)
    ckpt = Checkpoint(root, require_shards=False)
    if output is None and not dry_run:  # before any shard is fetched
        raise InputError("OUTPUT folder is required (or use --dry-run)")
    if dry_run:  # shards that are not here are planned from config.json
        plan = build_plan(root, options, ckpt, config_only_ok=True)
        plan.hub = hub.describe() if hub else None
        res: dict[str, Any] = {"dry_run": True, "plan": plan.to_dict()}
        exp = export.get(options.output_format)
        exp.check_plan(plan)
        view = exp.dry_run_view(plan)
        if view is not None:  # the export's tensors, not mxcli's layout
            p = res["plan"]
            p["outputs_per_layer"] = view["outputs_per_layer"]
            p["output_bytes"] = view["write_total"]
            for e in p.get("per_layer") or []:
                e["output_bytes"] = view["write_per_layer"]
            p["notes"] = [*p.get("notes", []), view["note"]]
        problem = (
            None if output is None else would_refuse(Path(output), ckpt.root, resume, force, plan)
        )
        if problem is not None:
            res["plan"]["notes"] = [*res["plan"].get("notes", []), problem]
            res["plan"]["would_refuse"] = problem
        return res
    if finalize:
        if output is None:
            raise InputError("OUTPUT folder is required with --finalize")
        plan = build_plan(root, options, ckpt, config_only_ok=True)  # reads no tensor data
        return finalize_output(Path(output), plan)
    if hub is not None:  # fetch the shards of the selected layers, then plan from their headers
        first = build_plan(root, options, ckpt, config_only_ok=True)
        hub.fetch_shards(hub.shards_for(first.source_files))
        ckpt = Checkpoint(root, require_shards=False)
    plan = build_plan(root, options, ckpt)
    plan.hub = hub.describe() if hub else None
    if output is None:
        raise InputError("OUTPUT folder is required (or use --dry-run)")
    out = Path(output)
    if not export.get(options.output_format).resumable:  # another stack's layout, published whole
        if resume:
            raise InputError(
                f"--resume: not available with --output-format {options.output_format}"
            )
        return _run_export(plan, out, force, reporter)
    rep = reporter or Reporter()

    if shard is not None and shard.count <= 1:
        shard = None
    mine = plan.layers if shard is None else shard_layers(plan, shard.count)[shard.index]
    # config, index and the shards this run's layers read
    touched = sorted({plan.source_files[n] for L in mine for n in plan.source_tensors[L]})
    extra = ["config.json"] + ([INDEX_NAME] if ckpt.index_name else [])
    source_files = {name: _stat_entry(ckpt.root / name) for name in extra + touched}
    try:
        return _run(ckpt, plan, out, source_files, options, resume, force, rep, shard, mine)
    except OSError as exc:  # disk full, permissions, ...: the output could not be written
        if isinstance(exc, MxcliError):  # OutputExistsError is a FileExistsError
            raise
        raise MxcliError(f"{out}: cannot write ({exc.strerror or exc})") from None


def _run(
    ckpt: Checkpoint,
    plan: Plan,
    out: Path,
    source_files: dict[str, SourceFile],
    options: PrepOptions,
    resume: bool,
    force: bool,
    rep: Reporter,
    shard: Shard | None,
    mine: list[int],
) -> dict[str, Any]:
    created = _make_folder(out, plan, resume, force, shard)
    joined = resume or shard is not None  # a shard of several joins the folder as --resume
    try:
        with hold_folder(out, RUN_LOCK_NAME, shared=joined, busy=_BUSY):
            manifest = _open_output(out, plan, source_files, resume, force, shard)
            if shard is not None and manifest.shards is None:
                manifest.shards = ShardsRecord(count=shard.count, complete=False)
            try:
                return _convert(ckpt, plan, out, manifest, options, joined, rep, shard, mine)
            except BaseException:
                if not joined:  # held exclusively: what is here now is ours
                    _remove_unfinished(out, plan, created)
                raise
            finally:
                _remove_stale(out, plan)  # ours, if an interrupt left any (others' are locked)
                _remove_lock(out)
    except BaseException:
        if created:  # made by this run, which failed before writing: leave no empty folder
            with contextlib.suppress(OSError):  # not empty: another run holds it now
                out.rmdir()
        raise


def _remove_unfinished(out: Path, plan: Plan, created: bool) -> None:
    """A run that failed before finishing a layer (a full disk, an interrupt) leaves nothing:
    its rank folders (and the manifest, which lists no layer yet), so that the same command can
    simply run again. Once a layer is recorded, everything is kept for ``--resume``."""
    mpath = out / MANIFEST_NAME
    try:
        recorded = read_manifest(mpath).layers if mpath.is_file() else {}
    except ManifestError:
        return
    if recorded:
        return
    _remove_stale(out, plan)
    with contextlib.suppress(OSError):  # the files this run writes (--force checked them)
        _remove_files(out, {*_planned_files(out, plan), mpath})
    if created:  # only this run wrote here: remove what else it left (the folder goes below)
        for p in out.iterdir():
            if p.name not in (LOCK_NAME, RUN_LOCK_NAME):
                shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)


def _convert(
    ckpt: Checkpoint,
    plan: Plan,
    out: Path,
    manifest: ManifestRecord,
    options: PrepOptions,
    resume: bool,
    rep: Reporter,
    shard: Shard | None = None,
    mine: list[int] | None = None,
) -> dict[str, Any]:
    todo, done = [], []
    indexes = shard is None  # a shard leaves the indexes to the last one to finish
    for L in plan.layers if mine is None else mine:
        if resume and layer_is_complete(out, manifest.layers.get(str(L)), plan):
            done.append(L)
        else:
            manifest.layers.pop(str(L), None)
            todo.append(L)

    hasher = SourceHasher(ckpt.root, manifest.source.files)
    hasher.start()
    t0 = time.perf_counter()
    records: dict[int, dict[str, Any]] = {}
    rep.start(plan, todo, done)
    try:
        if options.workers <= 1 or len(todo) <= 1:
            with _torch_threads(options.threads_per_worker()):
                for L in todo:
                    rec = convert_and_check(plan, ckpt, L, out, rep.advance)
                    _record_layer(out, manifest, rec, indexes)
                    records[L] = rec
                    rep.layer_done(L, rec)
        else:
            _run_pool(plan.source, options, out, todo, manifest, records, rep, indexes)
        hasher.join()
        if hasher.error is not None:
            raise MxcliError(f"{ckpt.root}: cannot hash the source files ({hasher.error})")
        with _locked(out):
            _merge_from_disk(out, manifest)
            missing = missing_shards(out, plan, manifest) if shard is not None else []
            if shard is not None and manifest.shards is not None:
                manifest.shards.complete = not missing
            save_manifest(out, manifest, indexes or not missing)
    finally:
        rep.finish()
    seconds = time.perf_counter() - t0
    converted_bytes = plan.source_bf16_bytes * len(todo)
    result: dict[str, Any] = {
        "output": str(out),
        "manifest": str(out / MANIFEST_NAME),
        "family": plan.model.family.name,
        "router_act_fn": plan.model.router.act_fn,
        "router_exact": plan.model.router.exact,
        "backward_exact": plan.model.router.backward_exact,
        "layers_written": todo,
        "layers_skipped": done,
        "fp8": plan.options.fp8().to_dict(),
        "fp8_clipped": sum(int(r.get("fp8_clipped") or 0) for r in records.values()),
        "ranks": len(plan.ranks),
        "files": [f"{rk.dir}/{layer_file(L)}" for L in plan.layers for rk in plan.ranks],
        "source_bf16_bytes": converted_bytes,
        "output_bytes": plan.output_bytes_per_layer() * len(todo),
        "seconds": round(seconds, 3),
        "throughput_gbps": round(converted_bytes / seconds / 1e9, 4)
        if seconds > 0 and todo
        else None,
        "peak_rss_bytes": max(
            [peak_rss_bytes()] + [int(r.get("peak_rss_bytes") or 0) for r in records.values()]
        ),
        "notes": list(plan.notes)
        + list(plan.model.router.notes)
        + list(plan.model.router.bwd_notes),
    }
    if shard is not None:
        result["shard"] = {
            "index": shard.index,
            "count": shard.count,
            "from": shard.source,
            "layers": mine,
            "finalized": not missing,
            "missing_shards": missing,
        }
    if options.check:
        from mxcli.weightprep.check import summarize

        result["check"] = {
            str(L): summarize(r["check"]) for L, r in records.items() if r.get("check")
        }
        result["routing_check"] = {
            str(L): r["routing_check"] for L, r in records.items() if r.get("routing_check")
        }
    return result


def shard_layers(plan: Plan, count: int) -> list[list[int]]:
    """The selected layers split into `count` shards, balanced by their source bytes."""
    return partition(plan.layers, plan.source_bytes, count)


def _recorded(out: Path, plan: Plan, record: dict[str, Any] | None) -> bool:
    """A layer whose record names every rank and whose files are there at their sizes (the
    sha256 check is ``--resume``'s: re-reading every layer here would cost a second pass)."""
    if record is None or set(record.get("ranks", {})) != {str(rk.rank) for rk in plan.ranks}:
        return False
    for fe in record["ranks"].values():
        path = out / fe["file"]
        if not path.is_file() or path.stat().st_size != int(fe["bytes"]):
            return False
    return True


def missing_shards(out: Path, plan: Plan, manifest: ManifestRecord) -> list[dict[str, Any]]:
    """The shards (of the manifest's count) with a selected layer not recorded, and those layers."""
    count = int(manifest.shards.count or 1) if manifest.shards else 1
    out_list = []
    for i, layers in enumerate(shard_layers(plan, count)):
        lost = [L for L in layers if not _recorded(out, plan, manifest.layers.get(str(L)))]
        if lost:
            out_list.append({"shard": f"{i}/{count}", "layers": lost})
    return out_list


def finalize_output(out: Path, plan: Plan) -> dict[str, Any]:
    """``--finalize``: write the indexes and the final manifest of a sharded output, or refuse
    (one line) naming the shards whose layers are not all recorded."""
    path = out / MANIFEST_NAME
    if not path.is_file():
        raise InputError(f"{out}: no {MANIFEST_NAME} to finalize (no shard has finished a layer)")
    with _locked(out):
        manifest = read_manifest(path)
        _check_compatible(manifest, new_manifest(plan, {}), plan)
        _check_selection(manifest, plan, "--finalize", path)
        missing = missing_shards(out, plan, manifest)
        if missing:
            names = ", ".join(f"{m['shard']} (layers {describe(m['layers'])})" for m in missing)
            raise InputError(
                f"{out}: cannot finalize, shards not finished: {names}; run those shards "
                "again with --resume"
            )
        if manifest.shards:
            manifest.shards.complete = True
        save_manifest(out, manifest)
    _remove_lock(out)
    return {
        "output": str(out),
        "manifest": str(path),
        "finalized": True,
        "layers": plan.layers,
        "ranks": len(plan.ranks),
        "shards": int(manifest.shards.count or 1) if manifest.shards else 1,
    }


def _run_pool(
    source: str | Path,
    options: PrepOptions,
    out: Path,
    todo: list[int],
    manifest: ManifestRecord,
    records: dict[int, dict[str, Any]],
    rep: Reporter,
    indexes: bool = True,
) -> None:
    workers = min(options.workers, len(todo))
    threads = options.threads_per_worker()
    ctx = mp.get_context("spawn")
    with ctx.Manager() as mgr:
        queue = mgr.Queue()
        with cf.ProcessPoolExecutor(
            max_workers=workers, mp_context=ctx, initializer=_worker_init,
            initargs=(str(source), options, threads, queue),
        ) as pool:  # fmt: skip
            futures = {pool.submit(_worker_layer, L, str(out)): L for L in todo}
            pending = set(futures)
            try:
                while pending:
                    finished, pending = cf.wait(
                        pending, timeout=0.2, return_when=cf.FIRST_COMPLETED
                    )
                    _drain(queue, rep)
                    for fut in finished:
                        rec = fut.result()
                        _record_layer(out, manifest, rec, indexes)
                        records[futures[fut]] = rec
                        rep.layer_done(futures[fut], rec)
            except BaseException:
                for fut in pending:
                    fut.cancel()
                _stop_workers(pool)
                raise
            _drain(queue, rep)


def _stop_workers(pool: cf.ProcessPoolExecutor) -> None:
    """Interrupted: SIGTERM the workers (each removes its temporaries as it unwinds) rather
    than wait for the layers in flight."""
    for proc in list(getattr(pool, "_processes", {}).values()):
        with contextlib.suppress(Exception):
            proc.terminate()
    for proc in list(getattr(pool, "_processes", {}).values()):
        with contextlib.suppress(Exception):
            proc.join(timeout=30)


def _drain(queue: Any, rep: Reporter) -> None:
    import queue as q

    while True:
        try:
            rep.advance(queue.get_nowait())
        except q.Empty:
            return
