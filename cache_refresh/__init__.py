"""The nightly refresh stage: the learner's newest checkpoint becomes the served artifact.

Owns: the hot set chosen from Redis day counts (``hot_set.py``), the checks an artifact passes
before it is published (``validate.py``: probe scores equal the learner's, holdout quality no worse
than the live model's), the only writer of a publish root (``publish.py``: publish, rollback and the
pin, pruning, the refresh lock, cleanup of killed runs), one run (``job.py``), its record in the publish root
(``run_records.py``: ``last_run.json``), its Redis client (``redis_client.py``), the layered rows it cleans up
(``stored_rows.py``), ``--status`` (``status.py``), its schedule (``scheduler.py``) and its settings (``settings.py``).

May import: ``stream/``, ``learner/`` (checkpoints, the artifact format), ``serving.model`` (to load
what it built exactly as serving will), ``serving.stored_versions``, ``serving.row_codec`` and ``serving.settings``
(the layered mode's rows in Redis, written before a version is published) and ``monitor.alerts`` (its alerts); never
``streamrec/``.
Entry points: ``cache_refresh.job.run_now`` (``--now``), ``run_once`` and ``scheduled_run`` (``streamrec refresh``),
``cache_refresh.scheduler.run_forever``.
"""
