"""Serving says how old the model users get is (``streamrec_serving_model_age_seconds``, ``..._artifact_age_seconds``),
and the packaged alert rules fire on it: a learner whose deltas stop reaching serving (stopped, a deltas directory
it cannot write: the compose image's, until 2026-12-04) and a nightly refresh that does not reach serving were
silent before."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
import torch

from learner.artifact import build_artifact
from monitor.rule_engine import RuleEngine
from monitor.rules import load_rules
from monitor.scrape import Snapshot
from serving.metrics import ServingMetrics
from serving.model import ScoringModel
from tests.unit.learner.test_artifact import CFG, make_checkpoint


def _gauge(text: str, name: str) -> float:
    [line] = [x for x in text.splitlines() if x.startswith(name + " ")]
    return float(line.split()[1])


def _model(tmp_path: Path, saved_at: float | None) -> ScoringModel:
    ckpt = make_checkpoint()
    if saved_at is not None:
        ckpt["meta"]["created"] = saved_at  # what learner/checkpoint_write.py save records
    return ScoringModel.load(build_artifact(ckpt, tmp_path, np.arange(10), format="eager"))


def test_the_model_is_as_old_as_its_newest_delta_else_its_checkpoint(tmp_path: Path) -> None:
    now = time.time()
    model = _model(tmp_path, saved_at=now - 7200)
    metrics = ServingMetrics(lambda: model)
    text = metrics.render().decode()
    assert _gauge(text, "streamrec_serving_artifact_age_seconds") == pytest.approx(7200, abs=60)
    assert _gauge(text, "streamrec_serving_model_age_seconds") == pytest.approx(7200, abs=60)
    rows = torch.tensor([1, 2])
    model.apply_delta(rows, torch.zeros(2, CFG.embedding_dim + 1), None, seq=1, created=now - 30)
    text = metrics.render().decode()
    assert _gauge(text, "streamrec_serving_model_age_seconds") == pytest.approx(30, abs=60)
    assert _gauge(text, "streamrec_serving_artifact_age_seconds") == pytest.approx(7200, abs=60)
    model.apply_delta(rows, torch.zeros(2, CFG.embedding_dim + 1), None, seq=2, created=now - 600)  # an older one
    assert model.trained_at == pytest.approx(now - 30)  # (deltas may come out of order: the newest state counts)
    none = ServingMetrics(lambda: None).render().decode()  # no model: no age, not a 0 that looks fresh
    assert np.isnan(_gauge(none, "streamrec_serving_model_age_seconds"))


def test_an_artifact_that_does_not_record_its_checkpoints_time_is_as_old_as_its_build(tmp_path: Path) -> None:
    model = _model(tmp_path, saved_at=None)
    assert model.manifest["source"]["created"] is None
    assert model.source_created == model.manifest["created"]


@pytest.mark.parametrize(("deltas_configured", "paused", "age_s", "fires"), [
    (1, 0, 3600, True),  # deltas read, none for an hour: stale
    (1, 0, 60, False),
    (0, 0, 3600, False),  # serving reads no deltas: its model is as old as its artifact, by design
    (1, 1, 3600, False),  # a rollback pin holds deltas off on purpose
])
def test_the_packaged_rule_fires_when_deltas_stop_reaching_serving(
        tmp_path: Path, deltas_configured: int, paused: int, age_s: float, fires: bool) -> None:
    model = _model(tmp_path, saved_at=time.time() - age_s)
    metrics = ServingMetrics(lambda: model)
    metrics.deltas_configured.set(deltas_configured)
    metrics.deltas_paused.set(paused)
    config = load_rules(None)
    rule = next(r for r in config.rules if r.name == "served_model_stale")
    engine = RuleEngine([rule])
    fired = [a for t in (0, 200, 400) for a in engine.evaluate(
        Snapshot.from_texts({"serving": metrics.render().decode()}), t)]
    assert [a.rule for a in fired] == (["served_model_stale"] if fires else [])


def test_the_packaged_rule_fires_when_the_artifact_is_older_than_a_day_and_two_hours(tmp_path: Path) -> None:
    config = load_rules(None)
    rule = next(r for r in config.rules if r.name == "served_artifact_stale")
    for age_h, fires in ((25, False), (27, True)):
        model = _model(tmp_path / str(age_h), saved_at=time.time() - age_h * 3600)
        engine = RuleEngine([rule])
        text = ServingMetrics(lambda m=model: m).render().decode()
        fired = [a for t in (0, 700) for a in engine.evaluate(Snapshot.from_texts({"serving": text}), t)]
        assert bool(fired) is fires
