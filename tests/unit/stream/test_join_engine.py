"""The join logic alone (no broker): labels, windows, late/orphan/duplicate clicks, recovery."""

from __future__ import annotations

import dataclasses
import random
from collections import Counter

import pytest

import stream.joiner.engine as engine_module
from stream.events import Click, Impression
from stream.features import hash_value
from stream.joiner.engine import (
    _NO_OFFSET,
    COMPACT_SLACK,
    POLICIES,
    BatchResult,
    JoinConfig,
    PartitionJoin,
    StateChunk,
    Unjoined,
)
from stream.joiner.state_log import decode_chunk, encode_chunk

W = 1000  # window ms
# These tests step event time one event at a time (quorum 1); the quorum and the caps have tests of their own.
CFG = JoinConfig(window_ms=W, lateness_ms=0, late_retention_ms=5000, history_len=3, watermark_quorum=1)


def imp(i: str, ts: int, user: str = "u", item: str = "x") -> Impression:
    return Impression(i, ts, user, item, {"device": "ios", "tags": [1, 2]}, {"price": 2.0})


class Feed:
    """Numbers offsets per topic like a partition would."""

    def __init__(self) -> None:
        self.io = self.co = -1

    def imps(self, *evs: Impression) -> list[tuple[int, Impression]]:
        out = []
        for e in evs:
            self.io += 1
            out.append((self.io, e))
        return out

    def clicks(self, *evs: Click) -> list[tuple[int, Click]]:
        out = []
        for e in evs:
            self.co += 1
            out.append((self.co, e))
        return out


def test_click_inside_window_is_one_positive_and_duplicates_make_no_second_sample() -> None:
    j, f = PartitionJoin(0, CFG), Feed()
    r = j.apply(f.imps(imp("a", 100)), f.clicks(Click("a", 400), Click("a", 500)))
    assert [(s.pending.impression_id, s.label, s.label_delay_ms) for s in r.samples] == [("a", 1, 300)]
    assert r.stats["duplicate_clicks"] == 1 and not r.unjoined
    r = j.apply(f.imps(imp("b", 5000)), [])
    assert "a" in j.pending  # the click input is still at 500: event time is the slower input's
    r = j.apply([], f.clicks(Click("b", 5100)))  # now both inputs passed 100 + W: "a" expires
    assert [s.pending.impression_id for s in r.samples] == ["b"]  # b's positive; no second sample for a
    assert "a" not in j.pending and j.finalized["a"] == (100, 1)


def test_no_click_gives_a_negative_at_expiry_and_late_clicks_are_reported() -> None:
    j, f = PartitionJoin(0, CFG), Feed()
    r = j.apply(f.imps(imp("a", 100)), [])
    r = j.apply(f.imps(imp("b", 5000)), [])
    assert r.samples == [] and j.watermark is None  # no click input yet: event time waits for it
    j2, f2 = PartitionJoin(0, CFG), Feed()
    j2.apply(f2.imps(imp("a", 100)), [], clicks_idle=True)  # the driver says clicks are quiet
    r = j2.apply(f2.imps(imp("b", 1099)), [], clicks_idle=True)
    assert r.samples == []  # 100 + 1000 > 1099: still inside the window
    r = j2.apply(f2.imps(imp("b2", 1100)), [], clicks_idle=True)
    assert r.samples == []  # a click at 1100, in order, could still come: the window is inclusive
    r = j2.apply(f2.imps(imp("c", 1101)), [], clicks_idle=True)
    assert [(s.pending.impression_id, s.label, s.label_delay_ms) for s in r.samples] == [("a", 0, W)]
    j, f = j2, f2
    r = j.apply([], f.clicks(Click("a", 1150)))  # after expiry -> late
    assert [(u.impression_id, u.reason) for u in r.unjoined] == [("a", "late")] and r.samples == []
    r = j.apply([], f.clicks(Click("b", 1099 + W + 1)))  # pending but beyond the window -> late
    assert [(u.impression_id, u.reason) for u in r.unjoined] == [("b", "late")]


def test_clicks_may_arrive_before_their_impression_and_orphans_expire() -> None:
    j, f = PartitionJoin(0, CFG), Feed()
    r = j.apply([], f.clicks(Click("a", 300), Click("ghost", 310)))
    assert r.samples == [] and set(j.waiting) == {"a", "ghost"}
    r = j.apply(f.imps(imp("a", 200)), [])
    assert [(s.pending.impression_id, s.label) for s in r.samples] == [("a", 1)]
    r = j.apply(f.imps(imp("z", 400)), f.clicks(Click("y", 400)))  # watermark 399 > 310: the ghost's never came
    assert [(u.impression_id, u.reason) for u in r.unjoined] == [("ghost", "orphan")]


