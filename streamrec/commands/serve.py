"""``streamrec serve``: the HTTP scoring service ."""

from __future__ import annotations

import argparse
import functools
import sys
from typing import Any

from serving.settings import ServeSettings
from stream.config import RedisSettings
from stream.stop_signals import StopFlag, StopsTaken
from streamrec.commands.common import EXIT_OK, add_common, default_help, emit, kv_lines, setup_logging, sources


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "serve", help="serve click-through-rate scores over HTTP from the published artifact",
        description="Run the scoring service: POST /v1/score with {user_id, items: [...], context: {...}} answers "
        "one click probability per item plus the model_version and delta_seq that answered; POST /v1/score:batch "
        "takes several requests; GET /openapi.json describes both, naming the live model's context and dense "
        "features (a request valid under it is scored; any other is a 4xx with a JSON {\"error\": ...}). "
        "Features are hashed exactly as the joiner "
        "hashes them and the user's click history is read from Redis (the list the joiner keeps), so serving "
        "sees what training saw. The model is the artifact named by <publish-root>/CURRENT (published by "
        "`streamrec refresh`); a new one is loaded beside the live one and swapped atomically (requests in "
        "flight finish on the old one; a corrupt or malformed one is rejected once, counted in "
        "streamrec_serving_rejected_total, and the live one keeps serving), woken by "
        "Redis pub/sub and polled every poll_s. With --deltas-dir the learner's deltas (rows touched since "
        "the last one, plus dense weights) are applied as they appear, between nightly refreshes (a damaged one "
        "is rejected once and skipped; none are applied to a rolled-back artifact). Until an "
        "artifact exists, /v1/score and /readyz answer 503. /healthz, /readyz and /metrics (Prometheus) are "
        "for operators. SIGTERM or Ctrl-C: /readyz turns 503, requests in flight finish, then it exits 0.",
        epilog="Example: streamrec serve --port 8080 & curl -s localhost:8080/v1/score "
        "-d '{\"user_id\": 1, \"items\": [1193, 661], \"context\": {\"gender\": \"F\"}}'. "
        "Settings: [serve] in --config and STREAMREC_SERVE_<KEY> (host, port, publish_root, deltas_dir, device, "
        "threads, server, max_candidates, max_batch, max_body_bytes, poll_s, redis_timeout_s, history_retry_after_s, "
        "max_request_values, signing_key_file, max_connections, max_in_flight, request_timeout_s, keepalive_timeout_s, "
        "linger_s, linger_bytes, max_active, reuse_port, history_cache_users, embedding_store = in_process | "
        "layered (cold rows from Redis, written by `streamrec refresh` with [refresh] embedding_store = layered), "
        "embedding_cache_rows, embedding_store_timeout_s, embedding_store_retry_after_s, embedding_store_cluster, "
        "embedding_store_write_deltas, lookup_counts, lookup_counts_flush_s, lookup_counts_flush_ids, "
        "lookup_counts_max_pending, lookup_counts_timeout_s: each flush's Redis timeout, the last one at shutdown "
        "included); Redis from [redis] / STREAMREC_REDIS_URL.")
    d = functools.partial(default_help, ServeSettings, "serve")  # d(key): "default: [serve] key, else <built-in>"
    p.add_argument("--host", help=f"address to bind ({d('host')}: loopback only)")
    p.add_argument("--port", type=int, help=f"port ({d('port')}; 0 picks a free one)")
    p.add_argument("--publish-root", help=f"where `streamrec refresh` publishes ({d('publish_root')})")
    p.add_argument("--deltas-dir", help="the learner's delta directory (its [learner] deltas_dir; "
                   f"{d('deltas_dir', 'none: no deltas')})")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], help="where hot rows and the dense part live "
                   f"({d('device')}: CUDA when there is one)")
    p.add_argument("--threads", type=int, help=f"torch threads per request ({d('threads')})")
    p.add_argument("--server", choices=["threading", "aiohttp"], help=f"HTTP server ({d('server')})")
    p.add_argument("--max-connections", type=int, help="open connections at once; one more is answered 503 "
                   f"({d('max_connections')})")
    p.add_argument("--max-in-flight", type=int, help="requests being read or scored at once; one more is answered "
                   f"503 with Retry-After: 1, probes excepted ({d('max_in_flight')})")
    p.add_argument("--request-timeout", type=float, dest="request_timeout_s", metavar="SECONDS",
                   help="seconds a request's headers and body may take to arrive from its first byte, else 408 "
                   f"({d('request_timeout_s')})")
    p.add_argument("--keepalive-timeout", type=float, dest="keepalive_timeout_s", metavar="SECONDS",
                   help=f"seconds an idle keep-alive connection stays open ({d('keepalive_timeout_s')})")
    p.add_argument("--max-active", type=int, help="requests scored at once by the threading server, the others "
                   f"wait their turn; 0: no bound ({d('max_active')}; 1 suits the ONNX formats on few cores)")
    p.add_argument("--reuse-port", action=argparse.BooleanOptionalAction, default=None, help="bind with "
                   "SO_REUSEPORT: run several serve processes on one port (each loads the model and answers /metrics "
                   "for itself); --no-reuse-port overrides reuse_port = true of [serve] "
                   f"({d('reuse_port', 'off')})")
    p.add_argument("--redis-url", help="Redis with the users' click history and the update channels "
                   f"({default_help(RedisSettings, 'redis', 'url')}: the local stack)")
    p.add_argument("--no-redis", action="store_true", help="no history (empty) and no pub/sub: polling only")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                   help="how much the process logs to stderr (default: %(default)s)")
    add_common(p)
    p.set_defaults(func=cmd_serve)


