"""``streamrec counts``: the Redis day counts, shown by raw id (the hash only where no name is known)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from stream.config import RedisSettings
from stream.errors import shown
from streamrec.commands.common import EXIT_FAILED, EXIT_OK, add_common, default_help, emit, sources
from streamrec.settings import SettingsError


def readable_id(raw: str | None, member: str) -> str:
    """How an operator sees a counted id: its raw id (quoted and escaped where it holds unprintable characters, cut
    to 80 characters where longer: a 1 MB name padded every row to 1 MB), or ``hash <member>`` where none is known."""
    printable = raw is not None and raw.isprintable() and len(raw) <= 80
    return f"hash {member}" if raw is None else raw if printable else shown(raw, 80)


def add_parser(sub: Any) -> None:
    p = sub.add_parser("counts", help="show the most frequent items or users of recent days (Redis)",
                       description="Read the per-day occurrence counts the joiner writes to Redis "
                       "({prefix}:counts:{item}:{event}:{YYYYMMDD} and {user}, UTC days of event time) and "
                       "print the top k ids summed over --days consecutive days ending at --day (default: the latest "
                       "day with counts). These are the counts the nightly hot-embedding cache refresh and "
                       "cold-start admission use. The counts are kept by the stable hashes of the raw ids "
                       "(stream/ids.py, the keys of the embedding rows); each is shown by its raw id, from the names "
                       "the joiner keeps beside the counts ({prefix}:names:{item}:{YYYYMMDD}), or as 'hash N' "
                       "where no name is known (counted before names were kept, or by a writer that passed none).")
    p.add_argument("action", choices=["top"], help="print the --k most counted ids of the window")
    p.add_argument("--kind", required=True, choices=["item", "user"], help="count items or users")
    p.add_argument("--event", default="impression", choices=["impression", "click", "lookup"],
                   help="which events (lookup: serving's row lookups, which rank the hot set; default: %(default)s)")
    p.add_argument("--day", metavar="YYYYMMDD", help="last UTC day of the window (default: the latest day "
                   "with counts for --kind/--event)")
    p.add_argument("--days", type=int, default=1, help="number of consecutive days summed (default: %(default)s)")
    p.add_argument("--k", type=int, default=10, help="how many ids to print (default: %(default)s)")
    p.add_argument("--redis-url", help=f"Redis with the counts ({default_help(RedisSettings, 'redis', 'url')}: the "
                   "local stack)")
    add_common(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import redis

    from stream.counts import DailyCounts, check_top_window
    from stream.redis_client import connect, describe
    from stream.secrets import redact

    src = sources(args)
    rs = src.build(RedisSettings, "redis", url=args.redis_url)
    client = connect(rs, timeout_s=10, retries=1)  # credentials and TLS from [redis]; a wrong password fails at once
    try:
        counts = DailyCounts(client, prefix=rs.prefix, ttl_days=rs.counts_ttl_days)
        try:
            day = args.day
            if day is None:  # a bad --days/--k said first: Redis down, its error hid the mistake
                check_top_window(args.days, args.k)
                day = next(reversed(counts.days_available(args.kind, args.event)), None)  # the latest
            rows = counts.top(args.kind, args.event, day=day, days=args.days, k=args.k)  # checks --days, --k
            names = counts.names(args.kind, [m for m, _ in rows], day=day, days=args.days) if rows else {}
        except ValueError as exc:  # a bad --day/--days/--k: a usage error, exit 2
            raise SettingsError(str(exc)) from None
        except (redis.RedisError, OSError) as exc:
            print(f"streamrec counts: error: {describe(exc, rs)}", file=sys.stderr)
            return EXIT_FAILED
    finally:
        client.close()
    summary = {
        "kind": args.kind,
        "event": args.event,
        "day": day,
        "days": args.days,
        "k": args.k,
        "redis_url": redact(rs.url),
        "prefix": rs.prefix,
        # "id": the member counted (the raw id's stable hash, as before); "name": its raw id, null where none is known
        "top": [{"id": member, "name": names.get(member), "count": count} for member, count in rows],
    }

    def human(d: dict[str, Any]) -> str:
        if d["day"] is None:
            return f"no {d['kind']} {d['event']} counts under {d['prefix']}:counts:{{{d['kind']}}}: in {d['redis_url']}"
        head = (f"top {d['k']} {d['kind']}s by {d['event']}s over {d['days']} day(s) ending {d['day']} (UTC)")
        if not d["top"]:
            return head + "\n  none"
        shown = [readable_id(r["name"], r["id"]) for r in d["top"]]
        width = max(map(len, shown))
        lines = [head, *(f"  {i:>3}. {name:<{width}}  {r['count']:>12,.0f}"
                         for i, (name, r) in enumerate(zip(shown, d["top"], strict=True), 1))]
        unnamed = sum(r["name"] is None for r in d["top"])
        if unnamed:
            lines.append(f"  {unnamed} of {len(d['top'])} shown by hash: no name recorded beside the counts (counted "
                         "before names were kept, by a writer that passed none, or the names expired)")
        return "\n".join(lines)

    emit(args, summary, human)
    return EXIT_OK