def test_every_impression_gets_exactly_one_sample_after_drain() -> None:
    j, f = PartitionJoin(0, CFG), Feed()
    ids = [f"i{k}" for k in range(50)]
    samples = []
    for k in range(0, 50, 7):
        imps = f.imps(*(imp(i, 30 * int(i[1:])) for i in ids[k:k + 7]))
        clicks = f.clicks(*(Click(i, 30 * int(i[1:]) + 20) for i in ids[k:k + 7] if int(i[1:]) % 3 == 0))
        samples += j.apply(imps, clicks).samples
    samples += j.apply([], [], drain=True).samples
    assert sorted(s.pending.impression_id for s in samples) == sorted(ids)
    assert {s.pending.impression_id for s in samples if s.label} == {i for i in ids if int(i[1:]) % 3 == 0}
    assert not j.pending


def test_redelivered_events_after_a_restart_are_skipped_and_state_round_trips() -> None:
    j, f = PartitionJoin(0, CFG), Feed()
    log = {}
    batch1 = (f.imps(imp("a", 100), imp("b", 150)), f.clicks(Click("a", 300)))
    r = j.apply(*batch1)
    log[r.chunk.seq] = encode_chunk(r.chunk)
    batch2 = (f.imps(imp("c", 700)), f.clicks(Click("w", 800)))  # "w" waits for its impression
    r = j.apply(*batch2)
    log[r.chunk.seq] = encode_chunk(r.chunk)

    back = PartitionJoin.restore(0, CFG, [decode_chunk(v) for v in log.values()])
    assert set(back.pending) == {"a", "b", "c"} and back.pending["a"].click_ts == 300
    assert back.waiting == {"w": [800]} and back.offsets == [2, 1]
    # The whole input again, as after a crash before the consumer commit: nothing applies twice.
    r = back.apply(batch1[0] + batch2[0], batch1[1] + batch2[1])
    assert r.samples == [] and r.stats["redelivered"] == 5
    r = back.apply(f.imps(imp("d", 1200)), f.clicks(Click("d", 1250)))  # expires a (emitted before) and b
    assert sorted((s.pending.impression_id, s.label) for s in r.samples) == [("b", 0), ("d", 1)]
    assert back.pending["c"].context == {"device": hash_value("ios"), "tags": [hash_value(1), hash_value(2)]}


def test_retired_chunks_leave_a_state_that_restores_the_same() -> None:
    j, f = PartitionJoin(0, CFG), Feed()
    log = {}
    for k in range(40):
        r = j.apply(f.imps(imp(f"i{k}", k * 500)), f.clicks(Click(f"i{k}", k * 500 + 10)) if k % 2 else [])
        log[r.chunk.seq] = encode_chunk(r.chunk)
        for seq in r.retired:
            del log[seq]
    assert len(log) < 40  # old chunks were retired
    back = PartitionJoin.restore(0, CFG, [decode_chunk(v) for v in log.values()])
    assert set(back.pending) == set(j.pending) and back.offsets == j.offsets
    assert {i: p.click_ts for i, p in back.pending.items()} == {i: p.click_ts for i, p in j.pending.items()}


def test_an_idle_click_input_does_not_hold_expiry_back_for_ever() -> None:
    j, f = PartitionJoin(0, CFG), Feed()
    j.apply(f.imps(imp("a", 0)), f.clicks(Click("a", 10)))
    out = []
    for k in range(1, 4):
        out += j.apply(f.imps(imp(f"n{k}", 2000 * k)), []).samples
    assert out == []  # click time stuck at 10: nothing can expire
    out += j.apply(f.imps(imp("n4", 8000)), [], clicks_idle=True).samples
    assert [s.pending.impression_id for s in out] == ["n1", "n2", "n3"]


def test_one_far_future_event_does_not_move_event_time() -> None:
    cfg = JoinConfig(window_ms=W, lateness_ms=0, late_retention_ms=5000, watermark_quorum=3)
    j, f = PartitionJoin(0, cfg), Feed()
    j.apply(f.imps(*(imp(f"a{k}", 100 + k) for k in range(5))),
            f.clicks(*(Click(f"a{k}", 150 + k) for k in range(5))))
    before = j.watermark
    # One impression and one click from clients whose clocks are years ahead.
    r = j.apply(f.imps(imp("future", 10**12)), f.clicks(Click("ghost", 10**12)))
    assert before <= j.watermark <= 104 and not r.samples and not r.unjoined  # the bulk's time, not 10**12
    r = j.apply(f.imps(*(imp(f"b{k}", 200 + k) for k in range(5))), [])
    assert not [s for s in r.samples if s.label == 0], "an ordinary impression expired at once"
    # Time moves on with the bulk: the quorum-th largest time on each input.
    r = j.apply(f.imps(*(imp(f"c{k}", 5000 + k) for k in range(3))),
                f.clicks(*(Click(f"x{k}", 5000 + k) for k in range(3))))
    expired = {s.pending.impression_id for s in r.samples if s.label == 0}
    assert {f"b{k}" for k in range(5)} <= expired and "future" not in expired


