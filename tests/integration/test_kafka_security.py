"""Kafka security end to end: ``[kafka]`` security settings reach every confluent-kafka client (the one builder,
``stream/kafka.py``) and faust (``stream/joiner/worker.py``), and the streamrec commands work over TLS + SASL and
fail with one clear line, quickly, when the credentials or the protocol are wrong.

The broker is the real local Tansu 0.6.0. It cannot itself authenticate a client or serve TLS (two xfail tests
below reproduce exactly that, see ``tests/secure_kafka.py``), so the positive paths run through
``tests.secure_kafka``'s gateway: TLS termination (optionally requiring a client certificate) and the SASL
exchange (SCRAM-SHA-256, SCRAM-SHA-512, PLAIN) in front of a plain Tansu that does everything else. The
failure paths run against the gateway and against Tansu's own ``--authentication``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest
from confluent_kafka import KafkaException

from stream.config import KafkaSettings, SaslMechanism, SecurityProtocol
from stream.errors import ConfigError
from stream.kafka import admin_config, consumer_config, producer_config
from stream.kafka_access import KafkaAccessError, check_access
from stream.kafka_producer import AckedProducer
from stream.kafka_topics import ensure_topics
from stream.secrets import Secret
from streamrec.settings import build
from streamrec.stack import LocalStack, free_port
from tests.bounded_teardown import Reaper, kill_and_reap
from tests.kafka_io import read_topic
from tests.secure_kafka import (
    SecureKafka,
    TlsFiles,
    create_tansu_user,
    make_tls,
    secure_kafka,
    start_tansu,
    stop,
    tls_listener,
)
from tests.secure_redis import make_tls_files

USER, PASSWORD = "streamrec", "s3cret-password-for-tests"
MECHANISMS = ("SCRAM-SHA-512", "SCRAM-SHA-256", "PLAIN")
CLI_TIMEOUT_S = 120


# -- fixtures -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> TlsFiles:
    return make_tls(tmp_path_factory.mktemp("tls"))


@pytest.fixture(scope="module")
def sasl_ssl(tls: TlsFiles, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecureKafka]:
    """TLS + SASL (SCRAM-SHA-512, SCRAM-SHA-256, PLAIN): the compose deployment's listener."""
    with secure_kafka(tmp_path_factory.mktemp("sasl-ssl"), tls=tls, users={USER: PASSWORD},
                      mechanisms=MECHANISMS) as sk:
        yield sk


