"""What a sharded checkpoint carries across a restart besides the model, compared with one process's
(``learner/daemon.py`` ``save``/``_load``): one gloo rank saves, a new learner restores (``_restore``)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from learner.batch import TensorBatch, to_tensors
from learner.config import LearnerSettings
from learner.distributed import RankContext
from stream.config import KafkaSettings
from tests.integration.test_learner import sample_batch
from tests.unit.learner.test_sharded_metrics import CFG, NoBroker

T0 = 1_700_000_000_000  # ms
pytestmark = pytest.mark.usefixtures("one_rank_group")  # a world of one gloo rank


def learner(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, **settings: Any) -> Any:
    import learner.sharded_daemon as sd

    monkeypatch.setattr(sd, "new_consumer", lambda *a, **k: NoBroker())
    ls = LearnerSettings(checkpoint_dir=tmp_path / "ckpt", mlp="8", buckets=16, ctx_buckets=8, embedding_dim=4,
                         **settings)
    return sd.ShardedLearner(KafkaSettings(bootstrap_servers="127.0.0.1:9"), ls, RankContext())


def a_round(lr: Any, batch: TensorBatch) -> None:
    """One round of one rank as ``run`` trains it: test-then-train, then the round's quality metrics on rank 0."""
    probs = lr.trainer.test_then_train(batch, len(batch))
    lr._after_round(batch, probs, lr.trainer.last_logits, None)


def rows(n: int, start: int, k: int = 0) -> TensorBatch:
    return to_tensors(sample_batch(np.random.default_rng(k), n, start=start), CFG, [(0, k, n)])


def test_a_restarted_sharded_learner_goes_on_with_its_event_clock_so_one_late_row_does_not_move_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0's event clock (the 16th largest time of every rank's rows: the cold users' sightings, the quality
    windows' recent_s) was not in the sharded checkpoint: after a restart it started fresh, and the first round of a
    few rows, one of them stamped a day ahead (a client's wrong clock), moved it by a day, where one process (which
    restores its clock) and the run without a restart keep it."""
    first = learner(tmp_path, monkeypatch)
    try:
        first._build(CFG)
        a_round(first, rows(64, T0))
        first.save()
        before = first._clock.now_ms
    finally:
        first.close()
    again = learner(tmp_path, monkeypatch)
    try:
        assert again._restore()
        assert again._clock.now_ms == before == T0 + 64 - 16
        a_round(again, rows(1, T0 + 86_400_000, k=1))
        assert again._clock.now_ms == T0 + 64 - 15  # one row moved it one row on (a fresh clock: by a day)
    finally:
        again.close()


def test_unshard_gives_the_single_process_checkpoint_the_ranks_event_clock(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A single-process learner resumed from ``--unshard``'s checkpoint started with a fresh clock (it restores
    ``event_clock``, which the unsharded checkpoint lacked)."""
    from learner import checkpoint, sharded_checkpoint

    first = learner(tmp_path, monkeypatch)
    try:
        first._build(CFG)
        a_round(first, rows(64, T0))
        first.save()
        state = first._clock.state()
    finally:
        first.close()
    out = sharded_checkpoint.unshard(tmp_path / "ckpt", tmp_path / "single")
    assert checkpoint.load(out)["event_clock"] == state


