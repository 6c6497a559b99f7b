"""Whether and how a Kafka broker can be reached with the [kafka] settings: the security properties every
client gets (:func:`security_properties`), the check that the broker takes them before the first client is built
(:func:`check_access`, :class:`KafkaAccessError` naming the settings to fix), the Python TLS context librdkafka's
settings amount to (:func:`tls_context`, :func:`weakened_tls`), and a broker that cannot be reached: librdkafka's log
lines with repeats held back (``librdkafka_log``) and the error line a command ends in (:func:`describe_error`).
"""

from __future__ import annotations

import logging
import math
import re
import ssl
import threading
import time
import uuid
from collections.abc import Collection
from typing import Any

from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import AdminClient

from stream.config import KafkaSettings, SaslMechanism
from stream.errors import ConfigError, StreamError
from stream.tls import REFUSAL_TIMEOUT_S, certificate_refusal, check_file, client_context

log = logging.getLogger("streamrec.kafka")


def security_properties(kafka: KafkaSettings) -> dict[str, Any]:
    """The security properties of every client (producer, consumer, admin): ``security.protocol``, SASL
    credentials, TLS files, then ``[kafka.extra]`` (applied last; it may not name a property a setting gives).

    The files named must exist (checked here, when a client is built): a :class:`ConfigError` naming the
    setting, instead of librdkafka's ``ssl.ca.location failed`` at the first connection attempt.
    """
    protocol = kafka.security_protocol
    conf: dict[str, Any] = {"security.protocol": protocol.value}
    if protocol.sasl:
        conf["sasl.mechanism"] = kafka.sasl_mechanism.value
        if kafka.sasl_mechanism is not SaslMechanism.OAUTHBEARER:
            conf["sasl.username"] = kafka.sasl_username
            conf["sasl.password"] = kafka.sasl_password.reveal()
    if protocol.tls:
        for setting, prop in (("ssl_ca_location", "ssl.ca.location"),
                              ("ssl_certificate_location", "ssl.certificate.location"),
                              ("ssl_key_location", "ssl.key.location")):
            path = getattr(kafka, setting)
            if path is not None:
                check_file("kafka", setting, path)  # librdkafka reads it later: missing, a FIFO... said now
                conf[prop] = str(path)
        if kafka.ssl_key_password.reveal():
            conf["ssl.key.password"] = kafka.ssl_key_password.reveal()
    conf.update(kafka.extra)
    return conf


class KafkaAccessError(StreamError):
    """The broker refused this client: credentials it rejects, a certificate that does not verify, or a
    security protocol the listener does not speak. Not retried: retrying cannot fix a configuration."""


# -- the access check -------------------------------------------------------------------------------
# librdkafka retries a refused login or a failed TLS handshake for ever, logging a line every reconnect, and
# the call waiting on it fails only at its timeout with "Broker transport failure". So before the first
# client of a process is built with given settings, one silent admin client connects with them (bounded) and
# a refusal becomes one KafkaAccessError naming the cause and the settings to fix. A broker that is down
# (connection refused) or slow is not judged here: the caller's own timeouts and retries report it as before.
ACCESS_CHECK_S = 3.0
_VERIFY_FAILED = "certificate verify failed"  # in librdkafka's text, before its advice on ssl.ca.location
UNDECIDED_FOR_S = 60.0  # a check that could not decide (a silent or slow broker) is not repeated this long
_access_ok: set[tuple[Any, ...]] = set()
_access_undecided: dict[tuple[Any, ...], float] = {}  # key -> monotonic time of the undecided check
_access_lock = threading.Lock()
_AFTER = re.compile(r"\s*\(after \d+ms in state \w+\)$")
_PREFIX = re.compile(r"^[a-z_]+://[^ ]+/(?:bootstrap|\d+): ")


def _access_key(kafka: KafkaSettings) -> tuple[Any, ...]:
    return (kafka.bootstrap_servers, kafka.security_protocol, kafka.sasl_mechanism, kafka.sasl_username,
            kafka.sasl_password.reveal(), kafka.ssl_ca_location, kafka.ssl_certificate_location,
            kafka.ssl_key_location, kafka.ssl_key_password.reveal(), tuple(sorted(kafka.extra.items())))


def principal(kafka: KafkaSettings) -> str:
    p = kafka.security_protocol
    how = str(p)
    if p.sasl:
        how += f", {kafka.sasl_mechanism}"
        if kafka.sasl_mechanism is not SaslMechanism.OAUTHBEARER:
            how += f" as {kafka.sasl_username!r}"
    return f"Kafka at {kafka.bootstrap_servers} ({how})"


