"""A version of the layered store's rows in Redis, as the refresh handles it: written (``meta`` last) by the owner
that claimed it, its meta read, the versions stored (or begun and never finished) listed, and deleted. The keys and
the rows' bytes: ``serving/row_codec.py``; serving them: ``serving/embedding_store.py``.

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
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, cast

import numpy as np
from redis.exceptions import ClusterError, ResponseError

from serving.row_codec import (
    ROW_CHECK,
    encode_rows,
    glob_literal,
    meta_key,
    overlay_keys,
    row_keys,
    tag_key,
    version_prefix,
    writer_key,
)
from serving.settings import RowDtype
from stream.redis_client import wrong_type

_WRITE_CHUNK = 20_000  # rows per MSET while a version is written (~1.4 MB of float32 rows at D = 16)


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


def version_names(client: Any, prefix: str, owner: str | None = None) -> set[str]:
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
