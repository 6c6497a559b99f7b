"""learner/daemon.py's RecentIds: the duplicate filter's keys cannot collide between samples."""

from __future__ import annotations

import io

import numpy as np
import torch

from learner.daemon import RecentIds
from stream.samples import DELAYED_POSITIVE, OBSERVED


def _seen(r: RecentIds, ids: list[str], kinds: list[int]) -> list[bool]:
    return r.filter(np.array(ids, object), np.array(kinds, np.int8)).tolist()


def test_an_impression_named_like_another_ones_delayed_key_does_not_drop_its_click() -> None:
    """The delayed positive's key was ``id + "\\x00delayed"``: an impression of that name made the real click of
    impression X a 'duplicate', dropped."""
    r = RecentIds(100)
    assert _seen(r, ["X", "X\x00delayed"], [OBSERVED, OBSERVED]) == [True, True]
    assert _seen(r, ["X", "X\x00delayed"], [DELAYED_POSITIVE, DELAYED_POSITIVE]) == [True, True]
    assert _seen(r, ["X", "X\x00delayed", "X"], [DELAYED_POSITIVE, OBSERVED, OBSERVED]) == [False, False, False]


def test_the_keys_survive_a_checkpoint_without_colliding() -> None:
    r = RecentIds(100)
    _seen(r, ["X\x00delayed", "Y"], [OBSERVED, DELAYED_POSITIVE])
    buf = io.BytesIO()
    torch.save({"recent_ids": r.state()}, buf)
    buf.seek(0)
    back = RecentIds(100)
    back.load(torch.load(buf, weights_only=True)["recent_ids"])  # what learner/checkpoint_read.py's load does
    assert _seen(back, ["X", "Y", "Y", "X\x00delayed"], [DELAYED_POSITIVE, OBSERVED, DELAYED_POSITIVE, OBSERVED]) \
        == [True, True, False, False]


def test_merged_states_keep_the_newest_share_of_every_rank_not_only_the_last_ranks() -> None:
    """A sharded job restarted on another number of ranks loads every old rank's recent ids: each keeps its newest
    equal share of the window, where cutting the concatenation to the window kept the last rank's alone."""
    r = RecentIds(4)
    r.load_merged([["a1", "a2", "a3", "a4"], ["b1", "b2", "b3", "b4"]])
    assert r.state() == ["a3", "a4", "b3", "b4"]
    assert _seen(r, ["a4", "b4", "a1"], [0, 0, 0]) == [False, False, True]  # the newest of each rank still caught
    empty = RecentIds(4)
    empty.load_merged([])
    assert empty.state() == []
