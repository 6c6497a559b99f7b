"""Every count setting (an ``int`` field that is not a port or a ``*_s`` duration) of every settings class is an
integer >= 1, or >= 0 where 0 means none or off, checked once per class by ``stream.config.check_counts`` with a
ConfigError (exit 2): 0 or a negative count misbehaved late or silently (``[joiner] batch_max = 0``: empty batches
for ever; ``[learner] keep_checkpoints = 0``: ``list[:-0]`` never pruned; ``[serve] threads = 0`` bumped to 1)."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import typing
from dataclasses import fields
from pathlib import Path
from typing import Any

import pytest

from cache_refresh.settings import RefreshSettings
from learner.config import LearnerSettings
from learner.evaluation.config import EvalOverrides
from serving.settings import ServeSettings
from stream.config import KafkaSettings, RedisSettings, check_counts
from stream.errors import ConfigError
from stream.joiner.config import JoinerSettings
from stream.limits import EventLimits
from stream.replay.config import ReplaySettings, SyntheticSettings
from streamrec.settings import SettingsError, build
from streamrec.stack import StackSettings

ROOT = Path(__file__).resolve().parents[3]

# class -> (section, the counts where 0 is documented as meaningful). Every other count must be >= 1.
CLASSES: dict[type, tuple[str, set[str]]] = {
    KafkaSettings: ("kafka", set()),
    RedisSettings: ("redis", {"history_ttl_days"}),
    JoinerSettings: ("joiner", set()),
    ReplaySettings: ("replay", {"limit", "seed", "linger_ms"}),
    SyntheticSettings: ("synthetic", {"start_ts_ms"}),
    LearnerSettings: ("learner", {"id_capacity", "cold_k", "dedup_window", "num_workers", "max_fields", "seed"}),
    ServeSettings: ("serve", {"max_active", "embedding_cache_rows", "linger_bytes", "history_cache_users"}),
    RefreshSettings: ("refresh", {"hot_items", "hot_users", "small_field_rows", "holdout_messages"}),
    StackSettings: ("stack", set()),
    EventLimits: ("limits", set()),
    EvalOverrides: ("evaluate", {"history_len"}),
}


def counts_of(cls: type) -> list[str]:
    """The count fields of ``cls``, found independently of check_counts: int (or int | None) fields, not ports, not
    durations."""
    hints = typing.get_type_hints(cls)
    return [f.name for f in fields(cls) if hints[f.name] in (int, int | None)
            and not (f.name == "port" or f.name.endswith(("_port", "_s")))]


CASES = [(cls, name) for cls in CLASSES for name in counts_of(cls)]
NOT_ZERO = [(cls, name) for cls, name in CASES if name not in CLASSES[cls][1]]
ZERO_OK = [(cls, name) for cls, name in CASES if name in CLASSES[cls][1]]


def test_the_table_covers_every_class_and_names_only_real_counts() -> None:
    assert len(CASES) >= 70  # every settings class but the stack has counts
    for cls, (_, zero_ok) in CLASSES.items():
        assert zero_ok <= set(counts_of(cls)), (cls.__name__, zero_ok - set(counts_of(cls)))


@pytest.mark.parametrize("value", [0, -1, -(10**6)])
@pytest.mark.parametrize("cls, name", NOT_ZERO, ids=[f"{c.__name__}.{n}" for c, n in NOT_ZERO])
def test_a_count_must_be_at_least_one(cls: Any, name: str, value: int) -> None:
    section = CLASSES[cls][0]
    with pytest.raises(ConfigError, match=rf"^\[{section}\] {name} must be an integer >= 1(?: and <= \d+)?, "
                                          rf"got {value}$"):
        cls(**{name: value})
    assert getattr(cls(**{name: 1}), name) == 1


@pytest.mark.parametrize("cls, name", ZERO_OK, ids=[f"{c.__name__}.{n}" for c, n in ZERO_OK])
def test_a_count_where_zero_means_none_or_off_takes_zero_but_no_negative(cls: Any, name: str) -> None:
    assert getattr(cls(**{name: 0}), name) == 0
    with pytest.raises(ConfigError, match=rf"^\[{CLASSES[cls][0]}\] {name} must be an integer >= 0"):
        cls(**{name: -1})


@pytest.mark.parametrize("value", [True, 2.0, "3"])
def test_a_count_is_an_int_not_a_bool_float_or_text(value: Any) -> None:
    with pytest.raises(ConfigError, match=r"\[joiner\] batch_max must be an integer >= 1"):
        JoinerSettings(batch_max=value)


def test_an_optional_count_may_be_left_unset_but_not_zero() -> None:
    assert LearnerSettings(max_samples=None).max_samples is None and ReplaySettings(limit=None).limit is None
    assert EvalOverrides().embedding_dim is None
    with pytest.raises(ConfigError, match=r"\[learner\] max_samples must be an integer >= 1, got 0"):
        LearnerSettings(max_samples=0)  # trained one batch and stopped


@pytest.mark.parametrize("cls, changes", [
    (JoinerSettings, {"batch_max": 1_000_001}),  # confluent-kafka's consume() takes at most 1M
    (JoinerSettings, {"max_sample_bytes": 1_000_000_000 - 65_535}),  # the producer's message.max.bytes: <= 1e9
    (ReplaySettings, {"linger_ms": 900_001}),  # librdkafka's linger.ms: 0..900000
    (SyntheticSettings, {"users": 2**62 + 1}), (SyntheticSettings, {"items": 2**62 + 1}),  # 62-bit ids
    (LearnerSettings, {"seed": 2**64}),  # torch.manual_seed: at most 2**64 - 1
    (KafkaSettings, {"session_timeout_ms": 300_001}),  # over librdkafka's default max.poll.interval.ms
    (KafkaSettings, {"session_timeout_ms": 3_600_001, "extra": {"max.poll.interval.ms": "86400000"}}),
])
def test_a_count_past_what_its_consumer_takes_is_refused(cls: Any, changes: dict[str, Any]) -> None:
    name = next(iter(changes))
    with pytest.raises(ConfigError, match=rf"{name} must be an integer >= [01] and <= \d+, got "):
        cls(**changes)


def test_the_largest_counts_that_work_are_accepted() -> None:
    JoinerSettings(batch_max=1_000_000, max_sample_bytes=1_000_000_000 - 65_536)
    ReplaySettings(linger_ms=900_000, broker_wait_s=901, seed=0)  # librdkafka: delivery timeout > linger
    SyntheticSettings(users=2**62, items=2**62, start_ts_ms=0)
    LearnerSettings(seed=2**64 - 1)
    KafkaSettings(session_timeout_ms=300_000)
    KafkaSettings(session_timeout_ms=600_000, extra={"max.poll.interval.ms": "600000"})


def test_a_count_from_the_environment_is_one_settings_error() -> None:
    with pytest.raises(SettingsError, match=r"^\[joiner\] batch_max must be an integer >= 1 and <= 1000000, got 0 "
                                             r"\(set by environment STREAMREC_JOINER_BATCH_MAX\)$"):
        build(JoinerSettings, "joiner", environ={"STREAMREC_JOINER_BATCH_MAX": "0"})
    with pytest.raises(SettingsError, match=r"^\[learner\] keep_checkpoints must be an integer >= 1, got 0 "
                                             r"\(set by config file \[learner\]\.keep_checkpoints\)$"):
        build(LearnerSettings, "learner", file_data={"learner": {"keep_checkpoints": 0}})
    assert build(RefreshSettings, "refresh", environ={"STREAMREC_REFRESH_HOLDOUT_MESSAGES": "0"}).holdout_messages == 0
    assert build(RedisSettings, "redis", environ={"STREAMREC_REDIS_HISTORY_TTL_DAYS": "0"}).history_ttl_days == 0


def test_the_history_cache_size_comes_from_the_environment_and_a_bad_one_names_the_setting() -> None:
    assert build(ServeSettings, "serve", environ={"STREAMREC_SERVE_HISTORY_CACHE_USERS": "5000"}).history_cache_users \
        == 5000
    with pytest.raises(SettingsError, match=r"^\[serve\] history_cache_users must be an integer >= 0 and <= 100000000, "
                                             r"got -1 \(set by environment STREAMREC_SERVE_HISTORY_CACHE_USERS\)$"):
        build(ServeSettings, "serve", environ={"STREAMREC_SERVE_HISTORY_CACHE_USERS": "-1"})


def test_check_counts_refuses_a_zero_ok_name_that_is_no_count() -> None:
    with pytest.raises(TypeError, match=r"not count fields of JoinerSettings"):
        check_counts("joiner", JoinerSettings(), zero_ok=("batch_maxx",))


# -- the refresh's durations and ports, which it did not check at all --

@pytest.mark.parametrize("name, value", [("redis_backoff_s", -1.0), ("redis_timeout_s", 0.0), ("misfire_grace_s", 0),
                                         ("misfire_grace_s", -1), ("holdout_timeout_s", math.inf),
                                         ("validate_tolerance", -1.0), ("validate_tolerance", math.nan)])
def test_refresh_durations_and_tolerance_are_finite_and_not_negative(name: str, value: float) -> None:
    with pytest.raises(ConfigError, match=rf"\[refresh\] {name} must be a finite number"):
        RefreshSettings(**{name: value})


def test_refresh_zero_backoff_and_tolerance_mean_at_once_and_exact_and_a_negative_auc_drop_demands_a_gain() -> None:
    RefreshSettings(redis_backoff_s=0.0, validate_tolerance=0.0, max_auc_drop=-0.01, max_int8_auc_drop=-1.0)


@pytest.mark.parametrize("port", [-1, 65536])
def test_refresh_metrics_port_is_range_checked(port: int) -> None:
    with pytest.raises(ConfigError, match=rf"\[refresh\] metrics_port must be a port number 0-65535, got {port}"):
        RefreshSettings(metrics_port=port)


# -- [kafka] bootstrap_servers and [redis] url --

@pytest.mark.parametrize("servers", ["127.0.0.1:19092", "kafka-1:9092,kafka-2:9092", "[::1]:9092", "env:2",
                                     "broker.example.com:65535"])
def test_bootstrap_servers_of_host_port_entries_are_accepted(servers: str) -> None:
    assert KafkaSettings(bootstrap_servers=servers).bootstrap_servers == servers


@pytest.mark.parametrize("servers, protocol, written", [
    (" kafka-1:9092 , kafka-2:9092\n", "PLAINTEXT", "kafka-1:9092,kafka-2:9092"),
    ("PLAINTEXT://kafka-1:9092,kafka-2:9092", "PLAINTEXT", "kafka-1:9092,kafka-2:9092"),
    ("SSL://kafka-1:9093, ssl://[::1]:9093", "SSL", "kafka-1:9093,[::1]:9093"),
    ("SASL_SSL://kafka-1:9094", "SASL_SSL", "kafka-1:9094"),
    ("sasl_plaintext://kafka-1:9095", "SASL_PLAINTEXT", "kafka-1:9095"),
], ids=["white space around entries", "PLAINTEXT://", "SSL:// any case, ipv6", "SASL_SSL://", "sasl_plaintext://"])
def test_bootstrap_servers_as_librdkafka_takes_them_are_kept_in_one_written_form(servers: str, protocol: str,
                                                                                 written: str) -> None:
    """librdkafka takes a PROTOCOL:// prefix that is the client's security.protocol, and white space around entries;
    streamrec refused the prefix as "not host:port", and passed the white space on (the faust driver, the learner's
    same-cluster check and the client's name compare the text). Both are written out in one form every reader
    shares (the sasl settings are given only so that the protocol's own checks pass)."""
    sasl = {"sasl_username": "u", "sasl_password": "pw-of-u"} if protocol.startswith("SASL") else {}
    got = KafkaSettings(bootstrap_servers=servers, security_protocol=protocol, **sasl)
    assert got.bootstrap_servers == written


@pytest.mark.parametrize("servers", ["", " ", "kafka", "kafka:", ":9092", "kafka:0", "kafka:70000", "kafka:-1",
                                     "h:abc", "my host:9092", "[]:9092", "h:\u0661\u0662", "PLAINTEXT://h",
                                     "PLAINTEXT://"])
def test_bootstrap_servers_that_are_not_host_port_entries_are_refused(servers: str) -> None:
    with pytest.raises(ConfigError, match=r"^\[kafka\] bootstrap_servers: .* is not host:port"):
        KafkaSettings(bootstrap_servers=servers)


@pytest.mark.parametrize("servers, protocol, said", [
    ("a:1,,b:2", "PLAINTEXT", "entry 2 of 3 is empty (two commas in a row, or one at an end): remove the comma"),
    ("a:1,", "PLAINTEXT", "entry 2 of 2 is empty"),
    (",a:1", "PLAINTEXT", "entry 1 of 2 is empty"),
    ("kafka://h:9092", "PLAINTEXT", "'kafka://h:9092' begins with 'kafka://', which is no prefix librdkafka takes (it "
                                    "drops the entry): give host:port, or a prefix of security_protocol "
                                    "(PLAINTEXT://host:port)"),
    ("SSL://h:9093", "PLAINTEXT", "'SSL://h:9093' says SSL:// but [kafka] security_protocol is PLAINTEXT (librdkafka "
                                  "drops the entry): set security_protocol = \"SSL\" or leave the prefix out"),
    ("SSL://h:9093,SASL_SSL://g:9094", "SSL", "'SASL_SSL://g:9094' says SASL_SSL:// but [kafka] security_protocol is "
                                              "SSL"),
], ids=["two commas", "a comma at the end", "a comma at the start", "kafka://", "another protocol's prefix",
        "two protocols"])
def test_bootstrap_servers_that_librdkafka_would_drop_or_misread_are_refused_naming_the_entry_and_the_fix(
        servers: str, protocol: str, said: str) -> None:
    """librdkafka skips an entry whose prefix is no protocol or another than security.protocol (a "parse error" in
    its log) and empty entries: the client then waited for a broker until its timeout and said only "Broker
    transport failure". Each is refused at start naming the entry and what to change."""
    with pytest.raises(ConfigError) as bad:
        KafkaSettings(bootstrap_servers=servers, security_protocol=protocol)
    assert str(bad.value).startswith(f"[kafka] bootstrap_servers: {said}"), str(bad.value)
    assert str(bad.value).endswith(f"got {servers!r}"), str(bad.value)


def test_a_redis_url_naming_port_0_is_refused() -> None:
    """redis-py took port 0 and every connection was refused, retried as an outage."""
    with pytest.raises(ConfigError, match=r"^\[redis\] url: 'redis://h:0/0' names port 0: give the port Redis "
                                          r"listens on \(1-65535\), or leave it out for 6379"):
        RedisSettings(url="redis://h:0/0")


@pytest.mark.parametrize("url", ["redis://127.0.0.1:47001/abc", "redis://h:1/-1", "redis://h:1/3/4",
                                 "rediss://h:1/x"])
def test_a_redis_url_whose_path_is_no_db_number_is_refused(url: str) -> None:
    with pytest.raises(ConfigError, match=r"^\[redis\] url: the path of .* is not a database number"):
        RedisSettings(url=url)


@pytest.mark.parametrize("url", ["redis://127.0.0.1:16379/0", "redis://h:1/15", "redis://h:1/", "redis://h:1",
                                 "redis://h:1/%33", "unix:///run/redis.sock"])
def test_a_redis_url_with_a_db_number_or_none_is_accepted(url: str) -> None:
    assert RedisSettings(url=url).url == url


# -- the library guards under the settings: a zero that slips past them fails loudly, not silently --

def test_library_guards_refuse_what_the_settings_refuse(tmp_path: Path) -> None:
    from cache_refresh.publish import publish
    from learner import checkpoint
    from stream.joiner.engine import JoinConfig

    with pytest.raises(ValueError, match="checkpoint keep must be >= 1, got 0"):
        checkpoint.save(tmp_path / "ckpt", {}, {"samples_trained": 0}, keep=0)
    assert not (tmp_path / "ckpt").exists()  # refused before anything is written
    with pytest.raises(ValueError, match="publish keep must be >= 1, got 0"):
        publish(tmp_path / "root", tmp_path / "staged", keep=0)
    with pytest.raises(ValueError, match="watermark_quorum must be >= 1, got 0"):
        JoinConfig(watermark_quorum=0)


# -- end to end: the CLI stops at start with exit 2 and one line naming the setting --

def run_cli(argv: list[str], env: dict[str, str], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("STREAMREC_")}
    return subprocess.run([sys.executable, "-m", "streamrec.cli", *argv], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120, env={**clean, "PYTHONPATH": str(ROOT), **env})


def test_join_with_batch_max_0_exits_2_with_one_line(tmp_path: Path) -> None:
    proc = run_cli(["join", "--driver", "kafka"], {"STREAMREC_JOINER_BATCH_MAX": "0"}, tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "streamrec join: error: [joiner] batch_max must be an integer >= 1 and <= 1000000, got 0 (set by environment "
        "STREAMREC_JOINER_BATCH_MAX)"]


def test_evaluate_with_embedding_dim_0_exits_2_before_training(tmp_path: Path) -> None:
    proc = run_cli(["evaluate", "--protocol", "online", "--embedding-dim", "0"], {}, tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "streamrec evaluate: error: [evaluate] embedding_dim must be an integer >= 1 and <= 4096, got 0 (set by "
        "--embedding-dim)"]


# -- upper bounds: an absurd count is refused at start, naming the setting and its source --
# (before: [learner] embedding_dim = 10**30 started and failed only after reading samples, with torch's "Overflow when
# unpacking long long"; [kafka] partitions = 10**30 reached confluent-kafka's NewTopic: "OverflowError: Python int too
# large to convert to C long"; [redis] counts_ttl_days = 10**30 and dozens more were accepted)

@pytest.mark.parametrize("cls, name", CASES, ids=[f"{c.__name__}.{n}" for c, n in CASES])
def test_every_count_has_an_upper_bound_and_the_error_names_its_source(cls: Any, name: str) -> None:
    section = CLASSES[cls][0]
    with pytest.raises(SettingsError, match=rf"^\[{section}\] {name} must be an integer >= [01] and <= \d+, got .* "
                                            rf"\(set by config file \[{section}\]\.{name}\)$"):
        build(cls, section, file_data={section: {name: 10**30}}, environ={})


BOUNDS = [  # (class, setting, its documented upper bound)
    (KafkaSettings, "partitions", 100_000), (KafkaSettings, "replication_factor", 1_000),
    (RedisSettings, "counts_ttl_days", 3_650), (RedisSettings, "history_len", 10_000),
    (RedisSettings, "history_ttl_days", 3_650),
    (LearnerSettings, "embedding_dim", 4_096), (LearnerSettings, "buckets", 1_000_000_000),
    (LearnerSettings, "ctx_buckets", 1_000_000_000), (LearnerSettings, "id_capacity", 1_000_000_000),
    (LearnerSettings, "batch_rows", 10_000_000), (LearnerSettings, "max_fields", 4_096),
    (EvalOverrides, "embedding_dim", 4_096), (EvalOverrides, "id_buckets", 1_000_000_000),
    (ServeSettings, "threads", 1_024), (ServeSettings, "max_body_bytes", 1 << 30),
    (ServeSettings, "embedding_cache_rows", 1_000_000_000), (ServeSettings, "history_cache_users", 100_000_000),
    (RefreshSettings, "days", 3_650), (RefreshSettings, "hot_items", 1_000_000_000),
    (JoinerSettings, "max_pending_per_partition", 1_000_000_000),
    (SyntheticSettings, "latent_dim", 1_024), (SyntheticSettings, "start_ts_ms", 253_402_300_799_999),
    (EventLimits, "max_message_bytes", 1_000_000_000),
    (LearnerSettings, "max_samples", 10**12), (ReplaySettings, "limit", 10**12),  # the ceiling of every other count
]


@pytest.mark.parametrize("cls, name, bound", BOUNDS, ids=[f"{c.__name__}.{n}" for c, n, _ in BOUNDS])
def test_a_count_is_accepted_up_to_its_documented_bound_and_refused_past_it(cls: Any, name: str, bound: int) -> None:
    section = CLASSES[cls][0]
    assert getattr(cls(**{name: bound}), name) == bound
    with pytest.raises(ConfigError, match=rf"^\[{section}\] {name} must be an integer >= [01] and <= {bound}, "
                                          rf"got {bound + 1}$"):
        cls(**{name: bound + 1})


def test_monitor_history_max_series_has_an_upper_bound() -> None:
    from monitor.rules import RulesError, loads_rules

    with pytest.raises(RulesError, match=r'field "history_max_series": expected a whole number from 1 to 10000000'):
        loads_rules('history_max_series = 1_000_000_000_000_000_000_000_000_000_000\n[sources]\n', "rules.toml")


@pytest.mark.parametrize(("cls", "section", "name"), [
    ("stream.joiner.config:JoinerSettings", "joiner", "attribution_window_s"),
    ("learner.config:LearnerSettings", "learner", "checkpoint_every_s"),
    ("cache_refresh.settings:RefreshSettings", "refresh", "redis_timeout_s"),
    ("stream.replay.config:ReplaySettings", "replay", "rate"),
])
def test_a_duration_or_rate_past_ten_years_of_seconds_is_refused_at_start(cls: str, section: str, name: str) -> None:
    # 1e30 passed (only [serve] had a cap): a wait, a window or a rate that size overflows a timer or a datetime later
    import importlib

    module, _, attr = cls.partition(":")
    settings_class = getattr(importlib.import_module(module), attr)
    with pytest.raises(SettingsError, match=rf"\[{section}\] {name} must be a finite number .*<= 3\.15\d*e\+08"):
        build(settings_class, section, {section: {name: 1e30}}, {})


@pytest.mark.parametrize("url", ["redis://:pw@:7000", "rediss://@:6379", "redis://", "rediss://", "redis://:7000",
                                 "redis:///0", "redis://user:pw@/1", "redis://%20:6379"])
def test_a_redis_url_that_names_no_host_is_refused_without_showing_its_password(url: str) -> None:
    """redis-py takes a tcp url without a host as localhost (a single-node client talked to whatever listens there)
    and a cluster client named its node 'None:7000'; refused here, the password masked. unix:// urls name a path."""
    with pytest.raises(ConfigError, match=r"^\[redis\] url: .* names no host: expected rediss?://host:port/db") as no:
        RedisSettings(url=url)
    assert "pw" not in str(no.value)
    assert RedisSettings(url="unix:///run/redis.sock").url == "unix:///run/redis.sock"
    assert RedisSettings(url="redis://[::1]:6379/0").url == "redis://[::1]:6379/0"


@pytest.mark.parametrize("url", ["redis://h:1/0?socket_timeout=60", "rediss://h:1?ssl_check_hostname=false",
                                 "redis://h:1/?decode_responses=true", "redis://h:1?db=3",
                                 "unix:///tmp/r.sock?db=1&socket_timeout=9", "redis://h:1?password=x"])
def test_a_redis_url_with_query_parameters_is_refused_as_they_would_override_the_clients_settings(url: str) -> None:
    """redis-py hands a url's query parameters to the client over what streamrec sets: a url's ``?socket_timeout=60``
    replaced serving's embedding_store_timeout_s, ``?ssl_check_hostname=false`` turned a rediss:// url's host check
    off, ``?decode_responses=true`` failed every binary read, each in silence. Only a unix:// url's ``?db=N`` (its
    only way to name a database) is taken; no parameter value (a password) is shown."""
    with pytest.raises(ConfigError, match=r"^\[redis\] url: query parameters are not taken") as refused:
        RedisSettings(url=url)
    assert "=x" not in str(refused.value) and "false" not in str(refused.value)
    assert RedisSettings(url="unix:///tmp/r.sock?db=2").url.endswith("?db=2")
    with pytest.raises(ConfigError, match=r"\?db= of .* is not a database number"):
        RedisSettings(url="unix:///tmp/r.sock?db=two")


def test_a_replay_broker_wait_librdkafka_refuses_is_a_config_error_naming_the_setting() -> None:
    """``[replay] broker_wait_s`` is the replay producer's ``message.timeout.ms``: librdkafka refuses one not longer
    than ``linger.ms``, or past 2**31 - 1 ms, when the producer is built (after the data set was loaded):
    refused here."""
    for bad in ({"broker_wait_s": 0.01, "linger_ms": 20}, {"broker_wait_s": 3e6}):
        with pytest.raises(ConfigError, match=r"\[replay\] broker_wait_s must be longer than linger_ms"):
            ReplaySettings(**bad)
    assert ReplaySettings(broker_wait_s=2_147_483, linger_ms=0).broker_wait_s == 2_147_483
