"""Credentials are never printed (stream/secrets.py) and the loader reads them from a file or a named
environment variable (streamrec/settings.py)."""

from __future__ import annotations

import io
import json
import logging
import pickle
from dataclasses import dataclass
from pathlib import Path

import pytest

from stream.config import KafkaSettings, RedisSettings
from stream.secrets import MASK, RedactingFilter, Secret, redact, redact_obj, register
from streamrec.settings import SettingsError, build


def test_a_secret_prints_masked_everywhere_but_reveals_for_the_client() -> None:
    s = Secret("s3cr3t-value")
    assert (str(s), f"{s}", f"{s:>5}") == (MASK, MASK, "  ***") and "s3cr3t" not in repr(s)
    assert s.reveal() == "s3cr3t-value" and s == "s3cr3t-value" and not Secret("")
    assert pickle.loads(pickle.dumps(s)) == ""  # pickled (into a checkpoint, say): the value stays behind


@pytest.mark.parametrize("text, leaked", [
    ("Error 111 connecting to redis://alice:pa55word@10.0.0.1:6379/0", "pa55word"),
    ("rediss://:onlypass@host:6380", "onlypass"),
    ("kafka: sasl.password=hunter22 sasl.username=bob", "hunter22"),
    ('{"password": "quoted-pw", "user": "x"}', "quoted-pw"),
    ("webhook https://hooks.example/x?token=tok123&a=1", "tok123"),
])
def test_redact_scrubs_url_passwords_and_credential_pairs(text: str, leaked: str) -> None:
    out = redact(text)
    assert leaked not in out and MASK in out


@pytest.mark.parametrize("url, secret", [
    ("redis://:p@ssW0rdXYZ@127.0.0.1:1/0", "ssW0rdXYZ"),  # '@' in the password: mask to the LAST '@'
    ("redis://:sec/ret9PW@127.0.0.1:1/0", "ret9PW"),  # '/' in it: urlsplit fails, the error quotes it
    ("rediss://alice:a:b:cQ9@h:6380/2", "cQ9"),
    ("redis://:pc%40t%2Fz7@h/0", "pc%40t%2Fz7"),
    ("kafka://bob:x@y/z:w8K@broker:9092", "w8K"),
    ("SASL_SSL://svc:s3@cr/et@broker:9093", "cr/et"),
    ("https://tok:qq@zz11@hooks.example/x", "zz11"),
    ("http://onlytokenABC@hooks.example/x", "onlytokenABC"),
])
def test_redact_masks_the_whole_userinfo_up_to_the_last_at(url: str, secret: str) -> None:
    host = url.rpartition("@")[2]
    for text in (f"error: Redis at {url} cannot be reached", f"cannot parse '{url}': bad port", f'{{"url": "{url}"}}'):
        out = redact(text)
        assert secret not in out and f"://{MASK}@{host}" in out, out


@pytest.mark.parametrize("text", [
    "Redis at redis://127.0.0.1:1/0 cannot be reached",
    "kafka at kafka://broker:9092/topic and http://h:8080/metrics?x=1",
    "see https://example.com/a/b and mail ops@example.com",
])
def test_redact_leaves_urls_without_userinfo_unchanged(text: str) -> None:
    assert redact(text) == text


def test_a_registered_secret_is_scrubbed_from_free_text_and_nested_summaries() -> None:
    register("free-floating-key-42")
    assert redact("failed with free-floating-key-42 in the message") == f"failed with {MASK} in the message"
    summary = {"redis": {"url": "redis://u:pw1234@h/0"}, "settings": {"sasl_password": "abcdef",
               "sasl_password_file": "/run/secrets/kafka", "note": ["free-floating-key-42"]}, "samples": 12}
    out = redact_obj(summary)
    text = json.dumps(out)
    assert "pw1234" not in text and "abcdef" not in text and "free-floating-key-42" not in text
    assert out["settings"]["sasl_password_file"] == "/run/secrets/kafka" and out["samples"] == 12


def test_log_records_are_scrubbed_before_a_handler_writes_them() -> None:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.addFilter(RedactingFilter())
    log = logging.getLogger("test.secrets")
    log.addHandler(handler)
    try:
        log.warning("cannot reach %s", "redis://u:logpw99@h:1/0")
        try:
            raise ConnectionError("auth failed for password=logpw77")
        except ConnectionError:
            log.exception("history read failed")
    finally:
        log.removeHandler(handler)
    text = stream.getvalue()
    assert "logpw99" not in text and "logpw77" not in text and text.count(MASK) >= 2


@dataclass(frozen=True)
class _Creds:
    user: str = "app"
    password: Secret = Secret("")
    password_file: Path | None = None
    password_env: str | None = None


