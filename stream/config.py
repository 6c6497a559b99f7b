"""How every stage talks to Kafka and Redis: the two configs shared across the pipeline.

Frozen dataclasses with the embedded defaults (a local stack on loopback); ``streamrec/settings.py``
fills them from a file, the environment and flags at the process edge, and nothing below reads
``os.environ``."""

from __future__ import annotations

import enum
import math
import re
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, ClassVar, TypeVar
from urllib.parse import SplitResult, parse_qs, unquote, urlsplit

from stream.errors import ConfigError, shown
from stream.secrets import MASK, Secret, redact, redacted_repr

C = TypeVar("C", bound="Choice")


# The upper bound of every duration (and rate, factor) a class gives no tighter one: ten years of seconds. Past it
# a value is a typo, and 1e30 passed the check and overflowed a timer, a datetime or a wait later.
DURATION_CAP_S = 10 * 365.25 * 86400


def check_durations(section: str, settings: Any, *, zero_ok: Collection[str] = (),
                    max_s: float = DURATION_CAP_S, extra: Iterable[str] = ()) -> None:
    """The one check of a settings dataclass's durations: every field named ``*_s`` (and those in ``extra``:
    rates, factors) must be a finite number > 0, or >= 0 for the names in ``zero_ok`` (where 0 means off), and
    at most ``max_s`` (ten years of seconds unless the class gives less). ``None`` passes (an optional setting left
    unset). A ``ConfigError`` otherwise: 0 or a negative period pins a core in a busy loop, NaN compares False with
    everything and inf overflows a wait."""
    names = [f.name for f in fields(settings) if f.name.endswith("_s")] + list(extra)
    for name in names:
        value = getattr(settings, name)
        if value is None:
            continue
        low = 0.0 if name in zero_ok else None
        ok = (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
              and (value >= 0 if low is not None else value > 0) and value <= max_s)
        if not ok:
            bound = ">= 0" if low is not None else "> 0"
            unit = "of seconds " if name.endswith("_s") and not name.endswith("_per_s") else ""  # (a rate: per s)
            past = isinstance(value, (int, float)) and not isinstance(value, bool) and value > max_s  # (inf too)
            cap = f" and <= {max_s:g}" if past else ""
            raise ConfigError(f"[{section}] {name} must be a finite number {unit}{bound}{cap}, got {value!r}")


# The upper bound of every count a class gives no bound of its own (``at_most``): no count streamrec keeps reaches a
# trillion (samples, rows, bytes, days); past it a value is a typo, and past 2**63 it reached the C code under a
# setting and failed there (confluent-kafka's NewTopic: "OverflowError: Python int too large to convert to C long";
# torch: "Overflow when unpacking long long", after the learner had read its samples). Counts that size memory have
# tighter bounds, each given by its class and said in the setting's comment.
MAX_COUNT = 10**12


def check_counts(section: str, settings: Any, *, zero_ok: Collection[str] = (),
                 at_most: Mapping[str, int] | None = None) -> None:
    """The one check of a settings dataclass's counts: every ``int`` field (sizes, caps, windows in rows, attempts,
    seeds) but the ports (:func:`check_ports`) and the ``*_s`` durations (:func:`check_durations`) must be an integer
    >= 1, or >= 0 for the names in ``zero_ok`` (where 0 means none, off or no bound: each class says which), and at
    most ``at_most[name]`` (where a larger value breaks something or sizes absurd memory), else :data:`MAX_COUNT`.
    ``None`` passes where the field is optional (left unset). A ``ConfigError`` otherwise: 0 or a negative count
    misbehaves late or silently (empty batches for ever, ``list[:-0]`` pruning nothing, a whole batch trained as one
    step). The error states the upper bound where the class gives one or the value is past it."""
    caps = dict(at_most or {})
    counts = {}
    for f in fields(settings):
        text = str(f.type).replace(" ", "").replace("<class'int'>", "int")
        if text in ("int", "int|None", "None|int", "Optional[int]") and not (
                f.name == "port" or f.name.endswith(("_port", "_s"))):
            counts[f.name] = text != "int"
    unknown = (set(zero_ok) | set(caps)) - set(counts)
    if unknown:  # a typo in a class's own list: a programming error, not a configuration one
        raise TypeError(f"check_counts: {sorted(unknown)} are not count fields of {type(settings).__name__}")
    for name, optional in counts.items():
        value = getattr(settings, name)
        if value is None and optional:
            continue
        low, cap = (0 if name in zero_ok else 1), caps.get(name, MAX_COUNT)
        if isinstance(value, bool) or not isinstance(value, int) or value < low or value > cap:
            shown_cap = name in caps or (isinstance(value, int) and value > cap)
            bound = f">= {low}" + (f" and <= {cap}" if shown_cap else "")
            raise ConfigError(f"[{section}] {name} must be an integer {bound}, got {shown(value)}")


