"""A new artifact goes live only caught up with the deltas (serving/swap.py ``ModelUpdater._maybe_swap``), also when
the delta reader ends a round early to retry a delta whose read hit a passing shortage of serving's process
(``learner/deltas.py`` ``TRANSIENT_TRIES``). A fake model (the updater's side alone), real delta files, the shortage
injected into the loader the reader calls."""

from __future__ import annotations

import errno
from pathlib import Path
from typing import Any

import pytest
import torch

from learner import delta_reader, deltas
from learner.delta_reader import DeltaReader
from learner.deltas import TRANSIENT_TRIES, delta_path, encode_delta
from serving.metrics import LookupTally, ServingMetrics
from serving.swap import LiveModel, ModelHolder, ModelUpdater
from stream.files import write_atomic


class Model:
    """What the updater reads of a ScoringModel."""

    delta_samples, source_samples, source_delta_seq, lineage = 0, 0, 0, None
    trained_at = 0.0  # (ScoringModel.trained_at: when the newest state it holds was written)
    format = "torchscript"

    def __init__(self, version: str, version_dir: Path) -> None:
        self.version, self.version_dir, self.delta_seq = version, version_dir, 0
        self.tally = LookupTally()
        self.applied: list[int] = []

    def apply_delta(self, rows: Any, vectors: Any, dense: Any, seq: int, **kw: Any) -> None:
        self.applied.append(seq)
        self.delta_seq, self.delta_samples = seq, kw["samples_trained"]


def _write(directory: Path, seq: int) -> None:
    write_atomic(delta_path(directory, seq, 10 * seq), encode_delta(
        {"seq": seq, "samples_trained": 10 * seq, "created": 1.0, "rows": torch.tensor([seq], dtype=torch.int64),
         "vectors": torch.full((1, 5), float(seq)), "dense_state": {"bias": torch.zeros(1)}}))



def _updater_with_v2_waiting(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, live_seq: int,
                             fail: Any) -> tuple[ModelUpdater, ModelHolder, Model, list[Model]]:
    """An updater over deltas 1..3 serving ``v1`` (holding deltas up to ``live_seq``), with ``v2`` (trained to no
    delta) current; ``fail(name)``, called before each delta read, raises to make it fail. Returns the updater, its
    holder, v1 and v2's loads."""
    ddir = tmp_path / "deltas"
    ddir.mkdir()
    for seq in (1, 2, 3):
        _write(ddir, seq)
    holder = ModelHolder()
    u = ModelUpdater(holder, ServingMetrics(holder.model), tmp_path / "root", ddir, device="cpu")
    old = Model("v1", tmp_path / "v1")
    old.delta_seq, old.delta_samples = live_seq, 10 * live_seq  # (as _write's deltas 1..live_seq applied leave it)
    holder.live = LiveModel(old, None, 0)  # type: ignore[arg-type]
    (tmp_path / "v2").mkdir()
    loaded: list[Model] = []

    def load(path: Path, device: str) -> Model:
        loaded.append(Model("v2", path))
        return loaded[-1]

    real = deltas.load_delta

    def load_delta(p: Path, key: object = None) -> deltas.Delta:
        fail(p.name)
        return real(p, key)  # type: ignore[arg-type]

    monkeypatch.setattr(delta_reader, "load_delta", load_delta)
    monkeypatch.setattr("serving.swap.current_version", lambda r: "v2")
    monkeypatch.setattr("serving.swap.version_path", lambda r, name: tmp_path / name)
    monkeypatch.setattr("serving.swap._live_model", lambda m: LiveModel(m, None, 0))
    u._load = load  # type: ignore[method-assign,assignment]
    return u, holder, old, loaded


def test_an_artifact_whose_delta_read_is_retried_goes_live_only_caught_up(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    # The live model holds deltas 1..3; the new artifact v2 (trained to none of them) had its read of delta 1 fail
    # with EMFILE: the round ended there and v2 went live without deltas 1..3, scores staler than the model it
    # replaced until a round read delta 1 (the live model's own round right after failed too).
    fails = [2]

    def fail(name: str) -> None:
        if name.startswith("delta-000000000001") and fails[0] > 0:
            fails[0] -= 1
            raise OSError(errno.EMFILE, "Too many open files")

    assert delta_path(tmp_path, 1, 10).name.startswith("delta-000000000001")
    u, holder, old, loaded = _updater_with_v2_waiting(tmp_path, monkeypatch, 3, fail)
    for _ in range(3):  # delta 1's read fails in two rounds, then reads
        u.check_now()
        assert holder.live.model.delta_seq == 3  # never behind the deltas the replaced model held
    assert holder.live.model is loaded[-1] and loaded[-1].applied == [1, 2, 3]
    assert isinstance(u.deltas, DeltaReader) and u.deltas.retries == 2 and TRANSIENT_TRIES > 2


def test_a_check_that_reads_a_failing_delta_for_the_new_artifact_and_the_live_model_spends_one_try(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The live model holds delta 1; the new artifact v2 holds none. Delta 2's read fails with EMFILE in every read of
    # the first two checks: each check reads it twice (for v2, then for the live model). Each read counted a try, so
    # the third read (the second check) rejected delta 2 for good after two rounds although TRANSIENT_TRIES is
    # rounds: its rows were lost until the next artifact. Now a check is one round: delta 2 applies in the third.
    reads: list[str] = []

    def fail(name: str) -> None:
        if name.startswith("delta-000000000002"):
            reads.append(name)
            if len(reads) <= 4:
                raise OSError(errno.EMFILE, "Too many open files")

    u, holder, old, loaded = _updater_with_v2_waiting(tmp_path, monkeypatch, 1, fail)
    assert TRANSIENT_TRIES == 3
    for _ in range(2):
        u.check_now()
        assert holder.live.model is old and old.applied == []  # nothing past delta 2 applies before it
    assert len(reads) == 4 and u.deltas is not None and u.deltas.bad == 0
    assert u.metrics.delta_retries._value.get() == 2  # one per round
    u.check_now()
    assert holder.live.model is loaded[-1] and loaded[-1].applied == [1, 2, 3]


def test_a_check_that_applies_a_delta_short_of_memory_to_the_new_artifact_and_the_live_model_spends_one_try(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # As for a read above, for an application (DeltaReader.retry_apply): delta 2 runs serving out of memory in every
    # application of the first two checks, twice per check (v2, then the live model). One try per check: it applies
    # in the third, and the new artifact goes live caught up.
    applications: list[int] = []
    real = Model.apply_delta

    def apply_delta(self: Model, rows: Any, vectors: Any, dense: Any, seq: int, **kw: Any) -> None:
        if seq == 2:
            applications.append(seq)
            if len(applications) <= 4:
                raise MemoryError()
        real(self, rows, vectors, dense, seq, **kw)

    monkeypatch.setattr(Model, "apply_delta", apply_delta)
    u, holder, old, loaded = _updater_with_v2_waiting(tmp_path, monkeypatch, 1, lambda name: None)
    assert TRANSIENT_TRIES == 3
    for _ in range(2):
        u.check_now()
        assert holder.live.model is old and old.applied == []  # nothing past delta 2 applies before it
    assert len(applications) == 4 and u.metrics.rejected.labels("delta")._value.get() == 0
    assert u.metrics.delta_retries._value.get() == 2  # one per round
    u.check_now()
    assert holder.live.model is loaded[-1] and loaded[-1].applied == [1, 2, 3]
