"""Learner deltas: what the writer puts in a file, what the reader hands serving, and the daemon's hook."""

from __future__ import annotations

import dataclasses
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
import redis
import torch

from learner.config import LearnerSettings
from learner.daemon import Learner
from learner.delta_reader import DeltaReader
from learner.delta_writer import DeltaWriter, redis_notifier
from learner.deltas import list_deltas, load_delta
from learner.model import DeepFM
from stream.config import KafkaSettings
from stream.redis_client import RedisFailure
from tests.integration.test_serving import CFG, TinyLearner
from tests.trickle_proxy import TrickleProxy


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_a_delta_holds_exactly_the_touched_rows_and_the_dense_weights(tmp_path: Path) -> None:
    learner = TinyLearner()
    clock = FakeClock()
    w = DeltaWriter(tmp_path, CFG.num_rows, every_s=1.0, clock=clock)
    assert w.after_step(learner.trainer, torch.zeros(0, dtype=torch.int64)) is None  # not due
    clock.t = 5
    assert w.write(learner.model, learner.trainer.samples) is None  # nothing trained: no file
    batches = learner.train(2)
    for tb in batches:
        w.mark(tb.values)
    clock.t = 10
    path = w.after_step(learner.trainer, torch.zeros(0, dtype=torch.int64))
    assert path is not None and [p.name for p in tmp_path.iterdir()] == [path.name]  # no temp file left
    d = load_delta(path)
    touched = torch.unique(torch.cat([tb.values for tb in batches]))
    assert d.seq == 1 and d.samples_trained == learner.trainer.samples
    assert torch.equal(d.rows, touched)  # (R,) sorted unique
    assert torch.equal(d.vectors, learner.model.sparse.bag.weight.detach()[touched])  # (R, D + 1), current values
    assert set(d.dense_state) == {k for k in learner.model.state_dict() if not k.startswith("sparse.")}
    assert not w.touched.any()  # the next delta starts empty


def test_seq_continues_across_restarts_and_only_the_last_keep_stay(tmp_path: Path) -> None:
    learner = TinyLearner()
    w = DeltaWriter(tmp_path, CFG.num_rows, every_s=1.0, keep=3)
    for _ in range(5):
        for tb in learner.train(1):
            w.mark(tb.values)
        w.write(learner.model, learner.trainer.samples)
    assert [s for s, _, _ in list_deltas(tmp_path)] == [3, 4, 5]
    w2 = DeltaWriter(tmp_path, CFG.num_rows, every_s=1.0, keep=3)  # a restarted learner
    w2.mark(torch.tensor([1, 2]))
    assert load_delta(w2.write(learner.model, learner.trainer.samples)).seq == 6  # type: ignore[arg-type]


