"""A publish over a live artifact whose holdout comparison did not happen because no holdout sample was read (the
samples topic empty, misnamed, or holding nothing that decodes) is ``unchecked``: the run publishes and raises a
``refresh_degraded`` warning (``job._published_warnings``), as for a live artifact that does not load. Before, the
summary said ``skipped`` and nothing else: a misnamed samples topic switched the quality gate off for every run."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

from cache_refresh import job, validate
from cache_refresh.settings import RefreshSettings

NEW = SimpleNamespace(format="eager", version="v2")
LIVE = SimpleNamespace(format="eager", version="v1")


def warnings(quality: dict[str, Any]) -> list[tuple[str, str]]:
    ckpt: Any = {"path": "ckpt-1.pt"}
    return job._published_warnings(RefreshSettings(publish_root=Path("/nonexistent"), hot_items=0, hot_users=0), "v2",
                                   ckpt, [], quality, {})


def test_no_holdout_sample_over_a_live_artifact_publishes_with_a_degraded_warning() -> None:
    quality = validate.holdout(NEW, LIVE, [], 0.01)  # type: ignore[arg-type]
    assert quality["skipped"] == "no samples in the topic"
    assert "no holdout samples were read from the samples topic" in quality["unchecked"]
    [(stage, message)] = warnings(quality)
    assert stage == "validate" and message.startswith("published v2 without the holdout comparison with the live "
                                                      "version: no holdout samples were read")


def test_no_holdout_sample_and_nothing_live_is_no_warning() -> None:
    quality = validate.holdout(NEW, None, [], 0.01)  # type: ignore[arg-type]
    assert "unchecked" not in quality and warnings(quality) == []


def test_holdout_messages_0_is_the_operators_choice_not_an_empty_topic_so_no_degraded_warning() -> None:
    """``holdout_messages = 0`` documents "no quality check" (a warning only for a reduced-precision artifact, whose
    AUC cost goes unmeasured). It was reported as no sample read, and warned on every publish over a live artifact
    as an empty or misnamed samples topic."""
    quality = validate.holdout(NEW, LIVE, [], 0.01, switched_off=True)  # type: ignore[arg-type]
    assert "holdout_messages = 0" in quality["skipped"] and warnings(quality) == []
    int8 = validate.holdout(SimpleNamespace(format="onnx_int8", version="v2"), LIVE, [], 0.01,  # type: ignore[arg-type]
                            switched_off=True)
    [(stage, message)] = warnings(int8)
    assert stage == "validate" and "holdout_messages = 0" in message
