"""The serving stage: scores candidates over HTTP with the published artifact, fresh with learner deltas.

Owns: the loaded artifact and its row lookups (``model.py``: hot rows on the device, cold rows copied into memory,
delta overrides), the layered mode's embedding store (``embedding_store.py``: cold rows in Redis, one round trip
per request, a bounded LRU, bucket-row fallback when Redis is down; ``row_codec.py``: its keys and the rows' tagged
bytes; ``stored_versions.py``: a version's rows written, listed and deleted by the refresh), the live model and
its swaps (``swap.py``: ``CURRENT`` polled and announced, deltas applied, the rollback pin respected), request
parsing and limits (``request.py``), features as the joiner built them, laid out with the user's bags once per
request and the candidates' per candidate (``features.py``, ``history.py``: the user's Redis read sent before the
candidates are encoded and collected last; the scorer adds the user row to every candidate), the
app and its HTTP servers (``app.py``; ``http_server.py`` picks ``http_threaded.py`` or ``http_aiohttp.py``, which
share ``http_wire.py``; ``service.py``), metrics (``metrics.py``), settings
(``settings.py``) and a demo client (``demo.py``).

May import: ``stream/`` and ``learner/`` (the artifact format, features, deltas); never
``cache_refresh/``, ``monitor/`` or ``streamrec/``. Entry point: ``serving.service.ScoringService``
(``streamrec serve``).
"""
