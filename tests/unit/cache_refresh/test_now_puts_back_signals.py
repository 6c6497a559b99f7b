"""``streamrec refresh --now`` (cache_refresh/job.py ``run_now``) takes SIGTERM/SIGINT for the run and puts the
process's handlers back after it, as every long-running loop does (``stream/stop_signals.py``). A handler not set from
Python (one a C library or an embedding program installed: ``signal.signal`` returns None for it) was put back as
``signal.signal(sig, None)``, a TypeError raised from run_now's ``finally``: it replaced the run's own outcome (its
RefreshError, or its summary) and left the run's handler installed."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import pytest

from cache_refresh import job
from cache_refresh.settings import RefreshSettings
from stream.config import KafkaSettings, RedisSettings
from streamrec.stack import free_port


def test_refresh_now_puts_back_the_default_for_a_handler_not_set_from_python_and_keeps_its_outcome(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = signal.signal
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}

    def installed_outside_python(sig: int, handler: Any) -> Any:
        previous = real(sig, handler)
        return None if isinstance(handler, job.StopSignals) else previous  # what Python says of a C handler

    monkeypatch.setattr(signal, "signal", installed_outside_python)
    rs = RefreshSettings(checkpoint_dir=tmp_path / "no-checkpoints", publish_root=tmp_path / "serving",
                         holdout_messages=0, alerts_topic="")
    try:
        with pytest.raises(job.RefreshError) as err:  # the run's own outcome: no checkpoint to build from
            job.run_now(rs, KafkaSettings(), RedisSettings(url=f"redis://127.0.0.1:{free_port()}/0"))
        assert err.value.stage == "checkpoint", str(err.value)
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the disposition a C handler reads as: default
        assert signal.getsignal(signal.SIGINT) is signal.SIG_DFL
    finally:
        for sig, handler in saved.items():
            real(sig, handler)
