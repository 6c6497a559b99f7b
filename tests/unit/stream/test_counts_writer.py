"""stream/joiner/day_counts.py: day counts written by the writer thread; a failed write is kept apart, with its write
id, and retried as it was before newer counts (tests/integration/test_counts_retry.py: the same against a real
Redis)."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import redis

from stream.errors import ConfigError
from stream.features import hash_value
from stream.joiner.day_counts import DayCountsWriter
from stream.joiner.pipeline import JoinPipeline


class FakeCounts:
    """Records each record call written; the first ``fail`` calls raise (their write ids are in ``failed_ids``)."""

    def __init__(self, fail: int) -> None:
        self.fail, self.calls, self.threads = fail, [], set()
        self.ids: list[str] = []  # the write id of each call written, in order
        self.failed_ids: list[str] = []

    def record(self, kind: str, event: str, ids: list[int], ts: list[int], names: dict, write_id: str) -> None:
        self.threads.add(threading.get_ident())
        if self.fail:
            self.fail -= 1
            self.failed_ids.append(write_id)
            raise redis.ConnectionError("redis went away")
        self.calls.append((kind, event, list(ids), list(ts), dict(names)))
        self.ids.append(write_id)


def counts_writer(counts: FakeCounts) -> DayCountsWriter:
    """The joiner's day counts writer on fake counts (no broker, no Redis); Redis never emptied (stream/keyspace.py)."""
    return DayCountsWriter(counts, SimpleNamespace(check=list), flush_s=3600)  # type: ignore[arg-type]


def pipeline_closing(p: DayCountsWriter) -> JoinPipeline:
    """A pipeline holding only ``p`` and what its close() touches besides (Redis, the collector's pacing)."""
    pipeline = JoinPipeline.__new__(JoinPipeline)
    pipeline.day_counts = p
    pipeline.redis = SimpleNamespace(close=lambda: None)  # type: ignore[assignment]
    pipeline.gc = SimpleNamespace(close=lambda: None)  # type: ignore[assignment]
    return pipeline


def buffer(p: DayCountsWriter, ids: list[int], ts: list[int], raw: str) -> None:
    got = p.buffered.setdefault(("item", "impression"), ([], []))
    got[0].extend(ids)
    got[1].extend(ts)
    p.names["item"].add(raw)


def test_counts_are_written_by_the_writer_thread_with_their_names() -> None:
    counts = FakeCounts(fail=0)
    p = counts_writer(counts)
    try:
        written_by_the_writer(p, counts)
    finally:
        p.shutdown()


def written_by_the_writer(p: DayCountsWriter, counts: FakeCounts) -> None:
    buffer(p, [1, 2], [10, 20], "a")
    p.start_flush()
    assert p.buffered == {} and p.names == {"item": set(), "user": set()}  # buffering afresh
    p.flush()
    assert counts.calls == [("item", "impression", [1, 2], [10, 20], {hash_value("a"): "a"})]
    assert threading.get_ident() not in counts.threads


def test_a_failed_write_is_retried_as_it_was_under_its_write_id_before_newer_counts_under_a_new_one() -> None:
    """Redis may have run the failed write (only its reply lost): merged with the counts that came since and retried
    under its id, those would be skipped as written; under a new id, its own would count twice."""
    counts = FakeCounts(fail=1)
    p = counts_writer(counts)
    try:
        failed_then_retried_apart(p, counts)
    finally:
        p.shutdown()


def failed_then_retried_apart(p: DayCountsWriter, counts: FakeCounts) -> None:
    buffer(p, [1, 2], [10, 20], "a")
    p.start_flush()
    buffer(p, [3], [30], "b")  # counted while the write was in flight
    with pytest.raises(redis.ConnectionError):
        p.finish_flush()
    assert p.buffered == {("item", "impression"): ([3], [30])}  # not merged into the failed write
    assert p.failed_write is not None and p.failed_write.counts == {("item", "impression"): ([1, 2], [10, 20])}
    p.flush()
    assert [c[2] for c in counts.calls] == [[1, 2], [3]]  # each written once, nothing lost
    assert counts.ids[0] == counts.failed_ids[0] and counts.ids[1] != counts.ids[0]
    assert [c[4] for c in counts.calls] == [{hash_value("a"): "a"}, {hash_value("b"): "b"}]  # names go with them
    assert p.failed_write is None


