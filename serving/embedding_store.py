"""The layered deployment's embedding store: cold rows in Redis, fetched per request, cached in a bounded LRU.

``[serve] embedding_store = "layered"`` splits the table the in-process mode keeps in one process::

    ranker (serving/model.py)                            embedding store (Redis, or Redis Cluster)
      hot rows + MLP      (the scorer, on the device)      <prefix>:emb:<version>:meta    JSON, written LAST
      delta overrides     (learner deltas, as today)       <prefix>:emb:<version>:r:<row> D + 1 values, raw
      bucket rows         (dynamic fields' fallback rows,                                  float32 | float16 LE,
                                                                                           then a 4-byte tag
                           copied from the artifact)       <prefix>:emb:<version>:d:<row> delta overlay: the same,
                                                                                           written by serving,
                                                                                           never read by requests
      RowCache            (bounded LRU of fetched rows) <-- one MGET per request for its misses

A row is read, in order, from: the scorer's hot set, the delta overrides, the local bucket rows, the LRU, Redis.
Every row a request needs from Redis is asked for in ONE round trip (``MGET``; with ``embedding_store_cluster``
one MGET per hash slot, pipelined: one round trip per cluster node holding any of them), deduplicated; past
``_FETCH_CHUNK`` keys, as pipelined MGETs of that many (still one round trip: one huge MGET outlasts the timeout).

**Key layout: one key per row**, under a per-version prefix. ``MGET`` of N keys is one command, one round trip and
O(N) on the server, and per-row keys hash to cluster slots independently, so a cluster spreads a version evenly
with no hash tags. The price is Redis's per-key overhead: ~190 B per float32 row of D = 16 (68 B of values;
bench/layered.py measured 170 MB for 0.9 M rows). Buckets (a hash of 64-256 rows per key, ``HMGET``) would store
the same rows in roughly half that (listpack hashes carry little per-field overhead) but cost one command per
bucket touched (~a hundred per request: a request's rows are scattered over the table), and a pipeline of a hundred
commands costs more client time than one MGET; memory is the cheaper resource here. The version in every key means
a new artifact never reads an old artifact's rows (a table's rows mean nothing under another version's hot set and
deltas): the refresh writes a version's rows before it publishes it, ``meta`` last (a version without ``meta`` is
incomplete and never served), and deletes the keys of versions it prunes (:func:`write_version`,
:func:`delete_version`, ``cache_refresh/job.py`` and ``cache_refresh/stored_rows.py``).

**Integrity: a tag per value** (``meta["row_check"] = "wsum32"``, :func:`row_tags`): the last 4 bytes of every value
are a weighted sum of its bytes, its row and its version and dtype (:func:`tag_key`), mod 2^32. A value of the right
length that is not this version's row (another version's or dtype's, another row's, garbage, a flipped bit) is
malformed: its row falls back alone, like a missing key. Cost (bench/layered.py, 1 M rows): +4 B per key (Redis
170 -> 186 MB for 0.9 M float32 rows), ~13 us per 100 rows fetched (decoding), within the machine's noise on the
request's p50/p99. A version whose meta has no ``row_check`` (written before the tags) is read untagged; serving
before this change reads a tagged version's values as of the wrong length: **upgrade serving before the refresh**.

**Deltas.** Serving applies the learner's deltas as overrides exactly as in-process (``ScoringModel.apply_delta``),
so a delta changes layered scores exactly as it changes in-process ones, with or without Redis; the LRU drops the
rows a delta changes (:meth:`LayeredRows.on_delta`), so nothing stale is served from it either. **A version's row
keys (``r:``) only ever hold the artifact's rows**: the refresh writes them, nothing else does. A version is loaded
again with its deltas dropped (``streamrec refresh --rollback`` pins it with no deltas; a restart or a swap back
applies only the deltas serving reads after loading it), so rows of deltas written over its ``r:`` keys would serve
a model no one trained: the artifact's hot rows and dense weights with a later delta's cold rows. With
``embedding_store_write_deltas`` (off by default) the serving process that applies a delta writes its non-hot rows
apart, to the version's **delta overlay** ``<prefix>:emb:<version>:d:<row>`` (one pipelined MSET per delta, best
effort, in the version's dtype, so only once its meta was read; a failed write is counted in ``..._errors_total``
but does not make requests skip Redis). Requests never read the overlay: every ranker that applies deltas to a
version holds their rows as overrides until its next artifact, and one that does not apply them (a pinned rollback)
must not see them; rows of deltas pruned before a ranker read them wait for the next artifact, as in-process
(``learner/deltas.py``). The overlay is what serving has applied to the version, newest write wins (for tools and
for inspection), and is deleted with the version (:func:`delete_version`); it can grow to one value per non-hot row
the deltas touch in the version's life, as large as the version's own rows, which is why it is off unless a tool
reads it. Versions written before the overlay existed may hold delta rows under ``r:``: ``streamrec refresh --now``
writes a clean version.

**Redis down** (refused, timed out): the round trip counts in ``streamrec_serving_embedding_store_errors_total`` (the
default alert rule ``embedding_store_errors`` fires on it), requests skip Redis for ``embedding_store_retry_after_s``
(one failed round trip per period, not one per request), and the rows it should have given fall back: an admitted
id's own row to its hash bucket's row (the row the id would have if it were not admitted, kept locally), any other
row (a static field's hash row: it is its own bucket) to zeros, the "unknown" value of an embedding;
``..._fallback_rows_total{kind}`` counts them. Hot rows, overrides and cached rows keep serving; no request fails.
The outage is logged once, at its first failed read, and once more when Redis answers again.
Nothing is cached from a failed round trip. **A bad row** (its key missing: deleted, evicted; or its value malformed:
of another length, not finite or beyond ``MAX_ROW_ABS``, a bound no trained row reaches) is not Redis being down: that
row alone falls back, uncached, the round trip's other rows are served and cached, and Redis stays in use;
``..._bad_rows_total{reason}`` counts the rows and ``..._errors_total`` the round trip (so the alert fires for a
deleted version as for a Redis that is down).
"""

from __future__ import annotations

import functools
import json
import logging
import math
import re
import threading
import time
import zlib
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, cast

import numpy as np
from redis.cluster import PipelineCommand
from redis.crc import key_slot
from redis.exceptions import AskError, ClusterError, ResponseError, TryAgainError

from learner.artifact import ArtifactError
from serving.settings import RowDtype
from stream.redis_client import wrong_type
from stream.redis_deadline import replies_by

log = logging.getLogger("streamrec.serve")

