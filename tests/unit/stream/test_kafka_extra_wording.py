"""A ``[kafka.extra]`` property librdkafka rejects was reported as "a security setting cannot be used"; it is
named as an extra property now. A security setting librdkafka rejects keeps its wording. A poll interval below the
session names the poll interval as the setting out of range."""

from __future__ import annotations

from pathlib import Path

import pytest

from stream.config import KafkaSettings, SecurityProtocol
from stream.errors import ConfigError
from stream.kafka import producer_config


@pytest.mark.parametrize(("extra", "prop"), [({"bogus.prop": "1"}, "bogus.prop"),
                                             ({"socket.timeout.ms": "soon"}, "socket.timeout.ms")])
def test_a_rejected_extra_property_is_named_as_one(extra: dict[str, str], prop: str) -> None:
    with pytest.raises(ConfigError) as info:
        producer_config(KafkaSettings(bootstrap_servers="127.0.0.1:1", extra=extra))
    msg = str(info.value)
    assert msg.startswith(f"[kafka.extra] (STREAMREC_KAFKA_EXTRA) {prop}: ") and "security" not in msg


def test_a_rejected_security_file_keeps_its_wording(tmp_path: Path) -> None:
    (tmp_path / "ca.pem").write_text("not a certificate")
    k = KafkaSettings(bootstrap_servers="127.0.0.1:1", security_protocol=SecurityProtocol.SSL,
                      ssl_ca_location=tmp_path / "ca.pem", extra={"client.id": "x"})
    with pytest.raises(ConfigError, match=r"\[kafka\] a security setting cannot be used: .*ssl.ca.location"):
        producer_config(k)


@pytest.mark.parametrize(("prop", "value", "setting"), [
    ("security.protocol", "SASL_PLAINTEXT", "security_protocol"),  # the SASL password in clear text
    ("security.protocol", "plaintext", "security_protocol"),
    ("sasl.mechanism", "PLAIN", "sasl_mechanism"),
    ("sasl.mechanisms", "PLAIN", "sasl_mechanism"),
    ("sasl.username", "other", "sasl_username"),
    ("sasl.password", "other-pw-1", "sasl_password"),
    ("ssl.ca.location", "/etc/ssl/other.pem", "ssl_ca_location"),
    ("ssl.key.password", "other-pw-2", "ssl_key_password"),
    ("bootstrap.servers", "elsewhere:9092", "bootstrap_servers"),
])
def test_an_extra_property_that_a_kafka_setting_owns_is_refused_at_start(prop: str, value: str, setting: str) -> None:
    # [kafka.extra] is applied last: security_protocol = "SASL_SSL" with extra security.protocol = "SASL_PLAINTEXT"
    # sent the SASL password unencrypted from every confluent-kafka client, while the faust driver (which maps only
    # the typed settings) used TLS: two settings that do not fit together, taken silently
    with pytest.raises(ConfigError, match=rf"\[kafka\.extra\] {prop}: .*\[kafka\] {setting}") as err:
        KafkaSettings(security_protocol=SecurityProtocol.SASL_SSL, sasl_username="u", sasl_password="pw-123456",
                      extra={prop: value})
    assert "other-pw" not in str(err.value)


@pytest.mark.parametrize("poll", ["0", "5999"])
def test_a_poll_interval_below_the_session_is_named_as_the_setting_out_of_range(poll: str) -> None:
    # was "[kafka] session_timeout_ms must be an integer >= 1 and <= 0, got 6000": the session named, not the extra
    with pytest.raises(ConfigError) as info:
        KafkaSettings(session_timeout_ms=6000, extra={"max.poll.interval.ms": poll})
    msg = str(info.value)
    assert msg.startswith(f"[kafka.extra] max.poll.interval.ms = {poll} is out of range: it must be at least "
                          "[kafka] session_timeout_ms (6000)")
    assert "session within the time it may go between polls" in msg  # why
    KafkaSettings(session_timeout_ms=6000, extra={"max.poll.interval.ms": "6000"})  # equal: accepted
