"""A stop (SIGTERM) of ``streamrec refresh --now`` kept pending by ``job.StopSignals`` (it came while an exception was
in flight, which the code then got past: TorchScript's compiler and torch's loaders handle exceptions of their own)
must end the build and the validate stage at their next unit of work, not after every file was written and hashed,
or every probe scoring was done. Counted in units done after the stop; no broker, no Redis."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from cache_refresh import job, validate
from learner import artifact as A
from learner import artifact_manifest as M
from learner import artifact_versions as V
from stream.config import KafkaSettings, RedisSettings
from streamrec.stack import free_port
from tests.unit.cache_refresh.test_stop_pending_stage_end import _stop_inside_a_swallowed_error
from tests.unit.cache_refresh.test_stop_signal_now import _live_and_newer, _now_settings


def _run(root: Path, ckpts: Path) -> job.RefreshError:
    with pytest.raises(job.RefreshError) as err:
        job.run_now(_now_settings(root, ckpts), KafkaSettings(),
                    RedisSettings(url=f"redis://127.0.0.1:{free_port()}/0"))
    return err.value


def test_a_stop_kept_pending_while_the_scorer_is_saved_ends_the_build_before_the_next_file_is_written(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before, the build went on to write the cold table (the whole embedding table), the id maps, hash every file
    and write the manifest; the stop was raised only where the validate stage began."""
    root, ckpts = _live_and_newer(tmp_path)
    save_scorer, write_synced, sha256_file = A.save_scorer, A.write_synced, A.sha256_file
    after_stop: list[str] = []
    stopped: list[bool] = []

    def swallowing_save(*args: Any, **kwargs: Any) -> None:
        save_scorer(*args, **kwargs)
        if len(stopped) == 0 and Path(args[2]).parent.parent.name == V.STAGING:  # this run's build, not v001's
            stopped.append(True)
            _stop_inside_a_swallowed_error()

    def counted_write(path: Path, *args: Any) -> None:
        if stopped:
            after_stop.append(f"write {Path(path).name}")
        write_synced(path, *args)

    def counted_hash(path: Path) -> str:
        if stopped:
            after_stop.append(f"hash {Path(path).name}")
        return sha256_file(path)

    monkeypatch.setattr(A, "save_scorer", swallowing_save)
    monkeypatch.setattr(A, "write_synced", counted_write)
    monkeypatch.setattr(A, "sha256_file", counted_hash)
    err = _run(root, ckpts)
    assert stopped and err.stage == "build" and "stopped by SIGTERM" in str(err), str(err)
    assert after_stop == []  # no file written or hashed after the stop
    assert not any((root / V.STAGING).iterdir())  # the staged directory is removed
    assert V.current_version(root) == "v001" and V.list_versions(root) == ["v001"]


def test_a_stop_kept_pending_while_the_staged_artifact_loads_ends_the_validate_stage_before_the_probe_scores(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before, the validate stage went on to rebuild the learner's model from the checkpoint, score the probe with it
    (fp32 and bf16) and with the artifact, and load the live artifact, before its first stop check (the holdout)."""
    root, ckpts = _live_and_newer(tmp_path)
    load = job.ScoringModel.load
    eager_model = validate.eager_model
    after_stop: list[str] = []
    stopped: list[bool] = []

    def swallowing_load(path: Path, *args: Any, **kwargs: Any) -> Any:
        model = load(path, *args, **kwargs)
        if not stopped:
            stopped.append(True)
            _stop_inside_a_swallowed_error()
            score = model.score

            def counted_score(*a: Any, **k: Any) -> Any:
                after_stop.append("artifact scores the probe")
                return score(*a, **k)

            model.score = counted_score
        return model

    def counted_eager_model(*args: Any, **kwargs: Any) -> Any:
        after_stop.append("learner's model rebuilt")
        return eager_model(*args, **kwargs)

    def counted_live_model(*args: Any, **kwargs: Any) -> Any:
        after_stop.append("live artifact loaded")
        return None, None

    monkeypatch.setattr(job.ScoringModel, "load", staticmethod(swallowing_load))
    monkeypatch.setattr(validate, "eager_model", counted_eager_model)
    monkeypatch.setattr(job, "_live_model", counted_live_model)
    err = _run(root, ckpts)
    assert stopped and err.stage == "validate" and "stopped by SIGTERM" in str(err), str(err)
    assert after_stop == []
    assert V.current_version(root) == "v001" and V.list_versions(root) == ["v001"]


def test_a_stop_checked_in_the_probe_ends_it_before_its_next_scoring() -> None:
    """The probe's units (the learner's model rebuilt, its fp32 and bf16 scores, the artifact's scores, an INT8
    artifact's own) each see the stop check after the one before."""
    from tests.unit.learner.test_artifact import make_checkpoint

    class Stopped(Exception):
        pass

    ckpt = make_checkpoint()
    calls: list[int] = []

    class Model:
        feature_config = M.check_checkpoint(ckpt)
        format = "eager"

        def score(self, *a: Any, **k: Any) -> Any:
            raise AssertionError("the artifact scored the probe after the stop")

    def stop_at_third_check() -> None:
        calls.append(1)
        if len(calls) == 3:
            raise Stopped

    with pytest.raises(Stopped):
        validate.probe(Model(), ckpt, 64, 1e-5, between=stop_at_third_check)  # type: ignore[arg-type]
    assert len(calls) == 3