@pytest.fixture(scope="module")
def auth_tansu(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Tansu's own ``--authentication`` (which, in this build, no client can pass: see the xfail test)."""
    port = free_port()
    proc = start_tansu(tmp_path_factory.mktemp("auth-tansu") / "tansu.log", port, authentication=True)
    try:
        yield f"127.0.0.1:{port}"
    finally:
        stop(proc)


def topics(kafka: KafkaSettings) -> KafkaSettings:
    tag = uuid.uuid4().hex[:8]
    return dataclasses.replace(kafka, impressions_topic=f"imp-{tag}", clicks_topic=f"clk-{tag}",
                               samples_topic=f"smp-{tag}", client_id=f"sec-{tag}")


def secured(bootstrap: str, tls: TlsFiles, mechanism: str = "SCRAM-SHA-512", password: str = PASSWORD,
            protocol: str = "SASL_SSL") -> KafkaSettings:
    return topics(KafkaSettings(bootstrap_servers=bootstrap, security_protocol=SecurityProtocol(protocol),
                                sasl_mechanism=SaslMechanism(mechanism), sasl_username=USER,
                                sasl_password=Secret(password),
                                ssl_ca_location=tls.ca if protocol.endswith("SSL") else None))


def roundtrip(kafka: KafkaSettings, n: int = 20) -> None:
    """Produce ``n`` records through the builder's producer and read them back through its consumer."""
    ensure_topics(kafka, [kafka.impressions_topic], partitions=2)
    p = AckedProducer(kafka)
    for i in range(n):
        p.send(kafka.impressions_topic, f"v{i}".encode(), f"k{i}")
    assert p.flush(20).acked == {kafka.impressions_topic: n}
    got = read_topic(kafka, kafka.impressions_topic, timeout_s=20)
    assert sorted(r.value or b"" for r in got) == sorted(f"v{i}".encode() for i in range(n))


# -- settings and the builder (no broker) ---------------------------------------------------------
def test_settings_validate_security_and_name_the_setting(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"\[kafka\] sasl_password is empty"):
        KafkaSettings(security_protocol=SecurityProtocol.SASL_SSL, sasl_username="u")
    with pytest.raises(ConfigError, match=r"\[kafka\] sasl_username is empty"):
        KafkaSettings(security_protocol=SecurityProtocol.SASL_PLAINTEXT, sasl_password=Secret("pw123456"))
    with pytest.raises(ConfigError, match=r"security_protocol: got 'TLS'"):
        KafkaSettings(security_protocol="TLS")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"sasl_mechanism: got 'GSSAPI'"):
        KafkaSettings(sasl_mechanism="GSSAPI")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="ssl_certificate_location is set without ssl_key_location"):
        KafkaSettings(security_protocol=SecurityProtocol.SSL, ssl_certificate_location=tmp_path / "c.pem")
    with pytest.raises(ConfigError, match="ssl_ca_location set but security_protocol = PLAINTEXT"):
        KafkaSettings(ssl_ca_location=tmp_path / "ca.pem")
    with pytest.raises(ConfigError, match="used only with SASL_PLAINTEXT or SASL_SSL"):
        KafkaSettings(security_protocol=SecurityProtocol.SSL, sasl_username="u", sasl_password=Secret("pw123456"))
    with pytest.raises(ConfigError, match=r"OAUTHBEARER needs its configuration in \[kafka.extra\]"):
        KafkaSettings(security_protocol=SecurityProtocol.SASL_SSL, sasl_mechanism=SaslMechanism.OAUTHBEARER)
    oauth = KafkaSettings(security_protocol=SecurityProtocol.SASL_SSL, sasl_mechanism=SaslMechanism.OAUTHBEARER,
                          extra={"sasl.oauthbearer.method": "oidc"})
    hash(oauth)  # frozen settings stay hashable with a table field


def test_the_loader_reads_the_password_file_and_the_extra_table_and_the_builder_applies_them(tmp_path: Path) -> None:
    pw = tmp_path / "kafka_password"
    pw.write_text(PASSWORD + "\n")
    ca = tmp_path / "ca.pem"
    ca.write_text("not checked until a client is built")
    data = {"kafka": {"bootstrap_servers": "127.0.0.1:1", "security_protocol": "SASL_SSL",
                      "sasl_mechanism": "SCRAM-SHA-512", "sasl_username": USER, "sasl_password_file": str(pw),
                      "ssl_ca_location": str(ca), "extra": {"ssl.endpoint.identification.algorithm": "none"}}}
    k = build(KafkaSettings, "kafka", data, {"STREAMREC_KAFKA_EXTRA": "socket.keepalive.enable=true"})
    assert k.sasl_password.reveal() == PASSWORD and str(k.sasl_password) == "***" and PASSWORD not in repr(k)
    assert k.extra == {"socket.keepalive.enable": "true"}  # the environment overrides the file's table
    del data["kafka"]["sasl_password_file"]
    k = build(KafkaSettings, "kafka", data, {"STREAMREC_KAFKA_SASL_PASSWORD_ENV": "KPW", "KPW": "from-env-123"})
    assert k.sasl_password.reveal() == "from-env-123"
    with pytest.raises(ConfigError, match=r"\[kafka\] sasl_password is empty"):  # SASL without any password
        build(KafkaSettings, "kafka", data, {})


@pytest.mark.parametrize("builder", [producer_config, admin_config,
                                     lambda k: consumer_config(k, "g", **{"enable.partition.eof": False})])
def test_every_client_config_gets_the_security_settings_and_extra_last(builder, tls: TlsFiles) -> None:
    ca = tls.ca
    k = KafkaSettings(bootstrap_servers=f"127.0.0.1:{free_port()}",  # nothing listens: the access check passes
                      security_protocol=SecurityProtocol.SASL_SSL, sasl_mechanism=SaslMechanism.SCRAM_SHA_256,
                      sasl_username=USER, sasl_password=Secret(PASSWORD), ssl_ca_location=ca,
                      extra={"client.id": "from-extra", "ssl.endpoint.identification.algorithm": "none"})
    conf = builder(k)
    assert (conf["security.protocol"], conf["sasl.mechanism"], conf["sasl.username"], conf["sasl.password"],
            conf["ssl.ca.location"]) == ("SASL_SSL", "SCRAM-SHA-256", USER, PASSWORD, str(ca))
    assert conf["client.id"] == "from-extra" and conf["ssl.endpoint.identification.algorithm"] == "none"
    assert producer_config(KafkaSettings())["security.protocol"] == "PLAINTEXT"