def test_pending_and_waiting_caps_evict_with_a_record_and_state_restores_the_eviction() -> None:
    cfg = JoinConfig(window_ms=W, lateness_ms=0, late_retention_ms=5000, watermark_quorum=1, max_pending=3,
                     max_waiting=10)
    j, f = PartitionJoin(0, cfg), Feed()
    chunks = []
    r = j.apply(f.imps(*(imp(f"i{k}", 100 + k) for k in range(5))), [])
    chunks.append(r.chunk)
    assert len(j.pending) == 3 and r.stats["evicted_impressions"] == 2
    assert sorted(s.pending.impression_id for s in r.samples) == ["i0", "i1"]  # the oldest, as negatives
    r = j.apply([], f.clicks(Click("i0", 150)))
    chunks.append(r.chunk)
    assert [u.reason for u in r.unjoined] == ["late"]  # a click on an evicted impression is reported
    r = j.apply([], f.clicks(*(Click(f"g{k}", 1000 + k * 10**6) for k in range(12))))
    chunks.append(r.chunk)
    over = [u for u in r.unjoined if u.reason == "overflow"]
    assert len(j.waiting) <= 10 and len(over) == 12 - len(j.waiting) and over
    assert {u.impression_id for u in over} == {f"g{k}" for k in range(12 - len(over), 12)}  # furthest future first
    back = PartitionJoin.restore(0, cfg, [decode_chunk(encode_chunk(c)) for c in chunks])
    assert set(back.pending) == set(j.pending) and set(back.waiting) == set(j.waiting)
    r = back.apply([], [], drain=True)
    assert sorted(s.pending.impression_id for s in r.samples) == ["i2", "i3", "i4"]  # no second sample for i0/i1


def test_a_restored_partition_keeps_its_event_time_and_drains_when_its_clicks_came_before_the_restart() -> None:
    cfg = JoinConfig(window_ms=W, lateness_ms=0, late_retention_ms=5000, watermark_quorum=2)
    j, f = PartitionJoin(0, cfg), Feed()
    r1 = j.apply([], f.clicks(Click("a", 150), Click("b", 160), Click("c", 170)))  # clicks first, then a restart
    back = PartitionJoin.restore(0, cfg, [decode_chunk(encode_chunk(r1.chunk))])
    assert back.topic_max == j.topic_max and back.topic_max[1] is not None
    r2 = back.apply(f.imps(imp("a", 100), imp("b", 120), imp("z", 130)), [])
    assert sorted(s.pending.impression_id for s in r2.samples) == ["a", "b"]  # joined with the waiting clicks
    r3 = back.apply([], [], drain=True)  # no click arrives after the restart: the drain still ends every window
    assert [s.pending.impression_id for s in r3.samples] == ["z"] and not back.pending


def test_within_counts_the_events_before_an_inputs_time_would_pass_a_limit_and_a_lone_outlier_does_not_stop_it(
) -> None:
    exact = PartitionJoin(0, CFG)  # quorum 1: the time is the newest event
    assert exact.within(0, [10, 20, 30, 25], limit=20) == 2
    assert exact.reached(0, [10, 20, 30]) == 30 and exact.reached(1, []) is None
    three = PartitionJoin(0, dataclasses.replace(CFG, watermark_quorum=3))
    # the event far ahead does not stop the rest (it is one of three): the time passes 20 at 22, the second past it
    assert three.within(0, [10, 11, 12, 10**12, 13, 21, 22, 23, 24], limit=20) == 6
    assert three.reached(0, [10, 10**12]) is None  # fewer events than the quorum: not known
    assert three.reached(0, [10, 11, 12, 10**12]) == 11
    three.apply([(o, imp(f"i{o}", ts)) for o, ts in enumerate([100, 200, 300])], [])
    assert three.reached(0, []) == 100 and three.within(0, [400], limit=250) == 1  # joined events count too
    assert three.within(0, [400, 500], limit=250) == 1


def test_the_oldest_pending_impression_moves_on_as_windows_close_and_its_age_is_exported() -> None:
    from prometheus_client import REGISTRY

    from stream.joiner import metrics as m

    j, f = PartitionJoin(7, CFG), Feed()
    assert j.oldest_pending_ts() is None
    j.apply(f.imps(imp("a", 100), imp("b", 300)), f.clicks(Click("z", 50)))
    assert j.oldest_pending_ts() == 100
    j.apply(f.imps(imp("c", 1200)), f.clicks(Click("y", 1250)))  # event time 1200: a's window (100 + W) closed
    assert "a" not in j.pending and j.oldest_pending_ts() == 300
    m.gauges({7: j}, Counter())
    assert REGISTRY.get_sample_value("streamrec_join_oldest_pending_age_seconds", {"partition": "7"}) == 0.9
    j.apply([], [], drain=True)
    assert j.oldest_pending_ts() is None
    # an impression that left early (evicted) in a restored chunk leaves a stale heap entry behind: skipped
    chunk = j.apply(f.imps(imp("d", 9000), imp("e", 9100)), []).chunk
    assert chunk is not None
    chunk.evicted = ["d"]
    back = PartitionJoin.restore(7, CFG, [chunk])
    assert back.oldest_pending_ts() == 9100


