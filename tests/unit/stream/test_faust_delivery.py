"""The faust driver's batch delivery (stream/joiner/faust_delivery.py): the offset bookkeeping it does for a whole
fetch at once is the bookkeeping faust's per-message loop does (the integration side: tests/integration/
test_faust_delivery.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from stream.joiner.faust_delivery import _gaps


def faust_drain_gaps(read: int | None, offsets: list[int]) -> list[tuple[int, int]]:
    """faust's ``Consumer._drain_messages``, the gap part: what it passes to ``_add_gap`` message by message."""
    out = []
    for offset in offsets:
        if read is None or offset >= read:
            gap = offset - (read or 0)
            if gap > 1 and read:
                out.append((read + 1, offset))
            read = offset
    return out


@given(st.one_of(st.none(), st.integers(0, 50)), st.lists(st.integers(1, 5), min_size=1, max_size=30),
       st.integers(0, 60))
def test_a_fetch_records_the_gaps_faust_records_one_message_at_a_time(read: int | None, steps: list[int],
                                                                       start: int) -> None:
    # offsets ascending, at or past the read offset (what reaches _gaps after the read-offset filter)
    first = max(start, read or 0)
    offsets = [first + sum(steps[:i]) for i in range(len(steps))]
    recs = [SimpleNamespace(offset=o) for o in offsets]
    assert _gaps(read, offsets[0], offsets[-1], len(offsets), recs) == faust_drain_gaps(read, offsets)


def test_a_contiguous_fetch_after_its_read_offset_has_no_gap_and_one_after_a_hole_has_one() -> None:
    recs = [SimpleNamespace(offset=o) for o in range(10, 15)]
    assert _gaps(9, 10, 14, 5, recs) == []
    assert _gaps(6, 10, 14, 5, recs) == [(7, 10)]  # 7..9 are not in the log (markers, compaction)
    assert _gaps(None, 10, 14, 5, recs) == []  # nothing read yet: faust counts no gap either


def test_a_partition_starting_past_the_brokers_reported_high_watermark_moves_back_once_per_generation() -> None:
    """Tansu reports the start of a partition's last record batch + 1 as its high watermark, and a fetch from inside
    that batch returns nothing: a start at or past it moves back to it - 1 (once per generation and partition)."""
    import asyncio
    import logging

    from faust.types import TP

    from stream.joiner.faust_delivery import BatchConsumer

    stuck, fine, unknown, fed = (TP("impressions", p) for p in range(4))
    highs = {stuck: 10, fine: 10, fed: 3}
    seeks: list[tuple[TP, int]] = []

    def highwater(tp: TP) -> int:
        if tp not in highs:
            raise KeyError(tp)  # not fetched yet
        return highs[tp]

    async def seek(tp: TP, offset: int) -> None:
        seeks.append((tp, offset))

    starts = {stuck: 12, fine: 6, unknown: 50, fed: 7}  # faust's read offsets after its seek to the committed ones
    fake = SimpleNamespace(_resumed=set(), _resumed_generation=-1, _read_offset=starts, _redone={},
                           _get_active_partitions=lambda: [stuck, fine, unknown, fed], highwater=highwater, seek=seek,
                           log=logging.getLogger("test"))
    resume = BatchConsumer._resume_safely
    asyncio.run(resume(fake, 1, {fed: [object()]}))  # type: ignore[arg-type]  # fed brought records: not checked
    assert seeks == [(stuck, 9)]
    highs[unknown] = 40  # fetched now: checked once its high watermark is known
    asyncio.run(resume(fake, 1, {}))  # type: ignore[arg-type]
    assert seeks == [(stuck, 9), (unknown, 39)]
    asyncio.run(resume(fake, 1, {}))  # type: ignore[arg-type]  # the same generation: once
    assert len(seeks) == 2
    asyncio.run(resume(fake, 2, {}))  # type: ignore[arg-type]  # a rebalance: every partition's start again
    assert seeks[2:] == [(stuck, 9), (unknown, 39), (fed, 2)]


