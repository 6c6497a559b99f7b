"""The synthetic source: determinism, id distribution, planted model, click faults, malformed messages."""

from __future__ import annotations

import math
import tracemalloc
from collections import Counter

import numpy as np
import pytest

from stream.errors import BadMessage, ConfigError
from stream.events import Click, Impression, decode_click, decode_impression
from stream.replay.config import ClickDelay, DelayKind, SyntheticSettings
from stream.replay.synthetic import (
    MALFORMED_KINDS,
    NEW_USER_BASE,
    _rank_to_id,
    build_synthetic,
    oracle_probability,
    rank_auc,
)
from stream.replay.table import CLICK, IMPRESSION, EventTable

N = 20_000
SEED = 11
SETTINGS = SyntheticSettings(
    impressions=N,
    users=1_000_000,
    items=50_000,
    new_user_share=0.05,
    late_click_share=0.05,
    duplicate_click_share=0.05,
    orphan_click_share=0.02,
    malformed_share=0.01,
)
DELAY = ClickDelay(DelayKind.LOGNORMAL, 30.0, 1.0)


@pytest.fixture(scope="module")
def table() -> EventTable:
    return build_synthetic(SETTINGS, DELAY, SEED)


def _context_rows(t: EventTable, rows: np.ndarray) -> list[dict]:
    out = []
    for i in rows:
        ctx: dict = {}
        for part in t.context:
            ctx.update(part.dicts[part.index[i]])
        out.append(ctx)
    return out


def _labels(t: EventTable) -> np.ndarray:
    shown = set(t.impression_id.tolist())
    clicked = {c for c in t.click_impression_id.tolist() if c in shown}
    return np.array([i in clicked for i in t.impression_id.tolist()])


def _top_share(ids: np.ndarray, fraction: float = 0.01) -> float:
    counts = np.sort(np.unique(ids, return_counts=True)[1])[::-1]
    return counts[: max(1, math.ceil(fraction * len(counts)))].sum() / len(ids)


# --- determinism ------------------------------------------------------------------------------------


def _same(a: EventTable, b: EventTable) -> bool:
    cols = ("impression_id", "ts", "user_id", "item_id", "click_impression_id", "click_ts")
    if not all(np.array_equal(getattr(a, c), getattr(b, c)) for c in cols):
        return False
    if len(a.context) != len(b.context) or any(
        not np.array_equal(p.index, q.index) or p.dicts != q.dicts
        for p, q in zip(a.context, b.context, strict=True)
    ):
        return False
    return a.raw == b.raw and repr(a.stats) == repr(b.stats)


def test_same_seed_same_table_other_seed_differs(table: EventTable) -> None:
    again = build_synthetic(SETTINGS, DELAY, SEED)
    assert _same(table, again)
    other = build_synthetic(SETTINGS, DELAY, SEED + 1)
    assert not np.array_equal(table.user_id, other.user_id)
    assert not np.array_equal(table.ts, other.ts)
    assert other.impression_id[0] == f"syn{SEED + 1}-000000000"


def test_global_rng_untouched() -> None:
    np.random.seed(0)
    expected = np.random.random(3)
    np.random.seed(0)
    build_synthetic(SETTINGS, DELAY, SEED, limit=1000)
    assert np.array_equal(np.random.random(3), expected)


def test_limit_and_shapes(table: EventTable) -> None:
    assert table.n_impressions == N
    small = build_synthetic(SETTINGS, DELAY, SEED, limit=500)
    assert small.n_impressions == 500 and small.stats["impressions"] == 500
    assert build_synthetic(SETTINGS, DELAY, SEED, limit=10 * N).n_impressions == N
    empty = build_synthetic(SETTINGS, DELAY, SEED, limit=0)
    assert empty.n_impressions == 0 and empty.n_clicks == 0
    for part in table.context:
        assert part.index.shape == (N,) and part.index.dtype == np.int64
        assert part.index.min() >= 0 and part.index.max() < len(part.dicts)
    assert table.ts.dtype == np.int64 and table.click_ts.dtype == np.int64


