"""An ``os.fsync`` whose calls on a directory fail (EIO) and on a file go through: a directory's fsync failing
after a rename, the case ``stream.files.NotDurable`` names (the checkpoint tests of both learners). Test code only."""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Callable


def failing_directory_fsync(real: Callable[[int], None] = os.fsync) -> Callable[[int], None]:
    """The stand-in for ``os.fsync`` (``monkeypatch.setattr(os, "fsync", failing_directory_fsync())``)."""
    def fsync(fd: int) -> None:
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            raise OSError(errno.EIO, "Input/output error")
        real(fd)

    return fsync
