"""Atomic, self-describing checkpoints.

A checkpoint holds everything needed to continue exactly where training stopped: model and optimizer
state, the feature and model config it was trained with, the progressive metrics, the recent
impression ids (duplicate filter) and, per samples partition, the offset of the next message to
train. It is written to a temporary file, fsynced, renamed into place and the directory fsynced, so
a crash leaves either the old or the new checkpoint, never half of one. A small JSON sidecar with the
same name carries the metadata for ``streamrec train --status`` without loading the tensors.
The last ``keep`` checkpoints are kept.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import torch

FORMAT_VERSION = 1
_PREFIX = "ckpt-"


def fsync_dir(path: Path) -> None:
    """Make the directory's entries (a rename, a new file) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_synced(path: Path, write: Any) -> None:
    """``write(fh)`` into ``path``, then flush and fsync the file."""
    with open(path, "wb") as fh:
        write(fh)
        fh.flush()
        os.fsync(fh.fileno())


def _write_atomic(path: Path, write: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    write_synced(tmp, write)
    os.replace(tmp, path)


def save(directory: Path, state: dict[str, Any], meta: dict[str, Any], keep: int = 3) -> Path:
    """Write checkpoint number ``meta['samples_trained']``; returns its path."""
    directory.mkdir(parents=True, exist_ok=True)
    meta = {**meta, "format_version": FORMAT_VERSION, "created": time.time()}
    name = f"{_PREFIX}{int(meta['samples_trained']):015d}-{int(time.time() * 1000)}"
    path = directory / f"{name}.pt"
    _write_atomic(path, lambda fh: torch.save({"meta": meta, **state}, fh))
    _write_atomic(directory / f"{name}.json", lambda fh: fh.write(json.dumps(meta, default=str).encode()))
    fsync_dir(directory)
    for old in list_checkpoints(directory)[:-keep]:
        old.unlink(missing_ok=True)
        old.with_suffix(".json").unlink(missing_ok=True)
    return path


def list_checkpoints(directory: Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    if not directory.is_dir():
        return []
    return sorted(p for p in directory.glob(f"{_PREFIX}*.pt") if not p.name.startswith("."))


def load_latest(directory: Path) -> dict[str, Any] | None:
    """The newest checkpoint that loads; a corrupt newest one is reported and the previous one used."""
    for path in reversed(list_checkpoints(directory)):
        try:
            ckpt = torch.load(path, map_location="cpu", weights_only=False)
        except Exception as exc:  # noqa: BLE001 - a torn or corrupt file: fall back to the previous one
            print(f"streamrec: checkpoint {path} is unreadable ({exc}); trying the previous one")
            continue
        if ckpt.get("meta", {}).get("format_version") != FORMAT_VERSION:
            raise RuntimeError(f"checkpoint {path} has format {ckpt.get('meta', {}).get('format_version')}, "
                               f"this streamrec reads {FORMAT_VERSION}")
        ckpt["path"] = str(path)
        return ckpt
    return None


def latest_meta(directory: Path) -> dict[str, Any] | None:
    for path in reversed(list_checkpoints(directory)):
        side = path.with_suffix(".json")
        if side.is_file():
            meta = json.loads(side.read_text())
            meta["path"] = str(path)
            return meta
    return None