def test_bad_settings_rejected() -> None:
    with pytest.raises(ValueError, match="malformed_share"):
        build_synthetic(SyntheticSettings(impressions=10, malformed_share=1.0), DELAY, 1)
    with pytest.raises(ValueError, match="base_ctr"):
        build_synthetic(SyntheticSettings(impressions=10, base_ctr=0.0), DELAY, 1)


@pytest.mark.parametrize(("flag", "value", "said"), [
    ("--syn-base-ctr", "2", "[synthetic] base_ctr must be in (0, 1), got 2.0"),
    ("--syn-malformed-share", "1", "[synthetic] malformed_share must be in [0, 1), got 1.0"),
    ("--syn-late-click-share", "-0.5", "[synthetic] late_click_share must be in [0, 1], got -0.5"),
    ("--syn-impressions-per-s", "1e-300", "run past 4102444800000 (2100-01-01)"),
    ("--syn-start-ts-ms", "5000000000000", "run past 4102444800000 (2100-01-01)"),
    ("--syn-start-ts-ms", "9999999999999999", "[synthetic] start_ts_ms must be an integer >= 0 and <= "
                                              "253402300799999, got 9999999999999999 (set by --syn-start-ts-ms)"),
    ("--syn-attribution-window-s", "1e8", "[synthetic] attribution_window_s must be > 0 and at most 3.1536e+07"),
    ("--syn-attribution-window-s", "1e300", "[synthetic] attribution_window_s must be a finite number of seconds > 0 "
                                            "and <= 3.15576e+08, got 1e+300 (set by --syn-attribution-window-s)"),
])
def test_synthetic_settings_the_generator_cannot_use_are_one_error_line_and_exit_2(
        flag: str, value: str, said: str, capsys: pytest.CaptureFixture[str]) -> None:
    """A share or CTR out of range ended streamrec replay in a ValueError traceback (exit 1); event times past 2100
    were generated and published (each one an event the decoder refuses), and a tiny impressions_per_s wrapped the
    int64 times negative. Now one error line naming the setting, exit 2, before any broker is contacted."""
    from streamrec.cli import main

    rc = main(["replay", "--dataset", "synthetic", "--syn-impressions", "50", flag, value, "--no-progress",
               "--bootstrap-servers", "127.0.0.1:9"])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert said in err and "Traceback" not in err and err.count("\n") == 1, err


@pytest.mark.parametrize(("name", "value"), [
    ("latent_dim", 1025), ("signal", float("inf")), ("signal", float("nan")), ("attribution_window_s", 1e13),
    ("attribution_window_s", 1e300), ("new_user_session_s", 1e300),
])
def test_synthetic_settings_beyond_any_use_are_refused_naming_them(name: str, value: float) -> None:
    """latent_dim is one pass over every impression per dimension (10**9 ran for ever); an infinite signal made every
    click probability 0 or 1 (NaN at a zero dot product); a window of 1e13 s put late clicks past 2100 (1e300: a
    traceback), a session of 1e300 s new users' impressions likewise."""
    with pytest.raises(ConfigError, match=rf"\[synthetic\] {name} must be"):
        build_synthetic(SyntheticSettings(impressions=50, users=100, items=10, **{name: value}), DELAY, 1)  # type: ignore[arg-type]


# --- ids, time, context ------------------------------------------------------------------------------


def test_impression_ids_and_event_time(table: EventTable) -> None:
    assert table.impression_id[0] == f"syn{SEED}-000000000"
    assert table.impression_id[12345] == f"syn{SEED}-000012345"
    assert len(set(table.impression_id.tolist())) == N
    assert table.ts[0] == SETTINGS.start_ts_ms
    gaps = np.diff(table.ts)
    assert (gaps >= 0).all()
    mean_gap_ms = gaps.mean()
    assert abs(mean_gap_ms - 1000.0 / SETTINGS.impressions_per_s) < 0.1 * 1000.0 / SETTINGS.impressions_per_s
    # exponential gaps: std close to the mean
    assert 0.8 < gaps.std() / mean_gap_ms < 1.2


