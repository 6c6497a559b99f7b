"""While a partition's impressions have more to read, its clicks are joined only as far as the waiting cap has room
(``backpressure.click_room``): what a driver already has in hand when the gate pauses the clicks (the rest of a fetch,
clicks a hold kept) is held, not given up as ``overflow``. Pure logic: the pipeline's ``_take`` over one partition's
engine, no broker."""

from __future__ import annotations

from stream.config import KafkaSettings
from stream.errors import BadMessage
from stream.events import Click, Impression
from stream.joiner.backpressure import IMPRESSIONS, click_room
from stream.joiner.config import JoinerSettings
from stream.joiner.engine import JoinConfig, PartitionJoin
from stream.joiner.pipeline import JoinPipeline
from stream.joiner.records import Record
from stream.joiner.totals import JoinTotals

KAFKA = KafkaSettings()
CAP = 10
S = 1000  # ms


def _pipeline(waiting: int, max_pending: int = 500_000) -> JoinPipeline:
    """A JoinPipeline with only what the hold reads, its partition 0 engine already holding ``waiting`` impression ids
    whose clicks wait for them."""
    p = JoinPipeline.__new__(JoinPipeline)
    p.kafka, p.js = KAFKA, JoinerSettings(max_input_drift_s=3600.0, max_waiting_per_partition=CAP)
    # (an hour's lateness: nothing expires in the test)
    engine = PartitionJoin(0, JoinConfig(watermark_quorum=1, max_waiting=CAP, lateness_ms=3600 * S,
                                         max_pending=max_pending))
    # an impression read well ahead (its input's time is known: the frontier does not hold the clicks back), then
    # clicks whose impressions have not come
    ahead = [(0, Impression("ahead", 500 * S, "u", "i"))]
    engine.apply(ahead, [(o, Click(f"early-{o}", o * S)) for o in range(waiting)])
    assert len(engine.waiting) == waiting
    p.engines = {0: engine}
    p.totals, p._held_groups, p._reached = JoinTotals(), {}, {}
    return p


def _hold_clicks(p: JoinPipeline, first: int, n: int) -> None:
    recs = [Record(KAFKA.clicks_topic, 0, o, None, None) for o in range(first, first + n)]
    p._held_groups_add(recs, [Click(f"late-{r.offset}", r.offset * S) for r in recs])


def _taken_clicks(p: JoinPipeline, impressions_behind: bool) -> list[int]:
    def behind(kind: str, partition: int) -> bool:
        return impressions_behind if kind == IMPRESSIONS else False

    groups = p._take(behind)
    return [r.offset for r in groups.get((KAFKA.clicks_topic, 0), ([], []))[0]]


def test_click_room_is_what_the_cap_has_left_and_never_negative() -> None:
    assert click_room(10, 7) == 3 and click_room(10, 10) == 0 and click_room(10, 14) == 0


def test_clicks_past_the_caps_room_are_held_while_impressions_have_more_to_read() -> None:
    p = _pipeline(waiting=7)
    _hold_clicks(p, first=100, n=8)
    taken = _taken_clicks(p, impressions_behind=True)
    assert taken == [100, 101, 102]  # room for 3: each click may add one waiting id
    assert p.totals.batch["clicks_held_at_cap"] == 5  # the batch's: in the summary once it is durable
    assert [r.offset for r in p._held_groups[(KAFKA.clicks_topic, 0)].held()[0]] == list(range(103, 108))
    # Joined, the engine stays within its cap: nothing is given up as overflow.
    res = p.engines[0].apply([], [(o, Click(f"late-{o}", o * S)) for o in taken])
    assert len(p.engines[0].waiting) == CAP and res.stats["overflow_clicks"] == 0
    # At the cap nothing more is taken, whatever the event time allows.
    assert _taken_clicks(p, impressions_behind=True) == []


def test_with_impressions_read_to_the_end_every_click_is_joined_and_the_cap_gives_up_the_rest() -> None:
    # Nothing more is coming to take the waiting clicks: holding would stop the partition, so all of them are joined.
    p = _pipeline(waiting=7)
    _hold_clicks(p, first=100, n=8)
    assert _taken_clicks(p, impressions_behind=False) == list(range(100, 108))


def test_without_a_hold_every_click_is_joined() -> None:
    # behind=None: backpressure off, or an idle exit joining what is held (the cap's overflow is then the bound).
    p = _pipeline(waiting=9)
    _hold_clicks(p, first=100, n=4)
    groups = p._take(None)
    assert len(groups[(KAFKA.clicks_topic, 0)][0]) == 4


def _past_hope(p: JoinPipeline) -> None:
    """An impression 1 ms past the newest waiting click (6 s) plus the hour's lateness: every waiting click is past
    hope (no impression for them can come within the lateness)."""
    p.engines[0].apply([(1, Impression("later", 3600 * S + 7 * S, "u", "i"))], [])


