"""A FIFO fed by a writer thread, for tests that a file a path names is refused when it is no regular file.

Fed, a FIFO lets the defect (a blocking open, an unbounded read) show as a wrong answer instead of hanging the test
run: a reader that opens it reads ``content`` and the test fails on its assertion. Nothing here waits on a clock."""

from __future__ import annotations

import contextlib
import os
import select
import shutil
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def fed_fifo(path: Path, content: bytes) -> Iterator[Path]:
    """A FIFO at ``path`` whose writer (a thread) writes ``content`` to the first reader that opens it, then closes.
    At exit a reader is opened without blocking (so that the writer's open returns), drained until the writer ends.

    The writer and that reader open the FIFO through a hard link of their own (in a directory of their own), not
    through ``path``: the code under test may replace what is at ``path`` (a state file written anew over the FIFO),
    and then a writer not started yet wrote ``content`` into the new file, and one blocked in its open waited for
    good, the reader at exit opening the new file instead (a test hung on a loaded machine: 300 s, pytest-timeout)."""
    os.mkfifo(path)
    own = Path(tempfile.mkdtemp(prefix="fifo-", dir=path.parent.parent))  # the same file system: a hard link works
    fifo = own / "fifo"
    os.link(path, fifo)

    def feed() -> None:
        with contextlib.suppress(OSError):  # EPIPE: the reader refused it unread and closed at once
            with open(fifo, "wb") as fh:  # waits for a reader
                fh.write(content)

    writer = threading.Thread(target=feed, daemon=True)
    writer.start()
    try:
        yield path
    finally:  # drained until the writer is done: one blocked on a content over the pipe's buffer, its reader gone
        fd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
        try:
            while writer.is_alive():
                select.select([fd], [], [], 0.05)
                with contextlib.suppress(BlockingIOError):
                    os.read(fd, 1 << 16)
            writer.join()
        finally:
            os.close(fd)
            shutil.rmtree(own, ignore_errors=True)
