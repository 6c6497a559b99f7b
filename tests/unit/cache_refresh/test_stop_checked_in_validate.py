"""The validate stage's long units after the probe's fp32 scorings (cache_refresh/validate.py): every holdout batch
scored by the new artifact (an INT8 one also by its fp32 path) and by the live one, and an INT8 artifact's own probe
scoring, must each be followed by the run's stop check (``between``: ``job.StopSignals.check``), so that a stop kept
pending ends the stage at its next unit, not after the whole holdout was scored twice. Counted in units done after
the stop; pure logic, fake models."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from cache_refresh import validate


class Stopped(Exception):
    pass


_BATCH = SimpleNamespace(kinds=np.zeros(1, np.int8))


class _Tensors:
    def __init__(self) -> None:
        self.values, self.offsets, self.dense = torch.zeros(1), torch.zeros(2), torch.zeros(1, 1)
        self.labels, self.impression_ids = torch.zeros(1), np.zeros(1, np.int64)

    def __len__(self) -> int:
        return 1


class _Model:
    def __init__(self, name: str, scored: list[str], fmt: str = "eager") -> None:
        self.name, self.scored, self.format, self.version, self.feature_config = name, scored, fmt, name, "cfg"

    def map_batch(self, tb: Any) -> None:
        pass

    def score(self, *a: Any, fp32: bool = False, **k: Any) -> torch.Tensor:
        self.scored.append(self.name + (" fp32" if fp32 else ""))
        return torch.full((1,), 0.5)


@pytest.mark.parametrize("fmt", ["eager", "onnx_int8"])
def test_a_stop_checked_in_the_holdout_ends_it_after_the_batch_being_scored(
        monkeypatch: pytest.MonkeyPatch, fmt: str) -> None:
    """Before, the holdout scored every batch with the new artifact (and its fp32 path) and then with the live one,
    with no stop check: a stop waited for all of it."""
    monkeypatch.setattr(validate, "to_tensors", lambda batch, cfg: _Tensors())
    scored: list[str] = []
    checks: list[int] = []

    def stop_at_fourth_check() -> None:
        checks.append(1)
        if len(checks) == 4:
            raise Stopped

    with pytest.raises(Stopped):
        validate.holdout(_Model("new", scored, fmt), _Model("live", scored), [_BATCH] * 3,  # type: ignore[arg-type]
                         0.01, between=stop_at_fourth_check)
    assert scored == ["new"] * 3 + (["new fp32"] if fmt == "onnx_int8" else ["live"])  # one check after each batch


def test_a_stop_checked_after_the_int8_probe_scoring_ends_the_probe_before_the_live_artifact_loads() -> None:
    """Before, the probe's last check came after the artifact's fp32 path scored it: an INT8 artifact then scored the
    probe again, and the run went on to load the live artifact, with no check in between."""
    from learner import artifact_manifest as M
    from tests.unit.learner.test_artifact import make_checkpoint

    ckpt = make_checkpoint()
    scored: list[str] = []

    class Int8(_Model):
        def score(self, values: torch.Tensor, offsets: torch.Tensor, dense: torch.Tensor, fp32: bool = False,
                  ) -> torch.Tensor:
            scored.append("fp32" if fp32 else "int8")
            return torch.full((dense.shape[0],), 0.5)

    def stop_once_int8_scored() -> None:
        if "int8" in scored:
            raise Stopped

    model = Int8("new", scored, "onnx_int8")
    model.feature_config = M.check_checkpoint(ckpt)
    with pytest.raises(Stopped):
        validate.probe(model, ckpt, 16, 1e-5, between=stop_once_int8_scored)  # type: ignore[arg-type]
    assert scored == ["fp32", "int8"]
