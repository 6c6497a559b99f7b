"""The learner's health metrics on N ranks (``learner/health.py`` through ``learner/sharded_trainer.py`` and
``learner/sharded_daemon.py``), on 1 and 2 spawned gloo ranks: the gradient norms of the whole model's step (the
ranks' shards combined) equal one process's autograd gradient of the same loss, the update norms a full copy's
change, and a 2-rank job's rank 0 exports the window AUC, the field coverage, the gradient-norm histograms and the
update norms of every rank's rows and steps."""

from __future__ import annotations

import math
import pickle
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from learner.batch import TensorBatch, to_tensors
from learner.features import default_config
from learner.health import FieldCoverage, combine_rank_norms, combine_rank_updates, field_blocks
from tests.integration.test_learner import sample_batch
from tests.unit.learner.gloo_ranks import in_turn, run_gloo_ranks
from tests.unit.learner.test_sharded_boost import BOOST, CFG, HALF_LIFE, LR, batch, plain_model

STEPS = 2


def plain_trainer(world: int, lr: float, dense_lr: float):  # type: ignore[no-untyped-def]
    """A rank's ``ShardedTrainer`` of :func:`plain_model`'s weights (table row-wise Adagrad at ``lr``, dense SGD at
    ``dense_lr``), every step sampled; collective (the DMP's planning)."""
    from learner.health import GradNorms
    from learner.progressive import ProgressiveMetrics
    from learner.sharded_model import ShardedDeepFM, feature_names, local_pieces, shard, table_weight
    from learner.sharded_trainer import ShardedTrainer

    plain = plain_model()
    sharded = ShardedDeepFM(CFG, (16,), 0.0, 1, None, table_device=torch.device("meta"))
    dmp = shard(sharded, world, torch.device("cpu"), lr, 1e-8, 0.0, seed=1)
    d = CFG.embedding_dim
    with torch.no_grad():
        for start, rows in local_pieces(table_weight(dmp)):
            rows.zero_()
            rows[:, :d + 1] = plain.sparse.bag.weight[start:start + rows.shape[0]]
        for name, p in sharded.named_parameters():
            if not name.startswith("sparse."):
                p.copy_(plain.get_parameter(name))
    trainer = ShardedTrainer(dmp, torch.optim.SGD([p for n, p in sharded.named_parameters()
                                                   if not n.startswith("sparse.")], lr=dense_lr),
                             feature_names(CFG), torch.device("cpu"), ProgressiveMetrics())
    trainer.grad_norms, trainer.sample_every_s = GradNorms.of(sharded), 0.0
    return trainer


def trainer_rank(rank: int, world: int, out: str) -> None:
    """One rank's steps (run by ``gloo_rank``) with every step's table gradient measured; its drained norms in
    ``out``. Learning rates 0: the model stays the one the reference differentiates (the Adagrad sums still grow)."""
    trainer = plain_trainer(world, 0.0, 0.0)
    for step in range(STEPS):
        b = batch(step)
        half = np.arange(len(b)) % world == rank  # rank r trains rows r, r + world, ...
        trainer.test_then_train(b.select(half), int(half.sum()))
    Path(out).write_bytes(pickle.dumps(trainer.grad_norms.drain()))


def reference_norms(world: int) -> list[tuple[float, float, dict[str, float]]]:
    """(dense, table, {field: norm}) of each step, by autograd in one process: the ranks' average of their
    mean-loss gradients, for the dense part (DDP) and the table alike (TorchRec's comm ops divide the table's
    gradient by the world size, ``torchrec.distributed.comm_ops.GRADIENT_DIVISION``)."""
    names, starts = field_blocks(CFG)
    ends = starts[1:] + [CFG.num_rows]
    out = []
    for step in range(STEPS):
        model = plain_model()
        b = batch(step)
        parts = [b.select(np.arange(len(b)) % world == r) for r in range(world)]
        table = model.sparse.bag.weight
        loss = sum(F.binary_cross_entropy_with_logits(model(p.values, p.offsets, p.dense), p.labels)
                   for p in parts) / world
        dense = [p for n, p in model.named_parameters() if not n.startswith("sparse.")]
        g_table, *g_dense = torch.autograd.grad(loss, [table, *dense])
        g_table = (g_table.to_dense() if g_table.is_sparse else g_table).double()
        out.append((math.sqrt(sum(float(g.double().square().sum()) for g in g_dense)), float(g_table.norm()),
                    {n: float(g_table[s:e].norm()) for n, s, e in zip(names, starts, ends, strict=True)}))
    return out


