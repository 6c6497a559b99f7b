"""The hard watchdog of tests/hang_watchdog.py: a test that outlives pytest-timeout's limit by the grace (here a
teardown that blocks after the timeout fired, which pytest-timeout's signal cannot end) is stopped, under xdist as a
crashed worker that names the test, and the run goes on and ends; the summary shows the hung thread's stack. Tests
that end in time leave no dump."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest_plugins = ["pytester"]
REPO = Path(__file__).resolve().parents[2]

INNER = '''
import threading
import time

import pytest

FOREVER = threading.Event()


@pytest.fixture
def blocks_in_teardown():
    yield
    FOREVER.wait()  # pytest-timeout fired in the call: nothing bounds this any more


def test_hangs_in_teardown_after_its_timeout(blocks_in_teardown):
    time.sleep(30)


@pytest.mark.parametrize("n", range(4))
def test_ends_in_time(n):
    assert n >= 0
'''


def _run(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, *args: str, inner: str = INNER
         ) -> pytest.RunResult:
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    pytester.makeini("[pytest]\ntimeout = 1\nhang_watchdog_grace = 2\n")
    pytester.makepyfile(test_inner=inner)
    # bounded by the watchdog; the limit is only a backstop: a loaded machine (a CI run's other workers, 5 copies of
    # this file at once) took the inner run past 60 s, where it takes 5-15 s alone
    return pytester.runpytest_subprocess("-p", "tests.hang_watchdog", *args, timeout=240)


def test_a_test_hung_past_its_timeout_is_stopped_and_named_under_xdist(pytester: pytest.Pytester,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    result = _run(pytester, monkeypatch, "-n", "2", "-p", "no:randomly")
    out = result.stdout.str()
    result.assert_outcomes(passed=4, failed=2)  # the call's timeout, then the worker's crash in its teardown
    result.stdout.fnmatch_lines(["*crashed while running*test_hangs_in_teardown_after_its_timeout*"])
    result.stdout.fnmatch_lines(["*hung test, stopped by tests/hang_watchdog.py*",
                                 "*test_hangs_in_teardown_after_its_timeout: still running 3 s after it started*"])
    assert "in blocks_in_teardown" in out  # the stack of the thread that hung


def test_without_xdist_the_hung_process_ends_and_leaves_the_stack_in_the_cache(pytester: pytest.Pytester,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    result = _run(pytester, monkeypatch, "-p", "no:xdist")
    assert result.ret == 1
    dumps = [p for p in (pytester.path / ".pytest_cache" / "d" / "hangs").glob("main-*.txt") if p.stat().st_size]
    assert len(dumps) == 1
    text = dumps[0].read_text()
    assert "test_hangs_in_teardown_after_its_timeout: still running 3 s" in text and "in blocks_in_teardown" in text


def test_a_worker_that_dies_otherwise_is_not_reported_as_hung(pytester: pytest.Pytester,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """The dump file holds its header line from the start of every test: a worker killed some other way (here its
    own SIGKILL: an OOM kill, a segfault) left it, and was reported as a hang."""
    inner = "import os\nimport signal\n\n\ndef test_dies():\n    os.kill(os.getpid(), signal.SIGKILL)\n"
    result = _run(pytester, monkeypatch, "-n", "2", "-p", "no:randomly", inner=inner)
    result.stdout.fnmatch_lines(["*crashed while running*test_dies*"])
    assert "hung test" not in result.stdout.str()
