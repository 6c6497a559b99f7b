"""A DataLoader worker that hangs (alive, neither reading nor handing over) stops the learner with the worker, its
partitions and ``[learner] worker_stall_s`` named (learner/worker_stall.py), where it was waited for in silence for
good; a worker that sends heartbeats, or whose reading ended, is no hang. The workers here really hang: blocked on an
Event in a DataLoader worker process, behind the learner's own loader (``sample_loader``)."""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
from collections.abc import Iterator

import pytest
from torch.utils.data import IterableDataset, get_worker_info

from learner import worker_stall
from learner.batch import TensorBatch
from learner.config import LearnerSettings
from learner.features import FeatureConfig, FieldSpec
from learner.kafka_dataset import sample_loader, to_tensors_empty
from learner.worker_stall import WorkerStalled, loader_timeout, watched
from stream.errors import ConfigError

CFG = FeatureConfig((FieldSpec("user_id", "single", 50), FieldSpec("item_id", "single", 40)), embedding_dim=4)
STALL_S = 1.0  # short, so a hang is found within seconds; what a test asserts is the error, not a time


def _beat(worker: int, done: bool = False, reads: tuple[int, ...] | None = None) -> TensorBatch:
    tb = to_tensors_empty(CFG, None)  # an idle heartbeat, as the samples reader sends one a second
    tb.worker, tb.worker_done, tb.worker_partitions = worker, done, reads
    return tb


class _Workers(IterableDataset):
    """Worker 0 sends heartbeats for ever (an idle topic); the workers in ``hang`` send one, then block for good on an
    Event (alive: torch never reports them), or, ``stop``, stop themselves (SIGSTOP)."""

    def __init__(self, hang: set[int], stop: bool = False) -> None:
        super().__init__()
        self.hang, self.stop = hang, stop

    def __iter__(self) -> Iterator[TensorBatch]:
        info = get_worker_info()
        assert info is not None
        yield _beat(info.id)
        if info.id in self.hang and self.stop:
            os.kill(os.getpid(), signal.SIGSTOP)
        if info.id in self.hang:
            threading.Event().wait()
        while True:
            threading.Event().wait(0.05)
            yield _beat(info.id)


def _partitions(worker: int) -> list[int]:
    return [worker, worker + 2]  # of 4 partitions, dealt to 2 workers


def test_one_hung_dataloader_worker_among_live_ones_stops_the_learner_naming_it_and_its_partitions() -> None:
    """The loader hands on the live worker's heartbeats (``in_order=False``), so its own timeout never fires: before,
    the hung worker's partitions were never trained again, and nothing said so."""
    loader = sample_loader(_Workers(hang={1}), num_workers=2, prefetch_factor=2, pin_memory=False, stall_s=STALL_S)
    batches = watched(loader, 2, STALL_S, _partitions)
    with pytest.raises(WorkerStalled) as hung:
        for _ in batches:
            pass
    text = str(hung.value)
    assert "DataLoader worker(s) [1] (samples partitions [1, 3])" in text
    assert "[learner] worker_stall_s" in text and "hung, not dead" in text
    batches.close()


def test_every_dataloader_worker_hung_ends_the_learners_wait_for_a_batch_naming_the_setting() -> None:
    """No batch at all: the loader's next() waited for ever; the loader's timeout ends it, raised as the same error."""
    loader = sample_loader(_Workers(hang={0, 1}), num_workers=2, prefetch_factor=2, pin_memory=False, stall_s=STALL_S)
    batches = watched(loader, 2, STALL_S, _partitions)
    with pytest.raises(WorkerStalled, match=r"every DataLoader worker \(samples partitions \[0, 1, 2, 3\]\) handed "
                                            r"over no batch .*\[learner\] worker_stall_s"):
        for _ in batches:
            pass
    batches.close()


@pytest.mark.parametrize(("stop", "persistent"), [(True, False), (False, True)], ids=["stopped", "persistent"])
def test_the_workers_of_a_loader_that_named_a_hung_one_are_gone_when_it_raises(stop: bool, persistent: bool) -> None:
    """Named, the hung worker must not outlive the error: a stopped (SIGSTOP) one ignored torch's SIGTERM and
    multiprocessing's exit handler joined it for good (the learner never exited); with ``persistent_workers`` the
    loader kept its iterator, so none of its workers was shut down."""
    before = set(multiprocessing.active_children())
    loader = sample_loader(_Workers(hang={1}, stop=stop), num_workers=2, prefetch_factor=2, pin_memory=False,
                           persistent_workers=persistent, stall_s=STALL_S)
    batches = watched(loader, 2, STALL_S, _partitions)
    try:
        with pytest.raises(WorkerStalled, match=r"DataLoader worker\(s\) \[1\]"):
            for _ in batches:
                pass
        assert set(multiprocessing.active_children()) - before == set()
    finally:  # without the fix, not left behind to hang this test process's exit
        for left in set(multiprocessing.active_children()) - before:
            left.kill()
            left.join()