def test_a_click_before_its_impression_is_reported_as_such_also_once_the_impression_has_closed() -> None:
    """A click stamped before its impression was ``before_impression`` while the impression waited in its window,
    but ``late`` (unclicked) or a silent ``duplicate`` (clicked) once the window had closed: one input, two reasons."""
    j, f = PartitionJoin(0, CFG), Feed()
    j.apply(f.imps(imp("neg", 500), imp("pos", 500)), f.clicks(Click("pos", 600)))
    j.apply(f.imps(imp("z", 3000)), f.clicks(Click("z", 3000)))  # both windows close
    assert j.finalized["neg"] == (500, 0) and j.finalized["pos"] == (500, 1)
    r = j.apply([], f.clicks(Click("neg", 499), Click("pos", 499)))
    assert sorted((u.impression_id, u.reason) for u in r.unjoined) == [("neg", "before_impression"),
                                                                       ("pos", "before_impression")]
    assert r.stats["before_impression_clicks"] == 2 and not r.stats["late_clicks"] and not r.stats["duplicate_clicks"]


def test_a_restore_keeps_a_closed_impression_whose_id_was_evicted_and_forgotten_before_it_came_again() -> None:
    # max_pending 1: "a"@0 is evicted by "b"@4000 and forgotten at once (0 + window + retention <= 4000); that chunk
    # stays live for "b". "a" again @4500 closes at 5500 and is remembered until 10500. A restore replayed the first
    # "a"'s forget time onto the second: it was forgotten, and a click before it came out orphan, not before_impression.
    cfg = JoinConfig(window_ms=W, lateness_ms=0, late_retention_ms=2000, watermark_quorum=1, max_pending=1)
    j, f, chunks = PartitionJoin(0, cfg), Feed(), {}
    for imps, clicks in (([imp("a", 0), imp("b", 4000)], [Click("z", 4000)]), ([imp("a", 4500)], []),
                         ([imp("c", 6000)], [Click("y", 6000)])):
        r = j.apply(f.imps(*imps), f.clicks(*clicks))
        chunks[r.chunk.seq] = r.chunk
        for seq in r.retired:
            del chunks[seq]
    assert j.finalized["a"] == (4500, 0) and 0 in chunks  # the first "a"'s chunk is live
    back = PartitionJoin.restore(0, cfg, [decode_chunk(encode_chunk(c)) for c in chunks.values()])
    assert back.finalized == j.finalized
    clicks = f.clicks(Click("a", 4400), Click("x", 6500))
    assert [(u.impression_id, u.reason) for u in back.apply([], clicks).unjoined] == [("a", "before_impression")]


def test_a_restore_keeps_a_click_waiting_for_an_id_whose_earlier_impression_was_closed_and_forgotten() -> None:
    # "a"@0 closes and is forgotten at once (event time 5000 > 0 + window + retention); its chunk stays live for "b".
    # A click on "a" @6000 then waits for a new "a". A restore found the first "a" among the chunks' impressions and
    # dropped the waiting click as if that impression had taken it: the new "a"@5800 ended a negative, not a positive.
    cfg = JoinConfig(window_ms=W, lateness_ms=0, late_retention_ms=2000, watermark_quorum=1)
    j, f, chunks = PartitionJoin(0, cfg), Feed(), {}
    for imps, clicks in (([imp("a", 0), imp("b", 5000)], [Click("z", 4000)]), ([], [Click("a", 6000)])):
        r = j.apply(f.imps(*imps), f.clicks(*clicks))
        chunks[r.chunk.seq] = r.chunk
    assert j.waiting == {"a": [6000]} and "a" not in j.finalized
    back = PartitionJoin.restore(0, cfg, [decode_chunk(encode_chunk(c)) for c in chunks.values()])
    assert back.waiting == j.waiting
    samples = back.apply(f.imps(imp("a", 5800)), []).samples
    assert [(s.pending.impression_id, s.label) for s in samples] == [("a", 1)]


def test_a_restore_does_not_bring_back_a_waiting_click_its_impression_took_in_a_chunk_retired_since() -> None:
    # A click on "a" @10000 waits (its chunk lives until 10000 + window + retention); "a"@100 comes and takes it (late).
    # That chunk referred to 100 only and retired at event time 5000: a restore found the click still waiting, and
    # reported it a second time, as an orphan, once event time passed 10000.
    cfg = JoinConfig(window_ms=W, lateness_ms=0, late_retention_ms=2000, watermark_quorum=1)
    j, f, chunks = PartitionJoin(0, cfg), Feed(), {}
    for imps, clicks in (([imp("b", 0)], [Click("z", 0)]), ([], [Click("a", 10_000)]), ([imp("a", 100)], []),
                         ([imp("c", 5000)], [Click("y", 4000)])):
        r = j.apply(f.imps(*imps), f.clicks(*clicks))
        chunks[r.chunk.seq] = r.chunk
        for seq in r.retired:
            del chunks[seq]
    assert not j.waiting and 1 in chunks  # the click's chunk is live
    back = PartitionJoin.restore(0, cfg, [decode_chunk(encode_chunk(c)) for c in chunks.values()])
    assert back.waiting == j.waiting
    imps, clicks = f.imps(imp("d", 11_001)), f.clicks(Click("w", 11_000), Click("v", 11_001))
    assert back.apply(imps, clicks).unjoined == j.apply(imps, clicks).unjoined == [Unjoined("w", 11_000, "orphan")]


