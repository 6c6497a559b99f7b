"""Serving's delta reader (``learner/deltas.py`` ``DeltaReader.newer``) under a passing resource shortage of its own
process: too many open files, no memory. The file is fine, so it is retried, and no later delta (absolute values, seq
order) applies before it; one that keeps failing is given up after ``TRANSIENT_TRIES`` rounds. Permission and I/O
errors are the file's, rejected at once. Files in a tmp dir; the failure is injected into the loader the reader
calls, no descriptors are exhausted."""

from __future__ import annotations

import errno
import functools
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from learner import delta_reader, deltas
from learner.delta_reader import DeltaReader
from learner.deltas import TRANSIENT_TRIES, delta_path, encode_delta
from stream.files import write_atomic

DIM = 4


def _write(directory: Path, seq: int) -> Path:
    payload = {"seq": seq, "samples_trained": 10 * seq, "created": 1.0,
               "rows": torch.tensor([seq], dtype=torch.int64), "vectors": torch.full((1, DIM + 1), float(seq)),
               "dense_state": {"bias": torch.zeros(1)}}
    path = delta_path(directory, seq, 10 * seq)
    write_atomic(path, encode_delta(payload))
    return path


def _failing(monkeypatch: pytest.MonkeyPatch, path: Path, times: int,
             make: Callable[[], BaseException]) -> tuple[list[Path], list[int]]:
    """Make the reader's loader raise ``make()`` for ``path`` the next ``times`` reads; returns every path loaded and
    ``[reads still to fail]`` (settable)."""
    real, loads = deltas.load_delta, []
    left = [times]

    def load(p: Path, key: object = None) -> deltas.Delta:
        loads.append(p)
        if p == path and left[0] > 0:
            left[0] -= 1
            raise make()
        return real(p, key)  # type: ignore[arg-type]

    monkeypatch.setattr(delta_reader, "load_delta", load)
    return loads, left


SHORTAGES = [functools.partial(OSError, e, "injected") for e in
             (errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.EAGAIN, errno.EINTR, errno.ENOBUFS)] + [MemoryError]


@pytest.mark.parametrize("make", SHORTAGES, ids=["EMFILE", "ENFILE", "ENOMEM", "EAGAIN", "EINTR", "ENOBUFS",
                                                 "MemoryError"])
def test_a_delta_whose_read_hits_a_passing_shortage_applies_next_round_before_the_later_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, make: Callable[[], BaseException]) -> None:
    p2 = _write(tmp_path, 2)
    _write(tmp_path, 3)
    _failing(monkeypatch, p2, 1, make)
    rejected: list[Path] = []
    reader = DeltaReader(tmp_path, on_reject=lambda p, _r: rejected.append(p))
    assert list(reader.newer(1, 10)) == []  # the round ends at 2: 3 must not go first
    assert [d.seq for d in reader.newer(1, 10)] == [2, 3]
    assert rejected == [] and reader.bad == 0 and reader.retries == 1


def test_a_delta_that_keeps_failing_with_a_shortage_is_rejected_after_the_bound_and_the_later_one_applies(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    p2 = _write(tmp_path, 2)
    _write(tmp_path, 3)
    loads, _ = _failing(monkeypatch, p2, 10**6, lambda: OSError(errno.EMFILE, "Too many open files"))
    rejected: list[Path] = []
    reader = DeltaReader(tmp_path, on_reject=lambda p, _r: rejected.append(p))
    for _ in range(TRANSIENT_TRIES - 1):
        assert list(reader.newer(1, 10)) == [] and rejected == []
    assert [d.seq for d in reader.newer(1, 10)] == [3]  # the last try: given up, the later delta applies
    assert rejected == [p2] and reader.bad == 1 and reader.retries == TRANSIENT_TRIES - 1
    assert loads.count(p2) == TRANSIENT_TRIES
    assert [d.seq for d in reader.newer(1, 10)] == [3] and loads.count(p2) == TRANSIENT_TRIES  # never read again


def test_the_bound_counts_consecutive_failures_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    p2 = _write(tmp_path, 2)
    loads, left = _failing(monkeypatch, p2, TRANSIENT_TRIES - 1, MemoryError)
    reader = DeltaReader(tmp_path)
    for _ in range(TRANSIENT_TRIES - 1):
        assert list(reader.newer(1, 10)) == []
    assert [d.seq for d in reader.newer(1, 10)] == [2]  # read at last: its count starts again
    left[0] = TRANSIENT_TRIES - 1  # (a new artifact re-reads it, short again)
    for _ in range(TRANSIENT_TRIES - 1):
        assert list(reader.newer(1, 10)) == []
    assert [d.seq for d in reader.newer(1, 10)] == [2] and reader.bad == 0 and loads.count(p2) == 2 * TRANSIENT_TRIES


@pytest.mark.parametrize("code", [errno.EACCES, errno.EIO])
def test_a_permission_or_io_error_still_rejects_the_delta_at_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                  code: int) -> None:
    p2 = _write(tmp_path, 2)
    _write(tmp_path, 3)
    _failing(monkeypatch, p2, 10**6, lambda: OSError(code, "injected"))
    rejected: list[Path] = []
    reader = DeltaReader(tmp_path, on_reject=lambda p, _r: rejected.append(p))
    assert [d.seq for d in reader.newer(1, 10)] == [3]
    assert rejected == [p2] and reader.bad == 1 and reader.retries == 0
