"""The CLI's error for a service of the local stack that did not start keeps the last lines of its log, each escaped.

``stream.startup.not_started`` puts the last lines the service wrote under the error that shows them; the CLI's error
line went through ``quoted(text, 2000)``, which printed them as one line of literal ``\\n`` and cut the whole at 2,000
characters: the head and the log's first lines, not its last, the one that says why."""

from __future__ import annotations

from pathlib import Path

import pytest

from stream.startup import not_started
from streamrec.cli import main
from streamrec.stack import LocalStack, StackError

COMPLAINT = "error: unexpected argument '--bogus' found"


def fail_up(monkeypatch: pytest.MonkeyPatch, text: str) -> None:
    def up(self: LocalStack) -> None:
        raise StackError(text)

    monkeypatch.setattr(LocalStack, "up", up)


def test_a_service_that_exited_at_start_shows_the_last_lines_of_its_log_each_on_its_own_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    log = tmp_path / "kafka.log"
    log.write_text("".join(f"INFO chatter {n} " + "x" * 170 + "\n" for n in range(9)) + f"\x1b[31m{COMPLAINT}\n")
    fail_up(monkeypatch, not_started("kafka", "127.0.0.1:19092", 2, 20.0, log, 0, "run `streamrec stack up` again"))
    assert main(["stack", "up", "--state-dir", str(tmp_path / "state")]) == 1
    first, *rest = capsys.readouterr().err.splitlines()
    assert first.startswith("streamrec stack: error: kafka exited at start (exit status 2)") and first.endswith(
        f"the last lines of {log}:")
    assert len(rest) == 10 and rest[0].startswith("  INFO chatter 0 ")
    assert rest[-1] == f"  \\x1b[31m{COMPLAINT}"  # the last line, its escape sequence escaped


def test_a_line_break_in_an_error_message_starts_an_indented_line_and_the_lines_are_bounded(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    fail_up(monkeypatch, "bad\nstreamrec stack: ok" + "\n" * 100_000 + "A" * 100_000)
    assert main(["stack", "up", "--state-dir", str(tmp_path / "state")]) == 1
    lines = capsys.readouterr().err.splitlines()
    assert lines[:2] == ["streamrec stack: error: bad", "  streamrec stack: ok"]
    assert len(lines) == 22 and lines[-1] == "  ... (99981 more lines)"
