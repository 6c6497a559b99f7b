"""Dynamic ids in the learner (learner/row_mapper.py) and through the serving artifact; cold-start pieces."""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import orjson
import pytest
import torch

from learner.artifact import build_artifact
from learner.batch import to_tensors
from learner.evaluation.ratings import cold_mask
from learner.features import FeatureConfig, FieldSpec
from learner.model import DeepFM
from learner.optim import make_optimizers
from learner.row_mapper import ColdTracker, RowMapper, user_keys
from learner.trainer import Trainer
from serving.model import ScoringModel
from stream.samples import SampleBatch

B = 8  # buckets per id field
CFG = FeatureConfig((FieldSpec("user_id", "single", B, capacity=50, admit_after=2),
                     FieldSpec("item_id", "single", B, capacity=50, admit_after=1, init="zero"),
                     FieldSpec("history", "sequence", 1, shares="item_id"),
                     FieldSpec("ctx.device", "single", 5)), embedding_dim=4)


def batch(users: list[int], items: list[int], history: list[list[int]], start: int = 0) -> SampleBatch:
    n = len(users)
    return SampleBatch.from_columns(
        impression_id=[f"i{start + k}" for k in range(n)], ts=np.arange(start, start + n) * 1000,
        label=np.arange(n) % 2, label_delay_ms=np.zeros(n), user_id=np.array(users), item_id=np.array(items),
        history=history, context={"device": np.array([3] * n)})


def test_layout_puts_own_rows_after_the_buckets_and_history_uses_item_rows() -> None:
    assert CFG.blocks[0] == (0, B) and CFG.blocks[1] == (B + 50, B) and CFG.blocks[2] == CFG.blocks[1]
    assert CFG.num_rows == 2 * (B + 50) + 5 and CFG.dynamic


def test_admission_own_rows_bucket_init_and_read_only_history() -> None:
    model = DeepFM(CFG, mlp=(4,), seed=0, autocast_dtype=None)
    sparse, dense = make_optimizers(model, 0.1, 0.01)
    mapper = RowMapper(CFG)
    w = model.sparse.bag.weight
    # user 1001 twice (admit_after=2): the first batch keeps the bucket, the second admits it
    tb = to_tensors(batch([1001], [77], [[500, 501]]), CFG)
    st = mapper.apply(tb, now=1.0, model=model, sparse_opt=sparse)
    assert int(tb.values[0]) == 1001 % B  # user still on its bucket
    item_first = CFG.blocks[1][0]
    assert int(tb.values[1]) >= item_first + B  # item admitted at first sight (admit_after=1)
    assert torch.all(w[int(tb.values[1])] == 0)  # init="zero"
    assert st.admitted == {"user_id": 0, "item_id": 1} and st.bucket_lookups["user_id"] == 1
    hist = tb.values[2:4].tolist()
    assert hist == [item_first + 500 % B, item_first + 501 % B]  # history items never seen as items: buckets
    assert mapper.maps["item_id"].stats()["admissions"] == 1  # ... and history did not admit them
    Trainer(model, sparse, dense).test_then_train(tb)
    bucket_vec = w[1001 % B].detach().clone()
    tb2 = to_tensors(batch([1001], [77], [[77]], start=1), CFG)
    mapper.apply(tb2, now=2.0, model=model, sparse_opt=sparse)
    own = int(tb2.values[0])
    assert own >= B and torch.equal(w[own].detach(), bucket_vec)  # admitted, starting as its bucket
    assert int(tb2.values[1]) == int(tb.values[1]) == int(tb2.values[2])  # item keeps its row; history finds it
    assert float(sparse.state[w]["sum"][own]) == 0.0  # optimizer state of the new row reset


