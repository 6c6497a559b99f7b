"""Every Redis client streamrec builds comes from :func:`connect`: credentials and TLS are applied in one place.

    client = connect(settings, timeout_s=1.0, retries=0)    # serving's request path
    client = connect(settings, check=True)                  # the joiner: fails at start on a refused login

With ``[redis] cluster = true`` :func:`connect` returns a redis-py :class:`~redis.cluster.RedisCluster` (``url`` names
one node; it discovers the others) with the same credentials, TLS, timeouts and retry policy: the callers do not
choose between a node and a cluster, the setting does. Commands whose keys share a hash slot (every script call and
MULTI/EXEC streamrec sends, by its key layout) go to that slot's node; PUBLISH and SUBSCRIBE are cluster-wide.

:func:`connect` takes a :class:`~stream.config.RedisSettings` and applies its ACL ``username``, its
``password`` (or ``password_file``, read here when the settings loader has not read it already) and its
TLS settings (``rediss://`` url, ``ssl_ca_certs``, ``ssl_certfile``/``ssl_keyfile``); a password or user in
the url also works (redis-py parses it). Callers choose only timeouts and the retry policy: ``retries=None``
is what ``redis.Redis.from_url`` gives a connection (no retries: the callers' own recovery sees a failure at
once), ``n`` that many with short, jittered exponential backoff, ``0`` none. Under any
policy refused credentials are never retried (redis-py counts ``AuthenticationError`` as a connection
error and would retry it with backoff): a wrong password fails at once, it does not look like a slow Redis.

A cluster that cannot serve a command (no node reachable, a slot nobody serves, CLUSTERDOWN) fails it with
:class:`ClusterUnavailable`, a ``redis.ConnectionError``: the one failure every caller's recovery already handles for
a single node that is down (:class:`LazyClient` translates redis-py's cluster errors, :func:`unavailable`).

Errors: :func:`describe` turns any Redis failure into one line that names the Redis by its url through
:func:`~stream.secrets.redact` and says what to fix; :func:`failure` wraps it as a :class:`RedisFailure`
(:class:`RedisAuthError` for refused credentials or a missing ACL permission). Nothing here ever prints a
password: messages show ``settings.url`` redacted only, and the one :meth:`~stream.secrets.Secret.reveal` is
the keyword argument handed to redis-py.
"""

from __future__ import annotations

import contextlib
import functools
import re
import ssl
import threading
import types
import weakref
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import hiredis
import redis
from redis.backoff import ExponentialWithJitterBackoff, NoBackoff
from redis.cluster import ClusterPipeline, ClusterPubSub, RedisCluster
from redis.commands.core import Script
from redis.connection import parse_url
from redis.exceptions import (
    AskError,
    AuthenticationError,
    AuthenticationWrongNumberOfArgsError,
    ClusterDownError,
    CrossSlotTransactionError,
    ExecAbortError,
    InvalidPipelineStack,
    MovedError,
    NoPermissionError,
    NoScriptError,
    RedisClusterException,
)
from redis.retry import Retry

from stream.config import RedisSettings
from stream.errors import ConfigError, StreamError, quoted
from stream.files import MAX_SETTINGS_FILE_BYTES, read_regular
from stream.redis_deadline import connection_class, refresh_outside_deadlines
from stream.secrets import Secret, redact, secret_text
from stream.startup import wait_ready
from stream.tls import REFUSAL_TIMEOUT_S, certificate_refusal, client_context

__all__ = ["DEFAULT_TIMEOUT_S", "Client", "ClusterUnavailable", "LazyClient", "RedisAuthError", "RedisFailure",
           "acl_denied", "connect", "describe", "eviction_advice", "failure", "is_cluster", "latency_advice",
           "run_script", "scaled_timeout_s", "script_codes", "unavailable", "verify", "wait_until_up"]

Client = redis.Redis | RedisCluster  # what connect() returns: a single node's client or a cluster's

_AUTH_ERRORS = (AuthenticationError, AuthenticationWrongNumberOfArgsError, NoPermissionError)


class RedisFailure(StreamError):
    """A Redis operation failed; the message is :func:`describe`'s line (url redacted, no password)."""


class RedisAuthError(RedisFailure):
    """Redis refused the credentials (wrong or missing password, unknown or disabled user) or the ACL user
    lacks a permission: a configuration to fix, never retried."""


class ClusterUnavailable(redis.ConnectionError):
    """A Redis Cluster could not serve a command: no node of it answered (every node down, or unreachable from here),
    a hash slot is served by no node, or the nodes answered CLUSTERDOWN (a primary without a replica failed). Its
    ``__cause__`` is redis-py's error.

    A ``redis.ConnectionError`` so that the callers' recovery for a Redis that is down (the joiner's rewind and retry,
    serving's fallback rows and history, the refresh's retries, ``stream.strikes.is_infrastructure``) covers a cluster
    too: redis-py raises the first two as ``RedisClusterUnreachableError`` / ``SlotNotCoveredError``, which are not
    ``redis.RedisError`` at all, and CLUSTERDOWN as ``ClusterDownError``, a ``ResponseError`` (an answer, to callers
    that retry only what failed to connect)."""


# redis-py's cluster errors that are not outages: the same call fails the same way every time (keys of several slots
# in a transaction, a pipeline answered out of step), a bug to see, not to wait out
_DETERMINISTIC = (CrossSlotTransactionError, InvalidPipelineStack)


