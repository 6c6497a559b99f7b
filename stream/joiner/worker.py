"""``streamrec join`` on faust-streaming: the default driver of :class:`~stream.joiner.pipeline.JoinPipeline`.

faust's consumer reads ``impressions`` and ``clicks`` together (subscribed through faust's Conductor, as an agent's
topic would be); faust assigns partition p of both topics to the same worker (they are co-partitioned by
impression id). It delivers in batches, not through an agent (``faust_delivery.py``): faust's per-message path
(a ``ConsumerMessage``, a Conductor callback, an ``Event`` and a stream-buffer entry per message, each acked)
took ~28 of 34 s on bench/joiner.py, the join ~5.4. Its Fetcher hands each batch of up to ``batch_max`` records
(gathered for at most ``batch_within_s``) to :meth:`JoinPipeline.process` in one synchronous call, then marks the
offsets the pipeline reports processed as acknowledged in faust's own ledger; faust's commit (its timer, every
``broker_commit_every`` acknowledgements, a revocation, shutdown) still decides when offsets go to the broker and
commits only acknowledged ones. It is still faust's commit, over faust's consumer and group membership; only the
acknowledging moved from an agent's stream to the end of ``process``: the offsets never run ahead of the state.
A rebalance while records are in hand drops them unprocessed (faust stops the flow before the revocation signal
reaches :meth:`FaustJoinWorker._on_revoked`) and seeks back to the committed offsets.

The local Tansu broker reports a partition's high watermark as the start of its last record batch + 1, and a
consumer resuming at a committed offset inside that batch gets nothing until more data arrives: the kafka driver
starts such partitions at the batch start (``stream.kafka.resume_offsets``), the faust driver's consumer moves its
start there at the first fetch of a generation (``faust_delivery.BatchConsumer._resume_safely``), and both skip what
they had applied. A worker does not exit idle during a rebalance: partitions of a member that died come with it.

An exception in a batch must not let faust acknowledge it, and no faust path may commit it afterwards (faust's
error handling commits what was acknowledged; its agents acknowledge a crashed batch): the process exits at once
with status 1 (``os._exit``) from inside the batch call, before the consumer acknowledges anything of it, for its
supervisor to restart it. The pipeline has given the batch's messages their strikes (``stream/strikes.py``).

Backpressure (``backpressure.py``): after each batch the worker pauses a partition's clicks while their waiting
count is near ``max_waiting_per_partition`` and its impressions have more to read (faust's
``pause_partitions``; records already fetched still arrive), and resumes them when the
impressions catch up or before an idle exit. The event-time rule (``max_input_drift_s``) is the kafka
driver's only: faust counts what it has fetched as read, and with the rule on (still under an agent), a
``fake_negative`` run on the test stream exited with a third of its impressions unread and its waiting
clicks drained as orphans. Not understood yet; for a backlog, ``--driver kafka``.

faust's Tables are not used for the join state: a Table sends one changelog record per write and
routes it by the current event, which a batch blurs; the pipeline's state log writes one record per
batch and partition instead (see ``state_log.py``).

Security: the ``[kafka]`` security settings reach faust (aiokafka underneath) as ``broker_credentials``
(:func:`broker_credentials`): ``SASL_PLAINTEXT`` / ``SASL_SSL`` with PLAIN, SCRAM-SHA-256 or SCRAM-SHA-512 as
``faust.SASLCredentials``, ``SSL`` as ``faust.SSLCredentials``, the TLS part as an ``ssl.SSLContext`` that trusts
``ssl_ca_location`` (the system store when unset) and presents ``ssl_certificate_location`` /
``ssl_key_location`` (``ssl_key_password``) when set. What faust cannot take:

* OAUTHBEARER: faust wants a token-provider object, not librdkafka's ``sasl.oauthbearer.*`` properties, so
  the faust driver refuses it (a ConfigError naming ``--driver kafka``, which supports it).
* ``[kafka.extra]``: those are librdkafka properties. Two are mapped onto the TLS context
  (``ssl.endpoint.identification.algorithm = none``: no host-name check; ``enable.ssl.certificate.verification
  = false``: no verification at all); every other key is ignored by faust, with a warning naming it.
* GSSAPI (Kerberos) is not offered by streamrec's settings at all.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import ssl
import sys
import tempfile
import time
from typing import Any, NoReturn

import faust
from faust.types import TP

from stream.config import KafkaSettings, SaslMechanism, SecurityProtocol
from stream.errors import ConfigError
from stream.joiner.backpressure import CLICKS, InputGate, Key, topic_of
from stream.joiner.config import JoinerSettings
from stream.joiner.faust_delivery import BatchDelivery, Processed, install
from stream.joiner.pipeline import JoinPipeline, Record

log = logging.getLogger("streamrec.join")

# librdkafka properties of [kafka.extra] that broker_credentials maps onto the TLS context.
_FAUST_MAPPED_EXTRA = ("ssl.endpoint.identification.algorithm", "enable.ssl.certificate.verification")


def _ssl_context(kafka: KafkaSettings) -> ssl.SSLContext:
    for setting in ("ssl_ca_location", "ssl_certificate_location", "ssl_key_location"):
        path = getattr(kafka, setting)
        if path is not None and not path.is_file():
            raise ConfigError(f"[kafka] {setting}: {path} {'is not a file' if path.exists() else 'does not exist'}")
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH,
                                     cafile=str(kafka.ssl_ca_location) if kafka.ssl_ca_location else None)
    if kafka.ssl_certificate_location is not None and kafka.ssl_key_location is not None:
        try:
            ctx.load_cert_chain(str(kafka.ssl_certificate_location), str(kafka.ssl_key_location),
                                password=kafka.ssl_key_password.reveal() or None)
        except ssl.SSLError as exc:
            raise ConfigError(f"[kafka] ssl_certificate_location / ssl_key_location: cannot load the client "
                              f"certificate and key ({exc.reason or exc}); is ssl_key_password right?") from None
    if kafka.extra.get("ssl.endpoint.identification.algorithm", "https").lower() == "none":
        ctx.check_hostname = False
    if kafka.extra.get("enable.ssl.certificate.verification", "true").lower() in ("false", "0"):
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    return ctx


def broker_credentials(kafka: KafkaSettings) -> faust.SASLCredentials | faust.SSLCredentials | None:
    """``[kafka]``'s security settings as faust's ``broker_credentials`` (module docstring: what faust cannot do)."""
    protocol = kafka.security_protocol
    ignored = sorted(k for k in kafka.extra if k not in _FAUST_MAPPED_EXTRA)
    if ignored:
        log.warning("[kafka.extra] %s: librdkafka properties, not applied to the faust driver", ", ".join(ignored))
    if protocol is SecurityProtocol.PLAINTEXT:
        return None
    ctx = _ssl_context(kafka) if protocol.tls else None
    if protocol.sasl:
        if kafka.sasl_mechanism is SaslMechanism.OAUTHBEARER:
            raise ConfigError("[kafka] sasl_mechanism = OAUTHBEARER is not supported by the faust join driver (faust "
                              "needs a token-provider object, not sasl.oauthbearer.* properties): run "
                              "`streamrec join --driver kafka`")
        return faust.SASLCredentials(username=kafka.sasl_username, password=kafka.sasl_password.reveal(),
                                     mechanism=kafka.sasl_mechanism.value, ssl_context=ctx)
    return faust.SSLCredentials(ctx)


class FaustJoinWorker:
    def __init__(self, pipeline: JoinPipeline, kafka: KafkaSettings, js: JoinerSettings) -> None:
        self.pipeline, self.kafka, self.js = pipeline, kafka, js
        self.exit_code = 0
        self._idle_since = time.monotonic()
        self._busy = False
        self._records_in_hand = 0
        self._stopping = False
        self._assigned: set[int] = set()  # the partitions assigned now (both topics: co-partitioned)
        # The waiting-click cap only, no event-time rule (module docstring): with it, a fake_negative run on the
        # test stream exited with impressions unread (not understood yet; the kafka driver has the rule).
        self.gate = InputGate(js.max_waiting_per_partition, enabled=js.backpressure, headroom=js.batch_max,
                              max_drift_ms=None)
        self.worker: faust.Worker | None = None
        # faust writes its table and app-id files under datadir (default: "<app-id>-data" in the working
        # directory, one per test run). The memory store keeps no state there, so a private temporary directory,
        # removed when the worker stops, is enough.
        self._datadir = tempfile.mkdtemp(prefix=f"streamrec-faust-{js.app_id}-")
        self.app = self._build_app()

    def _build_app(self) -> faust.App:
        k = self.kafka
        app = faust.App(
            self.js.app_id,
            broker=[f"kafka://{b.strip()}" for b in k.bootstrap_servers.split(",")],
            broker_credentials=broker_credentials(k),
            store="memory://",
            datadir=self._datadir,
            topic_partitions=k.partitions,
            topic_replication_factor=k.replication_factor,
            broker_session_timeout=k.session_timeout_ms / 1000,
            broker_heartbeat_interval=max(0.5, k.session_timeout_ms / 6000),
            consumer_auto_offset_reset="earliest",
            broker_max_poll_records=self.js.batch_max,
            consumer_max_fetch_size=8 * 1024 * 1024,
            web_enabled=False,
            topic_allow_declare=False,  # the pipeline creates the topics it needs
        )
        install(app, BatchDelivery(process=self._process, max_records=self.js.batch_max,
                                   within_s=self.js.batch_within_s, short_polls=lambda: bool(self.gate.paused),
                                   in_hand=self._in_hand))
        # Subscribed through faust's Conductor as an agent's topic would be; delivered in batches by faust_delivery.
        app.topics.add(app.topic(k.impressions_topic, k.clicks_topic, key_serializer="raw", value_serializer="raw"))
        app.timer(0.25)(self._idle_check)
        # faust calls these with (sender, partitions); its signal stubs declare another signature
        app.on_partitions_revoked.connect(self._on_revoked)  # type: ignore[arg-type]
        app.on_partitions_assigned.connect(self._on_assigned)  # type: ignore[arg-type]
        return app

    def _process(self, records: list[Record]) -> Processed:
        """One batch, called by faust's consumer (faust_delivery.py), which acknowledges what this returns as
        processed once it returned; on an exception the process exits here, before anything is acknowledged."""
        self._busy = True
        try:
            # every assigned partition's state in one read of the state log, not one per partition as each first
            # appears in a batch (each read costs a consumer's start-up and an end-of-partition wait)
            if missing := self._assigned - set(self.pipeline.engines):
                self.pipeline.restore(missing)
            self.pipeline.process(records)
            processed = self.pipeline.processed
        except BaseException:
            self._die("a batch failed")
        finally:
            self._busy = False
            self._idle_since = time.monotonic()
        self._apply_gate()
        return processed

    def _in_hand(self, n: int) -> None:
        """faust's consumer holds ``n`` records not processed yet: not idle."""
        self._records_in_hand = n
        if n:
            self._idle_since = time.monotonic()

    @staticmethod
    def _die(what: str) -> NoReturn:
        """Stop the process now, before faust can acknowledge the batch in hand (module docstring)."""
        log.exception("%s; exiting without acknowledging it (status 1)", what)
        for h in logging.getLogger().handlers:
            h.flush()
        sys.stderr.flush()
        os._exit(1)

    async def _on_assigned(self, sender: Any, assigned: set, **kwargs: Any) -> None:
        self._idle_since = time.monotonic()  # idleness counts from when there is something to read
        self._assigned = {tp.partition for tp in assigned if tp.topic == self.kafka.impressions_topic}

    async def _on_revoked(self, sender: Any, revoked: set, **kwargs: Any) -> None:
        # a rebalance under way is not idleness: a member that died hands its partitions over only now (the group
        # noticed it ~25 s after a SIGKILL on the local broker), and a survivor that exited idle meanwhile left
        # them unread; idleness counts again from the assignment (_on_assigned)
        self._idle_since = time.monotonic()
        self.pipeline.forget({tp.partition for tp in revoked if tp.topic == self.kafka.impressions_topic})
        self._assigned -= {tp.partition for tp in revoked}
        # faust keeps its paused set across a rebalance (a re-assigned partition stays paused): resume them
        gone = {tp.partition for tp in revoked if tp.topic == self.kafka.impressions_topic}
        self._set_paused(self.gate.release(gone), False)

    def _topic(self, kind: str) -> str:
        return topic_of(self.kafka, kind)

    def _behind(self, kind: str, partition: int) -> bool:
        """Whether ``kind``'s input of ``partition`` has more to read (faust's tracked high water and read offset)."""
        tp = TP(self._topic(kind), partition)
        consumer = self.app.consumer
        try:
            high = consumer.highwater(tp)
        except Exception:  # unknown: never hold an input back on a guess (the cap's overflow still bounds memory)
            return False
        if high is None or high <= 0:
            return False
        # faust's own record of the last offset its fetcher handed to the stream (faust.transport.consumer)
        read = getattr(consumer, "_read_offset", {}).get(tp)
        return read is None or read + 1 < high

    def _apply_gate(self) -> None:
        pause, resume = self.gate.update(self.pipeline.waiting(), self.pipeline.input_times(), self._behind)
        self._set_paused(pause, True)
        self._set_paused(resume, False)

    def _set_paused(self, keys: set[Key], paused: bool) -> None:
        self.pipeline.clicks_held = self.gate.held(CLICKS)
        if not keys:
            return
        tps = {TP(self._topic(k), p) for k, p in keys}
        if paused:
            log.info("paused for backpressure: %s", sorted(keys))
            self.app.consumer.pause_partitions(tps)
        else:
            self.app.consumer.resume_partitions(tps)

    async def _idle_check(self) -> None:
        limit = self.js.exit_when_idle_s
        if limit is None or self._stopping or self._busy or self._records_in_hand or \
                time.monotonic() - self._idle_since < limit:
            return
        if self.gate.paused:  # never end a run with an input held back: read it first
            self._set_paused(self.gate.release(), False)
            self._idle_since = time.monotonic()
            return
        self._stopping = True
        try:
            if self.js.drain_at_exit:
                self.pipeline.drain()
            await self.app.consumer.commit()
        except Exception:
            log.exception("flush at exit failed")
            self.exit_code = 1
        if self.worker is not None:
            # The path a SIGTERM takes: stop the worker's services, then leave the run loop.
            self.worker._schedule_shutdown(signal.SIGTERM)

    def run(self) -> int:
        """Run until SIGTERM/SIGINT, or until idle when ``exit_when_idle_s`` is set."""
        level = logging.getLevelName(logging.getLogger().level).lower()
        # stdout=stderr: faust's spinner and banner must not mix into a --json summary on stdout.
        self.worker = faust.Worker(self.app, loglevel="warn" if level == "warning" else level, quiet=True,
                                   redirect_stdouts=False, stdout=sys.stderr)
        try:
            self.worker.execute_from_commandline()
        except SystemExit as exc:
            return self.exit_code or (exc.code if isinstance(exc.code, int) else 0)
        finally:
            shutil.rmtree(self._datadir, ignore_errors=True)
        return self.exit_code
