"""A FIFO fed by a writer thread, for tests that a file a path names is refused when it is no regular file.

Fed, a FIFO lets the defect (a blocking open, an unbounded read) show as a wrong answer instead of hanging the test
run: a reader that opens it reads ``content`` and the test fails on its assertion. Nothing here waits on a clock."""

from __future__ import annotations

import contextlib
import os
import select
import threading
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def fed_fifo(path: Path, content: bytes) -> Iterator[Path]:
    """A FIFO at ``path`` whose writer (a thread) writes ``content`` to the first reader that opens it, then closes.
    At exit a reader is opened without blocking (so that the writer's open returns), drained until the writer ends."""
    os.mkfifo(path)

    def feed() -> None:
        with contextlib.suppress(OSError):  # EPIPE: the reader refused it unread and closed at once
            with open(path, "wb") as fh:  # waits for a reader
                fh.write(content)

    writer = threading.Thread(target=feed, daemon=True)
    writer.start()
    try:
        yield path
    finally:  # drained until the writer is done: one blocked on a content over the pipe's buffer, its reader gone
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        try:
            while writer.is_alive():
                select.select([fd], [], [], 0.05)
                with contextlib.suppress(BlockingIOError):
                    os.read(fd, 1 << 16)
            writer.join()
        finally:
            os.close(fd)
