"""A stop (SIGTERM) of ``streamrec refresh --now`` kept pending by ``job.StopSignals`` (it came while an exception was
in flight, which the run then got past in a best-effort ``except``) must end the run at the end of the stage it came
in, named with that stage, and long stages must see it between their units of work, not only at their end."""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cache_refresh import job
from cache_refresh.metrics import RUNS
from learner import artifact as A
from stream.config import KafkaSettings, RedisSettings
from streamrec.stack import free_port
from tests.unit.cache_refresh.test_stop_signal_now import _live_and_newer, _now_settings


def _stop_inside_a_swallowed_error() -> None:
    """The operator's SIGTERM, delivered while a best-effort ``except`` handles an error it then swallows."""
    try:
        raise OSError("a best-effort step's error")
    except OSError:
        signal.raise_signal(signal.SIGTERM)


@pytest.mark.parametrize("stage", ["lock", "signing", "cleanup"])
def test_a_stop_kept_pending_in_the_lock_signing_or_cleanup_stage_ends_the_run_at_that_stage(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stage: str) -> None:
    """Before, these stages had no stage end: the pending stop was raised only at the end of the checkpoint stage,
    after every checkpoint had been loaded and checked, and the failure and its alert said stage checkpoint."""
    root, ckpts = _live_and_newer(tmp_path)
    if stage == "lock":
        lock = job.refresh_lock

        @contextlib.contextmanager
        def swallowing_lock(path: Path) -> Iterator[None]:
            with lock(path):
                _stop_inside_a_swallowed_error()
                yield

        monkeypatch.setattr(job, "refresh_lock", swallowing_lock)
    elif stage == "signing":
        load_key = job.load_signing_key

        def swallowing_key(path: Any) -> Any:
            _stop_inside_a_swallowed_error()
            return load_key(path)

        monkeypatch.setattr(job, "load_signing_key", swallowing_key)
    else:
        clean = job.clean_leftovers

        def swallowing_clean(path: Path) -> list[str]:
            _stop_inside_a_swallowed_error()
            return clean(path)

        monkeypatch.setattr(job, "clean_leftovers", swallowing_clean)
    checked: list[Any] = []
    monkeypatch.setattr(A, "check_checkpoint", checked.append)
    failed = RUNS.labels("failed", stage)
    before = failed._value.get()
    with pytest.raises(job.RefreshError) as err:
        job.run_now(_now_settings(root, ckpts), KafkaSettings(),
                    RedisSettings(url=f"redis://127.0.0.1:{free_port()}/0"))
    assert err.value.stage == stage and "stopped by SIGTERM" in str(err.value), str(err.value)
    assert failed._value.get() == before + 1
    assert checked == []  # no checkpoint was loaded after the stop
    assert A.current_version(root) == "v001" and A.list_versions(root) == ["v001"]