def wrong_type(reply: object) -> bool:
    """Whether a Redis error reply (raised, or returned in a pipeline's replies with ``raise_on_error=False``) is
    ``WRONGTYPE``: the key holds another Redis type than the command reads (any client can write one under the prefix:
    not a Redis that is down). By the reply's code, also behind the "Command # n (...) of pipeline caused error: "
    preamble redis-py puts on a pipeline's raised error, or the code of the command a Lua script called
    (:func:`script_codes`: "Error running script (...): @user_script:9: WRONGTYPE ...")."""
    if not isinstance(reply, redis.ResponseError):
        return False
    text = str(reply)
    code = getattr(reply, "status_code", None) or text.rsplit("caused error: ", 1)[-1].split(" ", 1)[0]
    return code == "WRONGTYPE" or "WRONGTYPE" in script_codes(text)


# Redis 6 wraps the error of a command a Lua script called: "@user_script: 1: -OOM command not allowed ..." (the
# script's result, redis.pcall), "Error running script (...): @user_script:1: @user_script: 1: -OOM ..." or
# "Error running script (...): @user_script:1: WRONGTYPE ..." (an ERR reply, redis.call; a pipeline puts "Command # 1
# (...) of pipeline caused error: " before it); Redis 7 replies with the command's own code.
_SCRIPT_CODE = re.compile(r"@user_script: ?\d+: -?([A-Z][A-Z0-9_]*) ")
# Redis 6 answers a command its ACL denies inside a script with no code at all: "@user_script: 1: The user executing
# the script can't run this command or subcommand" (or "... can't access at least one of the keys mentioned in the
# command"): NOPERM all the same, the ACL's to fix; struck, every message was dead-lettered for it.
_SCRIPT_ACL = "The user executing the script can't "


def script_codes(text: str) -> list[str]:
    """The error codes of the commands a Lua script called, as Redis 6 puts them in a script's error
    (:data:`_SCRIPT_CODE`)."""
    return _SCRIPT_CODE.findall(text)


# The command an ACL denied, as Redis names it ("this user has no permissions to run the 'evalsha' command or its
# subcommand"; Redis 7: "User u has no permissions to run the 'script|load' command"), and the ones a Lua script runs
# by: streamrec's scripts need the whole category (README, Security), which a grant of EVALSHA alone missed
_DENIED_COMMAND = re.compile(r"permissions to run the '([A-Za-z_.-]+)")
_SCRIPTING = frozenset({"eval", "evalsha", "eval_ro", "evalsha_ro", "script"})


def _acl_grant(exc: BaseException) -> str:
    """What to add to the ACL user for a command Redis refused it (``+@scripting`` for a script's command, else
    ``+<command>``), or "" when Redis did not name the command (a key or a channel out of the user's patterns, a
    command a script called)."""
    found = _DENIED_COMMAND.search(str(exc))
    if found is None:
        return ""
    command = found[1].lower()
    return "+@scripting" if command in _SCRIPTING else f"+{command}"


def acl_denied(exc: BaseException) -> bool:
    """Whether a Redis error is its ACL refusing a command (NOPERM), also one a script called, which Redis 6 says
    without a code (:data:`_SCRIPT_ACL`): the configuration's to fix, never the data's (serving's history read counts
    it as Redis unavailable, ``serving/history.py``, not as malformed data; :func:`describe` says which ACL to fix)."""
    if isinstance(exc, redis.exceptions.NoPermissionError):
        return True
    text = str(exc) if isinstance(exc, redis.ResponseError) else ""
    return text.startswith("NOPERM ") or "NOPERM" in script_codes(text) or _SCRIPT_ACL in text


def unavailable(exc: BaseException) -> BaseException:
    """``exc`` as the failure streamrec's callers handle: a :class:`ClusterUnavailable` (caused by ``exc``) for
    redis-py's errors that say a cluster cannot serve now (``RedisClusterException`` and its subclasses but the
    deterministic ones, ``ClusterDownError``); any other error as it is."""
    if isinstance(exc, ClusterDownError) or (isinstance(exc, RedisClusterException)
                                             and not isinstance(exc, _DETERMINISTIC)):
        err = ClusterUnavailable(f"the Redis Cluster cannot serve this now ({type(exc).__name__}: {exc})")
        err.__cause__ = exc
        return err
    return exc


@contextlib.contextmanager
def _translation() -> Iterator[None]:
    try:
        yield
    except (RedisClusterException, ClusterDownError) as exc:
        err = unavailable(exc)
        if err is exc:
            raise
        raise err from exc


def _translated_items(items: Iterator[Any]) -> Iterator[Any]:
    with _translation():
        yield from items


