"""The learner on a hostile samples topic: malformed messages are dead-lettered, one message cannot fix the
model's fields, and a message that keeps failing training is isolated and dead-lettered after poison_after
failed runs, with every other sample trained exactly once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from learner.checkpoint_read import latest_meta
from stream.config import KafkaSettings
from stream.kafka_producer import AckedProducer
from stream.kafka_topics import ensure_topics
from stream.samples import SampleBatch
from tests.bounded_teardown import Reaper
from tests.integration.test_learner import produce_samples, sample_batch, train_cmd
from tests.kafka_io import read_topic


def with_column(sb: SampleBatch, name: str, arr: pa.Array) -> bytes:
    """``sb`` with column ``name`` replaced by ``arr`` (no validation), as a samples message."""
    cols = [arr if n == name else sb.batch.column(i) for i, n in enumerate(sb.batch.schema.names)]
    rb = pa.RecordBatch.from_arrays(cols, schema=sb.batch.schema)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, rb.schema) as w:
        w.write_batch(rb)
    return sink.getvalue().to_pybytes()


def hostile_samples(rng: np.random.Generator) -> dict[str, bytes]:
    base = sample_batch(rng, 3, start=10**6, prefix="bad")
    hist = base.batch.column("history")
    wide = SampleBatch.from_columns(  # one row with thousands of context columns
        impression_id=["wide0"], ts=np.array([1]), label=np.array([1]), label_delay_ms=np.zeros(1),
        user_id=np.array([1]), item_id=np.array([2]), history=[[1]],
        context={f"k{i}": np.array([i + 1]) for i in range(3000)})
    return {
        "offsets_decrease": with_column(base, "history", pa.ListArray.from_arrays(
            pa.array(np.array([0, 3, 1, 2], np.int32)), hist.values)),
        "label_5": with_column(base, "label", pa.array(np.array([0, 5, 1], np.int8))),
        "not_arrow": b"\x00\x01garbage" * 10,
        "truncated": base.encode()[:-40],
        "wide": wide.encode(),
    }


def env_for(kafka: KafkaSettings) -> dict[str, str]:
    return dict(os.environ, STREAMREC_KAFKA_BOOTSTRAP_SERVERS=kafka.bootstrap_servers,
                STREAMREC_KAFKA_SAMPLES_TOPIC=kafka.samples_topic, STREAMREC_LEARNER_CHECKPOINT_EVERY_S="1",
                STREAMREC_LEARNER_BUCKETS="5000", STREAMREC_LEARNER_CTX_BUCKETS="500", STREAMREC_LEARNER_MLP="16",
                STREAMREC_LEARNER_GROUP_ID=f"learner-{kafka.samples_topic}", STREAMREC_LEARNER_POISON_AFTER="2")


def train(ckpt: Path, env: dict[str, str], module: str = "streamrec.cli") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, "train", "--checkpoint-dir", str(ckpt), "--batch-rows",
                           "256", "--exit-when-idle", "3", "--json"], env=env, capture_output=True, text=True,
                          timeout=300)


def test_hostile_and_poison_samples_are_dead_lettered_and_every_good_sample_is_trained_once(
        kafka: KafkaSettings, tmp_path: Path) -> None:
    ensure_topics(kafka, [kafka.samples_topic], partitions=2)
    rng = np.random.default_rng(3)
    producer = AckedProducer(kafka)
    bad = hostile_samples(rng)
    producer.send(kafka.samples_topic, bad.pop("wide"), b"wide", partition=0)  # the first message a fresh learner reads
    good = {0: 0, 1: 0}
    for k in range(24):
        part = k % 2
        producer.send(kafka.samples_topic, sample_batch(rng, 100, start=k * 100).encode(), str(k).encode(),
                      partition=part)
        good[part] += 100
        if k == 10:
            for name, value in bad.items():
                producer.send(kafka.samples_topic, value, name.encode(), partition=part)
            producer.send(kafka.samples_topic, sample_batch(rng, 20, start=0, prefix="poison").encode(), b"poison",
                          partition=part)
    producer.flush()
    env, ckpt = env_for(kafka), tmp_path / "ckpt"

    failures = 0
    for _ in range(4):
        out = train(ckpt, env, module="tests.fault_hooks")
        if out.returncode == 0:
            break
        failures += 1
        assert "injected fault" in out.stderr, out.stderr[-2000:]
    assert out.returncode == 0 and failures == 2, out.stderr[-3000:]
    summary = json.loads(out.stdout.strip().splitlines()[-1])

    dlq = {r.key: {k: v.decode() for k, v in r.headers}
           for r in read_topic(kafka, kafka.dlq_topic(kafka.samples_topic))}
    assert {k.decode(): v["dlq.kind"] for k, v in dlq.items()} == {
        "offsets_decrease": "bad_arrow", "label_5": "bad_value", "not_arrow": "bad_arrow", "truncated": "bad_arrow",
        "poison": "poison"}
    assert "injected fault" in dlq[b"poison"]["dlq.reason"]
    rows = {int(p): n for p, n in summary["partition_rows"].items()}
    assert rows == {0: good[0] + 1, 1: good[1]}  # every good row once (+ the wide row), nothing dead-lettered twice
    assert summary["samples_trained"] == sum(good.values()) + 1
    fields = [f["name"] for f in latest_meta(ckpt)["feature_config"]["fields"]]
    assert fields == ["user_id", "item_id", "history", "ctx.genres"]  # not the wide message's 3000 columns
    assert not json.loads((ckpt / "strikes.json").read_text())  # cleared once the poison was dead-lettered


def test_a_full_disk_while_suspects_train_after_all_stops_nothing_but_the_poison(kafka: KafkaSettings,
                                                                                 tmp_path: Path) -> None:
    """Messages that shared a batch with a poison message have strikes; on the next run they train one per batch,
    and each success clears its strike in strikes.json. On a full disk that write raised out of the daemon's loop:
    the learner stopped at the first innocent suspect (OSError), never reaching the poison, for as long as the disk
    stayed full. Now it goes on to the poison, which fails as it should, and after the disk is back the poison is
    dead-lettered and every other sample trained once."""
    ensure_topics(kafka, [kafka.samples_topic], partitions=1)
    rng = np.random.default_rng(5)
    producer = AckedProducer(kafka)
    good = 0
    for k in range(6):  # the poison between good messages, in one training batch with them (256 rows)
        if k == 2:
            producer.send(kafka.samples_topic, sample_batch(rng, 20, start=0, prefix="poison").encode(), b"poison",
                          partition=0)
        producer.send(kafka.samples_topic, sample_batch(rng, 50, start=k * 50).encode(), str(k).encode(), partition=0)
        good += 50
    producer.flush()
    full = tmp_path / "disk-full"
    env, ckpt = {**env_for(kafka), "STREAMREC_TEST_DISK_FULL": str(full)}, tmp_path / "ckpt"
    first = train(ckpt, env, module="tests.fault_hooks")  # the poison's batch fails: every message gets a strike
    assert first.returncode == 1 and "injected fault" in first.stderr, first.stderr[-2000:]
    assert len(json.loads((ckpt / "strikes.json").read_text())) == 6  # 5 good ones and the poison
    full.touch()
    second = train(ckpt, env, module="tests.fault_hooks")
    assert second.returncode == 1
    assert "injected fault" in second.stderr, second.stderr[-3000:]  # it got to the poison ...
    assert "could not record that 1 message(s) with strikes trained after all" in second.stderr  # ... past 6 suspects
    full.unlink()
    for _ in range(3):
        out = train(ckpt, env, module="tests.fault_hooks")
        if out.returncode == 0:
            break
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["samples_trained"] == good and summary["partition_rows"] == {"0": good}
    dlq = [r.key for r in read_topic(kafka, kafka.dlq_topic(kafka.samples_topic))]
    assert dlq == [b"poison"]
    assert not json.loads((ckpt / "strikes.json").read_text())


@pytest.mark.usefixtures("environ_restored")  # the command sets MALLOC_* for its children
def test_streamrec_train_dead_letters_impression_ids_over_the_limits_setting_and_trains_the_rest(
        kafka: KafkaSettings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    """``streamrec train`` bounds impression ids by ``[limits] max_str_len``, the joiner's setting (not a copy of its
    default): with it at 64, a message whose ids are 100 characters (under the default 256) is dead-lettered as
    ``too_large``, and every other sample is trained once. (In process: the command's own settings loading.)"""
    from streamrec.cli import main

    ensure_topics(kafka, [kafka.samples_topic], partitions=1)
    rng = np.random.default_rng(6)
    producer = AckedProducer(kafka)
    producer.send(kafka.samples_topic, sample_batch(rng, 3, prefix="x" * 99).encode(), b"long", partition=0)
    for k in range(3):
        producer.send(kafka.samples_topic, sample_batch(rng, 50, start=k * 50).encode(), str(k).encode(), partition=0)
    producer.flush()
    for name, value in {**env_for(kafka), "STREAMREC_LIMITS_MAX_STR_LEN": "64"}.items():
        if name.startswith("STREAMREC_"):
            monkeypatch.setenv(name, value)
    assert main(["train", "--checkpoint-dir", str(tmp_path / "ckpt"), "--exit-when-idle", "1", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["samples_trained"] == 150 and summary["offsets"] == {"0": 4}
    [rec] = read_topic(kafka, kafka.dlq_topic(kafka.samples_topic))
    headers = {k: v.decode() for k, v in rec.headers}
    assert (rec.key, headers["dlq.kind"]) == (b"long", "too_large")
    assert "an id of 100 chars, over [limits] max_str_len=64" in headers["dlq.reason"]


@pytest.mark.parametrize("workers", [2, 0])
def test_a_message_a_dataloader_worker_dead_letters_is_counted_once_in_the_learners_exported_metrics(
        kafka: KafkaSettings, tmp_path: Path, workers: int) -> None:
    """With ``num_workers > 0`` the reader, and the dead-letter counter it increments, ran in the DataLoader worker
    processes: the learner's /metrics (the training process's registry) never counted a dead letter. Each batch now
    carries what its worker dead-lettered, counted by the training process; without workers, counted once as before."""
    from prometheus_client import REGISTRY

    from learner.config import LearnerSettings
    from learner.daemon import Learner

    ensure_topics(kafka, [kafka.samples_topic], partitions=2)
    rng = np.random.default_rng(7)
    producer = AckedProducer(kafka)
    for k in range(4):
        producer.send(kafka.samples_topic, sample_batch(rng, 20, start=k * 20).encode(), str(k).encode(),
                      partition=k % 2)
    producer.send(kafka.samples_topic, hostile_samples(rng)["label_5"], b"label_5", partition=1)
    producer.flush()
    series = {"topic": kafka.samples_topic, "kind": "bad_value"}
    before = REGISTRY.get_sample_value("streamrec_dlq_messages_total", series) or 0.0
    ls = LearnerSettings(checkpoint_dir=tmp_path / "ckpt", mlp="16", buckets=50, ctx_buckets=20, embedding_dim=4,
                         group_id=f"g-{kafka.samples_topic}", num_workers=workers, exit_when_idle_s=1.0)
    learner = Learner(kafka, ls)
    try:
        summary = learner.run()
    finally:
        learner.close()
    assert summary["samples_trained"] == 80 and summary["offsets"] == {"0": 2, "1": 3}
    [rec] = read_topic(kafka, kafka.dlq_topic(kafka.samples_topic))
    assert rec.key == b"label_5"  # dead-lettered once (with workers, by the one reading partition 1)
    assert REGISTRY.get_sample_value("streamrec_dlq_messages_total", series) == before + 1


def dataloader_workers(pid: int) -> list[int]:
    """The DataLoader worker processes of process ``pid`` (torch names them ``pt_data_worker``)."""
    kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return [int(k) for k in kids if Path(f"/proc/{k}/comm").read_text().strip() == "pt_data_worker"]


def test_a_dataloader_worker_killed_while_the_learner_waits_for_samples_stops_it_and_loses_nothing(
        kafka: KafkaSettings, tmp_path: Path, reaper: Reaper) -> None:
    """A worker OOM-killed while the training process waits for its next batch: torch raises its death from inside
    the DataLoader iterator, and that exception's traceback kept the iterator alive into the interpreter's exit,
    where torch no longer shuts its workers down and multiprocessing sends the survivor one SIGTERM (which a worker
    outlives, ``learner.kafka_dataset``) and joins it for good: the learner hung after printing its traceback, and
    no supervisor restarted it. It must exit non-zero, and the restart train every sample exactly once."""
    ensure_topics(kafka, [kafka.samples_topic])
    produced = produce_samples(kafka, 8, 100, 0.0)
    total = sum(produced.values())
    env = dict(env_for(kafka), STREAMREC_LEARNER_NUM_WORKERS="2", STREAMREC_LEARNER_PREFETCH_FACTOR="2",
               STREAMREC_LEARNER_CHECKPOINT_EVERY_S="0.5")
    ckpt = tmp_path / "ckpt"
    proc = reaper.add(subprocess.Popen([*train_cmd(ckpt), "--log-level", "info"], env=env, stdout=subprocess.PIPE,
                                       stderr=subprocess.PIPE, text=True, start_new_session=True), group=True)
    while (meta := latest_meta(ckpt)) is None or meta["samples_trained"] < total:  # all trained: it waits for more
        assert proc.poll() is None, "the learner stopped before training the samples"
        time.sleep(0.2)
    workers = dataloader_workers(proc.pid)
    assert len(workers) == 2
    os.kill(workers[0], signal.SIGKILL)
    _, err = proc.communicate(timeout=120)  # it hung here for good
    assert proc.returncode == 1 and f"DataLoader worker (pid(s) {workers[0]}) exited unexpectedly" in err, err[-2000:]
    out = train(ckpt, env)
    assert out.returncode == 0, out.stderr[-2000:]
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert {int(p): n for p, n in summary["partition_rows"].items()} == produced  # nothing lost, nothing twice
    assert summary["samples_trained"] == total and summary["duplicates_dropped"] == 0


def test_a_dataloader_worker_killed_mid_stream_stops_the_learner_and_its_restart_trains_every_sample_once(
        kafka: KafkaSettings, tmp_path: Path, reaper: Reaper) -> None:
    """A worker SIGKILLed while the learner trains, with batches it had read ahead of the trained ones (its
    prefetch): torch raises its death wherever the training process is (a step, a checkpoint). The learner must exit
    non-zero, strike nothing, and the restart resume at the checkpoint's offsets: every sample trained once."""
    from tests.integration.test_distributed import MESSAGES, produce

    produced = produce(kafka, messages=MESSAGES // 2)  # the first half; the second after the kill
    env = dict(env_for(kafka), STREAMREC_LEARNER_NUM_WORKERS="2", STREAMREC_LEARNER_PREFETCH_FACTOR="2",
               STREAMREC_LEARNER_CHECKPOINT_EVERY_SAMPLES="600")
    ckpt = tmp_path / "ckpt"
    proc = reaper.add(subprocess.Popen(train_cmd(ckpt), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                       text=True, start_new_session=True), group=True)
    while latest_meta(ckpt) is None:
        assert proc.poll() is None, "the learner stopped before its first checkpoint"
        time.sleep(0.05)
    workers = dataloader_workers(proc.pid)
    assert len(workers) == 2
    os.kill(workers[0], signal.SIGKILL)
    for p, n in produce(kafka, messages=MESSAGES // 2, first=MESSAGES // 2).items():
        produced[p] += n
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 1, err[-2000:]
    assert f"DataLoader worker (pid {workers[0]}) is killed by signal" in err or \
        f"DataLoader worker (pid(s) {workers[0]}) exited unexpectedly" in err, err[-2000:]
    assert "strike" not in err, err[-2000:]  # the worker's death is no batch's fault
    out = train(ckpt, env)
    assert out.returncode == 0, out.stderr[-2000:]
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert {int(p): n for p, n in summary["partition_rows"].items()} == produced  # nothing lost, nothing twice
    assert summary["samples_trained"] == summary["metrics"]["samples"] == sum(produced.values())
    assert summary["duplicates_dropped"] == 0
