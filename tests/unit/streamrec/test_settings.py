from pathlib import Path

import pytest

from stream.config import KafkaSettings
from stream.replay.config import DelayKind, ReplaySettings
from streamrec.settings import SettingsError, Sources, build, read_config_file
from streamrec.stack import StackSettings


def test_defaults_are_the_local_stack() -> None:
    k = build(KafkaSettings, "kafka", {}, {})
    assert k.bootstrap_servers == "127.0.0.1:19092"
    assert k.session_timeout_ms == 6000
    assert (k.impressions_topic, k.clicks_topic, k.samples_topic) == ("impressions", "clicks", "samples")
    assert k.dlq_topic("clicks") == "clicks.dlq"


def test_precedence_file_then_env_then_flags(tmp_path: Path) -> None:
    cfg = tmp_path / "s.toml"
    cfg.write_text('[kafka]\nbootstrap_servers = "file:1"\npartitions = 8\nclicks_topic = "c-file"\n')
    data = read_config_file(cfg)
    env = {"STREAMREC_KAFKA_BOOTSTRAP_SERVERS": "env:2", "STREAMREC_KAFKA_PARTITIONS": "16"}
    k = build(KafkaSettings, "kafka", data, env, {"bootstrap_servers": "flag:3", "partitions": None})
    assert k.bootstrap_servers == "flag:3"  # flag beats env beats file
    assert k.partitions == 16  # env beats file; an unset flag (None) changes nothing
    assert k.clicks_topic == "c-file"  # file beats default


def test_types_are_coerced_from_strings() -> None:
    env = {"STREAMREC_REPLAY_LIMIT": "1_000", "STREAMREC_REPLAY_RATE": "2.5", "STREAMREC_REPLAY_PROGRESS": "no",
           "STREAMREC_REPLAY_CLICK_DELAY_KIND": "fixed", "STREAMREC_REPLAY_SPEED": "none"}
    r = build(ReplaySettings, "replay", {}, env)
    assert (r.limit, r.rate, r.progress, r.click_delay_kind, r.speed) == (1000, 2.5, False, DelayKind.FIXED, None)
    s = build(StackSettings, "stack", {"stack": {"state_dir": "/x/y"}}, {})
    assert s.state_dir == Path("/x/y")


def test_unknown_env_key_is_an_error_naming_the_known_ones() -> None:
    with pytest.raises(SettingsError, match="STREAMREC_KAFKA_BOOTSTRAP_SERVER does not name.*BOOTSTRAP_SERVERS"):
        build(KafkaSettings, "kafka", {}, {"STREAMREC_KAFKA_BOOTSTRAP_SERVER": "x"})


def test_unknown_file_key_and_bad_values_say_where(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match=r"unknown key 'partition' in \[kafka\]"):
        build(KafkaSettings, "kafka", {"kafka": {"partition": 3}}, {})
    with pytest.raises(SettingsError, match=r"STREAMREC_KAFKA_PARTITIONS: cannot use 'four'"):
        build(KafkaSettings, "kafka", {}, {"STREAMREC_KAFKA_PARTITIONS": "four"})
    with pytest.raises(SettingsError, match="expected one of fixed, exponential, lognormal"):
        build(ReplaySettings, "replay", {}, {"STREAMREC_REPLAY_CLICK_DELAY_KIND": "gamma"})
    bad = tmp_path / "bad.toml"
    bad.write_text("[kafka\n")
    with pytest.raises(SettingsError, match="not valid TOML"):
        read_config_file(bad)
    with pytest.raises(SettingsError, match="does not exist"):
        read_config_file(tmp_path / "missing.toml")


def test_sources_build_uses_file_and_environment() -> None:
    src = Sources(file_data={"redis": {"url": "redis://h:1/0"}}, environ={})
    from stream.config import RedisSettings

    assert src.build(RedisSettings, "redis").url == "redis://h:1/0"


def test_the_writers_and_readers_of_each_redis_channel_agree_for_any_prefix() -> None:
    from cache_refresh.job import notify_channel
    from cache_refresh.settings import RefreshSettings
    from serving.swap import artifact_channel, delta_channel
    from stream.config import RedisSettings as Redis

    rs = Redis(prefix="team-a")
    assert delta_channel(rs.prefix) == rs.deltas_channel == "team-a:model-deltas"
    assert artifact_channel(rs.prefix) == rs.artifact_channel == notify_channel(RefreshSettings(), rs)


