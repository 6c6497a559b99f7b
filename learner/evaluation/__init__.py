"""Offline and online evaluation of the learner on MovieLens (``streamrec evaluate``).

Owns, one concept per module: what an evaluation is configured as (``config.py``: ``EvalConfig``,
``EvalOverrides``, ``resolve_config``, the protocols and feature sets), the ratings with their labels and
the 8:1:1 split (``ratings.py``), the offline sample builder and how its history differs from the
joiner's (``samples.py``), Platt calibration (``calibration.py``) and the two protocols (``protocols.py``:
``evaluate``, ``describe``).

May import: ``stream/`` (the MovieLens reader, feature hashing, sample batches), ``learner/`` and
third-party libraries; never ``cache_refresh/``, ``serving/``, ``monitor/`` or ``streamrec/``.

Entry points: ``learner.evaluation.protocols.evaluate`` and ``describe`` (what ``streamrec evaluate``
calls); ``learner/cold_start.py`` builds its protocol from ``config``, ``ratings`` and ``samples``.
"""