def test_the_loader_reads_a_secret_from_a_file_or_a_named_variable_and_never_both(tmp_path: Path) -> None:
    f = tmp_path / "pw"
    f.write_text("from-file-pw\n")
    got = build(_Creds, "creds", {"creds": {"password_file": str(f)}}, {})
    assert got.password.reveal() == "from-file-pw" and str(got.password) == MASK  # newline dropped
    got = build(_Creds, "creds", {}, {"STREAMREC_CREDS_PASSWORD_ENV": "MY_PW", "MY_PW": "from-env-pw"})
    assert got.password.reveal() == "from-env-pw"
    assert build(_Creds, "creds", {}, {"STREAMREC_CREDS_PASSWORD": "direct-pw"}).password.reveal() == "direct-pw"
    with pytest.raises(SettingsError, match="both set"):
        build(_Creds, "creds", {"creds": {"password_file": str(f), "password_env": "MY_PW"}}, {"MY_PW": "x"})
    with pytest.raises(SettingsError, match="MISSING_VAR, which is not set"):
        build(_Creds, "creds", {"creds": {"password_env": "MISSING_VAR"}}, {})
    with pytest.raises(SettingsError, match="cannot read"):
        build(_Creds, "creds", {"creds": {"password_file": str(tmp_path / "absent")}}, {})



@pytest.mark.parametrize("ending", ["\n", "\r\n", "\n\n"], ids=["LF", "CRLF", "two LF"])
def test_a_secret_from_a_variable_loses_its_trailing_line_ending_as_one_from_a_file_does(
        tmp_path: Path, ending: str) -> None:
    """``PW="$(printf 'pw\n')"`` or a Kubernetes secret mapped to a variable keeps the newline ``$(cat file)`` strips;
    the password then sent was ``pw\n``, while the same secret in a ``*_file`` was ``pw``. Spaces stay: a
    password may hold them."""
    f = tmp_path / "pw"
    f.write_text(f" p w {ending}")
    from_file = build(_Creds, "creds", {"creds": {"password_file": str(f)}}, {}).password.reveal()
    from_var = build(_Creds, "creds", {}, {"STREAMREC_CREDS_PASSWORD_ENV": "MY_PW", "MY_PW": f" p w {ending}"})
    direct = build(_Creds, "creds", {}, {"STREAMREC_CREDS_PASSWORD": f" p w {ending}"})
    assert from_file == from_var.password.reveal() == direct.password.reveal() == " p w "

def test_a_secret_file_saved_with_a_byte_order_mark_is_read_without_it(tmp_path: Path) -> None:
    """Notepad (and PowerShell's ``Out-File -Encoding utf8``) starts a UTF-8 file with U+FEFF: it was sent as the
    password's first character, a refused login with nothing to see in the file. Both readers drop it."""
    from stream.config import RedisSettings
    from stream.redis_client import _password as password

    f = tmp_path / "pw"
    f.write_bytes("\ufeffp w\r\n".encode())
    assert build(_Creds, "creds", {"creds": {"password_file": str(f)}}, {}).password.reveal() == "p w"
    assert password(RedisSettings(password_file=str(f))) == "p w"


@pytest.mark.parametrize("how", ["variable", "file key", "redis password_file"])
def test_a_secret_of_only_a_line_ending_is_refused_not_read_as_no_secret(tmp_path: Path, how: str) -> None:
    """Once line endings were stripped, ``STREAMREC_REDIS_PASSWORD=$'\n'`` (or a password file holding only a newline,
    read by the Redis client itself) became "no password" and logged in as the default user; ``password_env`` and
    ``*_file`` already refused an empty secret. Every way now refuses it, naming where it came from."""
    from stream.config import RedisSettings
    from stream.errors import ConfigError
    from stream.redis_client import _password as password

    f = tmp_path / "pw"
    f.write_text("\r\n")
    if how == "variable":
        with pytest.raises(SettingsError, match="STREAMREC_CREDS_PASSWORD.*only a line ending"):
            build(_Creds, "creds", {}, {"STREAMREC_CREDS_PASSWORD": "\n"})
    elif how == "file key":
        with pytest.raises(SettingsError, match="password.*only a line ending"):
            build(_Creds, "creds", {"creds": {"password": "\r\n"}}, {})
    else:
        with pytest.raises(ConfigError, match="password_file .* is empty"):
            password(RedisSettings(password_file=str(f)))


def test_the_names_of_secret_files_and_variables_are_not_masked() -> None:
    text = "[redis] password_file: cannot read /run/secrets/redis; sasl_password_env=KAFKA_PW, password=abc123"
    want = f"[redis] password_file: cannot read /run/secrets/redis; sasl_password_env=KAFKA_PW, password={MASK}"
    assert redact(text) == want


def test_an_unparseable_redis_url_quotes_no_part_of_its_password() -> None:
    from stream.config import RedisSettings
    from stream.errors import ConfigError

    with pytest.raises(ConfigError) as exc:
        RedisSettings(url="redis://:sec/ret9PW@127.0.0.1:1/0")
    assert "sec" not in str(exc.value) and "ret9PW" not in str(exc.value) and "redis://***@" in str(exc.value)
    with pytest.raises(ConfigError, match="Port could not be cast"):  # no user-info: the library's detail stays
        RedisSettings(url="redis://127.0.0.1:abc/0")


