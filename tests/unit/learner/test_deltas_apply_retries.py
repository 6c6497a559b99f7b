"""Serving's delta reader (``learner/deltas.py`` ``DeltaReader.retry_apply``) told that a delta it yielded failed to
apply for want of a resource of the serving process: the rule of a read failing so (yielded again next round, up to
``TRANSIENT_TRIES`` rounds in a row, one try per round, counted in ``retries``), with tries of its own, and forgotten
with the file. Files in a tmp dir; the failure is the caller's word, no memory is exhausted."""

from __future__ import annotations

from pathlib import Path

import torch

from learner.delta_reader import DeltaReader
from learner.deltas import TRANSIENT_TRIES, delta_path, encode_delta
from stream.files import write_atomic


def _write(directory: Path, seq: int) -> Path:
    payload = {"seq": seq, "samples_trained": 10 * seq, "created": 1.0,
               "rows": torch.tensor([seq], dtype=torch.int64), "vectors": torch.full((1, 5), float(seq)),
               "dense_state": {"bias": torch.zeros(1)}}
    path = delta_path(directory, seq, 10 * seq)
    write_atomic(path, encode_delta(payload))
    return path


def _round(reader: DeltaReader, short: set[int], same_round: bool = False) -> tuple[list[int], bool | None]:
    """One round as serving runs it over deltas after seq 1: every delta of ``short`` fails to apply (the round ends
    at it when the reader says so, else it is passed over as a misfit). The seqs applied, and the reader's last
    answer (None: none asked)."""
    applied: list[int] = []
    answer = None
    for d in reader.newer(1, 10, same_round=same_round):
        if d.seq in short:
            answer = reader.retry_apply(d.path, MemoryError())
            if answer:
                break
            continue
        applied.append(d.seq)
    return applied, answer


def test_an_application_failing_in_every_round_is_given_up_after_the_tries_although_every_read_succeeds(
        tmp_path: Path) -> None:
    # Each round reads delta 2 whole (its read's tries end there): that must not start its application's tries again,
    # or a delta that can never be applied holds every later one back for ever.
    _write(tmp_path, 2)
    _write(tmp_path, 3)
    reader = DeltaReader(tmp_path)
    for _ in range(TRANSIENT_TRIES - 1):
        assert _round(reader, {2}) == ([], True)  # nothing past delta 2 before it
    assert _round(reader, {2}) == ([3], False)  # given up on: the caller rejects it, the later ones apply
    assert reader.retries == TRANSIENT_TRIES - 1


def test_a_second_failed_application_in_one_round_spends_no_try(tmp_path: Path) -> None:
    # Serving applies the deltas to a new artifact, then to the live model, in one round: both failing is one try.
    _write(tmp_path, 2)
    reader = DeltaReader(tmp_path)
    for _ in range(TRANSIENT_TRIES - 1):
        assert _round(reader, {2}) == ([], True)
        assert _round(reader, {2}, same_round=True) == ([], True)
    assert reader.retries == TRANSIENT_TRIES - 1
    assert _round(reader, set()) == ([2], None)


def test_a_delta_applied_at_last_starts_its_application_tries_afresh(tmp_path: Path) -> None:
    _write(tmp_path, 2)
    reader = DeltaReader(tmp_path)
    assert _round(reader, {2}) == ([], True)
    assert _round(reader, set()) == ([2], None)  # applied (to this model)
    for _ in range(TRANSIENT_TRIES - 1):  # short again for another model (a new artifact): every try is its own
        assert _round(reader, {2}) == ([], True)


def test_the_application_tries_of_a_removed_delta_file_are_forgotten(tmp_path: Path) -> None:
    # Serving's tries outlived the files (the learner prunes all but the last `keep`): one entry per delta that ever
    # failed to apply, for the life of the process.
    p2 = _write(tmp_path, 2)
    _write(tmp_path, 3)
    reader = DeltaReader(tmp_path)
    assert _round(reader, {2}) == ([], True)
    assert reader._applies.failing  # (what the reader remembers of it)
    p2.unlink()  # pruned by the learner
    assert _round(reader, set()) == ([3], None)
    assert reader._applies.failing == {}