def _total(counter: Any) -> int:
    return int(sum(s.value for mf in counter.collect() for s in mf.samples if s.name.endswith("_total")))


def cmd_serve(args: argparse.Namespace) -> int:
    import torch

    from serving.service import ScoringService
    from stream.limits import EventLimits

    src = sources(args)
    ss = src.build(ServeSettings, "serve", host=args.host, port=args.port, publish_root=args.publish_root,
                   deltas_dir=args.deltas_dir, device=args.device, threads=args.threads, server=args.server,
                   max_connections=args.max_connections, max_in_flight=args.max_in_flight,
                   request_timeout_s=args.request_timeout_s, keepalive_timeout_s=args.keepalive_timeout_s,
                   max_active=args.max_active, reuse_port=args.reuse_port,
                   flag_names={"request_timeout_s": "--request-timeout", "keepalive_timeout_s": "--keepalive-timeout"})
    rs = None if args.no_redis else src.build(RedisSettings, "redis", url=args.redis_url)
    setup_logging(args.log_level)
    from importlib.metadata import PackageNotFoundError, version

    try:
        pkg_version = version("streamrec")
    except PackageNotFoundError:
        pkg_version = "0"
    stop, threads = StopFlag(), torch.get_num_threads()  # the caller's count and signals: put back
    torch.set_num_threads(ss.threads)  # >= 1 (ServeSettings); the caller's count and signals back on every exit
    with StopsTaken(stop.set, stop.is_set):  # the first stop ends the wait; a second (the drain) is the process's own
        try:
            svc = ScoringService(ss, rs, version=pkg_version, limits=src.build(EventLimits, "limits")).start()
            try:
                m = svc.holder.model()
                print(f"serving on {svc.url} (model {m.version if m else 'none yet'} from {ss.publish_root}, "
                      f"server {ss.server}, device {svc.device})", file=sys.stderr, flush=True)
                stop.wait()
                print("stopping: draining requests in flight", file=sys.stderr, flush=True)
            finally:
                svc.stop()
        finally:
            torch.set_num_threads(threads)
    summary = {"url": svc.url, **svc.updater.status(), "swaps": _total(svc.metrics.swaps),
               "requests": _total(svc.metrics.requests)}
    emit(args, summary, lambda d: "serve summary\n" + kv_lines(d))  # redacted: last_error may hold a Redis URL
    return EXIT_OK
