"""Atomic, self-describing checkpoints.

A checkpoint holds everything needed to continue exactly where training stopped: model and optimizer
state, the feature and model config it was trained with, the progressive metrics, the recent
impression ids (duplicate filter) and, per samples partition, the offset of the next message to
train. It is written to a temporary file, fsynced, renamed into place and the directory fsynced, so
a crash leaves either the old or the new checkpoint, never half of one. A small JSON sidecar with the
same name carries the metadata for ``streamrec train --status`` without loading the tensors.
The last ``keep`` checkpoints are kept.

Lineage: every checkpoint's meta carries ``lineage``, a random id kept in ``<directory>/LINEAGE`` and
created with the directory's first checkpoint (or its first delta writer, ``learner/deltas.py``). A
learner that resumes from the directory continues its lineage; one started in an empty directory begins
a new one. The refresh copies it into the artifact's manifest and serving applies a delta only to an
artifact of the delta's own lineage: rows and dense weights of two different trainings never mix.

Loading: ``load_latest(..., safe=True)`` (what ``cache_refresh`` uses) unpickles nothing but tensors,
numpy arrays and plain containers (``torch.load(weights_only=True)`` with numpy's array types allowed),
so a foreign file cannot run code in the refresh job.
"""

from __future__ import annotations

import json
import logging
import re
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import torch

from stream.files import write_atomic

log = logging.getLogger("streamrec.checkpoint")

FORMAT_VERSION = 1
_PREFIX = "ckpt-"
LINEAGE = "LINEAGE"
_LINEAGE_RE = re.compile(r"[0-9a-f]{32}")


def lineage(directory: Path) -> str:
    """The lineage id of the checkpoints in ``directory`` (created, durably, when there is none yet)."""
    directory = Path(directory)
    path = directory / LINEAGE
    try:
        text = path.read_text(encoding="ascii").strip()
    except (FileNotFoundError, UnicodeDecodeError):
        text = ""
    if _LINEAGE_RE.fullmatch(text):
        return text
    if text:
        log.error("%s holds %r, not a lineage id; starting a new lineage (serving applies this learner's deltas "
                  "only to artifacts refreshed from now on)", path, text[:40])
    directory.mkdir(parents=True, exist_ok=True)
    new = uuid.uuid4().hex
    write_atomic(path, new.encode())
    return new


def save(directory: Path, state: dict[str, Any], meta: dict[str, Any], keep: int = 3) -> Path:
    """Write checkpoint number ``meta['samples_trained']``; returns its path."""
    directory.mkdir(parents=True, exist_ok=True)
    meta = {**meta, "format_version": FORMAT_VERSION, "created": time.time(),
            "lineage": meta.get("lineage") or lineage(directory)}
    name = f"{_PREFIX}{int(meta['samples_trained']):015d}-{int(time.time() * 1000)}"
    path = directory / f"{name}.pt"
    write_atomic(path, lambda fh: torch.save({"meta": meta, **state}, fh))
    write_atomic(directory / f"{name}.json", json.dumps(meta, default=str).encode())
    for old in list_checkpoints(directory)[:-keep]:
        old.unlink(missing_ok=True)
        old.with_suffix(".json").unlink(missing_ok=True)
    return path


def list_checkpoints(directory: Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    if not directory.is_dir():
        return []
    return sorted(p for p in directory.glob(f"{_PREFIX}*.pt") if not p.name.startswith("."))


def _numpy_globals() -> list[Any]:
    """What ``torch.load(weights_only=True)`` needs to rebuild numpy arrays (the metrics' histograms)."""
    core = getattr(np, "_core", None) or np.core  # numpy 2 | 1
    dtypes = [getattr(np.dtypes, n) for n in dir(np.dtypes) if n.endswith("DType")]
    return [np.ndarray, np.dtype, core.multiarray._reconstruct, *dtypes]


def load(path: Path, safe: bool = False) -> dict[str, Any]:
    """One checkpoint file. ``safe``: tensors, numpy arrays and plain containers only (no code runs)."""
    if not safe:
        return torch.load(path, map_location="cpu", weights_only=False)
    with torch.serialization.safe_globals(_numpy_globals()):
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(ckpt, dict):
        raise ValueError(f"checkpoint {path} holds a {type(ckpt).__name__}, not a dict")
    return ckpt


def _reason(exc: BaseException) -> str:
    """One line of why a file did not load (torch's weights-only errors are a page long)."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    line = next((ln for ln in lines if "Unsupported global" in ln), lines[0] if lines else "")
    return f"{type(exc).__name__}: {line[:300]}"


def load_latest(directory: Path, safe: bool = False,
                problems: list[tuple[Path, str]] | None = None) -> dict[str, Any] | None:
    """The newest checkpoint that loads; a corrupt newest one is reported and the previous one used.

    ``problems`` (when given) receives ``(path, reason)`` of every file skipped on the way."""
    for path in reversed(list_checkpoints(directory)):
        try:
            ckpt = load(path, safe=safe)
        except Exception as exc:  # noqa: BLE001 - a torn or corrupt file: fall back to the previous one
            reason = _reason(exc)
            log.warning("checkpoint %s is unreadable (%s); trying the previous one", path, reason)
            if problems is not None:
                problems.append((path, reason))
            continue
        meta = ckpt.get("meta")
        version = meta.get("format_version") if isinstance(meta, dict) else None
        if version != FORMAT_VERSION:
            raise RuntimeError(f"checkpoint {path} has format {version!r}, this streamrec reads {FORMAT_VERSION}")
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