@pytest.mark.parametrize("world", [1, 2])
def test_the_ranks_gradient_norms_combined_are_one_processs_gradient_norms_of_the_same_step(
        world: int, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    """The dense norm is the all-reduced gradient's (rank 0's); the table's and each field's come from every
    rank's shard (fbgemm's row-wise Adagrad sums' growth), combined as sqrt(sum of squares). One rank runs in this
    process's group of one; two are the module's spawned ranks."""
    if world == 1:
        request.getfixturevalue("one_rank_group")
        trainer_rank(0, 1, str(tmp_path / "grads0.pkl"))
        outs = [tmp_path / "grads0.pkl"]
    else:
        outs = [request.getfixturevalue("two_ranks") / f"grads{r}.pkl" for r in range(2)]
    steps, blocks = combine_rank_norms([pickle.loads(o.read_bytes()) for o in outs])
    want = reference_norms(world)
    assert len(steps) == len(blocks) == STEPS
    for (dense, table), per_field, (w_dense, w_table, w_fields) in zip(steps, blocks, want, strict=True):
        assert dense == pytest.approx(w_dense, rel=1e-4)
        assert table == pytest.approx(w_table, rel=1e-3) and w_table > 0
        assert per_field == pytest.approx(w_fields, rel=1e-3, abs=1e-9)


def update_rank(rank: int, world: int, lr: float, boost: bool, out: str) -> None:
    """One rank's steps (run by ``gloo_rank``), each sampled: per step the trainer's update norms and a direct
    measure, the squared change of this rank's whole shard (a full copy before and after) and the norm of the dense
    parameters' change (a full copy), in ``out``."""
    from learner.sharded_boost import ShardedBoost
    from learner.sharded_model import local_pieces, table_weight

    trainer = plain_trainer(world, lr, dense_lr=lr)
    if boost:
        trainer.boost = ShardedBoost(trainer.model, BOOST, HALF_LIFE)
    dense = [p for g in trainer.dense_opt.param_groups for p in g["params"]]
    got = []
    for step in range(STEPS):
        b = batch(step)
        half = np.arange(len(b)) % world == rank
        shard0 = [t.clone() for _, t in local_pieces(table_weight(trainer.model))]  # (R, W) each
        dense0 = [p.detach().clone() for p in dense]
        trainer.test_then_train(b.select(half), int(half.sum()))
        shard_sq = sum(float((t.double() - t0.double()).square().sum())
                       for (_, t), t0 in zip(local_pieces(table_weight(trainer.model)), shard0, strict=True))
        dense_norm = math.sqrt(sum(float((p.detach().double() - p0.double()).square().sum())
                                   for p, p0 in zip(dense, dense0, strict=True)))
        got.append((trainer.update_norms.drain(), shard_sq, dense_norm))
    Path(out).write_bytes(pickle.dumps(got))


def rank_updates(runs: Path, name: str) -> list[tuple[dict[str, float], float, float]]:
    """Per step of the 2 ranks' update run ``name`` (of UPDATE_RUNS): (the ranks' update norms combined, the
    table's direct norm, the dense one)."""
    per_rank = [pickle.loads((runs / f"{name}{r}.pkl").read_bytes()) for r in range(2)]
    return [(combine_rank_updates([r[i][0] for r in per_rank]), math.sqrt(sum(r[i][1] for r in per_rank)),
             per_rank[0][i][2]) for i in range(STEPS)]


@pytest.mark.parametrize("boost", [False, True])
def test_the_ranks_update_norms_combined_are_the_whole_models_change_of_the_step(boost: bool, two_ranks: Path) -> None:
    """The sharded learner exported no update norm (model_not_learning never fired on N ranks). The embedding part
    is what the step changed in every rank's shard (the boost's part too, applied after the fused update), the
    dense part what the dense step changed, each equal to a full copy's change."""
    for got, w_table, w_dense in rank_updates(two_ranks, "boost" if boost else "plain"):
        assert w_table > 0 and w_dense > 0
        assert got == pytest.approx({"dense": w_dense, "embedding": w_table}, rel=1e-5)


def test_a_zero_learning_rate_reads_an_embedding_update_norm_of_0_on_two_ranks(two_ranks: Path) -> None:
    """What model_not_learning watches: nothing changes, though the gradients are as large as ever."""
    for got, w_table, w_dense in rank_updates(two_ranks, "zero_lr"):
        assert got == {"dense": 0.0, "embedding": 0.0} and w_table == w_dense == 0.0


DAEMON_CFG = default_config({"genres": "multi"}, buckets=16, ctx_buckets=8, embedding_dim=4)
HEALTH = ["streamrec_learner_window_auc", "streamrec_learner_grad_norm_count", "streamrec_learner_grad_norm_sum",
          "streamrec_learner_field_grad_norm_count", "streamrec_learner_field_coverage",
          "streamrec_learner_update_norm"]


def rank_batches(rank: int) -> list[TensorBatch]:
    """Rank ``rank``'s messages of its partition ``rank``: 3 of 8 samples, ids apart from the other rank's."""
    return [to_tensors(sample_batch(np.random.default_rng(10 * rank + k), 8, start=100 * rank + 8 * k,
                                    prefix=f"r{rank}-"), DAEMON_CFG, [(rank, k, 8)]) for k in range(3)]


def daemon_rank(rank: int, world: int, directory: str, out: str) -> None:
    """One rank of the sharded daemon's run over :func:`rank_batches` (Kafka faked as tests/unit/learner/
    test_sharded_metrics.py does); its summary and its /metrics' health samples in ``out``."""
    from prometheus_client import REGISTRY

    import learner.sharded_daemon as sd
    from learner.config import LearnerSettings
    from learner.distributed import RankContext
    from stream.config import KafkaSettings
    from tests.unit.learner.test_sharded_metrics import NoBroker

    batches = rank_batches(rank)

    class Dataset(torch.utils.data.IterableDataset):
        def __iter__(self):  # type: ignore[no-untyped-def]
            yield from batches

    sd.KafkaSampleDataset = lambda *a, **k: Dataset()  # type: ignore[assignment,misc]
    sd.ShardedLearner._partitions = lambda self: list(range(world))  # type: ignore[method-assign]
    sd.ShardedLearner._fresh_config = lambda self: DAEMON_CFG  # type: ignore[method-assign]
    sd.new_consumer = lambda *a, **k: NoBroker()  # type: ignore[assignment]
    ls = LearnerSettings(checkpoint_dir=Path(directory), mlp="8", buckets=16, ctx_buckets=8, embedding_dim=4,
                         step_rows=4)
    learner = sd.ShardedLearner(KafkaSettings(bootstrap_servers="127.0.0.1:9"), ls, RankContext(rank, world))
    try:
        summary = learner.run()
    finally:
        learner.close()
    samples = {(m.name + s.name.removeprefix(m.name), tuple(sorted(s.labels.items()))): s.value
               for m in REGISTRY.collect() for s in m.samples if s.name in HEALTH}
    Path(out).write_bytes(pickle.dumps((summary, samples)))


def test_two_ranks_export_the_window_auc_coverage_and_gradient_norms_of_every_ranks_rows_on_rank_0(
        two_ranks: Path) -> None:
    """The sharded daemon exported none of them (the feature_stopped_arriving and gradients_vanished rules saw
    nothing on N ranks). Rank 0: the window AUC of both ranks' predictions (the summary's, which merges the ranks'
    windows), each field's coverage over both ranks' rows (one process's FieldCoverage over all of them), the
    histograms of the sampled steps; rank 1: a NaN window AUC and none of the others."""
    (summary, got), (_, other) = (pickle.loads((two_ranks / f"daemon{r}.pkl").read_bytes()) for r in range(2))
    assert summary["samples_trained"] == 48
    window_auc = got[("streamrec_learner_window_auc", ())]
    assert math.isfinite(window_auc) and window_auc == pytest.approx(summary["metrics"]["window_auc"], abs=1e-12)
    coverage = FieldCoverage(DAEMON_CFG, 100_000 // 10)  # metrics_window's default / 10, as the daemons keep it
    for b in rank_batches(0) + rank_batches(1):
        coverage.observe(b)
    want = coverage.shares()
    assert want["history"] < 1.0  # some samples carry no history: a share the ranks must add up, not copy
    assert {f: got[("streamrec_learner_field_coverage", (("field", f),))] for f in want} == pytest.approx(want)
    for part in ("dense", "embedding"):  # the first step is sampled, drained in its round
        assert got[("streamrec_learner_grad_norm_count", (("part", part),))] >= 1
        assert got[("streamrec_learner_grad_norm_sum", (("part", part),))] > 0
    assert got[("streamrec_learner_field_grad_norm_count", (("field", "item_id"),))] >= 1
    for part in ("dense", "embedding"):  # the sampled step's change, both ranks' shards (model_not_learning)
        assert got[("streamrec_learner_update_norm", (("part", part),))] > 0
    assert math.isnan(other[("streamrec_learner_window_auc", ())])
    assert not any(name != "streamrec_learner_window_auc" and v for (name, _), v in other.items())


UPDATE_RUNS = {"plain": (LR, False), "boost": (LR, True), "zero_lr": (0.0, True)}  # name: (lr, boost)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The module's 2-rank runs in one spawn (``gloo_ranks.in_turn``), each rank's results in the directory returned:
    the sharded daemon's first (it reads the process's /metrics before the others run), then the gradient norms'
    steps and each of UPDATE_RUNS, every run on a model of its own."""
    runs = tmp_path_factory.mktemp("two_ranks")

    def works(r: int) -> tuple[list[tuple[Callable[..., None], tuple]]]:
        return ([(daemon_rank, (str(runs / "ckpt"), str(runs / f"daemon{r}.pkl"))),
                 (trainer_rank, (str(runs / f"grads{r}.pkl"),)),
                 *[(update_rank, (lr, boost, str(runs / f"{name}{r}.pkl")))
                   for name, (lr, boost) in UPDATE_RUNS.items()]],)

    assert run_gloo_ranks(2, str(runs / "store"), in_turn, works, timeout_s=300) == [0, 0]
    return runs


def test_a_restarted_sharded_learner_exports_the_window_auc_of_the_samples_before_the_restart(
        one_rank_group: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0's window of every rank's predictions comes back from the checkpoint's (merged) windows, as one process's
    window does: a restart with nothing new to train exports the window AUC it had, not NaN."""
    from prometheus_client import REGISTRY

    from learner.daemon import WINDOW_AUC
    from tests.unit.learner.test_sharded_metrics import CFG as ONE_RANK_CFG
    from tests.unit.learner.test_sharded_metrics import run_sharded

    batches = [to_tensors(sample_batch(np.random.default_rng(k), 8, start=8 * k), ONE_RANK_CFG, [(0, k, 8)])
               for k in range(3)]
    before = run_sharded(tmp_path, monkeypatch, batches)["metrics"]["window_auc"]
    WINDOW_AUC.set(-1.0)
    run_sharded(tmp_path, monkeypatch, [])
    assert math.isfinite(before) and REGISTRY.get_sample_value("streamrec_learner_window_auc") == pytest.approx(before)
