"""Both join drivers read committed records only: an application producing impressions or clicks in transactions
never has what it aborted joined. faust asks aiokafka for ``read_uncommitted`` unless it runs exactly-once itself, so
the faust driver joined aborted events where the kafka driver (librdkafka's default) did not. The local broker does
not honour aborts (environment.md), so what is checked here is what each driver asks its client for."""

from __future__ import annotations

import asyncio
import shutil
from types import SimpleNamespace

from stream.config import KafkaSettings
from stream.idle_clock import IdleClock
from stream.joiner.config import JoinerSettings
from stream.joiner.worker import FaustJoinWorker
from stream.kafka import consumer_config


def test_the_faust_drivers_aiokafka_consumer_reads_committed_records_only() -> None:
    async def isolation() -> str:
        pipeline = SimpleNamespace(held_counts={}, engines={}, processed={}, awake=IdleClock(1.0, 0.0))
        worker = FaustJoinWorker(pipeline, KafkaSettings(bootstrap_servers="127.0.0.1:9"),  # type: ignore[arg-type]
                                 JoinerSettings())
        try:
            thread = worker.app.consumer._new_consumer_thread()  # type: ignore[attr-defined]
            consumer = thread._create_worker_consumer(worker.app.transport)
            return str(consumer._isolation_level)  # what aiokafka gives its fetcher at start
        finally:
            shutil.rmtree(worker._datadir, ignore_errors=True)

    assert asyncio.run(isolation()) == "read_committed"  # was read_uncommitted


def test_every_librdkafka_consumer_reads_committed_records_only() -> None:
    assert consumer_config(KafkaSettings(), "g")["isolation.level"] == "read_committed"
