"""Stable id hashing, defined once for the joiner, the learner and serving.

Raw ids (user, item, categorical context values) may be any non-negative 64-bit integer or a string.
They are canonicalised to their decimal/string text and hashed with BLAKE2b-64, masked to 63 bits,
so ``123`` and ``"123"`` are the same id (a CSV log and a JSON feed agree), the result is a
non-negative ``int64``, and it never depends on Python's per-process ``hash()`` seed. A float zero is one
value whatever its sign: ``-0.0 == 0.0``, so every cache keyed by value (``stream.features.hash_value``'s) may
answer either with the other's hash, and both must be the same number in the joiner and in serving.
"""

from __future__ import annotations

from collections.abc import Iterable
from hashlib import blake2b

import numpy as np

_MASK = (1 << 63) - 1
_ZERO = str(0.0)  # the text of both float zeros


def stable_hash(value: int | str | bool | float) -> int:
    """Hash one raw id to a non-negative int64."""
    text = value if isinstance(value, str) else _ZERO if isinstance(value, float) and value == 0 else str(value)
    return int.from_bytes(blake2b(text.encode(), digest_size=8).digest(), "little") & _MASK


def stable_hash_many(values: Iterable[int | str]) -> np.ndarray:
    """Hash many raw ids; returns an ``int64`` array of shape ``(N,)``."""
    return np.fromiter((stable_hash(v) for v in values), dtype=np.int64)
