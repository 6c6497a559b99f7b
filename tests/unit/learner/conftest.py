"""Fixtures shared by the learner's unit tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture
def one_rank_group(tmp_path: Path) -> Iterator[None]:
    """A gloo group of one rank in this process: the sharded learner's collectives (checkpoint, id maps) run."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
