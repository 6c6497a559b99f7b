"""Deltas that change under serving's reader (``learner/deltas.py`` ``DeltaReader.newer``): a file pruned between the
listing and the read, a writer's temp file, a damaged file at a final name. Pure files in a tmp dir, no broker."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from learner.delta_reader import _REMEMBER, DeltaReader
from learner.deltas import ABANDONED, delta_path, encode_delta, list_deltas
from stream.files import write_atomic

DIM = 4


def _write(directory: Path, seq: int, samples: int | None = None, lineage: str | None = None) -> Path:
    samples = 10 * seq if samples is None else samples
    payload = {"seq": seq, "samples_trained": samples, "created": 1.0, "lineage": lineage,
               "rows": torch.tensor([seq], dtype=torch.int64), "vectors": torch.full((1, DIM + 1), float(seq)),
               "dense_state": {"bias": torch.zeros(1)}}
    path = delta_path(directory, seq, samples)
    write_atomic(path, encode_delta(payload))
    return path


def test_a_delta_pruned_between_listing_and_reading_counts_as_a_gap(tmp_path: Path) -> None:
    for seq in (2, 3, 4):
        _write(tmp_path, seq)
    reader = DeltaReader(tmp_path)
    it = reader.newer(1, 10)
    assert next(it).seq == 2
    delta_path(tmp_path, 3, 30).unlink()  # the writer prunes it after the reader listed it
    assert [d.seq for d in it] == [4]
    assert reader.gaps == 1
    # the next round (the model now at 4) counts it no second time
    assert list(reader.newer(4, 40)) == [] and reader.gaps == 1


def test_a_delta_pruned_unread_and_the_last_listed_counts_one_gap_not_two(tmp_path: Path) -> None:
    for seq in (2, 3):
        _write(tmp_path, seq)
    reader = DeltaReader(tmp_path)
    it = reader.newer(1, 10)
    assert next(it).seq == 2
    delta_path(tmp_path, 3, 30).unlink()
    assert list(it) == [] and reader.gaps == 1
    for seq in (5, 6):  # the model at 2: the next round sees 3 and 4 missing before 5 (3 counted already)
        _write(tmp_path, seq)
    assert [d.seq for d in reader.newer(2, 20)] == [5, 6]
    assert reader.gaps == 2


def test_a_delta_a_restart_removed_as_a_dead_branch_between_listing_and_reading_is_no_gap(tmp_path: Path) -> None:
    for seq in (2, 3):
        _write(tmp_path, seq, lineage="L")
    reader = DeltaReader(tmp_path)
    it = reader.newer(1, 10, "L")
    assert next(it).seq == 2
    (tmp_path / ABANDONED).write_text("3 3 L\n")  # abandon_after records the range, then removes the file
    delta_path(tmp_path, 3, 30).unlink()
    assert list(it) == [] and reader.gaps == 0


def test_a_writers_temp_file_is_never_listed(tmp_path: Path) -> None:
    final = delta_path(tmp_path, 1, 10)
    (tmp_path / f".{final.name}.tmp-123-456").write_bytes(b"half a delta")  # a killed writer's leftover
    assert list_deltas(tmp_path) == []


def test_a_truncated_delta_at_its_final_name_is_rejected_and_the_next_still_applies(tmp_path: Path) -> None:
    p2 = _write(tmp_path, 2)
    _write(tmp_path, 3)
    p2.write_bytes(p2.read_bytes()[:-7])  # cut by something that is not write_atomic
    rejected: list[Path] = []
    reader = DeltaReader(tmp_path, on_reject=lambda p, _r: rejected.append(p))
    assert [d.seq for d in reader.newer(1, 10)] == [3]
    assert rejected == [p2] and reader.gaps == 0


def test_a_hole_seen_again_with_another_delta_after_it_counts_each_missing_seq_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from learner import delta_reader as deltas

    p4 = _write(tmp_path, 4)
    real = deltas.list_deltas

    def listing_then_prune(directory: Path) -> list[tuple[int, int, Path]]:
        found = real(directory)
        p4.unlink(missing_ok=True)  # the writer prunes 4 after the reader listed it
        return found

    monkeypatch.setattr(deltas, "list_deltas", listing_then_prune)
    reader = DeltaReader(tmp_path)
    assert list(reader.newer(1, 10)) == []  # the model at 1: 2 and 3 missing before 4, then 4 gone unread
    assert reader.gaps == 3
    monkeypatch.setattr(deltas, "list_deltas", real)
    _write(tmp_path, 5)  # the same hole, now before 5: only 4 is new to it, and it was counted when it vanished
    assert [d.seq for d in reader.newer(1, 10)] == [5]
    assert reader.gaps == 3


def test_a_rejected_delta_pruned_later_is_no_gap(tmp_path: Path) -> None:
    p2 = _write(tmp_path, 2)
    p2.write_bytes(p2.read_bytes()[:-7])  # truncated: rejected, its loss counted in bad
    reader = DeltaReader(tmp_path, on_reject=lambda _p, _r: None)
    assert list(reader.newer(1, 10)) == [] and (reader.bad, reader.gaps) == (1, 0)
    p2.unlink()  # pruned, and a later delta written: the model is still at 1
    _write(tmp_path, 3)
    assert [d.seq for d in reader.newer(1, 10)] == [3]
    assert (reader.bad, reader.gaps) == (1, 0)


def test_a_rejected_delta_pruned_between_a_later_listing_and_its_read_is_no_gap(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from learner import delta_reader as deltas

    p2 = _write(tmp_path, 2)
    p2.write_bytes(p2.read_bytes()[:-7])
    reader = DeltaReader(tmp_path, on_reject=lambda _p, _r: None)
    assert list(reader.newer(1, 10)) == [] and reader.bad == 1
    real = deltas.list_deltas

    def listing_then_prune(directory: Path) -> list[tuple[int, int, Path]]:
        found = real(directory)
        p2.unlink(missing_ok=True)  # pruned after this round listed it
        return found

    monkeypatch.setattr(deltas, "list_deltas", listing_then_prune)
    assert list(reader.newer(1, 10)) == []
    assert reader.gaps == 0


def test_a_delta_of_another_lineage_skipped_then_pruned_is_no_gap(tmp_path: Path) -> None:
    p2 = _write(tmp_path, 2, lineage="other")
    skipped: list[Path] = []
    reader = DeltaReader(tmp_path, on_skip=lambda p, _r: skipped.append(p))
    assert list(reader.newer(1, 10, "L")) == [] and skipped == [p2]
    p2.unlink()
    _write(tmp_path, 3, lineage="L")
    assert [d.seq for d in reader.newer(1, 10, "L")] == [3]
    assert reader.gaps == 0


def test_a_delta_marked_unfit_then_pruned_is_no_gap(tmp_path: Path) -> None:
    p2 = _write(tmp_path, 2)
    reader = DeltaReader(tmp_path)
    for d in reader.newer(1, 10):  # serving's apply_delta refused it: the model stays at 1
        reader.mark_unfit(d.path)
    p2.unlink()
    _write(tmp_path, 3)
    assert [d.seq for d in reader.newer(1, 10)] == [3]
    assert reader.gaps == 0


def test_a_reader_remembers_the_newest_deltas_it_got_to_within_its_bound(tmp_path: Path) -> None:
    reader = DeltaReader(tmp_path)
    last = 2 + _REMEMBER + 10
    for seq in range(2, last + 1):  # more than it keeps: every one refused by the model, which stays behind them
        reader.mark_unfit(_write(tmp_path, seq))
    for seq in range(2, last + 1):
        delta_path(tmp_path, seq, 10 * seq).unlink()
    _write(tmp_path, last + 2)  # last + 1 was never written nor read: the one gap
    assert [d.seq for d in reader.newer(last - 5, 10)] == [last + 2]
    assert reader.gaps == 1
    assert len(reader._settled) <= _REMEMBER


@pytest.mark.parametrize("old_two", ["rejected", "pruned unread"])
def test_after_the_numbering_restarts_a_seq_of_the_old_numbering_does_not_hide_the_new_one_pruned_unread(
        tmp_path: Path, old_two: str) -> None:
    p2 = _write(tmp_path, 2)
    if old_two == "rejected":
        p2.write_bytes(p2.read_bytes()[:-7])
    else:
        p2.unlink()
    _write(tmp_path, 3)
    reader = DeltaReader(tmp_path, on_reject=lambda _p, _r: None)
    assert [d.seq for d in reader.newer(1, 10, applied_samples=0)] == [3]  # the model at 3 (30 samples)
    gaps = reader.gaps
    for p in tmp_path.glob("delta-*"):
        p.unlink()
    _write(tmp_path, 1, samples=100)  # the numbering restarted (a learner from before DELTA_SEQ, another directory)
    assert [d.seq for d in reader.newer(3, 10, applied_samples=30)] == [1] and reader.rewinds == 1
    _write(tmp_path, 3, samples=120)  # the new 2 was written and pruned before serving read it
    assert [d.seq for d in reader.newer(1, 10, applied_samples=100)] == [3]
    assert reader.gaps == gaps + 1


def test_a_hole_after_the_numbering_restarted_counts_though_the_old_numbering_had_one_at_those_seqs(
        tmp_path: Path) -> None:
    # The model at 1 sees only 11 (2..10 pruned: 9 gaps); the learner's directory is then replaced (its numbering
    # restarts: 1, 2), serving re-bases on them (a rewind), and 3 and 4 of the new numbering are pruned unread before
    # 5: two more gaps. The counted holes were remembered as seqs of the old numbering, so 3..4 looked counted already.
    _write(tmp_path, 11, 110)
    reader = DeltaReader(tmp_path)
    assert [d.seq for d in reader.newer(1, 10)] == [11] and reader.gaps == 9
    delta_path(tmp_path, 11, 110).unlink()
    for seq in (1, 2):
        _write(tmp_path, seq, 200 + 10 * (seq - 1))
    assert [d.seq for d in reader.newer(11, 10, applied_samples=110)] == [1, 2] and reader.rewinds == 1
    _write(tmp_path, 5, 240)
    assert [d.seq for d in reader.newer(2, 10, applied_samples=210)] == [5]
    assert reader.gaps == 9 + 2
