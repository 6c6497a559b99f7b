"""learner/deltas.py: rows held back for the delta with the id maps (DeltaWriter.hold) and what computing the maps
costs; the serving side of held rows is tested in tests/unit/learner/test_row_mapper.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from learner.delta_writer import DeltaWriter
from learner.deltas import list_deltas, load_delta
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


def test_a_failed_first_delta_after_a_restart_leaves_the_maps_due_so_no_restored_row_goes_out_without_them(
        tmp_path: Path, monkeypatch: Any) -> None:
    """A restarted writer knows the rows of its pending list but not which of them were held (given to another id
    before the restart): only the first delta, which carries the maps, may send them. That delta failed to write (a
    full disk) and still reset the maps' clock, so the retry went out without the maps and sent row 2, now another
    id's, to serving under the old maps (the evicted id served the new owner's vector until the next maps)."""
    import learner.delta_writer as deltas_module

    now = [0.0]
    first = DeltaWriter(tmp_path, CFG.num_rows, every_s=1.0, clock=lambda: now[0], id_maps_every_s=60.0)
    first.mark(torch.tensor([1, 2, 3]))
    first.hold(np.array([2]))  # row 2 went to another id; the process stops before the delta with the maps
    first.sync()
    writer = DeltaWriter(tmp_path, CFG.num_rows, every_s=1.0, clock=lambda: now[0], id_maps_every_s=60.0)
    writer.id_maps_source = lambda: {"user_id": {}}
    real_write, failures = deltas_module.write_atomic, [1]

    def full_disk_once(path: Path, data: bytes) -> None:
        if failures and path.suffix == ".delta":
            failures.pop()
            raise OSError(28, "No space left on device")
        real_write(path, data)

    monkeypatch.setattr(deltas_module, "write_atomic", full_disk_once)
    m = model()
    now[0] = 1.0
    assert writer.write(m, 10) is None and writer.failed == 1
    now[0] = 2.0
    assert writer.write(m, 11) is not None
    [(_, _, path)] = list_deltas(tmp_path)
    delta = load_delta(path)
    assert 2 in delta.rows.tolist() and delta.id_maps is not None
