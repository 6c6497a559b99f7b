"""What the refresh writes as JSON is strict JSON (``json.dumps(allow_nan=False)`` passes; jq reads it): an AUC that
is undefined (one class in the holdout, or in the learner's progressive metrics) was written as ``NaN``, an
overflowing number as ``Infinity``. A non-finite float is written as null (``stream.files.finite_json``)."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np
import pytest

from learner import artifact as A
from learner import artifact_manifest as M
from learner.artifact import build_artifact
from stream.files import finite_json
from streamrec.commands.common import emit
from tests.unit.learner.test_artifact import make_checkpoint


def strict(text: str) -> object:
    def refuse(const: str) -> None:
        raise ValueError(f"{const} is not JSON")
    return json.loads(text, parse_constant=refuse)


def test_finite_json_writes_every_non_finite_float_as_null_and_keeps_the_rest() -> None:
    got = finite_json({"a": math.nan, "b": [math.inf, -math.inf, 1.5, np.float64("nan")], "c": (2, "x", None),
                       "d": {"e": True, "f": 10**400}})
    assert got == {"a": None, "b": [None, None, 1.5, None], "c": [2, "x", None], "d": {"e": True, "f": 10**400}}
    json.dumps(got, allow_nan=False)


def test_a_manifest_of_a_checkpoint_with_an_undefined_auc_is_strict_json(tmp_path: Path) -> None:
    ck = make_checkpoint()
    ck["meta"]["metrics"] = {"auc": math.nan, "logloss": math.inf, "samples": 3}
    staged = build_artifact(ck, tmp_path, np.zeros(0), format="eager", version="v001")
    manifest = strict((staged / M.MANIFEST).read_text())
    assert manifest["source"]["metrics"] == {"auc": None, "logloss": None, "samples": 3}  # type: ignore[index]
    A.verify(staged)


def test_a_json_summary_with_an_undefined_auc_is_strict_json(capsys: pytest.CaptureFixture[str]) -> None:
    emit(argparse.Namespace(json=True), {"holdout": {"new": {"samples": 5, "auc": math.nan}}}, str)
    assert strict(capsys.readouterr().out) == {"holdout": {"new": {"samples": 5, "auc": None}}}
