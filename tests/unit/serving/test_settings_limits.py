"""[serve] settings of the layered store and the lookup counts: hostile values are refused at the process edge with
the value and the bound, instead of failing later on a thread or a request."""

from __future__ import annotations

from pathlib import Path

import pytest

from serving.service import ScoringService
from serving.settings import ServeSettings
from stream.config import RedisSettings
from stream.errors import ConfigError

DURATIONS = ["lookup_counts_flush_s", "lookup_counts_timeout_s", "embedding_store_retry_after_s",
             "embedding_store_timeout_s"]


@pytest.mark.parametrize("name", DURATIONS)
@pytest.mark.parametrize("value", [float("inf"), 1e10])
def test_durations_beyond_a_day_are_refused(name: str, value: float) -> None:
    # retry_after_s = inf: after one failed round trip Redis is never asked again; flush_s = inf: the flush thread
    # dies at its first wait (OverflowError); a timeout of inf waits on a dead Redis for ever.
    with pytest.raises(ConfigError, match=name):
        ServeSettings(**{name: value})


@pytest.mark.parametrize("name", DURATIONS)
def test_nan_and_zero_durations_are_refused(name: str) -> None:
    for value in (float("nan"), 0.0, -1.0):
        with pytest.raises(ConfigError, match=name):
            ServeSettings(**{name: value})


def test_sane_values_are_kept() -> None:
    s = ServeSettings(lookup_counts_flush_s=86_400, embedding_store_retry_after_s=0.5, embedding_store_timeout_s=0.01)
    assert s.lookup_counts_flush_s == 86_400 and s.embedding_store_timeout_s == 0.01


def test_the_lookup_counts_client_times_out_after_lookup_counts_timeout_s(tmp_path: Path) -> None:
    # It was 2 s whatever the settings (serving/service.py): the bound on each flush, stop's last one included.
    settings = ServeSettings(port=0, publish_root=tmp_path, lookup_counts_timeout_s=0.25)
    svc = ScoringService(settings, RedisSettings(url="redis://127.0.0.1:9/0"))  # connects lazily: nothing listens
    try:
        assert svc.lookups is not None
        assert svc.lookups.counts.client.connection_pool.connection_kwargs["socket_timeout"] == 0.25
        assert ServeSettings().lookup_counts_timeout_s == 2.0  # the default is the value it replaced
    finally:
        svc.stop(grace_s=0.0)


@pytest.mark.parametrize("value", [31.0, 3_600.0, 86_400.0])
def test_a_lookup_counts_timeout_past_the_stop_timeout_is_refused(value: float) -> None:
    # stop()'s last flush runs on the stopping thread, bounded only by this timeout: a day-long one held a shutdown
    # (SIGTERM to `streamrec serve`) a day on a frozen Redis, past stop's 30 s bound on its flush thread.
    from serving.lookup_counts import STOP_TIMEOUT_S

    with pytest.raises(ConfigError, match=rf"lookup_counts_timeout_s .*<= {STOP_TIMEOUT_S:g}.*{value:g}"):
        ServeSettings(lookup_counts_timeout_s=value)
    assert ServeSettings(lookup_counts_timeout_s=STOP_TIMEOUT_S).lookup_counts_timeout_s == STOP_TIMEOUT_S
