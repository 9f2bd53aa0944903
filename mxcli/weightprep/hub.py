"""Checkpoints named by a Hugging Face Hub repo id (``Qwen/Qwen3-30B-A3B``, ``--revision``).

Files come through ``huggingface_hub`` (the optional extra ``mxcli[hub]``, imported only
here) into its cache, and only those a run needs: ``config.json`` and the shard index first
(a ``--dry-run`` plans from them and stops), then the shards holding the selected layers'
tensors. ``HF_HUB_OFFLINE`` set means the cache only, never the network; ``HF_HUB_CACHE`` (or
``HF_HOME``) places the cache. Everything lands in one snapshot folder of the cache, which the
rest of prep-weights reads like a local checkpoint whose other shards are absent.
"""

from __future__ import annotations

import importlib
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mxcli.errors import InputError, MxcliError
from mxcli.weightprep.checkpoint import INDEX_NAME, SINGLE_NAME

# owner/name as the Hub spells them (letters, digits, '-', '_', '.'; no leading '-' or '.')
_REPO_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,95}/[A-Za-z0-9][A-Za-z0-9_.-]{0,95}")
_TRUE = ("1", "true", "yes", "on")


class HubError(MxcliError):
    """A Hub repo, revision or file that cannot be had (offline, missing, gated)."""


def looks_like_repo_id(source: str) -> bool:
    """``owner/name`` that is not an existing local path."""
    return bool(_REPO_ID.fullmatch(source)) and not Path(source).exists()


def offline() -> bool:
    """``HF_HUB_OFFLINE`` as huggingface_hub reads it (read at each call, not at import)."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in _TRUE


def _hub() -> tuple[Any, Any]:
    """``(huggingface_hub, its errors module)``.

    The errors are imported as a submodule: the package resolves its attributes lazily, and
    ``huggingface_hub.errors`` / ``.utils`` are not among them (2.x raises ``AttributeError``
    until something else has imported the submodule), so attribute access fails in a fresh
    process."""
    try:
        import huggingface_hub

        errors = importlib.import_module("huggingface_hub.errors")
    except Exception:  # missing, or a broken install
        raise InputError(
            "reading a Hugging Face repo id needs huggingface_hub: pip install 'mxcli[hub]'"
        ) from None
    return huggingface_hub, errors


@dataclass
class HubSource:
    """One repo at one revision; `folder` is its cache snapshot once `fetch_metadata` ran."""

    repo_id: str
    revision: str | None = None
    folder: Path | None = None
    has_index: bool = False

    def _download(self, filename: str, *, optional: bool = False) -> Path | None:
        hub, errors = _hub()
        kwargs: dict[str, Any] = {"revision": self.revision, "local_files_only": offline()}
        cache = os.environ.get("HF_HUB_CACHE")
        if cache:
            kwargs["cache_dir"] = cache
        where = f"{self.repo_id}" + (f"@{self.revision}" if self.revision else "")
        try:
            return Path(hub.hf_hub_download(self.repo_id, filename, **kwargs))
        except errors.LocalEntryNotFoundError:
            if optional:
                return None
            why = "HF_HUB_OFFLINE is set" if offline() else "the Hub cannot be reached"
            raise HubError(
                f"{where}: {filename} is not in the Hugging Face cache and {why}"
            ) from None
        except errors.EntryNotFoundError:
            if optional:
                return None
            raise HubError(f"{where}: the repo has no file {filename}") from None
        except errors.RevisionNotFoundError:
            raise HubError(f"{where}: revision {self.revision!r} not found") from None
        except errors.RepositoryNotFoundError:
            raise HubError(f"{where}: repository not found (or gated without a token)") from None
        except OSError as exc:
            raise HubError(f"{where}: cannot fetch {filename} ({exc})") from None

    def fetch_metadata(self) -> Path:
        """Fetch ``config.json`` and the index (when the repo has one); the snapshot folder."""
        config = self._download("config.json")
        assert config is not None
        self.folder = config.parent
        self.has_index = self._download(INDEX_NAME, optional=True) is not None
        return self.folder

    def fetch_shards(self, files: list[str]) -> None:
        """Fetch these shards (names relative to the repo) into the snapshot folder."""
        for name in sorted(set(files)):
            path = self._download(name)
            assert path is not None
            if self.folder is not None and path.parent != self.folder:
                raise HubError(
                    f"{self.repo_id}: the revision moved while downloading ({name} landed in "
                    f"{path.parent}, not {self.folder}); pass --revision <commit>"
                )

    def shards_for(self, source_files: dict[str, str]) -> list[str]:
        """The shards holding the planned tensors (the single ``model.safetensors`` without
        an index)."""
        if not self.has_index:
            return [SINGLE_NAME]
        return sorted({f for f in source_files.values() if f})

    def describe(self) -> dict[str, Any]:
        """The manifest's ``source.hub`` entry (the commit is the snapshot folder's name)."""
        return {
            "repo_id": self.repo_id,
            "revision": self.revision,
            "commit": self.folder.name if self.folder is not None else None,
        }


def open_source(source: str | Path, revision: str | None = None) -> tuple[Path, HubSource | None]:
    """A local checkpoint folder as is, or a Hub repo id with its config and index fetched."""
    text = str(source)
    if isinstance(source, Path) or not looks_like_repo_id(text):
        if revision is not None:
            raise InputError(
                f"--revision applies to Hugging Face repo ids, and {text} is a local folder"
            )
        return Path(source), None
    hub = HubSource(text, revision)
    return hub.fetch_metadata(), hub
