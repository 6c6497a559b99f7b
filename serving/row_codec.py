"""The layered store's keys and values in Redis: the keys of a version's meta, writer marker, rows and delta
overlay, and each row's bytes, ending in a tag that names its row, version and dtype.

**Integrity: a tag per value** (``meta["row_check"] = "wsum32"``, :func:`row_tags`): the last 4 bytes of every value
are a weighted sum of its bytes, its row and its version and dtype (:func:`tag_key`), mod 2^32. A value of the right
length that is not this version's row (another version's or dtype's, another row's, garbage, a flipped bit) is
malformed: its row falls back alone, like a missing key. Cost (bench/layered.py, 1 M rows): +4 B per key (Redis
170 -> 186 MB for 0.9 M float32 rows), ~13 us per 100 rows fetched (decoding), within the machine's noise on the
request's p50/p99. A version whose meta has no ``row_check`` (written before the tags) is read untagged; serving
before this change reads a tagged version's values as of the wrong length: **upgrade serving before the refresh**.

What is written under these keys, and when (the key layout, a version's writer marker,
:func:`~serving.stored_versions.write_version`, :func:`~serving.stored_versions.unfinished_versions`,
:func:`~serving.stored_versions.delete_version`): ``serving/stored_versions.py``. What serving reads from them (the
delta overlay, a bad row falling back alone): ``serving/embedding_store.py``.
"""

from __future__ import annotations

import functools
import re
import zlib
from typing import cast

import numpy as np

from serving.settings import RowDtype

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
    """A version's writer marker, set before its first row and deleted with it last
    (:func:`~serving.stored_versions.unfinished_versions`)."""
    return version_prefix(prefix, version) + "writer"


def row_keys(prefix: str, version: str, rows: np.ndarray) -> list[str]:
    """The keys of global rows ``rows`` (M,) of a version."""
    start = version_prefix(prefix, version) + "r:"
    return [start + str(r) for r in rows.tolist()]


def overlay_keys(prefix: str, version: str, rows: np.ndarray) -> list[str]:
    """The keys of global rows ``rows`` (M,) in a version's delta overlay (``serving/embedding_store.py``'s
    docstring: never its row keys, which hold the artifact's rows only)."""
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
    row only (``serving/embedding_store.py``'s docstring)."""
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
