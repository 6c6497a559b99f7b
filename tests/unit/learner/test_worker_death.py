"""A DataLoader worker that dies on its own (OOM-killed, a SIGKILL from outside, a segfault in a library) is no
message's fault: torch raises its death in the training process wherever that process is, inside a training step
too, and every message of the batch in hand got a strike for it, so a few such deaths dead-lettered innocent messages
as poison. A batch that failed for its data still strikes its messages (``stream/strikes.py``)."""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from torch.utils.data import DataLoader, IterableDataset

from learner.daemon import strike_failed_batch
from learner.kafka_dataset import not_the_batch, worker_died
from stream.strikes import FileStrikes, Strikes

KEYS = [("samples", 0, 7), ("samples", 1, 3)]


class _PidThenWait(IterableDataset):
    """Yields its worker's pid, then waits for good (until the test kills the worker)."""

    def __iter__(self) -> Iterator[int]:
        yield os.getpid()
        threading.Event().wait()


def test_a_dataloader_worker_killed_by_a_signal_gives_the_batch_in_hand_no_strikes(tmp_path: Path) -> None:
    strikes = Strikes(FileStrikes(tmp_path / "strikes.json"), limit=1)
    it = iter(DataLoader(_PidThenWait(), batch_size=None, num_workers=1))
    pid = next(it)
    with pytest.raises(RuntimeError) as died:
        os.kill(pid, signal.SIGKILL)
        os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)  # dead, not reaped: torch's own checks find it
        next(it)  # torch's SIGCHLD handler raised by now (as inside a training step), or the loader finds it gone
    del it  # its shutdown closes the worker's index queue: the queue's feeder thread ends
    assert worker_died(died.value), str(died.value)
    assert strike_failed_batch(strikes, KEYS, died.value) is False
    assert not strikes.counts and not Strikes(FileStrikes(tmp_path / "strikes.json"), limit=1).counts
    # the same batch failing for its data: every message gets a strike (limit 1: poison at once)
    assert strike_failed_batch(strikes, KEYS, RuntimeError("index 9 is out of bounds for dimension 0")) is True
    assert all(strikes.poisoned(k) for k in KEYS)


@pytest.mark.parametrize("text", [
    "DataLoader worker (pid 4242) is killed by signal: Killed. ",
    "DataLoader worker (pid 4242) is killed by signal: Segmentation fault. ",
    "DataLoader worker (pid 4242) is killed by signal: Bus error. It is possible that dataloader's workers are out "
    "of shared memory. Please try to raise your shared memory limit.",
    "DataLoader worker (pid 4242) exited unexpectedly with exit code 1. Details are lost due to multiprocessing. "
    "Rerunning with num_workers=0 may give better error trace.",
    "DataLoader worker (pid(s) 4242, 4243) exited unexpectedly",
])
def test_every_form_of_torchs_worker_death_is_no_fault_of_the_batch(text: str) -> None:
    assert not_the_batch(RuntimeError(text))


@pytest.mark.parametrize("exc", [
    RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x3 and 5x6)"),
    ValueError("DataLoader worker (pid 4242) is killed by signal: Killed."),  # only torch's RuntimeError
    RuntimeError("Caught ValueError in DataLoader worker process 0."),  # a worker's own exception, passed on
])
def test_a_batch_that_failed_on_its_data_is_still_its_fault(exc: Exception) -> None:
    assert not not_the_batch(exc)


def test_a_rank_whose_dataloader_worker_died_strikes_nothing_and_blames_no_round(tmp_path: Path) -> None:
    """On N ranks, the rank whose worker died neither strikes its messages nor tells its peers that the round failed
    for its data (learner/sharded_daemon.py, ``_strike_round``); a data failure does both."""
    from types import SimpleNamespace

    from learner.sharded_daemon import ShardedLearner

    strikes = Strikes(FileStrikes(tmp_path / "strikes.json"), limit=1)
    rank = SimpleNamespace(ctx=SimpleNamespace(rank=0))
    ShardedLearner._strike_round(rank, strikes, KEYS, RuntimeError(  # type: ignore[arg-type]
        "DataLoader worker (pid 4242) is killed by signal: Killed. "))
    assert not strikes.counts
    ShardedLearner._strike_round(rank, strikes, KEYS, ValueError("a bad row"))  # type: ignore[arg-type]
    assert all(strikes.poisoned(k) for k in KEYS)


def _sigterm_pending(pid: int) -> bool:
    """Whether a SIGTERM sent to process ``pid`` waits to be taken (its shared pending signals, /proc)."""
    line = next(t for t in Path(f"/proc/{pid}/status").read_text().splitlines() if t.startswith("ShdPnd:"))
    return bool(int(line.split()[1], 16) >> (signal.SIGTERM - 1) & 1)


