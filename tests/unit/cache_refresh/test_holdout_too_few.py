"""The holdout's AUC comparison with the live artifact (cache_refresh/validate.py) on too few samples of a class: a
handful of clicked/unclicked pairs decide the AUC (one positive and one negative: it is 0 or 1), so a drop there says
nothing of the model. Before, a young samples topic (two samples) refused every refresh as "not publishing a worse
model" on one swapped pair; now it is ``unchecked`` (published, with a refresh_degraded warning, as for one class),
and a holdout with enough of each class still refuses a worse model. Pure logic, fake models."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from cache_refresh import validate


class _Tensors:
    def __init__(self, labels: np.ndarray) -> None:
        n = len(labels)
        self.values, self.offsets, self.dense = torch.zeros(n), torch.zeros(n + 1), torch.zeros(n, 1)
        self.labels, self.impression_ids = torch.from_numpy(labels.astype(np.float32)), np.arange(n)

    def __len__(self) -> int:
        return len(self.labels)


class _Model:
    """Scores each sample by its label (``right``) or against it."""

    def __init__(self, version: str, right: bool) -> None:
        self.version, self.right, self.format, self.feature_config = version, right, "eager", "cfg"
        self.labels = torch.zeros(0)

    def map_batch(self, tb: Any) -> None:
        self.labels = tb.labels

    def score(self, *a: Any, fp32: bool = False, **k: Any) -> torch.Tensor:
        return 0.2 + 0.6 * (self.labels if self.right else 1 - self.labels)


def _holdout(monkeypatch: pytest.MonkeyPatch, positives: int, negatives: int) -> dict[str, Any]:
    labels = np.array([1] * positives + [0] * negatives)
    monkeypatch.setattr(validate, "to_tensors", lambda batch, cfg: _Tensors(labels))
    batch: Any = SimpleNamespace(kinds=np.zeros(len(labels), np.int8))
    return validate.holdout(_Model("new", right=False), _Model("live", right=True), [batch], 0.01)  # type: ignore


def test_one_swapped_pair_of_a_tiny_holdout_is_unchecked_not_a_refused_publish(monkeypatch: pytest.MonkeyPatch,
                                                                               ) -> None:
    out = _holdout(monkeypatch, positives=1, negatives=1)
    assert out["new"]["auc"] == 0.0 and out["live"]["auc"] == 1.0
    assert "too few holdout samples" in out["unchecked"] and out["skipped"] == out["unchecked"]
    assert "auc_drop" not in out


def test_a_holdout_with_enough_of_each_class_still_refuses_a_worse_model(monkeypatch: pytest.MonkeyPatch) -> None:
    n = validate.MIN_CLASS_SAMPLES
    with pytest.raises(validate.ValidationFailed, match="not publishing a worse model"):
        _holdout(monkeypatch, positives=n, negatives=n)