def check_ports(section: str, settings: Any, *, lowest: int = 0) -> None:
    """Every port setting of a settings dataclass (an int field named ``port`` or ``*_port``) is ``None`` (unset) or an
    integer in ``lowest``..65535 (0: the system picks a free port; ``lowest=1`` where a fixed port is needed), and no
    two name the same fixed port. A :class:`ConfigError` otherwise: out of range, bind() raises OverflowError (or a
    confusing gaierror for -1); one port twice, the second listener finds it taken by the first (the stack's Redis
    on its own broker's port was "in use by a process this stack did not start")."""
    taken: dict[int, str] = {}
    for name in (f.name for f in fields(settings)
                 if (f.name == "port" or f.name.endswith("_port")) and "int" in str(f.type)):  # not reuse_port
        value = getattr(settings, name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or not lowest <= value <= 65535:
            raise ConfigError(f"[{section}] {name} must be a port number {lowest}-65535, got {value!r}")
        if value and value in taken:  # (0 is a different free port for each)
            raise ConfigError(f"[{section}] {name} and {taken[value]} are both {value}: give each its own port")
        taken[value] = name


def checked_bootstrap_servers(servers: str, protocol: str) -> str:
    """``[kafka] bootstrap_servers`` checked, in its one written form: comma-separated ``host:port`` entries (``[v6
    address]:port`` too), each a host and a port 1-65535, the white space around each dropped and a ``PROTOCOL://``
    prefix (librdkafka's form, ``SSL://kafka-1:9093``) dropped when it is ``protocol``, the client's security
    protocol, which it then only repeats (the faust driver puts ``kafka://`` before each entry itself). A
    ``ConfigError`` naming the entry and the fix otherwise, at start: librdkafka drops an entry with any other prefix
    (``kafka://``, or ``SSL://`` under PLAINTEXT) and reads a port that is no number as 0 and 70000 as 4464, and its
    client waited for a broker until its timeout, then said only "Broker transport failure"."""
    text, out = str(servers), []
    at = "@" in text  # a password may hold a comma: then no entry is quoted, the one before it leaks
    entries = text.split(",")
    for n, raw in enumerate(entries, 1):
        entry = raw.strip()
        name = "an entry" if at else shown(entry)
        scheme, sep, rest = entry.partition("://")
        if entry and sep and not at:
            given = scheme.upper()
            if given not in {p.value for p in SecurityProtocol}:
                raise ConfigError(f"[kafka] bootstrap_servers: {name} begins with {shown(scheme + sep)}, which is no "
                                  "prefix librdkafka takes (it drops the entry): give host:port, or a prefix of "
                                  f"security_protocol ({protocol}://host:port), got {_shown_servers(text)}")
            if given != str(protocol):
                raise ConfigError(f"[kafka] bootstrap_servers: {name} says {given}:// but [kafka] security_protocol "
                                  f"is {protocol} (librdkafka drops the entry): set security_protocol = \"{given}\" "
                                  f"or leave the prefix out, got {_shown_servers(text)}")
            entry = rest
        host, _, port = entry.rpartition(":")
        bare = host[1:-1] if host.startswith("[") and host.endswith("]") else host
        if not entry and len(entries) > 1:
            raise ConfigError(f"[kafka] bootstrap_servers: entry {n} of {len(entries)} is empty (two commas in a row, "
                              f"or one at an end): remove the comma, got {_shown_servers(text)}")
        if not (bare.strip() and "/" not in bare and "@" not in bare and not any(c.isspace() for c in bare)
                and port.isascii() and port.isdigit() and len(port) <= 5 and 1 <= int(port) <= 65535):
            userinfo = "; a user:password@ has no place here: give them as [kafka] sasl_username and " \
                       "sasl_password_file" if at else ""
            raise ConfigError(f"[kafka] bootstrap_servers: {name} is not host:port (a host, a port 1-65535); give "
                              f"comma-separated entries like \"kafka-1:9092,kafka-2:9092\", got "
                              f"{_shown_servers(text)}{userinfo}")
        out.append(entry)
    return ",".join(out)


def _shown_servers(text: str) -> str:
    """``text`` for a message, up to its last ``@`` masked: a ``user:password@`` written into it, as into a URL but
    without the scheme :func:`~stream.secrets.redact` needs to see a URL, was quoted whole (an entry of it is not
    quoted apart: a comma in the password split it, and the entry before the comma was quoted whole)."""
    return shown(MASK + text[text.rindex("@"):] if "@" in text else text)


# Kafka's rule for a topic name (the broker's Topic.validate): 1 to 249 characters, each an ASCII letter or digit, '.',
# '_' or '-', and not "." or "..". The one definition: every setting that names a topic (or a part of one) is checked
# by it where its settings are built, and monitor/rules.py checks its [sinks] kafka_topic by it.
MAX_TOPIC_CHARS = 249
TOPIC_RULE = "a Kafka topic name is 1 to 249 of letters, digits, '.', '_' and '-', and not '.' or '..'"
_TOPIC_CHARS = re.compile(r"[A-Za-z0-9._-]*")


def topic_problem(name: object) -> str | None:
    """None when ``name`` is a legal Kafka topic name, else what is wrong with it (a phrase: "is empty", ...)."""
    if not isinstance(name, str):
        return f"is a {type(name).__name__}, not text"
    if not name:
        return "is empty"
    if name in (".", ".."):
        return f"is {name!r}"
    if len(name) > MAX_TOPIC_CHARS:
        return f"is {len(name)} characters long, more than {MAX_TOPIC_CHARS}"
    if not _TOPIC_CHARS.fullmatch(name):
        return f"holds {shown(''.join(dict.fromkeys(c for c in name if not _TOPIC_CHARS.fullmatch(c))))}"
    return None


def check_topic(setting: str, name: object) -> None:
    """A :class:`ConfigError` naming ``setting`` unless ``name`` is a legal Kafka topic name (:func:`topic_problem`):
    the broker refuses a topic by any other name."""
    if problem := topic_problem(name):
        raise ConfigError(f"{setting}: {shown(name)} {problem}; {TOPIC_RULE}")


def check_group_id(setting: str, group: object) -> None:
    """A consumer group id as librdkafka takes it: text that is not empty once its ASCII whitespace is stripped, and
    without NUL (which ends it there). librdkafka takes "" (or " ", "\\n") as no group id at all, and confluent-kafka
    then aborted the whole process (an assertion in Consumer_init); any other text is a group id to Kafka."""
    if not isinstance(group, str) or not group.strip(" \t\n\v\f\r") or "\0" in group:
        raise ConfigError(f"{setting}: got {shown(group)}, expected a consumer group id: non-empty text, not only "
                          "spaces, without NUL")
    if group != group.strip():  # "g\n" (a variable filled from a file) is another group than "g": its offsets not read
        raise ConfigError(f"{setting}: got {shown(group)}, which has a space or a line ending around it: remove it")


class Choice(str, enum.Enum):
    """A setting with a fixed set of values (a driver, a device, a format): a ``str`` that prints as its value.

    Settings dataclasses call :meth:`of` in ``__post_init__``, so a wrong value is a :class:`ConfigError`
    where the dataclass is built (file, environment, flag or code) and everything below compares members.
    Stored state (checkpoints, manifests) keeps the plain ``.value``.
    """

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)

    @classmethod
    def of(cls: type[C], value: Any, setting: str) -> C:
        try:
            return cls(value)
        except ValueError:
            raise ConfigError(f"{setting}: got {value!r}, expected one of {', '.join(m.value for m in cls)}") from None


