"""Strike entries do not outlive the messages they are about: once the consumer's position (the group's committed
offset, the learner's checkpoint) is past a message it is never read again, and its strikes go from the store too,
whoever gave them (a message committed past by another worker after a rebalance, a partition that moved away)."""

from __future__ import annotations

import errno
from pathlib import Path

from stream.strikes import FileStrikes, PartitionFileStrikes, Strikes, settle_strikes


def _struck(path: Path) -> Strikes:
    other_owner = Strikes(FileStrikes(path), limit=3)
    other_owner.failed([("imps", 0, 3), ("imps", 0, 7), ("clicks", 0, 4), ("imps", 1, 2)], RuntimeError("boom"))
    return Strikes(FileStrikes(path), limit=3)


def test_a_reloaded_partitions_strikes_below_the_committed_offset_are_dropped_from_the_store(tmp_path: Path) -> None:
    strikes = _struck(tmp_path / "s.json")
    asked: list[list[int]] = []

    def committed(partitions: list[int]) -> dict[tuple[str, int], int]:
        asked.append(partitions)
        return {("imps", 0): 5, ("clicks", 0): 4, ("imps", 1): 0}

    strikes.reload([0], committed)
    assert asked == [[0]]  # only the reloaded partitions, which have strikes
    assert set(strikes.counts) == {("imps", 0, 7), ("clicks", 0, 4), ("imps", 1, 2)}  # 4: the next one read
    assert set(FileStrikes(tmp_path / "s.json").load()) == {("imps", 0, 7), ("clicks", 0, 4), ("imps", 1, 2)}


def test_committed_offsets_are_not_asked_for_partitions_without_strikes(tmp_path: Path) -> None:
    strikes = _struck(tmp_path / "s.json")
    strikes.reload([2], lambda partitions: (_ for _ in ()).throw(AssertionError(f"asked {partitions}")))
    strikes.reload([0], lambda partitions: {})  # the broker could not say: every strike kept
    assert len(FileStrikes(tmp_path / "s.json").load()) == 4


def test_the_learners_strikes_below_its_checkpoint_offsets_are_dropped_at_its_start(tmp_path: Path) -> None:
    rank = Strikes(PartitionFileStrikes(tmp_path, [0, 1]), limit=3)
    rank.failed([("samples", 0, 1), ("samples", 0, 9), ("samples", 1, 4)], RuntimeError("boom"))
    restarted = Strikes(PartitionFileStrikes(tmp_path, [0, 1]), limit=3)
    settle_strikes(restarted, {("samples", 0): 5, ("samples", 1): 5})
    assert set(restarted.counts) == {("samples", 0, 9)}
    assert set(Strikes(PartitionFileStrikes(tmp_path, [0, 1]), limit=3).counts) == {("samples", 0, 9)}


def test_a_strikes_file_that_cannot_be_written_does_not_stop_the_learners_start(tmp_path: Path) -> None:
    strikes = Strikes(FileStrikes(tmp_path / "s.json"), limit=3)
    strikes.failed([("samples", 0, 1)], RuntimeError("boom"))

    def full_disk(changed: object, cleared: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    strikes.store.save = full_disk  # type: ignore[method-assign]
    settle_strikes(strikes, {("samples", 0): 5})  # logged; the next start drops them
    assert FileStrikes(tmp_path / "s.json").load() == {("samples", 0, 1): (1, "RuntimeError: boom")}


def test_a_poison_messages_reason_quotes_its_last_error_escaped_and_says_how_much_was_left_out(tmp_path: Path) -> None:
    strikes = Strikes(FileStrikes(tmp_path / "s.json"), limit=1)  # a library's error quoting the input whole
    strikes.failed([("imps", 0, 3)], ValueError("bad row\n2026-12-07 ERROR forged line\x1b[2J" + "x" * 60_000))
    reason = strikes.poisoned(("imps", 0, 3))
    assert reason is not None and reason.isprintable(), reason[:400]  # clip cut it, escaping nothing
    assert "ValueError: bad row\\n2026-12-07 ERROR forged line\\x1b[2J" in reason, reason[:400]
    assert reason.endswith(" more chars)") and len(reason) < 400, reason[:400]
