"""Writing checkpoints: atomically (:func:`save`: the sidecar, then the ``.pt`` whose rename is the save), pruning the
older ones past ``keep`` and those set aside, removing what a killed write left (:func:`remove_torn`), and saying why
a write failed (:func:`torch_save`: the write's own ``OSError``; :class:`ExitCheckpointFailed` at a learner's exit).
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import time
from pathlib import Path
from typing import Any, BinaryIO

import torch
from prometheus_client import Counter

from learner.checkpoint_files import _PREFIX, DAMAGED, REFUSED, checkpoint_name, list_checkpoints
from learner.checkpoint_format import FORMAT_VERSION
from learner.checkpoint_lineage import lineage
from stream.errors import StreamrecError
from stream.files import NotDurable, describe_os_error, leftover_writer_alive, temp_of, write_atomic

log = logging.getLogger("streamrec.checkpoint")


class ExitCheckpointFailed(StreamrecError):
    """The checkpoint at a learner's exit could not be written (a full disk, a read-only or vanished directory): one
    line naming the path and the errno (:func:`exit_save_failed`), exit 1 at the CLI instead of a traceback. The
    ``OSError`` is its ``__cause__``."""


def exit_save_failed(directory: Path, exc: OSError) -> ExitCheckpointFailed:
    """The error of an exit checkpoint that raised ``exc``: what a restart resumes from, and the fix."""
    code = "" if exc.errno is None else f" [errno {errno.errorcode.get(exc.errno, exc.errno)}]"  # OSError("text"): none
    return ExitCheckpointFailed(
        f"the checkpoint at exit could not be written to {directory}: {describe_os_error(exc)}{code}; a "
        "restart resumes from the newest checkpoint written before and trains what came after it again. Free space "
        "or fix the directory, then restart")


class WriteErrors:
    """A binary file that remembers the first ``OSError`` its writes raised (torch.save swallows it: below); the
    rest of the file's methods are the file's (DCP's writer: ``learner/sharded_checkpoint.py``)."""

    def __init__(self, fh: BinaryIO) -> None:
        self.fh = fh
        self.error: OSError | None = None

    def write(self, data: bytes) -> int:
        try:
            return self.fh.write(data)
        except OSError as exc:
            if self.error is None:
                self.error = exc
            raise

    def flush(self) -> None:
        self.fh.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.fh, name)


def torch_save(obj: object, fh: BinaryIO) -> None:
    """``torch.save(obj, fh)``, raising the ``OSError`` of a write that failed as itself.

    torch's zip writer turns a failed write (a full disk, a quota, a file-size limit) into ``RuntimeError:
    [enforce fail at inline_container.cc] . unexpected pos 896 vs 790``: a periodic checkpoint, which the daemon
    survives on an ``OSError`` (a full disk is retried at the next interval), then stopped it, and every restart
    stopped again at its first checkpoint while the disk stayed full. Here the write's own error (ENOSPC, EDQUOT,
    EFBIG, EIO) is raised instead, from torch's."""
    out = WriteErrors(fh)
    try:
        torch.save(obj, out)  # type: ignore[arg-type]  # a file-like with write and flush is all it needs
    except OSError:
        raise
    except Exception as exc:
        if out.error is not None:
            raise out.error from exc
        raise


def remove_torn(directory: Path) -> list[Path]:
    """Remove the temp files of checkpoints whose writer was killed mid-write; returns them.

    ``write_atomic`` leaves its temp file (``.ckpt-<...>.pt.tmp-<pid>-<thread>``, up to a whole checkpoint's size)
    when its process is killed (SIGKILL, OOM, an eviction) while a checkpoint is written, and no load reads it. Each
    such kill leaked one: a learner killed now and then mid-checkpoint filled its disk, and then no checkpoint could
    be written at all. :func:`save` calls this first: a file of another live process (a second writer: a
    misconfiguration) is left alone, one of this pid too is removed (saves are sequential, and a container's
    learner is pid 1 after every restart)."""
    removed: list[Path] = []
    if not directory.is_dir():
        return removed
    for path in directory.iterdir():
        if path.name.startswith(_PREFIX) and path.suffix == ".json" and not path.with_suffix(".pt").exists():
            with contextlib.suppress(OSError):  # a sidecar whose checkpoint was never written (:func:`save`)
                path.unlink()
            continue
        temp = temp_of(path)
        if temp is None or not temp[0].startswith(_PREFIX) or leftover_writer_alive(temp[1]):
            continue
        try:
            size = path.stat().st_size
            path.unlink()
        except OSError as exc:
            log.warning("could not remove %s, left by a checkpoint write that was killed (%s)", path, exc)
            continue
        log.warning("removed %s (%d bytes), left by a checkpoint write that was killed", path, size)
        removed.append(path)
    return removed


