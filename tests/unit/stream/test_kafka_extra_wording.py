"""A ``[kafka.extra]`` property librdkafka rejects was reported as "a security setting cannot be used"; it is
named as an extra property now. A security setting librdkafka rejects keeps its wording."""

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