def test_a_write_behind_a_failed_retry_was_never_sent_and_goes_back_to_the_buffer() -> None:
    """The failed write fails again on its retry: the newer write behind it was never sent (Redis cannot have run it),
    so it joins the buffer again (no second write waits apart) and the failed one keeps its id."""
    counts = FakeCounts(fail=2)
    p = counts_writer(counts)
    try:
        buffer(p, [1], [10], "a")
        with pytest.raises(redis.ConnectionError):
            p.flush()
        buffer(p, [2], [20], "b")
        with pytest.raises(redis.ConnectionError):
            p.flush()  # the retry of [1] fails again; [2] not sent
        assert counts.failed_ids[0] == counts.failed_ids[1]
        assert p.buffered == {("item", "impression"): ([2], [20])} and p.names["item"] == {"b"}
        buffer(p, [3], [30], "c")
        p.flush()
    finally:
        p.shutdown()
    assert [c[2] for c in counts.calls] == [[1], [2, 3]]
    assert counts.ids[0] == counts.failed_ids[0] != counts.ids[1]


def test_close_retries_a_write_that_failed_in_flight_and_writes_the_counts_buffered_since() -> None:
    """SIGTERM after a background write failed on a Redis blip: close() is the last flush, so the failed write gets the
    retry a next flush would give it (under its write id) and the counts buffered since are written too; it used to
    raise the in-flight failure at once and lose both (exit 1 with every batch's state durable)."""
    counts = FakeCounts(fail=1)
    p = counts_writer(counts)
    buffer(p, [1], [10], "a")
    p.start_flush()  # in flight: fails
    p.flushing[0].exception()  # type: ignore[index]  # (waits for it)
    buffer(p, [2], [20], "b")  # a later batch's counts
    pipeline_closing(p).close()
    assert [c[2] for c in counts.calls] == [[1], [2]]
    assert counts.ids[0] == counts.failed_ids[0] != counts.ids[1]


def test_close_still_raises_when_the_last_flush_fails_too() -> None:
    counts = FakeCounts(fail=2)
    p = counts_writer(counts)
    buffer(p, [1], [10], "a")
    p.start_flush()
    with pytest.raises(redis.ConnectionError):
        pipeline_closing(p).close()
    assert counts.calls == [] and counts.failed_ids[0] == counts.failed_ids[1]


def test_the_writer_names_each_raw_id_by_its_hash_value_ints_strings_and_a_shared_text_alike() -> None:
    from stream.joiner.day_counts import named_by_hash

    raws: set[int | str] = {0, 7, 2**63 - 1, "a", "é-user", "123", 123, "x" * 256}
    got = named_by_hash(raws)
    assert got == {hash_value(raw): raw for raw in raws}  # 123 and "123" share one hash: one of them names it
    assert set(got.values()) <= raws and len(got) == len(raws) - 1
    assert named_by_hash(set()) == {}


def test_the_writer_looks_up_the_ids_the_join_hashed_instead_of_hashing_them_again(monkeypatch) -> None:
    # the join hashes a batch's user and item ids through hash_ids' cache (engine.apply: hash_column); the writer's
    # names are those ids: through hash_value's own LRU cache every one missed and was hashed a second time
    import stream.features as sf
    from stream.joiner.day_counts import named_by_hash

    monkeypatch.setattr(sf, "_ID_CACHE", {})
    raws = [f"user-{i}" for i in range(300)] + list(range(10**12, 10**12 + 300))
    sf.hash_column([v for v in raws if isinstance(v, str)])  # what the join did with the batch's columns
    sf.hash_column([v for v in raws if isinstance(v, int)])
    misses = sf.hash_value.cache_info().misses
    assert named_by_hash(set(raws)) == {sf.stable_hash(v): v for v in raws}
    assert sf.hash_value.cache_info().misses == misses


