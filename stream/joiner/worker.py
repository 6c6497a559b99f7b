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
An input a restore finds deleted and made again (``JoinPipeline.started_over``: the group's committed offset may be the
old topic's) is committed at its first offset and read from there by faust's consumer before any of it is joined
(``faust_delivery``), as the kafka driver does (``kafka_driver.KafkaJoinWorker._started_over``).

An exception in a batch must not let faust acknowledge it, and no faust path may commit it afterwards (faust's
error handling commits what was acknowledged; its agents acknowledge a crashed batch). A failure of the
infrastructure (``stream.strikes.is_infrastructure``: Redis or the broker unreachable, timed out, loading) is
recovered in the process, as the kafka driver does: nothing of the batch is reported processed, the join state and
every held record are dropped, faust's consumer drops the hand and seeks back to the committed offsets
(``faust_delivery``: records it did not keep), and it waits (``RECOVERY_BACKOFF_S``, doubling up to 30 s, back to 1 s
after a good batch) before it fetches again; the state is restored from the state log with the next batch. Before,
the process exited on a brief Redis outage and relied on a supervisor to start it again. Any other exception exits
the process at once with status 1 (``os._exit``) from inside the batch call, before the consumer acknowledges
anything of it, for its supervisor to restart it; the pipeline has given the batch's messages their strikes
(``stream/strikes.py``). A rebalance whose partition layout check (``partitions.Layout.assigned``, an admin metadata
request) fails exits too, before anything of the assignment is read: status 2 where the topics disagree, 1 where the
broker could not answer (or anything else), for the supervisor to restart it and check again. It is not retried
in the process as the kafka driver does: the check is a blocking request on faust's event loop, which also runs
aiokafka's heartbeats, and faust's rebalance waits on the signal handler; an exception out of it was faust's crash,
with a traceback and an exit status of faust's choosing.

Backpressure (``backpressure.py``), as in the kafka driver: event time is kept aligned by the hold. The records of a
partition past its event-time frontier (``backpressure.hold_limits``, with ``max_input_drift_s``: one fetch can bring
an input minutes ahead of the other) are kept by the pipeline (``JoinPipeline.process_new``) and joined with a later
batch; faust's consumer acknowledges them only then (``faust_delivery``: kept records), so a crash or a rebalance reads
them again. Without it, impressions a fetch brought ahead of their clicks went out as observed 0s minutes before the
delayed positives of older impressions, and the waiting-click cap alone let impressions outrun their clicks past the
window. An input is paused (faust's ``pause_partitions``; records already fetched still arrive) for the memory its
held records take (``backpressure.InputPauses``), and a partition's clicks while their waiting count is near
``max_waiting_per_partition`` and its impressions have more to read; everything is resumed, and what is held joined,
before an idle exit. The gate's own event-time rule is not used, as in the kafka driver.

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
  = false``, or f/0 in any case, as librdkafka reads it: ``KafkaSettings.verifies_certificates``: no verification at
  all), ``max.partition.fetch.bytes`` onto faust's ``consumer_max_fetch_size``
  (the same limit: what one fetch brings of a partition; 8 MB when unset), and ``max.poll.interval.ms`` onto faust's
  ``broker_max_poll_interval`` (seconds; librdkafka's 300 s when unset, the kafka driver's, not faust's 1000 s)
  and onto faust's ``broker_rebalance_timeout`` too: librdkafka sends the poll interval as its JoinGroup rebalance
  timeout (as the Java client does), how long the broker waits for a member busy with a batch to rejoin before it
  drops it from the new generation; under faust's own 60 s a batch of a minute or more during a rebalance cost the
  faust driver its member where the kafka driver's stayed. Every other key is ignored by faust, with a warning
  naming it.
* GSSAPI (Kerberos) is not offered by streamrec's settings at all.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import sys
import tempfile
import time
from typing import Any, NoReturn, cast

import faust
from faust.types import TP

from stream.config import MAX_POLL_INTERVAL_MS, KafkaSettings, SaslMechanism, SecurityProtocol
from stream.errors import ConfigError, quoted
from stream.idle_clock import IdleClock
from stream.joiner.backpressure import CLICKS, InputGate, InputPauses, never_fetched, topic_of, unread
from stream.joiner.config import JoinerSettings
from stream.joiner.faust_delivery import BatchConsumer, BatchDelivery, Processed, install
from stream.joiner.pipeline import JoinPipeline
from stream.joiner.records import Record
from stream.kafka import heartbeat_interval_s
from stream.kafka_access import tls_context
from stream.strikes import RECOVERY_BACKOFF_S, is_infrastructure
from stream.unfetched import Unfetched

log = logging.getLogger("streamrec.join")

_IDLE_TICK_S = 0.25  # how often the idle check runs
_STALL_S = 2.0  # a gap between two idle checks longer than this is a stall, not idleness (FaustJoinWorker._idle_check)

# librdkafka properties of [kafka.extra] that the faust driver maps: onto the TLS context (broker_credentials), and
# onto faust's per-partition fetch size (_fetch_bytes) and its poll interval and rebalance timeout
# (_max_poll_interval_s).
_FAUST_MAPPED_EXTRA = ("ssl.endpoint.identification.algorithm", "enable.ssl.certificate.verification",
                       "max.partition.fetch.bytes", "max.poll.interval.ms")
_FETCH_BYTES = 8 * 1024 * 1024  # faust's consumer_max_fetch_size (aiokafka's max_partition_fetch_bytes) when unset
_REQUEST_TIMEOUT_S = 90.0  # faust's broker_request_timeout, unless the session is longer (_request_timeout_s)


def _extra_count(kafka: KafkaSettings, key: str, default: int, unit: str) -> int:
    """A positive whole number from ``[kafka.extra]`` (``default`` when unset) for a faust setting of the same meaning:
    librdkafka refuses a bad one when the kafka driver's client is built, so the faust driver refuses it too."""
    raw = kafka.extra.get(key)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value <= 0:
        raise ConfigError(f"[kafka.extra] {key}: {raw!r} is not a positive number of {unit}")
    return value


def _fetch_bytes(kafka: KafkaSettings) -> int:
    """``[kafka.extra] max.partition.fetch.bytes`` as faust's ``consumer_max_fetch_size``: the most one fetch brings of
    a partition (librdkafka's property of the same meaning, which the kafka driver gets as it is)."""
    return _extra_count(kafka, "max.partition.fetch.bytes", _FETCH_BYTES, "bytes")


def _max_poll_interval_s(kafka: KafkaSettings) -> float:
    """``[kafka.extra] max.poll.interval.ms`` as faust's ``broker_max_poll_interval`` (seconds): how long a batch may
    keep the member from polling before the group drops it and hands its partitions on. Unset, librdkafka's default
    (the kafka driver's), not faust's own 1000 s: both drivers give a stuck member up after the same time. It is
    the rebalance timeout too (module docstring), as librdkafka's JoinGroup has it."""
    return _extra_count(kafka, "max.poll.interval.ms", MAX_POLL_INTERVAL_MS, "milliseconds") / 1000


def _request_timeout_s(kafka: KafkaSettings) -> float:
    """faust's ``broker_request_timeout``: its own 90 s, or the session where that is longer. faust refuses a session
    over its request timeout when the consumer starts, so a ``session_timeout_ms`` the settings allow (up to the poll
    interval) and the kafka driver runs with stopped the faust driver there."""
    return max(_REQUEST_TIMEOUT_S, kafka.session_timeout_ms / 1000)


def broker_credentials(kafka: KafkaSettings) -> faust.SASLCredentials | faust.SSLCredentials | None:
    """``[kafka]``'s security settings as faust's ``broker_credentials`` (module docstring: what faust cannot do)."""
    protocol = kafka.security_protocol
    ignored = sorted(k for k in kafka.extra if k not in _FAUST_MAPPED_EXTRA)
    if ignored:
        log.warning("[kafka.extra] %s: librdkafka properties, not applied to the faust driver", ", ".join(ignored))
    if protocol is SecurityProtocol.PLAINTEXT:
        return None
    ctx = tls_context(kafka) if protocol.tls else None
    if protocol.sasl:
        if kafka.sasl_mechanism is SaslMechanism.OAUTHBEARER:
            raise ConfigError("[kafka] sasl_mechanism = OAUTHBEARER is not supported by the faust join driver (faust "
                              "needs a token-provider object, not sasl.oauthbearer.* properties): run "
                              "`streamrec join --driver kafka`")
        return faust.SASLCredentials(username=kafka.sasl_username, password=kafka.sasl_password.reveal(),
                                     mechanism=kafka.sasl_mechanism.value, ssl_context=ctx)
    return faust.SSLCredentials(ctx)


def _faust_env(settings: dict[str, Any]) -> dict[str, str]:
    """The environment faust's App reads its settings from: the process's, less faust's environment names of
    ``settings`` (under ``APP_ENV_PREFIX`` too), which the worker gives from streamrec's own settings, each said in a
    WARNING. faust's environment names win over its App's arguments: ``BROKER_URL`` (a name other tools use) took the
    faust driver to another broker than ``[kafka] bootstrap_servers``, ``CONSUMER_AUTO_OFFSET_RESET=latest`` had a new
    group pass over its backlog, ``APP_WEB_ENABLED`` opened faust's web server, where the kafka driver reads streamrec's
    settings only. faust's names for settings the worker leaves to faust (``BROKER_COMMIT_INTERVAL``) still apply."""
    env = dict(os.environ)
    prefix = env.get(faust.Settings.SETTINGS["env_prefix"].env_name or "", "").rstrip("_")
    names = {n for name in settings if (n := faust.Settings.SETTINGS[name].env_name)}
    ignored = sorted(k for k in env if k in names or (prefix and k.startswith(prefix + "_")
                                                         and k[len(prefix) + 1:] in names))
    if ignored:
        log.warning("faust's environment name(s) %s ignored: the faust join driver sets them from streamrec's own "
                    "settings (the [kafka] and [joiner] sections, STREAMREC_* variables), as the kafka driver does; "
                    "unset them or set the streamrec setting", ", ".join(ignored))
    return {k: v for k, v in env.items() if k not in ignored}


class FaustJoinWorker:
    def __init__(self, pipeline: JoinPipeline, kafka: KafkaSettings, js: JoinerSettings) -> None:
        self.pipeline, self.kafka, self.js = pipeline, kafka, js
        self.exit_code = 0
        # what failed the idle exit's drain or last flush (_idle_check): raised by run, no summary (the kafka driver's)
        self.exit_error: Exception | None = None
        # a stall restarts idleness after a wait of two heartbeats (_idle_check)
        self._idle = IdleClock(_STALL_S, None, after_stall_s=2 * heartbeat_interval_s(kafka))
        self._busy = False
        self._records_in_hand = 0
        self._stopping = False
        self._assigned: set[int] = set()  # the partitions assigned now (both topics: co-partitioned)
        self._settled = False  # an assignment (perhaps empty) came and no rebalance started since (_idle_check)
        # The gate's waiting-click rule only; event time is the hold's (module docstring), as in the kafka driver.
        self.gate = InputGate(js.max_waiting_per_partition, enabled=js.backpressure, headroom=js.batch_max,
                              max_drift_ms=None)
        self.pauses = InputPauses(self.gate, js.batch_max)  # what the consumer has paused: the gate's and the hold's
        self.unfetched = Unfetched()  # an input not fetched yet since its assignment: behind, for a while
        self._hold = js.backpressure and js.max_input_drift_s is not None
        self._join_held = False  # set by the idle check: the next batch joins what is held, whatever the frontier
        self.recoveries = 0  # infrastructure failures recovered from (_recover)
        self._backoff_s = RECOVERY_BACKOFF_S[0]  # the next recovery's wait
        self._wait = 0.0  # the wait owed before the next fetch
        self._again: set[tuple[str, int]] = set()  # inputs the last batch's restore found made again (_started_over)
        self._below: set[tuple[str, int]] = set()  # inputs read again below faust's read offset (BatchDelivery.below)
        self._waited_until = 0.0  # (time.monotonic) when the wait the consumer took ends
        self.worker: faust.Worker | None = None
        # faust writes its table and app-id files under datadir (default: "<app-id>-data" in the working
        # directory, one per test run). The memory store keeps no state there, so a private temporary directory,
        # removed when the worker stops, is enough.
        self._datadir = tempfile.mkdtemp(prefix=f"streamrec-faust-{js.app_id}-")
        self.app = self._build_app()

    def _build_app(self) -> faust.App:
        k = self.kafka
        settings: dict[str, Any] = dict(
            broker=[f"kafka://{b.strip()}" for b in k.bootstrap_servers.split(",")],
            broker_credentials=broker_credentials(k),
            store="memory://",
            datadir=self._datadir,
            topic_partitions=k.partitions,
            topic_replication_factor=k.replication_factor,
            broker_session_timeout=k.session_timeout_ms / 1000,
            broker_request_timeout=_request_timeout_s(k),
            broker_heartbeat_interval=heartbeat_interval_s(k),
            broker_max_poll_interval=_max_poll_interval_s(k),
            broker_client_id=k.client_id,  # [kafka] client_id, as the kafka driver (broker quotas, logs)
            broker_rebalance_timeout=_max_poll_interval_s(k),  # librdkafka's JoinGroup rebalance timeout (docstring)
            consumer_auto_offset_reset="earliest",
            broker_max_poll_records=self.js.batch_max,
            consumer_max_fetch_size=_fetch_bytes(k),
            web_enabled=False,
            topic_allow_declare=False,  # the pipeline creates the topics it needs
            # no leader election (no on_leader timer or agent here): faust's assignor subscribed to
            # "<app_id>-__assignor-__leader", which the broker auto-created with its own defaults
            topic_disable_leader=True,
            # faust's commit as it is read here (exactly_once commits through per-partition transactional producers)
            processing_guarantee="at_least_once",
        )
        app = faust.App(self.js.app_id, env=_faust_env(settings), **settings)
        install(app, BatchDelivery(process=self._process, max_records=self.js.batch_max,
                                   within_s=self.js.batch_within_s, short_polls=lambda: bool(self.pauses.paused),
                                   in_hand=self._in_hand, held=lambda: self.pipeline.held_counts,
                                   dropped=self._drop_held, wait_s=self._wait_s, started_over=self._take_started_over,
                                   below=self._below.update, due=lambda: self.pipeline.topics_due()))
        # Subscribed through faust's Conductor as an agent's topic would be; delivered in batches by faust_delivery.
        app.topics.add(app.topic(k.impressions_topic, k.clicks_topic, key_serializer="raw", value_serializer="raw"))
        app.timer(_IDLE_TICK_S)(self._idle_check)
        # faust calls these with (sender, partitions); its signal stubs declare another signature
        app.on_partitions_revoked.connect(self._on_revoked)  # type: ignore[arg-type]
        app.on_partitions_assigned.connect(self._on_assigned)  # type: ignore[arg-type]
        return app

    def _process(self, records: list[Record]) -> Processed:
        """One batch, called by faust's consumer (faust_delivery.py), which acknowledges what this returns as
        processed once it returned; on an infrastructure failure nothing (:meth:`_recover`), on any other exception
        the process exits here, before anything is acknowledged."""
        self._busy = True
        held_before = self.pipeline.held_counts
        behind = self._holds_back if self._hold and not self._join_held else None
        self._join_held = False
        try:
            # every assigned partition's state in one read of the state log, not one per partition as each first
            # appears in a batch (each read costs a consumer's start-up and an end-of-partition wait)
            if missing := self._assigned - set(self.pipeline.engines):
                self.pipeline.restore(missing)
            below = set(self._below)  # (the set faust's consumer adds to: BatchDelivery.below)
            self._below.clear()
            if below:  # read again below what faust's consumer read, while it ran: the topic made again under it?
                self.pipeline.regressed(below)
            self.pipeline.check_topics()  # every topic_check_s: an input made again under the running consumer
            if self._started_over():
                return {}  # read again once the consumer started them over: nothing of them joined before
            self.pipeline.process_new(records, behind)  # what it holds back it keeps, and faust does not acknowledge
            processed = self.pipeline.processed
        except Exception as exc:
            if isinstance(exc, ConfigError) or not is_infrastructure(exc):  # (a ConfigError: a message over a topic's
                self._close_pipeline()  # limit; exits 2 as the CLI's)
                self._die("a batch failed", 2 if isinstance(exc, ConfigError) else 1)
            self._recover(exc)
            return {}
        except BaseException:
            self._close_pipeline()
            self._die("a batch failed", 1)
        finally:
            self._busy = False
        self._backoff_s = RECOVERY_BACKOFF_S[0]
        if records or processed or self.pipeline.held_counts != held_before:  # not an offer of what is held alone
            self._idle.reset()
        self._apply_gate()
        return processed

    def _started_over(self) -> bool:
        """Whether the restore found inputs deleted and made again (``pipeline.started_over``), said once each and kept
        for faust's consumer (:meth:`_take_started_over`): it commits their first offset and reads the batch again
        (``faust_delivery.BatchConsumer.start_over``). Their records below the group's committed offset, the old
        topic's, were left out as processed (``_resume_safely``'s floor), none joined, in silence."""
        again = self.pipeline.take_started_over()
        self._again |= again
        if again:
            self._idle.reset()  # read again from their first record: no idleness before
        return bool(again)

    def _take_started_over(self) -> set[tuple[str, int]]:
        """``BatchDelivery.started_over``: what :meth:`_started_over` kept, once."""
        again, self._again = self._again, set()
        return again

    def _recover(self, exc: Exception) -> None:
        """Back to the last durable point after an infrastructure failure (module docstring): the join state and what
        is held dropped, the gate's pauses released; faust's consumer, given nothing processed and nothing held, drops
        the hand and seeks back to the committed offsets, then waits :meth:`_wait_s` before it fetches again."""
        log.warning("infrastructure failure (%s: %s); reading again from the committed offsets in %.0f s",
                    type(exc).__name__, quoted(str(exc)), self._backoff_s)
        self.recoveries += 1
        self.pipeline.drop_held(set(self.pipeline.held_counts))  # never acknowledged: the seek reads them again
        self.pipeline.forget(set(self.pipeline.engines))  # restored from the state log with the next batch
        self.gate.release()
        self._sync_pauses()
        self._wait = self._backoff_s
        self._backoff_s = min(RECOVERY_BACKOFF_S[1], self._backoff_s * 2)
        self._idle.reset()  # a rewind is not idleness: what follows must be read again before an idle exit

    def _wait_s(self) -> float:
        """How long faust's consumer waits before its next fetch (after a recovery: the backoff), once."""
        wait, self._wait = self._wait, 0.0
        if wait > 0:
            self._waited_until = time.monotonic() + wait
        return wait

    def _drop_held(self, partitions: set[tuple[str, int]] | None) -> None:
        """faust's consumer dropped what the pipeline holds of ``partitions`` (None: all): it is read again."""
        self.pipeline.drop_held(set(self.pipeline.held_counts) if partitions is None else partitions)
        self._sync_pauses()

    def _in_hand(self, n: int) -> None:
        """faust's consumer holds ``n`` records not processed yet: not idle."""
        self._records_in_hand = n
        if n:
            self._idle.reset()

    def _close_pipeline(self) -> None:
        """Before a crash exit: the day counts of the batches already durable written (the failed batch's were never
        added), as the kafka driver's ``finally`` does; lost here until now (``os._exit`` skips every ``finally``).
        A failure to write them is logged, never raised (a KeyboardInterrupt out of the wait neither): the exit goes on
        with the batch's own error."""
        try:
            self.pipeline.close()
        except BaseException as exc:  # noqa: BLE001 - the crash's own error decides the exit
            log.warning("the day counts could not be written before exiting (%s: %s)", type(exc).__name__,
                        quoted(str(exc)))

    @staticmethod
    def _die(what: str, status: int = 1) -> NoReturn:
        """Stop the process now, before faust can acknowledge the batch in hand (module docstring). A ConfigError (a
        setting to fix) is said in its one line, as the CLI says it; anything else with its traceback."""
        if isinstance(error := sys.exc_info()[1], ConfigError):
            log.error("%s: %s; exiting without acknowledging it (status %d)", what, error, status)
        else:
            log.exception("%s; exiting without acknowledging it (status %d)", what, status)
        for h in logging.getLogger().handlers:
            h.flush()
        sys.stderr.flush()
        os._exit(status)

    async def _on_assigned(self, sender: Any, assigned: set, **kwargs: Any) -> None:
        try:  # partitions added to the inputs: the topics must still agree (stream/joiner/partitions.py)
            self.pipeline.layout.assigned(tp.partition for tp in assigned)
        except ConfigError:  # (said by _die in its one line)
            self._close_pipeline()  # the day counts of the batches already durable, as in a batch's crash exit
            self._die("the topics' partitions no longer agree", 2)  # exits 2 as the CLI's ConfigError
        except Exception as exc:  # the broker could not say (its metadata request timed out), or a bug: no retry here
            self._close_pipeline()
            self._die(f"the partition layout of assigned partitions could not be checked ({type(exc).__name__}: "
                      f"{quoted(str(exc))}); restart to check it again", 1)  # (module docstring)
        log.info("assigned %s", sorted((tp.topic, tp.partition) for tp in assigned))  # as the kafka driver says it
        self._idle.reset()  # idleness counts from when there is something to read, or nothing at all is assigned
        self._settled = True
        self._assigned = {tp.partition for tp in assigned if tp.topic == self.kafka.impressions_topic}
        self.unfetched.forget(tp.partition for tp in assigned)
        self.pauses.resize(len(self._assigned))

    async def _on_revoked(self, sender: Any, revoked: set, **kwargs: Any) -> None:
        # a rebalance under way is not idleness: a member that died hands its partitions over only now (the group
        # noticed it ~25 s after a SIGKILL on the local broker), and a survivor that exited idle meanwhile left
        # them unread; idleness counts again from the assignment (_on_assigned)
        self._idle.reset()
        self._settled = False
        gone = {tp.partition for tp in revoked if tp.topic == self.kafka.impressions_topic}
        self.pipeline.drop_held({(tp.topic, tp.partition) for tp in revoked})  # the next owner reads them
        cast(BatchConsumer, self.app.consumer).forget_kept({TP(tp.topic, tp.partition) for tp in revoked})
        self._assigned -= {tp.partition for tp in revoked}
        self.unfetched.forget(tp.partition for tp in revoked)
        # faust keeps its paused set across a rebalance (a re-assigned partition stays paused): resume them
        self.gate.release(gone)
        self._sync_pauses()
        self.pipeline.forget(gone)  # after the resume: it removes their gauges, PAUSED too (metrics.forget)

    def _topic(self, kind: str) -> str:
        return topic_of(self.kafka, kind)

    def _holds_back(self, kind: str, partition: int) -> bool:
        """``InputPauses.holds_back`` over faust's consumer: whether ``kind`` of ``partition`` bounds what is joined."""
        waiting = self.pipeline.waiting().get(partition, 0) if kind == CLICKS else 0
        return self.pauses.holds_back(kind, partition, waiting, self._behind)

    def _behind(self, kind: str, partition: int) -> bool:
        """Whether ``kind``'s input of ``partition`` has more to read: records the batches have not brought yet
        (``BatchConsumer.fetched_more``; not fetched yet since the assignment: yes, for a while: ``Unfetched``)."""
        more = cast(BatchConsumer, self.app.consumer).fetched_more(TP(self._topic(kind), partition))
        return self.unfetched.behind((kind, partition), more)

    def _apply_gate(self) -> None:
        self.gate.update(self.pipeline.waiting(), self.pipeline.input_times(), self._behind)
        self._sync_pauses()

    def _sync_pauses(self) -> None:
        """Pause what the gate or a hold wants paused and resume the rest."""
        pause, resume = self.pauses.sync(self.pipeline.held_per_input())
        self.pipeline.clicks_held = {p for k, p in self.pauses.paused if k == CLICKS}
        if pause:
            log.info("paused for backpressure: %s", sorted(pause))
            self.app.consumer.pause_partitions({TP(self._topic(k), p) for k, p in pause})
        if resume:
            self.app.consumer.resume_partitions({TP(self._topic(k), p) for k, p in resume})

    def _rebalancing(self) -> bool:
        """Whether a rebalance is under way: none of this member's assignment came yet, a revocation came since it, or
        faust's own flag (set as soon as aiokafka's listener hears of it, cleared once the flow resumed) says so. A
        member without partitions exits idle only outside of one: the partitions of a member that died come with it."""
        return not self._settled or self.app.rebalancing

    async def _idle_check(self) -> None:
        """Every ``_IDLE_TICK_S``: end the run once nothing came for ``exit_when_idle_s`` (draining first with
        ``drain_at_exit``). A gap between two ticks longer than ``_STALL_S`` is a stall (the process stopped, a long GC
        pause or a swapping host; a batch that kept the loop busy), not idleness: idleness counts afresh from it,
        after a wait of two heartbeats that input meanwhile does not end (stream.idle_clock). A member woken from a
        stall past its session had lost its partitions, which faust tells it only a heartbeat later: taken for idle
        at once, it drained its stale joins, their pending impressions out as samples labelled 0 whose clicks the
        partitions' new owner had joined already (the frozen-joiner fault test). With a limit under a heartbeat it
        still did (idleness restarted at 0). Idleness counts only outside a rebalance (:meth:`_rebalancing`) and once
        each assigned input is read to its end (``backpressure.unread``): it ran during a rebalance and before the
        clicks' first fetch, and a slow group join or fetch ended the run with the clicks unread, their impressions
        drained as 0s.
        A member assigned no partition (more workers than partitions) counts idleness once its empty assignment came:
        taken for a rebalance under way, it never exited and its bounded run never ended."""
        idle_s = self._idle.tick()  # below 0 for two heartbeats after a stall
        self.pipeline.awake.tick()  # a round ran: a quiet click input's time counts (a stall's does not)
        limit = self.js.exit_when_idle_s
        if self._wait or time.monotonic() < self._waited_until:  # a recovery's wait, owed or under way, is no idleness
            self._idle.reset()  # (the rewound records are read only after it: idleness counts from its end)
            return
        if limit is None or self._stopping or self._busy or self._records_in_hand:
            return
        if self._rebalancing() or unread(self._assigned, self._behind, self.pauses.paused):
            self._idle.reset()  # a rebalance under way, input not read yet: no idleness (backpressure.unread)
            return
        if idle_s < limit:
            return
        if self.pipeline.held_counts:  # never end a run with records held: the next batch joins them all
            self._join_held = True
            self._idle.reset()
            return
        if self.pauses.paused:  # nor with an input held back: read it first
            self.gate.release()
            self._sync_pauses()
            self._idle.reset()
            return
        self._stopping = True
        if overdue := self.unfetched.overdue():  # nor as idle with an input never fetched: not complete, status 1
            self.exit_code = never_fetched(overdue, self.unfetched.grace_s + limit)
        try:
            if self.js.drain_at_exit and not self.exit_code:
                # every assigned partition, those that brought no record since their assignment too (not restored)
                self.pipeline.restore(self._assigned)
                # an input that restore found made again gets its first offset committed before the drain's chunks
                # record the new topic's id (as the kafka driver's run does): left the old topic's, the next start
                # read on from it, no start over
                if again := self.pipeline.take_started_over():
                    await cast(BatchConsumer, self.app.consumer).start_over(again)
                self.pipeline.drain()
            await self.app.consumer.commit()
        except Exception as exc:  # raised by run once faust has stopped: the run failed, not complete (no summary)
            self.exit_error = exc
            self.exit_code = 1
        if self.worker is not None:
            # The path a SIGTERM takes: stop the worker's services, then leave the run loop.
            self.worker._schedule_shutdown(signal.SIGTERM)

    def _faust_worker(self) -> faust.Worker:
        """The faust worker :meth:`run` executes, at the root logger's level, logging through the CLI's handlers as they
        are (``override_logging=False``): faust's own set-up at start replaced them with handlers of its own, without
        ``stream.secrets.RedactingFilter``, and every line logged after the start went out unscrubbed."""
        level = logging.getLevelName(logging.getLogger().level).lower()
        # stdout=stderr: faust's spinner and banner must not mix into a --json summary on stdout.
        return faust.Worker(self.app, loglevel="warn" if level == "warning" else level, quiet=True,
                            redirect_stdouts=False, stdout=sys.stderr, override_logging=False)

    @property
    def stop_reason(self) -> str:
        """As :attr:`~stream.joiner.kafka_driver.KafkaJoinWorker.stop_reason`: the idle exit sets ``_stopping``; faust's
        worker ends otherwise on a signal (status 0) or a crash of one of its services, which mode's ``exiting`` ends as
        status 1, not by raising: "error" (a crash said "signal", an operator's stop)."""
        return "input idle" if self._stopping else "error" if self.exit_code else "signal"

    def run(self) -> int:
        """Run until SIGTERM/SIGINT, or until idle when ``exit_when_idle_s`` is set. A drain or last flush of the idle
        exit that failed is raised here, once faust has stopped, as the kafka driver's run raises it (until 2026-12-08
        the run ended with status 1 and a summary saying "input idle", as if complete, its drain or commit failed)."""
        self.worker = self._faust_worker()
        try:
            self.worker.execute_from_commandline()
        except SystemExit as exc:
            self.exit_code = self.exit_code or (exc.code if isinstance(exc.code, int) else 0)
        finally:
            shutil.rmtree(self._datadir, ignore_errors=True)
        if self.exit_error is not None:
            raise self.exit_error
        return self.exit_code