def test_eviction_when_full_returns_ids_to_their_buckets() -> None:
    cfg = FeatureConfig((FieldSpec("user_id", "single", 4, capacity=64, admit_after=1),), embedding_dim=2)
    mapper = RowMapper(cfg)
    for step in range(4):  # 4 x 48 distinct users through 64 own rows
        users = list(range(step * 48, (step + 1) * 48))
        tb = to_tensors(batch(users, [0] * 48, [[]] * 48), cfg)
        st = mapper.apply(tb, now=float(step))
        assert st.bucket_lookups["user_id"] == 0  # admitted on first sight, evicting the oldest when full
    s = mapper.stats()["user_id"]
    assert s["evictions"] > 0 and s["live_rows"] <= 64
    old = to_tensors(batch([0], [0], [[]]), cfg)
    mapper.apply(old, now=10.0, train=False)
    assert int(old.values[0]) == 0 % 4  # user 0 was evicted long ago: its bucket again


def test_serving_artifact_maps_ids_like_the_learner(tmp_path: Path) -> None:
    model = DeepFM(CFG, mlp=(8,), seed=1, autocast_dtype=None)
    sparse, dense = make_optimizers(model, 0.1, 0.01)
    mapper, trainer = RowMapper(CFG), Trainer(model, sparse, dense)
    rng = np.random.default_rng(0)
    for k in range(20):
        users, items = rng.integers(0, 40, 16).tolist(), rng.integers(0, 30, 16).tolist()
        tb = to_tensors(batch(users, items, [rng.integers(0, 30, 3).tolist() for _ in range(16)], start=16 * k), CFG)
        mapper.apply(tb, now=float(k), model=model, sparse_opt=sparse)
        trainer.test_then_train(tb)
    ckpt = {"meta": {"feature_config": CFG.to_dict(), "samples_trained": 320, "offsets": {},
                     "model": {"mlp": "8", "dropout": 0.0, "amp": False, "seed": 1}},
            "model": model.state_dict(), "id_maps": mapper.state_dict(), "path": "/ckpt/x.pt"}
    served = ScoringModel.load(build_artifact(ckpt, tmp_path, np.arange(10), format="torchscript"))
    probe_users = np.array([3, 17, 39, 12345])  # seen ones and a brand-new one
    assert served.map_rows(0, probe_users).tolist() == mapper.rows(0, probe_users).tolist()
    assert served.map_rows(0, np.array([12345]))[0] == 12345 % B  # brand-new user: its bucket
    tb = to_tensors(batch(probe_users.tolist(), [1, 2, 3, 4], [[1, 2], [], [5], [29]], start=9999), CFG)
    mapper.apply(tb, now=99.0, train=False)
    served_tb = to_tensors(batch(probe_users.tolist(), [1, 2, 3, 4], [[1, 2], [], [5], [29]], start=9999), CFG)
    served.map_batch(served_tb)
    assert torch.equal(served_tb.values, tb.values)
    with torch.no_grad():
        model.eval()
        want = torch.sigmoid(model(tb.values, tb.offsets, tb.dense))
    got = served.score(served_tb.values, served_tb.offsets, served_tb.dense)
    assert torch.allclose(got, want, atol=1e-6)


def test_cold_tracker_and_cold_mask_count_earlier_impressions() -> None:
    users = np.array([5, 5, 7, 5, 7, 5, 9])
    assert cold_mask(users, 2).tolist() == [True, True, True, False, True, False, True]
    tr = ColdTracker(k=2, capacity=100)
    got = [bool(tr.cold(np.array([u]), float(i))[0]) for i, u in enumerate(users)]
    assert got == cold_mask(users, 2).tolist()
    tb = to_tensors(batch([1, 2], [3, 4], [[], []]), CFG)
    assert user_keys(tb, CFG).tolist() == [1, 2]


def test_cold_tracker_counts_a_users_impressions_within_one_batch_and_not_its_clicks() -> None:
    users = np.array([5, 5, 7, 5, 7, 5, 9, 5, 7])
    whole = ColdTracker(k=2, capacity=100).cold(users, 0.0)
    assert whole.tolist() == cold_mask(users, 2).tolist()  # a burst in one batch: its first k rows are cold
    tr = ColdTracker(k=2, capacity=100)
    clicks = np.array([True, False] * 4 + [True])  # every other row is a later sample, not an impression
    got = tr.cold(users, 0.0, counted=~clicks)
    imps = users[~clicks]
    assert got[~clicks].tolist() == cold_mask(imps, 2).tolist()
    assert tr.cold(np.array([5, 7]), 1.0).tolist() == [False, True]  # 5 had 2 impressions, 7 had 1