def _delivering(process, held):  # noqa: ANN001, ANN202 - a fake BatchConsumer for _deliver / _drop
    """What ``BatchConsumer._deliver`` and ``_drop`` use of the consumer; records acknowledgements, drops, seeks."""
    import logging

    from stream.joiner.faust_delivery import BatchConsumer, BatchDelivery

    done: dict[str, list] = {"acked": [], "dropped": [], "seeks": [], "drops": []}

    async def commit() -> None:
        return None

    async def perform_seek() -> None:
        return None

    async def seek(tp, offset: int) -> None:  # noqa: ANN001
        done["seeks"].append((tp, offset))

    fake = SimpleNamespace(
        delivery=BatchDelivery(process=process, max_records=100, within_s=0.1, short_polls=lambda: False,
                               in_hand=lambda n: None, held=held, dropped=done["dropped"].append),
        _kept={}, _sought={}, _redone={}, _carry=[], _commit_every=None, _n_acked=0, commit=commit,
        _acked={}, _acked_index={}, _gap={},
        perform_seek=perform_seek, seek=seek,
        app=SimpleNamespace(monitor=None), assignment=lambda: set(), _read_offset={}, log=logging.getLogger("test"),
        ack_offsets=lambda tp, offsets: done["acked"].append((tp, list(offsets))))

    async def drop(first: dict, records: int) -> None:
        done["drops"].append((dict(first), records))
        await BatchConsumer._drop(fake, first, records)  # type: ignore[arg-type]

    fake._drop = drop
    fake._set_carry = lambda records: BatchConsumer._set_carry(fake, records)  # type: ignore[arg-type]
    return fake, done


def test_records_the_join_keeps_are_acknowledged_only_once_a_later_batch_processes_them() -> None:
    import asyncio

    from faust.types import TP

    from stream.joiner.faust_delivery import BatchConsumer
    from stream.joiner.records import Record

    tp = TP("impressions", 0)
    turns = iter([({("impressions", 0): 2}, {("impressions", 0): 3}),  # 0, 1 joined; 2-4 held past the frontier
                  ({("impressions", 0): 6}, {("impressions", 0): 1}),  # the held ones and 5 joined; 6 held
                  ({("impressions", 0): 7}, {})])  # nothing new: 6 joined
    held_now: dict = {}

    def process(records: list) -> dict:
        processed, held = next(turns)
        held_now.clear()
        held_now.update(held)
        return processed

    fake, done = _delivering(process, lambda: held_now)

    def deliver(offsets: range) -> None:
        asyncio.run(BatchConsumer._deliver(fake, [Record("impressions", 0, o, None, b"") for o in offsets]))  # type: ignore[arg-type]

    deliver(range(5))
    assert done["acked"] == [(tp, [0, 1])] and fake._kept == {tp: [2, 3, 4]}
    deliver(range(5, 7))
    assert done["acked"][1:] == [(tp, [2, 3, 4, 5])] and fake._kept == {tp: [6]}
    deliver(range(0))  # what _drain_messages offers while records are kept and nothing new came
    assert done["acked"][2:] == [(tp, [6])] and fake._kept == {}
    assert done["drops"] == [] and done["dropped"] == []  # nothing read again


def test_unprocessed_records_the_join_does_not_keep_are_read_again_from_the_first_kept_one() -> None:
    import asyncio

    from faust.types import TP

    from stream.joiner.faust_delivery import BatchConsumer
    from stream.joiner.records import Record

    tp = TP("impressions", 0)
    # 3, 4 kept from before; this batch (5-7) processes nothing and the join says it holds only 2 (not the 5 left)
    fake, done = _delivering(lambda records: {}, lambda: {("impressions", 0): 2})
    fake._kept = {tp: [3, 4]}
    fake.assignment = lambda: {tp}
    fake._read_offset = {tp: None}  # no committed offset: perform_seek leaves it, so the drop seeks it itself
    asyncio.run(BatchConsumer._deliver(fake, [Record("impressions", 0, o, None, b"") for o in (5, 6, 7)]))  # type: ignore[arg-type]
    assert done["acked"] == []
    assert done["seeks"] == [(tp, 3)]  # the first record not acknowledged, the kept ones first
    assert done["dropped"] == [None] and fake._kept == {}  # the join drops what it holds: it is read again


def test_a_revocation_drops_what_the_join_keeps_of_the_revoked_partitions_only() -> None:
    from faust.types import TP

    from stream.joiner.faust_delivery import BatchConsumer

    a, b = TP("impressions", 0), TP("clicks", 1)
    fake, done = _delivering(lambda records: {}, lambda: {})
    fake._kept = {a: [1, 2], b: [7]}
    BatchConsumer.forget_kept(fake, {b})  # type: ignore[arg-type]
    assert fake._kept == {a: [1, 2]} and done["dropped"] == [{("clicks", 1)}]


