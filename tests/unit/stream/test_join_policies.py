"""The joiner's emission policies (stream/joiner/engine.py): when each sample goes out and with which kind,
that every impression ends with exactly its wait-policy label in view, and that a restore mid-stream emits
what an uninterrupted run does."""

from __future__ import annotations

import dataclasses
import random

import pytest

from stream.events import Click, Impression
from stream.joiner.engine import POLICIES, JoinConfig, PartitionJoin, Sample
from stream.joiner.state_log import decode_chunk, encode_chunk
from stream.samples import DELAYED_POSITIVE, FINAL, OBSERVED

W, E = 1000, 200  # window, es_dfm's elapsed (ms)
BASE = JoinConfig(window_ms=W, lateness_ms=0, late_retention_ms=5000, watermark_quorum=1, elapsed_ms=E)


def cfg(policy: str) -> JoinConfig:
    return dataclasses.replace(BASE, policy=policy)


def imp(i: str, ts: int) -> Impression:
    return Impression(i, ts, "u", "x", {"device": "ios"}, {})


def out(samples: list[Sample]) -> list[tuple[str, int, int]]:
    return [(s.pending.impression_id, s.label, s.kind) for s in samples]


def step(j: PartitionJoin, offs: list[int], imps=(), clicks=(), drain: bool = False) -> list[tuple[str, int, int]]:
    """Apply impressions and clicks with offsets numbered per topic (``offs`` = [imp, click] last offsets)."""
    ii = []
    for e in imps:
        offs[0] += 1
        ii.append((offs[0], e))
    cc = []
    for e in clicks:
        offs[1] += 1
        cc.append((offs[1], e))
    return out(j.apply(ii, cc, drain=drain).samples)


def test_window_emits_every_sample_at_window_close_with_its_final_label() -> None:
    j, o = PartitionJoin(0, cfg("window")), [-1, -1]
    assert step(j, o, [imp("a", 100), imp("b", 100)], [Click("a", 300)]) == []  # the click makes no sample yet
    assert sorted(step(j, o, [imp("c", 1200)], [Click("z", 1200)])) == [("a", 1, FINAL), ("b", 0, FINAL)]


def test_fake_negative_emits_a_negative_at_once_and_the_positive_again_at_its_click() -> None:
    j, o = PartitionJoin(0, cfg("fake_negative")), [-1, -1]
    assert step(j, o, [imp("a", 100), imp("b", 100)]) == [("a", 0, OBSERVED), ("b", 0, OBSERVED)]
    assert step(j, o, [], [Click("a", 900)]) == [("a", 1, DELAYED_POSITIVE)]
    assert step(j, o, [imp("c", 1200)], [Click("z", 1200)]) == [("c", 0, OBSERVED)]  # a, b expire: nothing more
    assert step(j, o, [], [Click("b", 1300)]) == []  # late: reported, no sample
    assert "b" not in j.pending and j.finalized["b"] == (100, 0)


def test_fake_negative_with_a_click_before_its_impression_still_emits_the_negative_first() -> None:
    j, o = PartitionJoin(0, cfg("fake_negative")), [-1, -1]
    assert step(j, o, [], [Click("a", 150)]) == []
    assert step(j, o, [imp("a", 100)]) == [("a", 0, OBSERVED), ("a", 1, DELAYED_POSITIVE)]


def test_es_dfm_waits_elapsed_then_emits_what_it_saw_and_a_later_click_as_a_delayed_positive() -> None:
    j, o = PartitionJoin(0, cfg("es_dfm")), [-1, -1]
    assert step(j, o, [imp("a", 100), imp("b", 100), imp("c", 100)], [Click("a", 150)]) == [("a", 1, OBSERVED)]
    assert step(j, o, [imp("d", 350)], [Click("z", 350)]) == [("b", 0, OBSERVED), ("c", 0, OBSERVED)]
    assert step(j, o, [], [Click("b", 800)]) == [("b", 1, DELAYED_POSITIVE)]
    assert sorted(step(j, o, [imp("e", 1500)], [Click("y", 1500)])) == [("d", 0, OBSERVED)]  # a, b, c expire


def test_es_dfm_decides_by_the_click_delay_not_by_the_batch_that_sees_it() -> None:
    j, o = PartitionJoin(0, cfg("es_dfm")), [-1, -1]
    # one batch holds the impressions and their clicks: "a" clicked within the elapsed time, "b" after it
    assert step(j, o, [imp("a", 100), imp("b", 100)], [Click("a", 250), Click("b", 450)]) == [
        ("a", 1, OBSERVED), ("b", 0, OBSERVED), ("b", 1, DELAYED_POSITIVE)]


