"""The files of a checkpoint directory: how checkpoints are named (``ckpt-<samples>-<ms>.pt``, a ``.json`` sidecar
beside each), which of them are listed (:func:`list_checkpoints`), and those the learner's restore fell back past, set
aside as ``.damaged`` or marked ``.refused`` (:func:`set_aside`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from pathlib import Path

from stream.files import write_atomic

log = logging.getLogger("streamrec.checkpoint")

_PREFIX = "ckpt-"
DAMAGED = ".damaged"  # the suffix of a checkpoint the learner's restore fell back past (:func:`set_aside`)
REFUSED = ".refused"  # beside a checkpoint set aside that could not be renamed: it is not listed (:func:`set_aside`)


def checkpoint_name(prefix: str, samples: int, names: Iterable[str]) -> str:
    """The name of a new checkpoint of ``samples`` samples trained: ``<prefix><samples:015d>-<ms>``, ``ms`` the time
    now, or one past the newest of ``names`` (the listed checkpoints', without suffix) of the same sample count when
    the clock went back since that one was named (an NTP step, a VM restored). Loads and pruning take the greatest
    name as the newest: named by the clock alone, a checkpoint written after such a step with no sample trained since
    the last (the exit's after a periodic one, duplicates and dead-lettered messages read meanwhile) sorted before it,
    so the restart resumed the older one's offsets and read those messages again, and pruning counted it as older.
    Both the single-process checkpoints (:data:`_PREFIX`) and the sharded ones (``learner/sharded_checkpoint.py``)."""
    head = f"{prefix}{samples:015d}-"
    taken = [int(n[len(head):]) + 1 for n in names if n.startswith(head) and n[len(head):].isdigit()]
    return f"{head}{max([int(time.time() * 1000), *taken])}"


def set_aside(paths: list[Path]) -> None:
    """Rename each checkpoint (and its sidecar) the learner's restore fell back past to ``<name>.damaged``: kept for
    forensics, never listed or loaded again, the oldest pruned past ``keep`` by :func:`~learner.checkpoint_write.save`.
    Left in place, named after every later checkpoint (so never pruned), it made every later restart a fallback past it,
    each resending the whole table to serving. A checkpoint that cannot be renamed (EPERM: another owner's file in a
    sticky directory) gets a ``<name>.refused`` file beside it instead (pruned like a renamed one), and
    :func:`list_checkpoints` passes it over; only when that cannot be written either is it refused again at the next
    restart (logged)."""
    for path in paths:
        done: str | None = path.name + DAMAGED  # what it was set aside as (logged); None: neither
        for p in (path, path.with_suffix(".json")):
            try:
                p.rename(p.with_name(p.name + DAMAGED))
            except FileNotFoundError:
                pass
            except OSError as exc:
                if p != path:  # (a sidecar: read only for a listed checkpoint)
                    continue
                done = p.name + REFUSED
                try:
                    write_atomic(p.with_name(done), f"did not load; cannot be renamed: {exc}\n".encode())
                except OSError as exc2:
                    done = None
                    log.error("cannot set %s aside (%s) nor mark it refused (%s): the next restart falls back past "
                              "it again and resends every row; move it away", p, exc, exc2)
                    continue
                log.error("cannot rename %s aside (%s): marked %s, never listed again; move both away", p, exc, done)
        if done is not None:
            log.warning("checkpoint %s did not load: set aside (%s; never loaded, kept for forensics)", path.name,
                        done)


def list_checkpoints(directory: Path) -> list[Path]:
    """Complete checkpoints, oldest first (not those set aside: :func:`set_aside`)."""
    if not directory.is_dir():
        return []
    return sorted(p for p in directory.glob(f"{_PREFIX}*.pt")
                  if not p.name.startswith(".") and not p.with_name(p.name + REFUSED).exists())
