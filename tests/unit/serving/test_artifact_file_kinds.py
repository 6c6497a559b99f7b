"""A file an artifact's manifest lists (the cold rows, the scorer, the id maps) that is a FIFO or a device in a publish
directory is refused unread (``learner.artifact.open_artifact``/``verify``: an ArtifactError), and serving's swap keeps
the live model: ``np.load`` of the cold rows (and every other loader) opened it with a blocking open, and a FIFO hung
the swap thread, or serving's start, for good.

The load runs in a daemon thread joined with a bound: the old code blocks in its open, the thread is still alive, and
the test fails on that (then a writer opened and closed on the FIFO releases it) instead of hanging the run."""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from cache_refresh.publish import publish
from learner import artifact_manifest as M
from learner.artifact import build_artifact
from learner.artifact_versions import ArtifactError
from serving.metrics import ServingMetrics
from serving.model import ScoringModel
from serving.swap import ModelHolder, ModelUpdater
from tests.unit.learner.test_artifact import make_checkpoint

HANG_BOUND_S = 30  # only reached by a load that blocks on the FIFO (the defect)


def finishes(fifo: Path, call: Callable[[], object]) -> BaseException | None:
    """Run ``call`` in a daemon thread; assert it ended (not blocked opening ``fifo``); return what it raised."""
    raised: list[BaseException] = []

    def run() -> None:
        try:
            call()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            raised.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(HANG_BOUND_S)
    if t.is_alive():  # the defect: release the reader blocked in its open(s) (writers come and go), then fail
        while t.is_alive():
            with contextlib.suppress(OSError):
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
            t.join(0.1)
        pytest.fail(f"the load blocked opening the FIFO {fifo}")
    return raised[0] if raised else None


@pytest.fixture(scope="module")
def ckpt() -> dict:
    return make_checkpoint()


@pytest.mark.parametrize("verify_files", [False, True])
def test_a_listed_artifact_file_that_is_a_fifo_is_an_artifact_error_not_a_hang(
        tmp_path: Path, ckpt: dict, verify_files: bool) -> None:
    """(The cold rows: ``np.load`` opens them in Python, which lets the bounded join see the blocked thread;
    ``torch.jit.load`` blocks in C++ holding the GIL, so the scorer's FIFO, refused by the same check, is not the
    file tested here.)"""
    name = M.COLD_FILE
    published = publish(tmp_path, build_artifact(ckpt, tmp_path, np.arange(10)), keep=3)
    assert name in M.read_manifest(published)["files"]
    (published / name).unlink()
    os.mkfifo(published / name)
    exc = finishes(published / name, lambda: ScoringModel.load(published, verify_files=verify_files))
    assert isinstance(exc, ArtifactError) and "not a regular file" in str(exc) and name in str(exc)


def test_serving_keeps_the_live_model_when_the_next_versions_cold_rows_are_a_fifo(tmp_path: Path,
                                                                                  ckpt: dict) -> None:
    first = publish(tmp_path, build_artifact(ckpt, tmp_path, np.arange(10)), keep=3)
    holder = ModelHolder()
    updater = ModelUpdater(holder, ServingMetrics(holder.model), tmp_path, None, device="cpu")
    updater.check_now()
    assert holder.live is not None and holder.live.model.version_dir == first
    second = publish(tmp_path, build_artifact(ckpt, tmp_path, np.arange(10)), keep=3)
    assert second != first
    (second / M.COLD_FILE).unlink()
    os.mkfifo(second / M.COLD_FILE)
    assert finishes(second / M.COLD_FILE, updater.check_now) is None
    assert holder.live is not None and holder.live.model.version_dir == first
    assert "not a regular file" in (updater.last_error or "")