def test_a_missing_or_unusable_tls_file_is_a_config_error_when_a_client_is_built(tmp_path: Path) -> None:
    k = KafkaSettings(security_protocol=SecurityProtocol.SSL, ssl_ca_location=tmp_path / "nope.pem")
    with pytest.raises(ConfigError, match=r"\[kafka\] ssl_ca_location: .*nope.pem does not exist"):
        producer_config(k)
    (tmp_path / "nope.pem").write_text("not a certificate")
    with pytest.raises(ConfigError, match=r"a security setting cannot be used: .*ssl.ca.location"):
        producer_config(k)


@pytest.mark.parametrize("extra, says", [
    ({"ssl.endpoint.identification.algorithm": "none"}, "whatever host it names"),
    ({"enable.ssl.certificate.verification": "False"}, "any certificate is accepted"),
])
def test_kafka_extra_turning_off_the_certificate_check_is_warned_once(
        extra: dict[str, str], says: str, tls: TlsFiles, caplog: pytest.LogCaptureFixture) -> None:
    k = KafkaSettings(bootstrap_servers=f"127.0.0.1:{free_port()}",  # nothing listens: the access check passes
                      security_protocol=SecurityProtocol.SSL, ssl_ca_location=tls.ca,
                      extra={**extra, "client.id": uuid.uuid4().hex})  # settings this process has not checked
    with caplog.at_level("WARNING", logger="streamrec.kafka"):
        producer_config(k)
        admin_config(k)
    warned = [r.getMessage() for r in caplog.records if "turns off the check" in r.getMessage()]
    assert len(warned) == 1 and says in warned[0] and k.bootstrap_servers in warned[0], caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="streamrec.kafka"):  # the same properties over PLAINTEXT: no TLS, no check
        plain = KafkaSettings(bootstrap_servers=k.bootstrap_servers, extra={**extra, "client.id": uuid.uuid4().hex})
        admin_config(plain)
        admin_config(dataclasses.replace(k, extra={"client.id": uuid.uuid4().hex}))  # TLS fully checked
    assert "turns off the check" not in caplog.text


# -- the builder's clients against the secured broker ---------------------------------------------
@pytest.mark.parametrize("mechanism", MECHANISMS)
def test_produce_and_consume_over_sasl_ssl(sasl_ssl: SecureKafka, tls: TlsFiles, mechanism: str) -> None:
    roundtrip(secured(sasl_ssl.bootstrap_servers, tls, mechanism))


def test_sasl_plaintext_scram_sha_256(tls: TlsFiles, tmp_path: Path) -> None:
    with secure_kafka(tmp_path, users={USER: PASSWORD}, mechanisms=("SCRAM-SHA-256",)) as sk:
        k = secured(sk.bootstrap_servers, tls, "SCRAM-SHA-256", protocol="SASL_PLAINTEXT")
        roundtrip(k)


def test_mutual_tls_with_an_encrypted_client_key_for_confluent_and_faust(tls: TlsFiles, tmp_path: Path) -> None:
    from faust.transport.drivers.aiokafka import credentials_to_aiokafka_auth

    from stream.joiner.worker import broker_credentials

    with secure_kafka(tmp_path, tls=tls, require_client_cert=True) as sk:
        k = topics(KafkaSettings(bootstrap_servers=sk.bootstrap_servers, security_protocol=SecurityProtocol.SSL,
                                 ssl_ca_location=tls.ca, ssl_certificate_location=tls.client_cert,
                                 ssl_key_location=tls.client_key,
                                 ssl_key_password=Secret(tls.client_key_password)))
        roundtrip(k)

        async def faust_side() -> list[bytes]:  # faust's credentials, through aiokafka as faust hands them over
            import aiokafka

            auth = credentials_to_aiokafka_auth(broker_credentials(k))
            producer = aiokafka.AIOKafkaProducer(bootstrap_servers=k.bootstrap_servers, **auth)
            await producer.start()
            try:
                await producer.send_and_wait(k.impressions_topic, b"from-faust", partition=0)
            finally:
                await producer.stop()
            return [r.value for r in read_topic(k, k.impressions_topic) if r.value == b"from-faust"]

        assert asyncio.run(faust_side()) == [b"from-faust"]
        # without the client certificate the broker refuses the handshake: one clear error
        no_cert = dataclasses.replace(k, ssl_certificate_location=None, ssl_key_location=None,
                                      ssl_key_password=Secret(""), client_id="no-cert")
        with pytest.raises(KafkaAccessError, match="does it require a client certificate"):
            check_access(no_cert)