def test_a_batch_that_only_moves_event_time_writes_a_chunk_so_a_restore_does_not_emit_its_samples_again() -> None:
    # The clicks go quiet: a batch with no new event but clicks_idle moves event time to the impressions' 5000 and
    # closes "a"@0 (its negative goes out). It wrote no chunk, so a restore went back to event time 100 and "a"'s
    # negative went out a second time when event time came past it again.
    cfg = JoinConfig(window_ms=W, lateness_ms=0, late_retention_ms=2000, watermark_quorum=1)
    j, f, chunks = PartitionJoin(0, cfg), Feed(), {}
    for imps, clicks, idle in (([imp("a", 0), imp("b", 5000)], [Click("z", 100)], False), ([], [], True)):
        r = j.apply(f.imps(*imps), f.clicks(*clicks), clicks_idle=idle)
        if r.chunk is not None:
            chunks[r.chunk.seq] = r.chunk
    assert [s.pending.impression_id for s in r.samples] == ["a"] and j.max_ts == 5000
    back = PartitionJoin.restore(0, cfg, [decode_chunk(encode_chunk(c)) for c in chunks.values()])
    assert back.max_ts == j.max_ts and set(back.pending) == set(j.pending) == {"b"}
    clicks = f.clicks(Click("y", 7000))
    assert [s.pending.impression_id for s in back.apply([], clicks).samples] == []  # "a" was out already


def test_batches_that_move_nothing_write_no_chunk_so_an_idle_stream_does_not_grow_the_state_log() -> None:
    # A chunk is written when event time moved with no new event (the click input went idle), once: later batches
    # with nothing new, idle or not, move nothing and must write nothing (one chunk a poll grew the log for ever).
    j, f = PartitionJoin(0, CFG), Feed()
    assert j.apply(f.imps(imp("a", 0), imp("b", 5000)), f.clicks(Click("z", 100))).chunk is not None
    assert j.apply([], [], clicks_idle=True).chunk is not None and j.max_ts == 5000
    written = [j.apply([], [], clicks_idle=idle).chunk for idle in (True, True, False, True)]
    redelivered = j.apply(f.imps(), [(0, Click("z", 100))], clicks_idle=True)
    assert written == [None] * 4 and redelivered.chunk is None and j.max_ts == 5000


def test_a_restore_takes_the_offsets_of_the_newest_chunks_topic_not_a_larger_one_of_a_topic_made_again() -> None:
    """After a restore onto an input topic made again (``start_over``), the log holds older chunks with the old
    topic's offsets beside newer ones with the new topic's smaller offsets; the next restore must resume at the new
    topic's offset: the max over both skipped the new topic's records up to the old offset as redelivered, in silence
    (both ids equal by then, so ``pipeline._follow_topics`` saw no change)."""
    old = StateChunk(1, [], [], [], 1000, (900, 400), 1000, topic_ids=("old", "clicks-id"))
    new = StateChunk(2, [], [], [], 1000, (_NO_OFFSET, 410), 1000, topic_ids=("new", "clicks-id"))
    back = PartitionJoin.restore(0, CFG, [new, old])  # any order
    assert back.offsets == [_NO_OFFSET, 410] and back.topic_ids == ["new", "clicks-id"]
    later = dataclasses.replace(new, seq=3, offsets=(50, 420))
    assert PartitionJoin.restore(0, CFG, [old, later, new]).offsets == [50, 420]


class _ScanCount(dict):
    """``waiting`` that counts the scans of it (``items()``): hopeless() is the only reader that walks it."""

    scans = 0

    def items(self):  # type: ignore[override]
        self.scans += 1
        return super().items()


