"""Atomic, self-describing checkpoints.

A checkpoint holds everything needed to continue exactly where training stopped: model and optimizer
state, the feature and model config it was trained with, the progressive metrics, the recent
impression ids (duplicate filter) and, per samples partition, the offset of the next message to
train. It is written to a temporary file, fsynced, renamed into place and the directory fsynced, so
a crash leaves either the old or the new checkpoint, never half of one. A small JSON sidecar with the
same name carries the metadata for ``streamrec train --status`` without loading the tensors.
The last ``keep`` checkpoints up to the one just written are kept (:func:`save`), and the temp file of a write that
was killed is removed by the next save (:func:`remove_torn`).

Lineage: every checkpoint's meta carries ``lineage``, a random id kept in ``<directory>/LINEAGE`` and
created with the directory's first checkpoint (or its first delta writer, ``learner/deltas.py``). A
learner that resumes from the directory continues the lineage of the checkpoint it resumes from
(:func:`continue_lineage`: one of another lineage makes the directory's ``LINEAGE`` its own); one that resumes
no checkpoint begins a new one (:func:`begin_lineage`), even where an earlier training's ``LINEAGE`` is left. The
refresh copies it into the artifact's manifest and serving applies a delta only to an artifact of the delta's own
lineage: rows and dense weights of two different trainings never mix. Beside it, ``<directory>/DELTA_SEQ``
records the largest delta seq the lineage's writers took (``learner/deltas.py`` "Numbering"), so none is used twice
when the deltas directory is emptied.

Loading: every load (the learner's resume, :func:`restore_latest`, as much as the refresh's
:func:`load_latest`) unpickles nothing but tensors, numpy arrays and plain containers
(``torch.load(weights_only=True)`` with numpy's array types allowed, :func:`load`), after checking every record
against the CRC-32 its writer stored (torch does not: a bit flipped on disk inside a tensor loaded as a wrong
weight; now it is a damaged file, and the previous checkpoint is used), so a foreign file
cannot run code in the learner or the refresh job: a file holding anything else (a pickled callable, a
class) is refused unread, named with the global it wanted. Everything :func:`save` writes loads that way
(the learner's state is tensors, numpy arrays and plain values: ``tests/contracts/test_state_round_trip.py``
and ``tests/unit/learner/test_safe_loads.py`` check it), so the layout did not change for it. There is no
unrestricted load any more; ``safe=False`` is accepted and means the same.

Types and versions: a loaded checkpoint is a :class:`Checkpoint`; ``FORMAT_VERSION`` counts layout changes and
:func:`upgrade` brings every older version up to date. The format, its version history and the meta's checked
fields: ``learner/checkpoint_format.py``.

Where each part lives (this module holds none of it: it hands their public names on, so
``from learner import checkpoint`` reads every one):

- ``learner/checkpoint_format.py``: :class:`Checkpoint`, ``FORMAT_VERSION``, :func:`upgrade`, the meta's counts, typed
  fields and samples topic identity;
- ``learner/checkpoint_files.py``: the files' names (:func:`checkpoint_name`) and their order (:func:`newest_last`),
  :func:`list_checkpoints`, :func:`set_aside`;
- ``learner/checkpoint_write.py``: :func:`save`, :func:`remove_torn`, :func:`torch_save`, the exit save's error;
- ``learner/checkpoint_read.py``: :func:`load`, :func:`load_latest`, :func:`restore_latest`, :func:`latest_meta`;
- ``learner/checkpoint_lineage.py``: ``LINEAGE``, :func:`lineage`, :func:`begin_lineage`, :func:`continue_lineage`;
- ``learner/checkpoint_directory.py``: :func:`check_directory`, ``LOCK``, :func:`hold_directory`.
"""

from __future__ import annotations

import logging

from learner.checkpoint_directory import LOCK, check_directory, hold_directory, release_directory
from learner.checkpoint_files import (
    DAMAGED,
    REFUSED,
    checkpoint_name,
    checkpoint_order,
    list_checkpoints,
    newest_last,
    set_aside,
)
from learner.checkpoint_format import (
    FORMAT_VERSION,
    TOPIC_IDENTITY,
    TYPED_FIELDS,
    Checkpoint,
    CheckpointError,
    count,
    mistyped,
    partition_counts,
    same_topic,
    state_counts,
    topic_recorded,
    upgrade,
)
from learner.checkpoint_lineage import LINEAGE, begin_lineage, continue_lineage, lineage
from learner.checkpoint_read import latest_meta, load, load_latest, restore_latest
from learner.checkpoint_write import (
    PRUNE_FAILURES,
    ExitCheckpointFailed,
    WriteErrors,
    exit_save_failed,
    remove_torn,
    save,
    torch_save,
)

__all__ = [
    "FORMAT_VERSION", "LINEAGE", "LOCK", "DAMAGED", "REFUSED", "TYPED_FIELDS", "TOPIC_IDENTITY", "PRUNE_FAILURES",
    "Checkpoint", "CheckpointError", "ExitCheckpointFailed", "WriteErrors", "begin_lineage", "check_directory",
    "checkpoint_name", "checkpoint_order", "newest_last",
    "continue_lineage", "count", "exit_save_failed", "hold_directory", "latest_meta", "lineage", "list_checkpoints",
    "load", "load_latest", "mistyped", "partition_counts", "release_directory", "remove_torn", "restore_latest",
    "same_topic", "save", "set_aside", "state_counts", "topic_recorded", "torch_save", "upgrade",
]

log = logging.getLogger("streamrec.checkpoint")  # the logger every checkpoint module logs to