def test_a_cold_tracker_state_loads_into_another_cold_tracker_capacity_keeping_its_most_recent_warm_users(
        caplog: pytest.LogCaptureFixture) -> None:
    # [learner] cold_tracker_capacity may change across a restart: the checkpoint's tracker, of the old capacity,
    # failed to load into the new one (the id map refuses another config). It loads now, keeping the most recently
    # seen warm users that fit (the others are cold again, logged) and the users still counting towards warm.
    tr = ColdTracker(k=1, capacity=64)
    for t in range(8):  # users 0..63 warm (2 impressions each), user 8t..8t+7 last seen at t
        tr.cold(np.repeat(np.arange(8 * t, 8 * t + 8), 2), float(t))
    tr.cold(np.array([100]), 8.0)  # one impression: counting
    state = tr.state_dict()
    bigger = ColdTracker(k=1, capacity=128)
    bigger.load_state_dict(state)
    assert bigger.capacity == 128 and not bigger.cold(np.arange(64), 9.0).any()
    assert bigger.cold(np.array([100]), 9.0).tolist() == [False]  # its second impression: warm
    smaller = ColdTracker(k=1, capacity=16)
    with caplog.at_level("WARNING", logger="streamrec.train"):
        smaller.load_state_dict(state)
    assert "the 48 least recently seen are forgotten" in caplog.text
    assert smaller.cold(np.arange(64), 9.0, counted=np.zeros(64, bool)).tolist() == [True] * 48 + [False] * 16
    assert smaller.cold(np.array([100]), 9.0).tolist() == [False]
    other_k = ColdTracker(k=2, capacity=16)  # another cold_k: starts over (tests/unit/learner/test_restart_id_maps.py)
    other_k.load_state_dict(state)
    assert other_k.cold(np.array([0, 0, 0]), 9.0).tolist() == [True, True, False]


def test_cold_start_evaluation_runs_every_variant_on_one_stream() -> None:
    from learner.cold_start import ColdStartConfig, describe, evaluate_cold_start

    d = evaluate_cold_start("synthetic", seed=1, limit=4000, cold=ColdStartConfig(capacity=5000, buckets=32),
                            config={"mlp": (16,)})
    assert set(d["variants"]) == {"zero", "buckets", "admission"} and d["samples"] == 4000
    for r in d["variants"].values():
        assert r["cold"]["samples"] == d["cold_samples"] and r["cold"]["samples"] + r["warm"]["samples"] == 4000
        assert 0.3 < r["all"]["auc"] < 1.0 and np.isfinite(r["cold"]["logloss"])
    assert d["variants"]["buckets"]["id_maps"] == {}  # static hashing: no id maps
    assert d["variants"]["admission"]["id_maps"]["user_id"]["admissions"] > 0
    assert d["variants"]["admission"]["id_maps"]["user_id"]["bucket_share"] > 0
    assert "admission vs zero" in describe(d)


