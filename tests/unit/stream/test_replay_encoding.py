"""The publisher's column-wise event bytes (``stream/replay/encoding.py``) are, event for event, the bytes of
``stream/events.py``'s own encoder (``Impression.encode`` / ``Click.encode``) for the event the table defines:
on MovieLens and synthetic slices, on a table of odd values (unicode, characters JSON escapes, the largest and
smallest ids, mixed id types, floats, empty and overlapping context parts), whichever rows are asked for and in
the replay order the publisher sends, raw messages included."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from stream.events import Click, Impression, decode_click, decode_impression
from stream.replay.config import ClickDelay, SyntheticSettings
from stream.replay.encoding import EventEncoder, click_bytes, impression_bytes, to_bytes
from stream.replay.movielens import load_movielens
from stream.replay.publisher import _RAW, _chunk_values, replay_order
from stream.replay.synthetic import build_synthetic
from stream.replay.table import CLICK, IMPRESSION, ContextPart, EventTable, RawMessage


def reference_impressions(t: EventTable) -> list[Impression]:
    """The impressions the table defines: context = its parts' dicts merged in part order (later parts win)."""
    out = []
    dense = {name: col.tolist() for name, col in t.dense.items()}
    for i, (imp_id, ts, user, item) in enumerate(zip(t.impression_id.tolist(), t.ts.tolist(), t.user_id.tolist(),
                                                     t.item_id.tolist(), strict=True)):
        ctx: dict[str, Any] = {}
        for part in t.context:
            ctx.update(part.dicts[int(part.index[i])])
        out.append(Impression(imp_id, ts, user, item, ctx, {name: col[i] for name, col in dense.items()}))
    return out


def reference_clicks(t: EventTable) -> list[Click]:
    return [Click(c, ts) for c, ts in zip(t.click_impression_id.tolist(), t.click_ts.tolist(), strict=True)]


def assert_same_bytes(t: EventTable, *, decodes: bool = True) -> None:
    imps, clicks = reference_impressions(t), reference_clicks(t)
    got_imps, got_clicks = impression_bytes(t), click_bytes(t)
    assert len(got_imps) == len(imps) and len(got_clicks) == len(clicks)
    for k, (want, got) in enumerate(zip(imps, got_imps, strict=True)):
        assert got == want.encode(), (k, got, want.encode())
        if decodes:
            assert decode_impression(got) == want
    for want_c, got in zip(clicks, got_clicks, strict=True):
        assert got == want_c.encode()
        if decodes:
            assert decode_click(got) == want_c


def objects(values: list[Any]) -> np.ndarray:
    out = np.empty(len(values), dtype=object)
    out[:] = values
    return out


def odd_table(first_part_dicts: list[dict[str, Any]], later_dicts: list[dict[str, Any]] | None = None,
              dense: bool = True) -> EventTable:
    """Six impressions and three clicks with every odd value the schema allows."""
    ids = objects(["plain", 'quo"te', "back\\slash", "ctl\x01\x1f\n\t", "unicodé 中文 🎬 \u2028\x7f", "x" * 256])
    n = len(ids)
    users = objects([0, 2**63 - 1, "u", "ünï", 'a"b', 7])  # ints and strings in one column
    items = np.array([0, 1, 2**40, 9_007_199_254_740_993, 2**63 - 1, 5], dtype=np.int64)
    context = [ContextPart(np.arange(n, dtype=np.int64) % len(first_part_dicts), first_part_dicts)]
    if later_dicts is not None:
        context.append(ContextPart(np.arange(n, dtype=np.int64)[::-1] % len(later_dicts), later_dicts))
    return EventTable(
        impression_id=ids,
        ts=np.array([0, 1, 978_300_760_000, 4_102_444_800_000, 5, 6], dtype=np.int64),
        user_id=users,
        item_id=items,
        context=context,
        dense={"price": np.array([0.1, 1e16, -0.0, 3.0, 1e-7, -123456789.125]),
               "n\u00e9": np.array([1.0, 2.5, 0.0, -1.0, 1.8e19, 7.0])} if dense else {},  # 1.8e19: near 2**64
        click_impression_id=ids[[1, 3, 4]],
        click_ts=np.array([2, 978_300_760_001, 6], dtype=np.int64),
    )


