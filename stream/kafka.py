"""Thin wrappers over confluent-kafka: client configs, topic creation, an acknowledged producer.

Nothing here relies on broker transactions (the local broker does not honour aborts): correctness
comes from idempotent producing, waiting for acknowledgements, and offsets stored with state.
"""

from __future__ import annotations

import gc
import logging
import math
import re
import ssl
import threading
import time
import uuid
import weakref
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import chain
from typing import Any, NamedTuple

from confluent_kafka import (
    OFFSET_BEGINNING,
    Consumer,
    KafkaError,
    KafkaException,
    Message,
    Producer,
    TopicCollection,
    TopicPartition,
)
from confluent_kafka.admin import AdminClient, AlterConfigOpType, ConfigEntry, ConfigResource, NewTopic, ResourceType

from stream.config import KafkaSettings, SaslMechanism, check_group_id
from stream.errors import (
    BadMessage,
    ConfigError,
    DeliveryFailed,
    DeliveryRefused,
    MessageLimitError,
    MessageTooLarge,
    PartitionMissing,
    StreamError,
    quoted,
)
from stream.retention import account_for_retention
from stream.tls import REFUSAL_TIMEOUT_S, certificate_refusal, check_file, client_context

Headers = Sequence[tuple[str, bytes | None]]  # a header value may be null
log = logging.getLogger("streamrec.kafka")


def _security(kafka: KafkaSettings) -> dict[str, Any]:
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


def _who(kafka: KafkaSettings) -> str:
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
        if _refusal(errors) or _unreachable(errors) or _dropped(errors) or time.monotonic() > deadline:
            return False, errors


def _text(err: KafkaError) -> str:
    return _PREFIX.sub("", _AFTER.sub("", err.str()))


def _refusal(errors: list[KafkaError]) -> KafkaError | None:
    return next((e for e in errors if e.code() in (KafkaError._AUTHENTICATION, KafkaError._SSL)
                 or "SSL handshake failed" in e.str()), None)


def _unreachable(errors: list[KafkaError]) -> bool:
    """No connection at all: refused, timed out or not resolved (the broker is down or elsewhere)."""
    return any(e.code() == KafkaError._RESOLVE or (e.code() == KafkaError._TRANSPORT and "Connect to " in e.str())
               for e in errors)


