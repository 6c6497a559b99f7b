"""The lineage of a checkpoint directory: which training its checkpoints and deltas are of.

Every checkpoint's meta carries ``lineage``, a random id (:data:`_LINEAGE_RE`: 32 hex digits) kept in
``<directory>/LINEAGE`` and created with the directory's first checkpoint (or its first delta writer,
``learner/deltas.py``): :func:`lineage` reads it, :func:`begin_lineage` starts a new one for a learner that resumes no
checkpoint, :func:`continue_lineage` makes the resumed checkpoint's the directory's. Why it exists, and how the
refresh and serving use it: ``learner/checkpoint.py`` ("Lineage").
"""

from __future__ import annotations

import logging
import re
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from stream.files import MAX_STATE_FILE_BYTES, FileTooLarge, NotRegularFile, read_regular, write_atomic

log = logging.getLogger("streamrec.checkpoint")

LINEAGE = "LINEAGE"
_LINEAGE_RE = re.compile(r"[0-9a-f]{32}")


def _read_lineage(path: Path) -> str:
    """The text of a ``LINEAGE`` file, "" when there is none or it is no lineage file: undecodable, or not a regular
    file or more than :data:`~stream.files.MAX_STATE_FILE_BYTES` (a FIFO there hung the learner's start; logged, and
    the caller replaces it as it does a file holding no lineage id)."""
    try:
        return read_regular(path, MAX_STATE_FILE_BYTES, "a lineage file").decode("ascii").strip()
    except (FileNotFoundError, UnicodeDecodeError):
        return ""
    except (NotRegularFile, FileTooLarge) as exc:
        log.error("%s; it is taken as holding no lineage id", exc)
        return ""


def lineage(directory: Path) -> str:
    """The lineage id of the checkpoints in ``directory`` (created, durably, when there is none yet)."""
    directory = Path(directory)
    path = directory / LINEAGE
    text = _read_lineage(path)
    if _LINEAGE_RE.fullmatch(text):
        return text
    if text:
        log.error("%s holds %r, not a lineage id; starting a new lineage (serving applies this learner's deltas "
                  "only to artifacts refreshed from now on)", path, text[:40])
    return begin_lineage(directory)


def begin_lineage(directory: Path) -> str:
    """A new lineage id, made the directory's ``LINEAGE`` (durably): a learner that resumes no checkpoint trains a new
    model, whatever ``LINEAGE`` an earlier training left there (its checkpoints moved away). Kept, it numbered the new
    model's deltas past that training's ``DELTA_SEQ`` under its lineage, and serving applied an untrained model's rows
    and dense weights to that training's artifact."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    new = uuid.uuid4().hex
    write_atomic(directory / LINEAGE, new.encode())
    return new


def continue_lineage(directory: Path, meta: Mapping[str, Any], source: Path) -> str:
    """The lineage of the checkpoint (``meta``, read from ``source``) a learner resumes from, made the directory's
    (``LINEAGE``) if it is not. Both daemons call it before their delta writer reads ``LINEAGE`` (the sharded one on
    rank 0, which alone writes deltas and checkpoint metadata).

    The model is the checkpoint's training, so its next checkpoints and deltas are of that lineage. A checkpoint of
    another lineage in the directory (a backup of another training restored into it, checkpoints copied to a new
    volume without their ``LINEAGE``) was resumed under the directory's id: its deltas then carried the lineage of
    the directory's earlier training, and serving applied them to that training's artifact, mixing the two models'
    rows and dense weights. A checkpoint without a lineage (written before lineages) continues the directory's."""
    theirs = meta.get("lineage")
    if not (isinstance(theirs, str) and _LINEAGE_RE.fullmatch(theirs)):
        return lineage(directory)
    path = Path(directory) / LINEAGE
    mine = _read_lineage(path)
    if mine != theirs:
        log.warning("resuming from %s of lineage %s in %s, whose %s was %r: the directory continues the "
                    "checkpoint's lineage (deltas apply to artifacts of that training only)", source, theirs,
                    directory, LINEAGE, mine[:40] or None)
        write_atomic(path, theirs.encode())
    return theirs