_WRITE_CHUNK = 20_000  # rows per MSET while a version is written (~1.4 MB of float32 rows at D = 16)
# Keys per MGET when a request's misses are read (single node): more go as pipelined MGETs of at most this many, in
# the same one round trip. One MGET of the 262,144 rows a request may look up ([serve] max_request_values) kept Redis
# busy past a 50 ms embedding_store_timeout_s before its first reply byte (measured: a TimeoutError, so EVERY
# request's misses fell back for retry_after_s); 5,000 keys take Redis ~7 ms, and their reply is read as it comes.
_FETCH_CHUNK = 5_000


# The largest |value| a row may hold (a delta's, an artifact's, one read from Redis; serving/model.py row_problem): a
# bag pools up to 1,024 rows (events' list limit) and the FM squares the sum over fields; float32 overflows past
# ~1.8e19 squared. 1e12 leaves 1e7 of headroom there and is far beyond any trained embedding (a row this large means
# the learner diverged, or Redis holds a value no refresh wrote).
MAX_ROW_ABS = 1e12


def version_prefix(prefix: str, version: str) -> str:
    """``<prefix>:emb:<version>:``, the start of every key of one version's rows."""
    return f"{prefix}:emb:{version}:"


def glob_literal(text: str) -> str:
    """``text`` as a SCAN ``MATCH`` pattern matching itself only: a prefix "p?" (legal) or a stray version key
    named "*" matched other prefixes' and versions' keys, which pruning then deleted."""
    return re.sub(r"([\\*?\[\]])", r"\\\1", text)


def meta_key(prefix: str, version: str) -> str:
    return version_prefix(prefix, version) + "meta"


def writer_key(prefix: str, version: str) -> str:
    """A version's writer marker, set before its first row and deleted with it last (:func:`unfinished_versions`)."""
    return version_prefix(prefix, version) + "writer"


def row_keys(prefix: str, version: str, rows: np.ndarray) -> list[str]:
    """The keys of global rows ``rows`` (M,) of a version."""
    start = version_prefix(prefix, version) + "r:"
    return [start + str(r) for r in rows.tolist()]


def overlay_keys(prefix: str, version: str, rows: np.ndarray) -> list[str]:
    """The keys of global rows ``rows`` (M,) in a version's delta overlay (module docstring: never its row keys,
    which hold the artifact's rows only)."""
    start = version_prefix(prefix, version) + "d:"
    return [start + str(r) for r in rows.tolist()]


ROW_CHECK = "wsum32"  # meta["row_check"]: every value ends in a 4-byte tag (:func:`row_tags`)
_TAG_BYTES = 4
_ROW_MIX = np.uint64(0x9E3779B1)


def tag_key(version: str, dtype: RowDtype) -> int:
    """The part of every row's tag that names its version and dtype (a value of another version or dtype fails)."""
    return zlib.crc32(f"{version}\0{dtype}".encode())


@functools.lru_cache(maxsize=16)
def _weights(width: int) -> np.ndarray:
    """(width,) odd 32-bit weights, one per byte of a value (a change of any one byte changes the tag), as float64:
    a BLAS product, exact (each term < 2^40, a sum of W < 2^13 of them < 2^53)."""
    w = np.random.default_rng(width).integers(0, 2 ** 31, width, dtype=np.uint64) * 2 + 1
    w.flags.writeable = False
    return w.astype(np.float64)


def row_tags(payload: np.ndarray, rows: np.ndarray, key: int) -> np.ndarray:
    """(M,) uint32 tags of ``payload`` (M, W) uint8, the values of global ``rows`` (M,) under ``key``
    (:func:`tag_key`): a weighted sum of the bytes plus the row and the key, mod 2^32. Not a cryptographic check:
    it refuses a value of another version, dtype or row, and garbage or a damaged value (but for 1 in 2^32), for
    ~a microsecond per request (one small integer matrix product)."""
    s = (payload.astype(np.float64) @ _weights(payload.shape[1])).astype(np.uint64)  # (M,), exact
    s += rows.astype(np.uint64) * _ROW_MIX + np.uint64(key)
    return (s & np.uint64(0xFFFFFFFF)).astype(np.uint32)


def encode_rows(vectors: np.ndarray, dtype: RowDtype, rows: np.ndarray | None = None,
                key: int | None = None) -> list[bytes]:
    """(M, D + 1) float -> M little-endian byte strings of ``dtype``, each followed by its 4-byte tag when ``key``
    (:func:`tag_key`; ``rows`` (M,) the global rows). ValueError for a finite value ``dtype`` cannot hold (beyond
    float16's 65504: it would be stored as inf, a row every read then refuses)."""
    with np.errstate(over="ignore"):
        arr = np.ascontiguousarray(vectors, dtype=np.dtype(str(dtype)).newbyteorder("<"))
    if dtype is not RowDtype.FLOAT32 and not np.isfinite(arr).all():
        lost = int((np.isfinite(np.asarray(vectors, np.float64)) & ~np.isfinite(arr)).sum())
        if lost:
            raise ValueError(f"{lost} values are beyond {dtype}'s range (max |x| "
                             f"{float(np.abs(np.asarray(vectors, np.float64)).max()):.6g}): store the rows as float32 "
                             "([refresh] embedding_store_dtype = \"float32\")")
    payload = arr.view(np.uint8).reshape(len(arr), -1)  # (M, W)
    if key is not None:
        assert rows is not None, "a tagged value names its row"
        tags = row_tags(payload, np.asarray(rows, np.int64), key).astype("<u4").view(np.uint8).reshape(-1, _TAG_BYTES)
        payload = np.concatenate([payload, tags], axis=1)  # (M, W + 4)
    width = payload.shape[1]
    raw = payload.tobytes()
    return [raw[i:i + width] for i in range(0, len(raw), width)]


def decode_rows(values: list[bytes], dim: int, dtype: RowDtype) -> np.ndarray:
    """M byte strings of ``dim`` ``dtype`` values each (untagged) -> (M, dim) float32. A value of another length
    raises ValueError."""
    dt = np.dtype(str(dtype)).newbyteorder("<")
    if any(len(v) != dim * dt.itemsize for v in values):  # each value: lengths that only add up would split rows
        raise ValueError(f"embedding store rows of {sorted({len(v) for v in values})} bytes, expected "
                         f"{dim * dt.itemsize} ({dim} x {dtype})")
    return np.frombuffer(b"".join(values), dtype=dt).reshape(len(values), dim).astype(np.float32)