def test_a_user_admitted_after_the_artifact_reaches_serving_through_a_delta(tmp_path: Path) -> None:
    from cache_refresh.publish import publish
    from learner.delta_writer import DeltaWriter
    from serving.metrics import ServingMetrics
    from serving.swap import ModelHolder, ModelUpdater

    model = DeepFM(CFG, mlp=(8,), seed=2, autocast_dtype=None)
    sparse, dense = make_optimizers(model, 0.1, 0.01)
    mapper, trainer = RowMapper(CFG), Trainer(model, sparse, dense)
    rng = np.random.default_rng(3)

    def train(users: list[int], start: int) -> torch.Tensor:
        tb = to_tensors(batch(users, rng.integers(0, 30, len(users)).tolist(), [[] for _ in users], start), CFG)
        mapper.apply(tb, now=float(start), model=model, sparse_opt=sparse)
        trainer.test_then_train(tb)
        return tb.values

    for k in range(5):
        train(rng.integers(0, 40, 16).tolist(), 16 * k)
    ckpt = {"meta": {"feature_config": CFG.to_dict(), "samples_trained": trainer.samples, "offsets": {},
                     "model": {"mlp": "8", "dropout": 0.0, "amp": False, "seed": 2}},
            "model": model.state_dict(), "id_maps": mapper.state_dict(), "path": "/ckpt/y.pt"}
    root = tmp_path / "serving"
    publish(root, build_artifact(ckpt, root, np.arange(20)), keep=3)
    writer = DeltaWriter(tmp_path / "deltas", CFG.num_rows, every_s=1e-9)
    writer.id_maps_source = mapper.state_dict
    new_user = 777_777
    for k in range(3):  # seen 3 times after the artifact: admitted (admit_after=2) and trained
        writer.mark(train([new_user] * 4, 1000 + 4 * k))
    assert mapper.rows(0, np.array([new_user]))[0] >= B  # the learner gave it its own row
    writer.write(model, trainer.samples)

    holder = ModelHolder()
    updater = ModelUpdater(holder, ServingMetrics(holder.model), root, tmp_path / "deltas")
    updater.check_now()  # loads the artifact, then applies the delta (rows, dense weights, id maps)
    served = holder.model()
    assert served is not None and served.delta_seq == 1
    assert served.map_rows(0, np.array([new_user])).tolist() == mapper.rows(0, np.array([new_user])).tolist()
    probe = to_tensors(batch([new_user, 3], [5, 6], [[], []], start=5000), CFG)
    mapper.apply(probe, now=9999.0, train=False)
    served_probe = to_tensors(batch([new_user, 3], [5, 6], [[], []], start=5000), CFG)
    served.map_batch(served_probe)
    with torch.no_grad():
        model.eval()
        want = torch.sigmoid(model(probe.values, probe.offsets, probe.dense))
    assert torch.allclose(served.score(served_probe.values, served_probe.offsets, served_probe.dense), want,
                          atol=1e-6)


def test_the_learner_shrinks_idle_user_buckets_when_a_new_user_lands_in_them() -> None:
    cfg = FeatureConfig((FieldSpec("user_id", "single", B, capacity=50, admit_after=5, bucket_half_life_s=60.0),
                         FieldSpec("item_id", "single", B, capacity=50, admit_after=5),
                         FieldSpec("history", "sequence", 1, shares="item_id"), FieldSpec("ctx.device", "single", 5)),
                        embedding_dim=4)
    model = DeepFM(cfg, mlp=(4,), seed=0, autocast_dtype=None)
    sparse, _ = make_optimizers(model, 0.1, 0.01)
    mapper, w = RowMapper(cfg), model.sparse.bag.weight
    mapper.apply(to_tensors(batch([1001], [77], [[]]), cfg), now=0.0, model=model, sparse_opt=sparse)
    user_bucket, item_bucket = 1001 % B, cfg.blocks[1][0] + 77 % B
    before = w.detach().clone()
    other = 1001 + B  # another new user, same bucket, two half-lives later
    mapper.apply(to_tensors(batch([other], [77], [[]]), cfg), now=120.0, model=model, sparse_opt=sparse)
    assert torch.allclose(w[user_bucket], before[user_bucket] / 4)
    assert torch.equal(w[item_bucket], before[item_bucket])  # item buckets keep their memory (no half-life)


