"""A checkpoint brings every idle bucket's decay up to the event time (``RowMapper.decay_idle_buckets``, so the
artifact built from it holds what the learner would serve): those rows change outside any trained batch, and the
deltas must carry them too, or serving (an earlier artifact plus the deltas) keeps the undecayed buckets that the
learner no longer has until the next artifact (learner/deltas.py: serving ends on the learner's current rows)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from learner import checkpoint as ck
from learner.artifact import build_artifact
from learner.batch import to_tensors
from learner.config import Amp, Device, LearnerSettings
from learner.daemon import Learner
from learner.deltas import list_deltas, load_delta
from learner.features import FeatureConfig, FieldSpec
from serving.model import ScoringModel
from stream.config import KafkaSettings
from stream.samples import SampleBatch

B = 8
CFG = FeatureConfig((FieldSpec("user_id", "single", B, capacity=2, admit_after=1_000, bucket_half_life_s=60.0),
                     FieldSpec("item_id", "single", 30),
                     FieldSpec("history", "sequence", 1, shares="item_id"),
                     FieldSpec("ctx.device", "single", 5)), dense=("price",), embedding_dim=4)
KAFKA = KafkaSettings(bootstrap_servers="127.0.0.1:9")  # never contacted


def samples(users: list[int], start_s: int) -> SampleBatch:
    n = len(users)
    rng = np.random.default_rng(start_s)
    return SampleBatch.from_columns(
        impression_id=[f"s{start_s}-{k}" for k in range(n)], ts=(start_s + np.arange(n)) * 1000,
        label=np.arange(n) % 2, label_delay_ms=np.zeros(n), user_id=np.array(users),
        item_id=rng.integers(0, 30, n), history=[[] for _ in range(n)],
        context={"device": rng.integers(0, 5, n)}, dense={"price": rng.random(n).astype(np.float32)})


def test_the_buckets_a_checkpoint_decays_reach_serving_with_the_next_delta(tmp_path: Path) -> None:
    ls = LearnerSettings(checkpoint_dir=tmp_path / "ck", mlp=(8,), buckets=B, ctx_buckets=5, embedding_dim=4,
                         id_capacity=2, admit_after=1_000, device=Device.CPU, amp=Amp.OFF, deltas_every_s=3600.0,
                         deltas_dir=tmp_path / "deltas")
    learner = Learner(KAFKA, ls)
    try:
        learner._build(CFG, learner._model_settings())
        assert learner.trainer is not None and learner.deltas is not None
        learner._train(to_tensors(samples([0, 1] * 8, 0), CFG))  # user buckets 0 and 1
        assert learner.deltas.write(learner.trainer.model, learner.trainer.samples) is not None
        learner.save()  # checkpoint N (its delta_seq includes that delta): the artifact serving runs
        checkpoint_n = ck.load_latest(tmp_path / "ck")
        assert checkpoint_n is not None
        served = ScoringModel.load(build_artifact(checkpoint_n, tmp_path / "serving", np.zeros(0, np.int64)))
        learner._train(to_tensors(samples([2, 3] * 8, 600), CFG))  # ten minutes later, other buckets only
        weight = learner.trainer.model.state_dict()["sparse.bag.weight"]
        before = weight[:2].clone()
        learner.save()  # buckets 0 and 1 idle for ten minutes: decayed in the learner's table
        weight = learner.trainer.model.state_dict()["sparse.bag.weight"]
        assert not torch.allclose(weight[:2], before)  # (the decay this test is about happened)
        assert learner.deltas.write(learner.trainer.model, learner.trainer.samples) is not None
        for seq, _, path in list_deltas(tmp_path / "deltas"):
            if seq > (served.source_delta_seq or 0):
                d = load_delta(path)
                served.apply_delta(d.rows, d.vectors, d.dense_state, d.seq, d.id_maps, d.samples_trained)
        given, _ = served._given(served._live, np.arange(B))
        assert np.allclose(given, weight[:B].float().numpy()), "serving kept buckets the learner decayed"
    finally:
        learner.close()


def test_the_buckets_a_sharded_checkpoint_decays_go_out_with_the_next_sharded_delta(one_rank_group: None,
                                                                                   tmp_path: Path) -> None:
    from learner.distributed import RankContext
    from learner.features import default_config
    from learner.sharded_daemon import ShardedLearner
    from learner.sharded_model import local_pieces, table_weight

    ls = LearnerSettings(checkpoint_dir=tmp_path / "ckpt", mlp="8", buckets=16, ctx_buckets=8, embedding_dim=4,
                         id_capacity=2, admit_after=1_000, deltas_every_s=1.0, deltas_dir=tmp_path / "deltas",
                         user_bucket_half_life_s=60.0)
    cfg = default_config({}, buckets=16, ctx_buckets=8, embedding_dim=4, id_capacity=2, admit_after=1_000,
                         user_bucket_half_life_s=60.0)

    def train(learner: ShardedLearner, users: list[int], start_s: int) -> None:
        n = len(users)
        kept = to_tensors(SampleBatch.from_columns(
            impression_id=[f"i{start_s}-{k}" for k in range(n)], ts=(start_s + np.arange(n)) * 1000,
            label=np.arange(n) % 2, label_delay_ms=np.zeros(n), user_id=np.array(users),
            item_id=np.ones(n, np.int64), history=[[] for _ in range(n)], context={}), cfg)
        learner._map_ids(kept)
        learner.deltas.mark(kept.values)  # type: ignore[union-attr]
        learner.trainer.test_then_train(kept, n)  # type: ignore[union-attr]

    learner = ShardedLearner(KAFKA, ls, RankContext())
    try:
        learner._build(cfg)
        train(learner, [0, 1] * 8, 0)  # user buckets 0 and 1 (user_id is the first field: rows 0 and 1)
        learner._write_delta()
        train(learner, [2, 3] * 8, 600)  # ten minutes later, other buckets only
        learner.save()  # buckets 0 and 1 idle for ten minutes: decayed in the shards
        learner._write_delta()
        newest = load_delta(list_deltas(tmp_path / "deltas")[-1][2])
        [(_, table)] = local_pieces(table_weight(learner.dmp))  # (one rank: the whole table)
        assert {0, 1} <= set(newest.rows.tolist()), "the decayed buckets stayed undecayed in serving"
        at = {r: i for i, r in enumerate(newest.rows.tolist())}
        for row in (0, 1):
            assert torch.allclose(newest.vectors[at[row]], table[row, :5].float())
    finally:
        learner.close()


def test_the_bucket_an_admission_decays_reaches_serving_with_the_next_delta(tmp_path: Path) -> None:
    """An id admitted after its bucket sat idle: the lookup decays the bucket (and starts the id's row from it), but
    the batch's rows hold the id's own row, not the bucket, so no delta sent the bucket's decayed value."""
    cfg = FeatureConfig((FieldSpec("user_id", "single", B, capacity=2, admit_after=17, bucket_half_life_s=60.0),
                         *CFG.fields[1:]), dense=("price",), embedding_dim=4)
    ls = LearnerSettings(checkpoint_dir=tmp_path / "ck", mlp=(8,), buckets=B, ctx_buckets=5, embedding_dim=4,
                         id_capacity=2, admit_after=17, device=Device.CPU, amp=Amp.OFF, deltas_every_s=3600.0,
                         deltas_dir=tmp_path / "deltas", deltas_id_maps_every_s=0.0)
    learner = Learner(KAFKA, ls)
    try:
        learner._build(cfg, learner._model_settings())
        assert learner.trainer is not None and learner.deltas is not None
        learner._train(to_tensors(samples([0] * 16, 0), cfg))  # user 0, 16 times: on bucket 0
        assert learner.deltas.write(learner.trainer.model, learner.trainer.samples) is not None
        learner.save()  # checkpoint N: the artifact serving runs
        checkpoint_n = ck.load_latest(tmp_path / "ck")
        assert checkpoint_n is not None
        served = ScoringModel.load(build_artifact(checkpoint_n, tmp_path / "serving", np.zeros(0, np.int64)))
        learner._train(to_tensors(samples([0] * 16, 600), cfg))  # ten minutes later: admitted
        weight = learner.trainer.model.state_dict()["sparse.bag.weight"]
        assert learner.mapper is not None and learner.mapper.rows(0, np.array([0]))[0] >= B  # (admitted)
        assert learner.deltas.write(learner.trainer.model, learner.trainer.samples) is not None
        for seq, _, path in list_deltas(tmp_path / "deltas"):
            if seq > (served.source_delta_seq or 0):
                d = load_delta(path)
                served.apply_delta(d.rows, d.vectors, d.dense_state, d.seq, d.id_maps, d.samples_trained)
        given, _ = served._given(served._live, np.arange(B))
        assert np.allclose(given[0], weight[0].float().numpy()), "serving kept the bucket the learner decayed"
    finally:
        learner.close()


def test_the_bucket_a_sharded_admission_decays_goes_out_with_the_next_sharded_delta(one_rank_group: None,
                                                                                   tmp_path: Path) -> None:
    from learner.distributed import RankContext
    from learner.features import default_config
    from learner.sharded_daemon import ShardedLearner

    ls = LearnerSettings(checkpoint_dir=tmp_path / "ckpt", mlp="8", buckets=16, ctx_buckets=8, embedding_dim=4,
                         id_capacity=2, admit_after=17, deltas_every_s=1.0, deltas_dir=tmp_path / "deltas",
                         user_bucket_half_life_s=60.0)
    cfg = default_config({}, buckets=16, ctx_buckets=8, embedding_dim=4, id_capacity=2, admit_after=17,
                         user_bucket_half_life_s=60.0)
    learner = ShardedLearner(KAFKA, ls, RankContext())
    try:
        learner._build(cfg)
        for start_s in (0, 600):  # user 0 sixteen times on bucket 0; ten minutes later admitted
            kept = to_tensors(SampleBatch.from_columns(
                impression_id=[f"i{start_s}-{k}" for k in range(16)], ts=(start_s + np.arange(16)) * 1000,
                label=np.arange(16) % 2, label_delay_ms=np.zeros(16), user_id=np.zeros(16, np.int64),
                item_id=np.ones(16, np.int64), history=[[] for _ in range(16)], context={}), cfg)
            learner._map_ids(kept)
            learner._write_delta()
        assert int(kept.values[0]) >= 16  # (admitted: the batch reads its own row, not bucket 0)
        listed = list_deltas(tmp_path / "deltas")
        assert listed and 0 in load_delta(listed[-1][2]).rows.tolist(), \
            "the bucket the admission decayed stayed undecayed in serving (no delta sent it)"
    finally:
        learner.close()