def decode_answer(values: list[bytes | None], dim: int, dtype: RowDtype, rows: np.ndarray | None = None,
                  key: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """An MGET's M answers for global ``rows`` (M,) -> (vectors (M, dim) float32, missing (M,) bool, malformed (M,)
    bool), row by row: a None is missing; a value of another length, whose tag does not match (with ``key``: the
    version's :func:`tag_key`, values tagged by :func:`encode_rows`) or holding values non-finite or beyond
    :data:`MAX_ROW_ABS` is malformed; their vectors are zeros. Never raises on the values: one bad key costs its own
    row only (module docstring)."""
    m = len(values)
    dt = np.dtype(str(dtype)).newbyteorder("<")
    width = dim * dt.itemsize + (_TAG_BYTES if key is not None else 0)
    missing = np.zeros(m, dtype=bool)
    malformed = np.zeros(m, dtype=bool)
    # The common case: every value there and each of the right length (one join, no Python loop). Each value's
    # length, not the total: a short value beside a long one, or one key holding two rows beside an empty one, add
    # up to the right total and would be read across their rows (each of two concatenated rows even passes its tag).
    if None not in values and set(map(len, cast("list[bytes]", values))) == {width}:
        arr = np.frombuffer(b"".join(cast("list[bytes]", values)), dtype=np.uint8).reshape(m, width)
    else:
        arr = np.zeros((m, width), np.uint8)
        good: list[int] = []
        parts: list[bytes] = []
        for i, v in enumerate(values):
            if v is None:
                missing[i] = True
            elif len(v) != width:
                malformed[i] = True
            else:
                good.append(i)
                parts.append(v)
        if good:
            arr[good] = np.frombuffer(b"".join(parts), dtype=np.uint8).reshape(len(good), width)
    if key is not None:
        assert rows is not None, "a tagged value names its row"
        payload = arr[:, :-_TAG_BYTES]
        tags = np.ascontiguousarray(arr[:, -_TAG_BYTES:]).view("<u4")[:, 0]  # (M,)
        malformed |= ~missing & ~malformed & (tags != row_tags(payload, np.asarray(rows, np.int64), key))
    else:
        payload = arr
    out = np.ascontiguousarray(payload).view(dt).astype(np.float32)  # (M, dim)
    # finite and within the bound every served row keeps (NaN compares False): 1e30 under a matching tag scored NaN
    servable = (np.abs(out) <= MAX_ROW_ABS).all(axis=1)  # (M,)
    malformed |= ~missing & ~servable
    out[missing | malformed] = 0.0
    return out, missing, malformed


# -- writing and deleting a version (the refresh) ----------------------------------------------------------------
def write_version(client: Any, prefix: str, version: str, table: np.ndarray, rows: np.ndarray, dtype: RowDtype,
                  chunk: int = _WRITE_CHUNK, owner: str = "", between: Callable[[], object] = lambda: None,
                  ) -> dict[str, Any]:
    """Write ``table[rows]`` ((N, D + 1) table, rows (M,) int64) as one key per row, then ``meta`` last.

    ``owner`` (the refresh: its publish root) is recorded in ``meta``; a refresh prunes only its own versions, so
    two publish roots sharing a Redis prefix never delete each other's rows. It is also written, before the first
    row, in the version's writer marker (:func:`writer_key`): a write killed before ``meta`` leaves rows no meta
    names, which pruning (by meta) would never find; :func:`unfinished_versions` finds them by the marker.

    ``client`` is a ``redis.Redis`` or ``RedisCluster`` (``mset_nonatomic`` there: keys of many slots). Redis
    errors propagate (the refresh fails its stage and publishes nothing). ``between`` (the refresh's stop check) is
    called after each chunk: what it raises ends the write before ``meta``, as a Redis error does. Returns the meta
    written."""
    rows = np.asarray(rows, dtype=np.int64)
    _claim(client, prefix, version, owner, int(table.shape[0]))  # the writer marker, before any row
    key = tag_key(version, dtype)  # every value tagged (ROW_CHECK): serving refuses one of another version or row
    mset = getattr(client, "mset_nonatomic", None) or client.mset
    for start in range(0, len(rows), chunk):
        part = rows[start:start + chunk]
        mset(dict(zip(row_keys(prefix, version, part), encode_rows(table[part], dtype, part, key), strict=True)))
        between()
    meta = {"version": version, "rows": int(table.shape[0]), "dim": int(table.shape[1]), "dtype": str(dtype),
            "stored": int(len(rows)), "owner": owner, "row_check": ROW_CHECK}
    client.set(meta_key(prefix, version), json.dumps(meta, sort_keys=True))
    return meta


class VersionTaken(ValueError):
    """:func:`write_version` refused, before writing anything: the store holds the version under another owner."""


def _claim(client: Any, prefix: str, version: str, owner: str, rows: int) -> None:
    """Make ``owner`` the writer of ``version`` (its marker, set only where none is: ``SET NX``), or raise
    :class:`VersionTaken` when its meta or marker names another owner (or is not one this code writes). Keys carry the
    version, not the owner: two publish roots sharing a prefix that named a version alike (in the same millisecond)
    wrote their rows over each other's, and one root's rankers served the other's rows, every tag matching. The marker
    also holds the table's ``rows``: what :func:`delete_version` deletes by name once the meta is gone."""
    def taken(what: str) -> VersionTaken:
        return VersionTaken(f"version {version} is in the embedding store already, {what}, not {owner!r}: nothing "
                            "was written; the next refresh names another version")
    try:
        meta = read_meta(client, prefix, version)  # a version written before the markers has a meta only
    except ValueError as exc:
        raise taken(f"its meta not one a refresh writes ({exc})") from None
    if meta is not None and meta.get("owner", "") != owner:
        raise taken(f"written by {meta.get('owner', '')}")
    key = writer_key(prefix, version)
    if client.set(key, json.dumps({"owner": owner, "rows": rows}), nx=True):
        return
    try:
        raw = get_value(client, key)  # a key of another type: a ValueError naming it
    except ValueError as exc:
        raise taken(f"its writer marker not one a refresh writes ({exc})") from None
    try:
        held = json.loads(raw or b"null")
    except (ValueError, RecursionError):  # not JSON (UnicodeDecodeError is one), or nested past the parser: as it is
        held = raw[:80]  # type: ignore[index]
    if not isinstance(held, dict) or held.get("owner") != owner:
        raise taken(f"its writer marker {held!r}")


def read_meta(client: Any, prefix: str, version: str) -> dict[str, Any] | None:
    """A version's meta (None: never completely written). Redis errors propagate; one that is not JSON, or a key of
    another Redis type, is a ValueError (:func:`decode_meta`, :func:`get_value`)."""
    key = meta_key(prefix, version)
    return decode_meta(key, get_value(client, key))


def get_value(client: Any, key: str) -> bytes | None:
    """``GET key``; a ValueError naming the key when it holds another Redis type (a hash, a list: WRONGTYPE): Redis
    answered, and the key is not one a refresh writes (not a Redis that is down). Other Redis errors propagate."""
    try:
        return cast("bytes | None", client.get(key))
    except ResponseError as exc:
        if not wrong_type(exc):
            raise
        raise ValueError(f"{key} is a Redis {_type_name(client, key)}, not a value a refresh writes; delete it and "
                         "republish with `streamrec refresh --now`") from None


def _type_name(client: Any, key: str) -> str:
    try:
        kind = client.type(key)
    except Exception:  # noqa: BLE001 - only for the message
        return "key of another type"
    return kind.decode() if isinstance(kind, bytes) else str(kind)


def decode_meta(key: str, raw: bytes | None) -> dict[str, Any] | None:
    """The meta stored at ``key`` from its raw value (None: no such key); a ValueError naming the key for a value that
    is not JSON, not UTF-8, or JSON but no object (``null`` included: the key exists, so the meta is damaged, not
    absent; read as absent, a refresh wrote over it and serving said the version was not stored): not written by a
    refresh."""
    if raw is None:
        return None
    try:
        meta = json.loads(raw)
        if not isinstance(meta, dict):
            raise ValueError(f"JSON {type(meta).__name__}, not an object")
    except (ValueError, RecursionError) as exc:  # (UnicodeDecodeError is one; RecursionError: "[[[[..." too deep)
        raise ValueError(f"{key} is not a meta a refresh writes ({type(exc).__name__}: {exc}; {raw[:80]!r}); "
                         "republish with `streamrec refresh --now`") from None
    return meta


def stored_versions(client: Any, prefix: str, owner: str | None = None) -> set[str]:
    """Versions whose meta is in the store (with ``owner``: only those that owner wrote)."""
    start, end = f"{prefix}:emb:", ":meta"
    out = set()
    for key in client.scan_iter(match=f"{glob_literal(start)}*{end}", count=1000):
        k = key.decode() if isinstance(key, bytes) else key
        version = k[len(start):-len(end)]
        if owner is not None:
            try:
                meta = read_meta(client, prefix, version)
            except ValueError:  # not a JSON object: not a meta this code wrote, so not this owner's
                continue
            if meta is None or meta.get("owner", "") != owner:  # None: deleted since the scan
                continue
        out.add(version)
    return out


def unfinished_versions(client: Any, prefix: str, owner: str) -> set[str]:
    """Versions ``owner`` began to write and never finished: a writer marker naming it and no ``meta`` (a refresh
    killed while writing its rows, or while deleting a version). Only a caller that knows none of them is being
    written may delete them: the refresh, holding its publish root's lock, before it writes its own."""
    start, end = f"{prefix}:emb:", ":writer"
    out = set()
    for key in client.scan_iter(match=f"{glob_literal(start)}*{end}", count=1000):
        k = key.decode() if isinstance(key, bytes) else key
        version = k[len(start):-len(end)]
        try:
            marker = json.loads(get_value(client, k) or b"null")
        except (ValueError, RecursionError):  # not JSON (or "[[[[..." too deep), not a string: not a marker of ours
            continue
        if isinstance(marker, dict) and marker.get("owner") == owner and not client.exists(meta_key(prefix, version)):
            out.add(version)
    return out


def delete_version(client: Any, prefix: str, version: str, batch: int = 10_000) -> int:
    """Delete a version's keys, ``meta`` first (so a half-deleted version is never served), then its rows and its
    delta overlay, and its writer marker last (a delete killed half-way is then an unfinished version, found again);
    returns how many.

    On a single node the rows are found by SCAN. On a Redis Cluster they are deleted by name, every row and overlay key
    of rows ``0 .. rows - 1`` (``rows``: the table's, from the meta or the writer marker), ``UNLINK`` per hash slot:
    a SCAN walks each primary on its own, and a key a resharding moved meanwhile from a node not walked yet to one
    walked already was never seen, and stayed for good (neither meta nor marker left to find it by). Only a version
    whose meta and marker name no ``rows`` (a marker of a write before markers held them, its meta deleted) is found
    by SCAN there too."""
    rows = _stored_rows(client, prefix, version) if hasattr(client, "mget_nonatomic") else None
    n = int(client.delete(meta_key(prefix, version)))
    if rows is not None:
        step = max(batch, _DELETE_CHUNK)  # rows per call: several keys per slot, or UNLINK per slot is one per key
        for start in range(0, rows, step):
            part = np.arange(start, min(rows, start + step), dtype=np.int64)
            n += _unlink_named(client, row_keys(prefix, version, part) + overlay_keys(prefix, version, part))
        return n + int(client.delete(writer_key(prefix, version)))
    keys: list[Any] = []
    for key in client.scan_iter(match=glob_literal(version_prefix(prefix, version)) + "[rd]:*", count=1000):
        keys.append(key)
        if len(keys) >= batch:
            n += _unlink(client, keys)
            keys = []
    if keys:
        n += _unlink(client, keys)
    return n + int(client.delete(writer_key(prefix, version)))


_DELETE_CHUNK = 100_000  # rows deleted by name per call on a cluster: ~12 keys per hash slot per UNLINK


def _stored_rows(client: Any, prefix: str, version: str) -> int | None:
    """The table rows a version's meta (else its writer marker) names; None where neither does."""
    for key in (meta_key(prefix, version), writer_key(prefix, version)):
        try:
            held = json.loads(get_value(client, key) or b"null")
        except (ValueError, RecursionError):  # another type, not JSON: not one this code wrote
            continue
        rows = held.get("rows") if isinstance(held, dict) else None
        if isinstance(rows, int) and not isinstance(rows, bool) and 0 <= rows <= _NAMED_ROWS_MAX:
            return rows
    return None


# The most rows deleted by name (a table of more is found by SCAN): a meta or marker another client wrote with rows
# 10**12 had the delete name keys for days.
_NAMED_ROWS_MAX = 1 << 31


def _unlink_named(client: Any, keys: list[str]) -> int:
    """UNLINK ``keys`` on a cluster: one command per hash slot; a slot a resharding has split between two nodes
    refuses a command on several of its keys (TRYAGAIN, then redis-py's ``ClusterError``), so the keys go again one
    per command, each followed to its node (ASK). UNLINK again of a key gone is a no-op, so the count may fall short
    of the keys deleted by the first try only."""
    try:
        return int(client.unlink(*keys))
    except (ResponseError, ClusterError):
        return _unlink(client, keys)


def _unlink(client: Any, keys: list[Any]) -> int:
    # one key per command in a cluster (keys of many slots); one UNLINK of many on a single node
    if hasattr(client, "mget_nonatomic"):
        pipe = client.pipeline()
        for k in keys:
            pipe.unlink(k)
        return sum(int(x) for x in pipe.execute())
    return int(client.unlink(*keys))


# -- the LRU ------------------------------------------------------------------------------------------------------
class RowCache:
    """A bounded LRU of rows fetched from the store: global row -> (D + 1,) float32. Thread-safe; ``capacity`` 0
    caches nothing.

    The vectors live in one preallocated (capacity, D + 1) array (allocated at the first put), the LRU order in
    an ``OrderedDict`` of row -> slot: memory is capacity x (D + 1) x 4 bytes plus ~100 B of dict entry per row,
    whatever the request sizes (a dict of per-row array views would keep every fetched batch alive)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = int(capacity)
        self._rows: OrderedDict[int, int] = OrderedDict()  # row -> slot in self._data, least recent first
        self._data: np.ndarray | None = None  # (capacity, D + 1) float32
        self._free: list[int] = []
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._rows)

    def __contains__(self, row: int) -> bool:
        return int(row) in self._rows

    def get_many(self, rows: np.ndarray, out: np.ndarray) -> np.ndarray:
        """Fill ``out[i]`` for the cached ``rows[i]`` ((M,) unique); returns the (M,) bool mask of hits."""
        hit = np.zeros(len(rows), dtype=bool)
        if not self.capacity or self._data is None:
            return hit
        idx, slots = [], []
        with self._lock:
            cache = self._rows
            for i, r in enumerate(rows.tolist()):
                s = cache.get(r)
                if s is not None:
                    cache.move_to_end(r)
                    idx.append(i)
                    slots.append(s)
            if idx:
                out[idx] = self._data[slots]  # copied under the lock: a put cannot reuse a slot half-way
        hit[idx] = True
        return hit

    def put_many(self, rows: np.ndarray, vectors: np.ndarray) -> None:
        """Cache ``vectors`` (M, D + 1) of ``rows`` (M,), evicting the least recently used rows beyond capacity."""
        if not self.capacity or not len(rows):
            return
        with self._lock:
            if self._data is None:
                self._data = np.empty((self.capacity, vectors.shape[1]), np.float32)
                self._free = list(range(self.capacity - 1, -1, -1))
            cache, free = self._rows, self._free
            slots = []
            for r in rows.tolist()[-self.capacity:]:  # more rows than capacity: the last ones win
                s = cache.get(r)
                if s is None:
                    s = free.pop() if free else cache.popitem(last=False)[1]
                    cache[r] = s
                else:
                    cache.move_to_end(r)
                slots.append(s)
            self._data[slots] = vectors[-self.capacity:]

    def discard_many(self, rows: np.ndarray) -> None:
        with self._lock:
            for r in rows.tolist():
                s = self._rows.pop(r, None)
                if s is not None:
                    self._free.append(s)


# -- the store of one service, and the rows of one loaded version -----------------------------------------------
class VersionNotStored(ArtifactError, ValueError):
    """Redis answers without a version's ``meta``: its rows are not (all) there. Not the artifact's fault, and it may
    pass (a refresh still writing the rows, a Redis restored or refilled), so serving tries the version again at a
    bounded cadence (``serving/swap.py``) where every other refusal waits for the artifact's files to change."""


class StoreUnavailable(Exception):
    """The store could not be read (internal: turned into fallback rows, never raised to a request)."""


class RedisEmbeddingStore:
    """The Redis side of the layered mode, one per scoring service: the client, the retry-after window and the
    metrics. :meth:`open` gives the rows of one artifact version (:class:`LayeredRows`)."""

    def __init__(self, client: Any, prefix: str, *, cache_rows: int = 200_000, retry_after_s: float = 1.0,
                 write_deltas: bool = False, metrics: Any = None,
                 clock: Callable[[], float] = time.monotonic, cluster: bool | None = None,
                 fetch_chunk: int = _FETCH_CHUNK, timeout_s: float | None = None) -> None:
        self.client, self.prefix = client, prefix
        # a fetch's deadline (embedding_store_timeout_s, on ``clock``): a cluster's slot split mid-move is read again
        # key by key only before it; None: no deadline
        self.timeout_s = timeout_s
        self.fetch_chunk = max(1, int(fetch_chunk))  # keys per MGET (:data:`_FETCH_CHUNK`)
        self.cache_rows, self.retry_after_s, self.write_deltas = int(cache_rows), float(retry_after_s), write_deltas
        self.metrics = metrics  # serving.metrics.ServingMetrics (its embedding_* metrics), or None
        # a Redis Cluster client (its *_nonatomic commands); say so for a LazyClient, which is not made yet
        self.cluster = hasattr(client, "mget_nonatomic") if cluster is None else cluster
        self._clock = clock
        self._down_until = -float("inf")
        self._quiet_until = -float("inf")  # bad rows are logged at most once per retry_after_s
        self.last_error: str | None = None
        self._outage_lock = threading.Lock()
        self._failures = 0  # failed reads since Redis last answered: an outage is logged at its first and its end

    # -- failures: counted, then Redis is skipped for retry_after_s --
    def failed(self, what: str, exc: BaseException, skip_reads: bool = True) -> None:
        """Count a failure; ``skip_reads``: requests skip Redis for ``retry_after_s`` (not for a failed delta write:
        writes may stall while reads answer, and a best-effort write must not cost requests their rows). A failed read
        is logged once per outage, at its first failure (:meth:`answered` says when it ends): every request in flight
        as Redis froze, and the one try of each retry-after window, logged a line each."""
        if skip_reads:
            self._down_until = self._clock() + self.retry_after_s
        self.last_error = f"{what}: {type(exc).__name__}: {exc}"[:300]
        if self.metrics is not None:
            self.metrics.embedding_store_errors.inc()
        if skip_reads:
            with self._outage_lock:
                self._failures += 1
                first = self._failures == 1
            if first:
                log.warning("embedding store %s failed (%s); misses use fallback rows, Redis is tried again every "
                            "%.1fs (said once until it answers; failures counted in streamrec_serving_embedding_"
                            "store_errors_total)", what, self.last_error, self.retry_after_s)
        else:
            log.warning("embedding store %s failed (%s); the delta serves from this process's overrides, Redis "
                        "gets the rows at the next refresh", what, self.last_error)

    def answered(self) -> None:
        """Redis answered a read: an outage :meth:`failed` logged has ended, said once."""
        if not self._failures:  # the common case: no lock
            return
        with self._outage_lock:
            failures, self._failures = self._failures, 0
        if failures:
            log.warning("embedding store: Redis answers again after %d failed reads; rows are read from it again",
                        failures)

    @property
    def available(self) -> bool:
        return self._clock() >= self._down_until

    def open(self, version: str, num_rows: int, dim: int) -> dict[str, Any] | None:
        """The version's meta, checked against the artifact (``num_rows`` rows of ``dim`` values).

        None when Redis cannot be read now (counted; the version loads and serves fallback rows until it can).
        :class:`VersionNotStored` (a ValueError) when Redis answers that the version is not there (not written yet,
        or pruned); ValueError when its meta does not fit, or is not JSON (Redis answered: a damaged meta is not a
        Redis that is down, which would load the version and serve all its non-hot rows from fallback rows)."""
        key = meta_key(self.prefix, version)
        try:
            raw = get_value(self.client, key)  # a key of another type: ValueError, Redis answered
        except ValueError:
            raise
        except Exception as exc:  # noqa: BLE001 - any Redis or socket failure: serve on fallback rows
            self.failed(f"reading {key}", exc)
            return None
        meta = decode_meta(key, raw)  # Redis answered: a damaged meta is a ValueError, not Redis down
        if meta is None:
            raise VersionNotStored(f"the embedding store has no rows of version {version} (no "
                             f"{meta_key(self.prefix, version)}): publish it with [refresh] embedding_store = "
                             "\"layered\" (and the same [redis] url and "
                             "prefix as serving), or serve with [serve] embedding_store = \"in_process\"")
        dtypes = {d.value for d in RowDtype}
        if (meta.get("rows") != num_rows or meta.get("dim") != dim  # (decode_meta: an object)
                or not isinstance(meta.get("dtype"), str) or meta["dtype"] not in dtypes
                or meta.get("row_check") not in (None, ROW_CHECK)):  # None: written before the tags, untagged
            raise ValueError(f"the embedding store's rows of version {version} do not fit the artifact ({num_rows} "
                             f"rows of {dim} values; meta {str(meta)[:200]}); republish with `streamrec refresh --now`")
        self.answered()
        return meta

    def fetch(self, version: str, rows: np.ndarray, dim: int, dtype: RowDtype,
              key: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """((M, dim) float32, bad (M,) bool) of ``rows`` (M,) in ONE round trip; :class:`StoreUnavailable` when the
        round trip fails (or inside the retry-after window, without trying). ``bad`` rows (their key missing, or a
        value that is malformed) are zeros, counted (:meth:`bad_rows`); the others are good whatever they are."""
        if not self.available:
            raise StoreUnavailable(self.last_error or "embedding store unavailable")
        keys = row_keys(self.prefix, version, rows)
        t0 = time.perf_counter()
        deadline = float("inf") if self.timeout_s is None else self._clock() + self.timeout_s
        late = np.zeros(len(keys), dtype=bool)  # (M,) rows a split slot held, not read by the deadline
        # the whole round trip's replies by timeout_s (a whole-reply client bounds each alone: a trickling Redis held
        # pipelined MGETs one timeout each), on the monotonic clock the sockets read by (self._clock may be a test's)
        by = math.inf if self.timeout_s is None else time.monotonic() + self.timeout_s
        try:
            with replies_by(by):
                values = self._mget(keys, deadline, late)
            if len(values) != len(keys):
                raise ValueError(f"{len(values)} answers to an MGET of {len(keys)} keys")
        except Exception as exc:  # noqa: BLE001 - refused, timed out, a broken answer: fallback rows
            self.failed(f"MGET of {len(keys)} rows", exc)
            raise StoreUnavailable(self.last_error or "") from exc
        finally:
            if self.metrics is not None:
                self.metrics.embedding_store_fetch_seconds.observe(time.perf_counter() - t0)
        self.answered()
        out, missing, malformed = decode_answer(values, dim, dtype, rows, key)
        missing &= ~late
        bad = missing | malformed
        if bad.any():
            self.bad_rows(keys, missing, malformed, dim, dtype)
        if late.any():
            self.late_rows(keys, late)
        if self.metrics is not None and (bad.any() or late.any()):  # one round trip, one error, whatever fell back
            self.metrics.embedding_store_errors.inc()
        return out, bad | late

    def late_rows(self, keys: list[str], late: np.ndarray) -> None:
        """Count a fetch that gave up rows at its deadline (a slot split mid-resharding, not read again in time):
        they fall back (counted by the caller in ``..._fallback_rows_total``), uncached; Redis stays in use (the
        split ends with the move). Counted in ``..._errors_total`` by :meth:`fetch`, once per fetch (bad rows in it
        too); logged at most once per ``retry_after_s``."""
        self.last_error = (f"{int(late.sum())} of {len(keys)} rows were in a hash slot a resharding has split between "
                           f"two nodes and were not read within embedding_store_timeout_s ({self.timeout_s} s), e.g. "
                           f"{keys[int(np.flatnonzero(late)[0])]}")[:300]
        now = self._clock()
        if now >= self._quiet_until:
            self._quiet_until = now + self.retry_after_s
            log.warning("embedding store: %s; those rows use fallback rows until the move ends", self.last_error)

    def _mget(self, keys: list[str], deadline: float = float("inf"), late: np.ndarray | None = None) -> list[Any]:
        """The values of ``keys`` in one round trip: one MGET, or pipelined MGETs of at most ``fetch_chunk`` keys
        (:data:`_FETCH_CHUNK`). On a cluster, one MGET per hash slot, pipelined (one round trip per node), redirections
        not followed; a slot a resharding has split between two nodes refuses an MGET of several of its keys (ASK, then
        TRYAGAIN from the importing node), so before ``deadline`` (on the store's clock) those keys go again one GET
        each, pipelined, each followed to its node (ASK); after it they are left None and marked in ``late`` (M,).
        redis-py, left to follow the MGET, tried it 16 times, sleeping 50 ms between the last TRYAGAINs: ~0.1 s for
        a request whose embedding_store_timeout_s is 0.05. Only a failure of the GETs, or any other failure, fails
        the round trip; a GET's WRONGTYPE (a key of another type) is None, as the MGET answers it: it failed the whole
        round trip, and every request's rows fell back for ``retry_after_s``."""
        if self.cluster:
            return self._mget_by_slot(keys, deadline, np.zeros(len(keys), dtype=bool) if late is None else late)
        n = self.fetch_chunk
        if len(keys) <= n:
            return list(self.client.mget(keys))
        pipe = self.client.pipeline(transaction=False)
        for start in range(0, len(keys), n):
            pipe.mget(keys[start:start + n])
        return [v for part in pipe.execute() for v in part]

    def _mget_by_slot(self, keys: list[str], deadline: float, late: np.ndarray) -> list[Any]:
        slots: dict[int, list[int]] = {}  # hash slot -> positions of its keys
        for i, k in enumerate(keys):
            slots.setdefault(key_slot(k.encode()), []).append(i)
        pipe, out, split = self.client.pipeline(), [None] * len(keys), []
        node_of = self.client.nodes_manager.get_node_from_slot
        # sent to the slot's node, as mget_nonatomic: not split by slot again (~1 ms); a redirection is answered, not
        # followed (:meth:`_mget`)
        stack = [PipelineCommand(("MGET", *[keys[i] for i in idx]), {"target_nodes": [node_of(slot)]}, n)
                 for n, (slot, idx) in enumerate(slots.items())]
        answers = pipe.send_cluster_commands(stack, raise_on_error=False, allow_redirections=False)
        for idx, got in zip(slots.values(), answers, strict=True):
            if isinstance(got, (AskError, ClusterError, TryAgainError)):  # the slot is split mid-move (or moved)
                split += idx
            elif isinstance(got, Exception):
                raise got
            else:  # (a short answer: ValueError)
                for i, v in zip(idx, got, strict=True):
                    out[i] = v
        if split and self._clock() >= deadline:  # no time left to read them again: they fall back
            late[split] = True
            split = []
        for i in split:
            pipe.get(keys[i])
        for i, v in zip(split, pipe.execute(raise_on_error=False) if split else [], strict=True):
            if wrong_type(v):
                v = None  # a key of another type: nil, as the MGET answers it (its row alone falls back)
            elif isinstance(v, Exception):
                raise v
            out[i] = v
        return out

    def bad_rows(self, keys: list[str], missing: np.ndarray, malformed: np.ndarray, dim: int,
                 dtype: RowDtype) -> None:
        """Count a round trip that answered but not with every row: its bad rows fall back, each alone; Redis stays
        in use (no retry-after window: one deleted or damaged key must not cost every request its rows). Counted in
        ``..._errors_total`` once per round trip, by :meth:`fetch` (the ``embedding_store_errors`` alert fires, as for
        a Redis that is down), and row by row in ``..._bad_rows_total{reason}``; logged at most once per
        ``retry_after_s``."""
        n_missing, n_malformed = int(missing.sum()), int(malformed.sum())
        example = keys[int(np.flatnonzero(missing | malformed)[0])]
        self.last_error = (f"of {len(keys)} rows, {n_missing} are missing (deleted or evicted keys: maxmemory?) and "
                           f"{n_malformed} malformed (not {dim} {dtype} values: of another length, non-finite or "
                           f"beyond |x| <= {MAX_ROW_ABS:g}; not written by a refresh), e.g. {example}")[:300]
        if self.metrics is not None:
            self.metrics.embedding_store_bad_rows.labels("missing").inc(n_missing)
            self.metrics.embedding_store_bad_rows.labels("malformed").inc(n_malformed)
        now = self._clock()
        if now >= self._quiet_until:
            self._quiet_until = now + self.retry_after_s
            log.warning("embedding store: %s; those rows use fallback rows, the others are served from Redis (said "
                        "at most every %.1fs, counted in streamrec_serving_embedding_store_bad_rows_total)",
                        self.last_error, self.retry_after_s)

    def write_overlay(self, version: str, rows: np.ndarray, vectors: np.ndarray, dtype: RowDtype,
                      key: int | None = None) -> bool:
        """Best effort: write a delta's rows to ``version``'s delta overlay (never its row keys: module docstring);
        False (counted) when Redis fails."""
        if not len(rows) or not self.write_deltas:
            return True
        try:
            mset = self.client.mset_nonatomic if self.cluster else self.client.mset
            mset(dict(zip(overlay_keys(self.prefix, version, rows), encode_rows(vectors, dtype, rows, key),
                          strict=True)))
        except Exception as exc:  # noqa: BLE001 - the override serves the delta; Redis catches up at the next refresh
            self.failed(f"writing {len(rows)} delta rows", exc, skip_reads=False)
            return False
        return True


class LayeredRows:
    """The non-hot rows of one loaded version: local bucket rows, an LRU, then the store (module docstring).

    ``table`` is the artifact's (N, D + 1) cold file (memory-mapped): only the bucket areas of dynamic fields
    (``buckets``: (first row, bucket rows, own rows) per field with an id map) are copied from it, once.
    """

    def __init__(self, store: RedisEmbeddingStore, version: str, table: np.ndarray,
                 buckets: list[tuple[int, int, int, str]], id_maps: dict[str, Any] | None) -> None:
        self.store, self.version = store, version
        self.num_rows, self.dim = int(table.shape[0]), int(table.shape[1])
        meta = store.open(version, self.num_rows, self.dim)
        self.dtype = RowDtype.of(meta["dtype"] if meta else RowDtype.FLOAT32, "embedding store dtype")
        self.key = self._key_of(meta)  # the values' tag key (None: untagged values, written before the tags)
        self._checked = meta is not None  # meta not read yet (Redis down at load): read it before the first fetch
        self.cache = RowCache(min(store.cache_rows, self.num_rows))  # never more rows than the table has
        # Dynamic fields: (first, bucket rows, own rows, field name); their bucket areas are local.
        self._blocks = sorted(buckets)
        self._local_first = np.array([b[0] for b in self._blocks], dtype=np.int64)
        self._local_end = np.array([b[0] + b[1] for b in self._blocks], dtype=np.int64)
        self._own_end = np.array([b[0] + b[1] + b[2] for b in self._blocks], dtype=np.int64)
        sizes = [b[1] for b in self._blocks]
        self._local_start = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)  # into self._local
        self._local = (np.concatenate([np.asarray(table[f:f + n], dtype=np.float32) for f, n, _, _ in self._blocks])
                       if self._blocks else np.zeros((0, self.dim), np.float32))  # (sum of bucket rows, D + 1)
        self._row_keys: list[np.ndarray] = []
        self.set_id_maps(id_maps)

    def set_id_maps(self, id_maps: dict[str, Any] | None) -> None:
        """Own row -> hashed id of every dynamic field (the id maps' ``row_key``), for the bucket fallback: the
        artifact's (a delta's travel in the model's snapshot with the maps they come from, :meth:`fallback_rows`)."""
        self.use_row_keys(self.row_keys_of(id_maps))

    def row_keys_of(self, id_maps: dict[str, Any] | None) -> list[np.ndarray]:
        """What :meth:`set_id_maps` would use, checked: ValueError unless each dynamic field's ``row_key`` is a 1-D
        integer array of one key per own row. (The id map's own load broadcasts a ``row_key`` of one key over every
        row; indexed here as it came, a malformed delta's made every fallback of an admitted id past it an
        IndexError: a 500 for each request of such an id while Redis was down.)"""
        keys = []
        for _, _, own, name in self._blocks:
            state = (id_maps or {}).get(name)
            try:
                rk: Any = state["row_key"] if state is not None else np.full(own, -1)
                arr = np.asarray(rk.numpy() if hasattr(rk, "numpy") else rk)
            except Exception as exc:  # noqa: BLE001 - any malformed state is a misfit
                raise ValueError(f"id maps: {name}'s row_key cannot be read ({type(exc).__name__}: {exc})") from exc
            if arr.shape != (own,) or arr.dtype.kind not in "iu":
                raise ValueError(f"id maps: {name}'s row_key is {arr.dtype} of shape {arr.shape}, expected one integer "
                                 f"key per own row ({own},)")
            keys.append(arr.astype(np.int64, copy=False))
        return keys

    def use_row_keys(self, keys: list[np.ndarray]) -> None:
        """Use :meth:`row_keys_of`'s keys."""
        self._row_keys = keys  # one assignment: readers see the old or the new list

    def _block_of(self, rows: np.ndarray) -> np.ndarray:
        """Index of the dynamic block holding each row, -1 for rows outside every dynamic block."""
        if not self._blocks:
            return np.full(len(rows), -1, dtype=np.int64)
        b = np.searchsorted(self._local_first, rows, side="right") - 1
        inside = (b >= 0) & (rows < self._own_end[np.maximum(b, 0)])
        return np.where(inside, b, -1)

    def _local_rows(self, rows: np.ndarray, block: np.ndarray) -> np.ndarray:
        """Index into ``self._local`` of each row in a dynamic bucket area, -1 for the others."""
        if not self._blocks:  # a static config: nothing is local
            return np.full(len(rows), -1, dtype=np.int64)
        bs = np.maximum(block, 0)
        local = (block >= 0) & (rows < self._local_end[bs])
        return np.where(local, self._local_start[bs] + rows - self._local_first[bs], -1)

    def fallback_rows(self, rows: np.ndarray, keys: list[np.ndarray] | None = None) -> np.ndarray:
        """The row to serve instead of each of ``rows`` (M,) when the store cannot give it: an admitted id's own
        row -> its bucket row; -1 for every other row (zeros). ``keys``: the :meth:`row_keys_of` of the id maps the
        rows were mapped with (a request's snapshot, ``serving.model._Live``; not the newest delta's, whose maps may
        have given an evicted id's row to another), the artifact's by default."""
        block = self._block_of(rows)
        out = np.full(len(rows), -1, dtype=np.int64)
        keys_of = self._row_keys if keys is None else keys
        for b in np.unique(block[block >= 0]).tolist():
            first, nb, _, _ = self._blocks[b]
            sel = np.flatnonzero(block == b)
            local = rows[sel] - first - nb  # own row index (< 0: a bucket row itself)
            own = local >= 0
            key = np.full(len(sel), -1, dtype=np.int64)
            key[own] = keys_of[b][local[own]]
            out[sel[own & (key >= 0)]] = first + key[own & (key >= 0)] % nb
            out[sel[~own]] = rows[sel[~own]]
        return out

    def local(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(mask (M,), vectors (M, D + 1)): the rows held locally (dynamic fields' bucket rows)."""
        idx = self._local_rows(rows, self._block_of(rows))
        have = idx >= 0
        vec = np.zeros((len(rows), self.dim), np.float32)
        vec[have] = self._local[idx[have]]
        return have, vec

    def gather(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(vectors (M, D + 1) float32, failed (M,) bool) for unique non-hot, non-overridden ``rows`` (M,):
        local bucket rows, then the LRU, then ONE round trip for the rest. ``failed`` rows (the store was not
        available) are zeros here: the caller substitutes :meth:`fallback_rows`."""
        m = self.store.metrics
        have, out = self.local(rows)
        rest = np.flatnonzero(~have)
        failed = np.zeros(len(rows), dtype=bool)
        if not len(rest):
            return out, failed
        sub = rows[rest]
        got = np.zeros((len(sub), self.dim), np.float32)
        hit = self.cache.get_many(sub, got)
        miss = np.flatnonzero(~hit)
        if m is not None:
            m.embedding_cache_rows.labels("hit").inc(int(hit.sum()))
            m.embedding_cache_rows.labels("miss").inc(len(miss))
        if len(miss):
            try:
                self._check()
                fetched, bad = self.store.fetch(self.version, sub[miss], self.dim, self.dtype, self.key)
            except StoreUnavailable:
                failed[rest[miss]] = True
            except ValueError as exc:  # Redis is back but never had this version: fallback, counted, never a 5xx
                self.store.failed("checking the version's rows", exc)
                failed[rest[miss]] = True
            else:
                got[miss] = fetched
                failed[rest[miss[bad]]] = True  # a bad key: its row alone falls back, and is not cached
                self.cache.put_many(sub[miss[~bad]], fetched[~bad])
        out[rest] = got
        out[failed] = 0.0
        return out, failed

    def _check(self) -> None:
        if self._checked:
            return
        if not self.store.available:  # inside the retry-after window: not asked, as fetch (one failure per window)
            raise StoreUnavailable(self.store.last_error or "embedding store unavailable")
        meta = self.store.open(self.version, self.num_rows, self.dim)  # ValueError: the version is not there
        if meta is None:
            raise StoreUnavailable(self.store.last_error or "")
        self.dtype = RowDtype.of(meta["dtype"], "embedding store dtype")
        self.key = self._key_of(meta)
        self._checked = True

    def _key_of(self, meta: dict[str, Any] | None) -> int | None:
        return tag_key(self.version, self.dtype) if meta and meta.get("row_check") == ROW_CHECK else None

    def on_delta(self, rows: np.ndarray, vectors: np.ndarray, hot: np.ndarray) -> None:
        """A delta changed ``rows`` (R,) to ``vectors`` (R, D + 1): drop them from the LRU and, with
        ``write_deltas``, write the non-hot ones (``hot`` (R,) bool) that are not local to the version's delta
        overlay in Redis (never over its rows)."""
        self.cache.discard_many(rows)
        block = self._block_of(rows)
        remote = ~hot & (self._local_rows(rows, block) < 0)
        if not remote.any() or not self.store.available or not self.store.write_deltas:
            return
        try:
            self._check()  # the version's dtype comes from its meta: never write rows in a guessed one
        except StoreUnavailable:
            return  # counted by open(); the override serves the delta, the next refresh rewrites the row
        except ValueError as exc:  # Redis answers, without this version (or with one that does not fit)
            self.store.failed("checking the version's rows before writing a delta", exc)
            return
        self.store.write_overlay(self.version, rows[remote], vectors[remote], self.dtype, self.key)