def test_hopeless_is_scanned_once_between_batches_and_never_stale() -> None:
    # While the cap is full, the pipeline's room asks hopeless() before each batch and the cap asks it in the batch:
    # after a batch whose cap gave the hopeless up, none is left until the next batch, so the room's ask scans nothing.
    cfg = JoinConfig(window_ms=W, lateness_ms=10, late_retention_ms=5000, watermark_quorum=1, max_waiting=3)
    j = PartitionJoin(0, cfg)
    j.apply([(0, imp("first", 0))], [(o, Click(f"w{o}", 100 + o)) for o in range(3)])
    j.waiting = waiting = _ScanCount(j.waiting)
    # Impressions pass w0 and w1 by the lateness (hopeless); a fourth waiting id pushes the cap over: both go.
    res = j.apply([(1, imp("later", 112))], [(3, Click("w3", 103))])
    assert sorted(u.impression_id for u in res.unjoined) == ["w0", "w1"] and waiting.scans == 1
    assert j.hopeless() == [] and waiting.scans == 1  # the pipeline's next ask: known, not scanned
    j.apply([(2, imp("again", 114))], [])  # the impressions' time moves: w2 and w3 are past hope now
    assert sorted(j.hopeless()) == ["w2", "w3"] and waiting.scans == 2
    assert sorted(j.hopeless()) == ["w2", "w3"] and waiting.scans == 2  # asked again before a batch: known



Q16 = dataclasses.replace(CFG, watermark_quorum=16, max_waiting=3)


def test_before_its_impressions_quorum_a_partition_closes_nothing_and_only_the_cap_bounds_its_waiting_clicks() -> None:
    # Fewer than 16 impressions: their input's time is not known, so event time has not started (one early event with
    # a wrong clock must not close every window). Nothing expires, whatever the clicks' time or idleness, and no
    # waiting click is an orphan or past hope: the cap gives up the furthest (reported, as "overflow"), and the 16th
    # impression starts event time. Pinned as right: a partition is held only until its quorum, or the drain.
    j, f = PartitionJoin(0, Q16), Feed()
    res = j.apply(f.imps(*(imp(f"a{n}", 10 * n) for n in range(15))),
                  f.clicks(*(Click(f"o{n}", 100 + n) for n in range(5)), *(Click("x", 10**6 + n) for n in range(16))))
    assert sorted((u.impression_id, u.reason) for u in res.unjoined) == sorted(
        [("o2", "overflow"), ("o3", "overflow"), ("o4", "overflow")] + [("x", "overflow")] * 16)
    res2 = j.apply([], f.clicks(Click("o1", 10**7)), clicks_idle=True)  # clicks idle: impressions alone would steer
    assert j.topic_max == [None, 10**6 + 1] and j.watermark is None and j.hopeless() == []
    assert res.samples == res2.samples == [] and res2.unjoined == [] and len(j.pending) == 15
    assert sorted(j.waiting) == ["o0", "o1"]
    res = j.apply(f.imps(imp("a15", 5000)), [])  # the 16th: event time starts at the oldest of the 16 (0)
    assert j.topic_max[0] == 0 and j.watermark == -1 and res.unjoined == []
    res = j.apply(f.imps(*(imp(f"b{n}", 5000 + n) for n in range(16))), [], clicks_idle=True)  # impressions steer
    assert sorted(s.pending.impression_id for s in res.samples) == sorted(f"a{n}" for n in range(15))
    assert sorted((u.impression_id, u.reason) for u in res.unjoined) == [("o0", "orphan"), ("o1", "orphan")]


def test_a_restored_partition_keeps_the_events_it_counted_toward_its_quorum() -> None:
    # A restart before the quorum does not start the count again (the events before it are not delivered again): the
    # restored partition reaches its quorum at the same event as one never restarted.
    imps = Feed().imps(*(imp(f"a{n}", 10 * n) for n in range(16)))
    j = PartitionJoin(0, Q16)
    chunk = j.apply(imps[:10], Feed().clicks(*(Click("z", 1) for _ in range(16)))).chunk
    assert chunk is not None and j.topic_max == [None, 1]
    back = PartitionJoin.restore(0, Q16, [decode_chunk(encode_chunk(chunk))])
    for eng in (j, back):
        eng.apply(imps[10:15], [])
        assert eng.topic_max[0] is None  # 15 seen
        eng.apply(imps[15:], [])
        assert eng.topic_max[0] == 0  # the 16th


def _stalled(cfg: JoinConfig, n_imps: int, batches: int) -> tuple[PartitionJoin, Feed, dict[int, bytes], int]:
    """``n_imps`` impressions (those of even number clicked), then ``batches`` batches of three clicks each on
    impressions that never come, ahead of every impression: the impressions' input has stalled (or never reached its
    quorum), so event time stands still. Returns the partition, its feed, its live state log and the most chunks
    that were ever live at once."""
    j, f, log = PartitionJoin(0, cfg), Feed(), {}

    def keep(r: BatchResult) -> None:
        if r.chunk is not None:
            log[r.chunk.seq] = encode_chunk(r.chunk)
        for seq in r.retired:
            del log[seq]

    keep(j.apply(f.imps(*(imp(f"i{k}", k * 100) for k in range(n_imps))),
                 f.clicks(*(Click(f"i{k}", k * 100 + 50) for k in range(0, n_imps, 2)))))
    most = len(log)
    for b in range(batches):
        keep(j.apply([], f.clicks(*(Click(f"o{b}-{n}", 5000 + b) for n in range(3)))))
        most = max(most, len(log))
    return j, f, log, most


