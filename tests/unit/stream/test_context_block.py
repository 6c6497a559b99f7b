"""stream/joiner/context_block.py: a batch's contexts hashed as columns read back, row by row, as the per-impression
``hash_context`` dicts, and rows gathered from many blocks are the rows themselves, in order."""

from __future__ import annotations

import random

import numpy as np
import pytest

from stream.features import hash_context
from stream.joiner.context_block import ContextRow, hashed_rows, take_rows


def _contexts(rng: random.Random, n: int, uniform: bool) -> list[dict]:
    out = []
    for _ in range(n):
        c: dict = {"device": rng.choice(["ios", "android", "", "télé"]), "hour": rng.randrange(24),
                   "tags": [rng.choice(["a", 3, "Ω"]) for _ in range(rng.randrange(4))]}
        if not uniform:
            r = rng.random()
            if r < 0.2:
                c = {"age": rng.choice([1, 2.5, True])}
            elif r < 0.3:
                c["tags"] = "solo"  # a list in other rows only
            elif r < 0.4:
                c = {"hour": c["hour"], "device": c["device"]}  # the same keys in another order
            elif r < 0.45:
                c = {}
        out.append(c)
    return out


def _rows_of(columns: dict, n: int) -> list[dict]:
    """Per-row dicts of gathered columns."""
    out: list[dict] = [{} for _ in range(n)]
    for k, col in columns.items():
        for i in range(n):
            out[i][k] = col[0][col[1][i]:col[1][i + 1]].tolist() if isinstance(col, tuple) else int(col[i])
    return out


@pytest.mark.parametrize("uniform", [True, False])
@pytest.mark.parametrize("seed", range(6))
def test_hashed_rows_read_as_hash_context(seed: int, uniform: bool) -> None:
    contexts = _contexts(random.Random(seed), 1 + 41 * seed, uniform)
    rows = hashed_rows(contexts, hash_context)
    assert all(isinstance(r, ContextRow) for r in rows)
    assert [dict(r) for r in rows] == [hash_context(c) for c in contexts]
    assert rows == [hash_context(c) for c in contexts]  # a row equals its dict (Mapping equality)
    assert [list(r) for r in rows] == [list(c) for c in contexts]  # keys in the event's order
    if uniform:
        assert len({id(r.block) for r in rows}) == 1


@pytest.mark.parametrize("seed", range(6))
def test_rows_of_many_blocks_gather_in_order(seed: int) -> None:
    rng = random.Random(seed)
    rows = [r for _ in range(5) for r in hashed_rows(_contexts(rng, rng.randrange(1, 30), uniform=True), hash_context)]
    pick = [rng.randrange(len(rows)) for _ in range(rng.randrange(1, 80))]
    chosen = [rows[i] for i in pick]
    got = take_rows(chosen)
    assert got is not None
    assert _rows_of(got, len(chosen)) == [dict(r) for r in chosen]
    assert got["hour"].dtype == np.int64 and got["tags"][1].dtype == np.int32


def test_rows_that_cannot_gather_as_columns() -> None:
    rows = hashed_rows([{"a": 1}, {"a": [1]}], hash_context)  # blocks of different signatures
    assert take_rows(rows) is None
    assert take_rows([{"a": 1}]) is None and take_rows([]) is None  # plain dicts; nothing


def test_columns_hashed_as_arrays_give_hash_contexts_numbers_for_every_value_type() -> None:
    # each column goes through hash_column with the scan's types; None (which hash_column takes for an absent
    # feature, MISSING) and mixed or float columns must still read as hash_context's numbers
    contexts = [{"s": "x", "i": 7, "b": True, "f": -0.0, "m": 1, "n": None, "l": ["a", 1, True]},
                {"s": "", "i": 2**62, "b": False, "f": 2.5, "m": "1", "n": "None", "l": []},
                {"s": "日本", "i": -3, "b": True, "f": 0.0, "m": 1.0, "n": None, "l": [None, 0.0]}]
    assert [dict(r) for r in hashed_rows(contexts, hash_context)] == [hash_context(c) for c in contexts]