class SecurityProtocol(Choice):
    """``[kafka] security_protocol``: librdkafka's ``security.protocol`` (faust: ``broker_credentials``)."""

    PLAINTEXT = "PLAINTEXT"
    SSL = "SSL"
    SASL_PLAINTEXT = "SASL_PLAINTEXT"
    SASL_SSL = "SASL_SSL"

    @classmethod
    def _missing_(cls, value: object) -> SecurityProtocol | None:
        """Any case (``"ssl"``), as librdkafka reads ``security.protocol``: the canonical member, so each reader (the
        librdkafka conf, the faust driver's credentials, the bootstrap_servers prefix rule) sees one form.
        (``sasl.mechanism`` stays exact: librdkafka refuses ``"plain"``.)"""
        upper = value.upper() if isinstance(value, str) else None
        return next((m for m in cls if m.value == upper), None)

    @property
    def sasl(self) -> bool:
        return self in (SecurityProtocol.SASL_PLAINTEXT, SecurityProtocol.SASL_SSL)

    @property
    def tls(self) -> bool:
        return self in (SecurityProtocol.SSL, SecurityProtocol.SASL_SSL)


class SaslMechanism(Choice):
    """``[kafka] sasl_mechanism`` (used only with ``SASL_*``). OAUTHBEARER takes its configuration from
    ``[kafka.extra]`` (``sasl.oauthbearer.*``) and works with the confluent-kafka clients only."""

    PLAIN = "PLAIN"
    SCRAM_SHA_256 = "SCRAM-SHA-256"
    SCRAM_SHA_512 = "SCRAM-SHA-512"
    OAUTHBEARER = "OAUTHBEARER"


# librdkafka's max.poll.interval.ms unless [kafka.extra] sets it: the kafka driver's, and the faust driver's too
# (faust's own default is 1000 s; stream/joiner/worker.py maps the property onto it)
MAX_POLL_INTERVAL_MS = 300_000

_VERIFY_CERTIFICATES = "enable.ssl.certificate.verification"
# librdkafka's spellings of a boolean property (rdkafka_conf.c, _RK_C_BOOL): these, in any case, and nothing around
# them (" f", "yes", "off" it refuses when a client is built)
_LIBRDKAFKA_BOOL = {"true": True, "t": True, "1": True, "false": False, "f": False, "0": False}


