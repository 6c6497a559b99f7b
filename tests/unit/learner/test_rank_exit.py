"""A rank's exit (learner/sharded_daemon.py ``run_ranks``): nothing of the learner may outlive the ``except`` that
runs before ``destroy_process_group``, not even through an exception chained to the one being raised."""

from __future__ import annotations

import gc
import weakref

from learner.sharded_daemon import clear_chained_frames


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
