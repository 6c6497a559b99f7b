"""The stream stage, the ground floor: everything that travels on Kafka and in Redis.

Owns: the event schemas and their limits (``events.py``, ``limits.py``), sample batches as Arrow IPC
(``samples.py``), the Kafka and Redis configs and the ``Choice`` base of every setting with fixed
values (``config.py``), durable local files (``files.py``: fsync, atomic replace), stable id and
feature hashing (``ids.py``, ``features.py``), Kafka client configs, consumer helpers and the one
read-to-end loop (``kafka.py``), whether the broker can be reached with the settings (``kafka_access.py``), topics
(``kafka_topics.py``), what a topic's messages may weigh (``kafka_limits.py``), the acknowledged producer
(``kafka_producer.py``), dead letters (``dlq.py``) and poison-message
strikes (``strikes.py``), the validating reader (``event_reader.py``), a batch of event messages decoded
and validated as columns with the same rules (``event_batch.py``), Redis day counts (``counts.py``; their kinds,
days and key layout in ``counts_keys.py``, their Lua scripts in ``counts_scripts.py``) and user histories
(``history.py``), the idle clock of every ``exit_when_idle_s`` that takes no stall for idleness (``idle_clock.py``),
the wait on a service just started that notices it die (``startup.py``), replay sources (``replay/``) and the
impression-click joiner (``joiner/``). The exception tree of every stage starts in ``errors.py``.

May import: third-party libraries only; never ``learner/``, ``cache_refresh/``, ``serving/``,
``monitor/`` or ``streamrec/``. Entry points: ``stream.joiner.pipeline.JoinPipeline`` with its
drivers, ``stream.replay.publisher.publish``.
"""