def _same_outputs_after(j: PartitionJoin, back: PartitionJoin, f: Feed) -> None:
    """The impressions come back (those the waiting clicks wait for among them) with clicks on held, closed and
    waiting impressions: the restored partition answers exactly as the one that never stopped."""
    imps = f.imps(*(imp(f"o{b}-0", 5000 + b - 10) for b in range(0, 2000, 7)),
                  *(imp(f"n{k}", 9000 + k * 100) for k in range(40)))
    clicks = f.clicks(*(Click(f"i{k}", k * 100 + 60) for k in range(40)), Click("n3", 9400), Click("n39", 20_000))
    for batch in ((imps, clicks), ([], [])):
        a, b = j.apply(*batch, drain=not batch[0]), back.apply(*batch, drain=not batch[0])
        assert [(s.pending.impression_id, s.label, s.label_delay_ms, s.kind) for s in a.samples] == [
            (s.pending.impression_id, s.label, s.label_delay_ms, s.kind) for s in b.samples]
        assert sorted(a.unjoined, key=repr) == sorted(b.unjoined, key=repr) and a.stats == b.stats
    assert j.pending == back.pending == {} and j.waiting == back.waiting


STALL = dataclasses.replace(CFG, watermark_quorum=16, max_waiting=50)


@pytest.mark.parametrize("policy", POLICIES)
def test_a_partition_whose_impressions_stall_after_their_quorum_keeps_a_bounded_state_log_that_restores_the_same(
        policy: str) -> None:
    # 40 impressions (event time starts: 16 of each input), then 2,000 batches of clicks on impressions that never come,
    # ahead of them all: the watermark stands at the impressions' time, so no chunk retires. Each batch wrote a chunk
    # that stayed live: 2,001 live chunks, and a restore read every one. Now the batch whose chunks outweigh twice the
    # live state (plus the slack) writes the whole state instead and retires the rest: a bounded number live.
    cfg = dataclasses.replace(STALL, policy=policy, elapsed_ms=300 if policy == "es_dfm" else 0)
    j, f, log, most = _stalled(cfg, 40, 2000)
    assert j.watermark == 2399 and len(j.finalized) == 14 and len(j.waiting) == 48  # closed, held, waiting: all kept
    assert most <= 200, most
    back = PartitionJoin.restore(0, cfg, [decode_chunk(v) for v in log.values()])
    assert back.finalized == j.finalized and back.waiting == j.waiting and back.offsets == j.offsets
    assert {i: (p.ts, p.click_ts) for i, p in back.pending.items()} == {
        i: (p.ts, p.click_ts) for i, p in j.pending.items()}
    _same_outputs_after(j, back, f)


def test_a_partition_short_of_its_impressions_quorum_keeps_a_bounded_state_log_that_restores_the_same() -> None:
    # Five impressions, never the 16 that start event time: no watermark at all, nothing retires (2,001 live chunks).
    j, f, log, most = _stalled(STALL, 5, 2000)
    assert j.watermark is None and len(j.pending) == 5 and len(j.waiting) == 48
    assert most <= 200, most
    back = PartitionJoin.restore(0, STALL, [decode_chunk(v) for v in log.values()])
    assert back.waiting == j.waiting and back.offsets == j.offsets and back.topic_max == j.topic_max
    _same_outputs_after(j, back, f)


def test_a_stall_below_the_waiting_cap_keeps_its_chunks_few_though_every_one_of_them_is_state() -> None:
    # Below the waiting cap every orphan click a stalled batch brings is live state, so its chunk's items never
    # outweighed twice the state they hold: with a chunk counted as 1 + its items, 2,000 batches of three such clicks
    # left 2,001 live chunks (each mostly framing: ~350 bytes against ~31 a click) and no snapshot. A chunk's own cost
    # (CHUNK_WEIGHT) makes the many small chunks compact into one.
    cfg = dataclasses.replace(CFG, watermark_quorum=16)
    j, f, log, most = _stalled(cfg, 40, 2000)
    assert len(j.waiting) == 6000 and cfg.max_waiting > 6000  # every click kept: no cap at work
    assert most <= 600, most
    back = PartitionJoin.restore(0, cfg, [decode_chunk(v) for v in log.values()])
    assert back.waiting == j.waiting and back.offsets == j.offsets and back.finalized == j.finalized
    _same_outputs_after(j, back, f)


def test_many_clicks_waiting_on_one_impression_id_do_not_make_every_later_batch_write_the_whole_state() -> None:
    # A burst of clicks on one impression not come yet (a bot, a client retrying) waits as one id of the state but is
    # a snapshot's weight each: measured by ids, the snapshot alone outweighed twice the state plus the slack, and each
    # batch after it compacted again, writing every held impression and waiting click once per batch.
    j, f = PartitionJoin(0, STALL), Feed()
    j.apply(f.imps(*(imp(f"i{k}", k * 100) for k in range(40))), [])
    j.apply([], f.clicks(*(Click("bot", 5000 + n) for n in range(COMPACT_SLACK + 300))))
    rs = [j.apply([], f.clicks(Click(f"o{b}", 6000 + b))) for b in range(20)]
    assert sum(r.chunk is not None and r.chunk.snapshot for r in rs) <= 1
    assert len(j.waiting["bot"]) == COMPACT_SLACK + 300