def test_deltas_written_row_by_row_carry_the_id_maps_again_once_id_maps_every_s_passed(tmp_path: Path) -> None:
    """The distributed mode's rank 0 calls ``write_rows`` only (``learner/sharded_deltas.py``): the maps' cadence must
    follow the clock there too (it sent them with the first delta only)."""
    from learner.delta_writer import DeltaWriter, dense_weights
    from learner.deltas import list_deltas, load_delta

    dense = dense_weights(DeepFM(CFG, mlp=(8,), seed=0, autocast_dtype=None))
    now = [0.0]
    writer = DeltaWriter(tmp_path / "deltas", CFG.num_rows, every_s=1.0, clock=lambda: now[0], id_maps_every_s=10.0)
    writer.id_maps_source = RowMapper(CFG).state_dict
    carried = []
    for t in (0.0, 5.0, 11.0, 12.0, 25.0):
        now[0] = t
        carried.append(writer.maps_due())
        writer.write_rows(torch.tensor([1]), torch.zeros(1, CFG.embedding_dim + 1), dense, 1)
    got = [load_delta(p).id_maps is not None for _, _, p in list_deltas(tmp_path / "deltas")]
    assert got == carried == [True, False, True, False, True]


def test_map_stats_report_each_admissions_event_time_from_first_sight() -> None:
    mapper = RowMapper(CFG)  # user_id admits after 2 sightings, item_id on the first
    st = mapper.apply(to_tensors(batch([1001, 1002], [77, 78], [[], []]), CFG), now=1_700_000_000.0)
    assert st.time_to_admission["user_id"].size == 0 and st.time_to_admission["item_id"].tolist() == [0.0, 0.0]
    st = mapper.apply(to_tensors(batch([1001], [77], [[]], start=2), CFG), now=1_700_003_600.0)
    assert st.admitted["user_id"] == 1 and st.time_to_admission["user_id"].tolist() == [3600.0]
    old = mapper.state_dict()  # 1002 counted once; a checkpoint written before first-seen times lost its time
    for field_state in old.values():
        for k in [k for k in field_state if k.endswith("_first_seen")]:
            del field_state[k]
    restored = RowMapper.from_state(CFG, old)
    st = restored.apply(to_tensors(batch([1002], [79], [[]], start=3), CFG), now=1_700_007_200.0)
    assert st.admitted["user_id"] == 1 and st.time_to_admission["user_id"].size == 0  # unknown: no bogus delay