def test_the_faust_driver_takes_librdkafkas_fetch_limit_as_faust_s_own_and_refuses_a_bad_one() -> None:
    import logging

    import pytest

    from stream.config import KafkaSettings
    from stream.errors import ConfigError
    from stream.joiner.worker import _FETCH_BYTES, _fetch_bytes, broker_credentials

    assert _fetch_bytes(KafkaSettings()) == _FETCH_BYTES  # unset: faust's fetch size as before
    assert _fetch_bytes(KafkaSettings(extra={"max.partition.fetch.bytes": "65536"})) == 65536
    for bad in ("64k", "0", "-1"):
        with pytest.raises(ConfigError, match="max.partition.fetch.bytes"):
            _fetch_bytes(KafkaSettings(extra={"max.partition.fetch.bytes": bad}))
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logging.getLogger("streamrec.join").addHandler(handler)
    try:  # mapped, so not named among the properties faust ignores
        broker_credentials(KafkaSettings(extra={"max.partition.fetch.bytes": "65536", "fetch.wait.max.ms": "5"}))
    finally:
        logging.getLogger("streamrec.join").removeHandler(handler)
    assert [r.getMessage() for r in records] == [
        "[kafka.extra] fetch.wait.max.ms: librdkafka properties, not applied to the faust driver"]


def test_a_partition_whose_last_records_wait_in_the_carry_still_has_more_to_read() -> None:
    """faust's read offset counts a fetch read whole, but a fetch past a batch's room leaves its tail in the carry for
    the next batch: backpressure (``worker._behind``) must not take that partition for read to its end, or the
    other input's held records go out ahead of the carried ones (one click 14 s behind its partition in a CI run)."""
    from faust.types import TP

    from stream.joiner.faust_delivery import BatchConsumer
    from stream.joiner.records import Record

    clicks, imps, unfetched = TP("clicks", 0), TP("impressions", 0), TP("clicks", 1)
    highs = {clicks: 40, imps: 10}

    def highwater(tp: TP) -> int:
        if tp not in highs:
            raise KeyError(tp)  # not fetched yet
        return highs[tp]

    unsubscribed = SimpleNamespace(_subscription=SimpleNamespace(subscription=None))  # aiokafka's position unknown
    fake = SimpleNamespace(highwater=highwater, _read_offset={clicks: 39, imps: 5}, _sought={}, _carry=[],
                           _carried=set(), _thread=SimpleNamespace(_ensure_consumer=lambda: unsubscribed))
    more = BatchConsumer.fetched_more
    assert more(fake, clicks) is False  # type: ignore[arg-type]  # fetched to its high water, nothing carried
    assert more(fake, imps) is True  # type: ignore[arg-type]  # 6..9 not fetched yet
    assert more(fake, unfetched) is None  # type: ignore[arg-type]  # unknown: backpressure.Unfetched decides
    BatchConsumer._set_carry(fake, [Record("clicks", 0, o, None, b"") for o in (37, 38, 39)])  # type: ignore[arg-type]
    assert more(fake, clicks) is True  # type: ignore[arg-type]  # its last three wait for the next batch
    BatchConsumer._set_carry(fake, [])  # type: ignore[arg-type]  # taken into the next batch
    assert more(fake, clicks) is False  # type: ignore[arg-type]


def test_a_partition_sought_to_its_last_record_still_has_that_record_to_read() -> None:
    """Right after a seek (a rebalance's or a dropped hand's seek to the committed offsets) faust's read offset is the
    offset sought, the next to read, not the last read: a partition sought to its last record has that record to read,
    or backpressure releases the other input to its end ahead of it (``worker._behind``)."""
    from faust.types import TP

    from stream.joiner.faust_delivery import BatchConsumer

    imps = TP("impressions", 2)
    fake = SimpleNamespace(highwater=lambda tp: 1224, _read_offset={imps: 1223}, _sought={imps: 1223}, _carried=set(),
                           _start_checked=lambda tp: True)
    more = BatchConsumer.fetched_more
    assert more(fake, imps) is True  # type: ignore[arg-type]  # 1223 sought, not read yet
    fake._sought = {}  # read: the read offset is the last offset read
    assert more(fake, imps) is False  # type: ignore[arg-type]
    fake._sought = {imps: 1224}  # _resume_safely's re-read of an applied record: owed from past the high water
    assert more(fake, imps) is False  # type: ignore[arg-type]
    fake._start_checked = lambda tp: False  # a start at the high water _resume_safely has not checked yet: unknown
    assert more(fake, imps) is None  # type: ignore[arg-type]