_PROPERTY = re.compile(r'configuration property:? "([^"]+)"')


def _probe(conf: dict[str, Any], timeout_s: float, extra: Collection[str] = ()) -> tuple[bool, list[KafkaError]]:
    """Connect with ``conf`` (silently) until metadata comes, a refusal is reported, or ``timeout_s``. ``extra``:
    the properties of ``conf`` that came from ``[kafka.extra]``, to say so when librdkafka rejects one."""
    errors: list[KafkaError] = []
    silent: dict[str, Any] = {**conf, "log_level": 0, "error_cb": errors.append}
    try:
        admin = AdminClient(silent)
    except KafkaException as exc:  # a property librdkafka rejects: a CA file that holds no certificate, say
        err = exc.args[0]
        if isinstance(err, KafkaError) and err.code() == KafkaError._INVALID_ARG:
            prop = _PROPERTY.search(err.str())
            if prop and prop.group(1) in extra:
                raise ConfigError(f"[kafka.extra] (STREAMREC_KAFKA_EXTRA) {prop.group(1)}: {err.str()}; the table "
                                  "passes librdkafka properties as they are (librdkafka's CONFIGURATION.md)") from None
            raise ConfigError(f"[kafka] a security setting cannot be used: {err.str()}") from None
        raise
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            admin.list_topics(timeout=0.25)
            return True, errors
        except KafkaException:
            pass
        admin.poll(0)
        if _refusal(errors) or never_connected(errors) or _dropped(errors) or time.monotonic() > deadline:
            return False, errors


def error_text(err: KafkaError) -> str:
    return _PREFIX.sub("", _AFTER.sub("", err.str()))


def _refusal(errors: list[KafkaError]) -> KafkaError | None:
    return next((e for e in errors if e.code() in (KafkaError._AUTHENTICATION, KafkaError._SSL)
                 or "SSL handshake failed" in e.str()), None)


def never_connected(errors: list[KafkaError]) -> bool:
    """No connection at all: refused, timed out or not resolved (the broker is down or elsewhere)."""
    return any(e.code() == KafkaError._RESOLVE or (e.code() == KafkaError._TRANSPORT and "Connect to " in e.str())
               for e in errors)


def _dropped(errors: list[KafkaError]) -> bool:
    """The broker took the connection and closed it (all brokers down, or disconnected, yet no connect error)."""
    return (any(e.code() == KafkaError._ALL_BROKERS_DOWN
                or (e.code() == KafkaError._TRANSPORT and "Disconnected" in e.str()) for e in errors)
            and not never_connected(errors))


def weakened_tls(kafka: KafkaSettings) -> str | None:
    """What ``[kafka.extra]`` turns off of the broker certificate's checks over TLS (None: nothing): librdkafka's
    ``enable.ssl.certificate.verification = false`` (any certificate is accepted) or
    ``ssl.endpoint.identification.algorithm = none`` (any certificate the CA signed, whatever host it names)."""
    if not kafka.security_protocol.tls:
        return None
    if not kafka.verifies_certificates():
        how = "any certificate is accepted, self-signed or not"
    elif not _checks_host(kafka):
        how = "any certificate the CA signed is accepted, whatever host it names"
    else:
        return None
    return (f"[kafka.extra] turns off the check of {kafka.bootstrap_servers}'s TLS certificate ({how}): whoever can "
            "intercept the connection can read the data and the SASL credentials; remove "
            "enable.ssl.certificate.verification / ssl.endpoint.identification.algorithm from [kafka.extra] "
            "(ssl_ca_location names the CA that signed a certificate naming the broker's host)")


def tls_context(kafka: KafkaSettings) -> ssl.SSLContext:
    """Python's TLS context for ``kafka``'s settings, as librdkafka applies them: the CA, the client certificate and
    key, and ``[kafka.extra]``'s checks turned off (:func:`weakened_tls`). Loaded by :func:`stream.tls.client_context`:
    a bad CA file, a key that is not the certificate's or cannot be read is a ConfigError naming the setting."""
    ctx = client_context("kafka", ("ssl_ca_location", kafka.ssl_ca_location),
                         ("ssl_certificate_location", kafka.ssl_certificate_location),
                         ("ssl_key_location", kafka.ssl_key_location), kafka.ssl_key_password.reveal())
    if not kafka.verifies_certificates():
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    elif not _checks_host(kafka):
        ctx.check_hostname = False
    return ctx