def test_es_dfm_an_impression_evicted_before_its_elapsed_time_gets_a_final_negative() -> None:
    c = dataclasses.replace(cfg("es_dfm"), max_pending=1)
    j, o = PartitionJoin(0, c), [-1, -1]
    assert step(j, o, [imp("a", 100), imp("b", 110)]) == [("a", 0, FINAL)]  # "a" evicted by the cap


def test_es_dfm_needs_an_elapsed_time_inside_the_window() -> None:
    with pytest.raises(ValueError, match="elapsed_ms"):
        dataclasses.replace(BASE, policy="es_dfm", elapsed_ms=W + 1)
    with pytest.raises(ValueError, match="policy"):
        dataclasses.replace(BASE, policy="sometimes")


def random_stream(seed: int, n: int = 300) -> list[tuple[list[Impression], list[Click]]]:
    """Batches of impressions and clicks in roughly event-time order: clicks up to 1.5 windows late, some before
    their impression arrives, some duplicated."""
    rnd = random.Random(seed)
    events: list[tuple[int, int, object]] = []
    for k in range(n):
        ts = k * 7
        events.append((ts, 0, imp(f"i{k}", ts)))
        if rnd.random() < 0.4:
            cts = ts + int(rnd.expovariate(1 / 250))
            for _ in range(1 + (rnd.random() < 0.1)):
                events.append((cts + rnd.randint(-30, 30), 1, Click(f"i{k}", cts)))
    events.sort(key=lambda e: (e[0], e[1]))
    batches, cur = [], ([], [])
    for _, kind, ev in events:
        cur[kind].append(ev)
        if rnd.random() < 0.08:
            batches.append(cur)
            cur = ([], [])
    batches.append(cur)
    return batches


def run(policy: str, batches, restore_at: int | None = None, base: JoinConfig = BASE) -> list[tuple[str, int, int]]:
    """Every sample of ``batches`` then a drain; with ``restore_at``, the partition is rebuilt from its state log
    (encoded and decoded, retired chunks dropped) before that batch."""
    c = dataclasses.replace(base, policy=policy)
    j, o, emitted, log = PartitionJoin(0, c), [-1, -1], [], {}
    for k, (imps, clicks) in enumerate(batches):
        if k == restore_at:
            j = PartitionJoin.restore(0, c, [decode_chunk(encode_chunk(ch)) for ch in log.values()])
        ii = [(o[0] + 1 + n, e) for n, e in enumerate(imps)]
        cc = [(o[1] + 1 + n, e) for n, e in enumerate(clicks)]
        o[0] += len(imps)
        o[1] += len(clicks)
        r = j.apply(ii, cc, drain=k == len(batches) - 1)
        emitted += out(r.samples)
        if r.chunk is not None:
            log[r.chunk.seq] = r.chunk
        for seq in r.retired:
            log.pop(seq, None)
    return emitted


