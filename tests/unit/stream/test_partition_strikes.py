"""Strikes kept one file per partition (the learner on N ranks): each partition's strikes live in its own file,
so a restart on another world size hands them, with the partition, to whichever rank reads it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stream.strikes import PartitionFileStrikes, Strikes


def test_each_partitions_strikes_are_in_its_own_file_and_follow_the_partition_to_another_reader(
        tmp_path: Path) -> None:
    rank0 = Strikes(PartitionFileStrikes(tmp_path, [0, 2]), limit=2)
    rank1 = Strikes(PartitionFileStrikes(tmp_path, [1, 3]), limit=2)
    rank0.failed([("s", 0, 5), ("s", 2, 7)], RuntimeError("boom"))
    rank1.failed([("s", 1, 9)], RuntimeError("bang"))
    rank1.failed([("s", 1, 9)], RuntimeError("bang"))
    assert json.loads((tmp_path / "strikes-1.json").read_text()) == {"s:1:9": [2, "RuntimeError: bang"]}
    assert set(json.loads((tmp_path / "strikes-2.json").read_text())) == {"s:2:7"}
    # one rank now reads every partition: it finds all strikes; the poisoned one is named
    whole = Strikes(PartitionFileStrikes(tmp_path, [0, 1, 2, 3]), limit=2)
    assert set(whole.counts) == {("s", 0, 5), ("s", 2, 7), ("s", 1, 9)}
    assert whole.poisoned(("s", 1, 9)) is not None and whole.poisoned(("s", 0, 5)) is None
    whole.succeeded([("s", 1, 9), ("s", 0, 5)])
    assert json.loads((tmp_path / "strikes-1.json").read_text()) == {}
    assert set(Strikes(PartitionFileStrikes(tmp_path, [0, 2]), limit=2).counts) == {("s", 2, 7)}


def test_a_strike_for_a_partition_the_store_does_not_hold_is_refused(tmp_path: Path) -> None:
    store = PartitionFileStrikes(tmp_path, [0])
    with pytest.raises(ValueError, match=r"partitions \[1\]"):
        store.save({("s", 1, 3): (1, "x")}, [])