def _checks_host(kafka: KafkaSettings) -> bool:
    """Whether librdkafka checks that the broker's certificate names the host connected to (``[kafka.extra]``
    ``ssl.endpoint.identification.algorithm = none`` turns it off)."""
    return kafka.extra.get("ssl.endpoint.identification.algorithm", "https").strip().lower() != "none"


def _certificate_refusal(kafka: KafkaSettings) -> str | None:
    """Why the first bootstrap server's certificate fails verification, when it names another host or is out of date
    (:func:`stream.tls.certificate_refusal`, one bounded handshake); None for any other outcome."""
    host, _, port = kafka.bootstrap_servers.split(",")[0].strip().rpartition(":")
    try:
        ctx = tls_context(kafka)
    except ConfigError:  # a file librdkafka loaded and ssl cannot: the CA advice stands
        return None
    return certificate_refusal(ctx, host.strip("[]"), int(port), REFUSAL_TIMEOUT_S)


_weakened_warned: set[tuple[Any, ...]] = set()  # settings whose weakened TLS has been logged (once per process)


def check_access(kafka: KafkaSettings, timeout_s: float = ACCESS_CHECK_S) -> None:
    """Raise :class:`KafkaAccessError` when the broker refuses ``kafka``'s security settings; once per process
    and settings, when they work (see the comment above). Called by every client config builder, which also logs
    (once) a warning when ``[kafka.extra]`` turns off the broker certificate's checks (:func:`weakened_tls`)."""
    key = _access_key(kafka)
    if key in _access_ok or time.monotonic() - _access_undecided.get(key, -UNDECIDED_FOR_S) < UNDECIDED_FOR_S:
        return
    with _access_lock:
        if key in _access_ok or time.monotonic() - _access_undecided.get(key, -UNDECIDED_FOR_S) < UNDECIDED_FOR_S:
            return
        if key not in _weakened_warned and (weakened := weakened_tls(kafka)) is not None:
            _weakened_warned.add(key)
            log.warning("%s", weakened)
        base = {"bootstrap.servers": kafka.bootstrap_servers, "client.id": f"{kafka.client_id}-access-check"}
        ok, errors = _probe({**base, **security_properties(kafka)}, timeout_s, kafka.extra)
        if ok:
            _access_ok.add(key)
            _unreached.pop(kafka.bootstrap_servers, None)
            return
        refused = _refusal(errors)
        p = kafka.security_protocol
        if refused is not None:
            text = error_text(refused)
            if refused.code() == KafkaError._AUTHENTICATION:
                fix = ("check [kafka] sasl_username and sasl_password (or sasl_password_file / sasl_password_env) "
                       "and sasl_mechanism")
            elif "PLAINTEXT broker listener" in refused.str():
                fix = "the listener does not speak TLS: set [kafka] security_protocol = PLAINTEXT or SASL_PLAINTEXT"
            elif reason := _certificate_refusal(kafka):  # the CA is right: not the CA advice, ours nor librdkafka's
                fix, cut = reason, text.find(_VERIFY_FAILED)
                text = text[:cut + len(_VERIFY_FAILED)] if cut >= 0 else text
            else:
                fix = ("check [kafka] ssl_ca_location (the CA that signed the broker's certificate) and "
                       "ssl_certificate_location / ssl_key_location if the broker wants a client certificate")
            raise KafkaAccessError(f"{principal(kafka)} refused the connection: {text}; {fix}")
        if not _dropped(errors):
            _access_undecided[key] = time.monotonic()  # down, unreachable or slow: not ours to judge
            why = next((re.sub(r"^[^ ]+/bootstrap: ", "", error_text(e)) for e in errors if never_connected([e])), None)
            if why:  # ... but the error line a caller's timeout ends in says it (describe_error)
                _unreached[kafka.bootstrap_servers] = why
            return
        # The broker accepted the connection and dropped it: find out whether it wants TLS or SASL. A diagnosis
        # is reported only if the settings still fail after it (a broker shutting down drops connections too).
        diagnosis: str | None = None
        if not p.tls:
            tls_ok, tls_errors = _probe({**base, "security.protocol": "SSL",
                                         "enable.ssl.certificate.verification": False}, 1.0)
            if tls_ok or (_refusal(tls_errors) is None and _dropped(tls_errors)):
                diagnosis = (f"the listener speaks TLS and closed the {p} connection; set [kafka] security_protocol "
                             "= SSL or SASL_SSL (with ssl_ca_location, and sasl_* for SASL_SSL)")
        if diagnosis is None and not p.sasl:
            sasl_conf = {**base, **security_properties(kafka),
                         "security.protocol": "SASL_SSL" if p.tls else "SASL_PLAINTEXT",
                         "sasl.mechanism": "SCRAM-SHA-512", "sasl.username": "streamrec-access-check",
                         "sasl.password": uuid.uuid4().hex}
            _, sasl_errors = _probe(sasl_conf, 1.0)
            if any(e.code() == KafkaError._AUTHENTICATION for e in sasl_errors):
                diagnosis = ("the listener requires SASL authentication and closed the unauthenticated connection; "
                             f"set [kafka] security_protocol = {'SASL_SSL' if p.tls else 'SASL_PLAINTEXT'}, "
                             "sasl_mechanism, sasl_username and sasl_password (or sasl_password_file / "
                             "sasl_password_env)")
        if diagnosis is None and p.tls and kafka.ssl_certificate_location is None:
            # TLS 1.3: a listener that wants a client certificate rejects its absence after the handshake
            diagnosis = ("the listener completed the TLS handshake and closed the connection at once: does it "
                         "require a client certificate? set [kafka] ssl_certificate_location and ssl_key_location")
        if diagnosis is None:
            return
        ok, errors = _probe({**base, **security_properties(kafka)}, 1.0)
        if ok:
            _access_ok.add(key)
        elif _dropped(errors) and _refusal(errors) is None:
            raise KafkaAccessError(f"{principal(kafka)}: {diagnosis}")


