"""The distributed mode's pieces in one process: the partition split, the lock-step decisions, the rank context
from torchrun's environment, and TorchRec's fused row-wise Adagrad making the single-process optimizer's update
(a world of one gloo rank: the whole table on it), and which rank sends which touched rows in a serving delta."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from learner.batch import to_tensors
from learner.distributed import LockStep, RankContext, partitions_of
from learner.features import default_config
from learner.model import DeepFM
from learner.optim import RowWiseAdagrad
from learner.progressive import ProgressiveMetrics
from stream.config import KafkaSettings
from stream.errors import ConfigError
from tests.fsync_faults import failing_directory_fsync
from tests.integration.test_learner import sample_batch


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_every_partition_goes_to_exactly_one_rank(world: int) -> None:
    parts = list(range(10))
    owned = [p for r in range(world) for p in partitions_of(parts, r, world)]
    assert sorted(owned) == parts
    assert partitions_of(parts, 1 % world, world) == [p for p in parts if p % world == 1 % world]


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("num_workers", [1, 2, 3, 4])
def test_every_dataloader_worker_of_a_rank_gets_a_share_of_its_partitions_differing_by_at_most_one(
        world: int, num_workers: int) -> None:
    """Rank 1 of 2 reads the odd partitions: dealt by ``p % num_workers`` over 2 workers, one worker got all of them
    and the other sat idle. Each rank's partitions go to its workers exactly once, as evenly as they can."""
    for topic_partitions, rank in itertools.product([1, 2, 4, 5, 8, 12, 13], range(world)):
        parts = list(range(topic_partitions))  # Kafka numbers a topic's partitions 0..P-1
        ranks = partitions_of(parts, rank, world)
        shares = [partitions_of(parts, rank, world, w, num_workers) for w in range(num_workers)]
        assert sorted(p for share in shares for p in share) == ranks  # nothing lost, nothing twice
        sizes = [len(share) for share in shares]
        assert max(sizes) - min(sizes) <= 1, (topic_partitions, rank, shares)
        if len(ranks) >= num_workers:
            assert min(sizes) >= 1, (topic_partitions, rank, shares)


def test_a_partition_added_later_goes_to_the_worker_that_would_have_read_it_from_the_start() -> None:
    """A reader asks one partition at a time whether it is its own (``KafkaSampleDataset._owns``): the answer for a
    partition the topic gains while it reads cannot depend on the partitions listed before it."""
    for p in range(12):
        owner = [w for w in range(3) if partitions_of([p], p % 2, 2, w, 3)]
        assert owner == [w for w in range(3) if p in partitions_of(list(range(12)), p % 2, 2, w, 3)]
        assert len(owner) == 1


def test_a_round_has_the_most_steps_any_rank_needs_each_as_large_as_the_largest_chunk() -> None:
    lock = LockStep(step_rows=100)
    # one process: its own rows only
    assert lock.agree(250, False, False, False, 0).steps == (100, 100, 50)
    assert lock.agree(0, False, False, False, 0).steps == ()


def test_the_job_stops_for_a_signal_max_samples_or_when_every_input_ended() -> None:
    assert LockStep(10).agree(0, True, False, False, 0).stop == "input idle"
    assert LockStep(10).agree(5, True, False, False, 0).stop is None  # rows still to train this round
    assert LockStep(10).agree(5, False, False, True, 0).stop == "signal"
    assert LockStep(10, max_samples=100).agree(5, False, False, False, 100).stop == "max samples"
    assert LockStep(10, max_samples=100).agree(5, False, True, False, 99).checkpoint


def test_rank_context_comes_from_torchruns_environment() -> None:
    assert not RankContext.from_env({}).distributed
    ctx = RankContext.from_env({"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1", "MASTER_PORT": "29500",
                                "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RESTART_COUNT": "1"})
    assert ctx.distributed and ctx.rank == 1 and ctx.backend == "gloo" and ctx.agent_store and ctx.restart_count == 1
    assert RankContext.from_env({"WORLD_SIZE": "2"}, "cuda").backend == "nccl"
    with pytest.raises(ConfigError):
        RankContext.from_env({"WORLD_SIZE": "2", "RANK": "2"})
    with pytest.raises(ConfigError):
        RankContext.from_env({"WORLD_SIZE": "two"})


@pytest.mark.parametrize("env", [{"MASTER_PORT": "abc"}, {"MASTER_PORT": "70000"},
                                 {"TORCHELASTIC_RESTART_COUNT": "x"}, {"LOCAL_RANK": "-1"}])
def test_torchruns_other_variables_with_nonsense_are_a_config_error_not_a_traceback(env: dict[str, str]) -> None:
    with pytest.raises(ConfigError, match="torchrun sets them"):
        RankContext.from_env({"WORLD_SIZE": "2", "RANK": "0", **env})



def test_torchrec_fused_rowwise_adagrad_makes_the_single_process_update(one_rank_group: None) -> None:
    from learner.sharded_model import ShardedDeepFM, feature_names, shard, table_weight
    from learner.sharded_trainer import ShardedTrainer

    cfg = default_config({"genres": "multi"}, buckets=300, ctx_buckets=50, embedding_dim=8)
    lr, acc0 = 0.05, 1e-5
    plain = DeepFM(cfg, mlp=(16,), seed=1, autocast_dtype=None)
    sharded = ShardedDeepFM(cfg, (16,), 0.0, 1, None, table_device=torch.device("meta"))
    dmp = shard(sharded, 1, torch.device("cpu"), lr, 1e-8, acc0, seed=1)
    d = cfg.embedding_dim
    with torch.no_grad():
        for s in table_weight(dmp).local_shards():  # one rank: the whole table
            s.tensor.zero_()
            s.tensor[:, :d + 1] = plain.sparse.bag.weight
        for name, p in sharded.named_parameters():
            if not name.startswith("sparse."):
                p.copy_(plain.get_parameter(name))
    batch = to_tensors(sample_batch(np.random.default_rng(0), 64), cfg)
    # the single process: sparse gradient, then learner/optim.py's row-wise Adagrad
    opt = RowWiseAdagrad(plain.sparse_parameters(), lr=lr, initial_accumulator=acc0)
    plain.train()
    F.binary_cross_entropy_with_logits(plain(batch.values, batch.offsets, batch.dense), batch.labels).backward()
    opt.step()
    # the sharded model: fbgemm's fused EXACT_ROWWISE_ADAGRAD in the backward
    trainer = ShardedTrainer(dmp, torch.optim.SGD([p for n, p in sharded.named_parameters()
                                                   if not n.startswith("sparse.")], lr=0.0),
                             feature_names(cfg), torch.device("cpu"), ProgressiveMetrics())
    trainer.test_then_train(batch, len(batch))
    after = torch.cat([s.tensor for s in table_weight(dmp).local_shards()])  # (num_rows, W)
    moved = (plain.sparse.bag.weight.detach() - after[:, :d + 1]).abs().max()
    assert float(moved) < 1e-6
    assert float((after[:, d + 1:]).abs().max()) == 0.0  # padding columns never move
    assert int((opt.state[plain.sparse.bag.weight]["sum"] > acc0).sum()) > 10  # rows were updated at all


def test_the_single_process_path_imports_no_torchrec() -> None:
    import subprocess
    import sys

    code = ("import sys, streamrec.commands.train, learner.daemon, learner.distributed, learner.sharded_checkpoint; "
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torchrec', 'fbgemm_gpu')); "
            "assert not bad, bad")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]


