"""Raw event fields -> the hashed feature values every stage uses (joiner, learner, serving).

Categorical values (ids, context strings and numbers) become ``stable_hash`` int64s; list-valued
context fields become lists of them; dense values stay floats. Defined once, here: a second copy in
serving would be the start of training/serving skew.
"""

from __future__ import annotations

from functools import lru_cache

from stream.events import ContextValue
from stream.ids import stable_hash

MISSING = 0  # the hashed value of an absent categorical feature (stable_hash never yields 0 in practice)

# Feature values repeat a lot (gender, genres, devices); typed=True keeps True and 1 apart.
hash_value = lru_cache(maxsize=1 << 20, typed=True)(stable_hash)


def hash_context(context: dict[str, ContextValue]) -> dict[str, int | list[int]]:
    return {k: [hash_value(x) for x in v] if isinstance(v, list) else hash_value(v) for k, v in context.items()}
