"""A delta whose application ran this serving process out of memory (``MemoryError`` building the new snapshot) says
nothing of the delta: it is applied again next round, like a delta whose read hit the same shortage
(``learner/deltas.py`` ``TRANSIENT_TRIES``), not rejected for good as a misfit while the later deltas step past it.
And what the delta reader counts (gaps, rewinds, retries) reaches the metrics also in a round an exception
ends. A fake model (the updater's side alone), real delta files."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import learner.delta_reader
from learner.deltas import TRANSIENT_TRIES, delta_path, encode_delta
from serving.metrics import LookupTally, ServingMetrics
from serving.swap import LiveModel, ModelHolder, ModelUpdater
from stream.files import write_atomic


class Model:
    """What the updater reads of a ScoringModel; ``short[seq]``: applications of delta ``seq`` that run out of
    memory before one succeeds (-1: every one)."""

    delta_samples, source_samples, source_delta_seq, lineage = 0, 0, 0, None
    trained_at = 0.0  # (ScoringModel.trained_at: when the newest state it holds was written)
    version, format = "v1", "torchscript"

    def __init__(self, short: dict[int, int]) -> None:
        self.delta_seq, self.short = 0, short
        self.tally = LookupTally()
        self.applied: list[int] = []

    def apply_delta(self, rows: Any, vectors: Any, dense: Any, seq: int, **kw: Any) -> None:
        if self.short.get(seq, 0):
            self.short[seq] -= 1
            raise MemoryError()
        self.applied.append(seq)
        self.delta_seq, self.delta_samples = seq, kw["samples_trained"]


def _write_delta(ddir: Path, seq: int) -> None:
    write_atomic(delta_path(ddir, seq, 10 * seq), encode_delta(
        {"seq": seq, "samples_trained": 10 * seq, "created": 1.0, "rows": torch.tensor([seq], dtype=torch.int64),
         "vectors": torch.full((1, 5), float(seq)), "dense_state": {"bias": torch.zeros(1)}}))


def _updater(tmp_path: Path, model: Model, seqs: tuple[int, ...] = (1, 2, 3)) -> tuple[ModelUpdater, ModelHolder]:
    ddir = tmp_path / "deltas"
    ddir.mkdir()
    for seq in seqs:
        _write_delta(ddir, seq)
    holder = ModelHolder()
    u = ModelUpdater(holder, ServingMetrics(holder.model), tmp_path / "root", ddir, device="cpu")
    holder.live = LiveModel(model, None, 0)  # type: ignore[arg-type]
    return u, holder


def test_a_delta_whose_application_ran_out_of_memory_is_applied_next_round_not_rejected(tmp_path: Path) -> None:
    model = Model({2: 1})
    u, _ = _updater(tmp_path, model)
    u.check_now()
    assert model.applied == [1]  # nothing past delta 2 before it (values are absolute, applied in seq order)
    assert u.metrics.rejected.labels("delta")._value.get() == 0 and u.metrics.delta_retries._value.get() == 1
    u.check_now()
    assert model.applied == [1, 2, 3]


def test_a_delta_that_runs_out_of_memory_every_round_is_rejected_after_the_tries_and_the_later_ones_apply(
        tmp_path: Path) -> None:
    model = Model({2: -1})
    u, _ = _updater(tmp_path, model)
    for _ in range(TRANSIENT_TRIES):
        u.check_now()
    assert model.applied == [1, 3]  # given up on after TRANSIENT_TRIES rounds, as a read short of memory is
    assert u.metrics.rejected.labels("delta")._value.get() == 1


def test_what_the_reader_counted_in_a_round_an_exception_ended_still_reaches_the_metrics(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The gap before delta 3 is counted by the reader, then reading delta 3 raises (an unexpected error): the round
    ends by the exception. The metrics took the reader's counts only after a round that ended normally, and the next
    round starts from the reader's totals, so streamrec_serving_delta_gaps missed that gap for good."""
    model = Model({})
    u, _ = _updater(tmp_path, model, seqs=(1,))
    u.check_now()
    assert model.applied == [1]
    _write_delta(tmp_path / "deltas", 3)  # delta 2 pruned before serving read it: a gap

    def unexpected(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("a bug reading delta 3")

    with monkeypatch.context() as m:
        m.setattr(learner.delta_reader, "load_delta", unexpected)
        with pytest.raises(RuntimeError, match="a bug reading"):
            u.check_now()
    assert u.deltas is not None and u.deltas.gaps == 1
    assert u.metrics.delta_gaps._value.get() == 1
    u.check_now()  # the next round applies delta 3 and counts the gap no second time
    assert model.applied == [1, 3] and u.metrics.delta_gaps._value.get() == 1
