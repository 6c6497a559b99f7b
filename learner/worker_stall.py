"""The bound on a hung DataLoader worker: alive, so torch never reports it, but neither reading nor handing over.

A live samples reader (``learner/kafka_dataset.py``) hands over its rows, or an empty heartbeat every second while its
partitions are idle (an empty topic is no hang); a trickle of messages is handed over at each poll that brings none
(librdkafka's fetches leave one every second or two: measured on the test broker at 100 one-row messages a second);
starting, it hands a heartbeat over between its broker calls, one per partition, each bounded by its timeout (10 s), so
a start on a slow broker is no hang, and a worker hung inside one call still hands nothing over. A
worker that does neither for ``[learner] worker_stall_s`` is hung: in a library call that never returns, on a lock,
stopped (SIGSTOP). torch reports a worker that dies, never one that hangs, and the learner waited for it for good:

- every worker hung: the loader's ``next()`` waited for ever. ``DataLoader(timeout=...)`` (:func:`loader_timeout`) ends
  each wait after at most :data:`WAIT_CHUNK_S` with torch's "DataLoader timed out after N seconds" (the iterator goes
  on after it), counted below; :class:`WorkerStalled` once that adds up to worker_stall_s.
- some workers hung: the loader hands on any worker's batch (``in_order=False``), so the others' kept coming and the
  hung worker's partitions were never trained again, in silence. :func:`watched` keeps, per worker, the time the
  training process spent waiting for the loader since that worker's last batch. Only waiting counts: a long training
  step or checkpoint backs every worker up (their queues are full), it hangs none of them. Read from a backlog the
  training process seldom waits, so a hung worker is found later there, after worker_stall_s of waiting. One wait
  counts at most the loader's timeout: the monotonic clock runs on while the whole learner is frozen (SIGSTOP of its
  process group, a paused VM or container), and a freeze inside one wait, counted whole, named every worker as hung
  once it was continued (torch's own timeout, one wait of worker_stall_s, fired at once too).

Either way the learner stops with the worker, its partitions and the setting named: a restart reads them again from
the checkpoint (torchrun restarts the group; a supervisor the single process). No message's fault: nothing is struck.

A worker that dies while handing a batch over is a dead worker that torch does not name: the batch's tensors come
through shared memory, whose file descriptors the training process fetches from the worker over a socket
(multiprocessing's resource_sharer), and a worker killed then fails that fetch with "Connection reset by peer" (or
EOF), raised as it is. :func:`watched` says it as torch says a worker's death ("DataLoader worker (pid(s) N) exited
unexpectedly", :func:`learner.kafka_dataset.worker_died`), so the learner stops as for any dead worker, striking
nothing, instead of with a bare connection error and its traceback.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator

from learner.batch import TensorBatch

# torch's text when DataLoader(timeout=...) ends a wait for a batch (checked on torch 2.13)
_TORCH_TIMEOUT = "DataLoader timed out after"
# The longest one wait for the loader counts (module docstring): well above a live reader's heartbeat (1 s)
WAIT_CHUNK_S = 5.0
# How long a handover broken by a connection error waits for a worker to be seen dead (module docstring)
DEATH_WAIT_S = 2.0


def loader_timeout(stall_s: float) -> float:
    """The loader's ``timeout`` for a bound of ``stall_s``: a wait ends after this long, and :func:`watched` waits
    again, counting it."""
    return min(stall_s, WAIT_CHUNK_S)


class WorkerStalled(RuntimeError):
    """A DataLoader worker handed over no batch and no heartbeat for ``[learner] worker_stall_s`` of waiting."""


def stalled(workers: str, stall_s: float) -> WorkerStalled:
    return WorkerStalled(
        f"{workers} handed over no batch and no heartbeat (a live reader sends a heartbeat a second when idle) for "
        f"{stall_s:g} s of waiting ([learner] worker_stall_s): hung, not dead (torch reports only a dead worker). "
        "Stopping without a checkpoint so that a restart reads its partitions again from the last one; raise "
        "worker_stall_s if the worker was only slow")


def watched(batches: Iterable[TensorBatch], num_workers: int, stall_s: float,
            partitions_of_worker: Callable[[int], list[int]],
            clock: Callable[[], float] = time.monotonic) -> Iterator[TensorBatch]:
    """``batches`` (a :func:`learner.kafka_dataset.sample_loader`'s) as they come, raising :class:`WorkerStalled` once
    a worker's batches stop for ``stall_s`` of waiting (module docstring). ``num_workers`` 0: as they come. A hung
    worker's partitions are those its last batch said it reads (``TensorBatch.worker_partitions``: partitions added
    while it read, a rebalance's, are in it; the start's split, ``partitions_of_worker``, named only those it started
    with, and the added ones went unnamed to the operator), or ``partitions_of_worker``'s where it said none."""
    it: Iterator[TensorBatch] | None = iter(batches)
    waited = dict.fromkeys(range(num_workers), 0.0)  # worker -> seconds waited for the loader since its last batch
    reads: dict[int, tuple[int, ...]] = {}  # worker -> the partitions its last batch said it reads (added ones too)
    while it is not None:
        start, timed_out = clock(), False
        try:
            batch = next(it)
        except StopIteration:
            return
        except (ConnectionError, EOFError) as exc:
            dead = _dead_workers(it, DEATH_WAIT_S)
            if not dead:
                raise
            raise RuntimeError(f"DataLoader worker (pid(s) {', '.join(map(str, dead))}) exited unexpectedly while "
                               f"handing over a batch ({type(exc).__name__}: {exc})") from exc
        except RuntimeError as exc:
            if _TORCH_TIMEOUT not in str(exc):
                raise
            timed_out = True  # raised below, outside this block: torch's error (its frames hold the loader) not chained
        spent = min(clock() - start, loader_timeout(stall_s))  # a freeze inside it: one wait (module docstring)
        for w in waited:
            waited[w] += spent
        if not timed_out and batch.worker is not None and batch.worker_done:  # reading ended (exit_when_idle_s)
            waited.pop(batch.worker, None)
        elif not timed_out and batch.worker is not None:
            waited[batch.worker] = 0.0
            if batch.worker_partitions is not None:
                reads[batch.worker] = batch.worker_partitions
        hung = [w for w, s in waited.items() if s >= stall_s]
        if hung:
            _end_workers(it)
            it = None  # the loader's workers shut down now (the hung one terminated), not at the learner's exit
            which = "every DataLoader worker" if len(hung) == num_workers else f"DataLoader worker(s) {hung}"
            listed = sorted(p for w in hung for p in (reads[w] if w in reads else partitions_of_worker(w)))
            raise stalled(f"{which} (samples partitions {listed})", stall_s)
        if not timed_out:
            yield batch


