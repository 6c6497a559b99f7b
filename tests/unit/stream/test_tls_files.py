"""A TLS file a setting names that cannot be used (a CA file holding no certificate, a key that is not the
certificate's, an encrypted key without its password, a FIFO) is a ConfigError naming the setting and the file, when
the client is built: never ssl's raw SSLError traceback (the faust join driver's context) nor a failure at the first
command, retried as an outage (redis-py loads the files only when it connects)."""

from __future__ import annotations

import contextlib
import datetime
import os
import socket
import ssl
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization

from stream.config import KafkaSettings, SecurityProtocol
from stream.errors import ConfigError
from stream.kafka_access import tls_context
from stream.secrets import Secret
from stream.tls import _certificate_facts, certificate_refusal
from tests.secure_redis import TlsFiles, make_tls_files


@dataclass(frozen=True)
class Files:
    good: TlsFiles
    other: TlsFiles  # another CA's: its key is not good.cert's
    junk: Path  # text, no certificate
    encrypted_key: Path  # good.key, encrypted with "right-password"
    fifo: Path


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Files:
    d = tmp_path_factory.mktemp("tls")
    good, other = make_tls_files(d / "good", "good"), make_tls_files(d / "other", "other")
    junk = d / "junk.pem"
    junk.write_text("this is no certificate\n")
    key = serialization.load_pem_private_key(good.key.read_bytes(), None)
    encrypted = d / "encrypted.key"
    encrypted.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                            serialization.BestAvailableEncryption(b"right-password")))
    fifo = d / "fifo.pem"
    os.mkfifo(fifo)
    return Files(good, other, junk, encrypted, fifo)


def _kafka(f: Files, case: str) -> tuple[KafkaSettings, str, Path]:
    """The settings of ``case``, the setting its error must name and the file."""
    ca, cert, key, password = f.good.ca, f.good.cert, f.good.key, ""
    named = {"ca holds no certificate": ("ssl_ca_location", f.junk), "ca is a fifo": ("ssl_ca_location", f.fifo),
             "key of another certificate": ("ssl_certificate_location / ssl_key_location", f.other.key),
             "key holds no key": ("ssl_key_location", f.junk),
             "encrypted key, no password": ("ssl_key_location", f.encrypted_key),
             "encrypted key, wrong password": ("ssl_key_location", f.encrypted_key),
             "certificate holds no certificate": ("ssl_certificate_location", f.junk)}[case]
    if named[0] == "ssl_ca_location":
        ca = named[1]
    elif case == "certificate holds no certificate":
        cert = f.junk
    else:
        key = named[1]
    if case == "encrypted key, wrong password":
        password = "wrong-password"
    k = KafkaSettings(security_protocol=SecurityProtocol.SSL, ssl_ca_location=ca, ssl_certificate_location=cert,
                      ssl_key_location=key, ssl_key_password=Secret(password))
    return k, named[0], named[1]


KAFKA_CASES = ["ca holds no certificate", "ca is a fifo", "key of another certificate", "key holds no key",
               "encrypted key, no password", "encrypted key, wrong password", "certificate holds no certificate"]


@pytest.mark.parametrize("case", KAFKA_CASES)
def test_the_faust_driver_reports_an_unusable_tls_file_as_a_config_error_naming_the_setting(
        files: Files, case: str) -> None:
    from stream.joiner.worker import broker_credentials

    k, setting, path = _kafka(files, case)
    with pytest.raises(ConfigError) as info:
        broker_credentials(k)
    assert str(info.value).startswith(f"[kafka] {setting}: ") and str(path) in str(info.value)


def test_the_faust_driver_loads_good_tls_files_and_an_encrypted_key_with_its_password(files: Files) -> None:
    import faust

    from stream.joiner.worker import broker_credentials

    for key, password in ((files.good.key, ""), (files.encrypted_key, "right-password")):
        k = KafkaSettings(security_protocol=SecurityProtocol.SSL, ssl_ca_location=files.good.ca,
                          ssl_certificate_location=files.good.cert, ssl_key_location=key,
                          ssl_key_password=Secret(password))
        assert isinstance(broker_credentials(k), faust.SSLCredentials)


# enable.ssl.certificate.verification's spellings and what librdkafka reads (rdkafka_conf.c: true/t/1, false/f/0, any
# case); None: librdkafka refuses it when a client is built
VERIFY_SPELLINGS = [("true", True), ("t", True), ("T", True), ("TRUE", True), ("1", True), ("True", True),
                    ("false", False), ("f", False), ("F", False), ("FALSE", False), ("0", False), ("False", False),
                    ("yes", None), ("no", None), ("off", None), (" f", None), ("false ", None), ("", None)]