def test_a_failed_delta_write_is_survived_and_retried_with_the_same_seq(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A full disk (or the directory gone) raised out of the daemon's training step: the learner died, before its
    next checkpoint each time when deltas are more frequent, and the failed write had used up a seq (serving counted a
    gap that was none). Now: logged, counted, the rows stay marked, the next write sends them under the same seq."""
    import errno
    import shutil

    import learner.delta_writer as writer_mod

    learner = TinyLearner()
    w = DeltaWriter(tmp_path / "d", CFG.num_rows, every_s=1.0)
    batches = learner.train(2)
    for tb in batches:
        w.mark(tb.values)
    real = writer_mod.write_atomic

    def full(path: Path, data: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(writer_mod, "write_atomic", full)
    failures = writer_mod.DELTA_WRITE_FAILURES._value.get()
    assert w.write(learner.model, learner.trainer.samples) is None  # no exception
    assert w.failed == 1 and w.seq == 0 and w.touched.any() and list_deltas(tmp_path / "d") == []
    assert writer_mod.DELTA_WRITE_FAILURES._value.get() == failures + 1
    monkeypatch.setattr(writer_mod, "write_atomic", real)
    shutil.rmtree(tmp_path / "d")  # and the directory is gone meanwhile: made again
    path = w.write(learner.model, learner.trainer.samples)
    assert path is not None and load_delta(path).seq == 1  # no gap for serving
    touched = torch.unique(torch.cat([tb.values for tb in batches]))
    assert torch.equal(load_delta(path).rows, touched) and not w.touched.any()


@pytest.mark.parametrize("bad", ["symlink_loop", "fifo", "memory_error"])
def test_one_entry_that_cannot_be_read_is_rejected_once_and_the_deltas_after_it_still_come(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, bad: str) -> None:
    """A symlink loop named like a delta raised out of the reader (ELOOP at its stat), a FIFO blocked it for good
    in its read, a MemoryError was never remembered: each stopped every later delta, and, as serving applies the
    deltas before it swaps an artifact in, every new artifact too. (A MemoryError may be a passing shortage: it holds
    the later deltas back only ``TRANSIENT_TRIES`` rounds, then the file is rejected.)"""
    import os

    import learner.deltas as deltas_mod

    learner = TinyLearner()
    w = DeltaWriter(tmp_path, CFG.num_rows, every_s=1.0)
    for _ in range(2):
        for tb in learner.train(1):
            w.mark(tb.values)
        w.write(learner.model, learner.trainer.samples)
    (_, _, first), (_, _, second) = list_deltas(tmp_path)
    if bad == "symlink_loop":
        first.unlink()
        os.symlink(first.name, first)  # points at itself
    elif bad == "fifo":
        first.unlink()
        os.mkfifo(first)
    else:
        real = deltas_mod.decode_delta

        def oom(data: bytes, path: Path, key: object = None) -> object:
            if Path(path).name == first.name:
                raise MemoryError
            return real(data, path, key)  # type: ignore[arg-type]

        monkeypatch.setattr(deltas_mod, "decode_delta", oom)
    rejected: list[str] = []
    reader = DeltaReader(tmp_path, on_reject=lambda p, why: rejected.append(p.name))
    for _ in range(deltas_mod.TRANSIENT_TRIES - 1 if bad == "memory_error" else 0):
        assert list(reader.newer(0, 0)) == [] and rejected == []  # retried, nothing after it first
    assert [d.seq for d in reader.newer(0, 0)] == [2]  # returns (the FIFO read does not block), the next one comes
    assert rejected == [first.name] and reader.bad == 1
    assert [d.seq for d in reader.newer(0, 0)] == [2] and rejected == [first.name]  # remembered: rejected once


def test_reader_yields_newer_deltas_in_order_skips_old_and_corrupt_ones_and_counts_gaps(tmp_path: Path) -> None:
    learner = TinyLearner()
    w = DeltaWriter(tmp_path, CFG.num_rows, every_s=1.0, keep=100)
    samples = []
    for _ in range(6):
        for tb in learner.train(1):
            w.mark(tb.values)
        w.write(learner.model, learner.trainer.samples)
        samples.append(learner.trainer.samples)
    r = DeltaReader(tmp_path)
    assert [d.seq for d in r.newer(0, 0)] == [1, 2, 3, 4, 5, 6]
    assert [d.seq for d in r.newer(2, 0)] == [3, 4, 5, 6]
    assert [d.seq for d in r.newer(0, samples[3])] == [5, 6]  # 1..4 are inside an artifact trained that far
    list_deltas(tmp_path)[4][2].write_bytes(b"not a torch file")  # seq 5 corrupt
    assert [d.seq for d in r.newer(4, 0)] == [6] and r.bad == 1
    assert [d.seq for d in r.newer(4, 0)] == [6] and r.bad == 1  # not retried
    for _, _, p in list_deltas(tmp_path)[:3]:
        p.unlink()  # 1..3 pruned before a reader at seq 1 got to them
    assert [d.seq for d in r.newer(1, 0)] == [4, 6] and r.gaps == 2


def test_a_learner_whose_deltas_directory_was_emptied_never_numbers_a_delta_as_its_lineage_did(
        tmp_path: Path) -> None:
    """The deltas directory emptied (a new volume, an operator's rm) while the checkpoints stayed: the restarted
    writer started again at seq 1, and a serving process at seq 3 skipped every new delta (seq <= its own) without a
    word. Now the lineage's seqs are recorded beside its checkpoints, and the single-process and the distributed
    (rank 0) writers built from the settings go on after them."""
    import shutil

    from learner.deltas import SEQ_FILE
    from learner.sharded_deltas import ShardedDeltas

    learner = TinyLearner()
    ls = LearnerSettings(checkpoint_dir=tmp_path / "ckpt", deltas_dir=tmp_path / "deltas", deltas_every_s=1.0)
    w = DeltaWriter.from_settings(ls, CFG.num_rows)
    for _ in range(3):
        for tb in learner.train(1):
            w.mark(tb.values)
        w.write(learner.model, learner.trainer.samples)
    assert (tmp_path / "ckpt" / SEQ_FILE).read_text() == "3"
    shutil.rmtree(tmp_path / "deltas")  # the checkpoints stay
    w2 = DeltaWriter.from_settings(ls, CFG.num_rows)  # the restarted learner
    w2.mark(torch.tensor([1, 2]))
    assert load_delta(w2.write(learner.model, learner.trainer.samples)).seq == 4  # type: ignore[arg-type]
    shutil.rmtree(tmp_path / "deltas")
    sharded = ShardedDeltas.from_settings(ls, CFG.num_rows, CFG.embedding_dim, rank=0)
    assert sharded is not None and sharded.writer is not None and sharded.writer.seq == 4
    sharded.writer.mark(torch.tensor([3]))
    path = sharded.writer.write_rows(torch.tensor([3]), torch.zeros(1, CFG.embedding_dim + 1),
                                     {"bias": torch.zeros(1)}, learner.trainer.samples)
    assert path is not None and load_delta(path).seq == 5


def test_a_reader_rebases_on_samples_when_the_delta_numbering_went_back_behind_its_model(tmp_path: Path) -> None:
    """A serving model at seq 500 skipped every delta of a restarted numbering (seq 1, 2, ...) until the next
    artifact. Now it notices (the directory's latest seq is below its own, or a delta at or below its seq was trained
    further than it holds), counts and logs it once, and takes every delta newer than its artifact, in seq order."""
    learner = TinyLearner()
    w = DeltaWriter(tmp_path, CFG.num_rows, every_s=1.0)
    samples = []
    for _ in range(3):
        for tb in learner.train(1):
            w.mark(tb.values)
        w.write(learner.model, learner.trainer.samples)
        samples.append(learner.trainer.samples)
    r = DeltaReader(tmp_path)
    assert [d.seq for d in r.newer(500, 0, applied_samples=samples[-1] + 1000)] == [1, 2, 3] and r.rewinds == 1
    assert [d.seq for d in r.newer(500, 0, applied_samples=samples[-1] + 1000)] == [1, 2, 3] and r.rewinds == 1  # once
    assert [d.seq for d in r.newer(3, 0, applied_samples=samples[-1])] == [] and r.rewinds == 1  # caught up: as usual
    # the numbering restarted and passed the model's seq: seq 2 holds training beyond what the model has
    assert [d.seq for d in r.newer(2, 0, applied_samples=samples[0])] == [1, 2, 3] and r.rewinds == 2
    assert [d.seq for d in r.newer(2, samples[0], applied_samples=samples[1])] == [3] and r.rewinds == 2  # usual


def test_serving_takes_the_deltas_of_a_restarted_numbering_and_counts_the_rewind(tmp_path: Path) -> None:
    import shutil

    from serving.metrics import ServingMetrics
    from serving.swap import ModelHolder, ModelUpdater
    from tests.integration.test_serving import publish_version

    learner = TinyLearner()
    root = tmp_path / "serving"
    publish_version(learner, root, "v1")
    old = DeltaWriter(tmp_path / "deltas", CFG.num_rows, every_s=1.0)  # a learner without a seq record
    for _ in range(3):
        for tb in learner.train(1):
            old.mark(tb.values)
        old.write(learner.model, learner.trainer.samples)
    holder = ModelHolder()
    updater = ModelUpdater(holder, ServingMetrics(holder.model), root, tmp_path / "deltas")
    updater.check_now()
    served = holder.model()
    assert served is not None and served.delta_seq == 3
    newest = max(load_delta(p).created for _, _, p in list_deltas(tmp_path / "deltas"))
    assert served.trained_at == newest  # the age serving reports (streamrec_serving_model_age_seconds) is the delta's
    shutil.rmtree(tmp_path / "deltas")
    restarted = DeltaWriter(tmp_path / "deltas", CFG.num_rows, every_s=1.0)  # numbers from 1 again
    (tb,) = learner.train(1)
    restarted.mark(tb.values)
    restarted.write(learner.model, learner.trainer.samples)
    updater.check_now()
    rows = torch.unique(tb.values)
    assert served.delta_seq == 1 and served.delta_samples == learner.trainer.samples  # applied, not skipped
    assert updater.metrics.delta_rewinds._value.get() == 1
    idx = np.searchsorted(served._live.override_ids, rows.numpy())
    assert np.array_equal(served._live.override_vectors[idx], learner.model.sparse.bag.weight.detach()[rows].numpy())


def test_a_fresh_model_counts_the_deltas_pruned_between_its_source_checkpoint_and_the_oldest_kept(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A freshly loaded model (no delta applied yet) counted no gap: an artifact older than the oldest delta kept
    silently missed the rows of the pruned ones. Its source checkpoint now records the last delta it includes (seq
    2 here), so the 2 deltas pruned after it (3 and 4) are counted and logged, once."""
    from cache_refresh.publish import publish
    from learner.artifact import build_artifact
    from serving.metrics import ServingMetrics
    from serving.swap import ModelHolder, ModelUpdater

    learner = TinyLearner()
    w = DeltaWriter(tmp_path / "deltas", CFG.num_rows, every_s=1.0, keep=2)
    for _ in range(2):
        for tb in learner.train(1):
            w.mark(tb.values)
        w.write(learner.model, learner.trainer.samples)
    ckpt = learner.checkpoint()
    ckpt["meta"]["delta_seq"] = w.seq  # what the daemon records (learner/daemon.py save)
    root = tmp_path / "serving"
    publish(root, build_artifact(ckpt, root, np.arange(0, CFG.num_rows, 3), version="v1"), keep=3)
    for _ in range(4):  # 3..6; keep=2 leaves 5 and 6
        for tb in learner.train(1):
            w.mark(tb.values)
        w.write(learner.model, learner.trainer.samples)
    holder = ModelHolder()
    updater = ModelUpdater(holder, ServingMetrics(holder.model), root, tmp_path / "deltas")
    with caplog.at_level("WARNING", logger="streamrec.deltas"):
        updater.check_now()
        updater.check_now()
    served = holder.model()
    assert served is not None and served.source_delta_seq == 2 and served.delta_seq == 6
    assert updater.metrics.delta_gaps._value.get() == 2
    assert sum("deltas 3..4 were pruned" in r.getMessage() for r in caplog.records) == 1


def test_an_announcement_to_a_trickling_redis_fails_at_its_timeout_instead_of_waiting_out_the_trickle(stack) -> None:
    """Redis trickles its replies a byte per 0.6 s (``tests/trickle_proxy.py``): no read waits the notifier's 1 s
    timeout, so with a per-read timeout the PUBLISH's 4-byte reply took 1.8 s a try (the learner's step held for it,
    and for as long as any longer trickle lasts). Bounded as a whole reply, each try fails at 1 s and the announcement
    fails as a Redis that did not answer in time; once the trickle stops the next one goes through."""
    channel = f"t{uuid.uuid4().hex[:8]}:model-deltas"
    with TrickleProxy(stack.s.redis_port, gap_s=0.6) as proxy:
        notify = redis_notifier(proxy.url, channel)
        notify(1)  # connected while Redis is healthy
        proxy.trickling = True
        try:
            with pytest.raises(RedisFailure, match="did not answer in time"):
                notify(2)
        finally:
            proxy.trickling = False
        notify(3)


def test_writer_announces_each_delta_on_redis(stack, tmp_path: Path) -> None:
    channel = f"t{uuid.uuid4().hex[:8]}:model-deltas"
    client = redis.Redis.from_url(stack.redis_url)
    sub = client.pubsub(ignore_subscribe_messages=True)
    sub.subscribe(channel)
    try:
        learner = TinyLearner()
        w = DeltaWriter(tmp_path, CFG.num_rows, every_s=1.0, notify=redis_notifier(stack.redis_url, channel))
        for tb in learner.train(1):
            w.mark(tb.values)
        w.write(learner.model, learner.trainer.samples)
        deadline = time.monotonic() + 5
        msg = None
        while msg is None and time.monotonic() < deadline:
            msg = sub.get_message(timeout=0.2)
        assert msg is not None and msg["data"] == b"1"
        # Redis down: the delta is still written, the announcement is dropped with a warning.
        w.notify = redis_notifier("redis://127.0.0.1:1/0", channel)
        for tb in learner.train(1):
            w.mark(tb.values)
        assert w.write(learner.model, learner.trainer.samples) is not None and w.seq == 2
    finally:
        sub.close()
        client.close()


def test_the_learner_daemon_writes_deltas_of_what_it_trains(kafka: KafkaSettings, tmp_path: Path) -> None:
    from learner.batch import to_tensors
    from tests.integration.test_serving import random_samples

    ls = dataclasses.replace(LearnerSettings(), deltas_every_s=1e-9, deltas_dir=tmp_path / "deltas",
                             checkpoint_dir=tmp_path / "ckpt", mlp="8", amp=False, group_id=f"g-{uuid.uuid4().hex[:6]}")
    cfg = CFG
    learner = Learner(kafka, ls)
    try:
        learner._build(cfg, learner._model_settings())
        assert learner.deltas is not None and learner.trainer is not None
        tb = to_tensors(random_samples(np.random.default_rng(0), 32), cfg)
        learner._train(tb)
        (seq, samples, path), = list_deltas(ls.deltas_dir)
        d = load_delta(path)
        assert (seq, samples) == (1, 32) and torch.equal(d.rows, torch.unique(tb.values))
        model: DeepFM = learner.trainer.model  # type: ignore[assignment]
        assert torch.equal(d.vectors, model.sparse.bag.weight.detach()[d.rows])
        learner.save()  # the checkpoint says which deltas it includes: an artifact of it starts after them
        from learner import checkpoint

        saved = checkpoint.load_latest(ls.checkpoint_dir)
        assert saved is not None and saved.meta["delta_seq"] == 1
    finally:
        learner.close()


def test_a_pending_list_that_cannot_be_made_durable_stops_no_checkpoint(kafka: KafkaSettings, tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The daemon syncs the deltas' pending list before each checkpoint. An fsync of it that failed (EIO, or ENOSPC
    on a deltas volume that filled up) failed the checkpoint itself: every periodic one for as long as it lasted, and
    the one at exit (exit 1), while a delta that cannot be written is survived. Now it is logged and the checkpoint
    is written: only rows trained since the last delta may then wait for the next artifact after a crash."""
    import errno
    import os

    from learner import checkpoint
    from learner.config import Amp
    from learner.deltas import PENDING

    ls = dataclasses.replace(LearnerSettings(), deltas_every_s=3600.0, deltas_dir=tmp_path / "deltas",
                             checkpoint_dir=tmp_path / "ckpt", mlp=(8,), amp=Amp.OFF,
                             group_id=f"g-{uuid.uuid4().hex[:6]}")
    learner = Learner(kafka, ls)
    try:
        learner._build(CFG, learner._model_settings())
        assert learner.deltas is not None
        learner.deltas.mark(torch.tensor([1, 2]))  # rows marked since the last delta: listed in the pending file
        real = os.fsync

        def failing(fd: int) -> None:
            if os.readlink(f"/proc/self/fd/{fd}").endswith(PENDING):
                raise OSError(errno.EIO, "Input/output error")
            real(fd)

        monkeypatch.setattr(os, "fsync", failing)
        assert learner._try_save()
        saved = checkpoint.load_latest(ls.checkpoint_dir)
        assert saved is not None and saved.meta["samples_trained"] == 0
        learner.save()  # the one at exit too
        assert len(checkpoint.list_checkpoints(ls.checkpoint_dir)) == 2
    finally:
        learner.close()


def test_a_delta_file_is_checksummed_and_any_truncation_or_flipped_bit_is_a_delta_error(tmp_path: Path) -> None:
    import hashlib

    from learner import tensorpack
    from learner.deltas import DeltaError

    learner = TinyLearner()
    w = DeltaWriter(tmp_path, CFG.num_rows, every_s=1.0)
    for tb in learner.train(1):
        w.mark(tb.values)
    path = w.write(learner.model, learner.trainer.samples)
    assert path is not None and path.suffix == ".delta"
    raw = path.read_bytes()
    assert raw[:8] == tensorpack.MAGIC and raw[8:40] == hashlib.sha256(raw[40:]).digest()
    assert load_delta(path).seq == 1
    for cut in (0, 10, 47, len(raw) // 2, len(raw) - 1):
        path.write_bytes(raw[:cut])
        with pytest.raises(DeltaError):
            load_delta(path)
    for pos in (8, 45, 60, len(raw) // 2, len(raw) - 1):
        flipped = bytearray(raw)
        flipped[pos] ^= 0x01
        path.write_bytes(bytes(flipped))
        with pytest.raises(DeltaError):
            load_delta(path)


def test_deltas_and_checkpoints_of_one_directory_share_a_lineage_and_a_fresh_directory_starts_another(
        tmp_path: Path) -> None:
    from learner import checkpoint

    ls = dataclasses.replace(LearnerSettings(), deltas_every_s=1.0, deltas_dir=tmp_path / "d",
                             checkpoint_dir=tmp_path / "c")
    learner = TinyLearner()
    w = DeltaWriter.from_settings(ls, CFG.num_rows)  # before the first checkpoint: creates the lineage
    for tb in learner.train(1):
        w.mark(tb.values)
    d = load_delta(w.write(learner.model, learner.trainer.samples))  # type: ignore[arg-type]
    meta = learner.checkpoint()["meta"]
    checkpoint.save(tmp_path / "c", {"model": learner.model.state_dict()}, meta)
    saved = checkpoint.latest_meta(tmp_path / "c")
    assert saved is not None and d.lineage == saved["lineage"] == checkpoint.lineage(tmp_path / "c")
    assert len(d.lineage) == 32
    assert checkpoint.lineage(tmp_path / "other") != d.lineage  # a learner started from scratch


def test_a_loaded_delta_is_views_of_one_buffer_of_the_files_size_and_an_unpadded_pack_still_reads(
        tmp_path: Path) -> None:
    """Reading a delta took ~3.7x its size (read with a 4 GiB request, every tensor copied out of the bytes, a whole
    isfinite mask): rows and vectors are now views of the one buffer the file was read into. A pack written before
    the padding that makes that possible (tensors at any offset) still reads, copied."""
    import hashlib
    import json
    import struct

    from learner import tensorpack

    learner = TinyLearner()
    w = DeltaWriter(tmp_path, CFG.num_rows, every_s=1.0)
    for tb in learner.train(2):
        w.mark(tb.values)
    path = w.write(learner.model, learner.trainer.samples)
    assert path is not None
    d = load_delta(path)
    # views of the file's buffer: vectors lie where the file has them, right after the rows (padded to 64 bytes)
    assert d.vectors.data_ptr() - d.rows.data_ptr() == d.rows.nbytes + (-d.rows.nbytes % tensorpack.ALIGN)
    assert d.rows.data_ptr() % 8 == 0 and d.vectors.data_ptr() % 8 == 0
    assert torch.equal(d.vectors, learner.model.sparse.bag.weight.detach()[d.rows])
    # an unpadded pack (the layout before): an int8 tensor of 3 bytes puts the float32 one at offset 3
    small, values = torch.tensor([1, 2, 3], dtype=torch.int8), torch.tensor([1.5, -2.0, 3.25])
    header = json.dumps({"tree": {"a": {"$tensor": 0}, "b": {"$tensor": 1}},
                         "tensors": [["int8", [3], 0, 3], ["float32", [3], 3, 12]]}).encode()
    body = struct.pack("<Q", len(header)) + header + small.numpy().tobytes() + values.numpy().tobytes()
    raw = tensorpack.MAGIC + hashlib.sha256(body).digest() + body
    for given in (raw, bytearray(raw), memoryview(bytearray(raw))):
        tree = tensorpack.unpack(given)
        assert torch.equal(tree["a"], small) and torch.equal(tree["b"], values)


@pytest.mark.parametrize("kind", ["directory", "fifo"])
def test_a_pending_list_that_cannot_be_read_at_start_is_logged_and_the_writer_starts(
        tmp_path: Path, kind: str, caplog: pytest.LogCaptureFixture) -> None:
    """A restarted learner reads the rows its predecessor marked and never wrote (``pending-rows.i64``). Anything
    but a file there stopped it at start (a directory: IsADirectoryError, a traceback) or hung it for good (a FIFO
    without a writer). The list is a side output: the writer now starts, says what it could not read, and the rows
    it marks go out with the next delta as usual."""
    import os
    import threading

    from learner.deltas import PENDING

    path = tmp_path / PENDING
    if kind == "directory":
        path.mkdir()
    else:
        os.mkfifo(path)
    made: list[DeltaWriter] = []
    t = threading.Thread(target=lambda: made.append(DeltaWriter(tmp_path, CFG.num_rows, every_s=1.0)), daemon=True)
    t.start()
    t.join(10)
    if t.is_alive():  # (unblock the FIFO so the thread ends, then fail)
        with open(path, "wb"):
            pass
        t.join(10)
        pytest.fail("the writer blocked reading a FIFO in place of its pending list")
    assert made, "the writer did not start"
    assert f"cannot read {path}" in caplog.text
    learner = TinyLearner()
    for tb in learner.train(1):
        made[0].mark(tb.values)
    seq = made[0].write(learner.model, learner.trainer.samples)
    assert seq is not None and list_deltas(tmp_path)
