"""An event whose Kafka key is set and is not its impression_id breaks co-partitioning (both topics are keyed by
impression_id): it is dead-lettered as ``key_mismatch`` by the per-event decoders and the column decoder alike."""

from __future__ import annotations

import orjson
import pytest

import stream.event_batch as event_batch
from stream.errors import BadMessage
from stream.event_batch import decode_events
from stream.events import Click, Impression, decode_click, decode_impression
from stream.limits import DEFAULT_LIMITS


def imp(i: int) -> bytes:
    return Impression(f"i{i}", 1_000 + i, i % 7, f"item{i % 5}", {"device": "ios"}).encode()


def clk(i: int) -> bytes:
    return Click(f"i{i}", 2_000 + i).encode()


def one_by_one(values: list, keys: list, clicks: bool) -> list:
    decode = decode_click if clicks else decode_impression
    out = []
    for raw, key in zip(values, keys, strict=True):
        try:
            out.append(decode(raw, DEFAULT_LIMITS, None, key=key))
        except BadMessage as exc:
            out.append(exc)
    return out


@pytest.mark.parametrize("clicks", [False, True])
def test_a_key_other_than_the_impression_id_is_a_key_mismatch_and_no_key_is_accepted(clicks: bool) -> None:
    decode, raw = (decode_click, clk(3)) if clicks else (decode_impression, imp(3))
    with pytest.raises(BadMessage) as caught:
        decode(raw, key=b"i4")
    assert caught.value.kind == "key_mismatch" and "'i3'" in str(caught.value) and "'i4'" in str(caught.value)
    assert decode(raw, key=b"i3").impression_id == "i3"
    assert decode(raw, key=None).impression_id == "i3"  # an unkeyed producer: accepted (one partition, or round robin)
    assert decode(raw).impression_id == "i3"


@pytest.mark.parametrize("clicks", [False, True])
def test_a_block_with_mismatched_keys_decodes_like_each_message_alone(clicks: bool) -> None:
    make = clk if clicks else imp
    values = [make(i) for i in range(300)]
    keys: list = [f"i{i}".encode() for i in range(300)]
    keys[17] = None
    keys[137] = b"other"
    keys[200] = b"\xff\xfe"  # not UTF-8: not the id either
    keys[250] = "i250".encode("utf-16")
    got = decode_events(values, [None] * 300, clicks, DEFAULT_LIMITS, keys)
    want = one_by_one(values, keys, clicks)
    assert [type(g) for g in got] == [type(w) for w in want]
    assert [(i, g.kind, str(g)) for i, g in enumerate(got) if isinstance(g, BadMessage)] == \
        [(i, w.kind, str(w)) for i, w in enumerate(want) if isinstance(w, BadMessage)]
    assert {i for i, g in enumerate(got) if isinstance(g, BadMessage)} == {137, 200, 250}
    assert all(g.kind == "key_mismatch" for g in got if isinstance(g, BadMessage))


def test_a_keyed_clean_block_never_takes_the_per_event_decoder(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*_: object, **__: object) -> None:
        raise AssertionError("decoded row by row")

    values = [imp(i) for i in range(500)]
    keys = [f"i{i}".encode() if i % 3 else None for i in range(500)]
    want = one_by_one(values, keys, False)
    monkeypatch.setattr(event_batch, "decode_impression", refuse)
    got = decode_events(values, [None] * 500, False, DEFAULT_LIMITS, keys)
    assert got == want


def test_a_bad_body_keeps_its_own_reason_whatever_its_key() -> None:
    bad = orjson.dumps({"schema_version": 1, "impression_id": "x", "ts": -5, "user_id": 1, "item_id": 2})
    got = decode_events([imp(0), bad, imp(2)], [None] * 3, False, DEFAULT_LIMITS, [b"i0", b"wrong", b"i2"])
    assert isinstance(got[1], BadMessage) and got[1].kind == "invalid_field"