def test_the_ranks_progressive_metrics_merge_into_those_of_all_their_samples() -> None:
    from learner.sharded_checkpoint import merged_metrics

    rng = np.random.default_rng(4)
    labels = (rng.random(3000) < 0.3).astype(np.float64)
    probs = np.clip(0.3 + 0.3 * (labels - 0.3) + rng.normal(0, 0.2, 3000), 0.01, 0.99)
    whole = ProgressiveMetrics(window=5000)
    whole.update(probs, labels)
    parts = []
    for sel in (slice(0, 1000), slice(1000, 3000)):  # two ranks' samples
        m = ProgressiveMetrics(window=5000)
        m.update(probs[sel], labels[sel])
        parts.append({"metrics": m.state_dict()})
    merged = merged_metrics(parts, window=5000)
    assert merged.count == 3000
    assert merged.auc == pytest.approx(whole.auc, abs=1e-12)
    assert merged.logloss == pytest.approx(whole.logloss, rel=1e-9)
    assert merged.auc != pytest.approx(merged_metrics(parts[:1], window=5000).auc, abs=1e-6)  # not one rank's


def test_the_ranks_full_windows_merge_into_a_window_of_every_ranks_newest_samples_not_the_last_ranks_alone() -> None:
    """merged_metrics concatenated the ranks' windows and the window kept the last ``window`` samples: with every
    rank's window full, the last rank's alone. The job's window AUC and logloss (the summary, every checkpoint's meta,
    --unshard's checkpoint, rank 0 after a restore on another world size) were then of one rank's rows."""
    from learner.sharded_checkpoint import merged_metrics

    parts = []
    for probs in ([0.11, 0.12, 0.13, 0.14], [0.21, 0.22, 0.23, 0.24]):  # rank 0's, rank 1's window, oldest first
        m = ProgressiveMetrics(window=4)
        m.update(np.array(probs), np.array([0.0, 1.0, 0.0, 1.0]))
        parts.append({"metrics": m.state_dict()})
    window = merged_metrics(parts, window=4)._window_arrays()[0]
    assert sorted(window.tolist()) == [0.13, 0.14, 0.23, 0.24]  # the two newest of each rank

def test_each_rank_sends_the_touched_rows_of_its_own_shard_and_together_they_send_each_once() -> None:
    from learner.sharded_deltas import rows_in_shard, union_rows

    # three ranks' lookups since the last delta (any rank may look up rows of any shard), row-wise shards of a
    # 10-row table: [0, 4), [4, 8), [8, 10)
    looked_up = [np.array([9, 1, 1, 4]), np.array([], dtype=np.int64), np.array([0, 9, 7])]
    union = union_rows(looked_up)
    assert union.tolist() == [0, 1, 4, 7, 9]
    picks = [rows_in_shard(union, lo, hi) for lo, hi in ((0, 4), (4, 8), (8, 10))]
    assert [p.tolist() for p in picks] == [[0, 1], [4, 7], [9]]
    assert np.concatenate(picks).tolist() == union.tolist()  # every touched row once, from the rank that holds it
    assert union_rows([]).tolist() == []


def test_a_delta_round_is_decided_together_like_a_checkpoint() -> None:
    assert LockStep(10).agree(5, False, False, False, 0, wants_delta=True).delta
    assert not LockStep(10).agree(5, False, True, False, 0).delta


def test_a_sharded_delta_carries_the_touched_rows_first_d_plus_1_columns_and_the_dense_weights(
        one_rank_group: None, tmp_path: Path) -> None:
    from learner.delta_writer import DeltaWriter
    from learner.deltas import PENDING, list_deltas, load_delta
    from learner.sharded_deltas import ShardedDeltas
    from learner.sharded_model import ShardedDeepFM, feature_names, shard, table_weight
    from learner.sharded_trainer import ShardedTrainer

    cfg = default_config({"genres": "multi"}, buckets=300, ctx_buckets=50, embedding_dim=6)  # W = 8: 1 pad column
    model = ShardedDeepFM(cfg, (16,), 0.0, 1, None, table_device=torch.device("meta"))
    dmp = shard(model, 1, torch.device("cpu"), 0.05, 1e-8, 0.0, seed=1)
    dense = [p for n, p in model.named_parameters() if not n.startswith("sparse.")]
    trainer = ShardedTrainer(dmp, torch.optim.Adam(dense, lr=1e-2), feature_names(cfg), torch.device("cpu"),
                             ProgressiveMetrics())
    (tmp_path / "deltas").mkdir()
    # rows marked by a learner before a restart and in no delta: rank 0's writer sends them with the first delta
    (tmp_path / "deltas" / PENDING).write_bytes(np.array([3, 5], "<i8").tobytes())
    deltas = ShardedDeltas(cfg.num_rows, cfg.embedding_dim, 0.5,
                           DeltaWriter(tmp_path / "deltas", cfg.num_rows, every_s=0.5, lineage="l1"))
    batch = to_tensors(sample_batch(np.random.default_rng(0), 64), cfg)
    trainer.test_then_train(batch, len(batch))
    deltas.mark(batch.values)
    deltas.sync()  # a checkpoint round: the rank's marks reach the writer's durable pending list
    listed = np.frombuffer((tmp_path / "deltas" / PENDING).read_bytes(), "<i8")
    assert set(listed.tolist()) == set(batch.values.tolist()) | {3, 5} and not deltas.touched.any()
    path = deltas.write(dmp, model, 64)
    assert path is not None and [p for _, _, p in list_deltas(tmp_path / "deltas")] == [path]
    assert not (tmp_path / "deltas" / PENDING).exists()  # everything listed is in the durable delta
    d = load_delta(path)
    table = torch.cat([s.tensor for s in table_weight(dmp).local_shards()])  # (num_rows, W)
    assert d.rows.tolist() == sorted(set(batch.values.tolist()) | {3, 5})
    assert d.vectors.shape == (len(d.rows), cfg.embedding_dim + 1)  # D + 1: the padding is not sent
    assert torch.equal(d.vectors, table[d.rows, :cfg.embedding_dim + 1])
    assert d.samples_trained == 64 and d.lineage == "l1" and d.seq == 1
    # DeepFM's names, all of which serving's apply_delta requires: calibration at the identity (off on N ranks)
    assert set(d.dense_state) == {n for n, _ in model.named_parameters() if not n.startswith("sparse.")} | {
        "calibration"}
    assert d.dense_state["calibration"].tolist() == [1.0, 0.0]
    for n, p in model.named_parameters():
        if not n.startswith("sparse."):
            assert torch.equal(d.dense_state[n], p.detach().float())
    assert deltas.write(dmp, model, 64) is None  # nothing touched since


def test_a_peers_failure_seen_in_a_collective_is_told_apart_from_a_ranks_own_error() -> None:
    from learner.distributed import is_peer_failure

    gloo = RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:4501: "
                        "Connection reset by peer.")
    assert is_peer_failure(gloo) and is_peer_failure(dist.DistBackendError("NCCL error: remote process exited"))
    assert not is_peer_failure(RuntimeError("injected fault: training failed on a poison sample"))
    assert not is_peer_failure(IndexError("index 7 is out of bounds"))


def test_building_the_sharded_model_prints_none_of_torchrecs_advice_about_its_own_internals(
        one_rank_group: None, caplog: pytest.LogCaptureFixture) -> None:
    import logging
    import warnings

    from learner.sharded_model import _TORCHREC_ADVICE_LOGGERS, ShardedDeepFM, shard

    cfg = default_config({"genres": "multi"}, buckets=300, ctx_buckets=50, embedding_dim=8)
    levels = [logging.getLogger(n).level for n in _TORCHREC_ADVICE_LOGGERS]
    with warnings.catch_warnings(record=True) as seen, caplog.at_level(logging.WARNING):
        warnings.simplefilter("always")
        shard(ShardedDeepFM(cfg, (16,), 0.0, 1, None, table_device=torch.device("meta")), 1, torch.device("cpu"),
              0.05, 1e-8, 1e-5, seed=1)
    assert not [w for w in seen if issubclass(w.category, FutureWarning) and "torchrec" in w.filename]
    assert not [r for r in caplog.records if r.name.startswith("torchrec")]
    assert [logging.getLogger(n).level for n in _TORCHREC_ADVICE_LOGGERS] == levels  # put back as they were


