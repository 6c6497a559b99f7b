"""Serving's cold path: ids the artifact's id maps do not know (brand-new users and items, in every form a request may
carry them) get their hash-bucket row and a valid score, and serving counts them
(``streamrec_serving_id_lookups_total{field, row="bucket"}``), as the learner counts its own lookups; the packaged
``serving_fallback_share`` rule reads that count's share (evaluated over this serving's /metrics text)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from prometheus_client.parser import text_string_to_metric_families

from learner.artifact import build_artifact
from learner.batch import to_tensors
from learner.model import DeepFM
from learner.optim import make_optimizers
from learner.row_mapper import RowMapper
from learner.trainer import Trainer
from monitor.alerts import AlertState
from monitor.rule_engine import RuleEngine
from monitor.rules import load_rules
from monitor.scrape import Snapshot
from serving.features import FeatureEncoder
from serving.metrics import ServingMetrics
from serving.model import ScoringModel
from serving.request import parse_request
from stream.events import MAX_ID
from stream.features import hash_value
from stream.limits import DEFAULT_LIMITS
from tests.unit.learner.test_row_mapper import CFG, B, batch


def trained_artifact(tmp_path: Path) -> Path:
    """A served artifact of a learner that admitted (most of) users 0..39 and items 0..29."""
    model = DeepFM(CFG, mlp=(8,), seed=1, autocast_dtype=None)
    sparse, dense = make_optimizers(model, 0.1, 0.01)
    mapper, trainer = RowMapper(CFG), Trainer(model, sparse, dense)
    rng = np.random.default_rng(0)
    for k in range(20):
        users, items = rng.integers(0, 40, 16).tolist(), rng.integers(0, 30, 16).tolist()
        # samples carry hashed ids (the joiner hashes them as serving does)
        users, items = [hash_value(u) for u in users], [hash_value(i) for i in items]
        history = [[hash_value(i) for i in rng.integers(0, 30, 3).tolist()] for _ in range(16)]
        tb = to_tensors(batch(users, items, history, start=16 * k), CFG)
        mapper.apply(tb, now=float(k), model=model, sparse_opt=sparse)
        trainer.test_then_train(tb)
    ckpt = {"meta": {"feature_config": CFG.to_dict(), "samples_trained": 320, "offsets": {},
                     "model": {"mlp": "8", "dropout": 0.0, "amp": False, "seed": 1}},
            "model": model.state_dict(), "id_maps": mapper.state_dict(), "path": "/ckpt/x.pt"}
    return build_artifact(ckpt, tmp_path, np.arange(10), format="torchscript")


def id_lookups(metrics: ServingMetrics) -> dict[tuple[str, str], float]:
    return {(s.labels["field"], s.labels["row"]): s.value
            for fam in text_string_to_metric_families(metrics.render().decode())
            for s in fam.samples if s.name == "streamrec_serving_id_lookups_total"}


def test_unknown_users_and_items_in_every_form_get_their_bucket_row_a_valid_score_and_are_counted(
        tmp_path: Path) -> None:
    served = ScoringModel.load(trained_artifact(tmp_path))
    metrics = ServingMetrics(lambda: served)
    encoder = FeatureEncoder(served)
    # brand-new users: the largest int id, a long unicode string, a number sent as text and as a number (one id)
    unknown_users = [MAX_ID, "ü" * DEFAULT_LIMITS.max_str_len, "1000001", 1000001, "\u0000x", " 7"]
    unknown_items = [MAX_ID, "新しい", 99999]
    for user in unknown_users:
        req = parse_request({"user_id": user, "items": [*unknown_items, 3]}, max_candidates=100)
        values, offsets, dense = encoder.encode(req, [])
        user_row = int(values[0])  # the user row's bags come first, user_id being field 0
        assert user_row == hash_value(user) % B  # its hash bucket (user_id's block starts at row 0)
        p = served.score_request(torch.from_numpy(values), torch.from_numpy(offsets), torch.from_numpy(dense))
        assert p.shape == (4,) and bool(torch.isfinite(p).all()) and bool(((p > 0) & (p < 1)).all())
    assert hash_value("1000001") == hash_value(1000001)  # one id, one bucket, whichever form it came in
    counted = id_lookups(metrics)
    # every user was unknown; of the items, 3 of 4 per request (item 3 was admitted)
    assert counted[("user_id", "bucket")] == len(unknown_users) and counted.get(("user_id", "own"), 0) == 0
    assert counted[("item_id", "bucket")] == 3 * len(unknown_users)
    assert counted[("item_id", "own")] == len(unknown_users)
    # a known user is counted on its own row; swapping the model keeps what the retired one counted
    req = parse_request({"user_id": 5, "items": [3]}, max_candidates=100)
    encoder.encode(req, [])
    metrics.lookups.retire(served)
    served2 = ScoringModel.load(trained_artifact(tmp_path / "again"))
    metrics.lookups.live = lambda: served2  # what serving/swap.py does: retire the old model, the new one is live
    assert id_lookups(metrics)[("user_id", "own")] == 1


def fallback_alerts(tmp_path: Path, minutes: list[int]) -> list[tuple[int, str | None, AlertState]]:
    """The packaged ``serving_fallback_share`` rule over this serving's /metrics, scraped once a minute while
    ``minutes[k]`` requests of brand-new users (each with 3 admitted candidate items) arrive in minute k."""
    served = ScoringModel.load(trained_artifact(tmp_path))
    metrics = ServingMetrics(lambda: served)
    encoder = FeatureEncoder(served)
    rule = next(r for r in load_rules(None).rules if r.name == "serving_fallback_share")
    engine = RuleEngine([rule], history_s=rule.for_s + 600)
    out, user = [], 10**9
    for minute, requests in enumerate(minutes):
        for _ in range(requests):
            user += 1
            encoder.encode(parse_request({"user_id": user, "items": [3, 5, 7]}, max_candidates=100), [])
        out += [(minute, a.labels.get("field"), a.state)
                for a in engine.evaluate(Snapshot.from_texts({"serving": metrics.render().decode()}), minute * 60.0)]
    return out


def test_the_packaged_serving_fallback_share_rule_fires_on_a_burst_of_new_users_and_resolves_when_traffic_stops(
        tmp_path: Path) -> None:
    # 300 new users a minute (5 user lookups a second, all on buckets; their items admitted) for 20 minutes, then
    # nothing: the share read is 5 / (5 + 1) > 0.5, firing for user_id after 5 minutes of rate history and the rule's
    # 10; with no lookups at all it reads 0 / (0 + 1), no division by zero, and resolves.
    alerts = fallback_alerts(tmp_path, [300] * 20 + [0] * 10)
    assert [(f, s) for _, f, s in alerts] == [("user_id", AlertState.FIRING), ("user_id", AlertState.RESOLVED)]
    assert 10 <= alerts[0][0] <= 16 and 20 <= alerts[1][0] <= 26


def test_the_packaged_serving_fallback_share_rule_stays_quiet_on_a_quiet_night_of_a_few_new_users(
        tmp_path: Path) -> None:
    # A request a minute, each a brand-new user: every user lookup is a bucket lookup (a true share of 1), but at
    # 1/60 lookups a second the share read is 1/61: no alert for a handful of users.
    assert fallback_alerts(tmp_path, [1] * 40) == []