def librdkafka_bool(key: str, raw: str) -> bool:
    """A boolean ``[kafka.extra]`` property as librdkafka reads it, for code that must act on it too (the faust driver
    maps it onto its TLS context): the faust driver took ``"f"`` for true, librdkafka for false. A spelling librdkafka
    refuses is a ConfigError naming the property, for both drivers alike."""
    try:
        return _LIBRDKAFKA_BOOL[raw.lower()]
    except KeyError:
        raise ConfigError(f"[kafka.extra] {key} = {raw!r}: librdkafka takes true/false, t/f or 1/0 (any case, no "
                          "spaces)") from None


# librdkafka properties a [kafka] setting gives (stream.kafka applies [kafka.extra] last, over them): refused in extra
_OWNED_PROPERTIES = {"bootstrap.servers": "bootstrap_servers", "security.protocol": "security_protocol",
                     "sasl.mechanism": "sasl_mechanism", "sasl.mechanisms": "sasl_mechanism",
                     "sasl.username": "sasl_username", "sasl.password": "sasl_password",
                     "ssl.ca.location": "ssl_ca_location", "ssl.certificate.location": "ssl_certificate_location",
                     "ssl.key.location": "ssl_key_location", "ssl.key.password": "ssl_key_password",
                     # both drivers' session, and its heartbeat (a sixth of it: stream.kafka.heartbeat_interval_s)
                     "session.timeout.ms": "session_timeout_ms", "heartbeat.interval.ms": "session_timeout_ms"}