@pytest.mark.parametrize(("raw", "verifies"), VERIFY_SPELLINGS)
def test_both_join_drivers_read_certificate_verification_as_librdkafka_does_and_refuse_what_it_refuses(
        files: Files, raw: str, verifies: bool | None) -> None:
    """The faust driver took ``"f"`` (and ``"F"``, ``"FALSE"``) for verification on where librdkafka, the kafka
    driver's client, reads it as off: the two drivers of one deployment checked the broker's certificate differently."""
    import ssl

    import confluent_kafka

    from stream.joiner.worker import broker_credentials
    from stream.kafka_access import security_properties, weakened_tls

    prop = "enable.ssl.certificate.verification"
    try:  # the table is librdkafka's: it takes exactly the spellings read as True or False here
        confluent_kafka.Producer({prop: raw, "log_level": 0})
    except confluent_kafka.KafkaException:
        assert verifies is None, raw
    else:
        assert verifies is not None, raw

    def settings() -> KafkaSettings:
        return KafkaSettings(security_protocol=SecurityProtocol.SSL, ssl_ca_location=files.good.ca, extra={prop: raw})

    if verifies is None:
        with pytest.raises(ConfigError, match=f"\\[kafka.extra\\] {prop} = {raw!r}"):
            settings()
        return
    k = settings()
    # the kafka driver (librdkafka)
    assert security_properties(k)[prop] == raw and (weakened_tls(k) is None) is verifies
    context = broker_credentials(k).context  # type: ignore[union-attr]  # the faust driver
    assert (context.verify_mode, context.check_hostname) == ((ssl.CERT_REQUIRED, True) if verifies else
                                                             (ssl.CERT_NONE, False))


REDIS_CASES = ["ca holds no certificate", "ca is a fifo", "key of another certificate", "key holds no key",
               "encrypted key (no password setting)", "certificate holds no certificate"]


@pytest.mark.parametrize("case", REDIS_CASES)
def test_a_redis_client_with_an_unusable_tls_file_fails_when_built_naming_the_setting(files: Files, case: str) -> None:
    """``connect`` builds a client without connecting: before the check, every case here returned a client whose first
    command failed (or was retried as an outage)."""
    from stream.config import RedisSettings
    from stream.redis_client import connect

    ca, cert, key = files.good.ca, files.good.cert, files.good.key
    setting, path = {"ca holds no certificate": ("ssl_ca_certs", files.junk),
                     "ca is a fifo": ("ssl_ca_certs", files.fifo),
                     "key of another certificate": ("ssl_certfile / ssl_keyfile", files.other.key),
                     "key holds no key": ("ssl_keyfile", files.junk),
                     "encrypted key (no password setting)": ("ssl_keyfile", files.encrypted_key),
                     "certificate holds no certificate": ("ssl_certfile", files.junk)}[case]
    if setting == "ssl_ca_certs":
        ca = path
    elif setting == "ssl_certfile":
        cert = path
    else:
        key = path
    rs = RedisSettings(url="rediss://127.0.0.1:1/0", ssl_ca_certs=ca, ssl_certfile=cert, ssl_keyfile=key)
    with pytest.raises(ConfigError) as info:
        connect(rs, retries=0)
    assert str(info.value).startswith(f"[redis] {setting}: ") and str(path) in str(info.value)
    good = RedisSettings(url="rediss://127.0.0.1:1/0", ssl_ca_certs=files.good.ca, ssl_certfile=files.good.cert,
                         ssl_keyfile=files.good.key)
    connect(good, retries=0).close()  # good files: built (lazily, nothing sent)


def test_an_encrypted_redis_client_key_is_refused_saying_to_decrypt_it_as_no_setting_takes_its_password(
        files: Files) -> None:
    """The error said "encrypted and its password is missing or wrong", sending the operator to look for a [redis]
    key password setting there is none of; the Kafka one, which has ssl_key_password, still says that."""
    from stream.config import RedisSettings
    from stream.redis_client import connect

    rs = RedisSettings(url="rediss://127.0.0.1:1/0", ssl_ca_certs=files.good.ca, ssl_certfile=files.good.cert,
                       ssl_keyfile=files.encrypted_key)
    with pytest.raises(ConfigError, match=r"\[redis\] ssl_keyfile: .*encrypted, which \[redis\] cannot use .*give the "
                                          r"key unencrypted \(openssl pkey -in .*encrypted.key") as info:
        connect(rs, retries=0)
    assert "password is missing" not in str(info.value)