def test_clicks_past_hope_leave_the_cap_first_and_the_new_clicks_stay_waiting() -> None:
    # A cap full of clicks past hope is released so the clicks go on (a live stream whose impressions always have more
    # to read would otherwise hold its clicks for good: the watermark that expires orphans is the slower input's time,
    # and the clicks' stands). But the cap gives up the hopeless ones, not the new clicks whose impressions may still
    # come: the cap lifted whole took all 8 and the engine gave up the 6 furthest of them (real clicks), kept the 7
    # hopeless.
    p = _pipeline(waiting=7)
    engine = p.engines[0]
    assert engine.hopeless() == []  # impressions at 500 s less the hour's lateness: their impressions may still come
    _past_hope(p)
    assert sorted(engine.hopeless()) == [f"early-{o}" for o in range(7)]
    _hold_clicks(p, first=100, n=8)
    taken = _taken_clicks(p, impressions_behind=True)
    assert taken == list(range(100, 108))  # room for 10 once the 7 past hope are left out
    res = engine.apply([], [(o, Click(f"late-{o}", o * S)) for o in taken])
    assert sorted(u.impression_id for u in res.unjoined) == [f"early-{o}" for o in range(7)]  # (all "overflow")
    assert sorted(engine.waiting) == [f"late-{o}" for o in taken]


def test_one_click_past_hope_frees_one_place_not_the_whole_cap() -> None:
    # The faust driver's lost clicks (test_backpressure's orphan burst under load): one waiting click past hope, a
    # batch of clicks ahead of their impressions. Joined whole, they passed the cap and the engine gave up the furthest
    # (real clicks). Only the cap's room is taken; the rest is held, and nothing that could still join is given up.
    p = _pipeline(waiting=1)
    engine = p.engines[0]
    _past_hope(p)
    _hold_clicks(p, first=100, n=30)
    taken = _taken_clicks(p, impressions_behind=True)
    assert taken == list(range(100, 110)) and p.totals.batch["clicks_held_at_cap"] == 20
    res = engine.apply([], [(o, Click(f"late-{o}", o * S)) for o in taken])
    assert [u.impression_id for u in res.unjoined] == ["early-0"] and len(engine.waiting) == CAP



def _hold(p: JoinPipeline, clicks: list[tuple[int, str, int]]) -> list[tuple[int, Click]]:
    """Hold ``(offset, impression_id, ts in s)`` clicks of partition 0, as a fetch brings them; returns them as the
    engine takes them."""
    pairs = [(o, Click(i, t * S)) for o, i, t in clicks]
    p._held_groups_add([Record(KAFKA.clicks_topic, 0, o, None, None) for o, _ in pairs], [c for _, c in pairs])
    return pairs


def test_clicks_that_add_no_waiting_id_take_no_place_at_a_full_cap() -> None:
    # Counted one each, a full cap held back every click, also those that cannot add a waiting id: the clicks on an
    # impression held (they join at once), a second click of an id already waiting, a click on an impression closed
    # (late: evicted by the pending cap), a record that is not a click (dead-lettered), the second click of a new id.
    # Only the new ids take places: one is left, so the first new id's clicks are joined and the next one held.
    p = _pipeline(waiting=9, max_pending=2)
    engine = p.engines[0]
    res = engine.apply([(1, Impression("closed", 0, "u", "i")), (2, Impression("held", 499 * S, "u", "i"))], [])
    assert res.stats["evicted_impressions"] == 1 and "closed" in engine.finalized
    pairs = _hold(p, [(100, "held", 499), (101, "ahead", 500), (102, "early-3", 3), (103, "closed", 1)])
    p._held_groups_add([Record(KAFKA.clicks_topic, 0, 104, None, None)], [BadMessage("not json")])
    pairs += _hold(p, [(105, "new", 9), (106, "new", 10), (107, "other", 9)])
    assert _taken_clicks(p, impressions_behind=True) == [100, 101, 102, 103, 104, 105, 106]
    assert p.totals.batch["clicks_held_at_cap"] == 1  # "other": it would be the eleventh waiting id
    res = engine.apply([], [pair for pair in pairs if pair[0] < 107])
    assert len(engine.waiting) == CAP and res.stats["overflow_clicks"] == 0
    assert res.stats["joined_clicks"] == 2 and res.stats["late_clicks"] == 1


def test_a_new_click_of_a_click_past_hope_takes_the_place_its_id_would_have_left() -> None:
    # A waiting id past hope is counted as leaving the cap; a newer click of it keeps it (no longer past hope), so the
    # click takes a place as a new id does, and the room stays safe: nothing is given up as overflow.
    p = _pipeline(waiting=10)
    engine = p.engines[0]
    engine.apply([(1, Impression("later", 3600 * S + 5 * S, "u", "i"))], [])  # early-0..4 past hope
    assert sorted(engine.hopeless()) == [f"early-{o}" for o in range(5)]
    pairs = _hold(p, [(100, "early-0", 3600), *((100 + n, f"new-{n}", 3600) for n in range(1, 6))])
    assert _taken_clicks(p, impressions_behind=True) == list(range(100, 105))  # 5 places: early-0 and new-1..4
    res = engine.apply([], pairs[:5])
    assert len(engine.waiting) == CAP and sorted(u.impression_id for u in res.unjoined) == [
        f"early-{o}" for o in range(1, 5)]


def test_clicks_redelivered_after_a_restart_take_no_place_at_a_full_cap() -> None:
    # Records at or below the engine's applied click offset (read again after a restart) are skipped by the join: they
    # add no waiting id, so a full cap does not hold them (nor the clicks behind them) back.
    p = _pipeline(waiting=9)  # clicks 0..8 applied
    _hold(p, [(o, f"again-{o}", 100) for o in range(5, 9)] + [(9, "new", 100), (10, "other", 100)])
    assert _taken_clicks(p, impressions_behind=True) == [5, 6, 7, 8, 9]
    assert p.totals.batch["clicks_held_at_cap"] == 1
