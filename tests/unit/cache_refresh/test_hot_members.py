"""The hot set's members come from Redis sorted sets any client with write access can add to: a member that is not a
stable hash's text (``stream/ids.py``: ASCII digits, below 2**63) is left out of the hot set and counted, never a
failed nightly refresh. ``"99999999999999999999"`` (an int64 overflow) and ``"²"`` (``isdigit`` but not ``int``) failed
stage hot_set every night while they were among the top ids; the refresh published nothing."""

from __future__ import annotations

import numpy as np

from cache_refresh.hot_set import hot_rows, member_hashes
from learner.features import default_config

HOSTILE = ["99999999999999999999", "9223372036854775808", "\u00b2", "\u0661\u0662", "-3", "+4", " 5", "u1", "", "1e3"]


def test_members_that_are_no_stable_hash_are_counted_and_left_out() -> None:
    hashed, skipped = member_hashes(["5", *HOSTILE, "9223372036854775807", "0"])
    assert hashed.tolist() == [5, 9223372036854775807, 0]
    assert skipped == len(HOSTILE)


def test_hostile_members_among_the_top_ids_leave_the_hot_rows_of_the_others() -> None:
    cfg = default_config({}, buckets=1000)
    assert np.array_equal(hot_rows(cfg, "item", ["5", *HOSTILE, "7"]), hot_rows(cfg, "item", ["5", "7"]))
