"""Every setting that names a Kafka topic or a consumer group is checked where its settings are built (exit 2)."""

import pytest

from cache_refresh.settings import RefreshSettings
from learner.config import LearnerSettings
from monitor.rules import loads_rules
from stream.config import KafkaSettings
from stream.errors import ConfigError
from stream.joiner.config import JoinerSettings
from streamrec.settings import SettingsError, build

ILLEGAL_TOPICS = ["", "my topic", "a/b", ".", "..", "x" * 250, "caf\u00e9", "a\nb"]


@pytest.mark.parametrize("name", ILLEGAL_TOPICS)
@pytest.mark.parametrize("cls, section, key", [
    (KafkaSettings, "kafka", "impressions_topic"), (KafkaSettings, "kafka", "clicks_topic"),
    (KafkaSettings, "kafka", "samples_topic"), (JoinerSettings, "joiner", "late_clicks_topic")])
def test_a_topic_setting_kafka_would_refuse_is_a_config_error_naming_the_setting(
        cls: type, section: str, key: str, name: str) -> None:
    with pytest.raises(ConfigError, match=rf"\[{section}\] {key}: .*Kafka topic name"):
        cls(**{key: name})


@pytest.mark.parametrize("name", [n for n in ILLEGAL_TOPICS if n])  # "" = log only
def test_the_refresh_alerts_topic_is_checked_unless_empty(name: str) -> None:
    with pytest.raises(ConfigError, match=r"\[refresh\] alerts_topic: .*Kafka topic name"):
        RefreshSettings(alerts_topic=name)
    assert RefreshSettings(alerts_topic="").alerts_topic == ""


def test_legal_topic_names_at_the_bounds_pass() -> None:
    k = KafkaSettings(impressions_topic="i" * 245, clicks_topic="A-b_c.9", samples_topic="...")
    assert k.dlq_topic(k.impressions_topic) == "i" * 245 + ".dlq"  # 249 characters: the longest legal name
    assert JoinerSettings(late_clicks_topic="l" * 249, app_id="j" * 238).app_id == "j" * 238
    assert RefreshSettings(alerts_topic="a" * 249).alerts_topic == "a" * 249


@pytest.mark.parametrize("table, setting", [
    ({"impressions_topic": "i" * 246}, "impressions_topic"),  # + ".dlq": 250 characters
    ({"samples_topic": "s" * 249}, "samples_topic"),
    ({"dlq_suffix": "/dlq"}, "impressions_topic"), ({"dlq_suffix": " dlq"}, "impressions_topic")])
def test_a_dead_letter_topic_kafka_would_refuse_is_a_config_error(table: dict, setting: str) -> None:
    with pytest.raises(SettingsError, match=rf"\[kafka\] {setting} \+ \[kafka\] dlq_suffix: the dead-letter topic"):
        build(KafkaSettings, "kafka", {"kafka": table}, {})


def test_the_late_clicks_dead_letter_topic_is_checked_before_the_joiner_connects() -> None:
    from stream.config import RedisSettings
    from stream.joiner.pipeline import JoinPipeline

    # a Redis url nothing listens on: the check must come before any connection is tried
    with pytest.raises(ConfigError, match=r"\[joiner\] late_clicks_topic \+ \[kafka\] dlq_suffix"):
        JoinPipeline(KafkaSettings(), RedisSettings(url="redis://127.0.0.1:1/0"),
                     JoinerSettings(late_clicks_topic="l" * 246))


@pytest.mark.parametrize("group", ["", " ", "\t\n", "a\x00b"])
def test_a_consumer_group_librdkafka_takes_as_none_is_refused(group: str) -> None:
    # confluent-kafka's Consumer({"group.id": ""}) (or " ", "\n", "\x00...") aborted the whole process (an assertion
    # in Consumer_init), after the daemon had loaded its checkpoint
    with pytest.raises(ConfigError, match=r"\[learner\] group_id: .*consumer group id"):
        LearnerSettings(group_id=group)
    with pytest.raises(ConfigError, match=r"\[joiner\] app_id: "):
        JoinerSettings(app_id=group)


def test_a_joiner_app_id_must_name_a_legal_state_topic() -> None:
    for app_id in ("my app", "a/b", "j" * 239):
        with pytest.raises(ConfigError, match=r"\[joiner\] app_id: .*state topic"):
            JoinerSettings(app_id=app_id)
    assert LearnerSettings(group_id="any text: a b/c").group_id == "any text: a b/c"  # Kafka takes it


@pytest.mark.parametrize("name", ["..", "."])
def test_the_monitor_kafka_topic_uses_the_same_rule(name: str) -> None:
    with pytest.raises(ConfigError, match=r'"kafka_topic": .*Kafka topic name'):
        loads_rules(f'[sinks]\nkafka_topic = "{name}"\n')


def test_audit_with_an_empty_group_is_exit_2_not_an_abort() -> None:
    # `streamrec audit --group ""` aborted the process (SIGABRT, exit 134: confluent-kafka's Consumer_init assertion)
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-m", "streamrec.cli", "audit", "--group", " ", "--bootstrap-servers",
                          "127.0.0.1:9"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2, run.stderr
    assert "consumer group id" in run.stderr