@pytest.mark.parametrize("with_ca", [True, False])
def test_a_rediss_client_checks_the_servers_host_name_whatever_redis_pys_default(files: Files, with_ca: bool) -> None:
    """The host-name check of a rediss:// connection is streamrec's setting, not redis-py's default: pyproject allowed
    redis-py 5, whose ``ssl_check_hostname`` defaults to False, where any certificate a trusted CA signed (the
    system's CAs when ssl_ca_certs is unset: any public site's) was taken for the Redis's. Nothing is sent."""
    from stream.config import RedisSettings
    from stream.redis_client import connect

    rs = RedisSettings(url="rediss://127.0.0.1:1/0", ssl_ca_certs=files.good.ca if with_ca else None)
    client = connect(rs, retries=0)
    try:
        kw = client.connection_pool.connection_kwargs
        assert kw.get("ssl_check_hostname") is True and kw.get("ssl_cert_reqs") == "required"
    finally:
        client.close()


@pytest.mark.parametrize("url", ["rediss://u:pw@127.0.0.1:1/0", "redis://127.0.0.1:1"])
def test_a_cluster_client_asked_for_whole_reply_deadlines_keeps_them_over_a_rediss_url(
        monkeypatch: pytest.MonkeyPatch, url: str) -> None:
    """Serving asks for whole-reply deadlines (``whole_reply=True``, stream/redis_deadline.py). redis-py's
    ``RedisCluster.from_url`` lets the URL's options win over the caller's, and a rediss:// URL's connection class is
    ``SSLConnection``: a TLS cluster's nodes were bounded read by read again. Made with no node contacted (the node
    discovery and the command table left out), the client's connection class is the whole-reply one, with the URL's
    address and credentials."""
    import redis.cluster

    from stream.config import RedisSettings
    from stream.redis_client import connect
    from stream.redis_deadline import connection_class

    monkeypatch.setattr(redis.cluster.NodesManager, "initialize", lambda self, *a, **k: None)
    monkeypatch.setattr(redis.cluster.CommandsParser, "__init__", lambda self, *a, **k: None)
    client = connect(RedisSettings(url=url, cluster=True), whole_reply=True).client()
    kw = client.nodes_manager.connection_kwargs
    assert kw["connection_class"] is connection_class(url)
    assert list(client.nodes_manager.startup_nodes) == ["127.0.0.1:1"]
    assert (kw.get("username"), kw.get("password")) == (("u", "pw") if url.startswith("rediss") else (None, None))


def test_the_redis_py_floor_is_one_whose_cluster_clients_check_host_names() -> None:
    """A Redis Cluster client of redis-py before 6.0 drops the ``ssl_check_hostname`` that
    :func:`~stream.redis_client.connect` sets (it is not among the cluster's allowed connection keys) and its
    ``SSLConnection`` defaults to no check: a rediss:// cluster checked no host name under pyproject's old floor
    (redis>=5.0). From 6.0 the check is the default."""
    import redis.cluster
    from packaging.requirements import Requirement
    from packaging.version import Version

    from stream.setting_values import tomllib

    deps = tomllib.loads((Path(__file__).resolve().parents[3] / "pyproject.toml").read_text())["project"]
    req = next(Requirement(d) for d in deps["dependencies"] if Requirement(d).name == "redis")
    floor = min(Version(s.version) for s in req.specifier if s.operator in (">=", "=="))
    assert floor >= Version("6.0"), str(req)
    assert "ssl_check_hostname" in redis.cluster.REDIS_ALLOWED_KEYS  # the installed one passes it on, too


