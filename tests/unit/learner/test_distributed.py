"""The distributed mode's pieces in one process: the partition split, the lock-step decisions, the rank context
from torchrun's environment, and TorchRec's fused row-wise Adagrad making the single-process optimizer's update
(a world of one gloo rank: the whole table on it)."""

from __future__ import annotations

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
from stream.errors import ConfigError
from tests.integration.test_learner import sample_batch


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_every_partition_goes_to_exactly_one_rank(world: int) -> None:
    parts = list(range(10))
    owned = [p for r in range(world) for p in partitions_of(parts, r, world)]
    assert sorted(owned) == parts
    assert partitions_of(parts, 1 % world, world) == [p for p in parts if p % world == 1 % world]


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


@pytest.fixture
def one_rank_group(tmp_path: Path):
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


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
