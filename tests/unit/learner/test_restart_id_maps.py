"""A restart rolls the id maps back to its checkpoint's, while serving holds the rows the deltas after that checkpoint
gave to other ids: the first delta after a restart must leave serving no id on another id's vector (the reverse of
``DeltaWriter.hold``). The sharded writer's restart is checked in tests/unit/learner/test_distributed.py."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from learner import checkpoint as ck
from learner import delta_writer
from learner import deltas as deltas_mod
from learner.artifact import build_artifact
from learner.batch import to_tensors
from learner.config import Amp, Device, LearnerSettings
from learner.daemon import Learner
from learner.delta_writer import dense_weights
from learner.deltas import encode_delta, list_deltas, load_delta
from learner.features import FeatureConfig, FieldSpec
from serving.model import ScoringModel
from stream.config import KafkaSettings
from stream.samples import SampleBatch

B = 8
CFG = FeatureConfig((FieldSpec("user_id", "single", B, capacity=2, admit_after=1),
                     FieldSpec("item_id", "single", 30),
                     FieldSpec("history", "sequence", 1, shares="item_id"),
                     FieldSpec("ctx.device", "single", 5)), dense=("price",), embedding_dim=4)


def samples(users: list[int], start: int) -> SampleBatch:
    n = len(users)
    rng = np.random.default_rng(start)
    return SampleBatch.from_columns(
        impression_id=[f"s{start + k}" for k in range(n)], ts=np.arange(start, start + n) * 1000,
        label=np.arange(n) % 2, label_delay_ms=np.zeros(n), user_id=np.array(users),
        item_id=rng.integers(0, 30, n), history=[[] for _ in range(n)],
        context={"device": rng.integers(0, 5, n)}, dense={"price": rng.random(n).astype(np.float32)})


def _settings(tmp_path: Path) -> LearnerSettings:
    return LearnerSettings(checkpoint_dir=tmp_path / "ck", mlp=(8,), buckets=B, ctx_buckets=5, embedding_dim=4,
                           id_capacity=2, admit_after=1, device=Device.CPU, amp=Amp.OFF, deltas_every_s=3600.0,
                           deltas_dir=tmp_path / "deltas", deltas_id_maps_every_s=0.0)  # (by hand, with maps)


KAFKA = KafkaSettings(bootstrap_servers="127.0.0.1:9")  # never contacted
AFTER = [samples([103] * 8, 16), samples([201, 202] * 8, 24)]  # 103 takes 101's or 102's row; then 201 and 202 both


def _first_run(tmp_path: Path) -> np.ndarray:
    """Checkpoint N (101, 102 on the two own rows), then deltas (with the maps) that give both rows to 201 and 202;
    the own rows of 101 and 102 at N."""
    first = Learner(KAFKA, _settings(tmp_path))
    try:
        first._build(CFG, first._model_settings())
        assert first.trainer is not None and first.deltas is not None and first.mapper is not None
        first._train(to_tensors(samples([101, 102] * 8, 0), CFG))
        first.save()  # checkpoint N
        assert first.deltas.write(first.trainer.model, first.trainer.samples) is not None
        old_rows = first.mapper.rows(0, np.array([101, 102]))
        assert (old_rows >= B).all()  # own rows
        for b in AFTER:
            first._train(to_tensors(b, CFG))
        assert (first.mapper.rows(0, np.array([101, 102])) < B).all()  # evicted: their rows went to 201 and 202
        assert first.deltas.write(first.trainer.model, first.trainer.samples) is not None  # with the maps
    finally:
        first.close()
    return old_rows


def _served_from_checkpoint(tmp_path: Path) -> ScoringModel:
    checkpoint_n = ck.load_latest(tmp_path / "ck")
    assert checkpoint_n is not None
    return ScoringModel.load(build_artifact(checkpoint_n, tmp_path / "serving", np.zeros(0, np.int64)))


def _apply(served: ScoringModel, path: Path) -> None:
    d = load_delta(path)
    served.apply_delta(d.rows, d.vectors, d.dense_state, d.seq, d.id_maps, d.samples_trained)


def _restarted_resend(ls: LearnerSettings) -> tuple[Learner, torch.Tensor, torch.Tensor, list[Any]]:
    """A learner restored from the first run's checkpoint that trained one batch: it, the rows its next delta resends
    (R,), its table (num_rows, D + 1), and that delta's tree [rows, vectors, dense weights, id maps]."""
    second = Learner(KAFKA, ls)
    assert second._restore() and second.trainer is not None and second.deltas is not None
    assert second.mapper is not None
    second._train(to_tensors(AFTER[0], CFG))
    resent = second.deltas.touched.nonzero().squeeze(1)  # (R,)
    weight = second.trainer.model.state_dict()["sparse.bag.weight"]  # (num_rows, D + 1)
    return second, resent, weight, [resent, weight[resent].float(), dense_weights(second.trainer.model),
                                    second.mapper.state_dict()]