def test_a_huge_dense_value_never_makes_the_sharded_trainers_adam_state_infinite(one_rank_group: None) -> None:
    """As the single-process Trainer (tests/unit/learner/test_dense_overflow.py): a batch with dense 3e38 (which
    SampleBatch.decode refuses) made Adam's exp_avg_sq inf for good."""
    from learner.sharded_model import ShardedDeepFM, feature_names, shard
    from learner.sharded_trainer import ShardedTrainer
    from stream.samples import SampleBatch

    cfg = default_config({}, buckets=300, ctx_buckets=50, embedding_dim=4, dense=("price",))
    model = ShardedDeepFM(cfg, (8,), 0.0, 1, None, table_device=torch.device("meta"))
    dmp = shard(model, 1, torch.device("cpu"), 0.05, 1e-8, 0.0, seed=1)
    dense = [p for n, p in model.named_parameters() if not n.startswith("sparse.")]
    opt = torch.optim.Adam(dense, lr=1e-2)
    trainer = ShardedTrainer(dmp, opt, feature_names(cfg), torch.device("cpu"), ProgressiveMetrics())
    for price in (3e38, 1.0, 1.0):
        n = 8
        sb = SampleBatch.from_columns(
            impression_id=[f"i{k}" for k in range(n)], ts=np.full(n, 1_700_000_000_000), label=np.arange(n) % 2,
            label_delay_ms=np.zeros(n), user_id=np.arange(n), item_id=np.arange(n), history=[[]] * n,
            dense={"price": np.r_[np.float32(price), -np.float32(price), np.ones(n - 2, np.float32)]})
        batch = to_tensors(sb, cfg)
        trainer.test_then_train(batch, len(batch))
    states = [s["exp_avg_sq"] for s in opt.state.values() if "exp_avg_sq" in s]
    assert states and all(bool(torch.isfinite(s).all()) for s in states)
    assert trainer.overflow_steps == 1


def _two_ranks(rank: int, world: int, out: str) -> None:
    """One of 2 gloo ranks (``two_ranks``): a suspect's round, a failed round told through the store, and a stop
    signal on rank 1 while rank 0 waits for the first samples; the results in ``out``-<rank>.json."""
    import json
    import time
    from types import SimpleNamespace

    from learner import distributed, sharded_daemon

    real = sharded_daemon.infer_feature_config
    try:
        got: dict = {}
        rnd = LockStep(10).agree(25 if rank == 0 else 5, False, False, False, 0, suspect=rank == 1)
        got["turn"], got["steps"] = rnd.turn, list(rnd.steps)  # rank 1's suspect alone: rank 0's 25 rows wait
        got["idle"] = LockStep(10).agree(0 if rank == 0 else 5, True, False, False, 0, suspect=rank == 1).stop
        assert distributed.round_failed_elsewhere() is None
        dist.barrier()
        if rank == 0:
            distributed.mark_round_failed(0, ValueError("bad row"))
        dist.barrier()
        got["failed"] = distributed.round_failed_elsewhere()
        # the waiting loop: rank 0 finds no samples (no exit_when_idle), rank 1 got SIGTERM
        sharded_daemon.infer_feature_config = lambda *a, **k: time.sleep(0.2)  # None: nothing arrived yet
        learner = sharded_daemon.ShardedLearner.__new__(sharded_daemon.ShardedLearner)
        learner.ls, learner.kafka, learner.limits = SimpleNamespace(exit_when_idle_s=None), None, None
        learner.ctx, learner._stop = RankContext(rank, 2), rank == 1
        got["config"] = learner._fresh_config()
        Path(f"{out}-{rank}.json").write_text(json.dumps(got))
    finally:
        sharded_daemon.infer_feature_config = real


def test_two_ranks_train_a_suspect_alone_share_a_failed_round_and_any_ranks_stop_ends_the_wait(
        two_ranks: Path) -> None:
    import json

    for rank in (0, 1):
        got = json.loads((two_ranks / f"suspect-{rank}.json").read_text())
        assert got["turn"] == 1 and got["steps"] == [5]
        assert got["idle"] is None  # rank 1's suspect waits for its round: not idle
        assert got["failed"] == "rank 0: ValueError: bad row"
        assert got["config"] is None  # rank 1's SIGTERM stopped rank 0's wait too