def test_a_partition_whose_every_record_was_deleted_has_nothing_more_for_a_new_group() -> None:
    """A new group's first assignment starts at the log start (nothing read, nothing sought): where retention or
    DeleteRecords removed every record that is the high water, no record ever comes, and "more to read" held the other
    input back for good. aiokafka's fetch position (its real assignment state, reset as its fetcher resets it) stands
    in for the read offset; before it is known the partition still counts as more."""
    import asyncio

    from aiokafka.consumer.fetcher import OffsetResetStrategy
    from aiokafka.consumer.subscription_state import SubscriptionState
    from aiokafka.structs import TopicPartition as AioTP
    from faust.types import TP

    from stream.joiner.faust_delivery import BatchConsumer

    emptied, unread = TP("clicks", 0), TP("clicks", 1)

    async def answers() -> list[bool | None]:
        subscription = SubscriptionState()
        subscription.assign_from_user({AioTP(*emptied), AioTP(*unread)})
        aiokafka = SimpleNamespace(_subscription=subscription)
        fake = SimpleNamespace(highwater=lambda tp: 5, _read_offset={}, _sought={}, _carried=set(),
                               _thread=SimpleNamespace(_ensure_consumer=lambda: aiokafka))
        more = BatchConsumer.fetched_more
        out = [more(fake, emptied)]  # type: ignore[arg-type]  # position not looked up yet: more
        for tp, low in ((emptied, 5), (unread, 2)):  # no committed offset: auto_offset_reset earliest, to the log start
            state = subscription.subscription.assignment.state_value(AioTP(*tp))
            state.await_reset(OffsetResetStrategy.EARLIEST)
            state.reset_to(low)
        return [*out, more(fake, emptied), more(fake, unread)]  # type: ignore[arg-type]

    assert asyncio.run(answers()) == [True, False, True]  # the emptied partition was True for good


def test_the_faust_worker_counts_an_input_not_fetched_since_its_assignment_as_behind_for_a_while() -> None:
    """As the kafka driver (tests/integration/test_backpressure.py): an input whose end faust's fetcher has not seen
    yet holds the other back for ``UNFETCHED_GRACE_S``, not for good; one it has seen is believed."""
    from faust.types import TP

    from stream.joiner.backpressure import CLICKS, IMPRESSIONS
    from stream.joiner.worker import FaustJoinWorker
    from stream.unfetched import UNFETCHED_GRACE_S, Unfetched

    ends = {TP("impressions", 0): False, TP("clicks", 0): None}
    now = [0.0]
    fake = SimpleNamespace(app=SimpleNamespace(consumer=SimpleNamespace(fetched_more=ends.__getitem__)),
                           unfetched=Unfetched(clock=lambda: now[0]), _topic=lambda kind: kind)
    assert FaustJoinWorker._behind(fake, CLICKS, 0)  # type: ignore[arg-type]
    assert not FaustJoinWorker._behind(fake, IMPRESSIONS, 0)  # type: ignore[arg-type]
    now[0] = UNFETCHED_GRACE_S
    assert not FaustJoinWorker._behind(fake, CLICKS, 0)  # type: ignore[arg-type]


def test_the_faust_driver_hands_the_pipeline_each_record_with_its_kafka_headers() -> None:
    """aiokafka's records carry their headers; the faust driver's pipeline records did not, so a malformed event's
    dead letter could not keep them (stream/dlq.py)."""
    from collections import defaultdict

    from aiokafka.structs import ConsumerRecord
    from faust.types import TP

    from stream.joiner.faust_delivery import BatchConsumer

    headers = [("trace-id", b"t-1")]
    rec = ConsumerRecord("impressions", 0, 5, 1000, 0, b"k", b"{bad", None, 4, 1, headers)
    fake = SimpleNamespace(_read_offset=defaultdict(lambda: None), _sought={}, _redone={}, _jumps=[], _left_out=False,
                           app=SimpleNamespace(monitor=None, topics=SimpleNamespace(acks_enabled_for=lambda t: False)))
    [out] = BatchConsumer._records(fake, {TP("impressions", 0): [rec]})  # type: ignore[arg-type]
    assert (out.offset, out.key, out.value, out.headers) == (5, b"k", b"{bad", headers)