def _encoded_size(tree: list[Any]) -> int:
    rows, vectors, dense_state, id_maps = tree
    return len(encode_delta({"seq": 1, "samples_trained": 0, "created": 0.0, "lineage": None, "rows": rows,
                             "vectors": vectors, "dense_state": dense_state, "id_maps": id_maps}))


def test_after_a_restart_no_id_is_served_the_vector_its_row_got_after_the_checkpoint(tmp_path: Path) -> None:
    """Checkpoint N maps ids 101 and 102 to the two own rows; the deltas after it give both rows to ids 201 and 202
    (with the maps) and serving applies them. A restart from N replays the samples after it: its first delta
    carries N's maps (101 and 102 on those rows again) but not the rows (the replay has not reached the evictions),
    so serving answered 101 with the vector 201 or 202 was trained to."""
    ls = _settings(tmp_path)
    old_rows = _first_run(tmp_path)
    served = _served_from_checkpoint(tmp_path)

    def apply_all() -> None:
        for _, _, path in list_deltas(tmp_path / "deltas"):
            if int(path.name.split("-")[1]) > served.delta_seq:
                _apply(served, path)

    apply_all()
    assert sorted(served.map_rows(0, np.array([201, 202])).tolist()) == sorted(old_rows.tolist())

    second = Learner(KAFKA, ls)
    try:
        assert second._restore() and second.trainer is not None and second.deltas is not None
        assert second.mapper is not None
        second._train(to_tensors(AFTER[0], CFG))  # the replay, up to the first delta after the restart
        assert second.deltas.write(second.trainer.model, second.trainer.samples) is not None
        apply_all()
        weight = second.trainer.model.state_dict()["sparse.bag.weight"]
        users = np.array([101, 102, 103, 201, 202])
        assert served.map_rows(0, users).tolist() == second.mapper.rows(0, users).tolist()
        for user, row in zip(users.tolist(), second.mapper.rows(0, users).tolist(), strict=True):
            if row < B:
                continue  # a bucket: shared, nobody's own vector
            given, _ = served._given(served._live, np.array([row]))
            assert torch.allclose(torch.from_numpy(given[0]), weight[row].float()), (user, row)
    finally:
        second.close()


