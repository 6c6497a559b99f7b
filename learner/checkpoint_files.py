"""The files of a checkpoint directory: how checkpoints are named (``ckpt-<samples>-<ms>.pt``, a ``.json`` sidecar
beside each), which of them are listed (:func:`list_checkpoints`), and those the learner's restore fell back past, set
aside as ``.damaged`` or marked ``.refused`` (:func:`set_aside`).
"""

from __future__ import annotations

import logging
import re
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


_NAME = re.compile(r"([0-9]+)-([0-9]+)")  # what follows the prefix in a name :func:`checkpoint_name` gives
_passed_over: set[Path] = set()  # names said not to be checkpoints' (once each in a process)


def checkpoint_order(path: Path, prefix: str = _PREFIX, suffix: str = "") -> tuple[int, int] | None:
    """``(samples trained, ms)`` of a checkpoint named by :func:`checkpoint_name` (``<prefix><samples>-<ms>`` and
    ``suffix``), the order of age; None for any other name under ``prefix`` (``ckpt-backup.pt``: an operator's copy)."""
    name = path.name
    if not (name.startswith(prefix) and name.endswith(suffix)):
        return None
    m = _NAME.fullmatch(name[len(prefix):len(name) - len(suffix)])
    return None if m is None else (int(m[1]), int(m[2]))


def newest_last(paths: Iterable[Path], prefix: str = _PREFIX, suffix: str = "") -> list[Path]:
    """``paths`` named as checkpoints are (:func:`checkpoint_order`), oldest first; any other name is passed over with
    a WARNING (once a process): sorted by name, an operator's copy ``ckpt-backup.pt`` (or ``dcp-old/``) came after
    every checkpoint, so each restart resumed from it (a state of the past, its samples trained again) and pruning,
    which keeps the newest, never removed it."""
    named: list[tuple[tuple[int, int], Path]] = []
    for p in paths:
        if (order := checkpoint_order(p, prefix, suffix)) is not None:
            named.append((order, p))
        elif p not in _passed_over:
            _passed_over.add(p)
            log.warning("%s is not named as a checkpoint (%s<samples trained>-<ms>%s): not loaded nor pruned; move "
                        "it out of the checkpoint directory", p, prefix, suffix)
    return [p for _, p in sorted(named)]


def list_checkpoints(directory: Path) -> list[Path]:
    """Complete checkpoints, oldest first (not those set aside: :func:`set_aside`; not a file named otherwise:
    :func:`newest_last`)."""
    if not directory.is_dir():
        return []
    return newest_last((p for p in directory.glob(f"{_PREFIX}*.pt")
                        if not p.name.startswith(".") and not p.with_name(p.name + REFUSED).exists()), suffix=".pt")
