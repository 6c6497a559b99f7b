"""The monitoring stage: alert rules over Prometheus metrics, and the sinks alerts go to.

Owns: the alert type and the sinks with their delivery queues (``alerts.py``), the rules file format
(``rules.py``, default rules in ``default_rules.toml``), the small safe expression language
(``expr.py``), the Prometheus text format as scraped (``exposition.py``), the engine that scrapes, evaluates,
sends and (with a ``[run_log]`` table in the rules file) records every scrape to a run log (``engine.py``), and
the operator report drawn from that log and the stages' summaries (``report.py``, ``streamrec report``).

May import: ``stream/`` (Kafka client configs) and the standard library; no other stage. Entry point:
``monitor.engine.Monitor`` (``streamrec monitor`` builds it at the edge).
"""
