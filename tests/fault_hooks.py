"""Run a ``streamrec`` command with a fault injected, for the fault-injection tests.

``python -m tests.fault_hooks join ...`` is ``streamrec join ...`` except that the join, and the
learner's training step (on every rank under torchrun too), raise an unexpected exception whenever an
impression id starting with ``poison`` is in the batch: the stand-in for a bug that one message triggers.
With ``STREAMREC_TEST_POISON_STAGE=quality`` the training step does not fail; instead the training-quality
metrics (``TrainingQuality.record``, fed on N ranks by rank 0 with EVERY rank's rows of the round) raise on such an
id: a fault that one rank's message triggers on another rank.
And while the file named by ``STREAMREC_TEST_DISK_FULL`` exists, every write of a checkpoint's files fails with
ENOSPC after its first 4 KiB (a full disk): inside ``torch.save``'s own writes, which is where a real full disk
shows, not around ``checkpoint.save`` (torch turned that OSError into a RuntimeError the daemon did not survive);
writing the learner's strikes file (``FileStrikes``) fails with ENOSPC too.
With ``STREAMREC_TEST_WORKER_DIES_IN_CHECKPOINT=<rank>`` that rank of the job's first run SIGKILLs one of its own
DataLoader workers inside its first sharded checkpoint, between two of DCP's collectives (a timing amplifier: torch
raises the death from its SIGCHLD handler wherever the rank is, here where DCP gives the rank no try); with
``<rank>:write``, in DCP's write step instead (its errors gathered from every rank by DCP).
Test code only.
"""

from __future__ import annotations

import errno
import os
import sys
from pathlib import Path

from learner import checkpoint_files, checkpoint_lineage, checkpoint_write
from learner.quality import TrainingQuality
from learner.trainer import Trainer
from stream import strikes
from stream.joiner import engine

POISON = "poison"
_STAGE = os.environ.get("STREAMREC_TEST_POISON_STAGE", "step")  # step | quality
_apply = engine.PartitionJoin.apply
_test_then_train = Trainer.test_then_train


def _failing_apply(self, impressions, clicks, **kwargs):  # noqa: ANN001, ANN202 - a patch
    if any(imp.impression_id.startswith(POISON) for _, imp in impressions):
        raise RuntimeError("injected fault: the join failed on a poison impression")
    return _apply(self, impressions, clicks, **kwargs)


def _failing_step(self, batch):  # noqa: ANN001, ANN202 - a patch
    if any(str(i).startswith(POISON) for i in batch.impression_ids):
        raise RuntimeError("injected fault: training failed on a poison sample")
    return _test_then_train(self, batch)


_write_atomic = checkpoint_write.write_atomic
_DISK_FULL = os.environ.get("STREAMREC_TEST_DISK_FULL")


class _FullDisk:
    """A file on a disk that fills after ``room`` bytes: then every write raises ENOSPC, as write(2) does."""

    def __init__(self, fh, room: int = 4096) -> None:  # noqa: ANN001 - a patch
        self.fh, self.room = fh, room

    def write(self, data) -> int:  # noqa: ANN001 - a patch
        if len(data) > self.room:
            raise OSError(errno.ENOSPC, "No space left on device (injected)")
        self.room -= len(data)
        return self.fh.write(data)

    def flush(self) -> None:
        self.fh.flush()


def _unless_full(write_atomic, room: int):  # noqa: ANN001, ANN202 - a patch
    """``write_atomic`` on a disk with ``room`` bytes left while the disk-full flag exists."""
    def patched(path, data):  # noqa: ANN001, ANN202 - a patch
        if not (_DISK_FULL and Path(_DISK_FULL).exists()):
            return write_atomic(path, data)
        write = (lambda fh: fh.write(data)) if isinstance(data, (bytes, bytearray, memoryview)) else data
        return write_atomic(path, lambda fh: write(_FullDisk(fh, room)))
    return patched


_record = TrainingQuality.record


def _failing_record(self, impression_ids, *args, **kwargs):  # noqa: ANN001, ANN202 - a patch
    if any(str(i).startswith(POISON) for i in impression_ids):
        raise ValueError("injected fault: the quality metrics failed on a poison sample")
    return _record(self, impression_ids, *args, **kwargs)


checkpoint_write.write_atomic = _unless_full(_write_atomic, room=4096)  # (save's)
checkpoint_lineage.write_atomic = _unless_full(_write_atomic, room=4096)  # (the LINEAGE file's, as before its move)
checkpoint_files.write_atomic = _unless_full(_write_atomic, room=4096)  # (set_aside's .refused marks', as before)
strikes.write_atomic = _unless_full(strikes.write_atomic, room=0)
engine.PartitionJoin.apply = _failing_apply  # type: ignore[method-assign]
if _STAGE == "quality":
    TrainingQuality.record = _failing_record  # type: ignore[method-assign]
else:
    Trainer.test_then_train = _failing_step  # type: ignore[method-assign]

if int(os.environ.get("WORLD_SIZE", "1")) > 1 and _STAGE == "step":  # a rank under torchrun (TorchRec imported)
    from learner.sharded_trainer import ShardedTrainer

    _sharded_step = ShardedTrainer.test_then_train

    def _failing_sharded_step(self, batch, rows):  # noqa: ANN001, ANN202 - a patch
        if any(str(i).startswith(POISON) for i in batch.impression_ids):
            raise RuntimeError("injected fault: training failed on a poison sample")
        return _sharded_step(self, batch, rows)

    ShardedTrainer.test_then_train = _failing_sharded_step  # type: ignore[method-assign]

_WORKER_DIES_ON = os.environ.get("STREAMREC_TEST_WORKER_DIES_IN_CHECKPOINT", "")  # "<rank>" or "<rank>:write"
if _WORKER_DIES_ON.split(":")[0] == os.environ.get("RANK") and \
        os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
    import signal
    import time

    from torch.distributed.checkpoint import utils as dcp_utils
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    _worker_killed: list[str] = []

    def _kill_a_worker() -> None:
        """SIGKILL one DataLoader worker of this rank, once; its SIGCHLD handler raises the death in the sleep."""
        if not _worker_killed:
            me = os.getpid()
            kids = Path(f"/proc/{me}/task/{me}/children").read_text().split()
            _worker_killed.extend(k for k in kids if Path(f"/proc/{k}/comm").read_text().strip() == "pt_data_worker")
            os.kill(int(_worker_killed[0]), signal.SIGKILL)
            time.sleep(5)

    def _dying_in(method):  # noqa: ANN001, ANN202 - a patch
        def patched(self, *args):  # noqa: ANN001, ANN202 - a patch
            _kill_a_worker()
            return method(self, *args)
        return patched

    if _WORKER_DIES_ON.endswith(":write"):  # in DCP's write step, whose errors DCP gathers from every rank
        FileSystemWriter.write_data = _dying_in(FileSystemWriter.write_data)  # type: ignore[method-assign]
    else:  # in DCP's gather of the save plans, outside its error handling: this rank skips the gather
        dcp_utils._DistWrapper.gather_object = _dying_in(dcp_utils._DistWrapper.gather_object)  # type: ignore

if __name__ == "__main__":
    from streamrec.cli import main

    sys.exit(main(sys.argv[1:]))
