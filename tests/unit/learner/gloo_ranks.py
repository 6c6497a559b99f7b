"""Spawned gloo ranks for the unit tests of the sharded learner: one definition of how such a rank joins its group
and leaves it."""

from __future__ import annotations

import gc
import os
import sys
import time
from collections.abc import Callable
from typing import Any

RANKS_TIMEOUT_S = 180.0


def gloo_rank(rank: int, world: int, store: str, work: Callable[..., None], *args: Any) -> None:
    """A spawned process's target: join a gloo group of ``world`` ranks over the FileStore at ``store``, run
    ``work(rank, world, *args)`` (one torch thread), leave. Leaves as ``learner.sharded_daemon.run_ranks`` does:
    everything holding the group lives in ``work``'s frame and is collected before ``destroy_process_group``, so
    gloo's threads are joined while the interpreter lives (left to the interpreter's exit, one of them aborted the
    rank now and then: SIGABRT, "terminate called without an active exception"). ``work`` must be a module-level
    function (spawn pickles it by name)."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    try:
        work(rank, world, *args)
    finally:
        gc.collect()
        dist.destroy_process_group()
    # Done, and the group is gone: end here, not in the interpreter's teardown, where a gloo thread still aborted a
    # finished rank now and then all the same (SIGABRT, "terminate called without an active exception": 2 of 16
    # runs of one test on a quiet 2-core machine, 2026-12-05), failing a test whose ranks had done and written
    # everything it checks. A rank whose work raised still exits through the interpreter (exit code 1).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def in_turn(rank: int, world: int, works: list[tuple[Callable[..., None], tuple]]) -> None:
    """A :func:`gloo_rank` work that runs several: each ``(work, args)`` in turn on the one group, as
    ``work(rank, world, *args)``. Runs that need no fresh process share one spawn: each rank's start (torch and
    torchrec imported, the test module too) costs seconds of CPU, and on CI's 2 cores it was most of such a test's
    time. Each work builds its own model and state, and its frame is gone before the next starts."""
    for work, args in works:
        work(rank, world, *args)


def run_gloo_ranks(world: int, store: str, work: Callable[..., None], args_of: Callable[[int], tuple],
                   timeout_s: float = RANKS_TIMEOUT_S) -> list[int | None]:
    """``work`` on ``world`` spawned :func:`gloo_rank` processes (rank ``r`` gets ``args_of(r)``); their exit codes
    (None: still running at ``timeout_s``). A rank still running then is killed: a rank whose peer died waits in its
    collective for gloo's own timeout (30 min), and left behind it outlived the test, and a multiprocessing child
    that never ends also holds its test process at exit (multiprocessing joins its children)."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=gloo_rank, args=(r, world, store, work, *args_of(r))) for r in range(world)]
    try:
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout_s
        for p in procs:
            p.join(timeout=max(deadline - time.monotonic(), 0.1))
        return [p.exitcode for p in procs]
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