def test_context_values(table: EventTable) -> None:
    rows = np.arange(0, N, 97)
    for i, ctx in zip(rows, _context_rows(table, rows), strict=True):
        assert ctx["device"] in ("ios", "android", "web")
        assert ctx["hour"] == (int(table.ts[i]) // 3_600_000) % 24
        assert 1 <= len(ctx["tags"]) <= 3 and all(isinstance(x, int) and 0 <= x < 10 for x in ctx["tags"])
    devices = Counter(c["device"] for c in _context_rows(table, np.arange(N)))
    assert len(devices) == 3


def test_zipf_skew() -> None:
    t = build_synthetic(SETTINGS, DELAY, SEED)
    returning = t.user_id[t.user_id < NEW_USER_BASE]
    assert _top_share(returning) > 0.3
    assert _top_share(t.item_id) > 0.3
    uniform = build_synthetic(
        SyntheticSettings(impressions=N, users=1_000_000, items=50_000, zipf_exponent=0.0), DELAY, SEED
    )
    assert _top_share(uniform.user_id[uniform.user_id < NEW_USER_BASE]) < 0.05
    # exponent 1 takes its own branch of the inverse CDF
    one = build_synthetic(SyntheticSettings(impressions=N, zipf_exponent=1.0), DELAY, SEED)
    assert _top_share(one.item_id) > 0.3
    # popular ids are spread over the 62-bit range, not small numbers
    assert returning.min() >= 0 and returning.max() < NEW_USER_BASE
    assert np.median(returning) > 2**58


def test_rank_to_id_is_injective() -> None:
    ranks = np.arange(1, 200_001, dtype=np.int64)
    ids = _rank_to_id(ranks, SEED, 1)
    assert len(np.unique(ids)) == len(ranks)
    assert ids.min() >= 0 and ids.max() < NEW_USER_BASE
    assert not np.array_equal(ids, _rank_to_id(ranks, SEED + 1, 1))


def test_huge_user_cardinality_is_cheap() -> None:
    s = SyntheticSettings(impressions=50_000, users=100_000_000, items=10_000_000)
    tracemalloc.start()
    try:
        t = build_synthetic(s, DELAY, SEED)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert t.n_impressions == 50_000
    assert peak < 100 * 2**20, f"peak {peak / 2**20:.0f} MiB: something scales with users"
    assert t.stats["users_cardinality"] == 100_000_000
    assert t.stats["returning_users_distinct"] > 10_000


def test_new_users_disjoint_and_counted(table: EventTable) -> None:
    is_new = table.user_id >= NEW_USER_BASE
    assert int(is_new.sum()) == table.stats["new_user_impressions"] == round(SETTINGS.new_user_share * N)
    new_ids = table.user_id[is_new]
    assert len(np.unique(new_ids)) == table.stats["new_users"]
    assert set(np.unique(new_ids).tolist()) == {NEW_USER_BASE + k for k in range(table.stats["new_users"])}
    assert (table.user_id[~is_new] < NEW_USER_BASE).all()
    assert (table.user_id < 2**63 - 1).all()
    # each new user's impressions are one burst of 1-5 consecutive rows
    for uid in np.unique(new_ids)[:200]:
        rows = np.flatnonzero(table.user_id == uid)
        assert 1 <= len(rows) <= 5
        assert (np.diff(rows) == 1).all()
    returning = table.user_id[~is_new]
    assert table.stats["users_distinct"] == len(np.unique(returning)) + table.stats["new_users"]
    assert table.stats["items_distinct"] == len(np.unique(table.item_id))


# --- planted model -------------------------------------------------------------------------------------


def _auc_by_search(scores: np.ndarray, labels: np.ndarray) -> float:
    """P(score of a positive > score of a negative), ties count half: a different route than ranks."""
    neg = np.sort(scores[~labels])
    pos = scores[labels]
    below = np.searchsorted(neg, pos, side="left")
    equal = np.searchsorted(neg, pos, side="right") - below
    return float((below + 0.5 * equal).sum() / (len(pos) * len(neg)))


def test_rank_auc_with_ties() -> None:
    rng = np.random.default_rng(0)
    scores = rng.integers(0, 5, size=300).astype(float)
    labels = rng.random(300) < 0.3
    brute = np.mean([(p > q) + 0.5 * (p == q) for p in scores[labels] for q in scores[~labels]])
    assert rank_auc(scores, labels) == pytest.approx(brute, abs=1e-12)
    assert math.isnan(rank_auc(scores, np.zeros(300, dtype=bool)))


def test_oracle_auc_and_planted_ctr(table: EventTable) -> None:
    labels = _labels(table)
    p = oracle_probability(table, SETTINGS, SEED)
    assert p.shape == (N,) and ((p > 0) & (p < 1)).all()
    assert table.stats["positives"] == int(labels.sum())
    assert table.stats["planted_ctr"] == pytest.approx(labels.mean())
    assert table.stats["planted_ctr"] == pytest.approx(SETTINGS.base_ctr, abs=0.01)
    assert p.mean() == pytest.approx(SETTINGS.base_ctr, abs=0.005)
    auc = table.stats["oracle_auc"]
    assert auc == pytest.approx(_auc_by_search(p, labels), abs=1e-9)
    assert auc > 0.75
    # a weaker signal plants a weaker model
    weak = SyntheticSettings(**{**SETTINGS.__dict__, "signal": 0.0})
    assert build_synthetic(weak, DELAY, SEED).stats["oracle_auc"] < auc - 0.05


# --- clicks ----------------------------------------------------------------------------------------------


def test_click_counts_match_the_columns(table: EventTable) -> None:
    st = table.stats
    imp_ts = dict(zip(table.impression_id.tolist(), table.ts.tolist(), strict=True))
    window_ms = SETTINGS.attribution_window_s * 1000.0
    per_impression: dict[str, list[int]] = {}
    orphans = 0
    for iid, ts in zip(table.click_impression_id.tolist(), table.click_ts.tolist(), strict=True):
        if iid in imp_ts:
            per_impression.setdefault(iid, []).append(ts)
        else:
            orphans += 1
            assert iid.startswith(f"syn{SEED}-orphan-")
    first_delay = {iid: min(v) - imp_ts[iid] for iid, v in per_impression.items()}
    assert all(d >= 1 for d in first_delay.values())
    assert st["positives"] == len(per_impression)
    assert st["orphan_clicks"] == orphans == round(SETTINGS.orphan_click_share * st["positives"])
    assert st["duplicate_clicks"] == sum(len(v) - 1 for v in per_impression.values())
    assert st["duplicate_clicks"] == round(SETTINGS.duplicate_click_share * st["positives"])
    assert st["clicks_on_time"] == sum(d <= window_ms for d in first_delay.values())
    assert st["late_clicks"] == sum(d > window_ms for d in first_delay.values())
    assert st["late_clicks"] >= round(SETTINGS.late_click_share * st["positives"])
    assert st["clicks_on_time"] + st["late_clicks"] == st["positives"]
    assert st["clicks"] == table.n_clicks == st["positives"] + st["duplicate_clicks"] + orphans
    # late clicks land in (window, 2 * window]; duplicates a few seconds after the original
    assert max(first_delay.values()) <= 2 * window_ms
    for v in per_impression.values():
        if len(v) > 1:
            assert 1_000 <= max(v) - min(v) <= 10_000


# --- wire format ---------------------------------------------------------------------------------------


def test_malformed_messages_are_all_rejected(table: EventTable) -> None:
    st = table.stats
    valid = table.n_impressions + table.n_clicks
    assert st["malformed"] == len(table.raw) > 0
    assert st["malformed"] / (valid + st["malformed"]) == pytest.approx(SETTINGS.malformed_share, rel=0.01)
    kinds = [k for k, _ in MALFORMED_KINDS]
    assert set(st["malformed_by_kind"]) == set(kinds)
    assert sum(st["malformed_by_kind"].values()) == st["malformed"]
    assert max(st["malformed_by_kind"].values()) - min(st["malformed_by_kind"].values()) <= 1
    lo, hi = int(table.ts.min()), int(table.ts.max())
    for msg in table.raw:
        assert msg.error is None
        assert msg.key is None or isinstance(msg.key, bytes)
        assert isinstance(msg.value, bytes)
        assert lo <= msg.ts <= hi
        decode = decode_impression if msg.topic_kind == IMPRESSION else decode_click
        assert msg.topic_kind in (IMPRESSION, CLICK)
        with pytest.raises(BadMessage):
            decode(msg.value)


def test_each_malformed_kind_once() -> None:
    s = SyntheticSettings(impressions=200, malformed_share=0.2)
    t = build_synthetic(s, DELAY, 3)
    seen = set()
    for k, msg in enumerate(t.raw):
        kind, topic = MALFORMED_KINDS[k % len(MALFORMED_KINDS)]
        assert msg.topic_kind == topic
        decode = decode_impression if topic == IMPRESSION else decode_click
        with pytest.raises(BadMessage):
            decode(msg.value)
        seen.add(kind)
    assert seen == {k for k, _ in MALFORMED_KINDS}


def test_valid_events_round_trip(table: EventTable) -> None:
    rows = np.random.default_rng(1).choice(N, size=300, replace=False)
    for i, ctx in zip(rows, _context_rows(table, rows), strict=True):
        imp = Impression(
            impression_id=table.impression_id[i],
            ts=int(table.ts[i]),
            user_id=int(table.user_id[i]),
            item_id=int(table.item_id[i]),
            context=ctx,
        )
        assert decode_impression(imp.encode()) == imp
    for j in range(0, table.n_clicks, max(1, table.n_clicks // 300)):
        click = Click(impression_id=table.click_impression_id[j], ts=int(table.click_ts[j]))
        assert decode_click(click.encode()) == click


def test_new_users_in_sessions_are_spread_over_their_session_and_still_counted_exactly() -> None:
    from dataclasses import replace

    s = replace(SETTINGS, new_user_impressions=40, new_user_session_s=30.0, malformed_share=0.0)
    t = build_synthetic(s, DELAY, SEED)
    is_new = t.user_id >= NEW_USER_BASE
    assert int(is_new.sum()) == t.stats["new_user_impressions"] == round(s.new_user_share * N)
    assert set(np.unique(t.user_id[is_new]).tolist()) == {NEW_USER_BASE + k for k in range(t.stats["new_users"])}
    spans, interleaved = [], 0
    for uid in np.unique(t.user_id[is_new]):
        rows = np.flatnonzero(t.user_id == uid)
        assert 1 <= len(rows) <= 40
        if len(rows) > 1:
            spans.append((t.ts[rows[-1]] - t.ts[rows[0]]) / 1000.0)
            interleaved += bool((np.diff(rows) > 1).any())
    # a session: within its 30 s (plus the arrival noise of the other users' rows in between)
    assert max(spans) < 45.0 and np.median(spans) > 5.0
    assert interleaved >= 0.9 * len(spans)  # other users' impressions come in between
    with pytest.raises(ValueError, match="new_user_session_s"):
        build_synthetic(replace(s, new_user_session_s=-1.0), DELAY, SEED)