def _dropped(errors: list[KafkaError]) -> bool:
    """The broker took the connection and closed it (all brokers down, or disconnected, yet no connect error)."""
    return (any(e.code() == KafkaError._ALL_BROKERS_DOWN
                or (e.code() == KafkaError._TRANSPORT and "Disconnected" in e.str()) for e in errors)
            and not _unreachable(errors))


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
        ok, errors = _probe({**base, **_security(kafka)}, timeout_s, kafka.extra)
        if ok:
            _access_ok.add(key)
            _unreached.pop(kafka.bootstrap_servers, None)
            return
        refused = _refusal(errors)
        p = kafka.security_protocol
        if refused is not None:
            text = _text(refused)
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
            raise KafkaAccessError(f"{_who(kafka)} refused the connection: {text}; {fix}")
        if not _dropped(errors):
            _access_undecided[key] = time.monotonic()  # down, unreachable or slow: not ours to judge
            why = next((re.sub(r"^[^ ]+/bootstrap: ", "", _text(e)) for e in errors if _unreachable([e])), None)
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
            sasl_conf = {**base, **_security(kafka), "security.protocol": "SASL_SSL" if p.tls else "SASL_PLAINTEXT",
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
        ok, errors = _probe({**base, **_security(kafka)}, 1.0)
        if ok:
            _access_ok.add(key)
        elif _dropped(errors) and _refusal(errors) is None:
            raise KafkaAccessError(f"{_who(kafka)}: {diagnosis}")


# -- a broker that cannot be reached ---------------------------------------------------------------------------
# librdkafka logs a failed connection on every reconnect (some 20 lines a second while a broker is down) and the
# call waiting on it ends in "KafkaError{code=_TRANSPORT,...}", which names neither the address nor the setting.
# So clients log through Python logging (served when they are polled), where repeats are held back, and the
# error line that reaches the command line says which broker, why, and what to set (describe_error).
_unreached: dict[str, str] = {}  # bootstrap servers the access check could not connect to -> why
_servers_in_use: list[str] = []  # of the last client built here
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
    if not isinstance(err, KafkaError) or err.code() not in _UNREACHED_CODES or not _servers_in_use:
        return str(exc)
    servers = _servers_in_use[-1]
    why = f" cannot be reached ({_unreached[servers]})" if servers in _unreached else ""
    return (f"Kafka at {servers}{why}: {err.str()}; is the broker up, and is that the right address? "
            "([kafka] bootstrap_servers / --bootstrap-servers)")


def _client(kafka: KafkaSettings, conf: dict[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    """``conf``, then the caller's ``extra`` properties, then the security ones (see :func:`_security`),
    after :func:`check_access` found that the broker takes them. librdkafka's log lines go to
    ``streamrec.kafka.librdkafka`` (repeats held back) unless ``extra`` names its own ``logger``."""
    security = _security(kafka)
    check_access(kafka)
    _servers_in_use[:] = [kafka.bootstrap_servers]
    conf["logger"] = librdkafka_log
    conf.update(extra)
    conf.update(security)
    return conf


BATCH_MESSAGES = 10_000  # the most records a streamrec producer puts in one record batch (resume_offsets)


def producer_config(kafka: KafkaSettings, **extra: Any) -> dict[str, Any]:
    conf: dict[str, Any] = {
        "bootstrap.servers": kafka.bootstrap_servers,
        "client.id": kafka.client_id,
        "enable.idempotence": True,
        "acks": "all",
        # murmur2 is what the Java client and aiokafka (faust) use: keys land on the same partition
        # whichever client produced them, which keeps impressions and clicks co-partitioned.
        "partitioner": "murmur2_random",
        "linger.ms": 20,
        "batch.num.messages": BATCH_MESSAGES,
        "queue.buffering.max.messages": 1_000_000,
        "queue.buffering.max.kbytes": 1_048_576,
        "compression.type": "lz4",
    }
    return _client(kafka, conf, extra)


def heartbeat_interval_s(kafka: KafkaSettings) -> float:
    """A group member's heartbeat interval: a sixth of the session, at least 0.5 s (both joiner drivers' consumers).
    A member that lost its partitions (it stalled past its session) hears so at its next heartbeat."""
    return max(0.5, kafka.session_timeout_ms / 6000)


# receive.message.max.bytes: 256 MiB, 2.5x librdkafka's default. Not its 2 GiB cap: librdkafka allocates the frame
# size a connection announces, so a bootstrap pointed at another protocol's port took its first bytes for one (a
# TLS alert 336 MiB, "-ERR" 759 MB, "HTTP" 1.2 GB) where this bound refuses it as an invalid frame
RECEIVE_MAX_BYTES = 256 << 20


def consumer_config(kafka: KafkaSettings, group_id: str, **extra: Any) -> dict[str, Any]:
    check_group_id("the consumer group (group.id)", group_id)  # librdkafka's "no group" aborted the process
    conf: dict[str, Any] = {
        "bootstrap.servers": kafka.bootstrap_servers,
        "client.id": kafka.client_id,
        "group.id": group_id,
        "session.timeout.ms": kafka.session_timeout_ms,
        "heartbeat.interval.ms": round(heartbeat_interval_s(kafka) * 1000),
        "auto.offset.reset": "earliest",
        "enable.auto.commit": False,
        "enable.auto.offset.store": False,
        # The local broker reports wrong high watermarks; the end of a partition is detected from
        # partition-EOF events instead (see environment.md).
        "enable.partition.eof": True,
        # An application producing in transactions: what it aborted never reaches a consumer (librdkafka's default,
        # stated: the faust driver's aiokafka reads uncommitted unless told, stream/joiner/faust_delivery.py). The
        # local broker does not honour aborts (environment.md).
        "isolation.level": "read_committed",
        # A record up to RECEIVE_MAX_BYTES can be fetched: the broker hands over a partition's first record whatever
        # its size (KIP-74), and a fetch response over librdkafka's default 100 MB limit was dropped and fetched again
        # for ever (librdkafka's FAIL log line the only word): a reader stalled at a record a producer sent with a
        # raised message.max.bytes, and nothing before it in the same response was read either (one over 256 MiB
        # still does: README). Buffers are sized per response, so the bound costs nothing until such a record comes.
        "receive.message.max.bytes": RECEIVE_MAX_BYTES,
    }
    return _client(kafka, conf, extra)


def admin_config(kafka: KafkaSettings, **extra: Any) -> dict[str, Any]:
    """The one place an admin client's config is built."""
    return _client(kafka, {"bootstrap.servers": kafka.bootstrap_servers, "client.id": kafka.client_id}, extra)


def ensure_topics(kafka: KafkaSettings, topics: Iterable[str], partitions: int | None = None) -> None:
    """Create ``topics`` with ``partitions`` partitions if they do not exist (idempotent)."""
    admin = AdminClient(admin_config(kafka))
    wanted = sorted(set(topics))
    existing = admin.list_topics(timeout=10).topics
    new = [
        NewTopic(t, num_partitions=partitions or kafka.partitions, replication_factor=kafka.replication_factor)
        for t in wanted
        if t not in existing
    ]
    if not new:
        return
    for fut in admin.create_topics(new, operation_timeout=10).values():
        try:
            fut.result()
        except KafkaException as exc:
            if exc.args[0].code() != KafkaError.TOPIC_ALREADY_EXISTS:
                raise
    # Wait until metadata shows every partition (creation is asynchronous on some brokers).
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        md = admin.list_topics(timeout=10).topics
        if all(t in md and md[t].partitions for t in wanted):
            return
        time.sleep(0.05)


def partition_counts(kafka: KafkaSettings, topics: Iterable[str]) -> dict[str, int]:
    """How many partitions each of ``topics`` has now (0: it does not exist), from one metadata request. A topic
    whose metadata carries an error (a leader not available yet, just after its creation) counts the partitions
    listed: its count is known all the same, and 0 would refuse a layout that holds."""
    admin = AdminClient(admin_config(kafka))
    md = admin.list_topics(timeout=10).topics
    return {t: len(md[t].partitions) if t in md else 0 for t in topics}


def topic_identity(kafka: KafkaSettings, topic: str, timeout_s: float = 10.0) -> dict[str, str]:
    """``{"topic_id": ..., "cluster_id": ...}`` of ``topic`` as the broker names them now (the topic id as Kafka's tools
    print it), for a checkpoint to record which topic its offsets are of: a topic deleted and created again, or another
    cluster's of the same name, has another topic id. An id the broker does not give (none, or the all-zero Uuid of a
    broker without topic ids) is left out, and so is everything when the broker cannot be asked (logged): the caller
    then cannot tell one topic from another of its name, and goes on as before topic ids were recorded."""
    return topic_identities(kafka, [topic], timeout_s)[topic]


# (bootstrap servers, topic) whose id the broker could not give: said once until it gives it again (a joiner asks
# every ``[joiner] topic_check_s`` and at each restore: a broker down for an hour said so 120 times)
_ids_unread: set[tuple[str, str]] = set()


def topic_identities(kafka: KafkaSettings, topics: Sequence[str], timeout_s: float = 10.0) -> dict[str, dict[str, str]]:
    """:func:`topic_identity` of each of ``topics`` from one admin client and one DescribeTopics (the joiner asks for
    both inputs at every restore: a client and two round trips per topic doubled its wait on a slow broker). A topic
    the broker cannot describe (absent, denied) gets the cluster id only, logged (a WARNING once until its id is read
    again, then an INFO line); the others keep theirs."""
    out: dict[str, dict[str, str]] = {t: {} for t in topics}
    try:
        admin = AdminClient(admin_config(kafka))
        cluster = admin.list_topics(timeout=timeout_s).cluster_id
        futures = admin.describe_topics(TopicCollection(list(topics)), request_timeout=timeout_s)
    except KafkaException as exc:
        _say_ids_unread(kafka, topics, "could not read the ids of topics %s (%s)", exc)
        return out
    for topic in topics:
        out[topic] = {"cluster_id": cluster} if cluster else {}
        try:
            tid = futures[topic].result().topic_id
        except KafkaException as exc:
            _say_ids_unread(kafka, [topic], "could not read the id of topic %s (%s)", exc)
            continue
        if (kafka.bootstrap_servers, topic) in _ids_unread:
            _ids_unread.discard((kafka.bootstrap_servers, topic))
            log.info("the id of topic %s is read again", topic)
        if tid is not None and (tid.get_most_significant_bits() or tid.get_least_significant_bits()):
            out[topic]["topic_id"] = str(tid)
    return out


def _say_ids_unread(kafka: KafkaSettings, topics: Sequence[str], what: str, exc: KafkaException) -> None:
    """:func:`topic_identities`' WARNING that ``topics``' ids could not be read, once until each is read again (DEBUG
    meanwhile)."""
    keys = {(kafka.bootstrap_servers, t) for t in topics}
    said = keys <= _ids_unread
    _ids_unread.update(keys)
    (log.debug if said else log.warning)(
        what + ": a topic made again under its name goes untold (said once until it is read again)",
        ", ".join(topics), quoted(str(exc)))


def ensure_compacted(kafka: KafkaSettings, topic: str, partitions: int | None = None) -> None:
    """Create ``topic`` with ``cleanup.policy=compact``; on an existing topic, check the policy and set it
    if it is not compact (a state log that is never compacted grows for ever and a restore reads its
    whole retention), ``compact,delete`` included (retention deleted live records: a chunk still holding
    impressions, an idle partition's newest one, a claim). Raises :class:`StreamError` when the broker refuses."""
    admin = AdminClient(admin_config(kafka))
    if topic not in admin.list_topics(timeout=10).topics:
        new = NewTopic(topic, num_partitions=partitions or kafka.partitions,
                       replication_factor=kafka.replication_factor, config={"cleanup.policy": "compact"})
        for fut in admin.create_topics([new], operation_timeout=10).values():
            try:
                fut.result()
            except KafkaException as exc:
                if exc.args[0].code() != KafkaError.TOPIC_ALREADY_EXISTS:
                    raise
        ensure_topics(kafka, [topic], partitions)  # waits until its partitions show in metadata
    resource = ConfigResource(ResourceType.TOPIC, topic)
    configs = next(iter(admin.describe_configs([resource]).values())).result()
    entry = configs.get("cleanup.policy")
    if entry is not None and entry.value == "compact":
        return
    log.warning("topic %s has cleanup.policy=%s; setting it to compact (it holds keyed state)", topic,
                entry.value if entry is not None else "(default delete)")
    try:
        change = ConfigResource(ResourceType.TOPIC, topic, incremental_configs=[
            ConfigEntry("cleanup.policy", "compact", incremental_operation=AlterConfigOpType.SET)])
        next(iter(admin.incremental_alter_configs([change]).values())).result()
    except KafkaException as exc:
        raise StreamError(f"topic {topic} must be compacted (cleanup.policy=compact) and the broker refused to "
                          f"change it: {exc}. Set it with kafka-configs.sh --alter --entity-type topics "
                          f"--entity-name {topic} --add-config cleanup.policy=compact") from None


# -- message size limits -----------------------------------------------------------------------------------------
LIBRDKAFKA_MESSAGE_BYTES = 1_000_000  # librdkafka's default producer message.max.bytes
FALLBACK_MESSAGE_BYTES = 1_000_000  # when no limit can be read at all: below Apache Kafka's default (1 MiB + 12 bytes)


class MessageLimit(NamedTuple):
    """The largest record a topic takes from this process, and where that number comes from (said in errors)."""

    bytes: int
    source: str  # "topic max.message.bytes", "[kafka.extra] message.max.bytes", ...


def usable_bytes(limit: int) -> int:
    """How much of a record of at most ``limit`` bytes its value may take: the rest is left to the key, the headers
    and the record batch's framing (61 bytes and a few per record), and to lz4, which can grow an incompressible
    value by 0.4% (the broker checks the compressed batch)."""
    return limit - 1024 - limit // 200


def message_limits(kafka: KafkaSettings, topics: Iterable[str], producer_bytes: int | None, producer_source: str,
                   timeout_s: float = 10.0) -> dict[str, MessageLimit]:
    """Per topic, the largest record it takes from a producer whose ``message.max.bytes`` is ``producer_bytes``
    (named by ``producer_source``; None: not readable): the smaller of that and the topic's ``max.message.bytes`` read
    with DescribeConfigs. Apache Kafka reports a topic's effective value, its own or the broker's
    ``message.max.bytes`` it defaults to; a broker that does not answer, or answers without it (Tansu reports only
    what was set on the topic), leaves the producer's. Neither readable: ``FALLBACK_MESSAGE_BYTES``."""
    wanted = sorted(set(topics))
    found: dict[str, int] = {}
    try:
        admin = AdminClient(admin_config(kafka))
        futures = admin.describe_configs([ConfigResource(ResourceType.TOPIC, t) for t in wanted],
                                         request_timeout=timeout_s)
        for resource, fut in futures.items():
            entry = fut.result(timeout=timeout_s).get("max.message.bytes")
            if entry is not None and str(entry.value).isdigit():
                found[resource.name] = int(entry.value)
    except Exception as exc:  # noqa: BLE001 - a broker without DescribeConfigs (or without our right to it)
        log.warning("could not read the topics' max.message.bytes (%s); writing under the producer's limit",
                    quoted(str(exc)))
    out = {}
    for t in wanted:
        known = [(found[t], "topic max.message.bytes")] if t in found else []
        if producer_bytes is not None:
            known.append((producer_bytes, producer_source))
        out[t] = MessageLimit(*min(known)) if known else MessageLimit(FALLBACK_MESSAGE_BYTES, "a fallback (unknown)")
    return out


def raise_limit(topic: str, limit: MessageLimit) -> str:
    """What to change where ``topic`` takes records of at most ``limit``: the setting it came from."""
    if limit.source == "topic max.message.bytes":
        return (f"raise the topic's limit (kafka-configs.sh --alter --entity-type topics --entity-name {topic} "
                "--add-config max.message.bytes=1048588)")
    return f"raise {limit.source}"


def refused_as_too_large(exc: MessageTooLarge, limit: MessageLimit | None) -> MessageLimitError:
    """The :class:`MessageLimitError` for a record refused as too large (``exc``) although it was sized under
    ``limit``, the limit learned for its topic (None: not sized by that): names the topic, the setting and the fix.
    The one wording for every topic a process sizes its records for (the joiner's samples, state, late clicks and
    dead letters)."""
    topic = exc.topic or "?"
    learned = (f"sized under {limit.bytes} bytes, the limit learned for it ({limit.source})"
               if limit is not None else "not sized under a learned limit")
    return MessageLimitError(
        f"{quoted(str(exc), 300)}; the records for {topic} are {learned}, so the broker's (or the producer's) limit is "
        "lower than that: set [kafka.extra] message.max.bytes to at most the topic's max.message.bytes (records are "
        f"then written under it), or raise the topic's max.message.bytes (kafka-configs.sh --alter --entity-type "
        f"topics --entity-name {topic} --add-config max.message.bytes=1048588) and the broker's message.max.bytes")


# Refusals of a write that sending it again cannot change: the principal lacks WRITE on the topic, or IDEMPOTENT_WRITE
# on the cluster (the idempotent producer's InitProducerId, a fatal error)
_DENIED = frozenset({KafkaError.TOPIC_AUTHORIZATION_FAILED, KafkaError.CLUSTER_AUTHORIZATION_FAILED})


def _denied_writes(err: KafkaError, topic: str | None, who: str) -> DeliveryRefused:
    """The :class:`DeliveryRefused` for ``err`` (one of :data:`_DENIED`) on a write to ``topic`` by ``who``
    (``_who``): names the topic, the principal and the ACL to grant."""
    where = f"topic {topic}" if topic else "its topics"
    return DeliveryRefused(
        f"the broker denied {who} writes to {where} ({err.str()}); sending again is denied again: grant the principal "
        f"WRITE and DESCRIBE on {where} (kafka-acls.sh --add --allow-principal User:NAME --operation Write "
        f"--operation Describe --topic {topic or 'TOPIC'}) and IDEMPOTENT_WRITE on the cluster (the producers are "
        "idempotent), then restart", topic=topic)


@dataclass
class DeliveryReport:
    acked: dict[str, int] = field(default_factory=dict)  # topic -> messages acknowledged
    failed: int = 0
    first_error: str | None = None


FLUSH_MARGIN_S = 5.0  # past the delivery timeout: its reports served after it expires the last messages
# ``flush_answered`` waits this long in silence (most flushes end well within it), then says what it waits for and
# how long at most, and how many messages are still unanswered every FLUSH_TELL_S while it waits
FLUSH_QUIET_S = 3.0
FLUSH_TELL_S = 15.0


class AckedProducer:
    """An idempotent producer that counts acknowledgements and surfaces delivery errors.

    librdkafka reports only failed deliveries (``delivery.report.only.error``): a Python callback per
    successful message would cost more than building the message. After :meth:`flush` returns with
    nothing outstanding, every message sent and not reported failed was acknowledged.

    ``send`` never drops a message on a full local queue: it serves callbacks and retries.
    A produce refused with a fatal error (an idempotent producer fenced, or its sequence lost by a broker that lost
    data: librdkafka's producer is unusable for good) replaces the producer with a new one and raises: what the old
    one held is unacknowledged, so its caller's batch fails and is done again on the new one. It was kept, and the
    kafka joiner driver's in-process recovery (an outage: ``stream.strikes.is_infrastructure``) failed for ever. A fatal
    error first reported in ``flush`` or ``poll`` (a delivery report, ``error_cb``) renews it there, the same way: the
    batch done again no longer fails once more on the dead producer (a second rewind).
    ``flush`` raises :class:`DeliveryFailed` if any message failed since the previous ``flush``, or
    :class:`MessageTooLarge` when one of them was refused as too large (MSG_SIZE_TOO_LARGE: over the topic's
    ``max.message.bytes`` or the broker's ``message.max.bytes``): sending it again cannot succeed, so it is no outage
    to retry (a :class:`DeliveryFailed` is, ``stream.strikes.is_infrastructure``). A write the broker denies by
    authorization (TOPIC_/CLUSTER_AUTHORIZATION_FAILED: in a delivery report, at ``produce`` once librdkafka marked the
    topic refused, or as the idempotent producer's fatal error) is :class:`DeliveryRefused`, a ConfigError, for the
    same reason: it was a DeliveryFailed, and the joiner rewound and was denied again for ever ("Is the broker up?").
    A message for a partition its topic does not have (_UNKNOWN_PARTITION, at ``produce`` or in its report) is
    :class:`PartitionMissing`, a DeliveryFailed that names the topic: the joiner checks its layout on it.
    """

    def __init__(self, kafka: KafkaSettings, **extra: Any) -> None:
        conf = producer_config(kafka, **extra)
        conf["delivery.report.only.error"] = True
        self._conf = conf
        self._fatal: KafkaError | None = None  # a fatal error the callbacks just served reported (_renew_if_fatal)
        self._producer = self._client()
        self._bootstrap = kafka.bootstrap_servers
        self._who = _who(kafka)
        # the largest message produce() takes (librdkafka refuses bigger ones at once), and the setting that says it
        self.max_message_bytes = int(conf.get("message.max.bytes", LIBRDKAFKA_MESSAGE_BYTES))
        self.max_message_setting = ("[kafka.extra] message.max.bytes" if "message.max.bytes" in kafka.extra
                                    else "the producer's message.max.bytes")
        # librdkafka answers each message within its delivery timeout (message.timeout.ms, alias delivery.timeout.ms:
        # 300 s by default; 0: never times out), retrying until then: ``flush_answered`` waits that long
        timeout_ms = int(conf.get("message.timeout.ms", conf.get("delivery.timeout.ms", 300_000)))
        self.delivery_timeout_s = math.inf if timeout_ms == 0 else timeout_ms / 1000
        # the first delivery refused as too large since the last flush: (what, its topic)
        self._too_large: tuple[str, str] | None = None
        self._denied: DeliveryRefused | None = None  # the first delivery denied by authorization since the last flush
        self._missing: str | None = None  # the topic of the first message for a partition it lacks, since the flush
        self._sent: dict[str, int] = {}
        self._failed: dict[str, int] = {}
        self._acked_before: dict[str, int] = {}  # acknowledged before the last failed flush
        self.report = DeliveryReport()
        # produced into / reported failed by the current client (:meth:`delivered`); why the broker is unreachable,
        # as error_cb last said (all brokers down: :meth:`_on_client_error`), until the caller
        # sees deliveries again and clears it; called while ``send`` waits on a full queue (a caller's broker watch)
        self._produced, self._failed_total = 0, 0
        self.timed_out = 0  # deliveries of the current client that ran out their delivery timeout
        self.unreachable: str | None = None
        self._refused: str | None = None  # error_cb's last connection refused or not resolved (the reason said)
        self.waiting: Callable[[], None] = lambda: None

    def _client(self) -> Producer:
        """A librdkafka producer whose callbacks reach this object, weakly: client -> callback -> self -> client would
        be a cycle only the cyclic GC frees, and a GC pass in a forked DataLoader worker destroys the parent's client
        there (it hangs or crashes)."""
        return Producer({**self._conf, **_weak_callbacks(weakref.ref(self))})

    def _on_fatal(self, err: KafkaError) -> None:
        if _is_fatal(err) and self._fatal is None:
            self._fatal = err

    def _on_client_error(self, err: KafkaError) -> None:
        """librdkafka's ``error_cb``: a fatal error (:meth:`_on_fatal`), or the broker gone (every broker down), said
        the moment it happens, where a message waiting on it fails only at its delivery timeout (300 s by default).
        The reason given is the last connection refused or not resolved, where one came: one such alone is one broker
        of several (a cluster with a broker down, a bootstrap list naming one), and the others acknowledge."""
        self._on_fatal(err)
        if _unreachable([err]):
            self._refused = _text(err)
        if err.code() == KafkaError._ALL_BROKERS_DOWN:
            self.unreachable = self._refused or _text(err)

    def delivered(self) -> tuple[int, int]:
        """``(delivered, outstanding)``: messages of the current client acknowledged so far (produced, not held, not
        reported failed), and those it still holds (queued or in flight). Serves no callbacks (:meth:`poll` does)."""
        outstanding = len(self._producer)
        return self._produced - outstanding - self._failed_total, outstanding

    def _renew_if_fatal(self) -> None:
        """After a call that served callbacks (poll, flush): where they reported a fatal error, renew the producer
        there (the next send would only fail on the dead one: a second rewind for the joiner) and raise it."""
        if self._fatal is not None:
            err = self._fatal
            self._renew()
            if err.code() in _DENIED:
                raise _denied_writes(err, None, self._who)
            raise KafkaException(err)

    def _on_error(self, err: KafkaError | None, msg: Any) -> None:
        if err is None:
            return
        self._on_fatal(err)
        topic = msg.topic()
        if err.code() == KafkaError.MSG_SIZE_TOO_LARGE and self._too_large is None:
            self._too_large = (f"a message of {len(msg.value() or b'') + len(msg.key() or b'')} bytes for {topic} was "
                               f"refused by the broker as too large ({err.str()})", topic)
        if err.code() == KafkaError._UNKNOWN_PARTITION and self._missing is None:
            self._missing = topic
        if err.code() in _DENIED and self._denied is None:
            self._denied = _denied_writes(err, topic, self._who)
        self._failed[topic] = self._failed.get(topic, 0) + 1
        self._failed_total += 1
        self.timed_out += err.code() == KafkaError._MSG_TIMED_OUT
        self.report.failed += 1
        if self.report.first_error is None:
            self.report.first_error = f"{topic}: {err.str()}"

    def send(self, topic: str, value: bytes | None, key: bytes | str | None = None,
             headers: Headers | None = None, partition: int | None = None) -> None:
        kwargs: dict[str, Any] = {}
        if headers:
            kwargs["headers"] = list(headers)
        if partition is not None:
            kwargs["partition"] = partition
        self._produce_waiting(topic, value, key, kwargs)
        self._sent[topic] = self._sent.get(topic, 0) + 1
        self._produced += 1

    def send_run(self, topics: list[str], values: list[bytes | None], keys: list[Any]) -> None:
        """Many messages in a loop that calls ``produce`` and nothing else per message (the replay's unpaced
        chunks); a full local queue or a refused message is handled as :meth:`send` handles it, and the run's sent
        counts are added per topic at the end (up to the failing message when one raises; none when that renewed the
        producer: the old one held them)."""
        producer = self._producer
        produce = producer.produce
        done = counted = 0  # counted: of ``done``, those in ``_produced`` already (a full queue's wait needs them)
        try:
            for topic, value, key in zip(topics, values, keys):  # noqa: B905 (equal lengths; strict= costs per message)
                try:
                    produce(topic, value, key)
                except (BufferError, KafkaException):
                    self._produced, counted = self._produced + done - counted, done
                    self._produce_waiting(topic, value, key, {})
                done += 1
        finally:
            if self._producer is producer:
                self._produced += done - counted
            for topic, n in Counter(topics[:done] if self._producer is producer else ()).items():
                self._sent[topic] = self._sent.get(topic, 0) + n

    def _produce_waiting(self, topic: str, value: bytes | None, key: Any, kwargs: dict[str, Any]) -> None:
        """``produce``, serving callbacks and retrying while the local queue is full; never drops the message. A
        message over the producer's ``message.max.bytes`` is :class:`MessageTooLarge`."""
        produce = self._producer.produce
        while True:
            try:
                if kwargs:
                    produce(topic, value, key, **kwargs)
                else:
                    produce(topic, value, key)
                return
            except BufferError:
                self._producer.poll(0.05)
                self._renew_if_fatal()
                self.waiting()  # a full queue waits on the broker: its caller's watch may say so, or give up
            except KafkaException as exc:
                if exc.args and exc.args[0].code() == KafkaError.MSG_SIZE_TOO_LARGE:
                    raise MessageTooLarge(
                        f"a message of {len(value or b'') + len(key or b'')} bytes for {topic} is over "
                        f"{self.max_message_setting} ({self.max_message_bytes})", topic=topic) from None
                if exc.args and exc.args[0].code() in _DENIED:
                    raise _denied_writes(exc.args[0], topic, self._who) from None
                if exc.args and exc.args[0].code() == KafkaError._UNKNOWN_PARTITION:
                    raise PartitionMissing(f"{topic} has no partition {kwargs.get('partition')} "
                                           f"({exc.args[0].str()})", topic=topic) from None
                if exc.args and _is_fatal(exc.args[0]):
                    self._renew()
                raise

    def _renew(self) -> None:
        """A new producer for one a fatal error made unusable (class docstring); nothing it held unacknowledged counts
        as sent, and what earlier flushes confirmed stays in ``acked_total``."""
        for t, n in self.report.acked.items():
            self._acked_before[t] = self._acked_before.get(t, 0) + n
        _close_dead(self._producer)  # first: its purged messages' reports land in the report dropped below
        self._producer, self._fatal = self._client(), None
        self.report, self._too_large, self._denied, self._missing = DeliveryReport(), None, None, None
        self._sent.clear()
        self._failed.clear()
        self._produced, self._failed_total, self.timed_out = 0, 0, 0

    def poll(self, timeout_s: float = 0.0) -> None:
        """Serve the delivery reports in (waiting up to ``timeout_s`` for one); raise a fatal error they brought."""
        self._producer.poll(timeout_s)
        self._renew_if_fatal()

    def flush_answered(self) -> DeliveryReport:
        """:meth:`flush` until librdkafka has answered every message (its delivery timeout and a margin): a message
        a shorter flush counts as unacknowledged may still be delivered after it (the caller's rerun, told it was not,
        then sends it twice)."""
        timeout_s = self.delivery_timeout_s + FLUSH_MARGIN_S
        return self._settled(self._wait_told(timeout_s), timeout_s)

    def _wait_told(self, timeout_s: float) -> int:
        """librdkafka's flush for up to ``timeout_s`` (inf: no limit), saying so where it takes long: with a broker
        slow or down that is minutes, and a wait in silence looked like a hang. A wait past :data:`FLUSH_QUIET_S` is
        told in one line (how many messages, how long at most), then every :data:`FLUSH_TELL_S` how many are still
        unanswered. Returns how many are unanswered at the end. A signal's exception (Ctrl-C, a handler's) leaves
        librdkafka's flush as it did when it was one call."""
        deadline = time.monotonic() + timeout_s
        left = self._producer.flush(min(FLUSH_QUIET_S, timeout_s))
        if not left or self._fatal is not None:
            return left
        most = ("no limit: message.timeout.ms is 0" if math.isinf(timeout_s)
                else f"up to {timeout_s - FLUSH_QUIET_S:.0f} s more")
        log.warning("waiting for %d message(s) to be acknowledged by %s (%s: the producer's delivery timeout and a "
                    "margin); a broker slow or down holds them this long", left, self._bootstrap, most)
        while left and self._fatal is None and (rest := deadline - time.monotonic()) > 0:
            left = self._producer.flush(min(FLUSH_TELL_S, rest))
            if left and self._fatal is None and deadline - time.monotonic() > 0:
                log.warning("still waiting for %d message(s) to be acknowledged by %s (%s)", left, self._bootstrap,
                            "no limit" if math.isinf(deadline) else f"up to {deadline - time.monotonic():.0f} s more")
        return left

    def flush(self, timeout_s: float = 60.0) -> DeliveryReport:
        return self._settled(self._producer.flush(timeout_s), timeout_s)

    def _settled(self, remaining: int, timeout_s: float) -> DeliveryReport:
        """The report of a flush of up to ``timeout_s`` that left ``remaining`` messages unanswered (:meth:`flush`)."""
        if self._fatal is not None:
            err = self._fatal
            self._renew()  # what it held since the last flush is not claimed; the next send goes to a new producer
            if err.code() in _DENIED:
                raise _denied_writes(err, None, self._who)
            raise DeliveryFailed(f"the producer for {self._bootstrap} had a fatal error ({err.str()}); the messages "
                                 "sent since the last flush were not acknowledged, and a new producer replaced it")
        self.report.acked = {t: n - self._failed.get(t, 0) for t, n in self._sent.items()}
        if remaining:
            self.report.failed += remaining
            self.report.acked = {}  # unknown which ones: claim none
            self.report.first_error = (self.report.first_error
                                       or f"{remaining} messages unacknowledged after {timeout_s}s")
        if self.report.failed:
            # Told once: a caller that recovers (and sends again) starts with a clean report. The epoch's
            # acknowledgements still count towards acked_total: exactly when every message was answered,
            # else as a lower bound (each unanswered one counted against every topic).
            for t, n in self._sent.items():
                self._acked_before[t] = self._acked_before.get(t, 0) + max(0, n - self._failed.get(t, 0) - remaining)
            error = self._failure()
            self.report = DeliveryReport()
            self._failed.clear()
            self._sent.clear()
            self._too_large, self._denied, self._missing = None, None, None
            raise error
        return self.report

    def raise_failed(self) -> None:
        """Raise now what the next :meth:`flush` would raise for the deliveries reported failed so far (served by a
        :meth:`poll`), without waiting for the rest: a caller that sends for hours (a paced replay) stops at the first
        failure instead of at its last flush. Nothing is settled here: the caller's stop flush counts what was
        acknowledged (and raises the same kind of error again, with every failure counted). One attribute read when
        nothing failed."""
        if self.report.failed:
            raise self._failure()

    def _failure(self) -> Exception:
        """The error for the deliveries this report counts failed (class docstring: which error for which refusal)."""
        failed, first = self.report.failed, self.report.first_error
        if self._denied is not None:
            return DeliveryRefused(str(self._denied), topic=self._denied.topic)  # a copy: raised once more at the flush
        if self._too_large is not None:
            too_large, topic = self._too_large
            return MessageTooLarge(f"{too_large}; {failed} message(s) failed", topic=topic)
        if self._missing is not None:
            return PartitionMissing(f"{failed} message(s) were not acknowledged by {self._bootstrap}; first error: "
                                    f"{first} (a partition {self._missing} does not have)", topic=self._missing)
        return DeliveryFailed(f"{failed} message(s) were not acknowledged by {self._bootstrap}; first error: {first}. "
                              "Is the broker up (`streamrec stack status`)?")


    @property
    def acked_total(self) -> dict[str, int]:
        """Messages acknowledged per topic over this producer's life, as of the last :meth:`flush`; a lower
        bound when a flush timed out with messages unanswered, never more than the broker confirmed."""
        out = dict(self._acked_before)
        for t, n in self.report.acked.items():
            out[t] = out.get(t, 0) + n
        return out


def _close_dead(producer: Producer) -> None:
    """Close a producer a fatal error made unusable, without waiting: it can deliver nothing more, and ``close()``
    alone waits for what it holds (up to its delivery timeout). Dropped unclosed, its librdkafka threads and queues
    lived on while anything (a traceback) referred to it."""
    steps: tuple[Callable[[], object], ...] = (
        lambda: producer.purge(in_queue=True, in_flight=True),
        lambda: producer.flush(0),  # the purged messages' reports: failed, into the report the renewal drops
        producer.close)
    for step in steps:  # each alone: a purge librdkafka refuses must not leave the producer unclosed
        try:
            step()
        except (KafkaException, RuntimeError) as exc:  # closed already, or librdkafka refusing
            log.debug("closing a producer after its fatal error: %s", exc)


def _is_fatal(err: KafkaError) -> bool:
    """librdkafka's producer is unusable for good (``error_cb`` carries the underlying error marked fatal)."""
    return err.fatal() or err.code() == KafkaError._FATAL


def _weak_callbacks(ref: weakref.ReferenceType[AckedProducer]) -> dict[str, Callable[..., None]]:
    """``on_delivery`` and ``error_cb`` calling the ``AckedProducer`` ``ref`` points to, while it lives
    (``AckedProducer._client``)."""
    def on_delivery(err: KafkaError | None, msg: Any) -> None:
        producer = ref()
        if producer is not None:
            producer._on_error(err, msg)

    def error_cb(err: KafkaError) -> None:
        producer = ref()
        if producer is not None:
            producer._on_client_error(err)

    return {"on_delivery": on_delivery, "error_cb": error_cb}


def headers_of(msg: Message) -> Headers | None:
    """A consumed message's headers. Raises :class:`BadMessage` (``bad_header``) for a header key that is not UTF-8
    (Kafka's keys are bytes; another producer may write any). confluent-kafka (2.16) then returns a (key, value) pair
    with an empty key slot and its UnicodeDecodeError still set: CPython raises a SystemError, the UnicodeDecodeError
    at a later call, or (a specialised call site, no check) nothing. It keeps the broken list for the message's next
    ``headers()``, and reading the empty slot segfaults. So this is called once per message, and finds an empty slot
    without reading it: ``gc.get_referents`` skips it."""
    try:
        headers = msg.headers()
        broken = any(len(gc.get_referents(pair)) != len(pair) for pair in headers or ())
    except (SystemError, UnicodeDecodeError):
        broken = True
    if broken:
        raise header_key_not_utf8()
    return headers  # type: ignore[return-value]  # consumed: a list of (str, bytes | None)


def headers_whole(lists: Iterable[Headers | None]) -> bool:
    """Whether no (key, value) pair of ``lists`` (consumed messages' ``headers()``, each read once) has the empty slot
    :func:`headers_of` looks for: its check for a whole batch, in one C-level call (~0.2 us a message with two headers,
    where :func:`headers_of` a message cost ~1.1 us, on the joiner's per-batch path)."""
    pairs = list(chain.from_iterable(filter(None, lists)))
    return len(gc.get_referents(*pairs)) == sum(map(len, pairs))


def header_key_not_utf8() -> BadMessage:
    """Why a message whose header key is not UTF-8 is dead-lettered (its headers cannot be read, so none are kept)."""
    return BadMessage("a header key that is not UTF-8 (the message's headers are not kept)", kind="bad_header")


def has_more(consumer: Consumer, topic: str, partition: int, unknown: bool = False) -> bool:
    """Whether ``partition`` of ``topic`` has records past what ``consumer`` has handed out (:func:`fetched_more`).
    Unknown (no fetch yet, an error) counts as ``unknown``: no by default, since callers use it to hold other inputs
    back (``stream/alignment.py``) and a guess must not stall them; a caller with its own timeout for an input that
    sends nothing (the learner's merge, ``idle_s``; the joiner's hold, ``backpressure.Unfetched``) may count it as
    yes."""
    more = fetched_more(consumer, topic, partition)
    return unknown if more is None else more


def fetched_more(consumer: Consumer, topic: str, partition: int, start: int | None = None) -> bool | None:
    """Whether ``partition`` of ``topic`` has records past what ``consumer`` has handed out, by the high watermark
    its fetcher last saw (no broker round trip); None while that is unknown (not fetched since the assignment, an
    error). The cached high watermark is the one fetch responses carry, the partition's true end on the local
    broker too (measured: 60 after three record batches of 20, where its ListOffsets answer, ``cached=False``, says 41:
    the start of the last record batch + 1).

    librdkafka's position is unknown until a record of the assignment is handed out, so a partition assigned at its end
    read as "more" for as long as nothing came (the joiner's hold kept the other input back for good after a rebalance
    or restart). ``start``, the offset the caller assigned or sought it at (``stream.retention.Gaps.next``), stands in
    for that position; without it (a logical start: a group's first assignment starts at the beginning) an unknown
    position still counts as more, unless the partition holds no record at all: its low watermark (the log start
    offset fetch responses carry) equal to its high one, as after retention or DeleteRecords removed every record (a
    new group's hold kept the other input back for good there, the partition having nothing to hand out)."""
    tp = TopicPartition(topic, partition)
    try:
        low, high = consumer.get_watermark_offsets(tp, cached=True)
        position = consumer.position([tp])[0].offset
    except KafkaException:
        return None
    if high < 0:  # not fetched yet
        return None
    if high == 0 or high == low:  # empty: never written, or every record deleted
        return False
    if position < 0 and start is not None and start >= 0:
        position = start
    return position < 0 or position < high


def resume_offsets(consumer: Consumer, partitions: list[TopicPartition], reader: str) -> list[TopicPartition]:
    """Start positions for ``partitions``: the group's committed offsets, made safe for brokers whose
    high watermark lags (Tansu reports the base offset of the last record batch + 1), and checked against
    retention for ``reader`` (the joiner, an ``EventReader`` stage: the name its losses are logged and counted by).

    Resuming at an offset inside a partition's last record batch makes such a broker return nothing
    until more data arrives, so a consumer resuming there would stall on a bounded input. Where the
    committed offset is beyond the reported high watermark, start from the batch's base offset
    instead (high watermark - 1): the records in between are delivered again, and every streamrec
    consumer skips records it has already applied (they come with offsets). On Apache Kafka the
    committed offset never exceeds the high watermark unless the topic was deleted and created again (its offsets
    start over; the records before the committed offset are the new topic's, and a streamrec consumer skips them as
    applied): a committed offset more than one record batch (``BATCH_MESSAGES``, what streamrec's producers put in
    one) past the high watermark cannot be Tansu's lag and is logged as a WARNING naming that cause. It still starts
    at the high watermark - 1: that is right on Tansu, and on a recreated topic the consumer's state is keyed by the
    old topic's offsets, which no start position here can mend.
    A committed offset below the partition's low watermark (retention or DeleteRecords removed records the
    consumer never read) starts at the low watermark, the loss logged as an ERROR and counted
    (``stream.retention``); librdkafka's reset to the earliest offset would have said nothing. The low watermark is
    then committed for that partition (no record lies between), so the next assignment, rewind or restart does not
    say and count the same loss again. Partitions without a committed offset start at the beginning.
    """
    out = []
    lows: dict[tuple[str, int], int] = {}
    for tp in consumer.committed(partitions, timeout=10):
        offset = tp.offset
        if offset >= 0:
            low, high = consumer.get_watermark_offsets(TopicPartition(tp.topic, tp.partition), timeout=10)
            lows[(tp.topic, tp.partition)] = low
            if offset > high:
                start = max(high - 1, low, 0)  # not below the first record held: that is no loss
                if offset - high > BATCH_MESSAGES:
                    log.warning("%s: the committed offset %d of %s partition %d is %d past the partition's end (%d), "
                                "more than one record batch: the topic was probably deleted and created again (its "
                                "offsets started over). Starting at offset %d; the records before the committed "
                                "offset count as read. Reset this reader's group offsets (and its state) if the topic "
                                "is new", reader, offset, tp.topic, tp.partition, offset - high, high, start)
                offset = start
        else:
            offset = OFFSET_BEGINNING
        out.append(TopicPartition(tp.topic, tp.partition, offset))
    starts = account_for_retention(reader, out, lows)[0]
    # the group's offset moved past what is gone (nothing lies between), whether said now or earlier by this process
    # (stream.retention.Gaps): a rebalance, a rewind or a restart before anything new of the partition is processed
    # does not say and count the loss again (the review's 4 ERROR lines and a fourfold count for one loss)
    moved = [s for s, o in zip(starts, out, strict=True) if 0 <= o.offset < s.offset]
    if moved:
        try:
            consumer.commit(offsets=moved, asynchronous=False)
        except KafkaException as exc:
            log.warning("%s: could not commit the offsets past the records lost (%s): the loss may be said and counted "
                        "again at the next assignment", reader, quoted(str(exc)))
    return starts


def new_consumer(kafka: KafkaSettings, group_id: str, **extra: Any) -> Consumer:
    return Consumer(consumer_config(kafka, group_id, **extra))


# A broker call a reader's stop check must not wait behind (``between`` of watermarks, read_to_end): asked in tries of
# at most this long, the check between them. librdkafka's metadata and offset requests ran out their whole timeout
# (10 s, holdout_timeout_s) with the broker down before the refresh saw a stop it had kept pending.
BROKER_TRY_S = 0.5
# what such a request raises when it ran out of time: _TRANSPORT (metadata) and _ALL_BROKERS_DOWN (offsets) with the
# broker down, _TIMED_OUT with it slow
_RAN_OUT = frozenset({KafkaError._TIMED_OUT, KafkaError._TRANSPORT, KafkaError._ALL_BROKERS_DOWN})


def _in_tries(call: Callable[[float], Any], timeout_s: float, between: Callable[[], object] | None) -> Any:
    """``call(timeout)`` bounded by ``timeout_s`` in all; with ``between``, asked in tries of at most
    :data:`BROKER_TRY_S` with ``between()`` after each that ran out (outside the ``except``: the refresh's stop check
    keeps a stop pending while an exception is in flight), the last try's error raised once ``timeout_s`` is spent.
    After a ``_TIMED_OUT`` (the broker is up, its answer slower than a try) the next try has all the time left: a
    re-asked request starts again, so a broker answering in 0.8 s timed out every 0.5 s try, and the call failed."""
    if between is None:
        return call(timeout_s)
    deadline, slow = time.monotonic() + timeout_s, False
    while True:
        left = deadline - time.monotonic()
        try:
            return call(max(0.0, left if slow else min(BROKER_TRY_S, left)))
        except KafkaException as exc:
            err = exc.args[0] if exc.args else None
            if not isinstance(err, KafkaError) or err.code() not in _RAN_OUT or left <= BROKER_TRY_S or slow:
                raise
            slow = err.code() == KafkaError._TIMED_OUT
        between()


def watermarks(kafka: KafkaSettings, topic: str, timeout_s: float = 10.0,
               between: Callable[[], object] | None = None) -> dict[int, tuple[int, int]]:
    """``{partition: (low, high)}`` of ``topic``; empty when the topic does not exist. The local broker's
    high watermark may lag by one record batch (:func:`resume_offsets`): read to the end with
    :func:`read_to_end`, not to ``high``. Each request is bounded by ``timeout_s``; ``between`` (a stop check) is
    called between its tries (:func:`_in_tries`) and between partitions."""
    c = new_consumer(kafka, f"{kafka.client_id}-watermarks-{uuid.uuid4().hex[:8]}")
    try:
        md = _in_tries(lambda t: c.list_topics(topic, timeout=t), timeout_s, between).topics.get(topic)
        if md is None or md.error is not None:
            return {}
        marks: dict[int, tuple[int, int]] = {}
        for p in sorted(md.partitions):
            if between is not None and marks:
                between()
            tp = TopicPartition(topic, p)
            marks[p] = _in_tries(lambda t: c.get_watermark_offsets(tp, timeout=t), timeout_s, between)  # noqa: B023 - called in this iteration
        return marks
    finally:
        c.close()


def read_to_end(kafka: KafkaSettings, topic: str, handle: Callable[[Message], None], *,
                start: Mapping[int, int] | None = None, timeout_s: float | None = 60.0, stall_s: float | None = None,
                batch: int = 10_000, between: Callable[[], object] | None = None) -> list[int]:
    """Read partitions of ``topic`` to their end, handing every record to ``handle``; returns the partitions read.

    The one read-to-the-end loop (state restore, the refresh's holdout, test and bench readers). ``start``
    maps partition -> first offset (``OFFSET_BEGINNING`` allowed); None reads every partition from the
    beginning. Partitions the topic does not have, or a topic that does not exist, are skipped. A
    partition's end is its partition-EOF event after its last record, not the high watermark (which the
    local broker under-reports, environment.md). Records come in offset order per partition. Assigned
    without joining a group: nothing is committed. ``TimeoutError`` naming the partitions that did not
    reach their end within ``timeout_s`` (None: no bound on the whole read), or, with ``stall_s``, while no record
    and no end came for ``stall_s``: a reader of a topic others keep writing to needs the first (it may never see
    every partition at its end at once), a restore of a log only its reader writes the second (a large log takes as
    long as it takes, a broker that stops answering does not). An exception from ``handle`` propagates (the consumer
    is closed); so does one from ``between``, called after each poll and between the tries of the metadata request
    (:func:`_in_tries`; the refresh's stop check: a stop need not wait for the end of the read).
    """
    c = new_consumer(kafka, f"{kafka.client_id}-reader-{uuid.uuid4().hex[:8]}", **{"fetch.wait.max.ms": 20})
    try:
        md = _in_tries(lambda t: c.list_topics(topic, timeout=t), min(10.0, timeout_s or 10.0, stall_s or 10.0),
                       between).topics.get(topic)
        if md is None or md.error is not None:
            return []
        wanted = {p: OFFSET_BEGINNING for p in md.partitions} if start is None else dict(start)
        present = sorted(p for p in wanted if p in md.partitions)
        if not present:
            return []
        c.assign([TopicPartition(topic, p, wanted[p]) for p in present])
        todo = set(present)
        began = progress = time.monotonic()
        while todo:
            now = time.monotonic()
            if timeout_s is not None and now - began > timeout_s:
                raise TimeoutError(f"topic {topic} partitions {sorted(todo)} did not reach their end in {timeout_s:g}s")
            if stall_s is not None and now - progress > stall_s:
                raise TimeoutError(f"topic {topic} partitions {sorted(todo)}: no record and no end for {stall_s:g}s "
                                   f"(after {now - began:.0f}s of reading)")
            got = c.consume(batch, 0.2)
            for m in got:
                err = m.error()
                if err is not None:
                    if err.code() == KafkaError._PARTITION_EOF:
                        todo.discard(m.partition())
                    continue
                todo.add(m.partition())  # a record after an end: its partition ends at the next EOF
                handle(m)
            if got:  # (after handling them: time in ``handle`` is not the broker's stall)
                progress = time.monotonic()
            if between is not None:
                between()
        return present
    finally:
        c.close()
