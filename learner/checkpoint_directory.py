"""The checkpoint directory itself: checked writable at start (:func:`check_directory`), and held by the one learner
that trains into it (``<directory>/LOCK``: :func:`hold_directory`, :func:`release_directory`).
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path

from stream.errors import ConfigError
from stream.files import describe_os_error
from stream.lock_file import LockHeld, hold_lock, release_lock

log = logging.getLogger("streamrec.checkpoint")

LOCK = "LOCK"  # held (flock) by the learner training into the directory: :func:`hold_directory`


def check_directory(directory: Path, setting: str) -> None:
    """A :class:`ConfigError` naming ``setting`` (``"[learner] checkpoint_dir"``) and the path unless ``directory`` is a
    directory this process can write files into (made, with its parents, when missing). Checked at start, before any
    work: a regular file there, or a directory nobody may write, ended the learner in a traceback (NotADirectoryError
    from the strikes file, or the first checkpoint's write after minutes of training)."""
    directory = Path(directory)
    if directory.exists() and not directory.is_dir():
        raise ConfigError(f"{setting} {directory} is a file, not a directory: name a directory (it is made when "
                          "missing), or move the file away")
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=directory):  # a file made and gone: writes there will succeed
            pass
    except OSError as exc:
        raise ConfigError(f"{setting} {directory} is no directory this process can write into "
                          f"({describe_os_error(exc)}): name one it can write, or fix its permissions") from None


def hold_directory(directory: Path) -> int | None:
    """Take ``<directory>/LOCK`` for the learner that trains into it: an exclusive ``flock`` held while the returned
    descriptor is open (the kernel releases it when the process ends, however it ends), the holder's pid written in
    it. A :class:`ConfigError` naming the directory and that pid when another process holds it: two learners on one
    directory each numbered their serving deltas from their own counter, so two different models' deltas took one seq
    (serving applied one and skipped the other for good), and each pruned the other's checkpoints. A filesystem that
    cannot lock (ENOLCK, EOPNOTSUPP): a WARNING that a second learner is not detected there, and None; one where
    the LOCK cannot be opened at all: a :class:`ConfigError` naming it."""
    directory = Path(directory)
    try:  # a directory or LOCK that cannot be opened (LOCK a directory or a link, no permission, a read-only mount):
        directory.mkdir(parents=True, exist_ok=True)  # the operator's to mend, exit 2 naming it (a traceback, exit 1)
        return hold_lock(directory / LOCK, "learner on this directory", log)
    except LockHeld as exc:
        raise ConfigError(f"[learner] checkpoint_dir {directory} is in use by another learner (pid {exc.holder}, "
                          f"holding {LOCK}): stop it first, or give this one its own checkpoint_dir") from None
    except OSError as exc:
        raise ConfigError(f"[learner] checkpoint_dir {directory}: cannot open its {LOCK} ({describe_os_error(exc)}); "
                          "the learner needs the directory writable, with LOCK a regular file or absent") from None


def release_directory(fd: int | None) -> None:
    """Give back what :func:`hold_directory` took (None: nothing)."""
    release_lock(fd)