def _faust_consumer_timeouts(kafka: object) -> dict[str, int]:
    """What the faust driver's aiokafka consumer is built with (faust's settings as the worker maps them), in ms."""
    import asyncio
    import shutil

    from stream.idle_clock import IdleClock
    from stream.joiner.config import JoinerSettings
    from stream.joiner.worker import FaustJoinWorker

    async def build() -> dict[str, int]:
        pipeline = SimpleNamespace(held_counts={}, engines={}, processed={}, awake=IdleClock(1.0, 0.0))
        worker = FaustJoinWorker(pipeline, kafka, JoinerSettings())  # type: ignore[arg-type]
        try:
            thread = worker.app.consumer._new_consumer_thread()  # type: ignore[attr-defined]
            c = thread._create_worker_consumer(worker.app.transport)
            return {"max.poll.interval.ms": c._max_poll_interval_ms, "session.timeout.ms": c._session_timeout_ms,
                    "heartbeat.interval.ms": c._heartbeat_interval_ms, "request.timeout.ms": c._request_timeout_ms,
                    "rebalance.timeout.ms": c._rebalance_timeout_ms,  # what aiokafka's JoinGroup carries
                    "client.id": c._client._client_id}
        finally:
            shutil.rmtree(worker._datadir, ignore_errors=True)

    return asyncio.run(build())


def test_the_faust_driver_drops_a_slow_member_after_librdkafkas_poll_interval_as_the_kafka_driver_does() -> None:
    """``[kafka.extra] max.poll.interval.ms`` was one of the properties faust ignored, so a batch could keep the faust
    driver's member from polling for faust's own 1000 s where the kafka driver's is dropped (and its partitions
    handed on) after librdkafka's 300 s or the configured value. Session and heartbeat match too."""
    import pytest

    from stream.config import KafkaSettings
    from stream.errors import ConfigError
    from stream.joiner.worker import _max_poll_interval_s
    from stream.kafka import consumer_config

    for kafka, poll_ms in ((KafkaSettings(bootstrap_servers="127.0.0.1:9"), 300_000),  # unset: librdkafka's default
                           (KafkaSettings(bootstrap_servers="127.0.0.1:9", session_timeout_ms=10_000,
                                          extra={"max.poll.interval.ms": "45000"}), 45_000)):
        librdkafka = consumer_config(kafka, "g")
        assert _faust_consumer_timeouts(kafka) == {
            "max.poll.interval.ms": poll_ms, "session.timeout.ms": librdkafka["session.timeout.ms"],
            "heartbeat.interval.ms": pytest.approx(librdkafka["heartbeat.interval.ms"], abs=1),
            "request.timeout.ms": 90_000,  # faust's own
            "rebalance.timeout.ms": poll_ms, "client.id": kafka.client_id}
    for bad in ("5m", "-1"):  # ("0": KafkaSettings refuses it already, as a session timeout over it)
        with pytest.raises(ConfigError, match="max.poll.interval.ms"):
            _max_poll_interval_s(KafkaSettings(extra={"max.poll.interval.ms": bad}))


def test_a_member_busy_with_a_batch_during_a_rebalance_gets_the_poll_interval_to_rejoin_in_both_drivers() -> None:
    """librdkafka sends ``max.poll.interval.ms`` as its JoinGroup rebalance timeout (how long the broker waits for a
    member to rejoin before it drops it from the new generation); the faust driver's aiokafka consumer sent faust's
    own 60 s, so a batch of a minute or more during a rebalance got the faust driver's member dropped (its partitions
    handed on, its batch's commit refused) where the kafka driver's, given 300 s or the configured interval, stayed."""
    from stream.config import MAX_POLL_INTERVAL_MS, KafkaSettings
    from stream.kafka import consumer_config

    for kafka in (KafkaSettings(bootstrap_servers="127.0.0.1:9"),  # unset: librdkafka's 300 s, not faust's 60 s
                  KafkaSettings(bootstrap_servers="127.0.0.1:9", extra={"max.poll.interval.ms": "600000"})):
        poll_ms = consumer_config(kafka, "g").get("max.poll.interval.ms", MAX_POLL_INTERVAL_MS)
        assert _faust_consumer_timeouts(kafka)["rebalance.timeout.ms"] == int(poll_ms)


def test_the_faust_driver_names_itself_to_the_broker_by_the_kafka_client_id_as_the_kafka_driver_does() -> None:
    """faust sent ``faust-<version>`` as its client id whatever ``[kafka] client_id`` said: a broker's quotas and
    request logs keyed by client id saw the faust driver as another application than the kafka driver."""
    from stream.config import KafkaSettings

    kafka = KafkaSettings(bootstrap_servers="127.0.0.1:9", client_id="ranking-joiner")
    assert _faust_consumer_timeouts(kafka)["client.id"] == "ranking-joiner"


