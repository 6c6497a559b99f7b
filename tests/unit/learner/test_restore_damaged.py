"""The learner's resume (``Learner._restore``) from a newest checkpoint whose CRCs match but whose content does not fit
the model its own config describes (a tensor of another shape, a missing tensor, a meta without a key, a negative
offset): it is a damaged file like a torn one, reported, and the previous checkpoint used; alone, it is a
CheckpointError naming it, never a traceback and never a silent start over."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from learner import checkpoint as ck
from learner.batch import to_tensors
from learner.config import Device, LearnerSettings
from learner.daemon import Learner
from stream.config import KafkaSettings
from stream.samples import OBSERVED, SampleBatch
from tests.unit.learner.test_safe_loads import CFG, B, samples


def _other_shape(raw: dict[str, Any]) -> None:
    name = next(k for k, v in raw["model"].items() if v.is_floating_point())
    raw["model"][name] = torch.zeros(3, 3)


def _missing_tensor(raw: dict[str, Any]) -> None:
    del raw["model"][next(iter(raw["model"]))]


def _meta_without_samples(raw: dict[str, Any]) -> None:
    del raw["meta"]["samples_trained"]


def _negative_offset(raw: dict[str, Any]) -> None:
    raw["meta"]["offsets"] = {"0": -1}  # librdkafka's OFFSET_END: every sample of partition 0 skipped


def _meta_field(name: str, value: Any) -> Callable[[dict[str, Any]], None]:
    return lambda raw: raw["meta"].__setitem__(name, value)


def _state_field(part: str, name: str, value: Any) -> Callable[[dict[str, Any]], None]:
    return lambda raw: raw[part].__setitem__(name, value)


DAMAGE: dict[str, Callable[[dict[str, Any]], None]] = {
    "other_shape": _other_shape, "missing_tensor": _missing_tensor,
    "meta_without_samples_trained": _meta_without_samples, "negative_offset": _negative_offset,
    # resumed with the text as its count (a TypeError at the first step trained, long after the restore), or a
    # fraction, a truth value or a negative count silently taken as a number
    "samples_trained_text": _meta_field("samples_trained", "many"), "samples_trained_float": _meta_field(
        "samples_trained", 64.5), "samples_trained_negative": _meta_field("samples_trained", -1),
    "steps_text": _meta_field("steps", "7"), "steps_bool": _meta_field("steps", True),
    "offset_fraction": _meta_field("offsets", {"0": 1.5}), "offset_bool": _meta_field("offsets", {"0": True}),
    "offset_text": _meta_field("offsets", {"0": "x"}), "offsets_list": _meta_field("offsets", [5]),
    "partition_rows_fraction": _meta_field("partition_rows", {"0": 2.5}),
    "duplicates_text": _meta_field("duplicates", "none"),
    # read as no offsets: every partition started at 0, each retained sample trained a second time
    "offsets_missing": lambda raw: raw["meta"].pop("offsets"),
    # resumed, with the check that refuses another topic's checkpoint skipped (it compares a string only), or the
    # directory's lineage continued instead of the checkpoint's; a list for the shaping settings read as none
    "topic_number": _meta_field("topic", 5), "topic_list": _meta_field("topic", ["a"]),
    "lineage_object": _meta_field("lineage", {}), "lineage_number": _meta_field("lineage", 5),
    "lineage_not_an_id": _meta_field("lineage", "abc"),  # the directory's lineage continued in silence
    "shape_empty_list": _meta_field("shape", []),
    # counts no stream counts: the late share divided by zero on every batch, each batch's messages struck for it
    "delayed_weights_negative": _state_field("delayed_weights", "positives", -20),
    "delayed_weights_more_delayed_than_positives": _state_field("delayed_weights", "delayed", 3),
    # a histogram of another length: every later batch's metrics update raised, each batch's messages struck
    "metrics_histogram_short": _state_field("metrics", "pos", np.zeros(5, np.int64)),
    # the bias rule's logit of its rate divided by zero on every batch until training owned the bias
    "base_rate_bias_rate_of_one": lambda raw: raw.__setitem__("base_rate_bias", {"positives": 1, "rate": 1.0}),
    "calibration_negative_rows": _state_field("calibration", "rows", -4)}


def _two_checkpoints(tmp_path: Path, seed: int, second_rows: int) -> tuple[LearnerSettings, KafkaSettings]:
    """A learner's settings and two checkpoints under ``tmp_path / "ck"``: 32 samples, then ``second_rows`` more."""
    ls = LearnerSettings(checkpoint_dir=tmp_path / "ck", mlp=(8,), buckets=B, ctx_buckets=5, embedding_dim=4,
                         id_capacity=40, admit_after=1, device=Device.CPU, amp=False, deltas_every_s=0)
    kafka = KafkaSettings(bootstrap_servers="127.0.0.1:9")  # never contacted: no offsets to commit
    first = Learner(kafka, ls)
    try:
        first._build(CFG, first._model_settings())
        rng = np.random.default_rng(seed)
        first._train(to_tensors(samples(rng, 32), CFG))
        first.save()
        first._train(to_tensors(samples(rng, second_rows, start=32), CFG))
        first.save()
    finally:
        first.close()
    return ls, kafka


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_a_newest_checkpoint_that_does_not_fit_its_own_model_is_refused_and_the_previous_one_resumed(
        tmp_path: Path, damage: str, caplog: pytest.LogCaptureFixture) -> None:
    ls, kafka = _two_checkpoints(tmp_path, seed=1, second_rows=32)
    older, newest = ck.list_checkpoints(tmp_path / "ck")
    raw = ck.load(newest)
    DAMAGE[damage](raw)
    newest.unlink()
    torch.save(raw, newest)  # CRCs match: only its content is wrong

    second = Learner(kafka, ls)
    try:
        assert second._restore()
        assert second.trainer is not None and second.trainer.samples == 32 and second.offsets == {}
        assert str(newest) in caplog.text
    finally:
        second.close()

    older.unlink()
    third = Learner(kafka, ls)
    try:
        with pytest.raises(ck.CheckpointError, match=str(newest)):
            third._restore()
    finally:
        third.close()


