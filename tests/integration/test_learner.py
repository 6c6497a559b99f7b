"""The learner: layouts, optimizer, accumulation, metrics (pure), and exactly-once training under kill -9."""

from __future__ import annotations

import copy
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pytest
import torch

from learner.batch import TensorBatch, concat, to_tensors
from learner.features import FeatureConfig, FieldSpec
from learner.model import DeepFM
from learner.optim import RowWiseAdagrad, make_optimizers
from learner.progressive import ProgressiveMetrics, auc
from learner.trainer import Trainer
from stream.config import KafkaSettings
from stream.kafka_producer import AckedProducer
from stream.kafka_topics import ensure_topics
from stream.samples import SampleBatch
from streamrec.stack import free_port
from tests.bounded_teardown import Reaper
from tests.fsync_faults import failing_directory_fsync
from tests.kafka_io import make_again
from tests.monitoring_io import metric, scrape

if TYPE_CHECKING:
    from learner.config import LearnerSettings
    from learner.daemon import Learner

CFG = FeatureConfig((FieldSpec("user_id", "single", 50), FieldSpec("item_id", "single", 40),
                     FieldSpec("history", "sequence", 40, shares="item_id"), FieldSpec("ctx.genres", "multi", 10)),
                    embedding_dim=4)


def sample_batch(rng: np.random.Generator, n: int, start: int = 0, prefix: str = "i") -> SampleBatch:
    # list values from 1: 0 is stream.features.MISSING, an absent value that a list field's bag leaves out
    hist = [rng.integers(1, 1000, rng.integers(0, 4)).tolist() for _ in range(n)]
    genres = [rng.integers(1, 100, rng.integers(1, 3)).tolist() for _ in range(n)]
    users = rng.integers(0, 1000, n)
    items = rng.integers(0, 1000, n)
    label = ((users + items) % 3 == 0).astype(np.int8)  # learnable
    return SampleBatch.from_columns(
        impression_id=[f"{prefix}{start + k}" for k in range(n)], ts=np.arange(start, start + n),
        label=label, label_delay_ms=np.zeros(n), user_id=users, item_id=items, history=hist,
        context={"genres": genres})


def naive_bags(sb: SampleBatch, cfg: FeatureConfig) -> list[list[int]]:
    """Field-major bags built row by row: the reference for to_tensors."""
    bags = []
    for spec, (first, rows) in zip(cfg.fields, cfg.blocks, strict=True):
        col = sb.batch.column(spec.name).to_pylist()
        for v in col:
            vals = v if isinstance(v, list) else [v]
            bags.append([first + x % rows for x in vals])
    return bags


def bags_of(tb: TensorBatch) -> list[list[int]]:
    o = tb.offsets.tolist()
    v = tb.values.tolist()
    return [v[o[i]:o[i + 1]] for i in range(len(o) - 1)]


def test_to_tensors_concat_and_select_keep_the_field_major_layout() -> None:
    rng = np.random.default_rng(0)
    a, b = sample_batch(rng, 5), sample_batch(rng, 3, start=5)
    ta, tb = to_tensors(a, CFG, [(0, 7, 5)]), to_tensors(b, CFG, [(1, 9, 3)])
    assert bags_of(ta) == naive_bags(a, CFG)
    both = concat([ta, tb], CFG.num_fields)
    f = CFG.num_fields
    ra, rb = naive_bags(a, CFG), naive_bags(b, CFG)
    want = [bag for k in range(f) for bag in ra[k * 5:(k + 1) * 5] + rb[k * 3:(k + 1) * 3]]
    assert bags_of(both) == want and both.positions == [(0, 7, 5), (1, 9, 3)]
    keep = np.array([True, False, True, True, False, False, True, True])
    sel = both.select(keep)
    idx = np.flatnonzero(keep)
    assert bags_of(sel) == [want[k * 8 + i] for k in range(f) for i in idx]
    assert sel.impression_ids.tolist() == [both.impression_ids[i] for i in idx]
    pieces = both.chunks(3)  # 8 rows -> 3 + 3 + 2, in order; the positions travel with the last piece
    assert [len(p) for p in pieces] == [3, 3, 2]
    rejoined = concat(pieces, f)
    assert bags_of(rejoined) == want and rejoined.labels.tolist() == both.labels.tolist()
    assert [p.positions for p in pieces] == [[], [], [(0, 7, 5), (1, 9, 3)]]
    assert both.chunks(8) == [both]


