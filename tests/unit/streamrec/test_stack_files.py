"""``streamrec stack``'s files in its state directory (a service's pid file, its log) are opened with
``stream.files``' non-blocking opens: a FIFO there is refused (the pid file taken as none and replaced, the log a
StackError naming it), where a blocking open hung ``stack up``/``down``/``status`` for good.

The pid FIFO is fed a valid pid file by a writer thread (``tests.fifos``) and the log FIFO has a reader open, so the
old code read or opened them and fails on the assertion instead of hanging the run."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from streamrec.stack import LocalStack, StackError, StackSettings, free_port
from tests.fifos import fed_fifo

PID = json.dumps({"pid": 1, "port": 1, "command": ["/bin/true"]}).encode()


def test_a_pid_file_that_is_a_fifo_is_taken_as_none_and_logged(tmp_path: Path,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    stack = LocalStack(StackSettings(state_dir=tmp_path))
    with fed_fifo(tmp_path / "kafka.pid.json", PID):
        assert stack._read_pid("kafka") is None
    assert "not a regular file" in caplog.text
    (tmp_path / "redis.pid.json").write_bytes(PID)
    assert stack._read_pid("redis") == json.loads(PID)  # a regular file as before
    (tmp_path / "redis.pid.json").write_bytes(b"[1]")
    assert stack._read_pid("redis") is None  # valid JSON, no pid file: no KeyError later


def test_a_service_log_that_is_a_fifo_is_a_stack_error_naming_it_and_nothing_starts(tmp_path: Path) -> None:
    stack = LocalStack(StackSettings(state_dir=tmp_path))
    os.mkfifo(tmp_path / "redis.log")
    reader = os.open(tmp_path / "redis.log", os.O_RDONLY | os.O_NONBLOCK)  # the old blocking open found it
    try:
        with pytest.raises(StackError, match=r"redis: cannot open its log .*not a regular file"):
            stack._ensure("redis", Path("/bin/true"), free_port(), [], lambda _: True, {})
    finally:
        os.close(reader)
    assert not (tmp_path / "redis.pid.json").exists()


@pytest.mark.parametrize("content", [b"[" * 5000, b'{"pid":' * 5000, b"\xff", b"1" * 5000, b""],
                         ids=["nested-array", "nested-object", "not-utf8", "huge-int", "empty"])
def test_a_pid_file_that_is_not_json_a_stack_wrote_is_taken_as_none(tmp_path: Path, content: bytes) -> None:
    """``[[[[...`` deeper than json recurses raised RecursionError out of ``stack up``, ``down`` and ``status``."""
    stack = LocalStack(StackSettings(state_dir=tmp_path))
    (tmp_path / "redis.pid.json").write_bytes(content)
    assert stack._read_pid("redis") is None