def test_a_last_flush_that_fails_says_how_many_events_of_durable_batches_it_leaves_uncounted(caplog) -> None:
    """close() with Redis down: the write that failed in flight (sent: item impressions and user clicks) and the counts
    buffered since are not written; the ERROR says how many events per kind and event (it raised the Redis error only,
    and the process exited without a word of the counts lost)."""
    counts = FakeCounts(fail=10)
    p = counts_writer(counts)
    buffer(p, [1, 1, 2], [10, 11, 12], "a")
    p.buffered[("user", "click")] = ([7, 8], [10, 11])
    p.start_flush()  # in flight: fails
    p.flushing[0].exception()  # type: ignore[index]  # (waits for it)
    buffer(p, [3], [20], "b")  # a later batch's counts
    with caplog.at_level("ERROR", logger="streamrec.join"), pytest.raises(redis.ConnectionError):
        pipeline_closing(p).close()
    said = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(said) == 1, said
    assert "6 events" in said[0] and "item/impression 4" in said[0] and "user/click 2" in said[0], said[0]


class RefusingCounts(FakeCounts):
    """Every record call refused by Redis with ``reply`` (an error reply that is no state of the server's)."""

    def __init__(self, reply: str) -> None:
        super().__init__(fail=0)
        self.reply = reply

    def record(self, kind: str, event: str, ids: list[int], ts: list[int], names: dict, write_id: str) -> None:
        raise redis.ResponseError(self.reply)


def refused_flush(reply: str) -> ConfigError:
    """The ConfigError a flush raises when Redis refuses every counts write with ``reply``."""
    counts = RefusingCounts(reply)
    counts.prefix = "sr"  # type: ignore[attr-defined]
    p = counts_writer(counts)
    buffer(p, [1], [10], "a")
    try:
        with pytest.raises(ConfigError) as info:
            p.flush()
    finally:
        p.shutdown()
    return info.value


def test_a_counts_write_refused_for_a_disabled_command_names_the_command_not_a_key_to_delete() -> None:
    """A Redis whose config renames or disables EVALSHA (rename-command) refuses every counts write: the joiner stops
    with a ConfigError quoting Redis, which told the operator to delete a key under the prefix or set another prefix
    (the fix of a WRONGTYPE), neither of which helps."""
    said = str(refused_flush("unknown command 'evalsha', with args beginning with: '9fb2' '3' "))
    assert "unknown command 'evalsha'" in said and "delete that key" not in said, said
    assert "EVALSHA" in said and "MULTI" in said, said  # what the joiner needs of Redis: the fix


def test_a_counts_write_refused_for_a_key_of_another_type_still_names_the_key_to_delete() -> None:
    said = str(refused_flush("WRONGTYPE Operation against a key holding the wrong kind of value"))
    assert "delete that key or set another prefix" in said, said


@pytest.mark.parametrize("reply", [
    "CROSSSLOT Keys in request don't hash to the same slot",
    "Error running script (call to f_9fb2): @user_script:12: user_script:12: bad argument #1 to 'tonumber'",
])
def test_a_counts_write_refused_for_another_reason_quotes_redis_and_gives_no_command_advice(reply: str) -> None:
    """Only a command Redis does not know is the commands' fault: a CROSSSLOT (a Redis Cluster) or a script's error
    was told to give the joiner EVALSHA and SCRIPT (renamed or disabled?), which it has. The error quotes Redis and
    names the settings to check."""
    said = str(refused_flush(reply))
    assert reply[:40] in said, said
    assert "EVALSHA" not in said and "renamed or disabled" not in said and "delete that key" not in said, said
    assert "[redis] url" in said and "[redis] prefix 'sr'" in said and "[redis] cluster" in said, said


@pytest.mark.parametrize("reply", ["ERR unknown command `EVALSHA`, with args beginning with: ",
                                   "unknown subcommand 'LOAD'. Try SCRIPT HELP."])
def test_a_counts_write_refused_for_an_unknown_command_in_any_wording_names_the_commands(reply: str) -> None:
    said = str(refused_flush(reply))
    assert "EVALSHA and SCRIPT" in said, said