def refused_settings_stderr(toml: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                            capsys: pytest.CaptureFixture[str]) -> str:
    """What `streamrec train --status` says on stderr refusing the settings file ``toml`` (its status must be 2)."""
    from streamrec.cli import main

    monkeypatch.chdir(tmp_path)
    config = tmp_path / "streamrec.toml"
    config.write_text(toml)
    assert main(["train", "--status", "--config", str(config)]) == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("toml", [
    '[kafka]\nsasl_password = ["hunter22-in-an-array"]\n',
    '[kafka]\nssl_key_password = ["hunter22-in-an-array"]\n',
    '[redis]\npassword = { value = "hunter22-in-a-table" }\n',
    '[kafka.extra]\n"sasl.oauthbearer.client.secret" = ["hunter22-in-an-array"]\n',
])
def test_a_credential_of_the_wrong_shape_is_refused_without_quoting_it(
        toml: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    err = refused_settings_stderr(toml, tmp_path, monkeypatch, capsys)
    assert "hunter22" not in err and "(a credential, its value not shown): expected one value" in err


def test_malformed_key_value_pairs_holding_a_credential_are_not_quoted() -> None:
    raw = "sasl.oauthbearer.client.secret=hunter22 with spaces,broken"
    with pytest.raises(SettingsError) as err:
        build(KafkaSettings, "kafka", environ={"STREAMREC_KAFKA_EXTRA": raw})
    assert "hunter22" not in str(err.value) and "with spaces" not in str(err.value)
    assert "STREAMREC_KAFKA_EXTRA (a credential, its value not shown): expected key=value pairs" in str(err.value)
    with pytest.raises(SettingsError, match=r"cannot use 'client.id=x,broken': expected key=value pairs"):
        build(KafkaSettings, "kafka", environ={"STREAMREC_KAFKA_EXTRA": "client.id=x,broken"})


@pytest.mark.parametrize("key", ["ssl.key.pem", "sasl.oauthbearer.assertion.private.key.pem",
                                 "sasl.oauthbearer.assertion.private.key.passphrase"])
def test_an_inline_private_key_or_its_passphrase_in_kafka_extra_is_never_shown(key: str) -> None:
    # librdkafka's sensitive properties that name neither a password nor a secret: a malformed pair is not quoted,
    # the value is masked in summaries and scrubbed from free text (a library's message quoting it)
    with pytest.raises(SettingsError) as err:
        build(KafkaSettings, "kafka", environ={"STREAMREC_KAFKA_EXTRA": f"{key}=hunter22-inline,broken"})
    assert "hunter22" not in str(err.value) and "(a credential, its value not shown)" in str(err.value)
    value = f"-----BEGIN ENCRYPTED PRIVATE KEY----- {key}-hunter33"
    settings = KafkaSettings(extra={key: value})
    assert "hunter33" not in json.dumps(redact_obj({"extra": settings.extra}))
    assert "hunter33" not in redact(f"librdkafka: cannot use {value!r}") and "hunter44" not in redact(f"{key}=hunter44")


def test_sasl_oauthbearer_config_in_kafka_extra_is_a_credential_never_shown() -> None:
    # librdkafka's sensitive property (_RK_SENSITIVE): its extensions and an OAuth callback's settings (a client
    # secret, an AWS-style grammar) go there, and librdkafka quotes it ("Unrecognized sasl.oauthbearer.config beginning
    # at: ..."); named by no credential word, it was printed in settings' repr, summaries and a malformed pair's error
    key, value = "sasl.oauthbearer.config", "principal=admin extension_logicalCluster=lkc-hunter55"
    with pytest.raises(SettingsError) as err:
        build(KafkaSettings, "kafka", environ={"STREAMREC_KAFKA_EXTRA": f"{key}={value},broken"})
    assert "hunter55" not in str(err.value) and "(a credential, its value not shown)" in str(err.value)
    settings = KafkaSettings(extra={key: value})
    assert "hunter55" not in repr(settings) and "hunter55" not in json.dumps(redact_obj({"extra": settings.extra}))
    assert "hunter55" not in redact(f"librdkafka: cannot use {value}")  # registered: scrubbed from free text


@pytest.mark.parametrize("section, name", [("redis", "password"), ("kafka", "sasl_password"),
                                           ("kafka", "ssl_key_password")])
@pytest.mark.parametrize("content", ["", "\n", "\r\n"])
def test_an_empty_secret_file_is_refused_naming_it_not_read_as_no_password(
        section: str, name: str, content: str, tmp_path: Path) -> None:
    # an unfilled secret template: the Redis clients would silently log in as the default user without a password
    from stream.config import RedisSettings

    f = tmp_path / "secret"
    f.write_text(content)
    cls = RedisSettings if section == "redis" else KafkaSettings
    with pytest.raises(SettingsError, match=rf"\[{section}\] {name}_file: .*secret is empty: put the {name} in it"):
        build(cls, section, {section: {f"{name}_file": str(f)}}, {})


@pytest.mark.parametrize("mode, warned", [(0o600, False), (0o400, False), (0o640, False), (0o440, False),
                                          (0o644, True), (0o604, True), (0o620, True), (0o602, True)])
def test_a_password_file_other_users_can_read_or_a_group_can_write_is_used_with_a_warning_naming_it(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, mode: int, warned: bool) -> None:
    """A password file mounted 0644 was used in silence, while a signing key file so mounted is warned of: any local
    user reads the password and logs in as the service. Used all the same (a secret volume's default mode), with a
    warning naming the setting, the file, its mode and the fix, never the password; once per file in a process."""
    f = tmp_path / f"pw-{mode:o}"
    f.write_text("s3cret-password-for-modes\n")
    f.chmod(mode)
    with caplog.at_level(logging.WARNING, logger="stream.setting_values"):
        for _ in range(2):
            got = build(_Creds, "creds", {"creds": {"password_file": str(f)}}, {})
            assert got.password.reveal() == "s3cret-password-for-modes"
    lines = [r.getMessage() for r in caplog.records if r.name == "stream.setting_values"]
    assert len(lines) == warned, lines
    if warned:
        assert "[creds] password_file" in lines[0] and str(f) in lines[0] and oct(mode)[2:] in lines[0]
        assert "chmod 600" in lines[0] and "s3cret" not in lines[0] and redact(lines[0]) == lines[0]
        assert ("every local user can read it" in lines[0]) is bool(mode & 0o004)


def test_the_repr_of_settings_holding_a_url_password_or_a_credential_property_shows_none_of_them() -> None:
    # a settings object in a traceback, a debug log line or an f-string with !r: the url's user-info (a plain str
    # field, not a Secret) and a [kafka.extra] credential were printed as they were
    from learner.config import LearnerSettings
    from stream.config import RedisSettings

    shown = [repr(RedisSettings(url="redis://ops:hunter51@redis-1:6379/0")),
             repr(LearnerSettings(deltas_redis_url="rediss://:hunter52@redis-2:6380/1")),
             repr(KafkaSettings(extra={"sasl.oauthbearer.client.secret": "hunter53"})),
             f"{RedisSettings(url='redis://:hunter54@h:1/0')!r}"]
    for text, secret in zip(shown, ("hunter51", "hunter52", "hunter53", "hunter54"), strict=True):
        assert secret not in text, text
    assert "redis-1:6379/0" in shown[0] and "RedisSettings(" in shown[0]  # the rest is still there to read


@pytest.mark.parametrize("value", ["", "\n", "\r\n"])
def test_a_secret_variable_set_but_empty_is_refused_naming_it_not_read_as_no_password(value: str) -> None:
    # as an empty secret file: an unfilled variable (`REDIS_PW=` in an env file) logged the Redis clients in as the
    # default user without a password, silently
    from stream.config import RedisSettings

    with pytest.raises(SettingsError, match=r"\[redis\] password_env: the variable REDIS_PW is set but empty"):
        build(RedisSettings, "redis", {"redis": {"password_env": "REDIS_PW"}}, {"REDIS_PW": value})


def test_the_repr_of_kafka_settings_shows_no_part_of_an_inline_private_key_or_a_credential_with_spaces() -> None:
    # redact() masks a key=value only up to the first space, comma or quote: an inline PEM key ("-----BEGIN PRIVATE
    # KEY-----\n...") or a passphrase with a space kept all but its first word in the repr
    pem = "-----BEGIN PRIVATE KEY-----\nMIIEhunter61body\n-----END PRIVATE KEY-----"
    text = repr(KafkaSettings(extra={"ssl.key.pem": pem, "ssl.key.passphrase": "correct horse hunter62",
                                     "linger.ms": "5"}))
    assert "hunter61" not in text and "hunter62" not in text and "PRIVATE KEY" not in text, text
    assert "'linger.ms': '5'" in text  # the rest is still there to read


def _settings_classes_with_url_fields() -> list[tuple[type, str]]:
    """Every settings dataclass of the project with a field named like a URL: (class, field)."""
    import dataclasses
    import importlib

    found = []
    for name in ("stream.config", "learner.config", "serving.settings", "cache_refresh.settings", "monitor.alerts",
                 "monitor.rules", "stream.joiner.config", "stream.replay.config", "learner.evaluation.config"):
        module = importlib.import_module(name)
        for obj in vars(module).values():
            if isinstance(obj, type) and dataclasses.is_dataclass(obj) and obj.__module__ == name:
                found += [(obj, f.name) for f in dataclasses.fields(obj) if "url" in f.name]
    return found


def test_every_settings_dataclass_with_a_url_field_hides_the_url_password_in_its_repr() -> None:
    # RedisSettings and LearnerSettings hid theirs; [sinks] webhook_url (SinkSettings) printed
    # https://user:TOKEN@host whole in a repr
    import dataclasses

    classes = _settings_classes_with_url_fields()
    assert {c.__name__ for c, _ in classes} >= {"RedisSettings", "LearnerSettings", "SinkSettings"}
    for cls, field in classes:
        scheme = "redis" if "redis" in field or cls.__name__ == "RedisSettings" else "https"
        obj = dataclasses.replace(cls(), **{field: f"{scheme}://ops:hunter71@host-1:9093/0"})
        assert "hunter71" not in repr(obj), (cls.__name__, field, repr(obj))
        assert "host-1:9093" in repr(obj)


@pytest.mark.parametrize("url", ["redis://:p@ss w0rd-hunter81@h:1/0", "redis://ops:hunter82 x@h:1/0",
                                 "redis://:a\thunter83@h:1/0"])
def test_a_redis_url_with_whitespace_is_refused_without_showing_any_of_its_password(url: str) -> None:
    # a URL cannot hold a raw space: the user-info redaction stops at it, and the repr (and this error) showed the
    # password's words after the first one ("ss w0rd-hunter81@h:1/0")
    from stream.config import RedisSettings
    from stream.errors import ConfigError

    with pytest.raises(ConfigError) as err:
        RedisSettings(url=url)
    assert "hunter8" not in str(err.value) and "w0rd" not in str(err.value), str(err.value)
    assert "whitespace" in str(err.value) and "%20" in str(err.value)


@pytest.mark.parametrize("url", ["redis://h:1/0\n", "  redis://h:1/0", "redis://h:1/0\r\n"])
def test_whitespace_around_a_redis_url_is_dropped_not_refused(url: str) -> None:
    # an environment variable filled from a secret file ends in a newline: the url itself holds no whitespace
    from stream.config import RedisSettings

    assert RedisSettings(url=url).url == "redis://h:1/0"


@pytest.mark.parametrize("password", ["pa'ss9Q", 'pa"ss9Q', "pa`ss9Q", "pa<ss9Q", "pa>ss9Q", "a'b\"c9Q"])
def test_a_url_password_holding_a_quote_or_angle_bracket_is_masked_whole(password: str) -> None:
    # "'" is a sub-delim RFC 3986 allows unencoded in a password (urlsplit and redis-py take the others too): the
    # userinfo match stopped at it, and the repr and every error line quoting the url showed the whole password
    from stream.config import RedisSettings
    from stream.errors import ConfigError

    url = f"redis://:{password}@h:1/3"
    assert "ss9Q" not in repr(RedisSettings(url=url)) and "redis://***@h:1/3" in repr(RedisSettings(url=url))
    with pytest.raises(ConfigError) as exc:
        RedisSettings(url=url, cluster=True)
    assert "ss9Q" not in str(exc.value) and "9Q" not in redact(f"url {url!r} and {url}"), str(exc.value)


def test_an_alert_sent_to_any_sink_carries_no_secret_its_message_quoted() -> None:
    # a refresh failure's message quotes the exception (cache_refresh/job.py): the log's filter scrubbed the log copy
    # only, and the Kafka or webhook payload went out as written
    from cache_refresh.alerts import RefreshAlerts
    from stream.config import KafkaSettings

    register("alert-borne-secret-77")
    alert = RefreshAlerts(KafkaSettings(), topic="").fire(
        "holdout", "ConnectionError: redis://svc:s3cr%40t@redis-1:6379/0 refused (token alert-borne-secret-77)",
        "refresh_failed")
    payload = alert.to_json().decode()
    assert "s3cr" not in payload and "alert-borne-secret-77" not in payload
    assert f"redis://{MASK}@redis-1:6379/0 refused" in alert.message


def test_a_webhook_urls_path_and_query_are_never_shown_its_token_may_be_there(tmp_path: Path) -> None:
    # Slack-style incoming webhooks carry their token in the path, others in the query: a failed delivery's error, the
    # settings' repr and a rules file's error once showed it whole (redact masks only a URL's user-info)
    from monitor.alerts import Alert, AlertState, Severity, SinkError, SinkSettings, WebhookSink
    from monitor.rules import load_rules
    from stream.errors import ConfigError
    from stream.secrets import hide_url_path

    token = "T0KEN-xoxb-9f8e7d6c"
    url = f"http://u:pw@127.0.0.1:1/services/T1/B2/{token}?sig={token}"
    assert hide_url_path(url) == f"http://{MASK}@127.0.0.1:1/{MASK}"
    assert hide_url_path("http://alertmanager:9093/") == "http://alertmanager:9093"
    sink = WebhookSink(url, timeout_s=2.0)
    alert = Alert(rule="r", source="s", severity=Severity.WARNING, state=AlertState.FIRING, value=1.0, threshold=0.0,
                  message="m", ts=0)
    with pytest.raises(SinkError) as err:  # nothing listens on port 1: refused
        sink.send([alert])
    assert token not in str(err.value) and "127.0.0.1:1" in str(err.value)
    assert token not in repr(SinkSettings(webhook_url=url))
    rules = tmp_path / "rules.toml"
    rules.write_text(f'[sinks]\nwebhook_url = "ftp://hooks.example/services/{token}"\n')
    with pytest.raises(ConfigError) as bad:
        load_rules(rules)
    assert token not in str(bad.value) and "webhook_url" in str(bad.value)


@pytest.mark.parametrize("url", [
    "http://usr9:pq7/ssW0rd@alerts.example/services/T1",  # '/' unencoded in the password: urlsplit's netloc ends there
    "http://usr9:pq7?ssW0rd@alerts.example/x",
    "http://usr9:pq7#ssW0rd@alerts.example/x",
    "http://usr9:pq7\t/ssW0rd@alerts.example/x",  # urlsplit drops the tab: the same URL
    "http://usr9:pq7/ss W0rd@alerts.example/x",  # a space after the '/': redact's token ends there
])
def test_a_webhook_url_whose_password_holds_a_path_character_shows_none_of_it(url: str) -> None:
    # hide_url_path took the user-info from urlsplit's netloc, which ends at the first '/', '?' or '#': the password's
    # head was shown as the host ('http://usr9:pq7/***'), where redact (and the repr before) masked it whole
    from monitor.alerts import SinkSettings
    from stream.secrets import hide_url_path

    for shown in (hide_url_path(url), repr(SinkSettings(webhook_url=url))):
        assert "usr9" not in shown and "pq7" not in shown, shown
    assert hide_url_path("http://usr9:pq7/ssW0rd@alerts.example/x") == f"http://{MASK}@alerts.example/{MASK}"


def test_a_webhook_or_source_url_that_cannot_be_parsed_quotes_no_part_of_its_password() -> None:
    # urlsplit's "Port could not be cast to integer value as 'pq7'" quoted the start of a password holding a '/'
    from monitor.alerts import WebhookSink
    from monitor.http_deadline import check_http_url

    url = "http://usr9:pq7/ssW0rd@alerts.example/x"
    with pytest.raises(ValueError) as err:
        WebhookSink(url)
    assert "pq7" not in str(err.value) and "ssW0rd" not in str(err.value) and "percent-encoded" in str(err.value)
    assert "could not be cast" in (check_http_url("http://host:abc/x") or "")  # no user-info: the library's detail


def test_a_secret_given_by_a_later_source_replaces_the_one_an_earlier_source_gave_whichever_way(
        tmp_path: Path) -> None:
    """defaults < file < environment holds for a secret as a whole: ``STREAMREC_REDIS_PASSWORD`` over a file's
    ``password_file`` (the file's secret was used, silently, the variable ignored), and a variable's ``password_env``
    over a file's ``password_file`` (refused as "both set", though each source gave it one way)."""
    f = tmp_path / "pw"
    f.write_text("from-file-pw\n")
    table = {"redis": {"password_file": str(f)}}
    got = build(RedisSettings, "redis", table, {"STREAMREC_REDIS_PASSWORD": "from-env-pw"})
    assert got.password.reveal() == "from-env-pw" and got.password_file is None
    got = build(RedisSettings, "redis", table, {"STREAMREC_REDIS_PASSWORD_ENV": "PW", "PW": "named-var-pw"})
    assert got.password.reveal() == "named-var-pw"
    got = build(RedisSettings, "redis", {"redis": {"password": "inline-pw"}}, {"STREAMREC_REDIS_PASSWORD_FILE": str(f)})
    assert got.password.reveal() == "from-file-pw"


def test_a_secret_given_two_ways_by_one_source_is_refused_not_one_of_them_picked(tmp_path: Path) -> None:
    """``password`` and ``password_file`` in one file: the file's content won silently, the value written beside it
    ignored; as ``password_file`` with ``password_env``, give it one way."""
    f = tmp_path / "pw"
    f.write_text("from-file-pw\n")
    with pytest.raises(SettingsError, match=r"\[redis\] password and password_file are both set"):
        build(RedisSettings, "redis", {"redis": {"password": "inline-pw", "password_file": str(f)}}, {})
    with pytest.raises(SettingsError, match=r"\[kafka\] sasl_password and sasl_password_env are both set"):
        build(KafkaSettings, "kafka", {}, {"STREAMREC_KAFKA_SASL_PASSWORD": "inline-pw",
                                           "STREAMREC_KAFKA_SASL_PASSWORD_ENV": "PW", "PW": "x"})


@pytest.mark.parametrize("text", [
    '[sinks]\nwebhook_url = ["https://hooks.example/services/T1/B2/{token}"]\n',  # several webhooks wanted: an array
    'sinks = "https://hooks.example/services/T1/B2/{token}"\n',  # the URL where the [sinks] table belongs
    '[sinks]\nwebhook_url = {{ url = "https://hooks.example/services/T1/B2/{token}" }}\n',
])
def test_a_rules_file_whose_webhook_url_is_no_string_quotes_no_part_of_its_token(tmp_path: Path, text: str) -> None:
    # the error quoted the value whole: a Slack-style token (in the path, which redact cannot tell from a path) reached
    # the `error:` line on stderr, and the logs of a monitor that reloads its rules
    from monitor.rules import load_rules
    from stream.errors import ConfigError

    token = "T0KEN-xoxb-5a4b3c2d"
    rules = tmp_path / "rules.toml"
    rules.write_text(text.format(token=token))
    with pytest.raises(ConfigError) as bad:
        load_rules(rules)
    assert token not in str(bad.value) and "sinks" in str(bad.value), str(bad.value)


def test_a_user_and_password_written_into_bootstrap_servers_are_not_quoted_in_its_error() -> None:
    # bootstrap_servers takes no user-info; one written there as into a URL but without a scheme (which redact needs to
    # see a URL) was quoted whole, twice, in the `error:` line
    from stream.errors import ConfigError

    with pytest.raises(ConfigError) as bad:
        KafkaSettings(bootstrap_servers="alice:pw-b00tstrap-7@broker-1:9092,broker-2:9092")
    text = redact(str(bad.value))  # as the CLI prints it
    assert "pw-b00tstrap-7" not in text and "alice" not in text, text
    assert "broker-1:9092" in text and "sasl_username" in text, text


def test_a_password_with_a_comma_written_into_bootstrap_servers_is_not_quoted_in_part() -> None:
    # the comma split the password across two entries: the first, "alice:pw-b00t", was quoted as the bad entry
    from stream.errors import ConfigError

    with pytest.raises(ConfigError) as bad:
        KafkaSettings(bootstrap_servers="alice:pw-b00t,strap-7@broker-1:9092")
    text = redact(str(bad.value))  # as the CLI prints it
    assert "b00t" not in text and "alice" not in text, text
    assert "broker-1:9092" in text and "sasl_username" in text, text


@pytest.mark.parametrize("argv, flags", [
    (["serve", "--redis-url", "redis://u:PASSWORD@h:6379/0"], ["--redis-url"]),
    (["join", "--redis-url=rediss://:PASSWORD@h"], ["--redis-url"]),
    (["monitor", "--source", "learner=http://u:PASSWORD@h/metrics", "--source", "s=http://h/m?token=PASSWORD"],
     ["--source"]),
    (["serve", "--redis-url", "redis://streamrec@h/0"], []),  # a user alone is no secret
    (["serve", "--redis-url", "redis://h/0", "--config", "/run/secrets/password_file.toml"], []),
])
def test_command_line_secrets_names_each_flag_given_a_password_and_no_other(argv: list[str], flags: list[str]) -> None:
    from stream.secrets import command_line_secrets

    assert command_line_secrets(argv) == flags


def test_a_password_on_the_command_line_is_warned_once_naming_the_flag_and_the_safe_ways_never_the_password(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
        capsys: pytest.CaptureFixture[str]) -> None:
    """Any local user reads a process's arguments (``ps``, /proc/PID/cmdline) while it runs: the CLI says so at start,
    as redis-cli does for ``-a``, and still runs the command (here it stops at a missing --config, exit 2)."""
    from stream import secrets
    from streamrec.cli import main

    monkeypatch.setattr(secrets, "_argv_warned", False)
    argv = ["counts", "top", "--kind", "item", "--redis-url", "redis://u:ArgvPa55word@127.0.0.1:1/0",
            "--config", str(tmp_path / "nope.toml")]
    with caplog.at_level(logging.WARNING, "streamrec.secrets"):
        assert main(argv) == 2
        assert main(argv) == 2  # once per process
    said = [r.getMessage() for r in caplog.records if r.name == "streamrec.secrets"]
    assert len(said) == 1 and said[0].startswith("--redis-url: a password given on the command line"), said
    assert "password_file" in said[0] and "password_env" in said[0] and "STREAMREC_REDIS_PASSWORD" in said[0]
    assert "ArgvPa55word" not in caplog.text + "".join(capsys.readouterr())


@pytest.mark.parametrize("argv, flags", [
    (["monitor", "--source", "learner=http://learner:9100/metrics?owner=ml@corp"], []),  # '@' past the host: no user
    (["serve", "--server", "http://serving:8000/users/u@example.com"], []),
    (["serve", "--redis-url", "redis://u:p@ss@h:6379/0"], ["--redis-url"]),  # an unencoded '@' in the password
    (["serve", "--redis-url=redis://u:a:b@[::1]:6379/0"], ["--redis-url"]),  # a ':' in it, an IPv6 host
    (["serve", "--redis-url", "redis://u:1234@h"], ["--redis-url"]),  # digits only: not a port
])
def test_command_line_secrets_reads_a_password_in_a_urls_user_info_only_not_an_at_sign_past_its_host(
        argv: list[str], flags: list[str]) -> None:
    """The user-info of a URL ends at its host: ``http://h:9100/m?owner=ml@corp`` holds none, yet was taken for
    ``user h, password 9100/m?owner=ml`` and warned about a password there was not."""
    from stream.secrets import command_line_secrets

    assert command_line_secrets(argv) == flags


@pytest.mark.parametrize("argv, flags", [
    (["monitor", "--source", "token-service=http://auth:9100/metrics"], []),
    (["monitor", "--source=secrets-sync=http://sync:9100/metrics"], []),
    (["monitor", "--source", "auth=http://auth:9100/metrics?token=PASSWORD"], ["--source"]),  # in the URL: one
])
def test_a_sources_name_is_a_label_not_a_password_pair(argv: list[str], flags: list[str]) -> None:
    """``--source NAME=URL``: a source named ``token-service`` read as a ``token=`` pair whose value was its URL, and
    the monitor was warned of a password on its command line that it did not have."""
    from stream.secrets import command_line_secrets

    assert command_line_secrets(argv) == flags


_KEY_PEM = "-----BEGIN PRIVATE KEY-----\nMIGHAgEAMBMGByqGSM49AgEGCCqGSM49AwEHBG0wawIBAQQg\n-----END PRIVATE KEY-----\n"
_CERT_PEM = "-----BEGIN CERTIFICATE-----\nMIIBfTCCASOgAwIBAgIUb3Jn\n-----END CERTIFICATE-----\n"


@pytest.mark.parametrize("section, cls, table, setting, pem, mode, warned", [
    ("kafka", KafkaSettings, {"security_protocol": "SSL", "ssl_certificate_location": "{cert}",
                              "ssl_key_location": "{f}"}, "ssl_key_location", _KEY_PEM, 0o644, True),
    ("kafka", KafkaSettings, {"security_protocol": "SSL", "ssl_certificate_location": "{cert}",
                              "ssl_key_location": "{f}"}, "ssl_key_location", _KEY_PEM, 0o620, True),
    ("kafka", KafkaSettings, {"security_protocol": "SSL", "ssl_certificate_location": "{cert}",
                              "ssl_key_location": "{f}"}, "ssl_key_location", _KEY_PEM, 0o600, False),
    ("redis", RedisSettings, {"url": "rediss://127.0.0.1:6380/0", "ssl_certfile": "{cert}", "ssl_keyfile": "{f}"},
     "ssl_keyfile", _KEY_PEM, 0o604, True),
    ("redis", RedisSettings, {"url": "rediss://127.0.0.1:6380/0", "ssl_certfile": "{f}"},
     "ssl_certfile", _CERT_PEM + _KEY_PEM, 0o644, True),
    ("redis", RedisSettings, {"url": "rediss://127.0.0.1:6380/0", "ssl_certfile": "{f}", "ssl_keyfile": "{key}"},
     "ssl_certfile", _CERT_PEM, 0o644, False),
], ids=["kafka key o+r", "kafka key g+w", "kafka key 0600", "redis key o+rw", "redis combined cert+key o+r",
        "redis certificate alone o+r"])
def test_a_tls_private_key_file_other_users_can_read_or_write_is_warned_of_as_a_password_file_is(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, section: str, cls: type, table: dict[str, str],
        setting: str, pem: str, mode: int, warned: bool) -> None:
    """A client's TLS private key (``[kafka] ssl_key_location``, ``[redis] ssl_keyfile``, or a ``[redis] ssl_certfile``
    that holds the key too) mounted 0644 was loaded in silence, while a password file so mounted was warned of: any
    local user who reads the key is this service to the broker or Redis. The same warning, from the same rule (its
    setting, the file, its mode, who can read it, chmod 600); a certificate without a key is public, no warning."""
    f, cert, key = tmp_path / f"{setting}-{mode:o}.pem", tmp_path / "client.crt", tmp_path / "client.key"
    f.write_text(pem)
    f.chmod(mode)
    cert.write_text(_CERT_PEM)
    key.write_text(_KEY_PEM)
    key.chmod(0o600)
    given = {k: v.format(f=f, cert=cert, key=key) for k, v in table.items()}
    with caplog.at_level(logging.WARNING, logger="stream.setting_values"):
        for _ in range(2):
            build(cls, section, {section: given}, {})
    lines = [r.getMessage() for r in caplog.records if r.name == "stream.setting_values"]
    assert len(lines) == warned, lines
    if warned:
        assert f"[{section}] {setting}: {f} has mode 0{mode:o}" in lines[0], lines[0]
        assert "chmod 600" in lines[0] and "PRIVATE" not in lines[0]
        assert ("every local user can read it" in lines[0]) is bool(mode & 0o004), lines[0]
        assert ("users other than its owner can write it" in lines[0]) is bool(mode & 0o022), lines[0]


@pytest.mark.parametrize("mode, warned", [(0o644, True), (0o600, False)], ids=["o+r", "0600"])
def test_a_pkcs12_keystore_in_kafka_extra_other_users_can_read_is_warned_of_by_its_property(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, mode: int, warned: bool) -> None:
    """``[kafka.extra] ssl.keystore.location`` names a PKCS#12 keystore, the client's private key with its
    certificate: mounted 0644 it was loaded in silence while ``[kafka] ssl_key_location`` so mounted was warned of.
    A keystore is binary, no PEM marker in it: warned of by its property, the same warning, naming the property."""
    f = tmp_path / "client.p12"
    f.write_bytes(b"\x30\x82\x0a\x1f\x02\x01\x03\x30\x82\x09\xe5\x06\x09\x2a\x86\x48\x86\xf7\x0d\x01\x07\x01")
    f.chmod(mode)
    given = {"security_protocol": "SSL", "extra": {"ssl.keystore.location": str(f), "ssl.keystore.password": "pw"}}
    with caplog.at_level(logging.WARNING, logger="stream.setting_values"):
        build(KafkaSettings, "kafka", {"kafka": given}, {})
    lines = [r.getMessage() for r in caplog.records if r.name == "stream.setting_values"]
    assert len(lines) == warned, lines
    if warned:
        assert f"[kafka.extra] ssl.keystore.location: {f} has mode 0{mode:o}" in lines[0], lines[0]
        assert "every local user can read it" in lines[0] and "chmod 600" in lines[0]
