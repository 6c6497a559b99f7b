"""``streamrec serve`` called in-process (tests, embedding programs) leaves the process as it found it: its
SIGTERM/SIGINT handlers and torch's thread count are the caller's again after it returns or raises. It left its own
handler (a lambda on a dead service's stop event: a later Ctrl-C did nothing) and its own thread count behind."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from serving.service import ScoringService
from streamrec.cli import main

CALLER_THREADS = 3  # serve runs with --threads 1


def _callers_handler(signum: int, frame: Any) -> None:
    """The caller's own handler: serve must put it back."""


@pytest.fixture
def caller_state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The caller's handlers and thread count, set before serve runs; the session's put back after the test."""
    monkeypatch.chdir(tmp_path)  # no streamrec.toml of the checkout
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    threads = torch.get_num_threads()
    for s in saved:
        signal.signal(s, _callers_handler)
    torch.set_num_threads(CALLER_THREADS)
    try:
        yield
    finally:
        for s, h in saved.items():
            signal.signal(s, h)
        torch.set_num_threads(threads)


def _serve(tmp_path: Path) -> int:
    return main(["serve", "--no-redis", "--port", "0", "--device", "cpu", "--threads", "1",
                 "--publish-root", str(tmp_path)])


def _assert_callers_state_is_back() -> None:
    assert signal.getsignal(signal.SIGTERM) is _callers_handler
    assert signal.getsignal(signal.SIGINT) is _callers_handler
    assert torch.get_num_threads() == CALLER_THREADS


def test_serve_stopped_by_sigterm_puts_back_the_callers_handlers_and_threads(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caller_state: None) -> None:
    real_start = ScoringService.start
    seen: dict[str, Any] = {}

    def start_then_sigterm(self: ScoringService) -> ScoringService:
        svc = real_start(self)
        seen["threads"] = torch.get_num_threads()
        signal.raise_signal(signal.SIGTERM)  # what an operator's SIGTERM does: serve's handler, a clean stop
        return svc

    monkeypatch.setattr(ScoringService, "start", start_then_sigterm)
    assert _serve(tmp_path) == 0
    assert seen["threads"] == 1  # serve ran with its own count
    _assert_callers_state_is_back()


@pytest.mark.parametrize(("error", "exit_code"), [(RuntimeError("the port is taken"), None),
                                                  (KeyboardInterrupt(), 130)], ids=["error", "keyboard_interrupt"])
def test_serve_that_raises_puts_back_the_callers_handlers_and_threads(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caller_state: None, error: BaseException,
        exit_code: int | None) -> None:
    def failing_start(self: ScoringService) -> ScoringService:
        self.stop(grace_s=0.0)  # as the real start does on a failure: nothing of it left running
        raise error

    monkeypatch.setattr(ScoringService, "start", failing_start)
    if exit_code is None:  # an unexpected error propagates from main
        with pytest.raises(type(error)):
            _serve(tmp_path)
    else:  # Ctrl-C: main's exit code
        assert _serve(tmp_path) == exit_code
    _assert_callers_state_is_back()


def test_serves_summary_is_redacted_and_written_as_the_other_commands_are(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caller_state: None,
        capsys: pytest.CaptureFixture[str]) -> None:
    """serve printed its summary with a print of its own: not through ``emit``'s redaction, so the updater's last
    error (a reason that may quote a ``redis://user:password@host`` URL) went to stdout whole, and not flushed."""
    real_start = ScoringService.start

    def start_fail_then_sigterm(self: ScoringService) -> ScoringService:
        svc = real_start(self)
        svc.updater.last_error = "cannot read redis://streamrec:hunter2@redis.internal:6379/0 (refused)"
        signal.raise_signal(signal.SIGTERM)
        return svc

    monkeypatch.setattr(ScoringService, "start", start_fail_then_sigterm)
    assert _serve(tmp_path) == 0
    out = capsys.readouterr().out
    assert "serve summary" in out and "redis.internal" in out, out
    assert "hunter2" not in out, out