def test_every_choice_is_an_enum_checked_where_its_dataclass_is_built() -> None:
    from cache_refresh.settings import CountEvent, RefreshSettings
    from learner.config import ArtifactFormat, Device, LearnerSettings, SparseOptimizer
    from serving.settings import ServerKind, ServeSettings
    from stream.errors import ConfigError
    from stream.joiner.config import Driver, JoinerSettings

    env = {"STREAMREC_JOINER_DRIVER": "kafka", "STREAMREC_LEARNER_DEVICE": "cpu",
           "STREAMREC_LEARNER_SPARSE_OPTIMIZER": "sparse_adam", "STREAMREC_REFRESH_FORMAT": "export",
           "STREAMREC_REFRESH_COUNT_EVENT": "click", "STREAMREC_SERVE_SERVER": "aiohttp"}
    assert build(JoinerSettings, "joiner", {}, env).driver is Driver.KAFKA
    ls = build(LearnerSettings, "learner", {}, env)
    assert (ls.device, ls.sparse_optimizer) == (Device.CPU, SparseOptimizer.SPARSE_ADAM)
    rs = build(RefreshSettings, "refresh", {}, env)
    assert (rs.format, rs.count_event) == (ArtifactFormat.EXPORT, CountEvent.CLICK)
    assert build(ServeSettings, "serve", {}, env).server is ServerKind.AIOHTTP
    # built in code with a plain string: converted; a wrong one is a ConfigError naming the setting
    assert JoinerSettings(driver="kafka").driver is Driver.KAFKA and f"{Device.CUDA}" == "cuda"
    for make, name in ((lambda: JoinerSettings(driver="spark"), "driver"),
                       (lambda: LearnerSettings(device="tpu"), "device"),
                       (lambda: LearnerSettings(sparse_optimizer="sgd"), "sparse_optimizer"),
                       (lambda: LearnerSettings(id_init="random"), "id_init"),
                       (lambda: RefreshSettings(format="tflite"), "format"),
                       (lambda: ServeSettings(server="gunicorn"), "server")):
        with pytest.raises(ConfigError, match=rf"\] {name}: got .*expected one of"):
            make()


def test_the_mlp_is_parsed_once_into_layer_sizes_from_a_file_an_array_or_the_environment() -> None:
    from learner.config import LearnerSettings, shape_of

    assert build(LearnerSettings, "learner", {}, {"STREAMREC_LEARNER_MLP": "64, 32"}).mlp == (64, 32)
    assert build(LearnerSettings, "learner", {"learner": {"mlp": [8, 4]}}, {}).mlp == (8, 4)
    assert build(LearnerSettings, "learner", {"learner": {"mlp": "16"}}, {}).mlp == (16,)
    assert LearnerSettings(mlp="400,400").mlp == (400, 400)
    assert shape_of(LearnerSettings(mlp=(8, 4)))["mlp"] == "8,4"  # what checkpoints record
    with pytest.raises(SettingsError, match="STREAMREC_LEARNER_MLP: cannot use 'x'"):
        build(LearnerSettings, "learner", {}, {"STREAMREC_LEARNER_MLP": "8,x"})
    with pytest.raises(ValueError, match="layer sizes must be >= 1"):
        LearnerSettings(mlp=(8, 0))


@pytest.mark.parametrize("raw", ["nan", "inf", "-inf", float("nan"), float("inf")])
def test_a_float_setting_must_be_finite(raw: object) -> None:
    from learner.config import LearnerSettings

    with pytest.raises(SettingsError, match="expected a finite number"):
        build(LearnerSettings, "learner", {"learner": {"lr_dense": raw}} if not isinstance(raw, str) else {},
              {"STREAMREC_LEARNER_LR_DENSE": raw} if isinstance(raw, str) else {})


def test_a_table_setting_comes_from_a_toml_table_or_key_value_pairs() -> None:
    from dataclasses import dataclass, field

    @dataclass(frozen=True)
    class WithTable:
        extra: dict[str, str] = field(default_factory=dict)

    got = build(WithTable, "t", {"t": {"extra": {"socket.keepalive.enable": True, "fetch.min.bytes": 1}}}, {})
    assert got.extra == {"socket.keepalive.enable": "true", "fetch.min.bytes": "1"}
    assert build(WithTable, "t", {}, {"STREAMREC_T_EXTRA": "a=1, b = x=y"}).extra == {"a": "1", "b": "x=y"}
    with pytest.raises(SettingsError, match="key=value pairs"):
        build(WithTable, "t", {}, {"STREAMREC_T_EXTRA": "novalue"})


@pytest.mark.parametrize("a,b", [("impressions_topic", "clicks_topic"), ("impressions_topic", "samples_topic"),
                                 ("clicks_topic", "samples_topic")])
def test_two_of_the_pipelines_streams_on_one_topic_is_a_config_error_for_every_command(a: str, b: str) -> None:
    """``streamrec audit`` with the clicks topic set to the impressions topic dead-lettered every impression as an
    invalid click and committed past it (exit 0); the check was the audit's own. It is now KafkaSettings', so the
    joiner, the replay and the learner refuse such settings too, from the file or the environment."""
    from stream.config import KafkaSettings
    from stream.errors import ConfigError

    with pytest.raises(ConfigError, match=rf"\[kafka\] {a} and {b} are both 'events'"):
        KafkaSettings(**{a: "events", b: "events"})
    env = {f"STREAMREC_KAFKA_{a.upper()}": "events", f"STREAMREC_KAFKA_{b.upper()}": "events"}
    with pytest.raises(ConfigError, match=rf"{a} and {b} are both"):
        build(KafkaSettings, "kafka", {}, env)