def _outlive_then_wait(ready: Any) -> None:
    """A DataLoader worker's SIGTERM rule (learner.kafka_dataset), then wait to be ended."""
    from learner.kafka_dataset import _outlive_one_sigterm

    _outlive_one_sigterm()
    ready.put(os.getpid())
    threading.Event().wait()


def test_a_workers_sigterm_from_the_training_process_ends_it_at_once_and_anothers_only_the_second_time() -> None:
    """multiprocessing's exit handler sends each live worker one SIGTERM and joins it: a worker that outlived its own
    training process's SIGTERM was joined for good (the learner hung at exit after a worker died). A SIGTERM from
    someone else (a process group's stop) is still outlived once."""
    ctx = multiprocessing.get_context("fork")
    for sender in ("training process", "another process"):
        ready = ctx.Queue()
        worker = ctx.Process(target=_outlive_then_wait, args=(ready,), daemon=True)
        worker.start()
        pid = ready.get(timeout=60)
        try:
            if sender == "training process":
                os.kill(pid, signal.SIGTERM)
                worker.join(60)
                assert worker.exitcode == 0  # as torch's own handler: stopped by its training process
            else:
                subprocess.run(["kill", "-TERM", str(pid)], check=True)
                while _sigterm_pending(pid):  # taken, not merged with the next one
                    time.sleep(0.01)
                assert worker.is_alive()
                subprocess.run(["kill", "-TERM", str(pid)], check=True)
                worker.join(60)
                assert worker.exitcode == -signal.SIGTERM  # the first outlived, the second ended it
        finally:
            worker.kill()
            worker.join()


class _BrokenHandover:
    """A DataLoader iterator whose next batch's handover fails as a worker killed while handing it over fails it
    (its shared-memory descriptors fetched over a socket the dead worker closed), with ``workers`` as its workers."""

    def __init__(self, workers: list[Any], exc: Exception) -> None:
        self._workers, self.exc = workers, exc

    def __iter__(self) -> _BrokenHandover:
        return self

    def __next__(self) -> Any:
        raise self.exc


@pytest.mark.parametrize("dies", ["before the error", "just after the error"])
def test_a_worker_killed_while_handing_a_batch_over_is_reported_as_a_dead_worker_and_strikes_nothing(
        dies: str, tmp_path: Path) -> None:
    """torch re-raises the handover's "Connection reset by peer" as it is when it has not yet seen the worker gone:
    the learner stopped with a bare connection error and its traceback, naming no worker. It is now torch's "exited
    unexpectedly" naming the dead worker (found within a moment: the socket closes before the process can be
    reaped), which strikes no message."""
    from learner.worker_stall import watched

    ctx = multiprocessing.get_context("fork")
    alive = ctx.Process(target=threading.Event().wait, daemon=True)
    killed = ctx.Process(target=time.sleep, args=(0.0 if dies == "before the error" else 0.3,), daemon=True)
    for w in (alive, killed):
        w.start()
    try:
        if dies == "before the error":
            killed.join()
        reset = ConnectionResetError(104, "Connection reset by peer")
        with pytest.raises(RuntimeError) as died:
            next(watched(_BrokenHandover([alive, killed], reset), 2, 60.0, lambda w: [w]))
        assert f"DataLoader worker (pid(s) {killed.pid}) exited unexpectedly while handing over a batch" in \
            str(died.value) and "Connection reset by peer" in str(died.value)
        assert died.value.__cause__ is reset
        assert worker_died(died.value) and not_the_batch(died.value)
        strikes = Strikes(FileStrikes(tmp_path / "strikes.json"), limit=1)
        assert strike_failed_batch(strikes, KEYS, died.value) is False and not strikes.counts
    finally:
        for w in (alive, killed):
            w.kill()
            w.join()


@pytest.mark.parametrize("exc", [ConnectionResetError(104, "Connection reset by peer"), EOFError()])
def test_a_broken_handover_with_every_worker_alive_is_raised_as_it_is(
        exc: Exception, monkeypatch: pytest.MonkeyPatch) -> None:
    """No worker died within the wait: the error is not called a worker's death."""
    from learner import worker_stall

    monkeypatch.setattr(worker_stall, "DEATH_WAIT_S", 0.2)
    ctx = multiprocessing.get_context("fork")
    alive = ctx.Process(target=threading.Event().wait, daemon=True)
    alive.start()
    try:
        with pytest.raises(type(exc)) as raised:
            next(worker_stall.watched(_BrokenHandover([alive], exc), 1, 60.0, lambda w: [w]))
        assert raised.value is exc
    finally:
        alive.kill()
        alive.join()
