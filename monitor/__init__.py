"""The monitoring stage: alert rules over Prometheus metrics, and the sinks alerts go to.

Owns: the alert type and the sinks (``alerts.py``), their delivery queues (``delivery.py``), HTTP requests with
one total deadline (``http_deadline.py``), the rules file format (``rules.py``, default rules in
``default_rules.toml``), the small safe expression language (``expr.py``), the Prometheus text format as scraped
(``exposition.py``), the scraper (``scrape.py``),
the rule state machines (``rule_engine.py``), the firing-state file kept over restarts (``state_file.py``), the
run log of every scrape (``run_log.py``, with a ``[run_log]`` table in the rules file), the loop that ties them to
the sinks (``engine.py``), and the operator report drawn from that log and the stages' summaries (``streamrec
report``: what was recorded, read back in ``recording.py``, its curves in ``series.py``, drawn by ``plotter.py`` in
the sections of ``sections.py``, the page in ``report.py``; progress lines while a stage runs in ``follow.py``).

May import: ``stream/`` (Kafka client configs) and the standard library; no other stage. Entry point:
``monitor.engine.Monitor`` (``streamrec monitor`` builds it at the edge).
"""
