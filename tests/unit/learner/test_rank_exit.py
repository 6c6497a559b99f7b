"""A rank's exit (learner/sharded_daemon.py ``run_ranks``): nothing of the learner may outlive the ``except`` that
runs before ``destroy_process_group``, not even through an exception chained to the one being raised; and the error a
rank raises is its run's, not its learner close's (``_train``)."""

from __future__ import annotations

import gc
import logging
import weakref
from pathlib import Path
from typing import Any

import pytest

from learner.sharded_daemon import clear_chained_frames
from tests.unit.learner.test_sharded_directory_lock import train


class _Learner:
    """Stands in for the sharded learner (its DMP and DDP hold the process group)."""


def _run_then_close_both_raising() -> tuple[BaseException, weakref.ref[_Learner]]:
    def run(learner: _Learner) -> None:
        raise RuntimeError("run failed")

    def close(learner: _Learner) -> None:
        raise OSError("close failed too")

    learner = _Learner()
    ref = weakref.ref(learner)
    try:
        try:
            run(learner)
        finally:
            close(learner)
    except BaseException as exc:  # noqa: BLE001 - the test keeps what a rank's except keeps
        caught = exc
    del learner
    return caught, ref


def test_a_learner_held_only_by_a_chained_exceptions_frames_is_freed_once_the_chain_is_cleared() -> None:
    exc, ref = _run_then_close_both_raising()
    assert isinstance(exc, OSError) and isinstance(exc.__context__, RuntimeError)
    gc.collect()
    assert ref() is not None  # the frames of run() and close() still hold it, through both exceptions
    clear_chained_frames(exc)
    gc.collect()
    assert ref() is None


def test_clearing_the_raised_exceptions_frames_alone_is_not_enough() -> None:
    """What run_ranks did before: ``run()``'s frame sits in ``__context__``'s traceback, which that misses."""
    import traceback

    exc, ref = _run_then_close_both_raising()
    traceback.clear_frames(exc.__traceback__)
    gc.collect()
    assert ref() is not None
    clear_chained_frames(exc)
    gc.collect()
    assert ref() is None


def test_a_chain_that_loops_is_cleared_once_per_exception() -> None:
    exc, ref = _run_then_close_both_raising()
    assert exc.__context__ is not None
    exc.__context__.__context__ = exc  # a loop: close's error -> run's error -> close's error
    clear_chained_frames(exc)  # returns: each exception is visited once
    gc.collect()
    assert ref() is None


@pytest.mark.usefixtures("one_rank_group")
def test_a_rank_whose_run_fails_and_whose_learner_close_fails_too_raises_the_runs_error_and_logs_the_closes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """``_train`` closed the learner in a bare ``finally``: a close failing after the run had failed (a full disk)
    replaced the run's error, and the rank's exit named the close. As ``streamrec train`` (close_after_error)."""
    import learner.sharded_daemon as sd

    real_close = sd.ShardedLearner.close

    def run(self: Any) -> dict[str, Any]:
        raise RuntimeError("the run failed")

    def close(self: Any) -> None:
        real_close(self)
        raise OSError("the close failed too")

    monkeypatch.setattr(sd.ShardedLearner, "close", close)
    with caplog.at_level(logging.ERROR, logger="streamrec.train"), pytest.raises(RuntimeError, match="the run failed"):
        train(monkeypatch, tmp_path / "ckpt", run)
    assert "closing the learner after the error below failed too" in caplog.text
    assert "the close failed too" in caplog.text
