"""Spawned gloo ranks for the unit tests of the sharded learner: one definition of how such a rank joins its group
and leaves it."""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any


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
