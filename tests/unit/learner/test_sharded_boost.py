"""The boost of young rows on N ranks (``learner/sharded_boost.py``): 1 and 2 gloo ranks, each training its half of
every batch through fbgemm's fused row-wise Adagrad plus the boost, end with the table and update counts of one
process training the whole batches with ``learner/optim.py``'s boosted ``RowWiseAdagrad``, and with ids handed
to new owners, their counts start again."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from learner.batch import TensorBatch, to_tensors
from learner.features import default_config
from learner.model import DeepFM
from learner.optim import RowWiseAdagrad
from tests.integration.test_learner import sample_batch
from tests.unit.learner.gloo_ranks import run_gloo_ranks

CFG = default_config({"genres": "multi"}, buckets=300, ctx_buckets=50, embedding_dim=8)
LR, BOOST, HALF_LIFE = 0.05, 3.0, 1.0  # a short half-life: the counts change the factor step by step
STEPS, ROWS = 4, 64


def batch(step: int) -> TensorBatch:
    return to_tensors(sample_batch(np.random.default_rng(step), ROWS), CFG)


def plain_model() -> DeepFM:
    return DeepFM(CFG, mlp=(16,), seed=1, autocast_dtype=None)


def rank_work(rank: int, world: int, out: str) -> None:
    """One rank's training (run by ``gloo_rank``), its result written to ``out``."""
    from learner.progressive import ProgressiveMetrics
    from learner.sharded_boost import ShardedBoost
    from learner.sharded_model import ShardedDeepFM, feature_names, local_pieces, shard, table_weight
    from learner.sharded_trainer import ShardedTrainer

    plain = plain_model()
    sharded = ShardedDeepFM(CFG, (16,), 0.0, 1, None, table_device=torch.device("meta"))
    # initial_accumulator 0: row-wise Adagrad's step is then independent of the gradient's scale, and the
    # ranks' summed per-rank means are twice one process's mean over both halves
    dmp = shard(sharded, world, torch.device("cpu"), LR, 1e-8, 0.0, seed=1)
    d = CFG.embedding_dim
    with torch.no_grad():
        for start, rows in local_pieces(table_weight(dmp)):
            rows.zero_()
            rows[:, :d + 1] = plain.sparse.bag.weight[start:start + rows.shape[0]]
        for name, p in sharded.named_parameters():
            if not name.startswith("sparse."):
                p.copy_(plain.get_parameter(name))
    trainer = ShardedTrainer(dmp, torch.optim.SGD([p for n, p in sharded.named_parameters()
                                                   if not n.startswith("sparse.")], lr=0.0),
                             feature_names(CFG), torch.device("cpu"), ProgressiveMetrics())
    trainer.boost = ShardedBoost(dmp, BOOST, HALF_LIFE)
    for step in range(STEPS):
        b = batch(step)
        half = np.arange(len(b)) % world == rank  # rank r trains rows r, r + world, ...
        trainer.test_then_train(b.select(half), int(half.sum()))
    Path(out).write_bytes(pickle.dumps({
        "rows": [(s, t.clone()) for s, t in local_pieces(table_weight(dmp))],
        "counts": [(s, t.clone()) for s, t in local_pieces(trainer.boost.counts)]}))


@pytest.mark.parametrize("world", [1, 2])
def test_ranks_boost_young_rows_like_one_process(world: int, tmp_path: Path) -> None:
    outs = [str(tmp_path / f"rank{r}.pkl") for r in range(world)]
    assert run_gloo_ranks(world, str(tmp_path / "store"), rank_work, lambda r: (outs[r],)) == [0] * world
    d = CFG.embedding_dim
    table = torch.zeros(CFG.num_rows, d + 1)
    counts = torch.zeros(CFG.num_rows, dtype=torch.int32)
    for o in outs:
        got = pickle.loads(Path(o).read_bytes())
        for s, t in got["rows"]:
            table[s:s + len(t)] = t[:, :d + 1]
            assert not t[:, d + 1:].any()  # padding never moves
        for s, t in got["counts"]:
            counts[s:s + len(t)] = t
    plain, plain_off = plain_model(), plain_model()
    opt = RowWiseAdagrad(plain.sparse_parameters(), lr=LR, initial_accumulator=0.0, boost=BOOST,
                         boost_half_life=HALF_LIFE)
    opt_off = RowWiseAdagrad(plain_off.sparse_parameters(), lr=LR, initial_accumulator=0.0)
    for step in range(STEPS):
        b = batch(step)
        for m, o in ((plain, opt), (plain_off, opt_off)):
            m.train()
            F.binary_cross_entropy_with_logits(m(b.values, b.offsets, b.dense), b.labels).backward()
            o.step()
            o.zero_grad()
    want = plain.sparse.bag.weight.detach()
    assert torch.equal(counts, opt.state[plain.sparse.bag.weight]["updates"])
    assert int((counts > 1).sum()) > 10  # rows updated more than once: the factor changed between their steps
    assert torch.allclose(table, want, atol=2e-5), float((table - want).abs().max())
    # and the boost is what made the difference
    assert float((table - plain_off.sparse.bag.weight.detach()).abs().max()) > 100 * 2e-5
