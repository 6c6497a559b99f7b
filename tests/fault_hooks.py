"""Run a ``streamrec`` command with a fault injected, for the fault-injection tests.

``python -m tests.fault_hooks join ...`` is ``streamrec join ...`` except that the join, and the
learner's training step, raise an unexpected exception whenever an impression id starting with
``poison`` is in the batch: the stand-in for a bug that one message triggers. Test code only.
"""

from __future__ import annotations

import sys

from learner.trainer import Trainer
from stream.joiner import engine

POISON = "poison"
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


engine.PartitionJoin.apply = _failing_apply  # type: ignore[method-assign]
Trainer.test_then_train = _failing_step  # type: ignore[method-assign]

if __name__ == "__main__":
    from streamrec.cli import main

    sys.exit(main(sys.argv[1:]))
