"""``[learner] deltas_redis_url`` (deprecated) is checked at settings load by the rule of ``[redis] url``
(stream.config.check_redis_url), naming its own setting."""

from __future__ import annotations

import pytest

from learner.config import LearnerSettings
from stream.config import RedisSettings
from stream.errors import ConfigError


@pytest.mark.parametrize("url, why", [("redis://redis-2:0/1", "names port 0"),
                                      ("redis://:hunter52@:6380/1", "names no host"),
                                      ("redis://redis-2:6380/deltas", "is not a database number"),
                                      ("http://redis-2:6380/1", "expected redis://host:port/db")])
def test_a_deltas_redis_url_that_redis_url_would_refuse_is_refused_at_load_naming_it(url: str, why: str) -> None:
    """Port 0, no host, a path that is no db number: accepted in silence, redis-py then took the host as localhost,
    the path as db 0, or failed every announcement with "Connection refused". Refused as [redis] url refuses it."""
    with pytest.raises(ConfigError) as redis_err:
        RedisSettings(url=url)
    with pytest.raises(ConfigError) as err:
        LearnerSettings(deltas_redis_url=url)
    assert str(err.value).startswith("[learner] deltas_redis_url: ") and why in str(err.value), err.value
    assert str(err.value).removeprefix("[learner] deltas_redis_url") == str(redis_err.value).removeprefix("[redis] url")
    assert "hunter52" not in str(err.value)


@pytest.mark.parametrize("url, kept", [(None, None), ("", ""), ("rediss://redis-2:6380/1\n", "rediss://redis-2:6380/1"),
                                       ("unix:///run/redis.sock?db=2", "unix:///run/redis.sock?db=2")])
def test_a_good_or_unset_deltas_redis_url_is_kept(url: str | None, kept: str | None) -> None:
    assert LearnerSettings(deltas_redis_url=url).deltas_redis_url == kept
