"""learner/deltas.py: rows held back for the delta with the id maps (DeltaWriter.hold) and what computing the maps
costs; the serving side of held rows is tested in tests/unit/learner/test_row_mapper.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from learner.deltas import DeltaWriter, list_deltas, load_delta
from learner.features import FeatureConfig, FieldSpec
from learner.model import DeepFM

CFG = FeatureConfig((FieldSpec("user_id", "single", 8), FieldSpec("item_id", "single", 8)), embedding_dim=4)


def model() -> DeepFM:
    return DeepFM(CFG, mlp=(8,), seed=1, autocast_dtype=None)


def test_held_rows_are_not_lost_when_the_maps_fall_due_inside_a_write(tmp_path: Path) -> None:
    """write() decided "no maps yet" (so left the held rows out) and write_rows, reading the clock again a moment
    later, found the maps due and attached them; the write then cleared every mark, held rows included: those rows
    were in no delta at all (serving kept their old vectors until the next artifact)."""
    ticks = iter([0.0, 0.0, 59.9999, 60.0001, 60.0002, 60.0003, 60.0004, 60.0005])
    writer = DeltaWriter(tmp_path, CFG.num_rows, every_s=1.0, clock=lambda: next(ticks), id_maps_every_s=60.0)
    maps_calls: list[int] = []
    writer.id_maps_source = lambda: maps_calls.append(1) or {"user_id": {}}  # type: ignore[func-returns-value]
    writer._last_maps = 0.0  # the maps went out at time 0
    writer.mark(torch.tensor([1, 2, 3]))
    writer.hold(np.array([2]))  # row 2 went to another id since
    assert writer.write(model(), 10) is not None
    [(_, _, path)] = list_deltas(tmp_path)
    delta = load_delta(path)
    sent = set(delta.rows.tolist())
    # either the held row went out with these maps, or it is still marked for the next delta
    assert 2 in sent or bool(writer.touched[2]), (sent, delta.id_maps is not None)


def test_an_idle_learner_does_not_build_the_id_maps_for_a_delta_it_does_not_write(tmp_path: Path) -> None:
    """Nothing trained since the last delta: write() returns None, as before, but it built the whole id maps
    (RowMapper.state_dict: every id of every field) first, and again at every due time while idle, since no delta
    carrying them reset the maps' clock."""
    now = [0.0]
    writer = DeltaWriter(tmp_path, CFG.num_rows, every_s=1.0, clock=lambda: now[0], id_maps_every_s=60.0)
    built: list[Any] = []
    writer.id_maps_source = lambda: built.append(now[0]) or {}  # type: ignore[func-returns-value]
    m = model()
    for k in range(5):  # idle heartbeats, the maps due all along
        now[0] = float(k)
        assert writer.write(m, 0) is None
    writer.mark(torch.tensor([4]))
    writer.hold(np.array([4]))
    writer._last_maps = now[0]  # maps not due: the only touched row is held, nothing goes out
    now[0] = 10.0
    assert writer.write(m, 1) is None
    assert built == []
