"""A hard per-test watchdog under pytest-timeout: a test still running ``GRACE_S`` after its timeout is stopped.

pytest-timeout (the ini's ``timeout``, signal method) fails a test by raising from SIGALRM in the main thread. It
fires once per test, and only where the main thread returns to the interpreter: a teardown that blocks after the
timeout fired (a ``join()`` or ``wait()`` with no bound), or a C call that retries through the signal, blocks the
worker for good. Under xdist the other worker then runs out of work, and the run waits until CI kills it with no
name for the test (a stop's CI ran past its 90 minutes this way, 57 tests short).

Here ``faulthandler.dump_traceback_later`` (a C thread that needs no GIL and no signal) is armed for every test, setup
to teardown, and dumps every thread's stack and ends the process if the test outlives it. xdist reports that worker
as crashed while running the test, starts another and goes on; the controller prints the stacks in its summary. The
dump is a file per process under the pytest cache (``hangs/``); without xdist, read it there."""

from __future__ import annotations

import faulthandler
import os
import time
from collections.abc import Generator
from pathlib import Path
from typing import IO

import pytest

GRACE_S = 60.0  # past pytest-timeout's own limit: it gets the first chance, with its clean failure

_DIR = "hangs"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addini("hang_watchdog_grace", f"seconds past pytest-timeout's limit before tests/hang_watchdog.py ends a "
                  f"hung test's process (default {GRACE_S:.0f})", default=str(GRACE_S))


def _dump_dir(config: pytest.Config) -> Path:
    assert config.cache is not None
    return config.cache.mkdir(_DIR)


def _is_worker(config: pytest.Config) -> bool:
    return hasattr(config, "workerinput")


class Watchdog:
    def __init__(self, config: pytest.Config, limit_s: float) -> None:
        name = config.workerinput["workerid"] if _is_worker(config) else "main"  # type: ignore[attr-defined]
        self.path = _dump_dir(config) / f"{name}-{os.getpid()}.txt"
        self.limit_s = limit_s
        self.deadline = 0.0
        self.fh: IO[str] = open(self.path, "w")  # noqa: SIM115 (held open: faulthandler writes to its fd)

    def arm(self, nodeid: str) -> None:
        self.fh.seek(0)
        self.fh.truncate()
        self.fh.write(f"{nodeid} still ran {self.limit_s:.0f} s after it started (setup to teardown); "
                      "every thread's stack:\n")
        self.fh.flush()
        self.deadline = time.monotonic() + self.limit_s
        faulthandler.dump_traceback_later(self.limit_s, exit=True, file=self.fh)

    def rearm(self) -> None:
        """pytest's faulthandler plugin cancels the timer on every failed test (``pytest_exception_interact``):
        set again, for what is left of the limit, before that failure's teardown runs."""
        if self.deadline:
            faulthandler.dump_traceback_later(max(self.deadline - time.monotonic(), 0.1), exit=True, file=self.fh)

    def disarm(self) -> None:
        faulthandler.cancel_dump_traceback_later()
        self.deadline = 0.0
        self.fh.seek(0)
        self.fh.truncate()

    def close(self) -> None:
        faulthandler.cancel_dump_traceback_later()
        self.fh.close()
        self.path.unlink(missing_ok=True)


_watchdog: Watchdog | None = None


def pytest_configure(config: pytest.Config) -> None:
    global _watchdog
    timeout = float(config.getini("timeout") or 0)
    if timeout <= 0 or getattr(config, "cache", None) is None:
        return
    if not _is_worker(config):  # the controller (or a run without xdist): dumps from an earlier run are gone
        for old in _dump_dir(config).glob("*.txt"):
            old.unlink(missing_ok=True)
    if _is_worker(config) or config.getoption("numprocesses", None) in (None, 0):
        _watchdog = Watchdog(config, timeout + float(config.getini("hang_watchdog_grace")))


def pytest_unconfigure(config: pytest.Config) -> None:
    global _watchdog
    if _watchdog is not None:
        _watchdog.close()
        _watchdog = None


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None, None, None]:
    if _watchdog is None:
        yield
        return
    _watchdog.arm(item.nodeid)
    try:
        yield
    finally:
        _watchdog.disarm()


@pytest.hookimpl(trylast=True)  # after pytest's faulthandler plugin (tryfirst) cancelled the timer
def pytest_exception_interact() -> None:
    if _watchdog is not None:
        _watchdog.rearm()


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    if _is_worker(config) or getattr(config, "cache", None) is None:
        return
    dumps = [p for p in sorted(_dump_dir(config).glob("*.txt")) if p.stat().st_size > 0]
    for p in dumps:
        terminalreporter.section(f"hung test, stopped by tests/hang_watchdog.py ({p.name})", sep="=", red=True)
        terminalreporter.write(p.read_text(errors="replace"))