def test_faust_credentials_map_the_settings_and_refuse_oauthbearer(tls: TlsFiles) -> None:
    import faust

    from stream.joiner.worker import broker_credentials

    k = secured("127.0.0.1:1", tls, "SCRAM-SHA-256")
    cred = broker_credentials(k)
    assert isinstance(cred, faust.SASLCredentials) and cred.mechanism.value == "SCRAM-SHA-256"
    assert cred.protocol.value == "SASL_SSL" and cred.ssl_context is not None and cred.password == PASSWORD
    assert broker_credentials(dataclasses.replace(k, security_protocol=SecurityProtocol.PLAINTEXT, sasl_username="",
                                                  sasl_password=Secret(""), ssl_ca_location=None)) is None
    oauth = KafkaSettings(security_protocol=SecurityProtocol.SASL_SSL, sasl_mechanism=SaslMechanism.OAUTHBEARER,
                          extra={"sasl.oauthbearer.method": "oidc"})
    with pytest.raises(ConfigError, match="--driver kafka"):
        broker_credentials(oauth)


# -- failures: one clear error, quickly -----------------------------------------------------------
def test_wrong_password_untrusted_ca_and_wrong_protocol_fail_at_once_with_the_cause(
        sasl_ssl: SecureKafka, tls: TlsFiles) -> None:
    cases = [
        (secured(sasl_ssl.bootstrap_servers, tls, password="wrong-password"), "invalid credentials.*sasl_password"),
        (dataclasses.replace(secured(sasl_ssl.bootstrap_servers, tls), ssl_ca_location=tls.other_ca),
         "certificate verify failed.*ssl_ca_location"),
        (topics(KafkaSettings(bootstrap_servers=sasl_ssl.bootstrap_servers)), "the listener speaks TLS"),
    ]
    for k, message in cases:
        start = time.monotonic()
        with pytest.raises(KafkaAccessError, match=message):
            AckedProducer(k)
        assert time.monotonic() - start < 5


@pytest.mark.parametrize(("hosts", "valid_days", "reason"), [
    (("kafka-1.internal", "10.9.8.7"), (-5 / 1440, 1),
     r"certificate does not name 127\.0\.0\.1 \(IP address mismatch.*connect by a host name the certificate lists "
     r"\(its names: kafka-1\.internal, 10\.9\.8\.7\) or reissue it"),
    (("127.0.0.1",), (-3, -1),
     r"out of date \(certificate has expired\): renew it \(valid from \d{4}-\d\d-\d\d [\d:]+ to [\d: -]+ UTC\) "
     r"and check the clocks"),
    (("127.0.0.1",), (1, 3), r"out of date \(certificate is not yet valid\): renew it \(valid from .* UTC\) and check "
                             r"the clocks"),
], ids=["names-another-host", "expired", "not-yet-valid"])
def test_a_broker_certificate_for_another_host_or_out_of_date_is_said_so_instead_of_blaming_the_ca(
        tmp_path: Path, hosts: tuple[str, ...], valid_days: tuple[float, float], reason: str) -> None:
    """The CA file is right here: the access check's error names the certificate's own fault and its fix (the TLS
    listener is the suite's gateway, alone: the handshake fails before any broker would be reached)."""
    files = make_tls_files(tmp_path / "tls", "broker", hosts, valid_days)
    with tls_listener(tmp_path / "gw", files.cert, files.key) as bootstrap:
        k = topics(KafkaSettings(bootstrap_servers=bootstrap, security_protocol=SecurityProtocol.SSL,
                                 ssl_ca_location=files.ca))
        with pytest.raises(KafkaAccessError, match=reason) as refused:
            check_access(k)
    said = str(refused.value)
    assert "certificate verify failed; the server's certificate" in said
    assert "ssl_ca_location" not in said and "ssl.ca.location" not in said  # the misdirection this replaces


