"""The join engine at the edges of event time: an event at exactly an input's time, or exactly its allowed lateness
behind it, is in order, so its label must not depend on which batch it is read in."""

from __future__ import annotations

import pytest

from stream.events import Click
from stream.joiner.engine import JoinConfig, PartitionJoin
from stream.samples import OBSERVED
from tests.unit.stream.test_join_engine import Feed, imp

W = 1000


def _cfg(lateness_ms: int, **kw: object) -> JoinConfig:
    return JoinConfig(window_ms=W, lateness_ms=lateness_ms, late_retention_ms=5000, watermark_quorum=1, **kw)  # type: ignore[arg-type]


def _labels(samples: list) -> list[tuple[str, int, int]]:
    return [(s.pending.impression_id, s.label, s.kind) for s in samples]


@pytest.mark.parametrize("lateness_ms", [0, 5])
def test_a_click_read_a_batch_before_its_impression_at_the_same_time_joins_when_both_are_within_the_lateness(
        lateness_ms: int) -> None:
    """Both inputs stand at 100 + lateness; a click at 100 and its impression at 100 are each exactly the lateness
    behind their input's time (with no lateness: at it, ties). The click came a batch first and was given up as an
    orphan at watermark 100, and the impression then closed as a negative."""
    j, f = PartitionJoin(0, _cfg(lateness_ms)), Feed()
    r1 = j.apply(f.imps(imp("b", 100 + lateness_ms)), f.clicks(Click("a", 100), Click("b", 100 + lateness_ms)))
    r2 = j.apply(f.imps(imp("a", 100)), [])
    r3 = j.apply([], [], drain=True)
    assert not r1.unjoined + r2.unjoined + r3.unjoined
    assert sorted(_labels(r1.samples + r2.samples + r3.samples)) == [("a", 1, 0), ("b", 1, 0)]


@pytest.mark.parametrize("lateness_ms", [0, 5])
@pytest.mark.parametrize("one_batch", [True, False])
def test_a_click_at_exactly_the_window_end_joins_whichever_batch_it_is_read_in(lateness_ms: int,
                                                                               one_batch: bool) -> None:
    """A click at ts + window is inside the window (``0 <= delay <= window``). Read in the batch that moved both inputs
    to ts + window + lateness it joined; read a batch later, in order all the same, it was ``late``."""
    j, f = PartitionJoin(0, _cfg(lateness_ms)), Feed()
    now = 100 + W + lateness_ms
    first = [Click("b", now)] + ([Click("a", 100 + W)] if one_batch else [])
    r1 = j.apply(f.imps(imp("a", 100), imp("b", now)), f.clicks(*first))
    r2 = j.apply([], [] if one_batch else f.clicks(Click("a", 100 + W)))
    assert not r1.unjoined + r2.unjoined
    assert sorted(_labels(r1.samples + r2.samples)) == [("a", 1, 0), ("b", 1, 0)]


@pytest.mark.parametrize("one_batch", [True, False])
def test_an_es_dfm_click_at_exactly_the_elapsed_time_is_an_observed_positive_whichever_batch_it_is_read_in(
        one_batch: bool) -> None:
    """es_dfm: a click by ``ts + elapsed`` makes an OBSERVED 1. Read a batch after the one that moved event time to
    exactly ts + elapsed, the impression had gone out as an OBSERVED 0 and the click became a delayed positive."""
    j, f = PartitionJoin(0, _cfg(0, policy="es_dfm", elapsed_ms=300)), Feed()
    first = [Click("b", 400)] + ([Click("a", 400)] if one_batch else [])
    r1 = j.apply(f.imps(imp("a", 100), imp("b", 400)), f.clicks(*first))
    r2 = j.apply([], [] if one_batch else f.clicks(Click("a", 400)))
    assert [s for s in _labels(r1.samples + r2.samples) if s[0] == "a"] == [("a", 1, OBSERVED)]


