"""``streamrec train`` on 2 ranks (torchrun, gloo, CPU) each reading through DataLoader workers, against the real
broker, killed mid-stream: a rank SIGKILLed (its workers orphaned with batches read ahead of what it trained), or one
DataLoader worker of a rank SIGKILLed (the rank must fail, not wait for ever in a collective its peer waits in, and
torchrun's elastic agent restart the group). Either way the restarted job resumes at the checkpoint's offsets of
every partition, whatever the workers had read ahead, and trains every sample exactly once."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from learner import sharded_checkpoint
from stream.config import KafkaSettings
from tests.bounded_teardown import Reaper
from tests.integration.test_distributed import (
    MESSAGES,
    PARTITIONS,
    ROWS,
    env_for,
    last_json,
    produce,
    rank_processes,
    torchrun,
)
from tests.integration.test_learner_faults import dataloader_workers


def gone(pid: int) -> bool:
    """Whether process ``pid`` has ended (reaped, or a zombie waiting for its new parent to reap it)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


# the rank's kill runs in -m slow (test_distributed.py kills ranks without workers in CI); a worker's in CI
@pytest.mark.parametrize("victim", [pytest.param("rank", marks=pytest.mark.slow), "dataloader worker"])
def test_two_ranks_reading_through_dataloader_workers_killed_mid_stream_resume_and_train_every_sample_once(
        kafka: KafkaSettings, tmp_path: Path, reaper: Reaper, victim: str) -> None:
    """At the first checkpoint rank 1 (``rank``), or one of rank 1's 2 DataLoader workers (``dataloader worker``),
    is SIGKILLed while the workers have batches read ahead of the trained ones; then the second half of the stream
    arrives. The group is restarted by the agent and its final checkpoint counts every sample produced once."""
    rows = produce(kafka, messages=MESSAGES // 2)  # the first half; the second after the kill
    ckpt = tmp_path / "ckpt"
    env = env_for(kafka, STREAMREC_LEARNER_CHECKPOINT_EVERY_SAMPLES="600", STREAMREC_LEARNER_NUM_WORKERS="2",
                  STREAMREC_LEARNER_PREFETCH_FACTOR="2")
    total = MESSAGES * ROWS
    out_file, err_file = tmp_path / "torchrun.out", tmp_path / "torchrun.err"  # files: a full pipe would block
    with open(out_file, "w") as so, open(err_file, "w") as se:  # ends at --max-samples (both halves trained)
        proc = reaper.add(subprocess.Popen(torchrun(2, ckpt, "--max-samples", str(total), max_restarts=3, idle_s=120),
                                           env=env, stdout=so, stderr=se, start_new_session=True), group=True)
    while not sharded_checkpoint.list_complete(ckpt):
        assert proc.poll() is None, err_file.read_text()[-4000:]
        time.sleep(0.1)
    first = sharded_checkpoint.latest(ckpt)
    assert first is not None and first[1]["samples_trained"] < total  # killed mid-stream
    rank1 = rank_processes(proc.pid, 2)[1]
    workers = dataloader_workers(rank1)
    assert len(workers) == 2, workers
    os.kill(rank1 if victim == "rank" else workers[0], signal.SIGKILL)
    for p, n in produce(kafka, messages=MESSAGES // 2, first=MESSAGES // 2).items():
        rows[p] += n
    proc.wait(timeout=300)  # a rank waiting for ever on its peer (or a worker on its dead parent) hangs here
    out, err = out_file.read_text(), err_file.read_text()
    assert proc.returncode == 0, err[-4000:]
    assert err.count(" on 2 ranks (gloo)") >= 2, err[-4000:]  # the agent restarted the group
    if victim == "dataloader worker":  # rank 1 failed on its worker's death: no batch's fault, nothing struck
        assert f"DataLoader worker (pid {workers[0]}) is killed by signal" in err or \
            f"DataLoader worker (pid(s) {workers[0]}) exited unexpectedly" in err, err[-4000:]
        assert "gets a strike" not in err, err[-4000:]
    assert all(gone(pid) for pid in workers), [pid for pid in workers if not gone(pid)]  # none left orphaned
    path, meta = sharded_checkpoint.latest(ckpt)  # type: ignore[misc]
    assert {int(p): n for p, n in meta["partition_rows"].items()} == rows  # nothing lost, nothing twice
    assert {int(p): o for p, o in meta["offsets"].items()} == {p: MESSAGES // PARTITIONS for p in rows}
    assert meta["samples_trained"] == meta["metrics"]["samples"] == sum(rows.values()) == total
    assert last_json(out)["samples_trained"] == total


# the plan's gather (the stall fixed) in CI; the write step, right already, in -m slow
@pytest.mark.parametrize("stage", ["plan", pytest.param("write", marks=pytest.mark.slow)])
def test_a_rank_whose_dataloader_worker_dies_inside_a_checkpoint_leaves_the_group_at_once_and_the_restart_trains_once(
        kafka: KafkaSettings, tmp_path: Path, reaper: Reaper, stage: str) -> None:
    """torch raises a DataLoader worker's death from its SIGCHLD handler wherever the rank is: here (a timing
    amplifier, ``tests/fault_hooks.py``) between two of DCP's collectives in rank 1's first checkpoint. The save
    caught it and took rank 1 into its agreement's all-gather while rank 0 still waited in DCP's gather: the ranks'
    collectives out of step, the job stalled for ``collective_timeout_s`` (10 minutes by default) until gloo timed
    out. Rank 1 must leave at once, rank 0 fail on its departure, and the restarted job train every sample once.
    ``write``: the death raised in DCP's write step, which DCP gathers from every rank (right already): every rank
    fails the checkpoint alike, and the job is restarted as well."""
    rows = produce(kafka, messages=MESSAGES)
    ckpt = tmp_path / "ckpt"
    env = env_for(kafka, STREAMREC_LEARNER_CHECKPOINT_EVERY_SAMPLES="600", STREAMREC_LEARNER_NUM_WORKERS="2",
                  STREAMREC_TEST_WORKER_DIES_IN_CHECKPOINT="1" if stage == "plan" else "1:write")
    cmd = torchrun(2, ckpt)
    cmd[cmd.index("streamrec.cli")] = "tests.fault_hooks"
    with open(tmp_path / "torchrun.out", "w") as so, open(tmp_path / "torchrun.err", "w") as se:
        proc = reaper.add(subprocess.Popen(cmd, env=env, stdout=so, stderr=se, start_new_session=True), group=True)
    proc.wait(timeout=240)  # a stall until the collectives' timeout (600 s) does not end here
    err = (tmp_path / "torchrun.err").read_text()
    assert proc.returncode == 0, err[-4000:]
    assert "is killed by signal" in err, err[-4000:]
    if stage == "plan":
        # rank 1 left at once: rank 0 saw it go (gloo), or the agent stopped rank 0 first on rank 1's failure; a
        # stall would have run into the collectives' timeout (600 s) past the wait above
        assert "Connection closed by peer" in err or re.search(
            r"Sending process \d+ closing signal SIGTERM\n.*failed \(exitcode: 1\) local_rank: 1", err), err[-4000:]
    else:  # every rank failed the checkpoint for rank 1's worker
        assert err.count("failed (rank 1: RuntimeError: DataLoader worker") >= 2, err[-4000:]
    assert "Timed out" not in err and "Application timeout" not in err, err[-4000:]  # not the collectives' timeout
    assert err.count(" on 2 ranks (gloo)") == 2, err[-4000:]  # the agent restarted the group once
    _, meta = sharded_checkpoint.latest(ckpt)  # type: ignore[misc]
    assert {int(p): n for p, n in meta["partition_rows"].items()} == rows  # nothing lost, nothing twice
    assert meta["samples_trained"] == meta["metrics"]["samples"] == sum(rows.values())
