"""``ScoringModel.score_arrays``: serving's request path on the encoder's numpy arrays (serving/app.py ``_run``).

An ONNX pooling graph is called on the arrays as they are (no tensor around each), every other scorer through
``score_request``: the scores must be ``score_request``'s bit for bit in every format, with hot rows, cold rows and a
delta's overrides mixed, live and pinned alike."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from learner.artifact import build_artifact
from learner.scorer import CALIBRATED_FORMATS
from serving.model import ScoringModel
from tests.unit.learner.test_artifact import CFG, make_checkpoint
from tests.unit.learner.test_onnx_int8_static import calibration_samples
from tests.unit.learner.test_onnx_scorer import request_probe

FORMATS = ["torchscript", "safetensors", "onnx", "onnx_int8", "onnx_int8_static"]


@pytest.fixture(scope="module")
def ckpt() -> dict:
    return make_checkpoint(seed=5)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("b", [1, 100])
def test_score_arrays_equals_score_request_bit_for_bit_with_cold_rows_and_overrides(
        ckpt: dict, tmp_path: Path, fmt: str, b: int) -> None:
    calibration = [calibration_samples(200)] if fmt in CALIBRATED_FORMATS else None
    model = ScoringModel.load(build_artifact(ckpt, tmp_path, np.arange(0, CFG.num_rows, 4), format=fmt,
                                             calibration=calibration))
    values, offsets, dense = request_probe(CFG, b, seed=70 + b)  # (N,), (F + F*B + 1,), (B, Dd)
    arrays = (values.numpy(), offsets.numpy(), dense.numpy())

    def same() -> None:
        want = model.score_request(values, offsets, dense).numpy()
        got = model.score_arrays(*arrays)
        assert got.dtype == np.float32 and got.shape == (b,)
        assert np.array_equal(got, want), np.abs(got - want).max()
        pin = model.pinned()
        assert np.array_equal(pin.score_arrays(*arrays), pin.score_request(values, offsets, dense).numpy())

    same()
    rows = torch.unique(values[::2])  # hot and cold rows alike
    vectors = torch.randn(len(rows), CFG.embedding_dim + 1, generator=torch.Generator().manual_seed(b)) * 0.3
    model.apply_delta(rows, vectors, None, seq=1)
    same()
