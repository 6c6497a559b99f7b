"""``streamrec train`` under torchrun takes SIGTERM/SIGINT from its sharded learner's build to rank 0's summary, as
the single-process path does (test_train_stop_signals.py). The learner's run took them for its own length and its
close put the process's own back, so a stop in the rest of the rank's leave (the directory's LOCK released, the
process group destroyed) killed the rank: no summary, status -15 where a stop during the run ends with the summary and
status 0. Each run here is a child process (the old behaviour kills it) with stand-ins for ``run_ranks``'s pieces (the
rank context, the learner, the directory lock), so no process group is needed; the stops arrive in the group's leave,
where the stand-in also checks that nothing kept the learner alive (its DMP and DDP hold the group)."""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path

from tests.python_child import last_json, run_python

CHILD = """
import os, signal, sys, weakref
import learner.distributed, learner.sharded_daemon
from stream.stop_signals import put_back_signals, take_stop_signals
from streamrec.cli import main

STOPS_AT_LEAVE, SIGNALLED, EARLY = int(sys.argv[1]), sys.argv[2] == "signalled", sys.argv[2] == "early"
BUILT = []

class Context:
    rank, world_size, local_rank, backend, distributed = 0, 2, 0, "gloo", True
    @classmethod
    def from_env(cls, env, device_type="cpu"):
        return cls()
    def init(self, timeout_s=600.0):
        pass
    def close(self):  # destroy_process_group's place
        if BUILT[0]() is not None:
            print("learner alive at the leave", file=sys.stderr, flush=True)
        for _ in range(STOPS_AT_LEAVE):
            os.kill(os.getpid(), signal.SIGTERM)
        print("group left", file=sys.stderr, flush=True)

class ShardedLearner:
    def __init__(self, *args, **kwargs):
        self._handlers, self._stop = {}, False
        BUILT.append(weakref.ref(self))
    def _on_signal(self, signum, frame):
        self._stop = True
    def stop(self):
        self._stop = True
    @property
    def stopped(self):
        return self._stop
    def run(self):
        if EARLY:  # a stop after the learner's build, before its run took the signals over
            os.kill(os.getpid(), signal.SIGTERM)
        take_stop_signals(self._handlers, self._on_signal)
        if SIGNALLED:  # the operator's stop ends the run
            os.kill(os.getpid(), signal.SIGTERM)
        return {"reason": "signal" if self._stop else "no samples arrived", "samples_trained": 7}
    def close(self):
        put_back_signals(self._handlers)

learner.distributed.RankContext = Context
learner.sharded_daemon.ShardedLearner = ShardedLearner
learner.sharded_daemon.hold_checkpoint_dir = lambda ls, rank: None
learner.sharded_daemon.check_same_settings = lambda *args: None
sys.exit(main(["train", "--checkpoint-dir", sys.argv[3], "--device", "cpu", "--json"]))
"""


def _train(tmp_path: Path, stops_at_leave: int, how: str = "-") -> subprocess.CompletedProcess[str]:
    return run_python(CHILD, str(stops_at_leave), how, str(tmp_path / "ckpt"), timeout_s=300)


def test_a_sigterm_in_the_ranks_group_leave_still_leaves_and_prints_rank_0s_summary_with_status_0(
        tmp_path: Path) -> None:
    done = _train(tmp_path, stops_at_leave=1)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert "group left" in done.stderr
    summary = last_json(done)
    assert (summary["samples_trained"], summary["reason"]) == (7, "no samples arrived")


def test_the_stops_taken_keep_nothing_of_the_learner_past_the_group_leave(tmp_path: Path) -> None:
    done = _train(tmp_path, stops_at_leave=0)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert "group left" in done.stderr
    assert "learner alive at the leave" not in done.stderr


def test_a_second_sigterm_in_the_ranks_group_leave_is_the_process_own_again(tmp_path: Path) -> None:
    done = _train(tmp_path, stops_at_leave=2)
    assert done.returncode == -signal.SIGTERM, (done.returncode, done.stderr[-2000:])
    assert "group left" not in done.stderr


def test_a_sigterm_in_the_leave_after_a_run_a_sigterm_ended_is_the_operators_second_and_the_process_own(
        tmp_path: Path) -> None:
    stopped = _train(tmp_path, stops_at_leave=0, how="signalled")
    assert stopped.returncode == 0, (stopped.returncode, stopped.stderr[-2000:])
    assert last_json(stopped)["reason"] == "signal"
    done = _train(tmp_path, stops_at_leave=1, how="signalled")
    assert done.returncode == -signal.SIGTERM, (done.returncode, done.stderr[-2000:])
    assert "group left" not in done.stderr


def test_a_sigterm_after_the_learners_build_before_its_run_takes_the_signals_stops_the_run_with_its_summary(
        tmp_path: Path) -> None:
    done = _train(tmp_path, stops_at_leave=0, how="early")
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert last_json(done)["reason"] == "signal"
