"""The tests' session ``stack`` fixture (tests/conftest.py) leaves no broker or Redis behind: not when one of its
services fails to start after the other did, not when the session is killed before its teardown (SIGTERM, SIGKILL:
the hang watchdog's exit, an OOM kill). Each case runs an inner pytest session in its own process, on its own
basetemp, and then looks at the processes its pid files name."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from stream.files import process_matches
from streamrec.stack import LocalStack, StackSettings

pytest_plugins = ["pytester"]

REPO = Path(__file__).resolve().parents[2]
GONE_WITHIN_S = 30.0  # a bound on the wait for a killed process to be reaped, not a timing under test


def _run_inner(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, test: str) -> tuple[Path, int]:
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    pytester.makeconftest("from tests.conftest import stack  # noqa: F401\n")
    pytester.makeini("[pytest]\naddopts = -p no:cacheprovider\n")
    pytester.makepyfile(test_inner=test)
    basetemp = pytester.path / "inner-tmp"
    result = pytester.runpytest_subprocess("-q", f"--basetemp={basetemp}", timeout=120)
    return basetemp, result.ret


def _live_services(basetemp: Path) -> list[str]:
    """The services a pid file under ``basetemp`` names that still run (their process, its start time)."""
    live = []
    for pid_file in basetemp.glob("**/*.pid.json"):
        info = json.loads(pid_file.read_text())
        if process_matches(info["pid"], Path(info["command"][0]).name, info.get("started")):
            live.append(f"{pid_file.name} (pid {info['pid']})")
    return live


def _stop_leftovers(basetemp: Path) -> None:
    """What the inner session started and left running: stopped by the stack's own down (its identity checks)."""
    for state_dir in {p.parent for p in basetemp.glob("**/*.pid.json")}:
        LocalStack(StackSettings(state_dir=state_dir)).down()


def _started_broker(basetemp: Path) -> bool:
    return any("ready in" in log.read_text(errors="replace") for log in basetemp.glob("**/kafka.log"))


def test_the_session_stack_stops_its_broker_when_its_redis_then_fails_to_start(
        pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    fake = tmp_path / "bin" / "redis-server"  # found first on PATH (streamrec.stack.redis_binary): exits at once
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\necho 'no redis here' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}:{os.environ['PATH']}")
    basetemp, ret = _run_inner(pytester, monkeypatch, "def test_uses_the_stack(stack):\n    pass\n")
    try:
        assert ret == pytest.ExitCode.TESTS_FAILED  # the fixture's StackError: an error at setup
        assert _started_broker(basetemp), "the inner session never started its broker: this test proves nothing"
        assert _live_services(basetemp) == []
    finally:
        _stop_leftovers(basetemp)


@pytest.mark.parametrize("signal_name", ["SIGTERM", "SIGKILL"])
def test_the_session_stack_does_not_outlive_a_session_killed_before_its_teardown(
        pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, signal_name: str) -> None:
    inner = ("import os, signal\n\n"
             f"def test_killed_while_the_stack_runs(stack):\n    os.kill(os.getpid(), signal.{signal_name})\n")
    basetemp, ret = _run_inner(pytester, monkeypatch, inner)
    try:
        assert ret < 0, f"the inner session was not killed (exit {ret})"
        assert _started_broker(basetemp), "the inner session never started its broker: this test proves nothing"
        deadline = time.monotonic() + GONE_WITHIN_S
        while _live_services(basetemp) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _live_services(basetemp) == []
    finally:
        _stop_leftovers(basetemp)
