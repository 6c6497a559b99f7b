"""``[redis] prefix`` begins every key streamrec writes; a prefix that changes what those keys are is refused at start
with a ConfigError naming it, not met at the first write.

Redis Cluster hashes a key by its first ``{...}``: the day counts put ``{item}`` / ``{user}`` after the prefix so that
a kind's counts, names and write markers share one slot (``stream/counts.py``). A brace in the prefix takes that role:
``a{b`` made the counts key's tag ``b:counts:{item`` and the names key's ``b:names:{item``, two slots, so every counts
script call failed with CROSSSLOT (the joiner's batches failing for ever); ``{x}`` put every key of every kind and
user in one slot. An empty prefix made keys begin with ``:`` (and DailyCounts refused it with a bare ValueError), and
text that is not UTF-8 (an environment variable's undecodable bytes) failed every command with UnicodeEncodeError.
"""

from __future__ import annotations

import pytest

from stream.config import RedisSettings
from stream.errors import ConfigError


@pytest.mark.parametrize("prefix", ["a{b", "x}", "{tenant}", "team:{a}:rec"])
def test_a_redis_prefix_with_a_hash_tag_brace_is_refused_naming_the_setting(prefix: str) -> None:
    with pytest.raises(ConfigError, match=r"^\[redis\] prefix: got .*hash tag"):
        RedisSettings(prefix=prefix)


@pytest.mark.parametrize("prefix", ["", "\udcff"])
def test_an_empty_or_non_utf8_redis_prefix_is_refused_naming_the_setting(prefix: str) -> None:
    with pytest.raises(ConfigError, match=r"^\[redis\] prefix: got "):
        RedisSettings(prefix=prefix)


@pytest.mark.parametrize("prefix", ["streamrec", "team-a:streamrec", "rec.prod_2", "päivä"])
def test_a_plain_redis_prefix_is_accepted(prefix: str) -> None:
    assert RedisSettings(prefix=prefix).prefix == prefix
