"""Poison messages: how often each input message was in a batch that made its process fail.

The rule every consumer follows (joiner, learner): an *unexpected* exception while processing a batch
stops the worker without committing anything of it, and every message of the failed batch gets a
strike, durably (the worker restarts as a fresh process). A message with strikes is processed alone
on the next attempts, so the one that keeps failing is isolated from its innocent neighbours: after
``limit`` failures in a row it is dead-lettered with kind ``poison`` and the last error as its
reason, and processing moves on. A message processed successfully (or dead-lettered) loses its strikes once the
whole batch it came in is processed: a failure later in that batch leaves it uncommitted, to be read again, and a
poison message that started over from no strikes each time would take about ``limit ** n`` failures for n of them in
a row.

Failures of the infrastructure (the broker, Redis, the disk) are not the message's fault and give no
strikes (:func:`is_infrastructure`): a Redis outage, or a Redis out of memory, read-only or failing over, must never
dead-letter good data. A Redis error reply to what a message carried (a WRONGTYPE, a script's error on a value) is the
message's, and gives strikes: counted as the infrastructure's it failed its batch forever.

Stores: :class:`RedisStrikes` (the joiner, whose state lives off-host anyway), :class:`FileStrikes` (the
learner, next to its checkpoints) and :class:`PartitionFileStrikes` (the learner on N ranks: one file per
partition, so that each file has one writer whatever the world size). All keep only messages that failed,
so they stay tiny; a key is ``"{topic}:{partition}:{offset}"``. A consumer whose partitions move between workers
reads a partition's strikes from the store again when it is assigned (:meth:`Strikes.reload`), and drops them when it
is revoked (:meth:`Strikes.forget`): its previous owner may have struck it after this worker started.

Entries are bounded: a message's strikes go when it is processed or dead-lettered, and otherwise when its consumer's
position is known to be past it (:meth:`Strikes.settle`: the joiner's committed offsets, read when it reloads a
partition that has strikes; the learner's checkpoint offsets, at its start), since it is never read again then (a
message committed past by another worker after a rebalance, a partition that moved away and came back). The joiner's
Redis hash also expires :data:`STRIKES_TTL_S` after its last strike was written (a group no longer run): a retry of one
message never takes that long, and a strike lost that way only lets the message fail ``limit`` times again.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Protocol

import redis
from confluent_kafka import KafkaException

from stream.errors import ConfigError, DeliveryFailed, PartitionLost, quoted
from stream.files import MAX_STATE_FILE_BYTES, FileTooLarge, NotRegularFile, read_regular, write_atomic
from stream.redis_client import RedisAuthError, RedisFailure, acl_denied, script_codes, wrong_type

log = logging.getLogger("streamrec.strikes")

Key = tuple[str, int, int]  # (topic, partition, offset)


# Redis error replies that say what state the server is in, not what a command carried: out of memory (OOM), a replica
# or a read-only primary (READONLY), a script running too long (BUSY), loading its data (LOADING), unable to persist
# (MISCONF), too few replicas (NOREPLICAS), a cluster failing over or resharding (CLUSTERDOWN, MASTERDOWN, TRYAGAIN,
# MOVED, ASK), a script cache flushed by a restart or a failover (NOSCRIPT: every caller reloads its scripts on the
# next attempt, ``stream/redis_client.py`` run_script and redis-py's Script), and an ACL user without a permission
# (NOPERM, and AUTH refused on connecting: the configuration's fault, never a message's). Each passes, or is fixed,
# without any message being changed.
_SERVER_STATE = frozenset({"OOM", "READONLY", "BUSY", "LOADING", "MISCONF", "NOREPLICAS", "CLUSTERDOWN", "MASTERDOWN",
                           "TRYAGAIN", "MOVED", "ASK", "NOSCRIPT", "NOPERM"})
_SERVER_STATE_ERRORS = (redis.exceptions.OutOfMemoryError, redis.exceptions.ReadOnlyError,
                        redis.exceptions.ClusterDownError, redis.exceptions.TryAgainError, redis.exceptions.AskError,
                        redis.exceptions.NoScriptError, redis.exceptions.NoPermissionError,
                        redis.exceptions.AuthenticationWrongNumberOfArgsError, redis.exceptions.NoSuchFieldsetError)


def _server_state(exc: redis.ResponseError) -> bool:
    """Whether a Redis error reply is one of :data:`_SERVER_STATE`: by redis-py's class, else by the reply's code
    (redis-py keeps it as ``status_code``; an error re-raised from a script's result, ``stream/history.py``, has only
    its text, which starts with the code), or by the code of the command a script called
    (:func:`~stream.redis_client.script_codes`; an ACL's refusal however Redis says it,
    :func:`~stream.redis_client.acl_denied`)."""
    if isinstance(exc, _SERVER_STATE_ERRORS):
        return True
    text = str(exc)
    code = getattr(exc, "status_code", None) or text.split(" ", 1)[0]
    if code in _SERVER_STATE:
        return True
    return any(c in _SERVER_STATE for c in script_codes(text)) or acl_denied(exc)


# After an infrastructure failure (:func:`is_infrastructure`) a join driver rewinds to its committed offsets and waits
# before reading again: the first wait, and the longest (doubling in between; back to the first after a good batch).
RECOVERY_BACKOFF_S = (1.0, 30.0)


def is_infrastructure(exc: BaseException) -> bool:
    """True for failures of what a message travels through, not of the message itself.

    Redis fails either way: unreachable, timed out or answering from a state it is in (:data:`_SERVER_STATE`) is the
    infrastructure; an error reply to what a command carried (``WRONGTYPE`` on a key the message names, ``ERR value is
    not an integer or out of range``, a Lua script's error on a value, ``CROSSSLOT``) or a value redis-py refuses to
    encode (``DataError``) fails the same way every time the message is processed: the message's fault, struck like
    any other, so that it is isolated and dead-lettered instead of failing its batch forever."""
    if isinstance(exc, RedisFailure):  # streamrec's one line for a failed Redis call: judged by what it wraps
        cause = exc.__cause__
        return True if cause is None or isinstance(exc, RedisAuthError) else is_infrastructure(cause)
    if isinstance(exc, redis.ResponseError):
        return _server_state(exc)
    if isinstance(exc, redis.DataError):
        return False
    return isinstance(exc, KafkaException | DeliveryFailed | PartitionLost | redis.RedisError | OSError | TimeoutError
                      | MemoryError)


def _text(key: Key) -> str:
    return f"{key[0]}:{key[1]}:{key[2]}"


def _str(raw: bytes | str) -> str:
    return raw.decode() if isinstance(raw, bytes) else raw


def _key(text: str) -> Key:
    topic, partition, offset = text.rsplit(":", 2)
    return topic, int(partition), int(offset)


class StrikeStore(Protocol):
    def load(self) -> dict[Key, tuple[int, str]]: ...

    def save(self, changed: dict[Key, tuple[int, str]], cleared: list[Key]) -> None: ...


class Strikes:
    """Strike counts of one consumer (see the module docstring). ``limit`` failures make a poison message."""

    def __init__(self, store: StrikeStore, limit: int = 3) -> None:
        if limit < 1:
            raise ValueError(f"poison_after: got {limit!r}, expected an integer >= 1")
        self.store, self.limit = store, limit
        self.counts: dict[Key, tuple[int, str]] = store.load()  # key -> (failures in a row, last error)

    def suspect(self, key: Key) -> bool:
        return key in self.counts

    def poisoned(self, key: Key) -> str | None:
        """The dead-letter reason if ``key`` has failed ``limit`` times, else None."""
        n, error = self.counts.get(key, (0, ""))
        if n < self.limit:
            return None
        return f"made the consumer fail {n} times in a row; last error: {error}"

    def failed(self, keys: Iterable[Key], exc: BaseException) -> None:
        """Record one failure of every message in a failed batch (durably, before the process stops)."""
        error = quoted(f"{type(exc).__name__}: {exc}", 300)
        changed = {k: (self.counts.get(k, (0, ""))[0] + 1, error) for k in keys}
        self.counts.update(changed)
        self.store.save(changed, [])

    def reload(self, partitions: Iterable[int],
               committed: Callable[[list[int]], dict[tuple[str, int], int]] | None = None) -> None:
        """The store's strikes of ``partitions`` replace those held here: a partition assigned by a rebalance brings
        the strikes its previous owner gave (written before that owner stopped, after this one read the store), so
        its suspects still go alone, their failures add to what they had, and their strikes are cleared here.

        ``committed``: asked only when the store has strikes of ``partitions``, the group's committed offsets of
        those partitions (``{(topic, partition): offset}``, the next offset to read); the strikes below them are
        :meth:`settle`'d, not loaded (a message committed past by another owner, or after a rebalance)."""
        mine = set(partitions)
        stored = {k: v for k, v in self.store.load().items() if k[1] in mine}
        self.counts = {k: v for k, v in self.counts.items() if k[1] not in mine}
        self.counts.update(stored)
        if stored and committed is not None:
            self.settle(committed(sorted({k[1] for k in stored})), stored)

    def settle(self, positions: dict[tuple[str, int], int], stored: dict[Key, tuple[int, str]] | None = None) -> int:
        """Drop every strike (here and in the store) of a message below its topic-partition's position in
        ``positions`` (``{(topic, partition): next offset to read}``: a committed offset, a checkpoint's): the
        consumer never reads it again, so its strikes would stay forever. ``stored``: the store's strikes, when the
        caller just loaded them. Returns how many were dropped.

        A position moved back by hand (an offset reset) reads such a message again without strikes: it starts over,
        as a message never struck; nothing is dead-lettered for lack of them."""
        if not positions:
            return 0
        known = self.store.load() if stored is None else stored
        stale = [k for k in {*known, *self.counts} if k[2] < positions.get((k[0], k[1]), -1)]
        for k in stale:
            self.counts.pop(k, None)
        if stale:
            self.store.save({}, stale)
        return len(stale)

    def forget(self, partitions: Iterable[int]) -> None:
        """Drop the strikes of revoked ``partitions`` here (the store keeps them for the next owner)."""
        gone = set(partitions)
        self.counts = {k: v for k, v in self.counts.items() if k[1] not in gone}

    def succeeded(self, keys: Iterable[Key]) -> None:
        """Messages processed (or dead-lettered) after all: they are no suspects any more."""
        cleared = [k for k in keys if k in self.counts]
        for k in cleared:
            del self.counts[k]
        if cleared:
            self.store.save({}, cleared)


def settle_strikes(strikes: Strikes, positions: dict[tuple[str, int], int]) -> None:
    """:meth:`Strikes.settle` at a consumer's start (the learner's checkpoint offsets), where a store that cannot be
    written now (a full disk) must not stop it: the strikes are dropped at a later start instead."""
    try:
        dropped = strikes.settle(positions)
    except OSError as exc:
        log.warning("could not drop the strikes below the consumer's positions (kept for now): %s", exc)
        return
    if dropped:
        log.info("dropped the strikes of %d message(s) below the consumer's positions: never read again", dropped)


STRIKES_TTL_S = 30 * 86_400  # a Redis hash of strikes is dropped 30 days after its last strike was written


class RedisStrikes:
    """Strikes in one Redis hash per consumer group: field = message key, value = ``"{count} {error}"``. The hash
    expires ``ttl_s`` after its last strike was written (module docstring)."""

    def __init__(self, client: redis.Redis, key: str, ttl_s: int = STRIKES_TTL_S) -> None:
        self.client, self.key, self.ttl_s = client, key, ttl_s

    def load(self) -> dict[Key, tuple[int, str]]:
        """The stored strikes. Redis is shared: an entry another client wrote is no strike unless it is one this
        class writes, a count >= 1 (a count of -100 let a poison message fail its batch 100 more times). The key
        holding another Redis type (a string, a list: WRONGTYPE) is a :class:`ConfigError` naming it and the fix
        (it was a bare ``ResponseError`` at every start): strikes that cannot be written would let a poison message
        stop the joiner at every restart, forever, so it does not start without them."""
        try:
            stored = self.client.hgetall(self.key)  # bytes: the client does not decode
        except redis.ResponseError as exc:
            if not wrong_type(exc):
                raise
            raise ConfigError(f"Redis key {self.key!r} is not the hash of poison strikes streamrec writes (WRONGTYPE: "
                              "another application using this [redis] prefix?): without it a poison message would stop "
                              f"the joiner at every restart; delete it (redis-cli DEL {self.key}) or set another "
                              "prefix") from exc
        out = {}
        for field, value in stored.items():
            try:
                n, _, error = _str(value).partition(" ")
                if int(n) >= 1:
                    out[_key(_str(field))] = (int(n), error)
            except (ValueError, UnicodeDecodeError):
                continue  # a damaged entry is no strike
        return out

    def save(self, changed: dict[Key, tuple[int, str]], cleared: list[Key]) -> None:
        pipe = self.client.pipeline(transaction=False)
        if changed:
            pipe.hset(self.key, mapping={_text(k): f"{n} {e}" for k, (n, e) in changed.items()})
            pipe.expire(self.key, self.ttl_s)
        if cleared:
            pipe.hdel(self.key, *(_text(k) for k in cleared))
        pipe.execute()


class FileStrikes:
    """Strikes in a JSON file, replaced atomically (write, fsync, rename)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._all: dict[Key, tuple[int, str]] = {}

    def load(self) -> dict[Key, tuple[int, str]]:
        try:
            raw = json.loads(read_regular(self.path, MAX_STATE_FILE_BYTES, "a strikes file"))
            self._all = {_key(k): (int(v[0]), str(v[1])) for k, v in raw.items()}
        except FileNotFoundError:
            self._all = {}
        except (NotRegularFile, FileTooLarge) as exc:  # a FIFO there hung the learner's start; read as damaged
            log.warning("%s; starting without its strikes", exc)
            self._all = {}
        except (ValueError, TypeError, KeyError, IndexError, AttributeError, OverflowError, RecursionError):
            self._all = {}  # damaged (Infinity as a count, nesting deeper than json recurses): start without strikes
        return dict(self._all)

    def save(self, changed: dict[Key, tuple[int, str]], cleared: list[Key]) -> None:
        self._all.update(changed)
        for k in cleared:
            self._all.pop(k, None)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(self.path, json.dumps({_text(k): list(v) for k, v in self._all.items()}).encode())


class PartitionFileStrikes:
    """Strikes of some partitions, one :class:`FileStrikes` file per partition (``<directory>/strikes-<p>.json``).

    The learner's ranks read disjoint partitions, so each file has one writer; a restart on another world size
    hands a partition, and its file, to another rank."""

    def __init__(self, directory: Path, partitions: Iterable[int]) -> None:
        self.directory = Path(directory)
        self.files = {p: FileStrikes(self.directory / f"strikes-{p}.json") for p in partitions}

    def hold(self, partitions: Iterable[int]) -> None:
        """Hold ``partitions`` too (one already held: nothing): samples partitions added to the topic while the rank
        reads. What a file of one holds already (left by another reader) stays in it; it is no strike here before the
        next start loads it (a new partition's messages have none)."""
        for p in partitions:
            if p not in self.files:
                self.files[p] = FileStrikes(self.directory / f"strikes-{p}.json")
                self.files[p].load()

    def load(self) -> dict[Key, tuple[int, str]]:
        out: dict[Key, tuple[int, str]] = {}
        for p, store in self.files.items():
            out.update({k: v for k, v in store.load().items() if k[1] == p})
        return out

    def save(self, changed: dict[Key, tuple[int, str]], cleared: list[Key]) -> None:
        for p, store in self.files.items():
            mine_changed = {k: v for k, v in changed.items() if k[1] == p}
            mine_cleared = [k for k in cleared if k[1] == p]
            if mine_changed or mine_cleared:
                store.save(mine_changed, mine_cleared)
        unknown = sorted({k[1] for k in [*changed, *cleared]} - set(self.files))
        if unknown:
            raise ValueError(f"strikes for partitions {unknown}, which this store does not hold")
