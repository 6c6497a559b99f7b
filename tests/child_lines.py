"""A child process's output read line by line in a thread as it comes (a pipe left unread fills and stops the
child), with a bounded wait for a line holding some text."""

from __future__ import annotations

import queue
import threading
import time
from typing import Any


class Lines(threading.Thread):
    """A child's stderr, line by line, with a wait for a line containing some text."""

    def __init__(self, stream: Any) -> None:
        super().__init__(daemon=True)
        self.stream, self.lines, self.q = stream, [], queue.Queue()
        self.start()

    def run(self) -> None:
        for line in self.stream:
            self.lines.append(line)
            self.q.put(line)
        self.q.put(None)

    def wait_for(self, text: str, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                line = self.q.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                return False
            if line is None:  # end of file: put back, so a later wait returns at once too (not after its timeout)
                self.q.put(None)
                return False
            if text in line:
                return True
        return False

    def text(self) -> str:
        return "".join(self.lines)