def test_a_non_finite_loss_skips_the_update_and_is_counted_instead_of_raising() -> None:
    rng = np.random.default_rng(2)
    good = to_tensors(sample_batch(rng, 32), CFG)
    model = DeepFM(CFG, mlp=(8,), seed=1, autocast_dtype=None)
    s, d = make_optimizers(model, lr_sparse=0.1, lr_dense=0.01)
    t = Trainer(model, s, d)
    poisoned = to_tensors(sample_batch(rng, 8, start=100), CFG)
    row = int(poisoned.values[0])
    with torch.no_grad():
        model.sparse.bag.weight[row] = float("nan")  # e.g. a row that blew up
    before = {n: p.detach().clone() for n, p in model.named_parameters() if not n.startswith("sparse.")}
    t.test_then_train(poisoned)
    assert t.nan_losses == 1 and t.steps == 0 and t.metrics.count == 0
    for n, p in model.named_parameters():
        if n in before:
            assert torch.equal(p, before[n]), n  # nothing learned from the poisoned batch
    with torch.no_grad():
        model.sparse.bag.weight[row] = 0.0
    t.test_then_train(good)  # and training goes on
    assert t.steps == 1 and t.nan_losses == 1 and t.metrics.count == 32


def test_loss_scaled_sparse_gradients_are_unscaled_and_an_overflow_skips_the_sparse_step() -> None:
    """fp16 on CUDA scales the loss; the scale reaches the sparse embedding gradients too. A CPU GradScaler
    stands in for the CUDA one (same code path): a scaled step must equal an unscaled one, and an overflowing
    scale must leave the table untouched rather than write inf into it."""
    rng = np.random.default_rng(4)
    batch = to_tensors(sample_batch(rng, 32), CFG)
    base = DeepFM(CFG, mlp=(8,), seed=2, autocast_dtype=None)
    tables = []
    for scale in (None, 2.0 ** 12):
        m = copy.deepcopy(base)
        s, d = make_optimizers(m, lr_sparse=0.1, lr_dense=0.01)
        t = Trainer(m, s, d)
        if scale is not None:
            t.scaler = torch.amp.GradScaler("cpu", init_scale=scale)
        t.test_then_train(batch)
        tables.append(m.sparse.bag.weight.detach().clone())
    assert torch.allclose(tables[0], tables[1], atol=1e-6)  # the scale was taken back out of the sparse grads
    m = copy.deepcopy(base)
    m.autocast_dtype = torch.float16  # what CUDA trains in
    s, d = make_optimizers(m, lr_sparse=0.1, lr_dense=0.01)
    t = Trainer(m, s, d)
    t.scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 40)  # fp16 gradients overflow to inf
    t.test_then_train(batch)
    assert torch.equal(m.sparse.bag.weight, base.sparse.bag.weight)  # step skipped, table still finite
    assert t.scaler.get_scale() < 2.0 ** 40 and t.steps == 1


def test_rowwise_adagrad_matches_its_definition() -> None:
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(6, 3))
    ref = w.detach().clone()
    acc = torch.zeros(6)
    opt = RowWiseAdagrad([w], lr=0.1)
    for _ in range(3):
        rows = torch.tensor([1, 4, 1])
        g_rows = torch.randn(3, 3)
        w.grad = torch.sparse_coo_tensor(rows.unsqueeze(0), g_rows, (6, 3), check_invariants=True)
        opt.step()
        dense = torch.zeros(6, 3).index_add_(0, rows, g_rows)  # duplicates summed
        for r in (1, 4):
            acc[r] += dense[r].pow(2).mean()
            ref[r] -= 0.1 * dense[r] / (acc[r].sqrt() + 1e-8)
    assert torch.allclose(w.detach(), ref, atol=1e-6)
    assert opt.state[w]["sum"].shape == (6,)  # one float of state per row


@pytest.mark.parametrize("amp", [None, torch.bfloat16])
def test_accumulated_micro_batches_make_the_update_of_one_big_batch(amp: torch.dtype | None) -> None:
    rng = np.random.default_rng(1)
    sb = sample_batch(rng, 64)
    big = to_tensors(sb, CFG)
    micro = [to_tensors(SampleBatch(sb.batch.slice(i, 16)), CFG) for i in range(0, 64, 16)]
    base = DeepFM(CFG, mlp=(8,), seed=3, autocast_dtype=amp)
    models = []
    for batches, accumulation in (([big], 1), (micro, 4)):
        m = copy.deepcopy(base)
        s, d = make_optimizers(m, lr_sparse=0.1, lr_dense=0.01)
        t = Trainer(m, s, d, accumulation=accumulation)
        for b in batches:
            t.test_then_train(b)
        assert t.steps == 1
        models.append(m)
    tol = 1e-5 if amp is None else 2e-2
    for (name, p1), (_, p2) in zip(models[0].named_parameters(), models[1].named_parameters(), strict=True):
        assert torch.allclose(p1, p2, atol=tol), name
    assert not torch.allclose(models[0].sparse.bag.weight, base.sparse.bag.weight)  # it did learn