def test_the_faust_driver_gives_partition_p_of_both_inputs_to_one_member_without_standby_replicas(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """faust builds its aiokafka consumer with aiokafka's round-robin assignor when an app has no standby replicas and
    no tables; ``TABLE_STANDBY_REPLICAS=0`` (faust's env name, which wins over the worker's settings) so split
    impressions p and clicks p between members (the kafka driver: librdkafka's range assignor keeps them together).
    The assignors the consumer is built with assign 4 partitions of both inputs to 3 members here."""
    import asyncio
    import shutil

    from aiokafka.coordinator.protocol import ConsumerProtocolMemberMetadata

    from stream.config import KafkaSettings
    from stream.idle_clock import IdleClock
    from stream.joiner.config import JoinerSettings
    from stream.joiner.worker import FaustJoinWorker

    monkeypatch.setenv("TABLE_STANDBY_REPLICAS", "0")
    kafka = KafkaSettings(bootstrap_servers="127.0.0.1:9")
    topics = [kafka.impressions_topic, kafka.clicks_topic]

    async def assignments() -> dict[str, dict[str, list[int]]]:
        pipeline = SimpleNamespace(held_counts={}, engines={}, processed={}, awake=IdleClock(1.0, 0.0))
        worker = FaustJoinWorker(pipeline, kafka, JoinerSettings())  # type: ignore[arg-type]
        try:
            assert worker.app.conf.table_standby_replicas == 0  # the env reached faust
            thread = worker.app.consumer._new_consumer_thread()  # type: ignore[attr-defined]
            [assignor] = thread._create_worker_consumer(worker.app.transport)._partition_assignment_strategy
            meta = assignor.metadata(set(topics))
            members = {f"m{i}": ConsumerProtocolMemberMetadata(meta.version, topics, meta.user_data) for i in range(3)}
            got = assignor.assign(SimpleNamespace(partitions_for_topic=lambda _t: set(range(4))), members)
            return {m: dict(a.assignment) for m, a in got.items()}
        finally:
            shutil.rmtree(worker._datadir, ignore_errors=True)

    got = asyncio.run(assignments())
    assert sorted(p for a in got.values() for p in a[kafka.impressions_topic]) == [0, 1, 2, 3]
    for a in got.values():
        assert sorted(a[kafka.impressions_topic]) == sorted(a[kafka.clicks_topic])  # co-partitioned


def test_the_faust_driver_takes_a_session_over_faust_s_request_timeout_as_the_kafka_driver_does() -> None:
    """A ``session_timeout_ms`` over 90 s (the settings allow up to the poll interval, 300 s by default) stopped the
    faust driver at its consumer's start with faust's ImproperlyConfigured (the session over its 90 s
    ``broker_request_timeout``) where the kafka driver ran: the request timeout now grows to the session."""
    from stream.config import KafkaSettings

    kafka = KafkaSettings(bootstrap_servers="127.0.0.1:9", session_timeout_ms=120_000)
    got = _faust_consumer_timeouts(kafka)
    assert got["session.timeout.ms"] == 120_000 and got["request.timeout.ms"] >= 120_000


def test_a_session_or_heartbeat_in_kafka_extra_is_refused_for_session_timeout_ms_as_both_drivers_read_that() -> None:
    """``[kafka.extra] session.timeout.ms`` / ``heartbeat.interval.ms`` overrode the kafka driver's session (extra is
    applied last) while the faust driver, ignoring them, kept ``session_timeout_ms``: two sessions for one setting,
    and both drivers' after-a-stall wait (two heartbeats of ``session_timeout_ms``) wrong for the kafka driver."""
    import pytest

    from stream.config import KafkaSettings
    from stream.errors import ConfigError

    for key in ("session.timeout.ms", "heartbeat.interval.ms"):
        with pytest.raises(ConfigError, match=rf"\[kafka.extra\] {key}: the setting \[kafka\] session_timeout_ms"):
            KafkaSettings(extra={key: "20000"})


def test_a_partition_ending_in_a_transaction_marker_has_nothing_more_once_the_fetcher_passed_it() -> None:
    """An application producing in transactions ends each with a commit marker: the partition's last offset holds no
    record, so faust's read offset (the last record read) stays below the high water for good (so do aborted records
    read committed, and compacted ones). Read as more to read, no idleness counted (``backpressure.unread``: a bounded
    ``--exit-when-idle`` run never ended) and the hold kept the other input back. aiokafka's fetch position passes
    control batches and skipped records as its fetcher hands the records on: at the high water, nothing is left."""
    import asyncio

    from aiokafka.consumer.fetcher import OffsetResetStrategy
    from aiokafka.consumer.subscription_state import SubscriptionState
    from aiokafka.structs import TopicPartition as AioTP
    from faust.types import TP

    from stream.joiner.faust_delivery import BatchConsumer

    imps = TP("impressions", 0)

    async def answers() -> list[bool | None]:
        subscription = SubscriptionState()
        subscription.assign_from_user({AioTP(*imps)})
        aiokafka = SimpleNamespace(_subscription=subscription)
        fake = SimpleNamespace(highwater=lambda tp: 1225, _read_offset={imps: 1223}, _sought={}, _carried=set(),
                               _thread=SimpleNamespace(_ensure_consumer=lambda: aiokafka))
        state = subscription.subscription.assignment.state_value(AioTP(*imps))
        state.await_reset(OffsetResetStrategy.EARLIEST)
        state.reset_to(0)
        more = BatchConsumer.fetched_more
        state.consumed_to(1224)  # the last record (1223) handed on, the marker (1224) not fetched yet
        out = [more(fake, imps)]  # type: ignore[arg-type]
        state.consumed_to(1225)  # the marker's control batch drained: the fetch position is the high water
        return [*out, more(fake, imps)]  # type: ignore[arg-type]

    assert asyncio.run(answers()) == [True, False]  # was [True, True]: more to read for good


def test_a_partition_moved_back_within_one_record_batch_skips_what_it_reads_again_but_a_topic_made_again_does_not(
) -> None:
    """The rewind to the local broker's lagging end (``_resume_safely``) reads processed records again: they are not
    handed to the join (a bad one was dead-lettered again). A start more than one record batch past the end is a topic
    deleted and made again (its offsets started over): its records are the new topic's and go to the join."""
    import asyncio
    import logging

    from faust.types import TP

    from stream.joiner.faust_delivery import BatchConsumer

    lagging, remade = TP("impressions", 0), TP("impressions", 1)
    highs = {lagging: 10, remade: 40}
    seeks: list[tuple[TP, int]] = []

    async def seek(tp: TP, offset: int) -> None:
        seeks.append((tp, offset))

    fake = SimpleNamespace(_resumed=set(), _resumed_generation=-1, _read_offset={lagging: 12, remade: 50_000},
                           _redone={}, _sought={}, _get_active_partitions=lambda: [lagging, remade],
                           highwater=highs.__getitem__, seek=seek, log=logging.getLogger("test"))
    asyncio.run(BatchConsumer._resume_safely(fake, 1, {}))  # type: ignore[arg-type]
    assert seeks == [(lagging, 9), (remade, 39)]
    assert fake._redone == {lagging: 12}


def test_an_input_made_again_that_is_revoked_while_its_first_offset_is_asked_is_neither_sought_nor_a_crash() -> None:
    """``start_over`` awaits the broker (the new topic's first offset, then the commit): a revocation may come in
    between. aiokafka's seek of a partition no longer assigned raises IllegalStateError, which escaped ``_deliver`` and
    failed faust's fetcher (the worker crashed on a rebalance); its next owner's restore finds the topic made again and
    starts it over itself."""
    import asyncio
    import dataclasses

    from aiokafka.errors import IllegalStateError
    from faust.types import TP

    from stream.joiner.faust_delivery import BatchConsumer
    from stream.joiner.records import Record

    remade = TP("impressions", 0)
    fake, done = _delivering(lambda records: {}, lambda: {})
    fake.delivery = dataclasses.replace(fake.delivery, started_over=lambda: {("impressions", 0)})
    owned = {remade}
    fake.assignment = lambda: set(owned)
    committed: list[dict] = []

    async def earliest_offsets(*tps: TP) -> dict:
        owned.clear()  # a rebalance revoked it while the broker was asked
        return {tp: 0 for tp in tps}

    async def commit_offsets(offsets: dict) -> bool:
        committed.append({tp: o for tp, o in offsets.items() if tp in owned})  # faust's: revoked ones discarded
        return True

    async def seek(tp: TP, offset: int) -> None:  # aiokafka's: only an assigned partition
        if tp not in owned:
            raise IllegalStateError(f"No current assignment for partition {tp}")
        done["seeks"].append((tp, offset))

    fake.earliest_offsets, fake._commit_offsets, fake.seek = earliest_offsets, commit_offsets, seek
    fake.start_over = lambda again: BatchConsumer.start_over(fake, again)  # type: ignore[arg-type]
    asyncio.run(BatchConsumer._deliver(fake, [Record("impressions", 0, 6, None, b"")]))  # type: ignore[arg-type]
    assert done["seeks"] == [] and committed in ([], [{}])
    assert done["dropped"] == [None]  # the hand dropped all the same


def test_an_input_made_again_with_records_past_the_old_committed_offset_is_read_again_from_its_first_record() -> None:
    """The new topic holds more records than the group's committed offset (6, the old topic's): the batch brought 6-8,
    ``start_over`` committed 0 and sought there, and the drop then sought the partition to the batch's first offset
    (6): faust's read offset after its seek to a committed 0 is None, which ``_drop`` takes for no committed offset.
    The new topic's records 0-5 were never joined, under a WARNING that said it was read from its first record."""
    import asyncio
    import dataclasses

    from faust.types import TP

    from stream.joiner.faust_delivery import BatchConsumer
    from stream.joiner.records import Record

    remade = TP("impressions", 0)
    fake, done = _delivering(lambda records: {}, lambda: {})
    fake.delivery = dataclasses.replace(fake.delivery, started_over=lambda: {("impressions", 0)})
    fake.assignment = lambda: {remade}
    fake._read_offset = {remade: None}  # faust's perform_seek after a committed offset of 0

    async def earliest_offsets(*tps: TP) -> dict:
        return {tp: 0 for tp in tps}

    async def commit_offsets(offsets: dict) -> bool:
        return True

    fake.earliest_offsets, fake._commit_offsets = earliest_offsets, commit_offsets
    fake.start_over = lambda again: BatchConsumer.start_over(fake, again)  # type: ignore[arg-type]
    asyncio.run(BatchConsumer._deliver(fake, [Record("impressions", 0, o, None, b"") for o in (6, 7, 8)]))  # type: ignore[arg-type]
    assert done["seeks"][-1] == (remade, 0)  # was (remade, 6)


def test_an_input_made_again_under_the_running_consumer_commits_none_of_the_old_topics_pending_acks() -> None:
    """The running topic-id check (``JoinPipeline.check_topics``) can start an input over while faust still holds
    acknowledgements of the old topic not committed yet (offsets 100-105, joined within the commit interval).
    ``start_over`` commits the new topic's first offset, 0; faust's next commit took the old acks (its gap check skips a
    committed offset of 0) and committed 106 over it: a crash before the new topic passed 106 read it on from there,
    its records between the state and 106 never joined."""
    import asyncio
    import dataclasses
    from collections import defaultdict

    from faust.transport.consumer import Consumer
    from faust.types import TP
    from intervaltree import IntervalTree

    from stream.joiner.faust_delivery import BatchConsumer

    remade = TP("impressions", 0)
    fake, done = _delivering(lambda records: {}, lambda: {})
    fake.delivery = dataclasses.replace(fake.delivery, started_over=lambda: {("impressions", 0)})
    fake.assignment = lambda: {remade}
    fake._read_offset = {remade: 105}
    fake._acked, fake._acked_index = defaultdict(list), defaultdict(set)
    fake._gap, fake._committed_offset = defaultdict(IntervalTree), defaultdict(lambda: None)
    fake._acked[remade].extend(range(100, 106))  # the old topic's, processed, not committed yet
    fake._acked_index[remade].update(range(100, 106))
    fake._gap[remade].addi(90, 95)  # an old topic's gap (a transaction marker's offsets)
    fake._committed_offset[remade] = 100

    async def earliest_offsets(*tps: TP) -> dict:
        return {tp: 0 for tp in tps}

    async def commit_offsets(offsets: dict) -> bool:
        fake._committed_offset.update(offsets)  # as faust's
        return True

    fake.earliest_offsets, fake._commit_offsets = earliest_offsets, commit_offsets
    fake.start_over = lambda again: BatchConsumer.start_over(fake, again)  # type: ignore[arg-type]
    fake._new_offset = lambda tp: Consumer._new_offset(fake, tp)  # type: ignore[arg-type]
    fake._should_commit = lambda tp, offset: Consumer._should_commit(fake, tp, offset)  # type: ignore[arg-type]
    asyncio.run(BatchConsumer._deliver(fake, []))  # type: ignore[arg-type]
    assert fake._committed_offset[remade] == 0
    assert Consumer._filter_committable_offsets(fake, [remade]) == {}  # type: ignore[arg-type]  # was 95 (106 without the gap)
    assert not fake._gap[remade]  # the old topic's gaps are no offsets of the new one
