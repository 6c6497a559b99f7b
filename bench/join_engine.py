"""CPU of the join step alone: ``PartitionJoin.apply`` + the sample columns and messages, no Kafka, no Redis.

The kafka driver's batches, pre-decoded: a stream (synthetic or ML-1M, as ``bench/joiner.py`` replays it) is
encoded and decoded once as the driver would (``stream.events``), split over 4 partitions by impression id, and cut
into batches of ``batch_max`` events in replay order. Timed is what the driver does per batch after the decode:
``apply`` then ``batches_later(...)(histories)`` (the histories an empty list column, as Redis would give for users
with no clicks: their cost is Redis's, not this step's). CPU time (``time.process_time``), not wall time: the
machine is shared. With ``--compare-with DIR`` (a checkout, e.g. ``git worktree add DIR main``) the two engines run
interleaved in one process, round after round (in turn first), and the ratio of their medians is printed.

    python bench/join_engine.py [--dataset synthetic|ml-1m] [--impressions 200000] [--rounds 5] [--compare-with DIR]
    python bench/join_engine.py --profile        # cProfile of one pass (this checkout), top 25 by own time
    python bench/join_engine.py --ceiling        # the most a columnar join state could save (bench/README.md)
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import importlib
import pstats
import statistics
import sys
import time
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from itertools import repeat
from operator import attrgetter, itemgetter
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from stream.joiner.gc_pacing import YOUNG_THRESHOLD  # noqa: E402

PARTITIONS, BATCH_MAX, FLUSH_ROWS = 4, 5000, 64


def load_engine(root: Path) -> tuple[ModuleType, ModuleType]:
    """``stream.joiner.engine`` and ``stream.joiner.sample_rows`` of the checkout at ``root``, as modules of their
    own (another checkout's are imported under a prefix, so both can run in one process)."""
    if root == ROOT:
        return importlib.import_module("stream.joiner.engine"), importlib.import_module("stream.joiner.sample_rows")
    saved = {k: v for k, v in sys.modules.items() if k == "stream" or k.startswith("stream.")}
    for k in saved:
        del sys.modules[k]
    sys.path.insert(0, str(root))
    try:
        return importlib.import_module("stream.joiner.engine"), importlib.import_module("stream.joiner.sample_rows")
    finally:
        sys.path.remove(str(root))
        for k in [k for k in sys.modules if k == "stream" or k.startswith("stream.")]:
            del sys.modules[k]
        sys.modules.update(saved)


def batches(dataset: str, impressions: int) -> list[list[tuple[int, list, list]]]:
    """Per batch, ``(partition, [(offset, Impression)], [(offset, Click)])`` for each partition: the driver's input."""
    from stream.events import decode_click, decode_impression
    from stream.replay.config import ClickDelay, SyntheticSettings
    from stream.replay.encoding import click_bytes, impression_bytes
    from stream.replay.publisher import IMPRESSION, replay_order

    if dataset == "synthetic":
        from stream.replay.synthetic import build_synthetic
        table = build_synthetic(SyntheticSettings(impressions=impressions, users=1_000_000, items=100_000,
                                                  impressions_per_s=2000.0), ClickDelay(), seed=1)
    else:
        from stream.replay.movielens import load_movielens
        table = load_movielens(dataset, ClickDelay(), 1, None)
    table.raw = []  # malformed messages are dead-lettered before the join
    imps = [decode_impression(b) for b in impression_bytes(table)]
    clicks = [decode_click(b) for b in click_bytes(table)]
    kinds, index = replay_order(table)
    offsets = [[0] * PARTITIONS, [0] * PARTITIONS]
    out: list[list[tuple[int, list, list]]] = []
    for lo in range(0, len(kinds), BATCH_MAX):
        parts: dict[int, tuple[list, list]] = {p: ([], []) for p in range(PARTITIONS)}
        for kind, i in zip(kinds[lo:lo + BATCH_MAX].tolist(), index[lo:lo + BATCH_MAX].tolist(), strict=True):
            ev = imps[i] if kind == IMPRESSION else clicks[i]
            p = zlib.crc32(ev.impression_id.encode()) % PARTITIONS
            k = 0 if kind == IMPRESSION else 1
            parts[p][k].append((offsets[k][p], ev))
            offsets[k][p] += 1
        out.append([(p, a, b) for p, (a, b) in parts.items()])
    return out


def run(engine: ModuleType, rows: ModuleType, todo: list[list[tuple[int, list, list]]]) -> tuple[float, int]:
    """One pass over ``todo`` with fresh partitions; (CPU seconds, samples). The collector set as a worker sets it
    (``stream/joiner/gc_pacing.py``: young collections only; its paced full ones, a minute apart, fall outside a
    pass)."""
    joins = {p: engine.PartitionJoin(p, engine.JoinConfig()) for p in range(PARTITIONS)}
    with worker_gc():
        return _timed(joins, rows, todo)


@contextmanager
def worker_gc() -> Iterator[None]:
    """Python's collector as a joiner worker sets it, after one full collection."""
    gc.collect()
    found = gc.get_threshold()
    gc.set_threshold(YOUNG_THRESHOLD, 1 << 30, 1 << 30)
    try:
        yield
    finally:
        gc.set_threshold(*found)


def _timed(joins: dict, rows: ModuleType, todo: list[list[tuple[int, list, list]]]) -> tuple[float, int]:
    n = 0
    t0 = time.process_time()
    for step in [*todo, [(p, [], []) for p in range(PARTITIONS)]]:
        drain = not step[0][1] and not step[0][2]
        for p, imps, clicks in step:
            res = joins[p].apply(imps, clicks, drain=drain)
            if res.samples:
                m = len(res.samples)
                empty = (np.zeros(0, np.int64), np.zeros(m + 1, np.int32))  # (H,), (N + 1,)
                rows.batches_later(res.samples, FLUSH_ROWS)(empty)
                n += m
    return time.process_time() - t0, n


def ceiling(engine: ModuleType, rows: ModuleType, todo: list[list[tuple[int, list, list]]]) -> None:
    """What a columnar join state could save at most: the CPU of building the per-impression Python objects alone
    (``Pending``, its ``ContextRow``, the sorted event tuples, the timers, a ``Sample`` per sample and the columns
    read back out of them), rebuilt from one pass's own inputs and outputs, against that pass's CPU. Columns would
    still cost something in their place, so the real saving is below this."""
    seen: list[tuple[list, list, list]] = []  # per partition batch: (clicks, new impressions, samples)
    run(engine, rows, todo)  # the id-hash caches warm, as in every timed round but the first
    real = engine.PartitionJoin.apply

    def apply(self: Any, imps: list, clicks: list, **kw: Any) -> Any:
        res = real(self, imps, clicks, **kw)
        seen.append((clicks, res.new_impressions, res.samples))
        return res

    engine.PartitionJoin.apply = apply
    try:
        total, _ = run(engine, rows, todo)
    finally:
        engine.PartitionJoin.apply = real
    cost = dict.fromkeys(("Pending", "ContextRow", "event tuples + sort", "timers", "Sample", "sample columns"), 0.0)
    with worker_gc():
        for clicks, added, samples in seen:
            _time_steps(engine, rows, clicks, added, samples, cost)
    print(f"one pass {total:.2f} s CPU; building its objects alone: "
          + ", ".join(f"{k} {v:.3f} s" for k, v in cost.items())
          + f"; together {sum(cost.values()):.2f} s = {sum(cost.values()) / total:.0%} of the pass")


def _time_steps(engine: ModuleType, rows: ModuleType, clicks: list, added: list, samples: list,
                cost: dict[str, float]) -> None:
    """:func:`ceiling`'s object building for one partition batch, each kind timed into ``cost``."""
    ts_of, kind_of = attrgetter("ts"), itemgetter(0, 1)
    contexts = list(map(attrgetter("context"), added))
    fields = [list(map(attrgetter(a), added)) for a in ("impression_id", "ts", "user", "item", "dense")]
    sp = [s.pending for s in samples]
    steps: dict[str, Callable[[], object]] = {
        "Pending": lambda: list(map(engine.Pending, *fields[:4], contexts, map(dict, fields[4]), repeat(0))),
        "ContextRow": lambda: contexts[0].block.rows() if contexts and hasattr(contexts[0], "block") else None,
        "event tuples + sort": lambda: sorted(
            [*zip(fields[1], repeat(0), added), *zip(map(ts_of, map(itemgetter(1), clicks)), repeat(1), clicks)],
            key=kind_of),
        "timers": lambda: engine.TimerRuns().add(engine._timers(added, 1)),
        "Sample": lambda: [engine.Sample(p, 0, 1) for p in sp],
        "sample columns": lambda: sp and (rows._labels(samples), [np.fromiter(map(attrgetter(a), sp), np.int64)
                                                                  for a in ("ts", "user", "item")]),
    }
    for name, step in steps.items():
        t0 = time.process_time()
        step()
        cost[name] += time.process_time() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dataset", default="synthetic", help="synthetic (default) or ml-1m")
    ap.add_argument("--impressions", type=int, default=200_000, help="synthetic: impressions in the stream")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--compare-with", type=Path, metavar="DIR", help="another checkout, run interleaved with this one")
    ap.add_argument("--profile", action="store_true", help="cProfile one pass of this checkout instead")
    ap.add_argument("--ceiling", action="store_true", help="what a columnar join state could save at most "
                    "(the per-impression objects' CPU alone, this checkout) instead")
    args = ap.parse_args()
    todo = batches(args.dataset, args.impressions)
    events = sum(len(a) + len(b) for step in todo for _, a, b in step)
    variants = {"this": load_engine(ROOT)}
    if args.compare_with is not None:
        variants = {"base": load_engine(args.compare_with.resolve()), **variants}
    if args.ceiling:
        ceiling(*variants["this"], todo)
        return
    if args.profile:
        prof = cProfile.Profile()
        prof.runcall(run, *variants["this"], todo)
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
        return
    cpu: dict[str, list[float]] = {name: [] for name in variants}
    samples: dict[str, int] = {}
    for r in range(args.rounds):
        for name in list(variants)[::-1 if r % 2 else 1]:  # ABBA: neither variant always runs first
            s, samples[name] = run(*variants[name], todo)
            cpu[name].append(s)
    if len(set(samples.values())) != 1:
        raise SystemExit(f"the variants made different numbers of samples: {samples}")
    print(f"{args.dataset}: {events:,} events in {len(todo)} batches of {BATCH_MAX} over {PARTITIONS} partitions, "
          f"{next(iter(samples.values())):,} samples, {args.rounds} rounds")
    for name, xs in cpu.items():
        where = Path(str(variants[name][0].__file__)).parents[2]
        print(f"{name:<6} {where}: cpu s median {statistics.median(xs):.3f} (range {min(xs):.3f}-{max(xs):.3f}), "
              f"{events / statistics.median(xs):,.0f} events/s")
    if "base" in cpu:  # the best round too: on a busy machine contention only ever adds CPU time
        print(f"this / base cpu: median {statistics.median(cpu['this']) / statistics.median(cpu['base']):.3f}, "
              f"best {min(cpu['this']) / min(cpu['base']):.3f}")


if __name__ == "__main__":
    main()
