"""stream/joiner/sample_rows.py ``state_batch``: the state chunks' rows built from the pendings themselves (no
``Sample`` per row) are exactly :func:`to_batch` of them as label-0 ``FINAL`` samples without histories, for rows
with the same columns (the one-pass path) and rows whose columns differ (the union path)."""

from __future__ import annotations

import random

import pytest

from stream.joiner.engine import Pending, Sample
from stream.joiner.sample_rows import state_batch, to_batch


def _pendings(rng: random.Random, n: int, uniform: bool) -> list[Pending]:
    out = []
    for i in range(n):
        tags = [rng.randrange(9)] * rng.randrange(3)
        context: dict[str, int | list[int]] = {"device": rng.randrange(5), "tags": tags}
        dense = {"price": rng.random()}
        if not uniform and rng.random() < 0.3:
            context = {"age": rng.randrange(99)}  # other keys: the union path
            dense = {}
        p = Pending(f"imp-{i}", 1_700_000_000_000 + rng.randrange(10**6), rng.randrange(2**62), rng.randrange(2**62),
                    context, dense, rng.randrange(9))
        p.history = [rng.randrange(99) for _ in range(rng.randrange(4))]  # left out of the state either way
        out.append(p)
    return out


@pytest.mark.parametrize("uniform", [True, False])
@pytest.mark.parametrize("seed", range(5))
def test_state_batch_is_to_batch_of_label_0_samples_without_histories(seed: int, uniform: bool) -> None:
    ps = _pendings(random.Random(seed), 1 + seed * 37, uniform)
    got, want = state_batch(ps), to_batch([Sample(p, 0, 0) for p in ps], history=False)
    assert got.batch.equals(want.batch)
    assert got.batch.schema.equals(want.batch.schema, check_metadata=True)
    assert got.encode() == want.encode()
