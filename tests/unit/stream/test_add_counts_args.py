"""``stream.counts.DailyCounts.add_counts`` refuses counts and members it would write wrong, before any Redis call: a
count below 1 or not whole (a ZINCRBY of -3 or NaN subtracts or poisons a member), a member that is no stable hash."""

from __future__ import annotations

import numpy as np
import pytest

from stream.counts import DailyCounts


class NoRedis:
    """A client that fails the test if the write reaches Redis."""

    def __getattr__(self, name: str) -> None:
        raise AssertionError(f"Redis was called ({name}) for arguments that should have been refused")


@pytest.mark.parametrize(("members", "counts", "bad"), [
    (np.array([1, 2]), np.array([1, 0]), "counts"),
    (np.array([1, 2]), np.array([1, -3]), "counts"),
    (np.array([1, 2]), np.array([1.0, np.nan]), "counts"),
    (np.array([1, 2]), np.array([1.5, 2.0]), "counts"),
    (np.array([1, -2]), np.array([1, 1]), "members"),
    (np.array(["a", "b"]), np.array([1, 1]), "members"),
    (np.array([1.0, 2.0]), np.array([1, 1]), "members"),
])
def test_add_counts_refuses_counts_below_one_or_not_whole_and_members_that_are_not_hashes(
        members: np.ndarray, counts: np.ndarray, bad: str) -> None:
    with pytest.raises(ValueError, match=f"argument '{bad}'"):
        DailyCounts(NoRedis()).add_counts("item", "lookup", members, counts, 20_000)  # type: ignore[arg-type]


def test_add_counts_refuses_a_chunk_below_one() -> None:
    with pytest.raises(ValueError, match="chunk"):
        DailyCounts(NoRedis()).add_counts("item", "lookup", np.array([1]), np.array([1]), 20_000,  # type: ignore
                                          chunk=0)