@dataclass(frozen=True)
class KafkaSettings:
    """How every streamrec process talks to Kafka (or the local Kafka-protocol broker).

    Security (``stream.kafka`` applies it to every producer, consumer and admin client, and
    ``stream/joiner/worker.py`` maps it to faust): ``security_protocol`` with, for ``SASL_*``,
    ``sasl_mechanism`` / ``sasl_username`` / ``sasl_password`` (a :class:`~stream.secrets.Secret`, best given
    as ``sasl_password_file`` or ``sasl_password_env``), and for ``SSL`` / ``SASL_SSL`` the CA to trust
    (``ssl_ca_location``; the system store when unset) and an optional client certificate and key (mutual
    TLS; ``ssl_key_password`` if the key is encrypted). ``extra`` holds any other librdkafka properties
    (``[kafka.extra]`` in TOML, ``STREAMREC_KAFKA_EXTRA="k=v,k2=v2"``), applied last. Whether the named
    files exist is checked when a client is built, not here.
    """

    bootstrap_servers: str = "127.0.0.1:19092"
    # The local Tansu broker takes about half the session timeout to complete a group join, so the
    # local default is short. Real Kafka deployments may raise it (compose/ uses 10000).
    session_timeout_ms: int = 6000
    impressions_topic: str = "impressions"
    clicks_topic: str = "clicks"
    samples_topic: str = "samples"
    dlq_suffix: str = ".dlq"
    partitions: int = 4  # at most 100,000 (a topic's partitions; NewTopic overflowed a C long past 2**63)
    replication_factor: int = 1  # at most 1,000 (copies of each partition, one per broker)
    client_id: str = "streamrec"
    security_protocol: SecurityProtocol = SecurityProtocol.PLAINTEXT
    sasl_mechanism: SaslMechanism = SaslMechanism.PLAIN
    sasl_username: str = ""
    sasl_password: Secret = Secret("")
    sasl_password_file: Path | None = None
    sasl_password_env: str | None = None
    ssl_ca_location: Path | None = None
    ssl_certificate_location: Path | None = None
    ssl_key_location: Path | None = None
    ssl_key_password: Secret = Secret("")
    ssl_key_password_file: Path | None = None
    ssl_key_password_env: str | None = None
    # Not part of the hash (a dict is unhashable): settings that differ only here compare unequal but
    # may hash alike, which a frozen dataclass allows.
    extra: dict[str, str] = field(default_factory=dict, hash=False)
    __repr__ = redacted_repr  # a credential in extra (sasl.oauthbearer.client.secret ...): never shown
    # the files that hold the client's private key (a certificate file may hold it too): warned of at settings load
    # when other users can read them, as a password file is (stream.setting_values.warn_loose_key_files)
    KEY_FILES: ClassVar[tuple[str, ...]] = ("ssl_key_location", "ssl_certificate_location")
    # ... and the [kafka.extra] properties that name one (ssl.key.location is a setting's, refused there): a PKCS#12
    # keystore is binary, warned of by its property, not by a PEM marker
    KEY_FILE_PROPERTIES: ClassVar[tuple[str, ...]] = ("ssl.keystore.location",)

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        protocol = SecurityProtocol.of(self.security_protocol, "[kafka] security_protocol")
        mechanism = SaslMechanism.of(self.sasl_mechanism, "[kafka] sasl_mechanism")
        set_(self, "security_protocol", protocol)
        set_(self, "sasl_mechanism", mechanism)
        for name in ("sasl_password", "ssl_key_password"):
            value = getattr(self, name)
            if not isinstance(value, Secret):  # a plain str given in code: keep it masked all the same
                set_(self, name, Secret(str(value)))
        for name in ("sasl_password_file", "ssl_ca_location", "ssl_certificate_location", "ssl_key_location",
                     "ssl_key_password_file"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, Path):
                set_(self, name, Path(value))
        if not isinstance(self.extra, dict) or not all(isinstance(k, str) and k for k in self.extra):
            raise ConfigError(f"[kafka] extra: expected a table of librdkafka properties (key = value), "
                              f"got {type(self.extra).__name__}")
        set_(self, "extra", {k: str(v) for k, v in self.extra.items()})  # a copy: the caller's dict may change
        for k in self.extra:  # applied last, these overrode a setting (SASL_SSL sent the password in clear text)
            if k.strip().lower() in _OWNED_PROPERTIES:
                raise ConfigError(f"[kafka.extra] {k}: the setting [kafka] {_OWNED_PROPERTIES[k.strip().lower()]} "
                                  "gives this property (the faust driver reads only that one): set it there, and "
                                  "leave it out of [kafka.extra]")
        set_(self, "bootstrap_servers", checked_bootstrap_servers(self.bootstrap_servers, protocol))
        for name in ("impressions_topic", "clicks_topic", "samples_topic"):
            check_topic(f"[kafka] {name}", getattr(self, name))
        # One topic for two of the pipeline's streams: each reader validates a topic as one kind of record (the audit
        # dead-lettered every impression as an invalid click and committed past it; the joiner would join a topic with
        # itself). Checked here, for every command.
        streams = {"impressions_topic": self.impressions_topic, "clicks_topic": self.clicks_topic,
                   "samples_topic": self.samples_topic}
        for i, (a, ta) in enumerate(streams.items()):
            for b, tb in list(streams.items())[i + 1:]:
                if ta == tb:
                    raise ConfigError(f"[kafka] {a} and {b} are both {ta!r}: each names its own topic")
        # Each stream's dead letters go to <topic><dlq_suffix>: one that is a stream topic itself (dlq_suffix = "", or
        # clicks_topic = "impressions.dlq") took the dead letters as that stream's messages, a bad one read again
        for a, ta in streams.items():
            for b, tb in streams.items():
                if self.dlq_topic(ta) == tb:
                    raise ConfigError(f"[kafka] {a}'s dead-letter topic {self.dlq_topic(ta)!r} ({a} + dlq_suffix "
                                      f"{self.dlq_suffix!r}) is the {b}: each stream's dead letters need a topic of "
                                      "their own (dlq_suffix: a non-empty suffix, default '.dlq')")
            self.check_dead_letter_topic(f"[kafka] {a}", ta)
        # librdkafka refuses a session timeout above its max.poll.interval.ms (300000 unless [kafka.extra] sets it;
        # at most 3600000) with a bare _INVALID_ARG when the first consumer is built
        poll = self.extra.get("max.poll.interval.ms")
        check_counts("kafka", self, at_most={"session_timeout_ms": MAX_POLL_INTERVAL_MS if poll is None else 3_600_000,
                                             "partitions": 100_000, "replication_factor": 1_000})
        if poll is not None:
            self._check_poll_interval(poll.strip())
        self.verifies_certificates()  # a spelling librdkafka refuses: refused here, for either join driver
        from stream.secrets import names_credential, register

        for k, v in self.extra.items():  # sasl.oauthbearer.client.secret, ssl.key.pem ...: scrubbed from all output
            if names_credential(k):
                register(v)

        if protocol.sasl:
            if mechanism is SaslMechanism.OAUTHBEARER:
                if not any(k.startswith(("sasl.oauthbearer.", "enable.sasl.oauthbearer.")) for k in self.extra):
                    raise ConfigError(
                        "[kafka] sasl_mechanism = OAUTHBEARER needs its configuration in [kafka.extra], e.g. "
                        "sasl.oauthbearer.method = \"oidc\" with sasl.oauthbearer.client.id, "
                        "sasl.oauthbearer.client.secret and sasl.oauthbearer.token.endpoint.url")
            else:
                if not self.sasl_username:
                    raise ConfigError(f"[kafka] sasl_username is empty: security_protocol = {protocol} with "
                                      f"sasl_mechanism = {mechanism} needs a user name")
                if not self.sasl_password.reveal():
                    raise ConfigError(f"[kafka] sasl_password is empty: security_protocol = {protocol} with "
                                      f"sasl_mechanism = {mechanism} needs a password (give it as "
                                      "sasl_password_file, a mounted secret, or sasl_password_env, the name of "
                                      "an environment variable)")
        elif self.sasl_username or self.sasl_password.reveal():
            raise ConfigError(f"[kafka] sasl_username / sasl_password are set but security_protocol = {protocol}: "
                              "they are used only with SASL_PLAINTEXT or SASL_SSL")
        if (self.ssl_certificate_location is None) != (self.ssl_key_location is None):
            given, missing = (("ssl_certificate_location", "ssl_key_location")
                              if self.ssl_key_location is None else ("ssl_key_location", "ssl_certificate_location"))
            raise ConfigError(f"[kafka] {given} is set without {missing}: a client certificate and its key "
                              "go together")
        if self.ssl_key_password.reveal() and self.ssl_key_location is None:
            raise ConfigError("[kafka] ssl_key_password is set without ssl_key_location")
        if not protocol.tls:
            tls = [n for n in ("ssl_ca_location", "ssl_certificate_location", "ssl_key_location")
                   if getattr(self, n) is not None]
            if tls:
                raise ConfigError(f"[kafka] {', '.join(tls)} set but security_protocol = {protocol}: TLS settings "
                                  "are used only with SSL or SASL_SSL")

    def verifies_certificates(self) -> bool:
        """``[kafka.extra] enable.ssl.certificate.verification`` as librdkafka reads it (:func:`librdkafka_bool`; on
        when unset): the one reading of both join drivers, the faust driver's TLS context and the kafka driver's."""
        raw = self.extra.get(_VERIFY_CERTIFICATES)
        return True if raw is None else librdkafka_bool(_VERIFY_CERTIFICATES, raw)

    def _check_poll_interval(self, poll: str) -> None:
        """``[kafka.extra] max.poll.interval.ms`` (``poll``) below ``session_timeout_ms``: the poll interval is what is
        out of range (it was reported as ``session_timeout_ms`` past a bound of 0 for ``max.poll.interval.ms = 0``). A
        value that is no number is left to librdkafka, which names it when the first client is built."""
        if poll.isascii() and poll.isdigit() and int(poll) < self.session_timeout_ms:
            raise ConfigError(f"[kafka.extra] max.poll.interval.ms = {poll} is out of range: it must be at least "
                              f"[kafka] session_timeout_ms ({self.session_timeout_ms}), as librdkafka keeps a "
                              "consumer's session within the time it may go between polls; raise "
                              f"max.poll.interval.ms to {self.session_timeout_ms} or more, or lower session_timeout_ms")

    def dlq_topic(self, topic: str) -> str:
        return topic + self.dlq_suffix

    def check_dead_letter_topic(self, setting: str, topic: str) -> None:
        """A :class:`ConfigError` unless ``topic``'s dead-letter topic (``topic`` + ``dlq_suffix``) is a legal topic
        name too (a suffix with another character, or a topic name within 249 characters that the suffix takes past)."""
        if problem := topic_problem(self.dlq_topic(topic)):
            raise ConfigError(f"{setting} + [kafka] dlq_suffix: the dead-letter topic {shown(self.dlq_topic(topic))} "
                              f"{problem}; {TOPIC_RULE} (change the topic or dlq_suffix)")


