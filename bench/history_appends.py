"""The cost of the history appends' redo rule (``stream/history.py``: an LPOS per entry over the list's newest
n + ``REDO_SLACK`` entries before the LPUSH, so a batch done again right after pushes nothing): the joiner's Redis stage
for history, ``UserHistory.append_many``, with main's script (every entry pushed) and with the rule, side by side
against one private redis-server, on the same batches and lists.

Every list starts full (``--max-len`` entries, the joiner's 4 x history_len), so every append trims. Each round times
``--batches`` batches of ``--appends`` clicks of random users among ``--users``, each batch appended by both versions
in turn (alternating which goes first, so the machine's load drifts over both alike), each right after it again (a
redo: with the rule every entry found, nothing pushed). Both versions share the Python side (the rule's one change
there, each entry sent once per batch, is in both). Prints ms per batch (median, mean) and the ratio of the means.

Reproduce::

    .venv/bin/python bench/history_appends.py              # 3 rounds, 200 batches of 5,000 clicks over 2,500 users
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import redis

sys.path[:1] = [str(Path(__file__).resolve().parents[1])]  # run from anywhere: the checkout's packages

from stream.history import UserHistory  # noqa: E402
from streamrec.stack import free_port, redis_binary, redis_server_args  # noqa: E402

# main's script, before the redo rule (050f5e6): every entry pushed, a batch done again pushed again.
BEFORE = (
    "local max_len, ttl, at, errors = tonumber(ARGV[1]), tonumber(ARGV[2]), 3, {} "
    "for _, k in ipairs(KEYS) do "
    "local n, ok = tonumber(ARGV[at]), true "
    "for j = at + 1, at + n, 4000 do "
    "local r = redis.pcall('LPUSH', k, unpack(ARGV, j, math.min(j + 3999, at + n))) "
    "if type(r) == 'table' and r['err'] then errors[#errors + 1] = r['err'] ok = j > at + 1 break end end "
    "if ok then redis.pcall('LTRIM', k, 0, max_len - 1) "
    "if ttl > 0 then redis.pcall('EXPIRE', k, ttl) else redis.pcall('PERSIST', k) end end "
    "at = at + n + 1 end "
    "return errors"
)


class Before(UserHistory):
    _APPEND_MANY = BEFORE


Batch = tuple[np.ndarray, np.ndarray, np.ndarray]


def batches(rng: np.random.Generator, n: int, appends: int, users: int, t0: int) -> list[Batch]:
    """``n`` batches of ``appends`` clicks (user, item, click time), times increasing as the joiner's are."""
    out = []
    for b in range(n):
        ts = t0 + b * appends + np.arange(appends, dtype=np.int64)
        out.append((rng.integers(0, users, appends), rng.integers(-2**62, 2**62, appends), ts))
    return out


def fill(h: UserHistory, users: int, max_len: int) -> None:
    """Every user's list at ``max_len`` entries, clicks before any batch's."""
    for start in range(0, max_len, 20):
        k = min(20, max_len - start)
        u = np.repeat(np.arange(users), k)
        h.append_many(u, u * 7 + 1, np.tile(np.arange(start, start + k), users))


def timed(versions: dict[str, UserHistory], work: list[Batch]) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """ms per ``append_many`` call of each version: each batch's first append and, right after it, its redo (the batch
    done again), the versions in turn, the first of them alternating."""
    out = {name: np.empty((2, len(work))) for name in versions}
    for i, (u, it, ts) in enumerate(work):
        for name in list(versions)[:: 1 if i % 2 == 0 else -1]:
            for j in range(2):
                t = time.perf_counter()
                versions[name].append_many(u, it, ts)
                out[name][j, i] = time.perf_counter() - t
    return {name: (ms[0] * 1e3, ms[1] * 1e3) for name, ms in out.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batches", type=int, default=200)
    ap.add_argument("--appends", type=int, default=5_000)
    ap.add_argument("--users", type=int, default=2_500)
    ap.add_argument("--max-len", type=int, default=200)
    args = ap.parse_args()
    port = free_port()
    proc = subprocess.Popen([str(redis_binary()), *redis_server_args("127.0.0.1", port)], stdout=subprocess.DEVNULL)
    try:
        client = redis.Redis(port=port)
        for _ in range(100):
            try:
                info = client.info("server")
                break
            except redis.ConnectionError:
                time.sleep(0.05)
        print(f"redis {info['redis_version']}, {len(os.sched_getaffinity(0))} CPUs, load {os.getloadavg()[0]:.1f}; "
              f"{args.batches} batches x {args.appends} clicks over {args.users} users, lists at {args.max_len}")
        print(f"{'round':<6} {'version':<8} {'first append ms/batch (median, mean)':>38} {'redo ms/batch':>22}")
        rng = np.random.default_rng(0)
        for r in range(args.rounds):
            client.flushall()
            work = batches(rng, args.batches, args.appends, args.users, 10**9 * (r + 1))
            versions = {"before": Before(client, "before", args.max_len), "after": UserHistory(client, "after",
                                                                                              args.max_len)}
            for h in versions.values():
                fill(h, args.users, args.max_len)
            got = timed(versions, work)
            for name, (first, redo) in got.items():
                print(f"{r:<6} {name:<8} {np.median(first):>24.2f} {first.mean():>13.2f} "
                      f"{np.median(redo):>10.2f} {redo.mean():>11.2f}")
            ratio = got["after"][0].mean() / got["before"][0].mean()
            print(f"{r:<6} after / before (first append, mean): {ratio:.2f}; load {os.getloadavg()[0]:.1f}")
    finally:
        proc.terminate()
        proc.wait()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
