"""Where serving's p99 tail comes from: one Redis round trip (the history read, ``LRANGE`` of 20 entries) after
``--work-us`` of busy CPU work, as a request does (it sends the read, encodes, then waits), with the client and a
private redis-server on different CPUs (the default scheduling on 2 cores: the server's CPU idles between requests)
and both pinned to one CPU. Round-trip p50/p90/p99/max in microseconds and how many exceed 300 us, interleaved rounds.

On a KVM guest whose idle CPUs halt (``/sys/devices/system/cpu/cpuidle/current_driver``: ``none``), waking Redis on
the other, idle CPU costs an inter-processor interrupt through the host; on the same CPU it is a context switch.

Reproduce::

    .venv/bin/python bench/redis_wakeup.py                  # 3 rounds x 3000 reads, 800 us of work between reads
    .venv/bin/python bench/redis_wakeup.py --work-us 0      # back to back
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

sys.path[:1] = [str(Path(__file__).resolve().parents[1])]  # (bench/ would shadow nothing here, but run from anywhere)

from streamrec.stack import free_port, redis_binary, redis_server_args  # noqa: E402


def round_trips(cpus: set[int] | None, reads: int, work_s: float) -> np.ndarray:
    """Round-trip times (us) of ``reads`` LRANGEs against a fresh redis-server, both on ``cpus`` when given."""
    port = free_port()
    pin = (lambda: os.sched_setaffinity(0, cpus)) if cpus else None
    proc = subprocess.Popen([str(redis_binary()), *redis_server_args("127.0.0.1", port)], stdout=subprocess.DEVNULL,
                            preexec_fn=pin)
    mine = os.sched_getaffinity(0)
    try:
        if cpus:
            os.sched_setaffinity(0, cpus)
        r = redis.Redis(port=port)
        for _ in range(100):
            try:
                r.ping()
                break
            except redis.ConnectionError:
                time.sleep(0.05)
        r.rpush("h", *[f"{i}:{i * 7}" for i in range(20)])
        for _ in range(300):
            r.lrange("h", 0, -1)
        out = np.empty(reads)
        for i in range(reads):
            t = time.perf_counter()
            r.lrange("h", 0, -1)
            out[i] = time.perf_counter() - t
            until = time.perf_counter() + work_s
            while time.perf_counter() < until:  # the request's own work while Redis's CPU idles
                pass
        return out * 1e6
    finally:
        os.sched_setaffinity(0, mine)
        proc.terminate()
        proc.wait()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reads", type=int, default=3000)
    ap.add_argument("--work-us", type=float, default=800.0, help="busy work between reads (default 800 us)")
    args = ap.parse_args()
    cpus = sorted(os.sched_getaffinity(0))
    idle = Path("/sys/devices/system/cpu/cpuidle/current_driver")
    print(f"{len(cpus)} CPUs, cpuidle driver {idle.read_text().strip() if idle.exists() else '?'}, "
          f"{args.work_us:.0f} us of work between reads, load average {os.getloadavg()[0]:.1f}")
    print(f"{'placement':<22} {'p50':>6} {'p90':>6} {'p99':>6} {'max':>7} {'>300us':>8}")
    for _ in range(args.rounds):
        for name, pin in (("apart (default)", None), ("one CPU", {cpus[0]})):
            a = round_trips(pin, args.reads, args.work_us / 1e6)
            print(f"{name:<22} {np.percentile(a, 50):6.0f} {np.percentile(a, 90):6.0f} {np.percentile(a, 99):6.0f} "
                  f"{a.max():7.0f} {int((a > 300).sum()):8d}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