def _translating(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` raising :func:`unavailable`'s failure; the pipelines and pubsubs it returns wrapped alike
    (:class:`_Translated`), and the generators (``scan_iter``: its commands are sent as it is iterated)."""
    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        with _translation():
            result = fn(*args, **kwargs)
        if isinstance(result, (ClusterPipeline, ClusterPubSub)):
            return _Translated(result)
        return _translated_items(result) if isinstance(result, types.GeneratorType) else result

    return call


class _Translated:
    """A pipeline or pubsub of a cluster client whose methods raise :func:`unavailable`'s failures."""

    def __init__(self, target: Any) -> None:
        self._target = target

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._target, name)
        return _translating(attr) if callable(attr) else attr


class _Retry(Retry):
    """redis-py's :class:`~redis.retry.Retry`, except that refused credentials are raised at once.

    (``AuthenticationError`` is a ``ConnectionError`` to redis-py, so a plain ``Retry`` retries a wrong
    password with backoff: seconds per command before the real error shows.) redis-py disconnects a
    connection whose login failed before raising, so nothing half-authenticated goes back to the pool."""

    def call_with_retry(self, do: Any, fail: Any, is_retryable: Any = None, with_failure_count: bool = False) -> Any:
        def retryable(error: Exception) -> bool:
            return not isinstance(error, AuthenticationError) and (is_retryable is None or bool(is_retryable(error)))

        return super().call_with_retry(do, fail, retryable, with_failure_count)


def _retry(retries: int | None) -> _Retry:
    if not retries:  # None: what redis.Redis.from_url(url) gives a connection (redis-py 8.1): no retries
        return _Retry(NoBackoff(), 0)
    return _Retry(ExponentialWithJitterBackoff(base=0.01, cap=1.0), retries)


def _password(settings: RedisSettings) -> str:
    """The password to send ("" = none). ``password_file`` is read here when the settings were built in code
    (the settings loader reads it, and ``password_env``, at the process edge)."""
    if settings.password:
        return settings.password.reveal()
    if settings.password_file is not None:
        path = Path(settings.password_file)
        try:  # refused unread when not a regular file (a FIFO would hang connect for good)
            text = read_regular(path, MAX_SETTINGS_FILE_BYTES).decode("utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            # not "password_file: ..." - stream.secrets.redact masks the word after a "password...:" key
            raise ConfigError(f"[redis] cannot read the password_file {path}: "
                              f"{getattr(exc, 'strerror', None) or exc}") from None
        if not secret_text(text):  # an unfilled secret file: not "no password", which is leaving password_file out
            raise ConfigError(f"[redis] the password_file {path} is empty: put the password in it, or leave "
                              "password_file out when there is none")
        return Secret(secret_text(text)).reveal()  # registered for redact() on the way
    if settings.password_env:
        raise ConfigError(f"[redis] password_env names {settings.password_env}, which gave no password (it is empty, "
                          "or these settings were not built by streamrec.settings, which reads the variable)")
    return ""


def _tls_options(settings: RedisSettings) -> dict[str, Any]:
    """The TLS files as redis-py's options, checked first: redis-py loads them at its first connection, where a CA
    file that holds no certificate, a key that is not the certificate's or an unreadable file failed every command
    late with an obscure error (retried as an outage). Loading them once here (:func:`stream.tls.client_context`)
    makes each a ConfigError naming the setting and the file when the client is built. The certificate and host-name
    checks are set here, not left to redis-py's defaults: redis-py before 6.0 checked no host name."""
    _tls_context(settings)
    return {"ssl_cert_reqs": "required", "ssl_check_hostname": True,
            **{name: str(path) for name in ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile")
               if (path := getattr(settings, name)) is not None}}


def _tls_context(settings: RedisSettings) -> ssl.SSLContext:
    """The TLS context of ``settings``' files (:func:`stream.tls.client_context`): what redis-py's options load, with
    the same checks (a certificate its CA signed, for the host connected to)."""
    return client_context("redis", ("ssl_ca_certs", settings.ssl_ca_certs), ("ssl_certfile", settings.ssl_certfile),
                          ("ssl_keyfile", settings.ssl_keyfile), key_password=None)  # no [redis] setting gives one


# Every command's bound where a caller names none. A Redis that stops answering without closing its connections (a
# SIGSTOPped or swapping server, a network partition that drops packets) leaves a read without a timeout waiting
# for ever, since the kernel keeps the idle connection open; with a bound the command fails as a
# ``redis.TimeoutError`` and the caller's recovery runs (the joiner rewinds and retries with backoff:
# tests/integration/test_faults.py, the frozen Redis). 5 s is redis-py 8's own default, stated here so that no
# redis-py version's default decides it; no command streamrec sends takes a healthy Redis more than milliseconds.
DEFAULT_TIMEOUT_S = 5.0


def scaled_timeout_s(base_s: float, size: float, size_per_base: float) -> float:
    """A whole-reply timeout (``connect(..., whole_reply=True)``) for replies of up to ``size`` (entries, members)
    where ``base_s`` was measured to cover ``size_per_base``: ``base_s``, grown in proportion past that, so that a
    healthy reply is never failed for its size while a trickling one still fails within a bound."""
    return base_s * max(1.0, size / size_per_base)


def _cluster(url: str, retries: int | None, options: dict[str, Any]) -> RedisCluster:
    """A Redis Cluster client of ``url`` with ``options``. A ``connection_class`` among them (the whole-reply one) is
    kept: ``RedisCluster.from_url`` lets the URL's options win, and a rediss:// URL's is redis-py's ``SSLConnection``,
    so a TLS cluster's commands were bounded read by read, not by whole reply, on serving's request path."""
    if "connection_class" not in options:
        return RedisCluster.from_url(url, retry=_retry(retries), **options)
    given = {k: v for k, v in parse_url(url).items() if k not in ("connection_class", "db")}  # db: 0 (RedisSettings)
    return RedisCluster(**{**given, **options}, retry=_retry(retries))


def connect(settings: RedisSettings, *, timeout_s: float = DEFAULT_TIMEOUT_S, connect_timeout_s: float | None = None,
            retries: int | None = None, check: bool = False, whole_reply: bool = False) -> Any:
    """A client of the Redis ``settings`` names, with its credentials and TLS applied: a :class:`redis.Redis`, or with
    ``settings.cluster`` a :class:`LazyClient` of a :class:`~redis.cluster.RedisCluster` (module docstring), which
    passes every command on to it; typed ``Any`` as the two share no base class.

    ``timeout_s`` bounds each command (``socket_timeout``; default :data:`DEFAULT_TIMEOUT_S`), ``connect_timeout_s``
    each connection attempt (default ``timeout_s``); ``retries`` is the retry policy (module docstring);
    ``whole_reply`` makes ``timeout_s`` bound each whole reply, not each read of it (a Redis trickling its reply holds
    a command past a per-read timeout: :mod:`stream.redis_deadline`; serving's request path asks for it). The client
    connects lazily (a cluster client is made at its first use, :class:`LazyClient`); ``check=True`` sends one
    PING and a script of no keys first (:func:`verify`) and raises a :class:`RedisFailure` (:class:`RedisAuthError` for
    refused credentials or scripting) instead of returning a client that cannot work.
    Raises :class:`~stream.errors.ConfigError` for an unreadable ``password_file`` or TLS file."""
    options = _client_options(settings, timeout_s, connect_timeout_s)
    if whole_reply:
        options["connection_class"] = connection_class(settings.url)
    client: Client | LazyClient
    if settings.cluster:  # made at its first use (LazyClient): an unreachable cluster fails commands, not connect()
        client = LazyClient(lambda: refresh_outside_deadlines(_cluster(settings.url, retries, options)), cluster=True)
    else:
        options["retry"] = _retry(retries)
        if retries == 0:
            options["retry_on_error"] = []
        client = redis.Redis.from_url(settings.url, **options)
        plain_packer(client.connection_pool.connection_kwargs)
    if check:
        try:
            verify(client, settings)
        except BaseException:
            client.close()
            raise
    return client


_PLAIN_ARGS = frozenset({str, int, bytes})  # what hiredis packs byte for byte as redis-py's UTF-8 encoder does


class PlainPacker:
    """A single-node client's command packer (redis-py's ``command_packer``): a command whose arguments are all exactly
    ``str``, ``int`` or ``bytes`` (and whose first is letters only: redis-py splits it at any ASCII whitespace, a tab
    or a newline too, and drops an empty one) goes to ``hiredis.pack_command`` whole, the same bytes as redis-py's own
    packer (``tests/unit/stream/test_redis_packer.py``), which passes every argument through a Python encoder first
    (~1 us each). Anything else (a float, a memoryview, a bool it refuses) goes to redis-py's packer, errors and all.

    Why: the joiner sends ~0.5 M arguments in a 220 k-event ``bench/joiner.py`` run, most in its counts writer thread
    (each counted id and its count, each name) and the history reads (a key per user): redis-py's encoder took about
    half of that thread's CPU (bench/README.md, forty-third session). Only for UTF-8 with strict errors, the encoding
    hiredis applies (:func:`plain_packer`)."""

    def __init__(self, buffer_cutoff: int = 6000) -> None:
        from redis._parsers.encoders import Encoder  # redis-py's internals (5.1+): plain_packer checks they import
        from redis.connection import HiredisRespSerializer, PythonRespSerializer

        encode = Encoder("utf-8", "strict", False).encode
        self._fallback = HiredisRespSerializer(PythonRespSerializer(buffer_cutoff, encode).pack, encode)

    def pack(self, *args: Any) -> list[bytes]:
        first = args[0] if args else None
        if type(first) is str and first.isalpha() and set(map(type, args)) <= _PLAIN_ARGS:
            return [hiredis.pack_command(args)]
        return self._fallback.pack(*args)


def plain_packer(connection_kwargs: dict[str, Any]) -> None:
    """Give a connection pool's connections a :class:`PlainPacker`, where their encoding is hiredis' (UTF-8, strict
    errors: redis-py's default; a url may name another) and no packer is set; before the first connection is made."""
    if "command_packer" in connection_kwargs or not hasattr(hiredis, "pack_command"):
        return
    encoding = str(connection_kwargs.get("encoding", "utf-8")).lower().replace("_", "-")
    if encoding in ("utf-8", "utf8") and connection_kwargs.get("encoding_errors", "strict") == "strict":
        try:
            connection_kwargs["command_packer"] = PlainPacker()
        except ImportError:  # a redis-py without the serializers it falls back to: its own packer, as before
            pass


_LOADED: weakref.WeakSet[Any] = weakref.WeakSet()  # the Scripts run_script has loaded on a cluster (_load)


def run_script(client: Any, script: Any, calls: Sequence[tuple[Sequence[Any], Sequence[Any]]], *,
               transaction: bool) -> list[Any]:
    """Run ``script`` (a redis-py :class:`~redis.commands.core.Script` registered on ``client``) once per ``(keys,
    args)`` of ``calls``, in one pipeline (MULTI/EXEC with ``transaction``), and return the results in call order;
    the first error is raised, as ``pipeline.execute()`` does. One call outside a transaction is sent on its own
    (no pipeline: redis-py's pipeline asks SCRIPT EXISTS first, a second round trip; on a cluster :func:`_call`).

    On a Redis Cluster each call's keys must share a hash slot (the callers' key layouts see to it) and the pipeline
    sends one batch per node. redis-py's cluster pipeline sends EVALSHA without loading the script, so it is loaded on
    the primaries of the calls' slots (SCRIPT LOAD, :func:`_load`) before the first use, and the calls a node refused
    with NOSCRIPT (its script cache flushed, a restart or a failover since) are sent once more after loading it again: a
    NOSCRIPT call ran nothing, and in a transaction (one slot, one node, one script) every call of it was refused alike.
    A transaction refused with MOVED or ASK before its EXEC ran (a slot moved since redis-py last asked, or is moving)
    is sent once more at once, after ASK to the node it names with ASKING (:func:`_send`)."""
    if not calls:
        return []
    if not is_cluster(client):
        if len(calls) == 1 and not transaction:
            keys, args = calls[0]
            return [script(keys=list(keys), args=list(args))]
        pipe = client.pipeline(transaction=transaction)
        for keys, args in calls:
            script(keys=list(keys), args=list(args), client=pipe)
        return list(pipe.execute())
    if script not in _LOADED:
        _load(client, script, calls)
        _LOADED.add(script)
    if len(calls) == 1 and not transaction:
        return [_call(client, script, *calls[0])]
    results: list[Any] = [None] * len(calls)
    todo = list(range(len(calls)))
    for attempt in range(2):
        got = _send(client, script, [calls[i] for i in todo], transaction)
        for i, result in zip(todo, got, strict=True):
            results[i] = result
        todo = [i for i, result in zip(todo, got, strict=True) if isinstance(result, NoScriptError)]
        if not todo or attempt:
            break
        _load(client, script, [calls[i] for i in todo])
    for result in results:
        if isinstance(result, Exception):  # in place of a result: pipe.execute(raise_on_error=False) translates none
            err = unavailable(result)
            if err is result:
                raise result
            raise err from result
    return results


def _call(client: Any, script: Any, keys: Sequence[Any], args: Sequence[Any]) -> Any:
    """One call of ``script`` on a cluster, alone (one round trip, as on a single node), sent once more where the node
    answered NOSCRIPT (not loaded there yet, its cache flushed, or a migrating slot's target that an ASK sent it to)
    after loading the script on every primary that answers (:func:`_load_reachable`). Not redis-py's
    ``Script.__call__``: it loads the script on every primary too, and one node down failed the load and so the call
    (a user's history read by serving, its appends by the joiner, in a process started during the outage)."""
    try:
        return client.evalsha(script.sha, len(keys), *keys, *args)
    except NoScriptError:
        _load_reachable(client, script)
        return client.evalsha(script.sha, len(keys), *keys, *args)


def _load_reachable(client: Any, script: Any) -> None:
    """SCRIPT LOAD ``script`` on every primary that answers; one down (or not answering in time) is skipped, and loads
    it at its first NOSCRIPT once back. Every primary, not the call's slot's: the node that answered NOSCRIPT may be
    another (an ASK's), which the reply does not name."""
    for node in client.get_primaries():
        with contextlib.suppress(redis.ConnectionError, redis.TimeoutError, RedisClusterException):
            client.execute_command("SCRIPT LOAD", script.script, target_nodes=[node])


def _load(client: Any, script: Any, calls: Sequence[tuple[Sequence[Any], Sequence[Any]]]) -> None:
    """SCRIPT LOAD ``script`` on the primaries ``calls`` go to (by each call's first key), not on every primary: with
    one node down, the load on it failed every script call of a client that had not loaded it yet (a process started
    or a client made during the outage), those of the healthy nodes' slots too. A node not loaded yet answers NOSCRIPT
    later, and :func:`run_script` loads it there then."""
    nodes = {node.name: node for node in (client.get_node_from_key(keys[0]) for keys, _ in calls)}
    # through the cluster client (not a node's own connection): its failures refresh the topology and become
    # ClusterUnavailable once no node answers, as every other command's
    client.execute_command("SCRIPT LOAD", script.script, target_nodes=list(nodes.values()))


def _send(client: Any, script: Any, calls: Sequence[tuple[Sequence[Any], Sequence[Any]]], transaction: bool,
          ) -> list[Any]:
    """One pipeline of ``calls`` on a cluster, sent once more at once where a transaction's commands were refused with
    MOVED or ASK as they were queued (the slot moved, or is moving, since redis-py last learnt its owner): Redis then
    aborted the EXEC (EXECABORT, redis-py raising the redirection in handling it) and ran none of it, and redis-py has
    patched its slot map from the redirection. The calls are the same, so are their write ids and markers."""
    for again in (True, False):
        pipe = client.pipeline(transaction=transaction)
        for keys, args in calls:
            script(keys=list(keys), args=list(args), client=pipe)
        try:
            return list(pipe.execute(raise_on_error=False))
        except AskError as exc:  # MovedError is one
            if not (again and transaction and isinstance(exc.__context__, ExecAbortError)):
                raise
            if not isinstance(exc, MovedError):
                return _send_asking(client, script, calls, exc)
    raise AssertionError("unreachable: the second try returns or raises")


def _send_asking(client: Any, script: Any, calls: Sequence[tuple[Sequence[Any], Sequence[Any]]], ask: AskError,
                 ) -> list[Any]:
    """``calls`` as one MULTI/EXEC on the node an ASK named (the slot is migrating there and the source no longer has
    the keys), ASKING first: what :func:`_send` sends where a transaction was refused with ASK.

    Sent again as it was, it went to that node without ASKING (redis-py points the slot at it on an ASK), which
    answered MOVED back: every counts write to the slot failed until the migration ended. ASK allows the next command
    only, but the ASKING flag holds through a MULTI until its EXEC, so ASKING goes before the MULTI (queued inside it,
    it would allow nothing). Where the node lacks some of the keys (the slot's keys split between the two nodes) it
    refuses them with TRYAGAIN as they are queued and the EXEC runs nothing: that error is raised, an outage the caller
    retries under the same write id."""
    node = client.get_node(host=ask.host, port=ask.port)
    if node is None:  # a node redis-py does not know: nothing ran anywhere, the ASK is the failure
        raise ask
    client.execute_command("SCRIPT LOAD", script.script, target_nodes=[node])  # (_load loaded it on the slot's owner)
    pipe = client.get_redis_connection(node).pipeline(transaction=False)  # (not redis-py's MULTI: ASKING precedes it)
    pipe.execute_command("ASKING")
    pipe.execute_command("MULTI")
    for keys, args in calls:
        pipe.execute_command("EVALSHA", script.sha, len(keys), *keys, *args)
    pipe.execute_command("EXEC")
    replies = pipe.execute(raise_on_error=False)  # ASKING, MULTI, one QUEUED (or a refusal) per call, EXEC's results
    done = replies[-1]
    if isinstance(done, Exception):  # EXECABORT: a call was refused as it was queued, and nothing ran
        raise next((r for r in replies[:-1] if isinstance(r, Exception)), done)
    return list(done)


def is_cluster(client: object) -> bool:
    """Whether ``client`` is a Redis Cluster client (keys of different hash slots may live on different nodes)."""
    return isinstance(client, RedisCluster) or (isinstance(client, LazyClient) and client.cluster)


class LazyClient:
    """A client made at its first use, and again at the next use after making it failed (:func:`connect`'s cluster
    client).

    redis-py's ``RedisCluster`` contacts a node when it is made; made at start, an unreachable cluster would stop a
    process from starting (serving, the refresh's notify) where a single node that is down only fails the commands
    sent to it. Through this the failure comes at the first round trip instead, where the callers' own recovery
    (fallback rows, retries, a dropped flush) deals with it as with a single node's. ``cluster``: what
    :func:`is_cluster` says of it without making it."""

    def __init__(self, make: Callable[[], Any], cluster: bool = False) -> None:
        self.cluster = cluster
        self._make = make
        self._client: Any = None
        self._lock = threading.Lock()

    def client(self) -> Any:
        """The client, made now if it is not yet. A cluster that cannot be reached raises :class:`ClusterUnavailable`
        (redis-py's ``RedisClusterUnreachableError`` is no ``RedisError``, which the callers' recovery catches)."""
        with self._lock:
            if self._client is None:
                try:
                    self._client = self._make()
                except RedisClusterException as exc:
                    raise ClusterUnavailable(f"the Redis Cluster cannot be reached ({type(exc).__name__}: {exc})"
                                             ) from exc
            return self._client

    def __getattr__(self, name: str) -> Any:  # only for names this class does not define: the client's commands
        """The client's attribute; a command (a method) raises :func:`unavailable`'s failures, and so do the methods
        of the pipelines and pubsubs it returns: where a single node that is down raises ``redis.ConnectionError``, a
        cluster that cannot serve raises :class:`ClusterUnavailable` (one), never redis-py's ``RedisClusterException``
        mid-run (module docstring)."""
        if name.startswith("_"):
            raise AttributeError(name)
        attr = getattr(self.client(), name)
        return _translating(attr) if callable(attr) else attr

    def register_script(self, script: Any) -> Script:
        """A redis-py :class:`~redis.commands.core.Script` registered on this client (not on the client it makes), so
        that its calls go through :meth:`__getattr__`'s translation too."""
        return Script(self, script)  # type: ignore[arg-type]  # duck-typed: Script calls evalsha and get_encoder

    def close(self) -> None:
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            client.close()



def _client_options(settings: RedisSettings, timeout_s: float, connect_timeout_s: float | None,
                    ) -> dict[str, Any]:
    """A client's timeouts (``connect_timeout_s`` defaults to ``timeout_s``), credentials and TLS."""
    options: dict[str, Any] = {"socket_timeout": timeout_s,
                               "socket_connect_timeout": timeout_s if connect_timeout_s is None else connect_timeout_s}
    if settings.username:  # a user in the url wins in redis-py; RedisSettings refuses two different ones
        options["username"] = settings.username
    password = _password(settings)
    if password:
        options["password"] = password
    if settings.tls:
        options.update(_tls_options(settings))
    return options


# A Lua script of no keys (any node of a cluster runs it): loaded and run by verify, as the history's and the day
# counts' scripts are (SCRIPT LOAD, EVALSHA: redis-py's Script), to ask the ACL for +@scripting at start
_PROBE_SCRIPT = "return 1"
_WHY_SCRIPTING = ("checked at start: streamrec's history and day counts are Lua scripts (README, Security), which a "
                  "user that passes PING without +@scripting failed at the first one")


def _probe_scripting(client: Any) -> None:
    """Load and run :data:`_PROBE_SCRIPT` (SCRIPT LOAD, EVALSHA: what redis-py's ``Script`` sends for the stages'
    scripts); the ACL refusing either raises NOPERM. On a cluster both go to PING's node (its default) alone: SCRIPT
    LOAD on every primary failed the start with one of them down, which the stages' scripts ride out
    (:func:`run_script`). NOSCRIPT (the script cache flushed between the two) is an answer the ACL let through: Redis
    asks the ACL before it looks the script up."""
    target = {"target_nodes": client.get_default_node()} if is_cluster(client) else {}
    sha = client.execute_command("SCRIPT LOAD", _PROBE_SCRIPT, **target)
    with contextlib.suppress(NoScriptError):
        client.execute_command("EVALSHA", sha, 0, **target)


def verify(client: Any, settings: RedisSettings, *, reachable: bool = True) -> bool:
    """PING once, then load and run a script of no keys (:data:`_PROBE_SCRIPT`): whether the login works and the ACL
    user may run the scripts the stages' Redis use needs (``+@scripting``). Refused credentials or scripts raise
    :class:`RedisAuthError` (naming the user and the grant); any other failure raises a :class:`RedisFailure` with
    ``reachable=True``, else returns False (the caller's retries deal with an outage). A NOPERM answer to PING
    counts as logged in (the commands that matter say more)."""
    try:
        with contextlib.suppress(NoPermissionError):  # logged in; an ACL without PING says nothing more
            client.ping()
        try:
            _probe_scripting(client)
        except redis.ResponseError as exc:
            if acl_denied(exc):
                raise RedisAuthError(f"{describe(exc, settings)}; {_WHY_SCRIPTING}") from exc
            raise
    except (redis.RedisError, OSError) as exc:
        err = failure(exc, settings)
        if isinstance(err, RedisAuthError) or reachable:
            raise err from exc
        return False
    return True


def wait_until_up(client: Any, timeout_s: float, running: Callable[[], bool] = lambda: True,
                  pid: int | None = None) -> bool:
    """Whether ``client``'s Redis answers PING within ``timeout_s``: a redis-server just started (by the local stack,
    a test, a benchmark) is polled every 50 ms until it listens, or until ``running`` says it has exited
    (:func:`stream.startup.wait_ready`). With ``pid`` (the process just started), only that process's answer counts
    (``INFO server``'s ``process_id``): another server that took the port between "find a free port" and this one
    binding it answers at once, while this one is still starting (and then exits, its port taken). A server that
    refuses ``INFO`` (renamed, or an ACL without it) cannot say its pid: its PING answer counts, as without ``pid``."""

    def pings() -> bool:
        try:
            if not client.ping():
                return False
        except redis.RedisError:  # not listening yet
            return False
        if pid is None:
            return True
        try:
            return bool(client.info("server").get("process_id") == pid)
        except redis.ResponseError:  # INFO refused: the pid cannot be told (else the start timed out "not started")
            return True
        except redis.RedisError:
            return False

    return wait_ready(pings, timeout_s, running)


def _text(v: Any) -> str:
    return v.decode(errors="replace") if isinstance(v, bytes) else str(v)


def latency_advice(client: Any, settings: RedisSettings) -> str | None:
    """One line saying what in the server's settings costs a caller on the request path latency, or None (nothing
    found, or Redis will not say: ``CONFIG`` renamed away or denied by the ACL, as managed services do, or down).

    What it checks: ``activerehashing`` (Redis's default ``yes``). redis.conf: "use activerehashing no if you have
    hard latency requirements and it is not a good thing in your environment that Redis can reply from time to time
    to queries with 2 milliseconds delay". Once a keyspace grows past a power of two (a refresh writing a version's
    rows), the server spends 1 ms of every 100 ms moving it into the bigger table, for minutes: bench/layered.py
    measured an MGET p99.5 of 1.7 ms with it and 0.3 ms without on 9 M keys. The local stack runs Redis with it off
    (``streamrec.stack.redis_server_args``)."""
    try:
        got = client.config_get("activerehashing")
    except Exception:  # noqa: BLE001 - a probe: Redis that will not say is not a finding
        return None
    value = got.get("activerehashing") if isinstance(got, dict) else None
    if value is None or _text(value) != "yes":
        return None
    return (f"Redis at {redact(settings.url)} runs with activerehashing yes (its default): after its keyspace grows "
            "past a power of two it spends 1 ms of every 100 ms rehashing, for minutes, and ~1% of the reads on the "
            "request path wait up to that long; set `activerehashing no` in its configuration (CONFIG SET "
            "activerehashing no, and in redis.conf) where serving reads it")


def eviction_advice(client: Any, settings: RedisSettings, holds: str) -> str | None:
    """One line saying that the server evicts keys at its memory limit, which would drop ``holds`` (what the caller
    keeps there) without an error, or None: ``maxmemory-policy noeviction`` (Redis's default), no ``maxmemory`` (0:
    no limit, nothing is evicted), or Redis will not say (``CONFIG`` hidden or denied, as managed services do; down).

    Every policy but ``noeviction`` evicts: ``allkeys-*`` any key, ``volatile-*`` those with a TTL, which the day
    counts and strikes have, user histories too unless ``[redis] history_ttl_days`` is 0 (the layered embedding
    store's rows have none). Under ``noeviction`` a write at the limit fails with an OOM error,
    which the callers retry and report (the joiner's batch fails and is redone); an evicted key is never reported: a
    count that restarts from 0, a user with no history, a poison message's strikes forgotten. On a Redis Cluster the
    first node that evicts is named."""
    try:  # a cluster client asks one node unless told to ask them all
        got = (client.config_get("maxmemory*", target_nodes=RedisCluster.ALL_NODES) if is_cluster(client)
               else client.config_get("maxmemory*"))
    except Exception:  # noqa: BLE001 - a probe: Redis that will not say is not a finding
        return None
    if not isinstance(got, dict):
        return None
    nodes = [v for v in got.values() if isinstance(v, dict)] or [got]  # a cluster answers per node
    for node in nodes:
        conf = {_text(k): _text(v) for k, v in node.items()}
        policy, limit = conf.get("maxmemory-policy"), conf.get("maxmemory", "0")
        if policy is None or policy == "noeviction" or not limit.isdigit() or int(limit) == 0:
            continue
        return (f"Redis at {redact(settings.url)} evicts keys when it reaches its memory limit (maxmemory {limit} "
                f"bytes, maxmemory-policy {policy}): {holds} would be dropped without an error once it fills. Set "
                "maxmemory-policy noeviction (a write at the limit then fails, and is retried and reported), or give "
                "it the memory")
    return None


def failure(exc: BaseException, settings: RedisSettings) -> RedisFailure:
    """``exc`` (a Redis or socket error) as a :class:`RedisFailure` carrying :func:`describe`'s line: a
    :class:`RedisAuthError` when :func:`describe` says it is the credentials' or the ACL's to fix (by
    :func:`acl_denied`, also a command denied inside a script, which Redis 6 says with no NOPERM code)."""
    cls = RedisAuthError if isinstance(exc, _AUTH_ERRORS) or acl_denied(exc) else RedisFailure
    return cls(describe(exc, settings))


# What to fix when OpenSSL refused the server's certificate for a reason other than its CA (a "check ssl_ca_certs" sent
# the operator to a CA file that was right): the url's host is not one the certificate names, or it is out of date.
# stream.tls.certificate_refusal says the same with the certificate's names or dates (one handshake of our own, with
# these settings' files): this text is what is said when that handshake does not give the reason redis-py's error gave
_TLS_VERIFY_ADVICE = (
    (("Hostname mismatch", "IP address mismatch"),
     "the url's host is not a name or address the server's certificate holds: connect by one it lists (its subject "
     "alternative names), or reissue the certificate for this host"),
    (("certificate has expired", "certificate is not yet valid"),
     "the server's certificate (or a CA's above it) is outside its validity dates: renew it, or check the clock of "
     "this machine and of the server"),
)


def _tls_advice(text: str) -> str:
    """What a rediss:// connection failure (``text``, its error) asks to check: the reason OpenSSL gave when it names
    one (:data:`_TLS_VERIFY_ADVICE`), else the CA and that the port speaks TLS."""
    for reasons, advice in _TLS_VERIFY_ADVICE:
        if any(reason in text for reason in reasons):
            return f" (TLS: {advice})"
    return " (TLS: check ssl_ca_certs and that the server speaks TLS on that port)"


_VERIFY_FAILED = "certificate verify failed"
_CONNECTING_TO = re.compile(r"connecting to (\S+):(\d+)\.")  # redis-py's "Error 1 connecting to HOST:PORT. ..."


def _certificate_refusal(text: str, settings: RedisSettings) -> str | None:
    """Why the server's certificate was refused (:func:`stream.tls.certificate_refusal`, with the names or dates it
    holds), when ``text`` (a rediss:// connection's error) gives one of :data:`_TLS_VERIFY_ADVICE`'s reasons and the
    handshake, with these settings' files, gives the same one; None otherwise. The server is the one ``text`` names
    (a cluster's node), else the url's."""
    said = next((r for reasons, _ in _TLS_VERIFY_ADVICE for r in reasons if r in text), None)
    if said is None:
        return None
    try:
        if node := _CONNECTING_TO.search(text):
            host, port = node.group(1), int(node.group(2))
        else:
            url = urlsplit(settings.url)
            host, port = url.hostname or "localhost", url.port or 6379
        ctx = _tls_context(settings)
    except (ConfigError, ValueError):  # a file changed since the client was built, a port out of range: the text's
        return None  # advice stands
    reason = certificate_refusal(ctx, host, port, REFUSAL_TIMEOUT_S)
    return reason if reason is not None and said in reason else None


def _handshake_advice(text: str) -> str:
    """What a rediss:// connection that timed out connecting (``text``, its error) asks to check: a Redis without TLS on
    that port never answers the handshake, which was said as a Redis that did not answer in time, nothing more."""
    if "Timeout connecting" in text:
        return (" (TLS: a port without TLS never answers the handshake: check that the server speaks TLS on that port, "
                "or use a redis:// url)")
    return ""


def describe(exc: BaseException, settings: RedisSettings) -> str:
    """One line for a failed Redis operation: which Redis (url redacted), what happened, what to check."""
    where = f"Redis at {redact(settings.url)}"
    what = quoted(redact(f"{type(exc).__name__}: {exc}"), 240)
    who = f"ACL user {settings.user!r}" if settings.user else "the default user"
    if acl_denied(exc):  # NOPERM, also a command a script called (Redis 6 gives that one no code)
        grant = _acl_grant(exc)
        return (f"{where}: {who} lacks a permission this needs ({what}); grant it in the Redis ACL "
                f"({grant + '; ' if grant else ''}keys ~{settings.prefix}:*, channels &{settings.prefix}:*)")
    if isinstance(exc, _AUTH_ERRORS):
        if not settings.has_password:
            return (f"{where} requires authentication and no password is configured ({what}); set [redis] "
                    "password_file (or password_env), and username for an ACL user")
        return (f"{where} refused the credentials of {who} ({what}); check [redis] username and "
                "password_file / password_env (or the password in the url)")
    if isinstance(exc, redis.TimeoutError):
        return f"{where} did not answer in time ({what}){_handshake_advice(str(exc)) if settings.tls else ''}"
    if isinstance(exc, (redis.ConnectionError, OSError)):
        if settings.tls and (refusal := _certificate_refusal(str(exc), settings)):
            cut = what.find(_VERIFY_FAILED)  # the reason is said once, in the refusal
            what = what[:cut + len(_VERIFY_FAILED)] if cut >= 0 else what
            return f"{where} cannot be reached ({what}) (TLS: {refusal})"
        return f"{where} cannot be reached ({what}){_tls_advice(str(exc)) if settings.tls else ''}"
    return f"{where}: {what}"