def check_redis_url(setting: str, url: str) -> SplitResult:
    """A Redis url (``[redis] url``, the deprecated ``[learner] deltas_redis_url``) as redis-py reads it, without its
    white space around (the caller strips it): redis://, rediss:// or unix://, a host, a port that is no 0, a path
    that is a database number; a ``ConfigError`` naming ``setting`` and the fix otherwise. Its parts returned."""
    if any(c.isspace() for c in url):  # no URL holds one; redact() (and so repr) stops at it
        raise ConfigError(f"{setting}: holds whitespace (not shown: it may be part of a password); encode a "
                          "space in a password as %20, or give the password as [redis] password_file / password_env")
    try:
        parts = urlsplit(url)
        _ = parts.port  # raises ValueError on a port that is not a number
    except ValueError as exc:
        # urlsplit's message quotes what it took for the port, which is part of the password when the password
        # holds an unencoded '/' ('redis://:sec/ret@h' -> "... as 'sec'"): no detail when there is user-info
        detail = (redact(str(exc)) if "@" not in url else "the user-info or the port is malformed (encode "
                  "'/', '@', ':', '#' and '%' in a password as %2F, %40, %3A, %23, %25, or use password_file)")
        raise ConfigError(f"{setting}: cannot parse {redact(url)!r}: {detail}") from None
    if parts.scheme not in ("redis", "rediss", "unix"):
        raise ConfigError(f"{setting}: got {redact(url)!r}, expected redis://host:port/db, "
                          "rediss://host:port/db (TLS) or unix:///path/to/socket")
    # redis-py takes a url without a host ('redis://:pw@:7000') as localhost, a cluster client as node 'None:7000'
    if parts.scheme != "unix" and not unquote(parts.hostname or "").strip():
        raise ConfigError(f"{setting}: {redact(url)!r} names no host: expected "
                          f"{parts.scheme}://host:port/db (a unix socket: unix:///path/to/socket)")
    if parts.scheme != "unix" and parts.port == 0:  # redis-py connected to port 0: "Connection refused" each try
        raise ConfigError(f"{setting}: {redact(url)!r} names port 0: give the port Redis listens on "
                          "(1-65535), or leave it out for 6379")
    # redis-py reads the path as the db number and silently takes db 0 for one that is not a number ("/abc")
    if parts.scheme != "unix" and not re.fullmatch(r"/?[0-9]*", unquote(parts.path)):
        raise ConfigError(f"{setting}: the path of {redact(url)!r} is not a database number: expected "
                          "redis://host:port/<db> with <db> an integer (nothing: db 0)")
    return parts


