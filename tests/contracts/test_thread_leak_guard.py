"""The thread-leak guard of tests/conftest.py: a test that leaves a thread running fails, naming the thread
and its target; threads that end within the grace period, or that a fixture stops in its teardown, do not
fail it; a module-scoped fixture that leaves one fails the module's last test;
``@pytest.mark.allow_thread_leak("why")`` lets a test with a known, reported leak pass."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from tests.conftest import leaked_threads, thread_leak_report

pytest_plugins = ["pytester"]
REPO = Path(__file__).resolve().parents[2]


def test_a_thread_still_running_is_reported_with_its_name_and_target() -> None:
    stop = threading.Event()
    before = set(threading.enumerate())
    t = threading.Thread(target=stop.wait, name="guard-demo-leak", daemon=True)
    t.start()
    try:
        leaked = leaked_threads(before, grace_s=0.1)
        assert leaked == [t]
        report = thread_leak_report(leaked)
        assert "'guard-demo-leak'" in report and "Event.wait" in report and "daemon" in report
    finally:
        stop.set()
        t.join(5)
    assert leaked_threads(before, grace_s=0.1) == []


def test_a_thread_that_ends_within_the_grace_period_is_not_a_leak() -> None:
    stop = threading.Event()
    before = set(threading.enumerate())
    t = threading.Thread(target=stop.wait, args=(0.3,), name="guard-demo-short")
    t.start()
    assert leaked_threads(before, grace_s=3.0) == []
    assert not t.is_alive()


def test_threads_that_were_already_running_are_not_blamed() -> None:
    stop = threading.Event()
    t = threading.Thread(target=stop.wait, name="guard-demo-older", daemon=True)
    t.start()
    try:
        assert leaked_threads(set(threading.enumerate()), grace_s=0.1) == []
    finally:
        stop.set()
        t.join(5)


INNER = '''
import threading

import pytest

STOP = threading.Event()


def _start(name):
    t = threading.Thread(target=STOP.wait, name=name, daemon=True)
    t.start()
    return t


@pytest.fixture
def worker():
    t = threading.Thread(target=STOP.wait, name="fixture-worker")
    t.start()
    yield t
    STOP.set()  # the fixture stops its thread in its teardown: before the guard looks
    t.join(5)
    STOP.clear()


def test_leaks_a_thread():
    _start("leaky-worker")


@pytest.mark.allow_thread_leak("a known leak in code this test cannot fix")
def test_leaks_a_thread_it_is_allowed_to():
    _start("allowed-worker")


def test_uses_a_fixture_that_stops_its_thread(worker):
    assert worker.is_alive()


def test_starts_nothing():
    pass
'''


INNER_MODULE = '''
import threading

import pytest

STOP = threading.Event()


@pytest.fixture(scope="module")
def shared_worker():
    t = threading.Thread(target=STOP.wait, name="module-worker", daemon=True)
    t.start()
    yield t  # never stopped: the module guard reports it after the module's last test


def test_first(shared_worker):
    assert shared_worker.is_alive()


def test_second(shared_worker):
    assert shared_worker.is_alive()
'''


def test_the_guard_fails_a_test_that_leaks_a_thread_and_only_that_test(pytester: pytest.Pytester,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    pytester.makeconftest("from tests.conftest import _no_thread_leaks, _no_thread_leaks_in_module  # noqa: F401\n")
    pytester.makeini("[pytest]\nmarkers =\n    allow_thread_leak(reason): see tests/conftest.py\n"
                     "addopts = --strict-markers -p no:cacheprovider\n")
    pytester.makepyfile(test_inner=INNER, test_inner_module=INNER_MODULE)
    result = pytester.runpytest_subprocess("-q", timeout=120)  # its own process: the leaks die with it
    result.assert_outcomes(passed=6, errors=2)
    result.stdout.fnmatch_lines(["*ERROR at teardown of test_leaks_a_thread*",
                                 "*'leaky-worker' (target threading.Event.wait, daemon)*"])
    result.stdout.fnmatch_lines(["*ERROR at teardown of test_second*",
                                 "*module-scoped fixtures: 1 thread(s)*'module-worker'*"])
    out = result.stdout.str()
    assert "allowed-worker" not in out and "fixture-worker" not in out and "test_first" not in out