def test_an_id_evicted_after_the_artifact_is_not_served_the_vector_of_the_id_its_row_went_to(tmp_path: Path) -> None:
    """Between two deltas that carry the id maps, serving maps ids with the maps it has: a delta that sent the row of
    an evicted id, now another id's, without the maps that say so served the evicted id the other id's vector."""
    from cache_refresh.publish import publish
    from learner.delta_writer import DeltaWriter
    from serving.metrics import ServingMetrics
    from serving.swap import ModelHolder, ModelUpdater

    cfg = FeatureConfig((FieldSpec("user_id", "single", B, capacity=2, admit_after=1),
                         FieldSpec("item_id", "single", B), FieldSpec("history", "sequence", 1, shares="item_id"),
                         FieldSpec("ctx.device", "single", 5)), embedding_dim=4)
    model = DeepFM(cfg, mlp=(8,), seed=2, autocast_dtype=None)
    sparse, dense = make_optimizers(model, 0.1, 0.01)
    mapper, trainer = RowMapper(cfg), Trainer(model, sparse, dense)
    now = [0.0]
    writer = DeltaWriter(tmp_path / "deltas", cfg.num_rows, every_s=1e-9, clock=lambda: now[0], id_maps_every_s=60.0)
    writer.id_maps_source = mapper.state_dict

    def train(users: list[int], start: int) -> None:
        tb = to_tensors(batch(users, [1] * len(users), [[] for _ in users], start), cfg)
        st = mapper.apply(tb, now=float(start), model=model, sparse_opt=sparse)
        writer.hold(st.reassigned)
        trainer.test_then_train(tb)
        writer.mark(tb.values)

    evicted = 101
    train([evicted, 102], 0)
    old_row = int(mapper.rows(0, np.array([evicted]))[0])
    assert old_row >= B  # its own row
    ckpt = {"meta": {"feature_config": cfg.to_dict(), "samples_trained": trainer.samples, "offsets": {},
                     "model": {"mlp": "8", "dropout": 0.0, "amp": False, "seed": 2}},
            "model": model.state_dict(), "id_maps": mapper.state_dict(), "path": "/ckpt/z.pt"}
    root = tmp_path / "serving"
    publish(root, build_artifact(ckpt, root, np.arange(4)), keep=3)
    artifact_vector = model.sparse.bag.weight[old_row].detach().clone()
    writer.write(model, trainer.samples)  # the first delta carries the maps (the same as the artifact's)
    now[0] = 1.0
    for k in range(3):  # two new users take both rows: the evicted id's row goes to one of them and is trained
        train([201, 202], 10 + k)
    assert mapper.rows(0, np.array([evicted]))[0] < B  # the learner: back to its bucket
    assert not writer.maps_due()
    writer.write(model, trainer.samples)  # no maps in this one

    holder = ModelHolder()
    updater = ModelUpdater(holder, ServingMetrics(holder.model), root, tmp_path / "deltas")
    updater.check_now()
    served = holder.model()
    assert served is not None and served.delta_seq == 2
    assert served.map_rows(0, np.array([evicted]))[0] == old_row  # serving's maps still give it its old row

    def scores(users: list[int], vector_at_old_row: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(serving's scores, the learner's model's on the rows serving maps them to, optionally with
        ``vector_at_old_row`` in the evicted id's old row)."""
        tb = to_tensors(batch(users, [1] * len(users), [[] for _ in users], 5000), cfg)
        served.map_batch(tb)
        ref = copy.deepcopy(model).eval()
        if vector_at_old_row is not None:
            with torch.no_grad():
                ref.sparse.bag.weight[old_row] = vector_at_old_row
        with torch.no_grad():
            want = torch.sigmoid(ref(tb.values, tb.offsets, tb.dense))
        return served.score(tb.values, tb.offsets, tb.dense), want

    got, own = scores([evicted], artifact_vector)
    _, others = scores([evicted])  # the row's new owner's vector
    assert not torch.allclose(own, others)
    assert torch.allclose(got, own, atol=1e-6), (got, own, others)  # its own vector, not the new owner's
    now[0] = 61.0
    writer.write(model, trainer.samples)  # the maps are due: the held rows go out with them
    updater.check_now()
    served = holder.model()
    assert served is not None and served.delta_seq == 3
    assert served.map_rows(0, np.array([evicted, 201, 202])).tolist() == \
        mapper.rows(0, np.array([evicted, 201, 202])).tolist()
    got, want = scores([evicted, 201, 202])
    assert torch.allclose(got, want, atol=1e-6)


def _row_after_accumulated_step(first_label: int) -> torch.Tensor:
    """One own user row, two micro-batches per step: user 1 trains the row, then user 2 takes it (LRU) before the
    step. Returns the row after the step."""
    cfg = FeatureConfig((FieldSpec("user_id", "single", 1, capacity=1, admit_after=1),), embedding_dim=2)
    model = DeepFM(cfg, mlp=(2,), seed=0, autocast_dtype=None)
    sparse, dense = make_optimizers(model, 0.5, 0.0)
    trainer = Trainer(model, sparse, dense, accumulation=2)
    mapper = RowMapper(cfg)
    first = SampleBatch.from_columns(impression_id=["a"], ts=np.array([0]), label=np.array([first_label]),
                                     label_delay_ms=np.zeros(1), user_id=np.array([1]), item_id=np.array([0]),
                                     history=[[]], context={})
    tb = to_tensors(first, cfg)
    mapper.apply(tb, now=1.0, model=model, sparse_opt=sparse)
    trainer.test_then_train(tb)  # micro-batch 1 of 2: user 1's gradient waits for the step
    second = SampleBatch.from_columns(impression_id=["b"], ts=np.array([1000]), label=np.array([1]),
                                      label_delay_ms=np.zeros(1), user_id=np.array([2]), item_id=np.array([0]),
                                      history=[[]], context={})
    tb2 = to_tensors(second, cfg)
    st = mapper.apply(tb2, now=2.0, model=model, sparse_opt=sparse)
    assert st.evicted == {"user_id": 1} and st.admitted == {"user_id": 1}
    row = int(tb2.values[0])
    assert row == int(tb.values[0])  # user 2 got user 1's row
    start = model.sparse.bag.weight[row].detach().clone()  # its bucket's vector
    trainer.test_then_train(tb2)  # micro-batch 2: the step
    assert trainer.steps == 1
    after = model.sparse.bag.weight[row].detach().clone()
    assert not torch.equal(after, start)  # user 2's own gradient was applied
    return after


def test_a_row_handed_to_a_new_id_between_accumulated_micro_batches_does_not_get_the_old_ids_pending_gradient() -> None:
    # The new id's row starts as its bucket's vector with fresh optimizer state; what it learns in the step must
    # come from its own samples only, whatever the id that left the row learned in the step's earlier micro-batch.
    assert torch.equal(_row_after_accumulated_step(0), _row_after_accumulated_step(1))


def test_ids_equal_as_text_share_one_own_row_and_ids_that_differ_in_bytes_do_not_in_learner_and_serving(
        tmp_path: Path) -> None:
    """Raw ids hashed by the joiner (``hash_column``) and admitted by the learner, then sent in scoring requests:
    ``7`` and ``"7"`` are one id (one own row); ``"007"``, ``" 7"``, ``"7 "`` and the NFD spelling of ``"Café"`` are
    ids of their own (stable_hash hashes the text as sent, no normalisation), and serving maps every one of them to
    the row the learner gave it, or to its bucket when it was never admitted."""
    from serving.features import FeatureEncoder
    from serving.request import read_request
    from stream.features import hash_column, hash_value

    cfg = FeatureConfig((FieldSpec("user_id", "single", 3, capacity=20, admit_after=2),
                         FieldSpec("item_id", "single", 5)), embedding_dim=4)
    model = DeepFM(cfg, mlp=(8,), seed=4, autocast_dtype=None)
    sparse, dense = make_optimizers(model, 0.1, 0.01)
    mapper, trainer = RowMapper(cfg), Trainer(model, sparse, dense)
    cafe_nfc, cafe_nfd = "Caf\u00e9", "Cafe\u0301"
    trained = [7, "7", "007", " 7", "7 ", cafe_nfc, cafe_nfc, cafe_nfd]  # 7 twice (as int and text): admitted
    users = hash_column(trained)  # (U,) the joiner's hashing of a column of mixed ints and strings
    tb = to_tensors(batch(users.tolist(), [1] * len(trained), [[]] * len(trained)), cfg)
    mapper.apply(tb, now=1.0, model=model, sparse_opt=sparse)
    trainer.test_then_train(tb)
    rows = mapper.rows(0, users).tolist()  # (U,)
    assert rows[0] == rows[1] >= 3 and rows[5] == rows[6] >= 3  # seen twice: own rows (7 and "7" one id)
    for i in (2, 3, 4, 7):  # seen once: still on their buckets, and not 7's id
        assert rows[i] < 3 and hash_value(trained[i]) != hash_value(7)
    ckpt = {"meta": {"feature_config": cfg.to_dict(), "samples_trained": trainer.samples, "offsets": {},
                     "model": {"mlp": "8", "dropout": 0.0, "amp": False, "seed": 4}},
            "model": model.state_dict(), "id_maps": mapper.state_dict(), "path": "/ckpt/z.pt"}
    served = ScoringModel.load(build_artifact(ckpt, tmp_path, np.arange(4), format="torchscript"))
    encoder = FeatureEncoder(served)
    for user in [*trained, 12345]:  # and a brand-new user: its bucket
        body = orjson.dumps({"user_id": user, "items": [1]})
        values, _, _ = encoder.encode(read_request(body, 10), [])
        assert int(values[0]) == int(mapper.rows(0, hash_column([user]))[0]), user