@dataclass(frozen=True)
class RedisSettings:
    """How every streamrec process talks to Redis; every client is built by ``stream.redis_client.connect``.

    Security (a secured deployment): ``username`` is the ACL user ("" = the default user), ``password`` its
    password, best given as ``password_file`` (a mounted secret, read once by the settings loader; a trailing
    newline is dropped) or ``password_env`` (the name of an environment variable) rather than in a shared file.
    A ``redis://user:password@host`` URL keeps working, but the password is then part of a value that gets
    printed (redacted) and passed around: prefer ``password_file``. Give each credential one way: a password
    both in the URL and in ``password``/``password_file`` is a configuration error, as is a username in both.
    TLS: a ``rediss://`` URL, ``ssl_ca_certs`` the CA bundle (PEM) that signed the server's certificate
    (default: the system's CAs), and ``ssl_certfile``/``ssl_keyfile`` a client certificate when Redis asks
    for one (``tls-auth-clients``).

    Redis Cluster: ``cluster = true`` (``STREAMREC_REDIS_CLUSTER=1``) says ``url`` names one node of a Redis Cluster
    (the clients discover the others); every client ``connect`` builds is then a redis-py ``RedisCluster`` (made at
    its first use): counts, history, strikes, pub/sub, the layered embedding store. Their keys are laid out so that
    each script call and MULTI/EXEC touches one hash slot (``stream/counts_keys.py``, ``stream/history.py``).
    ``[serve]`` and ``[refresh] embedding_store_cluster``, which asked for a cluster before this setting existed, are
    accepted as aliases of it (:meth:`clustered`).
    """

    url: str = "redis://127.0.0.1:16379/0"
    prefix: str = "streamrec"  # every key streamrec writes starts with this
    counts_ttl_days: int = 8  # per-day count keys live this long; at most 3,650 (10 years)
    history_len: int = 50  # recent clicked items kept per user; at most 10,000 (serving reads them per request)
    history_ttl_days: int = 30  # a user's click history expires this long after its last append; 0 = never; <= 3,650
    username: str = ""  # ACL user ("" = the default user)
    password: Secret = Secret("")  # prefer password_file; the value itself is discouraged in a shared file
    password_file: Path | None = None
    password_env: str | None = None
    ssl_ca_certs: Path | None = None  # with a rediss:// url: the CA bundle (PEM) that checks the server's certificate
    ssl_certfile: Path | None = None  # with a rediss:// url: a client certificate (PEM) ...
    ssl_keyfile: Path | None = None  # ... and its private key (PEM; default: inside ssl_certfile)
    cluster: bool = False  # url names one node of a Redis Cluster: every client is a redis-py RedisCluster
    __repr__ = redacted_repr  # the url's user-info (redis://user:password@host): never shown
    KEY_FILES: ClassVar[tuple[str, ...]] = ("ssl_keyfile", "ssl_certfile")  # as KafkaSettings.KEY_FILES

    def __post_init__(self) -> None:
        if not isinstance(self.password, Secret):  # a plain str from code: masked like every credential
            object.__setattr__(self, "password", Secret(str(self.password)))
        if self.url != self.url.strip():  # around it: a variable filled from a file ends in a newline
            object.__setattr__(self, "url", self.url.strip())
        parts = check_redis_url("[redis] url", self.url)
        self._check_query(parts.scheme, parts.query)
        # counts_ttl_days, history_len >= 1 (serving's h[-0:] is the whole history); history_ttl_days 0: never expire
        check_counts("redis", self, zero_ok=("history_ttl_days",),
                     at_most={"counts_ttl_days": 3_650, "history_len": 10_000, "history_ttl_days": 3_650})
        self._check_prefix()
        if (self.password or self.password_file is not None) and parts.password:
            raise ConfigError("[redis] password (or password_file / password_env) is set and url carries a password "
                              "too: give it one way (prefer password_file and a url without credentials)")
        if self.username and parts.username and unquote(parts.username) != self.username:
            raise ConfigError(f"[redis] username is {self.username!r} but url names user "
                              f"{unquote(parts.username)!r}: give the user one way")
        tls = [name for name in ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile") if getattr(self, name) is not None]
        if tls and parts.scheme != "rediss":
            raise ConfigError(f"[redis] {', '.join(tls)} set but url is {parts.scheme}://: TLS needs a rediss:// url")
        if self.ssl_keyfile is not None and self.ssl_certfile is None:
            raise ConfigError("[redis] ssl_keyfile is set without ssl_certfile: a client key needs its certificate")
        if self.cluster and parts.scheme == "unix":
            raise ConfigError("[redis] cluster = true but url is unix://: a Redis Cluster is reached over TCP, give "
                              "one node as redis://host:port (or rediss://)")
        if self.cluster and unquote(parts.path).strip("/") not in ("", "0"):
            raise ConfigError(f"[redis] cluster = true but url {redact(self.url)!r} names database "
                              f"{unquote(parts.path).strip('/')}: a Redis Cluster has database 0 only")

    def _check_query(self, scheme: str, query: str) -> None:
        """No query parameters but a unix:// url's ``db`` (its only way to name one): redis-py passes each to the
        client, over what the components set (``?socket_timeout=60`` over ``embedding_store_timeout_s``,
        ``?ssl_check_hostname=false`` turning off a rediss:// url's host check, ``?decode_responses=true`` failing
        every binary read), accepted in silence."""
        params = parse_qs(query, keep_blank_values=True)
        taken = {"db"} if scheme == "unix" else set()
        if extra := sorted(set(params) - taken):
            raise ConfigError(f"[redis] url: query parameters are not taken ({shown(', '.join(extra))}): they would "
                              "override the client settings streamrec sets (timeouts, TLS checks, the replies' types); "
                              "give them through the [redis] settings or leave them out")
        if any(not re.fullmatch(r"[0-9]+", v) for v in params.get("db", [])):
            raise ConfigError(f"[redis] url: ?db= of {redact(self.url)!r} is not a database number (an integer)")

    def _check_prefix(self) -> None:
        """The prefix begins every key: it must not change which hash slot a key is in (Redis Cluster hashes a key
        by its first ``{...}``, and the day counts keep a kind's keys in one slot by their own ``{item}``/``{user}``
        tag after the prefix: a brace before it split them over slots, CROSSSLOT on every counts write), and it must
        be text Redis can be sent (an environment variable's undecodable bytes failed every command)."""
        prefix = self.prefix
        if not isinstance(prefix, str) or not prefix:
            raise ConfigError(f"[redis] prefix: got {prefix!r}, expected a non-empty name every key begins with "
                              "(default 'streamrec')")
        if prefix != prefix.strip():  # "streamrec\n" is another keyspace than the other stages' "streamrec"
            raise ConfigError(f"[redis] prefix: got {prefix!r}, which has a space or a line ending around it: remove "
                              "it")
        if "{" in prefix or "}" in prefix:
            raise ConfigError(f"[redis] prefix: got {prefix!r}, which holds a '{{' or '}}': Redis Cluster reads a "
                              "key's first {...} as its hash tag, and streamrec's keys carry their own after the "
                              "prefix (a kind's counts in one slot); use a prefix without braces")
        try:
            prefix.encode()
        except UnicodeEncodeError:
            raise ConfigError(f"[redis] prefix: got {prefix!r}, which is not valid UTF-8 text (undecodable bytes "
                              "in the environment variable or file it came from?)") from None

    def clustered(self, alias: bool) -> RedisSettings:
        """These settings with ``cluster = True`` when ``alias`` (the older ``[serve]`` / ``[refresh]
        embedding_store_cluster``, which said the same of the same url before ``[redis] cluster`` existed) is set:
        a url that names a cluster node is one for every client, counts and history included."""
        return replace(self, cluster=True) if alias and not self.cluster else self

    @property
    def tls(self) -> bool:
        return self.url.startswith("rediss://")

    @property
    def user(self) -> str:
        """The ACL user the clients authenticate as (from ``username`` or the url); "" = the default user."""
        return self.username or unquote(urlsplit(self.url).username or "")

    @property
    def has_password(self) -> bool:
        """Whether the clients send a password (``password``/``password_file``, or one in the url)."""
        return bool(self.password) or self.password_file is not None or bool(urlsplit(self.url).password)

    # The pub/sub channels, named from the prefix here only: the writer and the reader of a channel must
    # agree, whatever prefix a deployment uses.
    @property
    def artifact_channel(self) -> str:
        """The refresh PUBLISHes each new artifact version here; serving subscribes."""
        return f"{self.prefix}:model-updates"

    @property
    def deltas_channel(self) -> str:
        """The learner PUBLISHes each new delta's seq here; serving subscribes."""
        return f"{self.prefix}:model-deltas"