ODD_DICTS: list[dict[str, Any]] = [
    {"title": "Amélie (2001)", "genres": ["Comedy", 'Rom"ance', "\\"], "neg": -5, "zero": 0, "flag": True},
    {"title": 'say "hi"\n', "big": -(2**63), "f": 0.5, "off": False, "ids": [2**63 - 1, -1, 0]},
    {"emoji": "🎬", "sep": "\u2028", "empty": "", "colon": ": x"},
]


def test_movielens_slices_encode_to_the_event_encoders_bytes() -> None:
    for name in ("ml-100k", "ml-1m"):
        assert_same_bytes(load_movielens(name, ClickDelay(), seed=1, limit=3000))


def test_synthetic_table_with_context_parts_encodes_to_the_event_encoders_bytes() -> None:
    t = build_synthetic(SyntheticSettings(impressions=3000, malformed_share=0.01), ClickDelay(), seed=5)
    assert len(t.context) == 2 and t.raw  # device/hour and tags parts; malformed messages ride along
    assert_same_bytes(t)


@pytest.mark.parametrize("case", ["all_full", "first_part_sometimes_empty", "later_part_sometimes_empty",
                                  "one_part", "overlapping_keys", "no_dense", "all_empty"])
def test_odd_values_encode_to_the_event_encoders_bytes(case: str) -> None:
    later = [{"request_time": 0}, {"request_time": 167}, {"later": "é"}]
    t = {
        "all_full": odd_table(ODD_DICTS, later),
        "first_part_sometimes_empty": odd_table([{}, *ODD_DICTS], later),
        "later_part_sometimes_empty": odd_table(ODD_DICTS, [{}, *later]),
        "one_part": odd_table([{}, *ODD_DICTS]),
        # a later part that repeats a key of the first overrides its value, in the first one's place
        "overlapping_keys": odd_table(ODD_DICTS, [{"title": "over"}, {"f": 2}, {}]),
        "no_dense": odd_table(ODD_DICTS, later, dense=False),
        "all_empty": odd_table([{}], [{}]),
    }[case]
    assert_same_bytes(t)


def test_values_the_decoder_rejects_are_still_encoded_as_orjson_writes_them() -> None:
    """The encoder does not validate (the sources do): out-of-range ids and floats keep orjson's form."""
    t = odd_table(ODD_DICTS, dense=False)
    t.user_id = objects([-1, 2**64 - 1, 1.5, True, "", None])
    t.dense = {"nan": np.array([np.nan, np.inf, -np.inf, 1e300, 0.0, 1.0])}
    assert_same_bytes(t, decodes=False)


def test_any_subset_of_rows_in_any_order_encodes_like_the_whole_table() -> None:
    t = odd_table([{}, *ODD_DICTS], [{"request_time": 3}, {}])
    whole_imps, whole_clicks = impression_bytes(t), click_bytes(t)
    enc = EventEncoder(t)
    rng = np.random.default_rng(0)
    for rows in ([np.arange(2, 5)], [np.array([4, 1, 1, 0])], [rng.permutation(6)], [np.array([], np.int64)]):
        r = rows[0].astype(np.int64)
        assert to_bytes(enc.impressions(r)) == [whole_imps[i] for i in r.tolist()]
    assert to_bytes(enc.clicks(np.array([2, 0], np.int64))) == [whole_clicks[2], whole_clicks[0]]


def test_chunks_of_the_replay_order_hold_each_events_bytes_raw_messages_included() -> None:
    t = build_synthetic(SyntheticSettings(impressions=2000, malformed_share=0.02), ClickDelay(), seed=9)
    t.raw.append(RawMessage(topic_kind=CLICK, ts=int(t.ts[10]), key=None, value=None))  # a tombstone
    kinds, indexes = replay_order(t)
    imps, clicks = impression_bytes(t), click_bytes(t)
    want = [imps[i] if k == IMPRESSION else clicks[i] if k == CLICK else t.raw[i].value
            for k, i in zip(kinds.tolist(), indexes.tolist(), strict=True)]
    assert (kinds == _RAW).sum() == len(t.raw) > 1
    enc = EventEncoder(t)
    got: list[bytes | None] = []
    for start in range(0, len(kinds), 700):
        values, over = _chunk_values(enc, t.raw, kinds[start:start + 700], indexes[start:start + 700],
                                     {IMPRESSION: 1 << 20, CLICK: 1 << 20})
        assert over is None
        got += values
    assert got == want