TRANSIENT: dict[str, BaseException] = {
    "memory_error": MemoryError(), "device_out_of_memory": torch.OutOfMemoryError("CUDA out of memory"),
    "io_error": OSError(5, "Input/output error")}


@pytest.mark.parametrize("error", sorted(TRANSIENT))
def test_a_transient_error_loading_the_newest_checkpoint_stops_the_start_and_never_resumes_an_older_one(
        tmp_path: Path, error: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Running out of memory or a failed read while the newest (sound) checkpoint is loaded into the learner is no
    damage of that file: resuming from the previous checkpoint instead would throw away its training without an
    alert; the start fails with the error, and a restart resumes from the newest."""
    ls, kafka = _two_checkpoints(tmp_path, seed=1, second_rows=32)

    build, calls = Learner._build, []

    def failing_once(self: Learner, *args: Any, **kwargs: Any) -> None:
        calls.append(1)
        if len(calls) == 1:
            raise TRANSIENT[error]
        build(self, *args, **kwargs)

    monkeypatch.setattr(Learner, "_build", failing_once)
    second = Learner(kafka, ls)
    try:
        with pytest.raises(type(TRANSIENT[error])):
            second._restore()
        assert second.trainer is None or second.trainer.samples != 32  # not resumed from the older checkpoint
    finally:
        second.close()
    monkeypatch.setattr(Learner, "_build", build)
    third = Learner(kafka, ls)
    try:
        assert third._restore() and third.trainer is not None and third.trainer.samples == 64
    finally:
        third.close()


def test_a_fallback_past_a_damaged_newest_checkpoint_keeps_none_of_its_state(tmp_path: Path) -> None:
    """The newest checkpoint loads its quality windows, then fails (id metrics that are not a mapping);
    the previous one, written before those windows were saved (they were added later), must resume with fresh
    ones, not the refused file's: ``TrainingQuality.load_state_dict`` keeps whatever part a state lacks."""
    ls, kafka = _two_checkpoints(tmp_path, seed=2, second_rows=64)
    older, newest = ck.list_checkpoints(tmp_path / "ck")
    raw = ck.load(older)
    for part in ("cold_metrics", "warm_metrics", "served"):  # a checkpoint from before these were saved
        del raw[part]
    older.unlink()
    torch.save(raw, older)
    raw = ck.load(newest)
    assert raw["served"] and raw["warm_metrics"]  # the refused file has windows of its own to leak
    raw["id_metrics"] = {"bucket_share": 5}  # not a mapping: fails after the quality windows were loaded
    newest.unlink()
    torch.save(raw, newest)

    fresh = Learner(kafka, ls)
    resumed = Learner(kafka, ls)
    try:
        assert resumed._restore()
        assert resumed.trainer is not None and resumed.trainer.samples == 32
        got = resumed.quality.summary()
        assert got["cold_users"]["cold"]["samples"] == 0 and got["cold_users"]["warm"]["samples"] == 0, got
        assert got["served"]["all"]["impressions"] == 0, got
        assert repr(got) == repr(fresh.quality.summary())  # (repr: NaN, no data, equals itself there)
    finally:
        resumed.close()
        fresh.close()


def test_a_learner_resumed_past_negative_delayed_feedback_counts_trains_its_next_batch_without_striking_it(
        tmp_path: Path) -> None:
    """The newest checkpoint's ``delayed_weights`` say ``positives = -20`` (edited, damaged): loaded, the late share
    of every batch of observed zeros divided by zero (``-20 + 20``), the batch raised and each of its messages got
    a strike. Refused at load, the previous checkpoint resumes and the batch trains."""
    ls, kafka = _two_checkpoints(tmp_path, seed=3, second_rows=32)
    newest = ck.list_checkpoints(tmp_path / "ck")[-1]
    raw = ck.load(newest)
    raw["delayed_weights"] = {"positives": -20, "delayed": 0}
    newest.unlink()
    torch.save(raw, newest)
    learner = Learner(kafka, ls)
    try:
        assert learner._restore() and learner.trainer is not None and learner.trainer.samples == 32
        n = 16
        batch = SampleBatch.from_columns(  # es_dfm's observed zeros, out after 60 s: no click among them
            impression_id=[f"o{k}" for k in range(n)], ts=np.arange(500, 500 + n) * 1000, label=np.zeros(n),
            label_delay_ms=np.full(n, 60_000), user_id=np.arange(n), item_id=np.arange(n) % 30,
            history=[[1, 2]] * n, context={"device": np.zeros(n, np.int64)},
            dense={"price": np.ones(n, np.float32)}, kind=np.full(n, OBSERVED, np.int8))
        learner._train(to_tensors(batch, CFG))  # raised ZeroDivisionError: every message of it struck
        assert learner.trainer.samples == 32 + n
    finally:
        learner.close()