# -- a broker that cannot be reached ---------------------------------------------------------------------------
# librdkafka logs a failed connection on every reconnect (some 20 lines a second while a broker is down) and the
# call waiting on it ends in "KafkaError{code=_TRANSPORT,...}", which names neither the address nor the setting.
# So clients log through Python logging (served when they are polled), where repeats are held back, and the
# error line that reaches the command line says which broker, why, and what to set (describe_error).
_unreached: dict[str, str] = {}  # bootstrap servers the access check could not connect to -> why
servers_in_use: list[str] = []  # of the last client built here
_UNREACHED_CODES = (KafkaError._TRANSPORT, KafkaError._ALL_BROKERS_DOWN, KafkaError._RESOLVE, KafkaError._TIMED_OUT)
REPEAT_EVERY_S = 60.0
# what differs between two reports of one failure: the client's name, the timing, librdkafka's own count
_SAME_LINE = re.compile(r" \[[^]\s]*#[^]\s]*\]"
                        r"|\s*\(after \d+ms in state \w+(?:, \d+ identical error\(s\) suppressed)?\)$")


class _HoldRepeats(logging.Filter):
    """Pass a librdkafka line, then hold back the same line (a broker's connection failure) for REPEAT_EVERY_S;
    the next one to pass says how many were held back."""

    def __init__(self) -> None:
        super().__init__()
        self._last: dict[str, tuple[float, int]] = {}  # line -> (monotonic time it last passed, held back since)
        self._lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        line = _SAME_LINE.sub("", record.getMessage())
        now = time.monotonic()
        with self._lock:
            passed, held = self._last.get(line, (-math.inf, 0))
            if now - passed < REPEAT_EVERY_S:
                self._last[line] = (passed, held + 1)
                return False
            self._last[line] = (now, 0)
        if held:
            record.msg, record.args = f"{record.getMessage()} ({held} more like it held back)", ()
        return True


librdkafka_log = logging.getLogger("streamrec.kafka.librdkafka")
librdkafka_log.addFilter(_HoldRepeats())


def describe_error(exc: KafkaException) -> str:
    """The error line for a KafkaException that ends a command: one the broker's absence explains (transport
    failure, all brokers down, a name that does not resolve, a timeout) names the bootstrap servers, what the access
    check saw when it tried to connect, and the setting; any other as it is."""
    err = exc.args[0] if exc.args else None
    if not isinstance(err, KafkaError) or err.code() not in _UNREACHED_CODES or not servers_in_use:
        return str(exc)
    servers = servers_in_use[-1]
    why = f" cannot be reached ({_unreached[servers]})" if servers in _unreached else ""
    return (f"Kafka at {servers}{why}: {err.str()}; is the broker up, and is that the right address? "
            "([kafka] bootstrap_servers / --bootstrap-servers)")
