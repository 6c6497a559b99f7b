"""``streamrec train`` takes SIGTERM/SIGINT from its learner's run to its summary. The run took them for its own length
and ``Learner.close`` put the process's own back first, so a stop that came in the rest of the close (the group
consumer's leave, the checkpoint directory's LOCK released) or while the summary was printed killed the process: no
summary, status -15 where a stop during the run ends with the summary and status 0. Each run here is a child process
(the old behaviour kills it) with a stand-in learner whose run takes the signals as the daemon's does (taken, put back
by its close); the stops arrive in the close."""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path

from tests.python_child import last_json, run_python

CHILD = """
import os, signal, sys
import learner.daemon
from stream.stop_signals import put_back_signals, take_stop_signals
from streamrec.cli import main

STOPS_AT_CLOSE, SIGNALLED, EARLY = int(sys.argv[1]), sys.argv[2] == "signalled", sys.argv[2] == "early"

class Learner:
    def __init__(self, *args, **kwargs):
        self._handlers, self._stop = {}, False
    def _on_signal(self, signum, frame):
        self._stop = True
    def stop(self):
        self._stop = True
    @property
    def stopped(self):
        return self._stop
    def run(self):
        if EARLY:  # a stop before the run took the signals over
            os.kill(os.getpid(), signal.SIGTERM)
        take_stop_signals(self._handlers, self._on_signal)
        if SIGNALLED:  # the operator's stop ends the run
            os.kill(os.getpid(), signal.SIGTERM)
        return {"reason": "signal" if self._stop else "input idle", "samples_trained": 7}
    def close(self):
        put_back_signals(self._handlers)
        for _ in range(STOPS_AT_CLOSE):
            os.kill(os.getpid(), signal.SIGTERM)
        print("directory released", file=sys.stderr, flush=True)

learner.daemon.Learner = Learner
sys.exit(main(["train", "--checkpoint-dir", sys.argv[3], "--device", "cpu", "--json"]))
"""


def _train(tmp_path: Path, stops_at_close: int, how: str = "-") -> subprocess.CompletedProcess[str]:
    return run_python(CHILD, str(stops_at_close), how, str(tmp_path / "ckpt"), timeout_s=300)


def test_a_sigterm_in_the_learners_close_still_releases_and_prints_the_summary_with_status_0(tmp_path: Path) -> None:
    done = _train(tmp_path, stops_at_close=1)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert "directory released" in done.stderr
    summary = last_json(done)
    assert (summary["samples_trained"], summary["reason"]) == (7, "input idle")


def test_a_second_sigterm_in_the_learners_close_is_the_process_own_again(tmp_path: Path) -> None:
    done = _train(tmp_path, stops_at_close=2)
    assert done.returncode == -signal.SIGTERM, (done.returncode, done.stderr[-2000:])
    assert "directory released" not in done.stderr


def test_a_sigterm_after_a_run_a_sigterm_ended_is_the_operators_second_and_the_process_own(tmp_path: Path) -> None:
    """The learner's close puts back what its run replaced: here the command's taking, which hands the operator's
    second stop on to the process's own."""
    stopped = _train(tmp_path, stops_at_close=0, how="signalled")
    assert stopped.returncode == 0, (stopped.returncode, stopped.stderr[-2000:])
    assert last_json(stopped)["reason"] == "signal"
    done = _train(tmp_path, stops_at_close=1, how="signalled")
    assert done.returncode == -signal.SIGTERM, (done.returncode, done.stderr[-2000:])
    assert "directory released" not in done.stderr


def test_a_sigterm_before_the_run_takes_the_signals_stops_the_run_with_its_summary(tmp_path: Path) -> None:
    done = _train(tmp_path, stops_at_close=0, how="early")
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert last_json(done)["reason"] == "signal"
