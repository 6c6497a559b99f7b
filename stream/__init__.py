"""The stream stage, the ground floor: everything that travels on Kafka and in Redis.

Owns: the event schemas and their limits (``events.py``, ``limits.py``), sample batches as Arrow IPC
(``samples.py``), stable id and feature hashing (``ids.py``, ``features.py``), Kafka client configs,
topics and the acknowledged producer (``kafka.py``), dead letters (``dlq.py``) and poison-message
strikes (``strikes.py``), the validating reader (``event_reader.py``), Redis day counts and user
histories (``counts.py``, ``history.py``), replay sources (``replay/``) and the impression-click joiner
(``joiner/``). The exception tree of every stage starts in ``errors.py``.

May import: third-party libraries only;
never ``learner/``, ``cache_refresh/``, ``serving/`` or ``monitor/``. Entry points:
``stream.joiner.pipeline.JoinPipeline`` with its drivers, ``stream.replay.publisher.publish``.
"""
