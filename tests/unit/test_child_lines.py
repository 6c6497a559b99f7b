"""tests/child_lines.py, the helper that reads a child's stderr while a test waits for a line."""

from __future__ import annotations

import io
import queue
from typing import Any

from tests.child_lines import Lines


class _NoWaitQueue(queue.Queue):  # type: ignore[type-arg]
    """A queue that records each wait on it while empty and ends it at once (as if its timeout had passed)."""

    def __init__(self) -> None:
        super().__init__()
        self.waits: list[float | None] = []

    def get(self, block: bool = True, timeout: float | None = None) -> Any:
        if self.empty():
            self.waits.append(timeout)
            raise queue.Empty
        return super().get(block, timeout)


def test_wait_for_after_the_stream_ended_returns_false_without_waiting_its_timeout() -> None:
    """Once the child's stderr reached end of file no line can come: each later wait_for for text it did not print
    returned False only after its whole timeout (the end-of-file mark was taken by the first wait). Now every wait
    after the end returns False at once, and one for a line that came before the end still finds it."""
    reader = Lines(io.StringIO("starting\nready on 7000\n"))
    reader.join()  # the whole stream read, its end marked
    waits = _NoWaitQueue()
    while not reader.q.empty():
        waits.put(reader.q.get())
    reader.q = waits
    assert reader.wait_for("ready on", timeout_s=3600)
    assert not reader.wait_for("never printed", timeout_s=3600)
    assert not reader.wait_for("never printed", timeout_s=3600)
    assert waits.waits == []
    assert reader.text() == "starting\nready on 7000\n"