def test_a_resend_past_the_readers_byte_limit_goes_out_in_parts_that_serving_reads_and_never_misserves_between(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The resend after a restart (every admitted id's row with the maps) is ~1.2 GB at 10 M ids: past the reader's
    byte limit (``deltas.MAX_BYTES``) serving refused it unread and skipped it for good, so the rolled-back maps
    and rows never arrived. With the limit made small the writer splits it: every part is within the limit and
    read, every row arrives, and after each part every id on an own row is served that row's resent vector."""
    ls = _settings(tmp_path)
    _first_run(tmp_path)
    served = _served_from_checkpoint(tmp_path)
    for _, _, path in list_deltas(tmp_path / "deltas"):
        _apply(served, path)
    written_before = {p for _, _, p in list_deltas(tmp_path / "deltas")}

    second, resent, weight, tree = _restarted_resend(ls)
    try:
        one_part = _encoded_size(tree)
        for too_many in range(1, len(resent)):  # rows (8 + 4 (D + 1) bytes each) over the limit: the first part
            for module in (deltas_mod, delta_writer):  # the reader's limit and the writer's
                monkeypatch.setattr(module, "MAX_BYTES", one_part - too_many * 28)  # one row (owned rows lowest)
            if second.deltas._parts(*tree[:3], second.trainer.samples, tree[3])[0] == (0, 1):
                break
        assert second.deltas.write(second.trainer.model, second.trainer.samples) is not None
        parts = [p for _, _, p in list_deltas(tmp_path / "deltas") if p not in written_before]
        assert len(parts) >= 2
        owned = set(second.mapper.owned_rows().tolist())  # 101's and 102's rows at N, now 201's and 202's in serving
        assert not owned <= set(load_delta(parts[0]).rows.tolist())  # (so the parts' order matters)
        users = np.array([101, 102, 103, 201, 202])
        arrived: set[int] = set()
        for path in parts:
            d = load_delta(path)  # (refused: DeltaError)
            arrived |= set(d.rows.tolist())
            _apply(served, path)
            for user, row in zip(users.tolist(), served.map_rows(0, users).tolist(), strict=True):
                if row >= B:  # an own row: it must hold this id's vector, not the one another id left there
                    given, _ = served._given(served._live, np.array([row]))
                    assert torch.allclose(torch.from_numpy(given[0]), weight[row].float()), (path.name, user, row)
        assert arrived == set(resent.tolist())
        assert served.map_rows(0, users).tolist() == second.mapper.rows(0, users).tolist()
    finally:
        second.close()


def test_a_delta_under_the_byte_limit_is_encoded_once_its_size_bounded_without_encoding(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The split needs a delta's size; encoding every delta twice to learn it (the maps are ~41 MB per million ids)
    doubled the writer's work. A cheap upper bound (``rough_bytes``) spares it below the limit: the resend after a
    restart, the largest delta there is, is encoded once, and the bound is above its real size."""
    ls = _settings(tmp_path)
    _first_run(tmp_path)
    second, _, _, tree = _restarted_resend(ls)
    try:
        size = _encoded_size(tree)
        assert size <= deltas_mod.rough_bytes(tree) < 2 * size + 65536
        encoded: list[int] = []
        monkeypatch.setattr(delta_writer, "encode_delta",
                            lambda *a, **kw: encoded.append(1) or encode_delta(*a, **kw))
        assert second.deltas.write(second.trainer.model, second.trainer.samples) is not None
        assert len(encoded) == 1
    finally:
        second.close()


def test_a_restart_with_another_cold_k_resumes_from_its_newest_checkpoint(tmp_path: Path) -> None:
    # cold_k is no shape setting (README "Restore contract": it may change across a restart). The checkpoint's cold
    # tracker, counting to the old cold_k, made every checkpoint fail to load as if damaged: the learner did not
    # start (or went back to an older checkpoint that happened to load).
    ls = dataclasses.replace(_settings(tmp_path), cold_tracker_capacity=64)  # (cold_k 10)
    first = Learner(KAFKA, ls)
    try:
        first._build(CFG, first._model_settings())
        assert first.trainer is not None
        first._train(to_tensors(samples([101, 102] * 8, 0), CFG))
        first.save()
    finally:
        first.close()
    second = Learner(KAFKA, dataclasses.replace(ls, cold_k=3))
    try:
        assert second._restore() and second.trainer is not None
        assert second.trainer.samples == 16
        assert second.quality.cold.k == 3
        # the tracker starts over: every user counts as cold again for its next cold_k impressions
        assert second.quality.cold_of(np.array([101, 101, 101, 101]), 1.0, None).tolist() == [True] * 3 + [False]
    finally:
        second.close()
