"""stream.files.listens_on: whether a started server's own process listens on its port (the stack's broker readiness,
streamrec/stack.py), read from /proc."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

from stream.files import listens_on


def test_this_process_listens_on_the_port_of_its_listening_socket_and_not_on_a_bound_one() -> None:
    with socket.socket() as listening, socket.socket() as bound:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        bound.bind(("127.0.0.1", 0))
        assert listens_on(os.getpid(), listening.getsockname()[1])
        assert not listens_on(os.getpid(), bound.getsockname()[1])


def test_a_process_that_is_gone_listens_on_nothing() -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        assert not listens_on(child.pid, listening.getsockname()[1])


def test_where_there_is_no_proc_to_ask_a_process_counts_as_listening(tmp_path: Path) -> None:
    """No /proc (not Linux, not mounted): the docstring's "True when that cannot be told", which the readiness probe
    relies on. The missing /proc/PID/fd was taken for a process gone, and the stack's broker never counted as ready
    there: ``stack up`` failed after its start timeout, its broker running."""
    assert listens_on(os.getpid(), 9092, proc=tmp_path)
    (tmp_path / "self" / "fd").mkdir(parents=True)  # a /proc that can tell, without that process: gone
    assert not listens_on(os.getpid(), 9092, proc=tmp_path)