def _settings_of_each_rank(rank: int, world: int, tmp: str, out: str) -> None:
    """One of 2 gloo ranks (``gloo_rank``): check_same_settings on settings as each rank's host would give them, and
    hold_checkpoint_dir on a directory in use; what each call raised in ``out``."""
    import errno
    import json

    from learner.config import LearnerSettings
    from learner.rank_checks import check_same_settings, hold_checkpoint_dir
    from stream.config import KafkaSettings

    ckpt, kafka = Path(tmp) / "ckpt", KafkaSettings(samples_topic="samples")
    # rank 1's settings; rank 0's are LearnerSettings(checkpoint_dir=ckpt, step_rows=100)
    cases: dict[str, dict[str, object]] = {
        # rank 1 mounts the same directory at another path, and has its own loader and metrics port: fine
        "same": dict(checkpoint_dir=Path(tmp) / "mount", num_workers=2, metrics_port=9100),
        "step_rows": dict(checkpoint_dir=ckpt, step_rows=50),
        "lr_dense": dict(checkpoint_dir=ckpt, lr_dense=0.01),
        "checkpoint_dir": dict(checkpoint_dir=Path(tmp) / "elsewhere"),
    }
    got: dict[str, str | None] = {}
    for name, mine in cases.items():
        ls = (LearnerSettings(**{"step_rows": 100, **mine}) if rank  # type: ignore[arg-type]
              else LearnerSettings(checkpoint_dir=ckpt, step_rows=100))
        try:
            check_same_settings(kafka, ls, rank)
            got[name] = None
        except ConfigError as exc:
            got[name] = str(exc)
    from stream.limits import EventLimits

    try:  # rank 1's environment raises [limits] max_str_len: its partitions' long ids trained, rank 0's dead-lettered
        check_same_settings(kafka, LearnerSettings(checkpoint_dir=ckpt, step_rows=100), rank,
                            EventLimits(max_str_len=4096 if rank else 256))
        got["limits"] = None
    except ConfigError as exc:
        got["limits"] = str(exc)
    from learner import rank_checks

    def full(path: Path, data: object) -> None:  # rank 0's disk is full when it writes the .group token
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    real, rank_checks.write_atomic = rank_checks.write_atomic, full if rank == 0 else rank_checks.write_atomic
    try:
        check_same_settings(kafka, LearnerSettings(checkpoint_dir=ckpt, step_rows=100), rank)
        got["full"] = None
    except ConfigError as exc:
        got["full"] = str(exc)
    finally:
        rank_checks.write_atomic = real
    try:  # the test holds ckpt's LOCK, as a running learner does
        hold_checkpoint_dir(LearnerSettings(checkpoint_dir=ckpt), rank)
        got["locked"] = None
    except ConfigError as exc:
        got["locked"] = str(exc)
    Path(out).write_text(json.dumps(got))


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The module's 2-rank runs in one spawn (``gloo_ranks.in_turn``; each rank's start imports torch, torchrec and
    this module), each in a directory of its own under the one returned: the settings checks (on ``settings/``, its
    ckpt's LOCK held here as another learner would), the failed checkpoints (full disk, unreadable metadata), the
    checksums read once, and the suspect's round last (it stubs the daemon's probe, restored at its end)."""
    import fcntl
    import os

    from tests.unit.learner.gloo_ranks import in_turn, run_gloo_ranks

    runs = tmp_path_factory.mktemp("two_ranks")
    settings = runs / "settings"
    (settings / "ckpt").mkdir(parents=True)
    (settings / "mount").symlink_to(settings / "ckpt")  # another host's mount point of the same directory
    lock = os.open(settings / "ckpt" / "LOCK", os.O_RDWR | os.O_CREAT, 0o644)  # another job's rank 0, or a learner
    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.write(lock, b"4242\n")

    def works(r: int) -> tuple[list[tuple[object, tuple]]]:
        return ([(_settings_of_each_rank, (str(settings), str(runs / f"settings-{r}.json"))),
                 (_two_ranks_one_full_disk, (str(runs / "full_disk"), str(runs / "full_disk"))),
                 (_two_ranks_one_unreadable_metadata, (str(runs / "unreadable"), str(runs / "unreadable"))),
                 (_two_ranks_check_a_checkpoint, (str(runs / "checksums"), str(runs / "checksums"))),
                 (_two_ranks, (str(runs / "suspect"),))],)

    try:
        assert run_gloo_ranks(2, str(runs / "store"), in_turn, works, timeout_s=300) == [0, 0]
    finally:
        os.close(lock)
    return runs


def test_ranks_started_with_different_settings_directories_or_on_one_in_use_all_stop_at_start_naming_why(
        two_ranks: Path) -> None:
    import json

    tmp = two_ranks / "settings"
    outs = [str(two_ranks / f"settings-{r}.json") for r in range(2)]
    for out in outs:  # every rank decides the same: none is left waiting in a collective
        got = json.loads(Path(out).read_text())
        assert f"{tmp / 'ckpt'} is in use by another learner (pid 4242, holding LOCK)" in got["locked"]
        assert got["same"] is None
        assert "step_rows: rank 0 100, rank 1 50" in got["step_rows"]
        assert "lr_dense: rank 0 0.001, rank 1 0.01" in got["lr_dense"]
        assert "[limits] max_str_len: rank 0 256, rank 1 4096" in got["limits"]
        assert (f"rank 0 writes {tmp / 'ckpt'} but rank 1's {tmp / 'elsewhere'} is not that directory"
                in got["checkpoint_dir"])
        # rank 0 could not write the .group token (a full disk): every rank stops with its error, none waits for it
        assert got["full"] == json.loads(Path(outs[0]).read_text())["full"]
        assert (f"{tmp / 'ckpt'}: rank 0 cannot write its .group (the file system is full (no space left on "
                "device)" in got["full"])


def test_ranks_whose_brokers_name_different_kafka_clusters_are_refused_naming_bootstrap_servers_and_each_rank() -> None:
    """The ranks' ``(bootstrap_servers, topic identity)``: another address of rank 0's cluster is fine; another
    cluster (a host's config pointing elsewhere), or brokers that give no ids at different addresses, are not."""
    from learner.rank_checks import cluster_mismatch

    a = {"cluster_id": "clusterA", "topic_id": "topicA"}
    assert cluster_mismatch([("kafka-1:9092", a), ("kafka-2:9092", dict(a))]) is None  # two brokers of one cluster
    assert cluster_mismatch([("kafka-1:9092", a), ("kafka-2:9092", {"cluster_id": "clusterA"})]) is None
    assert cluster_mismatch([("127.0.0.1:19092", {}), ("127.0.0.1:19092", {})]) is None  # no ids, one address
    why = cluster_mismatch([("kafka-1:9092", a), ("kafka-1:9092", dict(a)),
                            ("dr-kafka:9092", {"cluster_id": "clusterB", "topic_id": "topicB"})])
    assert why is not None and why.startswith("[kafka] bootstrap_servers: ")
    assert "rank 0 'kafka-1:9092' (cluster clusterA, topic id topicA)" in why
    assert "rank 2 'dr-kafka:9092' (cluster clusterB, topic id topicB)" in why
    assert "give every rank the same [kafka] bootstrap_servers" in why
    assert cluster_mismatch([("kafka-1:9092", a), ("kafka-1:9092", {"cluster_id": "clusterA", "topic_id": "B"})])
    assert cluster_mismatch([("kafka-1:9092", a), ("dr-kafka:9092", {})]) is not None  # cannot tell: refused


def test_a_rank_restored_against_another_kafka_cluster_stops_before_reading_its_partitions_at_the_checkpoints_offsets(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 1 of 2, its host's bootstrap_servers pointing at another cluster than rank 0's: ``_partitions`` (every
    rank, before the dataset seeks the restored offsets) raises the ConfigError; it used to take rank 0's partition
    list and read its own cluster's partitions from rank 0's cluster's offsets. The collectives are faked: rank 0's
    answer is given, and nothing may go on to the partition list's broadcast."""
    from learner import rank_checks, sharded_daemon
    from learner.config import LearnerSettings
    from learner.distributed import RankContext
    from learner.sharded_daemon import ShardedLearner

    def read_on(_: object) -> object:
        raise AssertionError("rank 1 went on to read its partitions")

    mine = {"cluster_id": "clusterB", "topic_id": "topicB"}
    monkeypatch.setattr(sharded_daemon, "topic_identity", lambda kafka, topic: dict(mine))
    monkeypatch.setattr(rank_checks, "all_gather_objects",
                        lambda obj: [("kafka-1:9092", {"cluster_id": "clusterA", "topic_id": "topicA"}), obj])
    monkeypatch.setattr(sharded_daemon, "broadcast_object", read_on)
    learner = ShardedLearner(KafkaSettings(bootstrap_servers="dr-kafka:9092"),
                             LearnerSettings(checkpoint_dir=tmp_path / "ckpt"), RankContext(rank=1, world_size=2))
    try:
        with pytest.raises(ConfigError, match=r"rank 1 'dr-kafka:9092' \(cluster clusterB"):
            learner._partitions()
    finally:
        learner.close()


def test_ranks_on_a_directory_of_single_process_checkpoints_refuse_to_start_a_fresh_model_there(
        tmp_path: Path) -> None:
    from learner import checkpoint, sharded_daemon
    from learner.config import LearnerSettings
    from learner.distributed import RankContext

    (tmp_path / "ckpt-000000000000800-1.pt").write_bytes(b"a single-process checkpoint")
    learner = sharded_daemon.ShardedLearner.__new__(sharded_daemon.ShardedLearner)
    learner.ls, learner.ctx = LearnerSettings(checkpoint_dir=tmp_path), RankContext()  # (no collective runs)
    with pytest.raises(ConfigError, match="holds single-process checkpoints .newest ckpt-000000000000800-1.pt"):
        learner._restore()
    learner.ls = LearnerSettings(checkpoint_dir=tmp_path / "empty")
    left = checkpoint.lineage(tmp_path / "empty")  # an earlier training's LINEAGE, its checkpoints moved away
    assert learner._restore() is False  # a fresh directory: a fresh sharded model
    assert checkpoint.lineage(tmp_path / "empty") != left  # of a new lineage: its deltas never reach that artifact


def test_unshard_refuses_a_directory_of_sharded_checkpoints_as_its_destination(tmp_path: Path) -> None:
    from learner import checkpoint, sharded_checkpoint

    (tmp_path / "dcp-000000000000800-1").mkdir()
    (tmp_path / "dcp-000000000000800-1" / sharded_checkpoint.META).write_text("{}")
    with pytest.raises(checkpoint.CheckpointError, match="holds sharded checkpoints"):
        sharded_checkpoint.unshard(tmp_path, tmp_path)
    assert checkpoint.list_checkpoints(tmp_path) == []  # nothing written beside them


def test_a_sharded_checkpoint_that_lost_or_tore_a_part_is_named_with_the_part_not_loaded_into_a_traceback(
        tmp_path: Path) -> None:
    import json

    import torch.distributed.checkpoint as dcp

    from learner import checkpoint, sharded_checkpoint

    path = tmp_path / "dcp-000000000000800-1"
    dcp.save({"model": {"w": torch.arange(1000.0)}}, checkpoint_id=str(path))  # one process: __0_0.distcp
    for r in (0, 1):
        (path / f"rank-{r}.pt").write_bytes(b"a rank's state")
    (path / sharded_checkpoint.META).write_text(json.dumps({"world_size": 2, "samples_trained": 800}))
    assert sharded_checkpoint.latest(tmp_path) is not None  # complete
    (path / "rank-1.pt").unlink()
    with pytest.raises(checkpoint.CheckpointError, match=r"\(written by 2 ranks\) lacks rank-1\.pt: "):
        sharded_checkpoint.latest(tmp_path)
    (path / "rank-1.pt").write_bytes(b"back")
    with open(path / "__0_0.distcp", "r+b") as fh:
        fh.truncate(100)
    with pytest.raises(checkpoint.CheckpointError, match=r"lacks __0_0\.distcp \(100 of its \d+ bytes\)"):
        sharded_checkpoint.unshard(tmp_path, tmp_path / "single")
    (path / ".metadata").unlink()
    with pytest.raises(checkpoint.CheckpointError, match=r"lacks \.metadata \(FileNotFoundError\)"):
        sharded_checkpoint.latest(tmp_path)


def test_a_ranks_state_file_from_another_sharded_checkpoint_is_refused_not_loaded_beside_this_ones_shards(
        tmp_path: Path) -> None:
    """rank-<r>.pt holds the rank's shares of the id maps, whose rows are the DCP shards': one copied in from another
    checkpoint (a restore from backups, an operator's copy) mapped ids onto rows that hold other ids' vectors."""
    from learner import checkpoint, sharded_checkpoint

    def save(step: int) -> Path:
        return sharded_checkpoint.save(tmp_path, {"model": {"w": torch.full((8,), float(step))}},
                                       {"step": step}, {"samples_trained": step, "world_size": 1}, 0)

    older, newer = save(100), save(200)
    path, meta = sharded_checkpoint.latest(tmp_path)
    assert path == newer and sharded_checkpoint.rank_states(path, meta)[0]["step"] == 200
    (newer / "rank-0.pt").write_bytes((older / "rank-0.pt").read_bytes())
    with pytest.raises(checkpoint.CheckpointError, match=r"rank-0\.pt .*" + older.name):
        sharded_checkpoint.rank_states(*sharded_checkpoint.latest(tmp_path))


@pytest.mark.parametrize("damage", ["torn", "emptied"])
def test_a_ranks_state_file_that_does_not_load_is_refused_naming_it_and_the_fix_not_a_raw_torch_error(
        tmp_path: Path, damage: str) -> None:
    """No checksum covers rank-<r>.pt, and lost_parts checks only that it is there: a torn one ended the ranks'
    restore and --unshard in torch's RuntimeError ("failed finding central directory"), an emptied one in a bare
    EOFError, naming neither the file nor what to do."""
    from learner import checkpoint, sharded_checkpoint

    path = sharded_checkpoint.save(tmp_path, {"model": {"w": torch.zeros(8)}}, {"step": 1},
                                   {"samples_trained": 100, "world_size": 1}, 0)
    data = (path / "rank-0.pt").read_bytes()
    (path / "rank-0.pt").write_bytes(data[:len(data) // 2] if damage == "torn" else b"")
    with pytest.raises(checkpoint.CheckpointError, match=r"rank-0\.pt does not load .*move .* out of"):
        sharded_checkpoint.rank_states(*sharded_checkpoint.latest(tmp_path))


def test_a_sharded_delta_without_the_id_maps_holds_back_the_rows_given_to_other_ids(
        one_rank_group: None, tmp_path: Path) -> None:
    """Serving maps ids with the maps of the last delta that carried them: a sharded delta without maps that sent
    the row of an evicted id, now another id's, served the evicted id the new owner's vector until the next maps.
    Through the sharded daemon's own round steps (map the ids, mark, train; a delta round)."""
    from learner.config import LearnerSettings
    from learner.deltas import list_deltas, load_delta
    from learner.row_mapper import RowMapper
    from learner.sharded_daemon import ShardedLearner
    from stream.config import KafkaSettings
    from stream.samples import SampleBatch

    ls = LearnerSettings(checkpoint_dir=tmp_path / "ckpt", mlp="8", buckets=16, ctx_buckets=8, embedding_dim=4,
                         id_capacity=2, admit_after=1, deltas_every_s=1.0, deltas_dir=tmp_path / "deltas",
                         deltas_id_maps_every_s=60.0)
    cfg = default_config({}, buckets=16, ctx_buckets=8, embedding_dim=4, id_capacity=2, admit_after=1)
    learner = ShardedLearner(KafkaSettings(bootstrap_servers="127.0.0.1:9"), ls, RankContext())
    try:
        learner._build(cfg)
        assert learner.deltas is not None and learner.deltas.writer is not None and learner.trainer is not None
        now = [0.0]
        learner.deltas.writer.clock = lambda: now[0]

        def train(users: list[int], start: int) -> torch.Tensor:
            n = len(users)
            kept = to_tensors(SampleBatch.from_columns(
                impression_id=[f"i{start}-{k}" for k in range(n)], ts=np.full(n, start * 1000, np.int64),
                label=np.arange(n) % 2, label_delay_ms=np.zeros(n), user_id=np.array(users),
                item_id=np.ones(n, np.int64), history=[[] for _ in range(n)], context={}), cfg)
            learner._map_ids(kept)
            learner.deltas.mark(kept.values)  # type: ignore[union-attr]
            learner.trainer.test_then_train(kept, n)  # type: ignore[union-attr]
            return kept.values[:n]  # (n,) the users' rows (user_id is the first field)

        old_rows = train([101, 102], 0)
        assert (old_rows >= 16).all()  # their own rows
        learner._write_delta()  # the first delta carries the maps
        now[0] = 1.0
        for k in range(3):  # two new users take both rows
            new_rows = train([201, 202], 10 + k)
        assert set(new_rows.tolist()) == set(old_rows.tolist())
        learner._write_delta()  # the maps are not due: no maps in this one
        deltas = [load_delta(p) for _, _, p in list_deltas(tmp_path / "deltas")]
        assert [d.id_maps is not None for d in deltas] == [True, False]
        assert not set(deltas[1].rows.tolist()) & set(old_rows.tolist())  # the rows given to 201, 202 wait
        now[0] = 61.0
        learner._write_delta()  # the maps are due: the held rows go out with them
        deltas = [load_delta(p) for _, _, p in list_deltas(tmp_path / "deltas")]
        assert [d.id_maps is not None for d in deltas] == [True, False, True]
        assert set(old_rows.tolist()) <= set(deltas[2].rows.tolist())  # with the maps that say whose they are
        served = RowMapper.from_state(cfg, deltas[2].id_maps)
        assert served.rows(0, np.array([201, 202])).tolist() == new_rows.tolist()
    finally:
        learner.close()


def test_the_first_sharded_delta_after_a_restart_resends_every_admitted_ids_row_with_the_maps(
        one_rank_group: None, tmp_path: Path) -> None:
    """A restart rolls the id maps back to its checkpoint's: ids 101, 102 on the two own rows again, while serving
    holds those rows' vectors of 201, 202 from the deltas after the checkpoint. The first delta after the restart
    carried the checkpoint's maps but only the rows the replay touched, so serving gave 101 (or 102) the vector of
    the id its row had gone to. (The single process: tests/unit/learner/test_restart_id_maps.py.)"""
    from learner.config import LearnerSettings
    from learner.deltas import list_deltas, load_delta
    from learner.sharded_daemon import ShardedLearner
    from stream.config import KafkaSettings
    from stream.samples import SampleBatch

    ls = LearnerSettings(checkpoint_dir=tmp_path / "ckpt", mlp="8", buckets=16, ctx_buckets=8, embedding_dim=4,
                         id_capacity=2, admit_after=1, deltas_every_s=1.0, deltas_dir=tmp_path / "deltas",
                         deltas_id_maps_every_s=0.0)
    cfg = default_config({}, buckets=16, ctx_buckets=8, embedding_dim=4, id_capacity=2, admit_after=1)
    kafka = KafkaSettings(bootstrap_servers="127.0.0.1:9")

    def train(learner: ShardedLearner, users: list[int], start: int) -> torch.Tensor:
        n = len(users)
        kept = to_tensors(SampleBatch.from_columns(
            impression_id=[f"i{start}-{k}" for k in range(n)], ts=np.full(n, start * 1000, np.int64),
            label=np.arange(n) % 2, label_delay_ms=np.zeros(n), user_id=np.array(users),
            item_id=np.ones(n, np.int64), history=[[] for _ in range(n)], context={}), cfg)
        learner._map_ids(kept)
        learner.deltas.mark(kept.values)  # type: ignore[union-attr]
        learner.trainer.test_then_train(kept, n)  # type: ignore[union-attr]
        return kept.values[:n]  # (n,) the users' rows (user_id is the first field)

    first = ShardedLearner(kafka, ls, RankContext())
    try:
        first._build(cfg)
        old_rows = train(first, [101, 102], 0)
        assert (old_rows >= 16).all()
        first.save()
        for k in range(3):  # two new users take both rows; a delta with the maps tells serving
            new_rows = train(first, [201, 202], 10 + k)
        assert set(new_rows.tolist()) == set(old_rows.tolist())
        first._write_delta()
    finally:
        first.close()
    again = ShardedLearner(kafka, ls, RankContext())
    try:
        assert again._restore()
        train(again, [101], 20)  # the replay, up to the first delta: 102's row is not touched
        again._write_delta()
        [(_, _, path)] = list_deltas(tmp_path / "deltas")  # (the first run's delta, after the checkpoint: removed)
        newest = load_delta(path)
        assert newest.seq == 2 and newest.id_maps is not None  # (numbered past the removed one)
        assert set(old_rows.tolist()) <= set(newest.rows.tolist())  # 101's and 102's restored vectors, resent
    finally:
        again.close()


def test_a_failed_sharded_delta_with_the_id_maps_leaves_them_due_and_the_held_rows_held(
        one_rank_group: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0's writer reset the maps' clock before its write, so a delta with the maps that failed (a full disk)
    made the next round one without them: the rows a restarted writer restored from its pending list (which were
    held before the restart, unknown to it) went out under the old maps."""
    import learner.delta_writer as deltas_module
    from learner.delta_writer import DeltaWriter
    from learner.sharded_deltas import ShardedDeltas

    first = DeltaWriter(tmp_path, 32, every_s=1.0, id_maps_every_s=60.0)
    first.mark(torch.tensor([3, 7]))
    first.hold(np.array([7]))  # row 7 went to another id; the process stops before the delta with the maps
    first.sync()
    writer = DeltaWriter(tmp_path, 32, every_s=1.0, id_maps_every_s=60.0)
    deltas = ShardedDeltas(32, 4, 1.0, writer)
    deltas.id_maps = (default_config({}, buckets=16), dict)
    monkeypatch.setattr(deltas_module, "write_atomic", lambda path, data: (_ for _ in ()).throw(OSError(28, "full")))
    union, wants_maps = deltas._exchange()
    assert wants_maps and union.tolist() == [3, 7]
    assert writer.write_rows(torch.from_numpy(union), torch.zeros(2, 5), {}, 10, {}) is None
    union, wants_maps = deltas._exchange()  # the next round: the maps again, so row 7 may go
    assert wants_maps and union.tolist() == [3, 7]


def test_an_idle_sharded_learner_builds_no_id_maps_for_a_delta_it_does_not_write(
        one_rank_group: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing touched since the last delta: the round writes nothing, but every rank built its share's id maps
    (``ShardedRowMapper.state_dict``) for it, and again at every due time while idle, since no delta with the maps
    reset their clock. (The table is a plain tensor here: the row-wise shard of one rank is the whole table.)"""
    import learner.sharded_deltas as sharded_deltas
    from learner.delta_writer import DeltaWriter
    from learner.deltas import list_deltas
    from learner.sharded_deltas import ShardedDeltas

    monkeypatch.setattr(sharded_deltas, "table_weight", lambda dmp: dmp)
    monkeypatch.setattr(sharded_deltas, "local_pieces", lambda weight: [(0, weight)])
    cfg = default_config({}, buckets=16, ctx_buckets=8, embedding_dim=4)
    model = DeepFM(cfg, mlp=(8,), seed=1, autocast_dtype=None)
    table = model.sparse.bag.weight.detach()  # (num_rows, D + 1)
    deltas = ShardedDeltas(cfg.num_rows, 4, 1.0, DeltaWriter(tmp_path, cfg.num_rows, every_s=1.0))
    built: list[int] = []
    deltas.id_maps = (cfg, lambda: built.append(1) or {})  # type: ignore[func-returns-value]
    for _ in range(5):  # idle rounds, the maps due all along
        assert deltas.write(table, model, 0) is None
    assert built == []
    deltas.mark(torch.tensor([3]))
    assert deltas.write(table, model, 1) is not None
    assert built == [1] and len(list_deltas(tmp_path)) == 1


def test_a_dcp_data_file_copied_in_from_another_sharded_checkpoint_is_refused_naming_it(tmp_path: Path) -> None:
    """Only the data files' sizes were checked: a ``__0_0.distcp`` of another step, the same size (a restore from
    backups, an operator's copy), loaded that step's table beside this checkpoint's id maps and offsets."""
    import json

    from learner import checkpoint, sharded_checkpoint

    def save(step: int) -> Path:
        return sharded_checkpoint.save(tmp_path, {"model": {"w": torch.full((8,), float(step))}},
                                       {"step": step}, {"samples_trained": step, "world_size": 1}, 0)

    older, newer = save(100), save(200)
    assert sharded_checkpoint.latest(tmp_path) is not None
    (newer / "__0_0.distcp").write_bytes((older / "__0_0.distcp").read_bytes())
    with pytest.raises(checkpoint.CheckpointError, match=r"lacks __0_0\.distcp \(its sha256 is not the one"):
        sharded_checkpoint.latest(tmp_path)
    meta = json.loads((newer / sharded_checkpoint.META).read_text())
    del meta["sha256"]  # a checkpoint written before the checksums: its sizes alone are checked, as then
    (newer / sharded_checkpoint.META).write_text(json.dumps(meta))
    assert sharded_checkpoint.latest(tmp_path) is not None


def _two_ranks_check_a_checkpoint(rank: int, world: int, directory: str, out: str) -> None:
    """One of 2 gloo ranks (``two_ranks``): a sharded checkpoint saved, its files' sha256 read by each rank at save
    and at ``latest()``, then a file damaged; what each rank read and raised in ``out``-<rank>.json."""
    import json

    from learner import checkpoint, sharded_checkpoint

    real = sharded_checkpoint.sha256_file
    try:
        read: list[str] = []
        sharded_checkpoint.sha256_file = lambda p: read.append(Path(p).name) or real(p)  # type: ignore[func-returns-value]
        path = sharded_checkpoint.save(Path(directory), {"model": {f"w{rank}": torch.full((64,), float(rank))}},
                                       {}, {"samples_trained": 1, "world_size": 2}, rank)
        at_save, read[:] = list(read), []
        assert sharded_checkpoint.latest(Path(directory)) is not None
        at_restore = list(read)
        dist.barrier()
        if rank == 0:
            damaged = path / "__1_0.distcp"
            damaged.write_bytes(bytes(damaged.stat().st_size))
        dist.barrier()
        try:
            sharded_checkpoint.latest(Path(directory))
            refused = ""
        except checkpoint.CheckpointError as exc:
            refused = str(exc)
        Path(f"{out}-{rank}.json").write_text(json.dumps({"save": at_save, "restore": at_restore,
                                                          "refused": refused}))
    finally:
        sharded_checkpoint.sha256_file = real


def test_two_ranks_read_a_sharded_checkpoint_once_between_them_to_check_its_sha256_and_both_refuse_a_damaged_file(
        two_ranks: Path) -> None:
    """Every rank hashed every DCP data file at each restore (and rank 0 alone all of them at save, the others
    waiting): N ranks read the checkpoint N times. Each rank now reads its share, and every rank still refuses a
    file another rank found damaged."""
    import json

    got = [json.loads((two_ranks / f"checksums-{rank}.json").read_text()) for rank in (0, 1)]
    files = {".metadata", "__0_0.distcp", "__1_0.distcp"}
    for when in ("save", "restore"):
        assert sorted(got[0][when] + got[1][when]) == sorted(files)  # each file read once, by one rank
    for rank in (0, 1):
        assert "__1_0.distcp (its sha256 is not the one recorded at save" in got[rank]["refused"]


def test_an_artifact_of_a_restarted_sharded_learners_checkpoint_applies_no_delta_of_the_run_it_abandoned(
        one_rank_group: None, tmp_path: Path) -> None:
    """The sharded learner writes delta 1 (8 samples) after its checkpoint (2) and dies; the restart writes delta 2
    (3 samples) and a checkpoint: an artifact of it took delta 1 for a restarted numbering (a rewind) and applied it.
    (The single process: tests/unit/learner/test_fallback_restart_deltas.py.)"""
    from learner import checkpoint, sharded_checkpoint
    from learner.config import LearnerSettings
    from learner.delta_reader import DeltaReader
    from learner.sharded_daemon import ShardedLearner
    from stream.config import KafkaSettings
    from stream.samples import SampleBatch

    ls = LearnerSettings(checkpoint_dir=tmp_path / "ckpt", mlp="8", buckets=16, ctx_buckets=8, embedding_dim=4,
                         deltas_every_s=1.0, deltas_dir=tmp_path / "deltas")
    cfg = default_config({}, buckets=16, ctx_buckets=8, embedding_dim=4)
    kafka = KafkaSettings(bootstrap_servers="127.0.0.1:9")

    def train(learner: ShardedLearner, n: int, start: int) -> None:
        kept = to_tensors(SampleBatch.from_columns(
            impression_id=[f"i{start}-{k}" for k in range(n)], ts=np.full(n, start * 1000, np.int64),
            label=np.arange(n) % 2, label_delay_ms=np.zeros(n), user_id=np.arange(n) + start,
            item_id=np.ones(n, np.int64), history=[[] for _ in range(n)], context={}), cfg)
        learner.deltas.mark(kept.values)  # type: ignore[union-attr]
        learner.trainer.test_then_train(kept, n)  # type: ignore[union-attr]

    first = ShardedLearner(kafka, ls, RankContext())
    try:
        first._build(cfg)
        train(first, 2, 0)
        first.save()
        train(first, 6, 10)
        first._write_delta()  # seq 1, 8 samples: no checkpoint holds it
    finally:
        first.close()
    again = ShardedLearner(kafka, ls, RankContext())
    try:
        assert again._restore()
        train(again, 1, 20)
        again._write_delta()  # seq 2, 3 samples
        again.save()
    finally:
        again.close()
    found = sharded_checkpoint.latest(tmp_path / "ckpt")
    assert found is not None and found[1]["samples_trained"] == 3 and found[1]["delta_seq"] == 2
    reader = DeltaReader(tmp_path / "deltas")
    applied = [d.seq for d in reader.newer(2, 3, checkpoint.lineage(tmp_path / "ckpt"), applied_samples=0)]
    assert (applied, reader.rewinds) == ([], 0)


def test_a_failing_round_strikes_the_messages_of_a_partition_added_while_the_rank_reads(
        one_rank_group: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank's strikes store held the partitions it read at its start: a round that failed with a message of a
    samples partition added since (read without a restart) stopped with "strikes for partitions [1], which this
    store does not hold" in place of the round's own error, and that message's strike was lost."""
    import learner.sharded_daemon as sd
    from learner.config import LearnerSettings
    from stream.config import KafkaSettings
    from stream.strikes import PartitionFileStrikes, Strikes

    ls = LearnerSettings(checkpoint_dir=tmp_path / "ckpt", mlp="8", buckets=16, ctx_buckets=8, embedding_dim=4)
    cfg = default_config({"genres": "multi"}, buckets=16, ctx_buckets=8, embedding_dim=4)
    batch = to_tensors(sample_batch(np.random.default_rng(0), 4), cfg, [(1, 3, 4)])  # partition 1: added

    class Dataset(torch.utils.data.IterableDataset):
        def __iter__(self):  # type: ignore[no-untyped-def]
            yield batch

    def bad_row(*a: object) -> None:
        raise ValueError("a bad row")

    monkeypatch.setattr(sd, "KafkaSampleDataset", lambda *a, **k: Dataset())
    monkeypatch.setattr(sd.ShardedLearner, "_partitions", lambda self: [0])  # the topic at the start
    monkeypatch.setattr(sd.ShardedLearner, "_fresh_config", lambda self: cfg)
    monkeypatch.setattr(sd.ShardedLearner, "_after_round", bad_row)
    learner = sd.ShardedLearner(KafkaSettings(bootstrap_servers="127.0.0.1:9"), ls, RankContext())
    try:
        with pytest.raises(ValueError, match="a bad row"):
            learner.run()
    finally:
        learner.close()
    topic = KafkaSettings().samples_topic
    assert set(Strikes(PartitionFileStrikes(ls.checkpoint_dir, [1]), limit=3).counts) == {(topic, 1, 3)}


def _two_ranks_one_full_disk(rank: int, world: int, directory: str, out: str) -> None:
    """One of 2 gloo ranks: a checkpoint, then one whose rank-1.pt write fails on rank 1 (its disk full), then one
    more; what each rank's second save raised and the newest complete checkpoint after each in ``out``-<rank>.json."""
    import errno
    import json

    from learner import sharded_checkpoint

    def save(samples: int) -> Path:
        return sharded_checkpoint.save(Path(directory), {"model": {f"w{rank}": torch.full((8,), float(samples))}},
                                       {}, {"samples_trained": samples, "world_size": world}, rank)

    first = save(100)
    real = sharded_checkpoint.write_atomic

    def full(path: Path, data: object) -> None:
        if rank == 1 and path.name == "rank-1.pt":
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        real(path, data)  # type: ignore[arg-type]

    sharded_checkpoint.write_atomic = full  # type: ignore[assignment]
    try:
        save(200)
        raised = ""
    except OSError as exc:
        raised = f"{exc.errno} {exc}"
    finally:
        sharded_checkpoint.write_atomic = real
    dist.barrier()
    newest_after_failure = sharded_checkpoint.latest(Path(directory))[0].name  # type: ignore[index]
    tmp_left = sorted(p.name for p in Path(directory).glob(".tmp-*"))
    third = save(300)
    Path(f"{out}-{rank}.json").write_text(json.dumps({
        "first": first.name, "raised": raised, "newest_after_failure": newest_after_failure, "tmp_left": tmp_left,
        "third": third.name, "newest": sharded_checkpoint.latest(Path(directory))[0].name}))  # type: ignore[index]


def test_a_checkpoint_one_ranks_full_disk_fails_fails_on_every_rank_with_its_oserror_and_the_previous_stays_newest(
        two_ranks: Path) -> None:
    """Rank 1 could not write its own state: it raised alone while rank 0 waited in the barrier for it (then failed
    on the peer's exit, a job stopped for a full disk). Every rank now raises the same OSError (the daemon's
    _try_save skips the checkpoint on every rank alike), the half-written one is removed and never complete, the
    previous one stays newest, and the next checkpoint is written by both."""
    import errno
    import json

    got = [json.loads((two_ranks / f"full_disk-{rank}.json").read_text()) for rank in (0, 1)]
    for g in got:
        assert g["raised"].startswith(f"{errno.ENOSPC} ") and "rank 1: OSError" in g["raised"]
        assert g["newest_after_failure"] == g["first"] and g["tmp_left"] == []
        assert g["newest"] == g["third"] and g["third"].startswith("dcp-000000000000300-")
    assert got[0]["first"] == got[1]["first"] and got[0]["third"] == got[1]["third"]


def test_a_sharded_checkpoint_in_place_whose_directory_fsync_failed_counts_as_written_and_commits_no_offsets(
        one_rank_group: None, kafka: KafkaSettings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The checkpoint directory's fsync failed (EIO) after rank 0 renamed the checkpoint into place: it was reported
    failed on every rank (checkpoint_failures_total, "failed" logged) and pruned by the next one, though a restart
    reads it. Now, as one process's (tests/integration/test_learner.py): written, counted as not durable, nothing
    pruned, and the group offsets wait for a durable one."""
    import json
    import os

    from confluent_kafka import TopicPartition
    from prometheus_client import REGISTRY

    from learner import sharded_checkpoint
    from learner.config import LearnerSettings
    from learner.sharded_daemon import ShardedLearner
    from stream.kafka_topics import ensure_topics

    ensure_topics(kafka, [kafka.samples_topic], partitions=1)
    ls = LearnerSettings(checkpoint_dir=tmp_path / "ckpt", mlp="8", buckets=16, ctx_buckets=8, embedding_dim=4,
                         group_id=f"g-{kafka.samples_topic}", keep_checkpoints=1)
    failures, unsure = "streamrec_learner_checkpoint_failures_total", "streamrec_learner_checkpoints_not_durable_total"
    before, unsure_before = (REGISTRY.get_sample_value(n) or 0.0 for n in (failures, unsure))
    fsync = failing_directory_fsync()  # a directory's fsync fails (EIO)

    learner = ShardedLearner(kafka, ls, RankContext())

    def committed() -> int:
        return learner._group.committed([TopicPartition(kafka.samples_topic, 0)], timeout=10)[0].offset

    def saved_offsets() -> list[dict[str, int]]:
        return [json.loads((p / sharded_checkpoint.META).read_text())["offsets"]
                for p in sharded_checkpoint.list_complete(ls.checkpoint_dir)]

    try:
        learner._build(default_config({}, buckets=16, ctx_buckets=8, embedding_dim=4))
        learner.offsets = {0: 1}
        learner.save()  # durable (and the directory's LINEAGE made)
        assert committed() == 1
        with monkeypatch.context() as m:
            m.setattr(os, "fsync", fsync)
            learner.offsets = {0: 3}
            assert learner._try_save()
            learner.offsets = {0: 5}
            assert learner.save().is_dir()  # the one at exit: no OSError either
        assert (REGISTRY.get_sample_value(failures) or 0.0) == before
        assert (REGISTRY.get_sample_value(unsure) or 0.0) == unsure_before + 2  # counted: the directory fills
        assert saved_offsets() == [{"0": 1}, {"0": 3}, {"0": 5}]  # keep_checkpoints = 1: none pruned meanwhile
        assert committed() == 1
        learner.offsets = {0: 6}
        learner.save()  # durable: committed, and pruned to keep_checkpoints
        assert committed() == 6 and saved_offsets() == [{"0": 6}]
    finally:
        learner.close()


def test_a_first_sharded_checkpoint_whose_lineage_files_directory_fsync_fails_is_a_failed_checkpoint_on_every_rank(
        one_rank_group: None, kafka: KafkaSettings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The directory's first checkpoint creates LINEAGE (rank 0, after the shards' agreement): its fsync failing
    raised on rank 0 alone, outside the agreement (the other ranks waited in it for ever; one rank took it for a
    checkpoint written, named after LINEAGE). Now a failed checkpoint on every rank, as one process's."""
    import os

    from prometheus_client import REGISTRY

    from learner import sharded_checkpoint
    from learner.config import LearnerSettings
    from learner.sharded_daemon import ShardedLearner
    from stream.kafka_topics import ensure_topics

    ensure_topics(kafka, [kafka.samples_topic], partitions=1)
    ls = LearnerSettings(checkpoint_dir=tmp_path / "ckpt", mlp="8", buckets=16, ctx_buckets=8, embedding_dim=4,
                         group_id=f"g-{kafka.samples_topic}")
    failures, unsure = "streamrec_learner_checkpoint_failures_total", "streamrec_learner_checkpoints_not_durable_total"
    before, unsure_before = (REGISTRY.get_sample_value(n) or 0.0 for n in (failures, unsure))
    fsync = failing_directory_fsync()  # a directory's fsync fails (EIO)

    learner = ShardedLearner(kafka, ls, RankContext())
    try:
        learner._build(default_config({}, buckets=16, ctx_buckets=8, embedding_dim=4))
        learner.offsets = {0: 1}
        with monkeypatch.context() as m:
            m.setattr(os, "fsync", fsync)
            assert not learner._try_save()
        assert (REGISTRY.get_sample_value(failures) or 0.0) == before + 1
        assert (REGISTRY.get_sample_value(unsure) or 0.0) == unsure_before
        assert sharded_checkpoint.list_complete(ls.checkpoint_dir) == []
    finally:
        learner.close()


def _two_ranks_one_unreadable_metadata(rank: int, world: int, directory: str, out: str) -> None:
    """One of 2 gloo ranks: a checkpoint, then one whose ``.metadata`` rank 1 cannot read back for the checksums (EIO),
    then one more; what each rank's second save raised and what it left in ``out``-<rank>.json."""
    import errno
    import json

    from learner import sharded_checkpoint

    def save(samples: int) -> Path:
        return sharded_checkpoint.save(Path(directory), {"model": {f"w{rank}": torch.full((8,), float(samples))}},
                                       {}, {"samples_trained": samples, "world_size": world}, rank)

    first = save(100)
    real = sharded_checkpoint._data_ends

    def unreadable(path: Path) -> dict[str, int]:
        if rank == 1:
            raise OSError(errno.EIO, "Input/output error", str(path / ".metadata"))
        return real(path)

    sharded_checkpoint._data_ends = unreadable  # type: ignore[assignment]
    try:
        save(200)
        raised = ""
    except OSError as exc:
        raised = f"{exc.errno} {exc}"
    finally:
        sharded_checkpoint._data_ends = real
    dist.barrier()
    newest_after_failure = sharded_checkpoint.latest(Path(directory))[0].name  # type: ignore[index]
    tmp_left = sorted(p.name for p in Path(directory).glob(".tmp-*"))
    third = save(300)
    Path(f"{out}-{rank}.json").write_text(json.dumps({
        "first": first.name, "raised": raised, "newest_after_failure": newest_after_failure, "tmp_left": tmp_left,
        "third": third.name}))


def test_a_checkpoint_whose_metadata_one_rank_cannot_read_back_fails_on_every_rank_not_on_that_rank_alone(
        two_ranks: Path) -> None:
    """The checksums' stage read ``.metadata`` on each rank before its all-gather, outside the agreed stages: rank 1's
    read error (EIO on its mount) left save on rank 1 alone (an OSError the daemon's _try_save skips: it trained on)
    while rank 0 waited in the checksums' all-gather, which the next collective of rank 1 then answered. Every rank
    now raises the same OSError, nothing half-written is left and the next checkpoint is written by both."""
    import errno
    import json

    got = [json.loads((two_ranks / f"unreadable-{rank}.json").read_text()) for rank in (0, 1)]
    for g in got:
        assert g["raised"].startswith(f"{errno.EIO} ") and "rank 1: OSError" in g["raised"]
        assert g["newest_after_failure"] == g["first"] and g["tmp_left"] == []
        assert g["third"].startswith("dcp-000000000000300-")