def test_progressive_metrics_record_before_learning_and_binned_auc_is_exact_enough() -> None:
    rng = np.random.default_rng(2)
    m = ProgressiveMetrics(window=500)
    scores = rng.random(5000)
    labels = (rng.random(5000) < scores).astype(float)
    for i in range(0, 5000, 250):
        m.update(scores[i:i + 250], labels[i:i + 250])
    assert abs(m.auc - auc(scores, labels)) < 1e-3
    w_auc, _ = m.window_metrics()
    assert w_auc == pytest.approx(auc(scores[-500:], labels[-500:]))
    assert auc(np.array([0.1, 0.1, 0.9]), np.array([0, 1, 1])) == pytest.approx(0.75)  # ties count half


# -- exactly once under kill -9 ---------------------------------------------------------------------
def produce_samples(kafka: KafkaSettings, batches: int, rows: int, pause_s: float) -> dict[int, int]:
    """Samples messages round-robin over 4 partitions; returns rows per partition."""
    rng = np.random.default_rng(7)
    p = AckedProducer(kafka)
    per_partition = {q: 0 for q in range(4)}
    for k in range(batches):
        part = k % 4
        p.send(kafka.samples_topic, sample_batch(rng, rows, start=k * rows).encode(), str(part), partition=part)
        per_partition[part] += rows
        if k % 8 == 7:
            p.flush()
            time.sleep(pause_s)
    p.flush()
    return per_partition


def train_cmd(ckpt: Path, idle: float | None = None) -> list[str]:
    cmd = [sys.executable, "-m", "streamrec.cli", "train", "--checkpoint-dir", str(ckpt), "--batch-rows", "256",
           "--json"]
    return cmd + (["--exit-when-idle", str(idle)] if idle else [])


