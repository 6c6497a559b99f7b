"""``[kafka] security_protocol`` in any case, as librdkafka reads ``security.protocol``; ``sasl_mechanism`` exact,
as librdkafka reads ``sasl.mechanism`` ("Unsupported SASL mechanism: plain")."""

from __future__ import annotations

import pytest

from stream.config import KafkaSettings, SaslMechanism, SecurityProtocol
from stream.errors import ConfigError
from streamrec.settings import build


@pytest.mark.parametrize("given, member", [("ssl", SecurityProtocol.SSL), ("Sasl_Ssl", SecurityProtocol.SASL_SSL),
                                           ("plaintext", SecurityProtocol.PLAINTEXT)])
def test_security_protocol_in_any_case_is_taken_as_its_canonical_upper_case_member(
        given: str, member: SecurityProtocol) -> None:
    """``security_protocol = "ssl"`` was refused ("expected one of PLAINTEXT, SSL, ..."), though librdkafka takes it:
    now the one upper-case member, which every reader sees (the bootstrap_servers prefix rule among them)."""
    sasl = {"sasl_username": "u", "sasl_password": "p"} if member.sasl else {}
    table = {"security_protocol": given, "bootstrap_servers": f"{member}://kafka-1:9093, kafka-2:9093", **sasl}
    settings = build(KafkaSettings, "kafka", {"kafka": table}, {})
    assert settings.security_protocol is member and str(settings.security_protocol) == member.value
    assert settings.bootstrap_servers == "kafka-1:9093,kafka-2:9093"
    assert KafkaSettings(security_protocol=given, **sasl).security_protocol is member  # in code too


def test_a_security_protocol_that_is_none_in_any_case_is_still_refused_naming_the_choices() -> None:
    with pytest.raises(ConfigError, match=r"\[kafka\] security_protocol: got 'tls', expected one of PLAINTEXT, SSL"):
        KafkaSettings(security_protocol="tls")


def test_sasl_mechanism_stays_exact_as_librdkafka_refuses_a_lower_case_one() -> None:
    with pytest.raises(ConfigError, match=r"\[kafka\] sasl_mechanism: got 'plain', expected one of PLAIN"):
        KafkaSettings(security_protocol="SASL_SSL", sasl_mechanism="plain", sasl_username="u", sasl_password="p")
    assert SaslMechanism.of("SCRAM-SHA-256", "x") is SaslMechanism.SCRAM_SHA_256