@pytest.mark.parametrize("section, file_data, environ, overrides, source", [
    ("kafka", {}, {"STREAMREC_KAFKA_PARTITIONS": "0"}, {}, "environment STREAMREC_KAFKA_PARTITIONS"),
    ("joiner", {"joiner": {"batch_max": 0}}, {}, {}, r"config file \[joiner\]\.batch_max"),
    ("serve", {}, {"STREAMREC_SERVE_POLL_S": "-1"}, {}, "environment STREAMREC_SERVE_POLL_S"),
    ("learner", {"learner": {"dropout": 1.5}}, {}, {}, r"config file \[learner\]\.dropout"),
    ("learner", {}, {}, {"step_rows": -3}, "--step-rows"),
    ("kafka", {}, {"STREAMREC_KAFKA_SASL_USERNAME": "u"}, {}, "environment STREAMREC_KAFKA_SASL_USERNAME"),
    ("redis", {"redis": {"url": "redis://h:1/0", "ssl_ca_certs": "/ca.pem"}}, {}, {},
     r"config file \[redis\]\.url.*config file \[redis\]\.ssl_ca_certs"),
])
def test_a_value_its_settings_class_refuses_names_the_variable_file_or_flag_it_came_from(
        section: str, file_data: dict, environ: dict, overrides: dict, source: str) -> None:
    """The class's own checks (a count, a duration, a share, a combination) raise in ``__post_init__``, where the
    source is unknown: ``build`` adds it, so an operator knows which variable or file line to fix."""
    from cache_refresh.settings import RefreshSettings  # noqa: F401 - the classes below, by section
    from learner.config import LearnerSettings
    from serving.settings import ServeSettings
    from stream.config import RedisSettings
    from stream.joiner.config import JoinerSettings

    cls = {"kafka": KafkaSettings, "joiner": JoinerSettings, "serve": ServeSettings, "learner": LearnerSettings,
           "redis": RedisSettings}[section]
    with pytest.raises(SettingsError, match=source) as err:
        build(cls, section, file_data, environ, overrides)
    assert "\n" not in str(err.value)


def test_a_nul_character_in_any_text_setting_is_refused_naming_the_setting() -> None:
    # TOML's "\u0000" escape: a path setting holding it ended `streamrec train` in os.mkdir's "ValueError: embedded
    # null byte" traceback, and a *_password_file one in the settings loader's open()
    from cache_refresh.settings import RefreshSettings
    from learner.config import LearnerSettings
    from stream.config import RedisSettings

    cases = [(LearnerSettings, "learner", "checkpoint_dir"), (RedisSettings, "redis", "password_file"),
             (KafkaSettings, "kafka", "clicks_topic"), (RefreshSettings, "refresh", "schedule")]
    for cls, section, key in cases:
        with pytest.raises(SettingsError, match=rf"\[{section}\]\.{key}: .*NUL"):
            build(cls, section, {section: {key: "a\x00b"}}, {})
    with pytest.raises(SettingsError, match=r"\[kafka\]\.extra\.client\.rack: .*NUL"):
        build(KafkaSettings, "kafka", {"kafka": {"extra": {"client.rack": "a\x00b"}}}, {})


@pytest.mark.parametrize("table", [{"dlq_suffix": ""}, {"clicks_topic": "impressions.dlq"},
                                   {"samples_topic": "x", "dlq_suffix": "", "impressions_topic": "y"},
                                   {"impressions_topic": "a", "clicks_topic": "a.dlq.dlq", "dlq_suffix": ".dlq.dlq"}])
def test_a_dead_letter_topic_that_is_one_of_the_streams_is_refused(table: dict[str, str]) -> None:
    # dlq_suffix = "" made impressions' dead-letter topic impressions itself: a bad message was written back onto the
    # topic it was read from (read again, dead-lettered again); clicks_topic = "impressions.dlq" took impressions'
    # dead letters as clicks
    with pytest.raises(SettingsError, match=r"dead-letter"):
        build(KafkaSettings, "kafka", {"kafka": table}, {})


@pytest.mark.parametrize("mlp", [str(2**64), "400,1099511627776", [8] * 65])
def test_an_mlp_too_wide_or_too_deep_to_build_is_refused_naming_the_setting(mlp: object) -> None:
    # each width was only checked >= 1: 2**64 passed and torch's nn.Linear failed once the first samples had been read
    # ("Overflow when unpacking long long"), 2**40 asked the allocator for 440 TB (RuntimeError), both tracebacks
    from learner.config import LearnerSettings

    with pytest.raises(SettingsError, match=r"mlp: at most .*set by environment STREAMREC_LEARNER_MLP"):
        build(LearnerSettings, "learner", {}, {"STREAMREC_LEARNER_MLP": ",".join(map(str, mlp)) if isinstance(
            mlp, list) else str(mlp)})
    assert build(LearnerSettings, "learner", {}, {"STREAMREC_LEARNER_MLP": "16384," * 63 + "16384"}).mlp[0] == 16384