def save(directory: Path, state: dict[str, Any], meta: dict[str, Any], keep: int = 3) -> Path:
    """Write checkpoint number ``meta['samples_trained']``; returns its path. What an earlier process killed while
    writing one left is removed first (:func:`remove_torn`).

    Pruning keeps this checkpoint and the ``keep - 1`` newest ones before it. Files named after it (a higher sample
    count) are neither pruned nor counted: they are the ones the learner's restore could not load (a damaged or
    foreign newest file, reported then) or another writer's. Counted, they took the place of good ones, and with
    ``keep = 1`` every checkpoint the learner wrote was deleted as soon as it was written, in silence.

    The sidecar is written first, the ``.pt`` last: the ``.pt``'s rename is the save (a restart loads the newest
    ``.pt``, meta and all). Written after it, a sidecar that failed (a full disk) left the ``.pt`` in place: the save
    counted as failed (exit 1 at exit) while the restart resumed from it, and ``--status`` reported the older
    checkpoint (its sidecar) as the one a restart reads. Now a failed save leaves no ``.pt``: the previous pair is what
    both read.

    :class:`stream.files.NotDurable` (raised after both files are written, before any pruning): the checkpoint is in
    place and a restart reads it, but the directory's fsync after a rename failed, so a power loss may undo it. Nothing
    is pruned then (the older ones are what such a loss leaves); the caller treats it as written, not as failed."""
    if keep < 1:  # list[:-0] is empty: nothing would ever be pruned
        raise ValueError(f"checkpoint keep must be >= 1, got {keep}")
    directory.mkdir(parents=True, exist_ok=True)
    remove_torn(directory)
    try:
        meta = {**meta, "format_version": FORMAT_VERSION, "created": time.time(),
                "lineage": meta.get("lineage") or lineage(directory)}
    except NotDurable as exc:  # LINEAGE's, before any checkpoint file: a failed checkpoint, not one written
        raise OSError(exc.errno, str(exc)) from exc
    try:  # (after the clock went back: still after the newest of its sample count)
        taken = [p.stem for p in list_checkpoints(directory)]
    except OSError:  # (EIO) named by the clock alone: the save goes on; its prune logs the listing's error
        taken = []
    name = checkpoint_name(_PREFIX, int(meta["samples_trained"]), taken)
    path, sidecar = directory / f"{name}.pt", directory / f"{name}.json"
    unsure = None
    for target, data in ((sidecar, json.dumps(meta, default=str).encode()),  # the .pt last: its rename is the save
                         (path, lambda fh: torch_save({"meta": meta, **state}, fh))):  # a failed write: its OSError
        try:
            write_atomic(target, data)
        except NotDurable as exc:  # in place (a restart reads it), its rename not known durable: go on, then say so
            unsure = unsure or exc
        except BaseException:
            if target == path:  # a sidecar without its checkpoint is never read (checkpoint_read.latest_meta);
                with contextlib.suppress(OSError):  # removed (else by the next save's :func:`remove_torn`)
                    sidecar.unlink(missing_ok=True)
            raise
    if unsure is not None:  # keep the older ones: a power loss may undo this one's rename, not their removal
        raise unsure
    try:  # the checkpoint is saved: a directory that cannot be listed now (EIO) is logged, never a failed save
        listed = list_checkpoints(directory)  # (oldest first, this one among them)
        older = listed[:listed.index(path)] if path in listed else []
        short = False
        for old in older[:max(0, len(older) - (keep - 1))]:
            try:  # (EPERM, EROFS: logged; raised, a durable checkpoint counted as failed)
                old.unlink(missing_ok=True)
                old.with_suffix(".json").unlink(missing_ok=True)
            except OSError as exc:
                short = True
                log.warning("cannot prune %s (%s); move it away", old, exc)
        if short:
            PRUNE_FAILURES.labels("checkpoints").inc()
        _prune_aside(directory, keep)
    except OSError as exc:
        PRUNE_FAILURES.labels("checkpoints").inc()
        log.warning("checkpoint %s is saved, but pruning older ones failed (%s); the next save prunes them", path,
                    exc)
    return path


def _prune_aside(directory: Path, keep: int) -> None:
    """Remove the checkpoints :func:`~learner.checkpoint_files.set_aside` renamed ``.damaged`` or marked ``.refused``
    but the newest ``keep`` of them all, with their sidecars (either name) and markers. A refused one's marker goes only
    once its checkpoint is gone (else it is listed again); one that cannot be removed (EPERM: why it was refused) is
    logged and kept. Refused ones were never pruned: each restart that fell back past one left a whole checkpoint behind
    for good."""
    aside = {p.name[: -len(DAMAGED)]: p for p in directory.glob(f"{_PREFIX}*.pt{DAMAGED}")}
    aside.update({p.name[: -len(REFUSED)]: p for p in directory.glob(f"{_PREFIX}*.pt{REFUSED}")})
    for name in sorted(aside)[:-keep]:
        pt, sidecar = directory / name, directory / f"{name[:-3]}.json"
        try:
            for p in (pt, pt.with_name(name + DAMAGED), sidecar, sidecar.with_name(sidecar.name + DAMAGED),
                      pt.with_name(name + REFUSED)):
                p.unlink(missing_ok=True)
        except OSError as exc:
            log.warning("cannot prune %s, set aside (%s); move it away", aside[name], exc)


PRUNE_FAILURES = Counter("streamrec_learner_prune_failures_total",
                         "Prunes after a checkpoint save (directory=checkpoints) or a serving delta (directory=deltas) "
                         "that left files they should have removed (the directory could not be listed, a file not "
                         "removed): logged, the write stands; rising for long, the directory grows until the disk "
                         "is full.", ["directory"])
