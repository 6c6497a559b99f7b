"""Every samples message carries its join partition's watermark (``stream/samples.py``, ``WATERMARK_HEADER``): the
last message of a batch the watermark after it, the others the watermark before it (a delayed positive in a later
message of the same batch must not find its impression closed already)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from stream.config import KafkaSettings
from stream.errors import BadMessage
from stream.events import Click, Impression
from stream.joiner.config import JoinerSettings
from stream.joiner.engine import JoinConfig, PartitionJoin
from stream.joiner.pipeline import JoinPipeline, awake_clock
from stream.joiner.totals import JoinTotals
from stream.samples import NO_WATERMARK, WATERMARK_HEADER, SampleBatch, watermark_header, watermark_of

KAFKA = KafkaSettings()


class Sent:
    def __init__(self) -> None:
        self.messages: list[tuple[str, bytes, list[tuple[str, bytes]] | None, int | None]] = []

    def send(self, topic, value, key=None, headers=None, partition=None) -> None:  # noqa: ANN001 - AckedProducer's
        self.messages.append((topic, value, headers, partition))


def _pipeline() -> tuple[JoinPipeline, Sent]:
    """A JoinPipeline with what a batch's join and samples read (no broker, no Redis): partition 3's engine."""
    p = JoinPipeline.__new__(JoinPipeline)
    p.kafka, p.js = KAFKA, JoinerSettings(sample_flush_rows=1)  # one sample a message
    p.engines = {3: PartitionJoin(3, JoinConfig(window_ms=1000, lateness_ms=0, watermark_quorum=1,
                                                policy="fake_negative"))}
    p.totals, p._last_click, p.clicks_held, p.message_limits = JoinTotals(), {}, set(), {}
    p.awake = awake_clock(p.js)
    p.sample_bytes = p.state_bytes = p.late_click_bytes = 1 << 20
    p.producer = sent = Sent()
    p._record_redis = lambda res, imps: None  # type: ignore[method-assign]
    p.day_counts = SimpleNamespace(begin_batch=lambda: None)  # type: ignore[assignment]  # nothing counted here
    p._read_histories = lambda res: None  # type: ignore[method-assign]
    return p, sent


def test_each_samples_message_carries_the_watermark_its_rows_are_complete_to() -> None:
    p, sent = _pipeline()
    p._apply_all([(3, [(0, Impression("a", 0, "u", "i")), (1, Impression("b", 100, "u", "i"))], [])])
    samples = [m for m in sent.messages if m[0] == KAFKA.samples_topic]
    assert [watermark_of(h) for _, _, h, _ in samples] == [NO_WATERMARK, NO_WATERMARK]  # no click seen: none yet
    sent.messages.clear()
    # a's click, and time moving to 2000: b's and a's windows close in this batch; a's delayed positive and c's
    # observed 0 go out in two messages, the first still carrying the watermark before the batch
    p._apply_all([(3, [(2, Impression("c", 2000, "u", "i"))], [(0, Click("a", 900)), (1, Click("zz", 2000))])])
    samples = [m for m in sent.messages if m[0] == KAFKA.samples_topic]
    assert len(samples) == 2 and {part for *_, part in samples} == {3}  # samples partition = join partition
    assert [watermark_of(h) for _, _, h, _ in samples] == [NO_WATERMARK, 1999]  # 2000 has not passed: 1 ms short
    assert [SampleBatch.decode(v).impression_ids for _, v, _, _ in samples] == [["a"], ["c"]]


def test_the_watermark_header_reads_back_and_its_absence_is_none() -> None:
    for wm in (None, -5, 0, 1 << 40):
        assert watermark_of([("other", b"x"), watermark_header(wm)]) == (NO_WATERMARK if wm is None else wm)
    assert watermark_of(None) is None and watermark_of([("other", b"12345678")]) is None
    for bad in ([(WATERMARK_HEADER, b"short")], [(WATERMARK_HEADER, None)], [watermark_header(1), watermark_header(1)]):
        with pytest.raises(BadMessage) as err:  # the joiner writes one of 8 bytes: anything else is dead-lettered
            watermark_of(bad)
        assert err.value.kind == "bad_header"
