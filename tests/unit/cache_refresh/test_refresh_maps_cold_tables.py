"""The refresh reads the artifacts it validates (the staged one, the live one) once, so it maps their cold tables
(``learner.artifact.map_table``) rather than copying them into memory as serving does per request
(``read_table``): copied, one refresh held the checkpoint's table and two more copies of it in anonymous memory
(648 MiB each at 10 M rows), where ``map_table``'s docstring promised the refresh the map. No broker, no Redis."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from cache_refresh import job
from learner import artifact_versions as V
from stream.config import KafkaSettings, RedisSettings
from streamrec.stack import free_port
from tests.unit.cache_refresh.test_stop_signal_now import _live_and_newer, _now_settings


def test_the_refresh_maps_the_cold_tables_of_the_staged_and_the_live_artifact_instead_of_copying_them(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root, ckpts = _live_and_newer(tmp_path)
    load = job.ScoringModel.load
    tables: dict[str, Any] = {}

    def recording_load(path: Path, *args: Any, **kwargs: Any) -> Any:
        model = load(path, *args, **kwargs)
        tables["live" if Path(path).name == "v001" else "staged"] = model.table
        return model

    monkeypatch.setattr(job.ScoringModel, "load", staticmethod(recording_load))
    job.run_now(_now_settings(root, ckpts), KafkaSettings(), RedisSettings(url=f"redis://127.0.0.1:{free_port()}/0"))
    assert len(V.list_versions(root)) == 2  # the run published: both loads happened
    assert set(tables) == {"live", "staged"}
    assert all(isinstance(t, np.memmap) for t in tables.values()), {k: type(t) for k, t in tables.items()}