def cli(args: list[str], config: Path, extra_env: dict[str, str] | None = None,
        timeout_s: float = CLI_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("STREAMREC_")}
    env.update(extra_env or {})
    return subprocess.run([sys.executable, "-m", "streamrec.cli", *args, "--config", str(config)], env=env,
                          capture_output=True, text=True, timeout=timeout_s)


def write_config(path: Path, kafka: KafkaSettings, redis_url: str, *, password_file: Path | None = None,
                 **sections: Mapping[str, object]) -> Path:
    """A TOML ``--config`` file with ``kafka``'s connection and security settings (the password as a file)."""
    def q(v: object) -> str:
        return json.dumps(str(v))

    lines = ["[kafka]"]
    for name in ("bootstrap_servers", "impressions_topic", "clicks_topic", "samples_topic", "client_id"):
        lines.append(f"{name} = {q(getattr(kafka, name))}")
    lines.append(f"security_protocol = {q(kafka.security_protocol)}")
    if kafka.security_protocol.sasl:
        lines += [f"sasl_mechanism = {q(kafka.sasl_mechanism)}", f"sasl_username = {q(kafka.sasl_username)}"]
        if password_file is not None:
            password_file.touch(mode=0o600)  # as a secret is mounted: a file others read is warned of
            password_file.write_text(kafka.sasl_password.reveal() + "\n")
            lines.append(f"sasl_password_file = {q(password_file)}")
    if kafka.ssl_ca_location is not None:
        lines.append(f"ssl_ca_location = {q(kafka.ssl_ca_location)}")
    lines += ["", "[redis]", f"url = {q(redis_url)}", f"prefix = {q(kafka.client_id)}"]
    for section, values in sections.items():
        lines += ["", f"[{section}]"] + [f"{k} = {json.dumps(v)}" for k, v in values.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


SYNTHETIC = {"impressions": 300, "users": 150, "items": 60, "impressions_per_s": 50.0, "malformed_share": 0.0,
             "attribution_window_s": 60.0}
LEARNER = {"buckets": 5000, "ctx_buckets": 500, "mlp": [32], "checkpoint_every_s": 600.0}


def join_args(app_id: str, driver: str) -> list[str]:
    return ["join", "--app-id", app_id, "--driver", driver, "--window-s", "60", "--lateness-s", "0",
            "--exit-when-idle", "3", "--drain", "--json"]


def last_json(out: subprocess.CompletedProcess[str]) -> dict:
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_replay_audit_join_with_both_drivers_and_train_over_sasl_ssl(sasl_ssl: SecureKafka, tls: TlsFiles,
                                                                       stack: LocalStack, tmp_path: Path,
                                                                       reaper: Reaper) -> None:
    k = secured(sasl_ssl.bootstrap_servers, tls)
    cfg = write_config(tmp_path / "secure.toml", k, stack.redis_url, password_file=tmp_path / "kafka_password",
                       synthetic=SYNTHETIC, learner={**LEARNER, "group_id": f"learner-{k.client_id}"})
    replay = last_json(cli(["replay", "--dataset", "synthetic", "--no-progress", "--json"], cfg))
    assert replay["impressions"] == SYNTHETIC["impressions"] and replay["clicks"] > 0
    audit = last_json(cli(["audit", "--group", f"audit-{k.client_id}", "--idle-timeout", "20", "--json"], cfg))
    assert audit["valid"] == {k.impressions_topic: replay["impressions"], k.clicks_topic: replay["clicks"]}

    # both drivers at once, each into its own samples topic (and Redis prefix)
    procs = {}
    for driver in ("kafka", "faust"):
        env = {"STREAMREC_KAFKA_SAMPLES_TOPIC": f"{k.samples_topic}-{driver}",
               "STREAMREC_JOINER_LATE_CLICKS_TOPIC": f"late-{k.client_id}-{driver}",
               "STREAMREC_REDIS_PREFIX": f"{k.client_id}-{driver}"}
        procs[driver] = reaper.add(subprocess.Popen(
            [sys.executable, "-m", "streamrec.cli", *join_args(f"join-{driver}-{k.client_id}", driver), "--config",
             str(cfg)], env={**{x: y for x, y in os.environ.items() if not x.startswith("STREAMREC_")}, **env},
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))  # both killed if either fails
    for driver, proc in procs.items():
        try:
            out, err = proc.communicate(timeout=CLI_TIMEOUT_S)
        finally:
            kill_and_reap(proc)
        assert proc.returncode == 0, f"{driver}: {err[-3000:]}"
        summary = json.loads(out.strip().splitlines()[-1])
        # one sample per impression, plus one per click joined after its observed 0 (fake_negative, the default)
        assert summary["samples"] - summary["delayed_positives"] == SYNTHETIC["impressions"], (driver, summary)
        assert summary["driver"] == driver

    train = last_json(cli(["train", "--checkpoint-dir", str(tmp_path / "ckpt"), "--batch-rows", "64",
                           "--max-samples", "100", "--exit-when-idle", "5", "--json"], cfg,
                          {"STREAMREC_KAFKA_SAMPLES_TOPIC": f"{k.samples_topic}-kafka"}))
    assert train["samples_trained"] >= 100


COMMANDS = {
    "replay": ["replay", "--dataset", "synthetic", "--no-progress"],
    "audit": ["audit", "--idle-timeout", "5"],
    "join-kafka": join_args("denied", "kafka"),
    "join-faust": join_args("denied", "faust"),
    "train": ["train", "--max-samples", "10", "--exit-when-idle", "3"],
}


def assert_one_clear_line(out: subprocess.CompletedProcess[str], command: str, *needles: str) -> None:
    lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
    assert out.returncode == 1, out.stderr[-3000:]
    assert len(lines) == 1, out.stderr[-3000:]
    assert lines[0].startswith(f"streamrec {command.split('-')[0]}: error: Kafka at "), lines[0]
    for needle in needles:
        assert needle in lines[0], lines[0]
    assert PASSWORD not in out.stderr and "wrong-password" not in out.stderr


@pytest.mark.parametrize("command", list(COMMANDS))
def test_every_command_with_a_wrong_password_fails_with_one_clear_line(
        command: str, sasl_ssl: SecureKafka, tls: TlsFiles, stack: LocalStack, tmp_path: Path) -> None:
    k = secured(sasl_ssl.bootstrap_servers, tls, password="wrong-password")
    cfg = write_config(tmp_path / "wrong.toml", k, stack.redis_url, password_file=tmp_path / "pw",
                       synthetic={**SYNTHETIC, "impressions": 20}, learner=LEARNER)
    args = COMMANDS[command] + (["--checkpoint-dir", str(tmp_path / "ckpt")] if command == "train" else [])
    start = time.monotonic()
    out = cli(args, cfg, timeout_s=60)
    assert_one_clear_line(out, command, "refused the connection", "invalid credentials", "sasl_password")
    assert time.monotonic() - start < 30


@pytest.mark.parametrize("command", list(COMMANDS))
def test_every_command_without_credentials_against_tansu_authentication_fails_with_one_clear_line(
        command: str, auth_tansu: str, stack: LocalStack, tmp_path: Path) -> None:
    k = topics(KafkaSettings(bootstrap_servers=auth_tansu))
    cfg = write_config(tmp_path / "plain.toml", k, stack.redis_url, synthetic={**SYNTHETIC, "impressions": 20},
                       learner=LEARNER)
    args = COMMANDS[command] + (["--checkpoint-dir", str(tmp_path / "ckpt")] if command == "train" else [])
    start = time.monotonic()
    out = cli(args, cfg, timeout_s=60)
    assert_one_clear_line(out, command, "requires SASL authentication", "security_protocol = SASL_PLAINTEXT")
    assert time.monotonic() - start < 30


def test_a_wrong_password_against_tansu_authentication_is_refused_at_once(auth_tansu: str) -> None:
    k = topics(KafkaSettings(bootstrap_servers=auth_tansu, security_protocol=SecurityProtocol.SASL_PLAINTEXT,
                             sasl_mechanism=SaslMechanism.SCRAM_SHA_512, sasl_username=USER,
                             sasl_password=Secret("wrong-password")))
    start = time.monotonic()
    with pytest.raises(KafkaAccessError, match="SASL SCRAM authentication failed"):
        AckedProducer(k)
    assert time.monotonic() - start < 5


# -- what Tansu 0.6.0 itself cannot do (minimal reproductions; see tests/secure_kafka.py) ----------
@pytest.mark.xfail(strict=True, raises=KafkaAccessError,
                   reason="Tansu 0.6.0's only storage engine (dynostore: memory://, s3://) stores no SCRAM "
                   "credentials: `tansu user create` succeeds as a no-op and every SCRAM login then fails with "
                   "unknown-user (dynostore.rs upsert_user_scram_credential / user_scram_credential at v0.6.0)")
def test_tansu_authenticates_the_scram_users_it_created(tmp_path: Path) -> None:
    """The way users would be made: `tansu user create` through a broker without --authentication (on the
    authenticating one the request itself is refused, NotAuthenticated), both brokers on one s3:// storage (a
    local moto server), then a SCRAM login on the authenticating broker."""
    import boto3

    s3_port, plain_port, auth_port = free_port(), free_port(), free_port()
    moto = subprocess.Popen([sys.executable, "-m", "moto.server", "-p", str(s3_port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        from tests.secure_kafka import wait_port

        wait_port(s3_port, moto)
        endpoint = f"http://127.0.0.1:{s3_port}"
        boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="test", aws_secret_access_key="test",
                     region_name="us-east-1").create_bucket(Bucket="tansu")
        env = {"AWS_ENDPOINT": endpoint, "AWS_ALLOW_HTTP": "true", "AWS_ACCESS_KEY_ID": "test",
               "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1"}
        procs.append(start_tansu(tmp_path / "plain.log", plain_port, env=env, storage="s3://tansu/"))
        procs.append(start_tansu(tmp_path / "auth.log", auth_port, env=env, storage="s3://tansu/",
                                 authentication=True))
        assert create_tansu_user(auth_port, USER, PASSWORD).returncode != 0  # NotAuthenticated
        refused: list[str] = []
        for mechanism in ("SCRAM-SHA-256", "SCRAM-SHA-512"):
            created = create_tansu_user(plain_port, USER, PASSWORD, "scram" + mechanism[-3:])
            assert created.returncode == 0, created.stderr
            try:
                check_access(topics(KafkaSettings(bootstrap_servers=f"127.0.0.1:{auth_port}",
                                                  security_protocol=SecurityProtocol.SASL_PLAINTEXT,
                                                  sasl_mechanism=SaslMechanism(mechanism), sasl_username=USER,
                                                  sasl_password=Secret(PASSWORD))))
            except KafkaAccessError as exc:  # unknown-user, for each mechanism
                refused.append(str(exc))
        if refused:
            raise KafkaAccessError(" | ".join(refused))
    finally:
        for proc in procs:
            stop(proc)
        moto.terminate()
        moto.wait(timeout=20)


@pytest.mark.xfail(strict=True, raises=KafkaException,
                   reason="Tansu 0.6.0 cannot serve TLS: --cert and --key are in one clap group "
                   "(mutually exclusive) while TLS is configured only when both are given; --cert alone serves "
                   "PLAINTEXT")
def test_tansu_serves_tls_itself(tls: TlsFiles, tmp_path: Path) -> None:
    from tests.secure_kafka import tansu_args

    both = subprocess.run(tansu_args(free_port(), cert=tls.server_cert, key=tls.server_key), capture_output=True,
                          text=True, timeout=10)
    assert "cannot be used with" in both.stderr and both.returncode != 0
    port = free_port()
    proc = start_tansu(tmp_path / "tansu.log", port, cert=tls.server_cert)  # --cert alone: starts, PLAINTEXT
    try:
        k = topics(KafkaSettings(bootstrap_servers=f"127.0.0.1:{port}", security_protocol=SecurityProtocol.SSL,
                                 ssl_ca_location=tls.ca))
        from confluent_kafka.admin import AdminClient

        # Tansu reads the TLS ClientHello as a Kafka frame and waits: no metadata ever comes (KafkaException)
        AdminClient(admin_config(k)).list_topics(timeout=1)
    finally:
        stop(proc)