def _dead_workers(it: Iterator[TensorBatch], wait_s: float) -> list[int]:
    """The pids of the DataLoader iterator ``it``'s workers that have exited, waited for up to ``wait_s``: a handover
    broken by a worker's death is seen as its socket closes, a moment before the process can be reaped (module
    docstring). Empty when no worker exits in that time (the connection error is another's) or ``it`` has no
    workers."""
    workers = getattr(it, "_workers", ())  # multiprocessing.Process, one per worker
    deadline = time.monotonic() + wait_s
    while True:
        dead = [w.pid for w in workers if not w.is_alive()]
        if dead or not workers or time.monotonic() >= deadline:
            return dead
        time.sleep(0.01)


def _end_workers(it: Iterator[TensorBatch]) -> None:
    """A DataLoader iterator's workers shut down (torch's own shutdown: a worker that does not join gets SIGTERM), then
    any still alive killed and joined. A stopped (SIGSTOP) worker, or one hung holding the GIL (its SIGTERM watcher
    never runs: ``learner/kafka_dataset.py``), outlives SIGTERM, and multiprocessing's exit handler joined it for
    good: the learner that had named it never exited. With ``persistent_workers`` the loader keeps its iterator, so
    dropping ours shut nothing down. Killed after torch's shutdown took their pids off its SIGCHLD check, so the kill
    is not raised as a worker's death. Any other iterable (no workers): nothing."""
    shutdown = getattr(it, "_shutdown_workers", None)
    if shutdown is None:
        return
    shutdown()
    for w in getattr(it, "_workers", ()):  # multiprocessing.Process, one per worker
        if w.is_alive():
            w.kill()
        w.join()