def checkpoint_status(ckpt: Path, capsys: pytest.CaptureFixture[str]) -> dict:
    """``streamrec train --status --json`` of ``ckpt``, run in this process: it reads the newest checkpoint's meta
    only, and a process of its own spent seconds importing the stack for it."""
    from streamrec.cli import main

    capsys.readouterr()
    assert main(["train", "--checkpoint-dir", str(ckpt), "--status", "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_kill_9_at_random_points_trains_every_sample_exactly_once(kafka: KafkaSettings, tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    ensure_topics(kafka, [kafka.samples_topic])
    env = dict(os.environ, STREAMREC_KAFKA_BOOTSTRAP_SERVERS=kafka.bootstrap_servers,
               STREAMREC_KAFKA_SAMPLES_TOPIC=kafka.samples_topic, STREAMREC_LEARNER_CHECKPOINT_EVERY_S="0.5",
               STREAMREC_LEARNER_BUCKETS="5000", STREAMREC_LEARNER_CTX_BUCKETS="500", STREAMREC_LEARNER_MLP="32",
               STREAMREC_LEARNER_GROUP_ID=f"learner-{kafka.samples_topic}")
    produced: dict[int, int] = {}
    producer = threading.Thread(target=lambda: produced.update(produce_samples(kafka, 240, 100, 0.25)))
    producer.start()
    ckpt = tmp_path / "ckpt"
    rnd = random.Random(11)
    kills = 0
    for _ in range(3):
        proc = subprocess.Popen(train_cmd(ckpt), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(rnd.uniform(2.5, 5.0))
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        kills += 1
    producer.join()
    out = subprocess.run(train_cmd(ckpt, idle=3), env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    total = sum(produced.values())
    assert {int(p): n for p, n in summary["partition_rows"].items()} == produced  # nothing lost, nothing twice
    assert summary["samples_trained"] == total and summary["duplicates_dropped"] == 0
    assert summary["metrics"]["samples"] == total  # each prediction recorded once too
    assert checkpoint_status(ckpt, capsys)["samples_trained"] == total
    assert kills == 3


def test_two_dataloader_workers_split_the_partitions_and_train_every_sample_exactly_once_across_a_kill(
        kafka: KafkaSettings, tmp_path: Path, reaper: Reaper) -> None:
    ensure_topics(kafka, [kafka.samples_topic])
    env = dict(os.environ, STREAMREC_KAFKA_BOOTSTRAP_SERVERS=kafka.bootstrap_servers,
               STREAMREC_KAFKA_SAMPLES_TOPIC=kafka.samples_topic, STREAMREC_LEARNER_CHECKPOINT_EVERY_S="0.5",
               STREAMREC_LEARNER_BUCKETS="5000", STREAMREC_LEARNER_CTX_BUCKETS="500", STREAMREC_LEARNER_MLP="32",
               STREAMREC_LEARNER_NUM_WORKERS="2", STREAMREC_LEARNER_PREFETCH_FACTOR="2",
               STREAMREC_LEARNER_GROUP_ID=f"learner-{kafka.samples_topic}")
    produced: dict[int, int] = {}
    producer = threading.Thread(target=lambda: produced.update(produce_samples(kafka, 160, 100, 0.25)))
    producer.start()
    ckpt = tmp_path / "ckpt"
    proc = reaper.add(subprocess.Popen([*train_cmd(ckpt), "--log-level", "info"], env=env, stdout=subprocess.DEVNULL,
                                       stderr=subprocess.PIPE, text=True, start_new_session=True),
                      group=True)  # its workers too, if they outlive it (what this test checks they do not)
    producer.join()
    time.sleep(1.5)  # the stream has stopped: the workers wait for new samples
    os.kill(proc.pid, signal.SIGKILL)
    # The workers notice their parent is gone and exit (they hold the stderr pipe: communicate waits for them). A
    # worker waiting for new samples stayed an orphan for good: learner/kafka_dataset.py checks its parent.
    first_err = proc.communicate(timeout=30)[1]
    out = subprocess.run([*train_cmd(ckpt, idle=3), "--log-level", "info"], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    total = sum(produced.values())
    assert {int(p): n for p, n in summary["partition_rows"].items()} == produced  # nothing lost, nothing twice
    assert summary["samples_trained"] == total and summary["duplicates_dropped"] == 0
    assert summary["metrics"]["samples"] == total
    split = {"DataLoader worker 0 of 2 reads samples partitions [0, 2]",
             "DataLoader worker 1 of 2 reads samples partitions [1, 3]"}  # worker w of 2 reads p with p % 2 == w
    assert all(line in out.stderr for line in split)
    # the killed run too, if its workers had started by then (the model is built from the first samples first)
    assert {line.split(": ", 1)[1] for line in first_err.splitlines() if "reads samples partitions" in line} <= split


def test_sigterm_checkpoints_and_exits_cleanly(kafka: KafkaSettings, tmp_path: Path, reaper: Reaper,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    ensure_topics(kafka, [kafka.samples_topic])
    produced = produce_samples(kafka, 16, 100, 0.0)
    env = dict(os.environ, STREAMREC_KAFKA_BOOTSTRAP_SERVERS=kafka.bootstrap_servers,
               STREAMREC_KAFKA_SAMPLES_TOPIC=kafka.samples_topic, STREAMREC_LEARNER_BUCKETS="5000",
               STREAMREC_LEARNER_CTX_BUCKETS="500", STREAMREC_LEARNER_MLP="32",
               STREAMREC_LEARNER_CHECKPOINT_EVERY_S="3600", STREAMREC_LEARNER_GROUP_ID=f"l-{kafka.samples_topic}",
               STREAMREC_LEARNER_DELTAS_DIR=str(tmp_path / "deltas"), STREAMREC_LEARNER_DELTAS_EVERY_S="3600")
    ckpt = tmp_path / "ckpt"
    port = free_port()
    env["STREAMREC_LEARNER_METRICS_PORT"] = str(port)
    proc = reaper.add(subprocess.Popen(train_cmd(ckpt), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                       text=True))  # no idle exit: it runs for good unless stopped
    assert proc.stderr is not None
    while "training on" not in proc.stderr.readline():  # started (the daemon runs forever without a bound)
        assert proc.poll() is None, "the learner died at start"
    deadline = time.monotonic() + 120  # until it has trained (a fixed 2 s sleep: under load it had not, yet)
    while not (metric(scrape(f"http://127.0.0.1:{port}/metrics"), "streamrec_learner_samples_total") or 0) > 0:
        assert proc.poll() is None and time.monotonic() < deadline, "the learner trained nothing"
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err[-2000:]
    status = json.loads(out.strip().splitlines()[-1])
    assert status["reason"] == "signal"
    meta = checkpoint_status(ckpt, capsys)
    assert meta["samples_trained"] == status["samples_trained"] <= sum(produced.values())
    # the exit's delta (deltas every hour: the only one) carries what was trained, and the final checkpoint says it
    # includes it: a fresh artifact of it that never reads the delta counts no gap (learner/deltas.py)
    from learner import checkpoint
    from learner.deltas import list_deltas

    (seq, samples, _), = list_deltas(tmp_path / "deltas")
    saved = checkpoint.load_latest(ckpt)
    assert saved is not None and samples == saved.meta["samples_trained"] == status["samples_trained"]
    assert saved.meta["delta_seq"] == seq == 1


def test_a_sigterm_to_the_whole_process_group_stops_a_learner_with_dataloader_workers_cleanly(
        kafka: KafkaSettings, tmp_path: Path, reaper: Reaper) -> None:
    """systemd's default stop (KillMode=control-group), ``kill -TERM -<pgid>``: the workers get the SIGTERM too. They
    died of it, and the learner, stopping on the same signal, failed with "DataLoader worker ... is killed by signal:
    Terminated" and exited 1 without its final checkpoint. Now the workers serve on until the learner shuts them
    down, and it exits as on its own SIGTERM."""
    ensure_topics(kafka, [kafka.samples_topic])
    produce_samples(kafka, 16, 100, 0.0)
    env = dict(os.environ, STREAMREC_KAFKA_BOOTSTRAP_SERVERS=kafka.bootstrap_servers,
               STREAMREC_KAFKA_SAMPLES_TOPIC=kafka.samples_topic, STREAMREC_LEARNER_BUCKETS="5000",
               STREAMREC_LEARNER_CTX_BUCKETS="500", STREAMREC_LEARNER_MLP="32", STREAMREC_LEARNER_NUM_WORKERS="2",
               STREAMREC_LEARNER_PREFETCH_FACTOR="2", STREAMREC_LEARNER_CHECKPOINT_EVERY_S="3600",
               STREAMREC_LEARNER_GROUP_ID=f"l-{kafka.samples_topic}")
    ckpt = tmp_path / "ckpt"
    proc = reaper.add(subprocess.Popen([*train_cmd(ckpt), "--log-level", "info"], env=env, stdout=subprocess.PIPE,
                                       stderr=subprocess.PIPE, text=True, start_new_session=True),  # its own group
                      group=True)
    assert proc.stderr is not None
    while "reads samples partitions" not in proc.stderr.readline():  # the workers run
        assert proc.poll() is None, "the learner died at start"
    time.sleep(1.0)
    os.killpg(proc.pid, signal.SIGTERM)  # the learner and its workers
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err[-2000:]
    status = json.loads(out.strip().splitlines()[-1])
    assert status["reason"] == "signal"
    from learner import checkpoint

    saved = checkpoint.load_latest(ckpt)
    assert saved is not None and saved.meta["samples_trained"] == status["samples_trained"]


def built_learner(kafka: KafkaSettings, ls: LearnerSettings) -> Learner:
    """A Learner whose model is built (as on its first samples) from ``ls``: the default fields and a genre list."""
    from learner.daemon import Learner
    from learner.features import default_config

    learner = Learner(kafka, ls)
    learner._build(default_config({"genres": "multi"}, buckets=ls.buckets, ctx_buckets=ls.ctx_buckets,
                                  embedding_dim=ls.embedding_dim, id_capacity=ls.id_capacity,
                                  admit_after=ls.admit_after, id_init=ls.id_init,
                                  user_bucket_half_life_s=ls.user_bucket_half_life_s), learner._model_settings())
    return learner


def test_a_checkpoint_in_place_whose_directory_fsync_failed_counts_as_written_and_commits_no_offsets(
        kafka: KafkaSettings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The directory's fsync failed (EIO) after the rename: the checkpoint a restart reads was reported failed
    (counted in checkpoint_failures_total, "failed" logged, and at exit the learner stopped with status 1). Now it
    counts as written, and the group offsets (committed only after a durable checkpoint) wait for the next one."""

    from confluent_kafka import TopicPartition
    from prometheus_client import REGISTRY

    from learner import checkpoint
    from learner.config import LearnerSettings

    ensure_topics(kafka, [kafka.samples_topic], partitions=1)
    ls = LearnerSettings(checkpoint_dir=tmp_path / "ckpt", mlp="16", buckets=50, ctx_buckets=20, id_capacity=10,
                         embedding_dim=4, group_id=f"g-{kafka.samples_topic}", keep_checkpoints=1)
    learner = built_learner(kafka, ls)
    failures, unsure = "streamrec_learner_checkpoint_failures_total", "streamrec_learner_checkpoints_not_durable_total"
    before, unsure_before = (REGISTRY.get_sample_value(n) or 0.0 for n in (failures, unsure))
    fsync = failing_directory_fsync()  # a directory's fsync fails (EIO)

    def committed() -> int:
        tp = TopicPartition(kafka.samples_topic, 0)
        return learner._group.committed([tp], timeout=10)[0].offset

    def saved_offsets() -> list[dict[str, int]]:
        return [checkpoint.load(p)["meta"]["offsets"] for p in checkpoint.list_checkpoints(ls.checkpoint_dir)]

    try:
        learner.offsets = {0: 1}
        learner.save()  # durable (and the directory's LINEAGE made)
        assert committed() == 1
        with monkeypatch.context() as m:
            m.setattr(os, "fsync", fsync)
            learner.offsets = {0: 3}
            assert learner._try_save()
            learner.offsets = {0: 5}
            learner.save()  # the one at exit: no OSError either
        assert (REGISTRY.get_sample_value(failures) or 0.0) == before
        assert (REGISTRY.get_sample_value(unsure) or 0.0) == unsure_before + 2  # counted: the directory fills
        assert saved_offsets() == [{"0": 1}, {"0": 3}, {"0": 5}]  # keep_checkpoints = 1: none pruned meanwhile
        assert committed() == 1
        learner.offsets = {0: 6}
        learner.save()  # durable: committed, and pruned to keep_checkpoints
        assert committed() == 6 and saved_offsets() == [{"0": 6}]
    finally:
        learner.close()


def test_a_restore_with_other_model_shaping_settings_names_each_field_and_rates_come_from_the_settings(
        kafka: KafkaSettings, tmp_path: Path) -> None:
    import dataclasses

    from learner.config import CheckpointMismatch, LearnerSettings
    from learner.daemon import Learner

    ls = LearnerSettings(checkpoint_dir=tmp_path / "ckpt", mlp="16", buckets=50, ctx_buckets=20, id_capacity=10,
                         embedding_dim=4, group_id=f"g-{kafka.samples_topic}")
    first = built_learner(kafka, ls)
    first.save()
    first.close()
    other = Learner(kafka, dataclasses.replace(ls, embedding_dim=8, buckets=60, lr_dense=0.5))
    with pytest.raises(CheckpointMismatch) as info:
        other._restore()
    assert set(info.value.fields) == {"embedding_dim", "buckets"}  # the rate may change; the shape may not
    assert info.value.fields["embedding_dim"] == (4, 8) and "new checkpoint_dir" in str(info.value)
    faster = Learner(kafka, dataclasses.replace(ls, lr_dense=0.5, lr_sparse=0.2))
    assert faster._restore()
    assert [g["lr"] for g in faster.trainer.dense_opt.param_groups] == [0.5]
    assert [g["lr"] for g in faster.trainer.sparse_opt.param_groups] == [0.2]


def test_the_dense_clips_history_is_checkpointed_and_its_factor_comes_from_the_settings(
        kafka: KafkaSettings, tmp_path: Path) -> None:
    """learner/grad_clip.py: without its history a restarted learner clipped nothing until 20 steps had passed, so
    an outlier batch right after each restart reached Adam whole."""
    import dataclasses

    from learner.config import LearnerSettings
    from learner.daemon import Learner

    ls = LearnerSettings(checkpoint_dir=tmp_path / "ckpt", mlp="16", buckets=50, ctx_buckets=20, id_capacity=10,
                         embedding_dim=4, group_id=f"g-{kafka.samples_topic}")
    first = built_learner(kafka, ls)
    first.trainer.dense_clip.load_state_dict({"norms": [0.01 * (i + 1) for i in range(30)], "clipped": 3})
    first.save()
    first.close()
    again = Learner(kafka, dataclasses.replace(ls, dense_grad_clip=4.0))
    assert again._restore()
    assert again.trainer.dense_clip.state_dict() == first.trainer.dense_clip.state_dict()
    assert again.trainer.dense_clip.threshold == pytest.approx(4.0 * 0.155)  # today's factor x the saved median
    again.close()


def test_a_checkpoint_of_another_samples_topic_is_refused_naming_both_and_its_event_clock_is_restored(
        kafka: KafkaSettings, tmp_path: Path) -> None:
    """Its offsets belong to the other topic: resumed, they skipped the new topic's messages (38 in the audit's run)
    and reported the other topic's samples as trained, exit 0. And the event clock (learner/event_clock.py) is
    checkpointed: after a restart one row stamped now cannot move it before a quorum of rows has been seen."""
    import dataclasses
    import time as _time

    from learner.config import CheckpointTopicMismatch, LearnerSettings
    from learner.daemon import Learner

    ls = LearnerSettings(checkpoint_dir=tmp_path / "ckpt", mlp="16", buckets=50, ctx_buckets=20, id_capacity=10,
                         embedding_dim=4, group_id=f"g-{kafka.samples_topic}")
    first = built_learner(kafka, ls)
    first._clock.advance(956_703_932_000 + np.arange(100) * 1000)  # a replay of 2000
    first.save()
    first.close()
    other = Learner(dataclasses.replace(kafka, samples_topic=f"{kafka.samples_topic}-recreated"), ls)
    with pytest.raises(CheckpointTopicMismatch, match=f"samples topic '{kafka.samples_topic}'.*-recreated'.*new "
                                                      "checkpoint_dir"):
        other._restore()
    again = Learner(kafka, ls)
    assert again._restore()
    assert again._clock.now_ms == first._clock.now_ms  # the quorum held across the restart ...
    # ... so one row stamped now moves it one row of 2000 on (the next of the 16 newest), not 26 years
    assert again._clock.advance([int(_time.time() * 1000)]) == first._clock.now_ms + 1000
    again.close()


def test_a_checkpoint_of_another_lineage_resumed_in_a_directory_gives_its_lineage_to_the_next_checkpoints_and_deltas(
        kafka: KafkaSettings, tmp_path: Path) -> None:
    """A backup of training B restored into training A's directory (or checkpoints moved to a new volume without
    their LINEAGE): the resumed model is B's, so its checkpoints and deltas are of B's lineage. They carried A's,
    and serving applied B's rows and dense weights to A's artifact
    (learner/checkpoint_lineage.py ``continue_lineage``)."""
    import shutil

    from learner import checkpoint as ck
    from learner.config import LearnerSettings

    def settings(name: str) -> LearnerSettings:
        return LearnerSettings(checkpoint_dir=tmp_path / name, mlp="16", buckets=50, ctx_buckets=20, id_capacity=10,
                               embedding_dim=4, group_id=f"g-{kafka.samples_topic}", deltas_every_s=1.0,
                               deltas_dir=tmp_path / name / "deltas")

    b = built_learner(kafka, settings("b"))
    b.trainer.samples = 500
    b.save()
    b.close()
    a = built_learner(kafka, settings("a"))
    a.trainer.samples = 100
    a.save()
    a.close()
    lineage_a, lineage_b = ((tmp_path / d / ck.LINEAGE).read_text() for d in ("a", "b"))
    assert lineage_a != lineage_b
    for f in (tmp_path / "b").glob("ckpt-*"):  # B's newest checkpoint restored into A's directory
        shutil.copy(f, tmp_path / "a" / f.name)
    resumed = built_learner(kafka, settings("a"))
    assert resumed._restore() and resumed.trainer.samples == 500
    assert resumed.deltas is not None and resumed.deltas.lineage == lineage_b
    resumed.trainer.samples = 600
    resumed.save()
    resumed.close()
    newest = ck.load_latest(tmp_path / "a")
    assert newest is not None and newest.samples_trained == 600 and newest.meta["lineage"] == lineage_b
    assert (tmp_path / "a" / ck.LINEAGE).read_text() == lineage_b


def fake_negative_stream(rng: np.random.Generator, n: int, start: int, seconds: float) -> SampleBatch:
    """``n`` impressions over ``seconds`` of event time from ``start`` (ms) as the joiner's fake_negative policy
    emits them: each an OBSERVED 0 at its time, each click (a learnable rule) a DELAYED_POSITIVE 20 s later."""
    from stream.samples import DELAYED_POSITIVE, OBSERVED

    base = sample_batch(rng, n, start=start)
    ts = start + np.sort(rng.uniform(0, seconds * 1000, n)).astype(np.int64)
    clicked = np.flatnonzero(base.column("label") > 0)
    rows = np.concatenate([np.arange(n), clicked])
    delay = np.concatenate([np.zeros(n, np.int64), np.full(len(clicked), 20_000)])
    order = np.argsort(ts[rows] + delay, kind="stable")
    rows, delay = rows[order], delay[order]
    kind = np.where(delay > 0, DELAYED_POSITIVE, OBSERVED).astype(np.int8)
    return SampleBatch.from_columns(
        impression_id=[f"i{start + r}" for r in rows], ts=ts[rows], label=(delay > 0).astype(np.int8),
        label_delay_ms=delay, user_id=base.column("user_id")[rows], item_id=base.column("item_id")[rows],
        history=[base.batch.column("history")[int(r)].as_py() for r in rows],
        context={"genres": [base.batch.column("ctx.genres")[int(r)].as_py() for r in rows]}, kind=kind)


def test_the_daemon_calibrates_what_it_serves_from_matured_impressions_and_keeps_it_across_a_restart(
        kafka: KafkaSettings, tmp_path: Path) -> None:
    from learner import checkpoint

    ensure_topics(kafka, [kafka.samples_topic], partitions=1)
    env = dict(os.environ, STREAMREC_KAFKA_BOOTSTRAP_SERVERS=kafka.bootstrap_servers,
               STREAMREC_KAFKA_SAMPLES_TOPIC=kafka.samples_topic, STREAMREC_LEARNER_BUCKETS="5000",
               STREAMREC_LEARNER_CTX_BUCKETS="500", STREAMREC_LEARNER_MLP="16",
               STREAMREC_LEARNER_GROUP_ID=f"l-{kafka.samples_topic}")
    rng = np.random.default_rng(5)
    producer = AckedProducer(kafka)
    ckpt = tmp_path / "ckpt"
    summaries = []
    for part in range(2):  # 2 x 12 k impressions, 900 s of event time each: the second run restores the first
        sb = fake_negative_stream(rng, 12_000, start=part * 900_000, seconds=900)
        for i in range(0, len(sb), 200):
            producer.send(kafka.samples_topic, SampleBatch(sb.batch.slice(i, 200)).encode(), b"k", partition=0)
        producer.flush()
        out = subprocess.run(train_cmd(ckpt, idle=3), env=env, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        summaries.append(json.loads(out.stdout.strip().splitlines()[-1]))
    # the fresh model's bias followed the click rate and was done in the first run; restored, it stays done with the
    # rate it followed (the checkpoint kept it: it used to read None after a restart)
    assert summaries[0]["base_rate_bias"]["done"] and summaries[1]["base_rate_bias"] == summaries[0]["base_rate_bias"]
    first, second = (s["calibration"] for s in summaries)
    # the first run fits the impressions between its 300 s warm-up and 300 s before its end; the rest wait ...
    assert 0 < first["pairs_fitted"] < 12_000 and first["pending"] > 0
    # ... in the checkpoint, and the second run pairs them with their clicks
    assert second["pairs_fitted"] > first["pairs_fitted"] + 12_000 * 0.5
    assert (second["a"], second["b"]) != (1.0, 0.0)
    saved = checkpoint.load_latest(ckpt)
    assert saved is not None
    np.testing.assert_allclose(saved["model"]["calibration"].numpy(), [second["a"], second["b"]], rtol=1e-6)


def test_a_samples_topic_made_again_and_written_past_the_checkpoints_offsets_is_trained_from_its_first_record(
        kafka: KafkaSettings, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The checkpoint recorded only the topic's name with its offsets (3 a partition): the topic deleted, created
    again and written to offset 5 before the restart, the learner resumed at offset 3 of the new topic, and its
    records 0-2 of each partition were never trained, without a word. Now the checkpoint records the topic id, and a
    restore against another id trains every partition from its first record, said as an ERROR naming both ids."""
    from prometheus_client import REGISTRY

    from learner import checkpoint
    from learner.config import Device, LearnerSettings
    from learner.daemon import Learner
    from stream.kafka_topics import topic_identity

    topic, rows = kafka.samples_topic, 10
    ensure_topics(kafka, [topic], partitions=2)
    ls = LearnerSettings(checkpoint_dir=tmp_path / "ckpt", mlp="16", buckets=50, ctx_buckets=20, embedding_dim=4,
                         device=Device.CPU, amp=False, deltas_every_s=0.0, exit_when_idle_s=1.5,
                         group_id=f"g-{topic}")
    rng = np.random.default_rng(11)

    def write(messages: int, prefix: str) -> None:
        producer = AckedProducer(kafka)
        for k in range(messages):
            for part in range(2):
                producer.send(topic, sample_batch(rng, rows, start=1000 * k, prefix=f"{prefix}{part}-").encode(),
                              b"k", partition=part)
        producer.flush()

    def train() -> dict:
        learner = Learner(kafka, ls)
        try:
            return learner.run()
        finally:
            learner.close()

    write(3, "old")
    first = train()
    assert first["offsets"] == {"0": 3, "1": 3} and first["samples_trained"] == 2 * 3 * rows
    old_id = checkpoint.load_latest(ls.checkpoint_dir).meta["topic_id"]
    make_again(kafka, topic, partitions=2)
    write(5, "new")
    new_id = topic_identity(kafka, topic)["topic_id"]
    changed = "streamrec_learner_topic_changed_total"
    before = REGISTRY.get_sample_value(changed) or 0.0
    second = train()
    assert second["offsets"] == {"0": 5, "1": 5}
    assert second["samples_trained"] - first["samples_trained"] == 2 * 5 * rows  # every new record, once
    said = [r.getMessage() for r in caplog.records if r.levelname == "ERROR" and new_id in r.getMessage()]
    assert len(said) == 1 and old_id in said[0] and old_id != new_id
    assert (REGISTRY.get_sample_value(changed) or 0.0) == before + 1
    assert checkpoint.load_latest(ls.checkpoint_dir).meta["topic_id"] == new_id  # what the next restart compares


def test_a_fresh_learner_infers_its_fields_only_from_samples_it_would_train(kafka: KafkaSettings) -> None:
    """The first probe_rows samples decide a fresh learner's fields for good. The probe took every message that
    decodes, also one the reader dead-letters (here rows a year ahead of the clock, ``future_ts``): one such message
    at the head of the topic gave the model its context fields and none of the samples it then trained on."""
    from learner.config import LearnerSettings
    from learner.daemon import infer_feature_config

    ensure_topics(kafka, [kafka.samples_topic], partitions=1)
    ls = LearnerSettings(probe_rows=256)
    now = int(time.time() * 1000)

    def rows(n: int, ts: int, field: str) -> bytes:
        z = np.zeros(n, np.int64)
        return SampleBatch.from_columns(impression_id=[f"{field}{k}" for k in range(n)], ts=z + ts, label=z,
                                        label_delay_ms=z, user_id=z + 1, item_id=z + 2, history=[[]] * n,
                                        context={field: z + 3}).encode()

    producer = AckedProducer(kafka)
    producer.send(kafka.samples_topic, rows(ls.probe_rows, now + 365 * 86_400_000, "evil"), b"ahead")
    producer.send(kafka.samples_topic, rows(64, now, "dev"), b"good")
    producer.flush()
    cfg = infer_feature_config(kafka, ls, timeout_s=30.0)
    assert cfg is not None
    names = [f.name for f in cfg.fields]
    assert "ctx.dev" in names and "ctx.evil" not in names