# -- why a server's certificate is refused (stream.tls.certificate_refusal, the kafka access check's reason) --------
@contextlib.contextmanager
def _tls_server(f: TlsFiles) -> Iterator[int]:
    """A plain Python TLS server (a thread) presenting ``f.cert``: each connection is handshaken, then closed."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(f.cert, f.key)
    srv = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:  # shut down: the test is over
                return
            conn.settimeout(5)  # a handshake the client left half done does not hold the thread
            with contextlib.suppress(OSError):
                ctx.wrap_socket(conn, server_side=True).close()
            conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield srv.getsockname()[1]
    finally:
        srv.shutdown(socket.SHUT_RDWR)  # wakes the accept() (close() alone does not)
        srv.close()
        thread.join()


def _tls_kafka(ca: Path, port: int, **extra: str) -> KafkaSettings:
    return KafkaSettings(bootstrap_servers=f"127.0.0.1:{port}", security_protocol=SecurityProtocol.SSL,
                         ssl_ca_location=ca, extra=extra)


def test_the_certificate_check_the_kafka_settings_turn_off_is_not_given_as_the_reason(tmp_path: Path) -> None:
    """``[kafka.extra]``'s off switches are honoured: a host-name mismatch is no reason when the host-name check is
    off, an expired certificate none when verification is off; with them on, each is the reason given."""
    other_host = make_tls_files(tmp_path, "other-host", hosts=("kafka-1.internal",))
    expired = make_tls_files(tmp_path, "expired", hosts=("127.0.0.1",), valid_days=(-3, -1))
    with _tls_server(other_host) as port:
        on = _tls_kafka(other_host.ca, port)
        assert "its names: kafka-1.internal" in (certificate_refusal(tls_context(on), "127.0.0.1", port, 3) or "")
        off = _tls_kafka(other_host.ca, port, **{"ssl.endpoint.identification.algorithm": "none"})
        assert certificate_refusal(tls_context(off), "127.0.0.1", port, 3) is None
    with _tls_server(expired) as port:
        on = _tls_kafka(expired.ca, port)
        assert "certificate has expired" in (certificate_refusal(tls_context(on), "127.0.0.1", port, 3) or "")
        off = _tls_kafka(expired.ca, port, **{"enable.ssl.certificate.verification": "false"})
        assert certificate_refusal(tls_context(off), "127.0.0.1", port, 3) is None


def test_an_untrusted_ca_a_good_certificate_or_no_tls_server_gives_no_reason(tmp_path: Path) -> None:
    """Only a host-name mismatch or validity dates are named: anything else keeps the caller's own advice."""
    good = make_tls_files(tmp_path, "good", hosts=("127.0.0.1",))
    stranger = make_tls_files(tmp_path, "stranger")
    with _tls_server(good) as port:
        assert certificate_refusal(ssl.create_default_context(cafile=good.ca), "127.0.0.1", port, 3) is None
        assert certificate_refusal(ssl.create_default_context(cafile=stranger.ca), "127.0.0.1", port, 3) is None
    with socket.create_server(("127.0.0.1", 0)) as closed:
        port = closed.getsockname()[1]
    assert certificate_refusal(ssl.create_default_context(cafile=good.ca), "127.0.0.1", port, 3) is None


def test_the_certificates_names_and_dates_are_read_in_both_der_time_forms(tmp_path: Path) -> None:
    """UTCTime until 2049, GeneralizedTime from 2050 (RFC 5280 4.1.2.5): both read as dates, with the names."""
    for name, days in (("short", (-1.0, 1.0)), ("long", (-1.0, 40 * 366.0))):
        f = make_tls_files(tmp_path, name, hosts=("kafka-1.internal", "10.9.8.7", "::1"), valid_days=days)
        der = ssl.PEM_cert_to_DER_cert(f.cert.read_text())
        names, dates = _certificate_facts(der)
        assert names == ["kafka-1.internal", "10.9.8.7", "::1"]
        cert = ssl._ssl._test_decode_cert(str(f.cert))  # type: ignore[attr-defined]  # CPython's own reading
        expect = [datetime.datetime.strptime(cert[k], "%b %d %H:%M:%S %Y %Z") for k in ("notBefore", "notAfter")]
        assert dates == tuple(d.strftime("%Y-%m-%d %H:%M:%S") for d in expect)


def test_a_certificate_of_a_thousand_names_shows_eight_and_how_many_more(tmp_path: Path) -> None:
    """A certificate may hold thousands of names: the reason shows the first 8, then how many more, not a flood."""
    hosts = tuple(f"host-{i:04d}.internal" for i in range(1000))
    f = make_tls_files(tmp_path, "many", hosts=hosts)
    with _tls_server(f) as port:
        reason = certificate_refusal(ssl.create_default_context(cafile=f.ca), "127.0.0.1", port, 3) or ""
    assert f"(its names: {', '.join(hosts[:8])} and 992 more)" in reason, reason
    assert hosts[8] not in reason
    assert len(reason) < 1000


def test_a_certificate_name_holding_a_newline_is_shown_escaped_not_as_a_second_line(tmp_path: Path) -> None:
    """A name is the server's text: a newline (or any control character) in it is shown as its escape, so it cannot
    forge a log line."""
    f = make_tls_files(tmp_path, "odd", hosts=("redis.internal\nERROR forged line", "evil\x1b[31m.internal"))
    with _tls_server(f) as port:
        reason = certificate_refusal(ssl.create_default_context(cafile=f.ca), "127.0.0.1", port, 3) or ""
    assert r"(its names: redis.internal\nERROR forged line, evil\x1b[31m.internal)" in reason, reason
    assert reason.isprintable()
