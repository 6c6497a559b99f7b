"""A lock file: one process at a time on a directory or file (``fcntl.flock``, exclusive, not waiting).

The kernel releases the lock when its holder ends, however it ends (SIGKILL included), so a dead holder never blocks
the next start. The holder's pid is written in the file, for the refusal's message.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import stat
from collections.abc import Iterator
from pathlib import Path

from stream.files import describe_os_error

log = logging.getLogger("streamrec")


class LockHeld(OSError):
    """Another process holds the lock: ``holder`` is the pid written in the file ("not known" where none is)."""

    def __init__(self, path: Path, holder: str) -> None:
        super().__init__(f"{path} is held by another process (pid {holder})")
        self.path, self.holder = path, holder


def hold_lock(path: Path, who: str = "process using it", logger: logging.Logger = log) -> int | None:
    """Take ``path`` (made if absent) for this process: the descriptor, the lock held while it is open (close it to
    release). :class:`LockHeld` naming the holder's pid when another process holds it; an OSError when the file
    cannot be opened (a directory, a symbolic link, a FIFO, no permission); None, with a WARNING on ``logger``, on a
    filesystem that cannot lock (ENOLCK, EOPNOTSUPP): a second ``who`` is not detected there. A forked child closes its
    copy of the descriptor, so a child outliving its parent does not keep the lock."""
    path = Path(path)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):  # a FIFO opens (O_NONBLOCK); its pid write failed, EINVAL
        os.close(fd)
        raise OSError("not a regular file")
    # a hard link (a directory copied with cp -al, a file linked there) is another file too: the pid written into it
    # truncated that file, and its first bytes were read as a pid. Locked all the same, its contents left alone
    own = st.st_nlink == 1
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = (os.pread(fd, 32, 0).decode("ascii", "replace").strip() if own else "") or "not known"
        os.close(fd)
        raise LockHeld(path, holder) from None
    except OSError as exc:
        os.close(fd)
        logger.warning("cannot lock %s (%s): a second %s is not detected", path, describe_os_error(exc), who)
        return None
    if not own:
        logger.warning("lock file %s is a hard link to another file: locked, its contents left alone (no pid written); "
                    "remove it, so that the next start makes a lock file of its own", path)
    else:
        try:  # the pid, for the refusal's message; a failure (a full disk) must not leave the lock held
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except BaseException:
            os.close(fd)
            raise
    _HELD.add(fd)
    return fd


def release_lock(fd: int | None) -> None:
    """Release a lock :func:`hold_lock` took (None: none was taken)."""
    if fd is not None:
        _HELD.discard(fd)
        with contextlib.suppress(OSError):
            os.close(fd)


@contextlib.contextmanager
def locked(path: Path, who: str, logger: logging.Logger = log) -> Iterator[None]:
    """:func:`hold_lock` on ``path`` for the ``with`` block, released at its end (:class:`LockHeld` when another process
    holds it: not waited for)."""
    fd = hold_lock(path, who, logger)
    try:
        yield
    finally:
        release_lock(fd)


# The lock descriptors this process holds. A forked child (a DataLoader worker) closes its copies: holding one, it
# kept the lock for the seconds it outlives a SIGKILLed parent, and the parent's restart was refused meanwhile.
_HELD: set[int] = set()


def _drop_held_in_child() -> None:
    for fd in _HELD:
        with contextlib.suppress(OSError):
            os.close(fd)
    _HELD.clear()


os.register_at_fork(after_in_child=_drop_held_in_child)
