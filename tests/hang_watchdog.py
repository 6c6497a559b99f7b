"""A hard per-test watchdog under pytest-timeout: a test still running ``GRACE_S`` past its timeout is stopped.

pytest-timeout (``timeout`` in the ini, ``--timeout`` or a marker; signal method) fails a test by raising from
SIGALRM in the main thread. It fires once per test, and only where the main thread returns to the interpreter: a
teardown that blocks after the timeout fired (a ``join()`` or ``wait()`` with no bound), or a C call that retries
through the signal, blocks the worker for good. Under xdist the other worker then runs out of work, and the run waits
until CI kills it with no name for the test (a stop's CI ran past its 90 minutes this way, 57 tests short).

Here ``faulthandler.dump_traceback_later`` (a C thread that needs no GIL and no signal) is armed for every test, setup
to teardown, and dumps every thread's stack and ends the process if the test outlives it. xdist reports that worker
as crashed while running the test, starts another and goes on; the controller prints the stacks in its summary. The
dump is a file per process under the pytest cache (``hangs/``); without xdist, read it there. Only a file with
faulthandler's ``Timeout (...)!`` line is a hang: a worker that died otherwise (an OOM kill) left its header alone.
Known limits: a child made by a bare ``os.fork()`` while the timer is armed hangs in its interpreter exit (the
faulthandler lock is copied held; multiprocessing's and subprocess's children are not affected, as with pytest's own
``faulthandler_timeout``), and a killed worker's session fixtures are not torn down (its broker and Redis die with it:
tests/conftest.py starts them bound to the worker, ``LocalStack(bound=True)``)."""

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


def _item_timeout(item: pytest.Item) -> float:
    """pytest-timeout's limit for ``item`` (its marker, ``--timeout``, ``PYTEST_TIMEOUT`` or the ini); 0: none."""
    try:
        from pytest_timeout import _get_item_settings  # its own resolution of the limit

        return float(_get_item_settings(item).timeout or 0)
    except Exception:  # noqa: BLE001 - another pytest-timeout: the ini's value
        return float(item.config.getini("timeout") or 0)


class Watchdog:
    def __init__(self, config: pytest.Config, grace_s: float) -> None:
        name = config.workerinput["workerid"] if _is_worker(config) else "main"  # type: ignore[attr-defined]
        self.path = _dump_dir(config) / f"{name}-{os.getpid()}.txt"
        self.grace_s = grace_s
        self.deadline = 0.0
        self.fh: IO[str] = open(self.path, "w")  # noqa: SIM115 (held open: faulthandler writes to its fd)

    def arm(self, item: pytest.Item) -> None:
        timeout = _item_timeout(item)
        if timeout <= 0:
            return
        limit = timeout + self.grace_s
        self.fh.seek(0)
        self.fh.truncate()  # what a dump adds after this line starts with faulthandler's "Timeout (H:MM:SS)!"
        self.fh.write(f"{item.nodeid}: still running {limit:.0f} s after it started (setup to teardown; "
                      f"pytest-timeout's {timeout:g} s + {self.grace_s:g} s); every thread's stack:\n")
        self.fh.flush()
        self.deadline = time.monotonic() + limit
        faulthandler.dump_traceback_later(limit, exit=True, file=self.fh)

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
    if not config.pluginmanager.hasplugin("timeout") or getattr(config, "cache", None) is None:
        return
    if not _is_worker(config):  # the controller (or a run without xdist): dumps from an earlier run are gone
        for old in _dump_dir(config).glob("*.txt"):
            old.unlink(missing_ok=True)
    if _is_worker(config) or config.getoption("numprocesses", None) in (None, 0):
        _watchdog = Watchdog(config, float(config.getini("hang_watchdog_grace")))


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
    _watchdog.arm(item)
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
    # only a dump: a process that died otherwise (a segfault, an OOM kill) left its header line alone
    dumps = [p for p in sorted(_dump_dir(config).glob("*.txt")) if "Timeout (" in p.read_text(errors="replace")]
    for p in dumps:
        terminalreporter.section(f"hung test, stopped by tests/hang_watchdog.py ({p.name})", sep="=", red=True)
        terminalreporter.write(p.read_text(errors="replace"))