def test_chunks_a_stop_left_live_before_a_snapshot_are_left_out_of_the_restore_and_retired_by_the_next_batch() -> None:
    # The snapshot's write and its predecessors' tombstones are not atomic: with all of them still in the log, a
    # restore that folded them in held every waiting click twice (each reported as an orphan twice at expiry).
    j, f, log, _ = _stalled(STALL, 40, 2000)
    b = 2000
    while True:
        r = j.apply([], f.clicks(*(Click(f"o{b}-{n}", 5000 + b) for n in range(3))))
        b += 1
        if r.chunk is not None and r.chunk.snapshot:
            break
        log = {s: v for s, v in log.items() if s not in r.retired} | ({r.chunk.seq: encode_chunk(r.chunk)}
                                                                       if r.chunk is not None else {})
    assert set(r.retired) == set(log)  # the snapshot retires every chunk live before it
    back = PartitionJoin.restore(0, STALL, [decode_chunk(v) for v in [*log.values(), encode_chunk(r.chunk)]])
    assert back.waiting == j.waiting and back.finalized == j.finalized and set(back.pending) == set(j.pending)
    assert set(back.apply([], []).retired) == set(log)  # their tombstones, with the next batch
    _same_outputs_after(j, back, f)


def _outputs(r: BatchResult) -> tuple:
    return ([(s.pending.impression_id, s.label, s.label_delay_ms, s.kind) for s in r.samples],
            sorted(map(repr, r.unjoined)), dict(r.stats))


def _random_run(rnd: random.Random, cfg: JoinConfig) -> int:
    """A random stream (duplicate ids, clicks before, on and after their impressions, idle click input, both caps
    small) joined by one partition that never stops and by one restored at a random batch from the live state log as a
    stop left it (each snapshot's predecessors still in it or not: a stop before their tombstones); the restored one's
    outputs must be the other's from there to the drain. Returns how many snapshots the run wrote."""
    f, ids, t, batches = Feed(), [f"i{k}" for k in range(60)], 0, []
    for _ in range(60):
        t += rnd.choice([0, 0, 5, 20, 100])
        batches.append((f.imps(*(imp(rnd.choice(ids), max(0, t + rnd.randint(-50, 50)))
                                 for _ in range(rnd.randint(0, 5)))),
                        f.clicks(*(Click(rnd.choice(ids), max(0, t + rnd.randint(-80, 80)))
                                   for _ in range(rnd.randint(0, 6)))), rnd.random() < 0.2))
    j, log, left, back, snapshots = PartitionJoin(0, cfg), {}, {}, None, 0
    stop_at = rnd.randint(1, len(batches))
    for n, (imps, clicks, idle) in enumerate([*batches, ([], [], False)]):
        if n == stop_at:
            back = PartitionJoin.restore(0, cfg, [decode_chunk(v) for v in {**left, **log}.values()])
        drain = n == len(batches)
        r = j.apply(imps, clicks, drain=drain, clicks_idle=idle)
        if back is not None:
            assert _outputs(back.apply(imps, clicks, drain=drain, clicks_idle=idle)) == _outputs(r), (n, stop_at)
        snapshot = r.chunk is not None and r.chunk.snapshot
        snapshots += snapshot
        if r.chunk is not None:
            log[r.chunk.seq] = encode_chunk(r.chunk)
        for seq in r.retired:
            if snapshot and rnd.random() < 0.5:
                left[seq] = log[seq]
            del log[seq]
    return snapshots


@pytest.mark.parametrize("policy", POLICIES)
def test_a_partition_restored_from_its_compacted_state_log_at_any_batch_answers_as_one_that_never_stopped(
        policy: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engine_module, "COMPACT_SLACK", 3)  # a snapshot every few batches
    rnd, snapshots = random.Random(policy), 0
    for _ in range(30):
        window = rnd.choice([50, 200, 1000])
        cfg = JoinConfig(window_ms=window, lateness_ms=rnd.choice([0, 5, 30]),
                         late_retention_ms=rnd.choice([0, 100, 2000]), history_len=3,
                         watermark_quorum=rnd.choice([1, 2, 4]), max_pending=rnd.choice([5, 20, 1000]),
                         max_waiting=rnd.choice([3, 10, 1000]), policy=policy,
                         elapsed_ms=rnd.randint(0, window) if policy == "es_dfm" else 0)
        snapshots += _random_run(rnd, cfg)
    assert snapshots >= 30  # the restores started from snapshots (with chunks after them), not only from chunks
