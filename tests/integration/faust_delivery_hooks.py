"""Run ``streamrec join`` with probes on how the faust driver delivers and commits (test code only).

``python -m tests.integration.faust_delivery_hooks join ...`` is ``streamrec join ...`` that writes one JSON line
per event to the file named by ``STREAMREC_TEST_DELIVERY_LOG``:

* ``{"batch": n, "size": ..., "tps": {"topic:partition": [first, last]}, "events": ...}`` as each
  ``JoinPipeline.process_new`` call starts (``events``: faust ``Event`` objects created so far; size 0: the driver
  offers what the pipeline holds again);
* ``{"returned": n}`` when it returned;
* ``{"commit": {"topic:partition": offset}, "ahead": [...], "generation": g}`` for every offset commit faust sends to
  the broker, ``ahead`` naming the partitions whose committed offset lies past the records the returned batches
  processed (``JoinPipeline.processed``: offsets running ahead of the state; records held back are not processed),
  ``generation`` the group generation aiokafka holds as it goes out (-1: the member was dropped from the group).

With ``STREAMREC_TEST_FAIL_BATCH=n`` the n-th ``process_new`` call raises instead (an unexpected failure in a batch;
with ``STREAMREC_TEST_FAIL_KIND=redis``, Redis refusing the connection: an infrastructure failure). With
``STREAMREC_TEST_SLOW_BATCH=n`` the n-th call first sleeps ``STREAMREC_TEST_SLOW_S`` seconds (a slow batch).
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import redis
from faust.events import Event

from stream.joiner import faust_delivery
from stream.joiner.pipeline import JoinPipeline
from stream.joiner.records import Record

_LOG = open(os.environ["STREAMREC_TEST_DELIVERY_LOG"], "a", buffering=1)  # noqa: SIM115 - lives with the process
_FAIL_AT = int(os.environ.get("STREAMREC_TEST_FAIL_BATCH", "0"))
_FAIL_KIND = os.environ.get("STREAMREC_TEST_FAIL_KIND", "")
_SLOW_AT = int(os.environ.get("STREAMREC_TEST_SLOW_BATCH", "0"))
_SLOW_S = float(os.environ.get("STREAMREC_TEST_SLOW_S", "0"))
_process_new = JoinPipeline.process_new
_commit = faust_delivery.BatchConsumer._commit
_event_init = Event.__init__
_returned: dict[str, int] = {}  # "topic:partition" -> the offset after the last record the returned batches processed
_batches = 0
_events = 0


def _write(entry: dict[str, Any]) -> None:
    _LOG.write(json.dumps(entry) + "\n")


def _counting_event_init(self, *args, **kwargs) -> None:  # noqa: ANN001, ANN002, ANN003 - a patch
    global _events
    _events += 1
    _event_init(self, *args, **kwargs)


def _probed_process_new(self, records: list[Record], behind=None):  # noqa: ANN001, ANN202 - a patch
    global _batches
    _batches += 1
    tps: dict[str, list[int]] = {}
    for r in records:
        span = tps.setdefault(f"{r.topic}:{r.partition}", [r.offset, r.offset])
        span[0], span[1] = min(span[0], r.offset), max(span[1], r.offset)
    _write({"batch": _batches, "size": len(records), "tps": tps, "events": _events})
    if _batches == _FAIL_AT:
        if _FAIL_KIND == "redis":
            raise redis.ConnectionError(f"injected outage in batch {_batches}: Connection refused.")
        raise RuntimeError(f"injected fault in batch {_batches}")
    if _batches == _SLOW_AT:
        time.sleep(_SLOW_S)  # the slow batch itself: past the consumer's max poll interval
    _process_new(self, records, behind)
    for (topic, partition), end in self.processed.items():
        tp = f"{topic}:{partition}"
        _returned[tp] = max(_returned.get(tp, 0), end)
    _write({"returned": _batches})


async def _probed_commit(self, offsets):  # noqa: ANN001, ANN202 - a patch
    committed = {f"{tp.topic}:{tp.partition}": off for tp, off in offsets.items()}
    ahead = sorted(tp for tp, off in committed.items() if off > _returned.get(tp, 0))
    _write({"commit": committed, "ahead": ahead, "generation": _generation(self)})
    return await _commit(self, offsets)


def _generation(consumer) -> int:  # noqa: ANN001 - a probe
    """The group generation aiokafka's coordinator holds now (-1: a member of none, dropped from the group)."""
    return consumer._thread._ensure_consumer()._coordinator.generation


Event.__init__ = _counting_event_init  # type: ignore[method-assign]
JoinPipeline.process_new = _probed_process_new  # type: ignore[method-assign]
faust_delivery.BatchConsumer._commit = _probed_commit  # type: ignore[method-assign]

if __name__ == "__main__":
    from streamrec.cli import main

    sys.exit(main(sys.argv[1:]))
