"""learner/checkpoint_files.checkpoint_name: a checkpoint written after the clock went back (an NTP step, a VM
restored), with no sample trained since the one before, is still the newest: the one a restart resumes from, with
its offsets (single-process and sharded checkpoints)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from learner import checkpoint, sharded_checkpoint

T0 = 2_000_000_000.0


def _meta(offset: int) -> dict[str, Any]:
    """Five samples trained; the next message to read at ``offset`` (duplicates read since: offsets move alone)."""
    return {"samples_trained": 5, "steps": 1, "offsets": {"0": offset}, "partition_rows": {"0": 5}, "duplicates": 0,
            "world_size": 1}


def _clock(monkeypatch: pytest.MonkeyPatch, at: float) -> None:
    monkeypatch.setattr(time, "time", lambda: at)


def test_a_checkpoint_saved_after_the_clock_went_back_is_the_one_a_restart_resumes_from(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _clock(monkeypatch, T0)
    first = checkpoint.save(tmp_path, {"model": {"w": torch.zeros(2)}}, _meta(10), keep=1)
    _clock(monkeypatch, T0 - 60)  # stepped back a minute
    second = checkpoint.save(tmp_path, {"model": {"w": torch.zeros(2)}}, _meta(17), keep=1)

    assert second.name > first.name
    ckpt = checkpoint.load_latest(tmp_path)
    assert ckpt is not None and ckpt.path == second and ckpt.offsets == {0: 17}
    assert checkpoint.list_checkpoints(tmp_path) == [second]  # keep=1: the older one pruned, not the newer


def test_a_sharded_checkpoint_saved_after_the_clock_went_back_is_the_newest(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def save(offset: int) -> Path:  # one process, no process group
        return sharded_checkpoint.save(tmp_path, {"model": {"w": torch.zeros(2)}}, {}, _meta(offset), 0, keep=1)

    _clock(monkeypatch, T0)
    save(10)
    _clock(monkeypatch, T0 - 60)
    second = save(17)

    found = sharded_checkpoint.latest(tmp_path)
    assert found is not None and found[0] == second and found[1]["offsets"] == {"0": 17}
    assert sharded_checkpoint.list_complete(tmp_path) == [second]
    assert json.loads((second / sharded_checkpoint.META).read_text())["offsets"] == {"0": 17}