def final_view(emitted: list[tuple[str, int, int]]) -> dict[str, int]:
    """The label each impression ends with: a delayed positive overrides its observed 0."""
    labels: dict[str, int] = {}
    for imp_id, label, kind in emitted:
        labels[imp_id] = max(labels.get(imp_id, 0), label) if kind == DELAYED_POSITIVE else label
    return labels


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("policy", POLICIES)
def test_every_policy_ends_each_impression_with_the_wait_label_and_one_sample_per_kind(policy: str,
                                                                                   seed: int) -> None:
    batches = random_stream(seed)
    emitted = run(policy, batches)
    assert final_view(emitted) == final_view(run("wait", batches))
    assert len(set((i, k) for i, _, k in emitted)) == len(emitted)  # (impression_id, kind) is unique
    kinds = {k for _, _, k in emitted}
    assert kinds <= ({FINAL} if policy in ("wait", "window") else {FINAL, OBSERVED, DELAYED_POSITIVE})
    per_imp: dict[str, list[int]] = {}
    for i, _, k in emitted:
        per_imp.setdefault(i, []).append(k)
    # one sample, or an observed one then its delayed positive
    assert all(ks in ([FINAL], [OBSERVED], [OBSERVED, DELAYED_POSITIVE]) for ks in per_imp.values()), per_imp


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("policy", POLICIES)
def test_a_partition_restored_mid_stream_emits_what_an_uninterrupted_one_does(policy: str, seed: int) -> None:
    batches = random_stream(seed)
    whole = run(policy, batches)
    for at in (len(batches) // 3, len(batches) // 2, 2 * len(batches) // 3):
        assert sorted(run(policy, batches, restore_at=at)) == sorted(whole), at


def test_final_view_keeps_each_impressions_first_sample_with_the_label_it_ends_with() -> None:
    import numpy as np

    from stream.samples import final_view

    ids = np.array(["a", "b", "c", "a", "d"], object)
    labels = np.array([0, 0, 1, 1, 0])
    kinds = np.array([OBSERVED, OBSERVED, OBSERVED, DELAYED_POSITIVE, FINAL], np.int8)
    keep, final = final_view(ids, labels, kinds)
    assert keep.tolist() == [True, True, True, False, True]
    assert final[keep].tolist() == [1, 0, 1, 0]


@pytest.mark.parametrize("policy", POLICIES)
def test_a_restore_keeps_each_inputs_quorum_so_a_click_late_before_the_restart_stays_late(policy: str) -> None:
    # quorum 2: the inputs' times are their 2nd largest. After batch 1 the impressions' top two are (500, 1500) and the
    # clicks' (600, 1400); batch 2 moves both to 1100, so "a" (window closes at 1000) expires, and its click at 900 in
    # batch 3 is late. A restore before batch 2 that took each input's top two as (500, 500) and (600, 600) kept the
    # watermark at 500: "a" was still open and its late click made it a positive.
    base = dataclasses.replace(BASE, watermark_quorum=2)
    batches = [([imp("a", 0), imp("b", 500), imp("c", 1500)], [Click("x", 600), Click("y", 1400)]),
               ([imp("d", 1100)], [Click("z", 1100)]), ([], [Click("a", 900)]), ([], [])]
    whole = run(policy, batches, base=base)
    assert final_view(whole)["a"] == 0
    for at in (1, 2):
        assert sorted(run(policy, batches, restore_at=at, base=base)) == sorted(whole), at


@pytest.mark.parametrize("policy", POLICIES)
def test_a_restore_keeps_an_impression_whose_id_came_again_after_the_first_was_forgotten(policy: str) -> None:
    # "a"@0 closes past 1000 and is forgotten past 6000 (window + late retention); "a" again @6500 is a new impression,
    # clicked @7000. The chunk that added the first "a" is still live (it also added "b"@3000): a restore replayed
    # the first one's expiry timer (1000) onto the second, which closed at once as a negative, and its click was lost.
    batches = [([imp("a", 0), imp("b", 3000)], [Click("z", 3000)]), ([imp("c", 6001)], [Click("y", 6001)]),
               ([imp("a", 6500)], [Click("x", 6500)]), ([], [Click("a", 7000)]), ([], [])]
    whole = run(policy, batches)
    assert sorted(whole).count(("a", 1, DELAYED_POSITIVE if policy in ("fake_negative", "es_dfm") else FINAL)) == 1
    assert sorted(run(policy, batches, restore_at=3)) == sorted(whole)


@pytest.mark.parametrize("policy", POLICIES)
def test_a_restore_keeps_a_click_waiting_for_an_id_that_comes_again_after_the_first_was_forgotten(policy: str) -> None:
    # "a"@0 is forgotten past 6000 (window + late retention) while the chunk that added it stays live ("b"@3000). A
    # click for "a" @6500 then waits for its impression, which comes @6400 in the next batch and joins it. A restore
    # before that batch held the forgotten "a" as pending, took the waiting click for one "joined there or late",
    # dropped it, and the second "a" ended a negative.
    batches = [([imp("a", 0), imp("b", 3000)], [Click("z", 3000)]), ([imp("c", 6001)], [Click("y", 6001)]),
               ([], [Click("a", 6500)]), ([imp("a", 6400)], [Click("x", 6400)]), ([], [])]
    whole = run(policy, batches)
    assert final_view(whole)["a"] == 1
    assert sorted(run(policy, batches, restore_at=3)) == sorted(whole)


def test_a_restore_from_a_new_chunk_then_an_old_codes_chunk_keeps_each_input_at_least_at_its_restored_time() -> None:
    # A rolling upgrade: a new owner wrote chunk 0 (its quorum kept), an old one chunk 1 (no topic_top; the impressions
    # at 5000). The restore took chunk 0's quorum (0, 100) as the impressions' time though chunk 1 had moved it to 5000:
    # reached() (backpressure's measure) said 0, below the restored time, where an uninterrupted run says 5000.
    c = dataclasses.replace(BASE, watermark_quorum=2)
    j = PartitionJoin(0, c)
    first = j.apply([(0, imp("a", 0)), (1, imp("b", 100))], []).chunk
    second = j.apply([(2, imp("c", 5000)), (3, imp("d", 6000))], []).chunk
    assert first is not None and second is not None and j.reached(0, []) == 5000
    old = dataclasses.replace(second, topic_top=([], []))
    restored = PartitionJoin.restore(0, c, [decode_chunk(encode_chunk(ch)) for ch in (first, old)])
    assert restored.topic_max[0] == 5000 and restored.reached(0, []) == 5000
    assert restored.within(0, [7000], 4000) == 0  # both held times are past 4000: one more passes it