def test_a_restarted_sharded_learner_gets_its_delayed_feedback_counts_back_and_unshard_gives_all_ranks_and_the_clip(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each rank's delayed-feedback counts (the late-click share its importance weights use) were written into its
    rank-<r>.pt but never read back: a restart weighted with the prior's share again, where one process restores its
    counts. And --unshard's checkpoint lacked the dense gradient clip's history (one process restores it: "no fresh
    window to pass") and took rank 0's counts alone, not those of all rows."""
    from learner import checkpoint, sharded_checkpoint

    first = learner(tmp_path, monkeypatch)
    try:
        first._build(CFG)
        for k in range(3):
            a_round(first, rows(16, T0 + 16 * k, k))
        first.trainer.delayed.load_state_dict({"positives": 40, "delayed": 10})
        first.save()
        clip = first.trainer.dense_clip.state_dict()
        assert clip["norms"]  # (3 steps' norms)
    finally:
        first.close()
    again = learner(tmp_path, monkeypatch)
    try:
        assert again._restore()
        assert again.trainer.delayed.state_dict() == {"positives": 40, "delayed": 10}
    finally:
        again.close()
    single = checkpoint.load(sharded_checkpoint.unshard(tmp_path / "ckpt", tmp_path / "single"))
    assert single["delayed_weights"] == {"positives": 40, "delayed": 10} and single["dense_clip"] == clip


def _two_ranks_restore_and_save(rank: int, store_path: str, directory: str, out: str) -> None:
    """One of 2 gloo ranks: restores the checkpoint in ``directory`` (written by 1 rank), saves it again, and writes
    its delayed-feedback counts to ``out``-<rank>.json."""
    import json

    import torch.distributed as dist

    import learner.sharded_daemon as sd

    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2)
    try:
        sd.new_consumer = lambda *a, **k: NoBroker()  # type: ignore[assignment]  # (a process of its own)
        ls = LearnerSettings(checkpoint_dir=Path(directory), mlp="8", buckets=16, ctx_buckets=8, embedding_dim=4)
        lr = sd.ShardedLearner(KafkaSettings(bootstrap_servers="127.0.0.1:9"), ls, RankContext(rank, 2))
        try:
            assert lr._restore()
            lr.save()
            Path(f"{out}-{rank}.json").write_text(json.dumps(lr.trainer.delayed.state_dict()))
        finally:
            lr.close()
    finally:
        dist.destroy_process_group()
    # Its result is written: leave without C++ teardown. Under the CI's load one such rank aborted once ("terminate
    # called without an active exception", the rank SIGABRT README's Status row on #15 notes), where is not known: at
    # the teardown, this leaves it out; before its result is written, the test still fails (nothing to read).
    os._exit(0)


def test_delayed_feedback_counts_restored_on_more_ranks_are_shared_out_not_copied_to_each_rank(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On another world size every rank restored the sum of all ranks' counts: 2 ranks restoring one rank's
    (40 positives, 10 delayed) each held (40, 10), and their next checkpoint's --unshard (and any later restore on
    another world size) summed them to (80, 20): the job's counts doubled at each such restart."""
    import json

    import torch.multiprocessing as mp

    from learner import checkpoint, sharded_checkpoint

    first = learner(tmp_path, monkeypatch)
    try:
        first._build(CFG)
        a_round(first, rows(16, T0))
        first.trainer.delayed.load_state_dict({"positives": 40, "delayed": 10})
        first.save()
    finally:
        first.close()
    mp.spawn(_two_ranks_restore_and_save, args=(str(tmp_path / "store2"), str(tmp_path / "ckpt"),
                                                str(tmp_path / "out")), nprocs=2, join=True)
    got = [json.loads((tmp_path / f"out-{r}.json").read_text()) for r in (0, 1)]
    assert {k: got[0][k] + got[1][k] for k in ("positives", "delayed")} == {"positives": 40, "delayed": 10}
    assert got[0] == {"positives": 20, "delayed": 5}  # each rank its share: the prior weighs as much against it
    single = checkpoint.load(sharded_checkpoint.unshard(tmp_path / "ckpt", tmp_path / "single"))
    assert single["delayed_weights"] == {"positives": 40, "delayed": 10}


def _two_ranks_admit_and_save(rank: int, world: int, directory: str, id_capacity: int = 0) -> None:
    """A gloo rank's work: admit 8 samples of its own (impression ids ``<rank>-<k>``) into its recent ids (a window
    of 8), then the job's checkpoint. ``id_capacity`` > 0: user and item ids get own rows (``default_config``), each
    rank's share of them in its ``rank-<r>.pt``."""
    import learner.sharded_daemon as sd
    from learner.features import default_config
    from learner.kafka_dataset import to_tensors_empty

    sd.new_consumer = lambda *a, **k: NoBroker()  # type: ignore[assignment]  # (a process of its own)
    ls = LearnerSettings(checkpoint_dir=Path(directory), mlp="8", buckets=16, ctx_buckets=8, embedding_dim=4,
                         dedup_window=8, id_capacity=id_capacity)
    cfg = default_config({"genres": "multi"}, buckets=16, ctx_buckets=8, embedding_dim=4, id_capacity=id_capacity)
    lr = sd.ShardedLearner(KafkaSettings(bootstrap_servers="127.0.0.1:9"), ls, RankContext(rank, world))
    try:
        lr._build(cfg)
        batch = to_tensors(sample_batch(np.random.default_rng(rank), 8, start=0, prefix=f"{rank}-"), cfg,
                           [(rank, 0, 8)])
        lr._admit(batch, to_tensors_empty(cfg, None))
        lr.save()
    finally:
        lr.close()


def test_unshard_keeps_every_ranks_newest_recent_ids_so_one_process_resumed_from_it_drops_their_duplicates(
        tmp_path: Path) -> None:
    """--unshard wrote the ranks' recent ids one rank after the other, and a single process loads the last
    ``dedup_window`` of them: only the last rank's survived (as in the sharded restore before ``load_merged``), so a
    joiner's retry of rank 0's newest samples was trained a second time by the learner resumed from the export."""
    from learner import checkpoint, sharded_checkpoint
    from learner.daemon import RecentIds
    from tests.unit.learner.gloo_ranks import in_turn, run_gloo_ranks

    works = [(_two_ranks_admit_and_save, (str(tmp_path / "ckpt"),))]
    assert run_gloo_ranks(2, str(tmp_path / "store2"), in_turn, lambda r: (works,)) == [0, 0]
    single = checkpoint.load(sharded_checkpoint.unshard(tmp_path / "ckpt", tmp_path / "single"))
    recent = RecentIds(8)  # the single process's window, as it loads its checkpoint (learner/daemon.py)
    recent.load(single["recent_ids"])
    retried = np.array(["0-7", "0-6", "1-7", "1-6"])  # each rank's two newest, delivered again
    assert recent.filter(retried).tolist() == [False, False, False, False]


@pytest.mark.parametrize(("part", "value", "named"), [
    ("delayed_weights", {"positives": -20, "delayed": 0}, "delayed_weights"),  # S divided by zero on every batch
    ("base_rate_bias", {"positives": 1, "rate": 1.0}, "base_rate_bias"),  # its logit divided by zero
    # a field of another type or a missing one (a TypeError, a KeyError) is as damaged: they were raised bare
    ("base_rate_bias", {"positives": 1, "rate": None}, "rate None is not a click rate"),
    ("metrics", {"neg": [], "loss_sum": 0.0, "count": 0}, "KeyError: 'pos'"),
    ("duplicates", True, '"duplicates" is \'True\''),  # int() read it as 1 duplicate
])
def test_a_rank_state_no_training_makes_refuses_the_sharded_checkpoint_naming_it_the_state_and_the_value(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, part: str, value: dict[str, Any], named: str) -> None:
    """A rank-<r>.pt edited or damaged (no checksum covers it) with counts no stream counts: loaded, every batch of
    the rank raised (each batch's messages struck); refused bare, a ValueError named neither the checkpoint nor the
    fix. It is a damaged checkpoint, as a torn rank file is."""
    import torch

    from learner import checkpoint, sharded_checkpoint

    first = learner(tmp_path, monkeypatch)
    try:
        first._build(CFG)
        a_round(first, rows(16, T0))
        path = first.save()
    finally:
        first.close()
    rank0 = path / "rank-0.pt"
    state = checkpoint.load(rank0)
    state[part] = value
    rank0.unlink()
    torch.save(state, rank0)
    again = learner(tmp_path, monkeypatch)
    try:
        with pytest.raises(checkpoint.CheckpointError) as err:
            again._restore()
        assert str(path) in str(err.value) and named in str(err.value) and "the one before it" in str(err.value)
    finally:
        again.close()
    assert sharded_checkpoint.latest(tmp_path / "ckpt") is not None  # (left in place for the operator)


def _two_ranks_restore(rank: int, world: int, directory: str, out: str, id_capacity: int = 0) -> None:
    """A gloo rank's work: restore the checkpoint in ``directory`` (written with ``id_capacity``); write what happened
    to ``out``-<rank>.txt (the CheckpointError's message, or "resumed")."""
    import learner.sharded_daemon as sd
    from learner import checkpoint

    sd.new_consumer = lambda *a, **k: NoBroker()  # type: ignore[assignment]  # (a process of its own)
    ls = LearnerSettings(checkpoint_dir=Path(directory), mlp="8", buckets=16, ctx_buckets=8, embedding_dim=4,
                         dedup_window=8, id_capacity=id_capacity)
    lr = sd.ShardedLearner(KafkaSettings(bootstrap_servers="127.0.0.1:9"), ls, RankContext(rank, world))
    try:
        try:
            lr._restore()
            said = "resumed"
        except checkpoint.CheckpointError as exc:
            said = f"CheckpointError: {exc}"
        Path(f"{out}-{rank}.txt").write_text(said)
    finally:
        lr.close()


def test_a_rank_state_only_rank_0_reads_refuses_the_sharded_checkpoint_on_every_rank_together(tmp_path: Path) -> None:
    """Rank 0 alone loads the quality metrics (its calibration, clock and id metrics too): a damaged value there was
    refused on rank 0 only, and rank 1 went on into its next collective with a rank 0 that had left (it failed there,
    or waited out the collective timeout, naming neither the checkpoint nor the fix). Every rank refuses it, rank 1
    naming rank 0 and its reason."""
    import torch

    from learner import checkpoint
    from tests.unit.learner.gloo_ranks import in_turn, run_gloo_ranks

    assert run_gloo_ranks(2, str(tmp_path / "store-save"), in_turn,
                          lambda r: ([(_two_ranks_admit_and_save, (str(tmp_path / "ckpt"),))],)) == [0, 0]
    path = next((tmp_path / "ckpt").glob("dcp-*"))
    rank0 = path / "rank-0.pt"
    state = checkpoint.load(rank0)
    assert "served" in state
    state["served"] = {**state["served"], "forced": -1}
    rank0.unlink()
    torch.save(state, rank0)
    works = [(_two_ranks_restore, (str(tmp_path / "ckpt"), str(tmp_path / "out")))]
    assert run_gloo_ranks(2, str(tmp_path / "store-restore"), in_turn, lambda r: (works,)) == [0, 0]
    said = [(tmp_path / f"out-{r}.txt").read_text() for r in (0, 1)]
    assert all(s.startswith("CheckpointError") and str(path) in s and "forced" in s for s in said), said
    assert "rank 0 refused it" in said[1]


def test_a_rank_0_state_of_another_type_refuses_the_sharded_checkpoint_on_every_rank_together(tmp_path: Path) -> None:
    """A state only rank 0 reads that is a list where a map belongs (the id metrics here) raised an AttributeError
    (``.get`` of a list), which the restore did not take for damage: rank 0 left with it bare, naming neither the
    checkpoint nor the fix, and rank 1 waited in the refusals' all-gather for a rank 0 that had gone. Every rank
    refuses it, rank 1 naming rank 0 and its reason."""
    import torch

    from learner import checkpoint
    from tests.unit.learner.gloo_ranks import in_turn, run_gloo_ranks

    assert run_gloo_ranks(2, str(tmp_path / "store-save"), in_turn,
                          lambda r: ([(_two_ranks_admit_and_save, (str(tmp_path / "ckpt"),))],)) == [0, 0]
    path = next((tmp_path / "ckpt").glob("dcp-*"))
    rank0 = path / "rank-0.pt"
    state = checkpoint.load(rank0)
    state["id_metrics"] = [0.3]
    rank0.unlink()
    torch.save(state, rank0)
    works = [(_two_ranks_restore, (str(tmp_path / "ckpt"), str(tmp_path / "out")))]
    assert run_gloo_ranks(2, str(tmp_path / "store-restore"), in_turn, lambda r: (works,)) == [0, 0]
    said = [(tmp_path / f"out-{r}.txt").read_text() for r in (0, 1)]
    assert all(s.startswith("CheckpointError") and str(path) in s and "AttributeError" in s for s in said), said
    assert "rank 0 refused it" in said[1]


def test_an_id_map_share_only_its_rank_reads_refuses_the_sharded_checkpoint_on_every_rank_together(
        tmp_path: Path) -> None:
    """Rank 1 alone loads its own share of an id map (its counters, free stack, candidates): a damaged value there
    was refused on rank 1 only, inside the ids' load, and rank 0 went on into the rows' move and the next collectives
    with a rank 1 that had left (it failed there, or waited out the collective timeout, naming neither the
    checkpoint nor the fix). Every rank refuses it before the move, rank 0 naming rank 1 and its reason."""
    import torch

    from learner import checkpoint
    from tests.unit.learner.gloo_ranks import in_turn, run_gloo_ranks

    assert run_gloo_ranks(2, str(tmp_path / "store-save"), in_turn,
                          lambda r: ([(_two_ranks_admit_and_save, (str(tmp_path / "ckpt"), 32))],)) == [0, 0]
    path = next((tmp_path / "ckpt").glob("dcp-*"))
    rank1 = path / "rank-1.pt"
    state = checkpoint.load(rank1)
    share = next(iter(state["id_shards"].values()))["map"]
    share["counters"] = {**share["counters"], "edited": 1}  # every rank sums the counters; only rank 1 loads them
    rank1.unlink()
    torch.save(state, rank1)
    works = [(_two_ranks_restore, (str(tmp_path / "ckpt"), str(tmp_path / "out"), 32))]
    assert run_gloo_ranks(2, str(tmp_path / "store-restore"), in_turn, lambda r: (works,)) == [0, 0]
    said = [(tmp_path / f"out-{r}.txt").read_text() for r in (0, 1)]
    assert all(s.startswith("CheckpointError") and str(path) in s and "edited" in s for s in said), said
    assert "rank 1 refused it" in said[0]