def test_a_far_past_impression_closes_in_its_batch_a_negative_unless_its_click_shares_the_batch() -> None:
    """README, "Far-future and far-past events": a producer writing seconds where milliseconds are expected (1.7e9)
    is applied, not dead-lettered; its impression closes at the end of the batch it comes in."""
    base = 1_700_000_000_000
    feeds = []
    for together in (True, False):
        j, f = PartitionJoin(0, JoinConfig()), Feed()  # the defaults: quorum 16, 30 min window
        j.apply(f.imps(*(imp(f"i{k}", base + k) for k in range(16))), f.clicks(*(Click(f"i{k}", base + k)
                                                                                for k in range(16))))
        first = j.apply(f.imps(imp("s", 1_700_000_000)), f.clicks(Click("s", 1_700_000_005)) if together else [])
        second = j.apply([], [] if together else f.clicks(Click("s", 1_700_000_005)))
        feeds.append((_labels(first.samples + second.samples), [u.reason for u in first.unjoined + second.unjoined]))
    assert feeds == [([("s", 1, 0)], []), ([("s", 0, 0)], ["orphan"])]


@pytest.mark.parametrize("one_batch", [True, False])
def test_a_drains_watermark_is_the_same_whichever_batch_a_click_before_its_impression_is_read_in(
        one_batch: bool) -> None:
    """The drain moves event time past what is still held: pending impressions and clicks still waiting. A click read a
    batch before its impression stayed in the waiting clicks' heap after the impression took it, so the drain took
    its time for held too: watermark 1500 where the same input in one batch drained at 1100 (the two join drivers cut
    the same input differently: their samples' closing watermarks differed by up to 40 s on one partition)."""
    j, f = PartitionJoin(0, _cfg(0)), Feed()
    if one_batch:
        r = [j.apply(f.imps(imp("b", 100), imp("a", 100)), f.clicks(Click("a", 500)))]
    else:
        r = [j.apply(f.imps(imp("b", 100)), f.clicks(Click("a", 500))), j.apply(f.imps(imp("a", 100)), [])]
    r.append(j.apply([], [], drain=True))
    assert sorted(_labels([s for x in r for s in x.samples])) == [("a", 1, 0), ("b", 0, 0)]
    assert j.watermark == 100 + W


@pytest.mark.parametrize("lateness_ms", [0, 5])
@pytest.mark.parametrize("restart", [False, True])
def test_a_second_drain_with_nothing_held_leaves_event_time_where_the_first_put_it(lateness_ms: int,
                                                                                  restart: bool) -> None:
    """A drain moves event time past what is still held. A second drain (a re-run of ``streamrec join`` with
    ``exit_when_idle`` on a drained partition, restored from its chunks) held nothing and still moved it a window
    further, from the first drain's time: each re-run stacked a window (and lateness) onto the partition's time, and
    the samples' watermark header could then pass the learner's bound (``future_ts_s`` + the window)."""
    from stream.joiner.state_log import decode_chunk, encode_chunk
    cfg = _cfg(lateness_ms)
    j, f = PartitionJoin(0, cfg), Feed()
    joined = j.apply(f.imps(imp("a", 100), imp("b", 150)), f.clicks(Click("a", 300)))
    first = j.apply([], [], drain=True)
    chunks = [joined.chunk, first.chunk]
    assert sorted(_labels(joined.samples + first.samples)) == [("a", 1, 0), ("b", 0, 0)]
    assert j.watermark == 150 + W
    if restart:
        j = PartitionJoin.restore(0, cfg, [decode_chunk(encode_chunk(c)) for c in chunks if c is not None])
        assert j.watermark == 150 + W
    again = j.apply([], [], drain=True)
    assert again.samples == [] and again.unjoined == []
    assert j.watermark == 150 + W  # was 150 + 2 * W + lateness + 1
    later = j.apply(f.imps(imp("c", 150 + 3 * W)), [])  # a later input moves it on as before
    drained = j.apply([], [], drain=True)
    assert [s.pending.impression_id for s in later.samples + drained.samples] == ["c"]
    assert j.watermark == 150 + 4 * W