class _Clock:
    """The training process's clock, moved by the batches it is handed (no wall clock in what is asserted)."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_loaders_timeout_after_a_worker_ended_names_only_the_workers_still_reading() -> None:
    """Worker 0's reading ended (exit_when_idle_s) and worker 1 hung: the loader's own timeout fires (no live worker
    is left), and the error said "every DataLoader worker", as if worker 0 had hung too."""

    clock = _Clock()

    def handed() -> Iterator[TensorBatch]:
        yield _beat(0, done=True)
        clock.now += STALL_S
        raise RuntimeError(f"DataLoader timed out after {STALL_S} seconds")  # torch's text

    with pytest.raises(WorkerStalled) as hung:
        list(watched(handed(), 2, STALL_S, _partitions, clock=clock))
    assert str(hung.value).startswith("DataLoader worker(s) [1] (samples partitions [1, 3]) handed over no batch")


def test_idle_heartbeats_a_worker_whose_reading_ended_and_time_spent_training_are_no_stall() -> None:
    clock = _Clock()

    def handed() -> Iterator[TensorBatch]:
        yield _beat(1, done=True)  # worker 1's reading ended (exit_when_idle_s): it owes nothing more
        for _ in range(100):
            clock.now += 0.5  # the learner waits half a second for each of worker 0's idle heartbeats
            yield _beat(0)

    got = list(watched(handed(), 2, STALL_S, _partitions, clock=clock))
    assert len(got) == 101
    clock.now = 0.0

    def slow_training() -> Iterator[TensorBatch]:  # worker 1's heartbeat waits behind a long training step
        yield _beat(0)
        yield _beat(1)

    batches = watched(slow_training(), 2, STALL_S, _partitions, clock=clock)
    next(batches)
    clock.now += 100 * STALL_S  # training, not waiting for the loader
    assert next(batches).worker == 1


def test_a_hung_worker_is_named_with_the_partitions_it_said_it_reads_those_added_after_its_start_too() -> None:
    """The partitions named were the start's split (``partitions_of_worker``): a partition the worker took on later (a
    topic grown while it read, a rebalance) was missing from the list the operator acts on."""
    clock = _Clock()

    def handed() -> Iterator[TensorBatch]:
        yield _beat(1, reads=(1, 3, 5))  # partition 5 was added to the topic while worker 1 read
        while True:
            clock.now += 0.5  # worker 0's heartbeats go on; worker 1 hangs
            yield _beat(0, reads=(0, 2))

    with pytest.raises(WorkerStalled) as hung:
        list(watched(handed(), 2, STALL_S, _partitions, clock=clock))
    assert str(hung.value).startswith("DataLoader worker(s) [1] (samples partitions [1, 3, 5]) handed over no batch")


def test_worker_stall_s_comes_from_the_settings_and_must_be_a_positive_number_of_seconds() -> None:
    assert LearnerSettings().worker_stall_s == 300.0
    assert LearnerSettings(worker_stall_s=30).worker_stall_s == 30
    with pytest.raises(ConfigError, match=r"\[learner\] worker_stall_s must be a finite number of seconds > 0"):
        LearnerSettings(worker_stall_s=0)


class _Frozen:
    """The loader as the training process sees it around a freeze of the whole learner (SIGSTOP of its process group,
    a paused VM): the clock jumps inside one wait, which torch's timeout then ends; then each worker's heartbeat."""

    def __init__(self, clock: _Clock, stall_s: float) -> None:
        self.clock, self.stall_s, self.handed = clock, stall_s, [_beat(0), _beat(1)]
        self.frozen = False

    def __iter__(self) -> _Frozen:
        return self

    def __next__(self) -> TensorBatch:
        if not self.frozen:
            self.frozen = True
            self.clock.now += 10 * self.stall_s
            raise RuntimeError(f"DataLoader timed out after {loader_timeout(self.stall_s)} seconds")  # torch's text
        if not self.handed:
            raise StopIteration
        return self.handed.pop(0)


def test_a_freeze_of_the_whole_learner_inside_a_wait_for_the_loader_is_no_stall() -> None:
    """The monotonic clock runs on while the learner is frozen: counted whole as waiting, a freeze longer than
    worker_stall_s named every worker as hung once it was continued (torch's timeout, then one wait of worker_stall_s,
    fired at once). One wait counts at most the loader's timeout, and the loader is waited for again after it."""
    stall_s = 60.0  # the settings' check: well above a start; what a freeze counts (WAIT_CHUNK_S) is far below it
    clock = _Clock()
    got = [b.worker for b in watched(_Frozen(clock, stall_s), 2, stall_s, _partitions, clock=clock)]
    assert got == [0, 1]


def test_every_worker_hung_is_named_after_worker_stall_s_of_the_loaders_shorter_timeouts(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The loader's timeout is a part of worker_stall_s (learner/worker_stall.py, WAIT_CHUNK_S): torch's iterator is
    waited on again after each, and the hang named once they add up."""
    monkeypatch.setattr(worker_stall, "WAIT_CHUNK_S", STALL_S / 4)
    loader = sample_loader(_Workers(hang={0, 1}), num_workers=2, prefetch_factor=2, pin_memory=False, stall_s=STALL_S)
    assert loader.timeout == STALL_S / 4
    batches = watched(loader, 2, STALL_S, _partitions)
    with pytest.raises(WorkerStalled, match=r"every DataLoader worker \(samples partitions \[0, 1, 2, 3\]\)"):
        for _ in batches:
            pass
