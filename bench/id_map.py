"""Id-to-row mapping throughput and memory: learner.id_map.IdMap against a Python dict and torch.searchsorted.

One run, the same ids for every variant, side by side:

  dict          a plain Python dict id -> row with admission counting (a second dict of counts for ids not
                yet admitted; admitted after --admit-after sightings while rows are free; the rest map to
                their bucket ``id mod B``), numpy -> list -> numpy conversion included. No eviction.
  searchsorted  torch.searchsorted over the sorted keys of the admitted ids (whatever IdMap holds at the
                end of its run, so the same hit rate), bucket for the rest: lookup only, no counting, no
                admission, no eviction
  IdMap         learner.id_map.IdMap.lookup(train=True): lookup + admission counting (bounded candidate
                tables) + LRU eviction when full + last-seen updates

Workload: --lookups Zipf(--zipf) ids over a universe of --universe ids (truncated Zipf: rank drawn from
the exact CDF, rank -> a random 63-bit key, as stable_hash makes them), in batches of --batch (4096
samples x 26 fields), capacity --capacity own rows, --buckets buckets. ids/s = lookups / wall time of the
whole stream (warm-up included: admissions are front-loaded).

Then the churn run: --churn-ids ids, a --churn-new share of them brand new (endless user churn: every
new id is distinct from all before), the rest Zipf over a 1 M-id warm pool, streamed through an IdMap of
--capacity rows admitting on first sight (--churn-admit-after 1: every new id takes a row, so a full table
evicts in every batch); RSS (VmRSS) is sampled every --churn-every ids, written as CSV (--csv) and drawn as an
ASCII plot. Memory must stay flat: the map's arrays are allocated once (IdMap.nbytes()).

Reproduce (2 shared cores; the ratios matter, the absolute figures move with other load):

    python bench/id_map.py                      # 10 M lookups + 100 M churn ids, ~2-3 min
    python bench/id_map.py --rounds 3           # best of 3 per variant (a busy machine)
    python bench/id_map.py --quick              # a smoke run, ~10 s
    python bench/id_map.py --churn-ids 0        # throughput only
"""

from __future__ import annotations

import argparse
import csv
import gc
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from learner.id_map import IdMap  # noqa: E402


def zipf_keys(seed: int, n: int, universe: int, a: float) -> np.ndarray:
    """(n,) int64 keys: Zipf(a) ranks over ``universe`` ids (exact truncated CDF), rank -> random key."""
    rng = np.random.default_rng(seed)
    cdf = np.cumsum(np.arange(1, universe + 1, dtype=np.float64) ** -a)
    cdf /= cdf[-1]
    ranks = np.minimum(np.searchsorted(cdf, rng.random(n)), universe - 1)
    del cdf
    key_of_rank = rng.integers(0, 2**63 - 1, universe, dtype=np.int64)
    return key_of_rank[ranks]


def run_dict(keys: np.ndarray, batch: int, capacity: int, buckets: int, admit_after: int) -> float:
    rows: dict[int, int] = {}
    counts: dict[int, int] = {}
    next_row = 0
    t0 = time.perf_counter()
    for i in range(0, keys.size, batch):
        out = []
        append = out.append
        for k in keys[i:i + batch].tolist():
            r = rows.get(k)
            if r is None:
                c = counts.get(k, 0) + 1
                if c >= admit_after and next_row < capacity:
                    r = rows[k] = next_row
                    next_row += 1
                    del counts[k]
                else:
                    counts[k] = c
                    append(k % buckets)
                    continue
            append(buckets + r)
        np.array(out, dtype=np.int64)
    return time.perf_counter() - t0


def run_searchsorted(keys: np.ndarray, batch: int, admitted: np.ndarray, buckets: int) -> float:
    order = np.argsort(admitted)
    sorted_keys = torch.from_numpy(admitted[order])
    row_of = torch.from_numpy(order.astype(np.int64) + buckets)
    last = max(sorted_keys.numel() - 1, 0)
    t0 = time.perf_counter()
    for i in range(0, keys.size, batch):
        q = torch.from_numpy(keys[i:i + batch])
        pos = torch.searchsorted(sorted_keys, q).clamp_(max=last)
        hit = sorted_keys[pos] == q
        torch.where(hit, row_of[pos], q % buckets).numpy()
    return time.perf_counter() - t0


def run_id_map(keys: np.ndarray, batch: int, m: IdMap) -> float:
    t0 = time.perf_counter()
    for j, i in enumerate(range(0, keys.size, batch)):
        m.lookup(keys[i:i + batch], now=float(j))
    return time.perf_counter() - t0


def rss_mb() -> float:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def churn(args: argparse.Namespace) -> list[tuple[int, float, float, float]]:
    """Stream ``--churn-ids`` ids (mostly brand new) through one IdMap; (ids seen, RSS MB, occupancy, bucket share)."""
    rng = np.random.default_rng(args.seed + 1)
    warm = zipf_keys(args.seed + 2, 5_000_000, 1_000_000, args.zipf)  # recycled for the returning users
    rss0 = rss_mb()
    m = IdMap(args.capacity, args.buckets, admit_after=args.churn_admit_after, ttl_s=args.churn_ttl)
    n_new = int(round(args.batch * args.churn_new))
    next_new = 0
    samples: list[tuple[int, float, float, float]] = []
    seen, next_sample, j = 0, 0, 0
    t0 = time.perf_counter()
    while seen < args.churn_ids:
        b = min(args.batch, args.churn_ids - seen)
        nn = min(n_new, b)
        new = np.arange(next_new, next_new + nn, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
        next_new += nn
        w = warm[rng.integers(0, warm.size - (b - nn) + 1):][:b - nn]
        m.lookup(np.concatenate([(new >> np.uint64(1)).view(np.int64), w]), now=float(j))
        seen, j = seen + b, j + 1
        if seen >= next_sample:
            st = m.stats()
            samples.append((seen, rss_mb(), st["occupancy"], st["bucket_share"]))
            next_sample += args.churn_every
    dt = time.perf_counter() - t0
    st = m.stats()
    samples.append((seen, rss_mb(), st["occupancy"], st["bucket_share"]))
    print(f"churn: {seen:,} ids ({next_new:,} distinct new) in {dt:.1f} s = {seen / dt / 1e6:.1f} M ids/s; "
          f"admit after {m.admit_after}; RSS before the map {rss0:.0f} MB, map arrays {m.nbytes() / 2**20:.0f} MiB; "
          f"admissions {st['admissions']:,.0f}, evictions "
          f"{st['evictions']:,.0f} (ttl {st['evictions_ttl']:,.0f}), candidates {st['candidates']:,.0f}")
    return samples


def ascii_plot(samples: list[tuple[int, float, float, float]], width: int = 60, height: int = 10) -> str:
    xs = np.array([s[0] for s in samples], dtype=np.float64)
    ys = np.array([s[1] for s in samples])
    lo, hi = 0.0, max(float(ys.max()) * 1.1, 1.0)  # from 0: flat is flat, noise is not magnified
    grid = [[" "] * width for _ in range(height)]
    for x, y in zip(xs, ys, strict=True):
        c = min(width - 1, int(x / xs.max() * (width - 1)))
        r = min(height - 1, int((y - lo) / (hi - lo) * (height - 1)))
        grid[height - 1 - r][c] = "*"
    lines = [f"{hi:8.0f} MB |" + "".join(grid[0])]
    lines += ["           |" + "".join(row) for row in grid[1:-1]]
    lines += [f"{lo:8.0f} MB |" + "".join(grid[-1]), "           +" + "-" * width,
              f"            0{'ids seen':^{width - 12}}{xs.max() / 1e6:.0f} M"]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lookups", type=int, default=10_000_000)
    ap.add_argument("--universe", type=int, default=10_000_000)
    ap.add_argument("--zipf", type=float, default=1.05)
    ap.add_argument("--batch", type=int, default=4096 * 26)
    ap.add_argument("--capacity", type=int, default=1_000_000)
    ap.add_argument("--buckets", type=int, default=100_000)
    ap.add_argument("--admit-after", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=1, help="repeat the throughput variants; each keeps its best")
    ap.add_argument("--churn-ids", type=int, default=100_000_000)
    ap.add_argument("--churn-new", type=float, default=0.9, help="share of brand-new ids in each churn batch")
    ap.add_argument("--churn-every", type=int, default=5_000_000, help="RSS sample interval (ids)")
    ap.add_argument("--churn-admit-after", type=int, default=1,
                    help="1: every new id gets a row, so the full table evicts all the time (the hard case)")
    ap.add_argument("--churn-ttl", type=float, default=None, help="ttl_s in batches for the churn map")
    ap.add_argument("--csv", type=Path, default=Path(tempfile.gettempdir()) / "id_map_rss.csv")
    ap.add_argument("--quick", action="store_true", help="1 M lookups over 1 M ids, capacity 100 k, 2 M churn")
    args = ap.parse_args()
    if args.quick:
        args.lookups, args.universe, args.capacity, args.buckets = 1_000_000, 1_000_000, 100_000, 10_000
        args.churn_ids, args.churn_every = min(args.churn_ids, 2_000_000), 200_000
    torch.set_num_threads(1)

    keys = zipf_keys(args.seed, args.lookups, args.universe, args.zipf)
    print(f"id_map bench: {args.lookups:,} Zipf({args.zipf}) lookups over {args.universe:,} ids "
          f"({np.unique(keys).size:,} distinct), batch {args.batch:,}, capacity {args.capacity:,}, "
          f"{args.buckets:,} buckets, admit after {args.admit_after}; torch threads 1; "
          f"load avg {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    gc.collect()
    t_dict = t_map = t_ss = t_map1 = t_decay = float("inf")
    for _ in range(args.rounds):  # fresh maps every round; the machine is shared, so keep each one's best
        t_dict = min(t_dict, run_dict(keys, args.batch, args.capacity, args.buckets, args.admit_after))
        m = IdMap(args.capacity, args.buckets, admit_after=args.admit_after)
        t_map = min(t_map, run_id_map(keys, args.batch, m))
        st = m.stats()
        admitted = m.state_dict()["row_key"].numpy()
        t_ss = min(t_ss, run_searchsorted(keys, args.batch, admitted[admitted >= 0], args.buckets))
        m1 = IdMap(args.capacity, args.buckets, admit_after=1)
        t_map1 = min(t_map1, run_id_map(keys, args.batch, m1))
        st1 = m1.stats()
        md = IdMap(args.capacity, args.buckets, admit_after=args.admit_after, bucket_half_life_s=8.0)
        t_decay = min(t_decay, run_id_map(keys, args.batch, md))  # + forgetting buckets (half-life 8 batches)

    def row(name: str, t: float, note: str) -> str:
        return f"  {name:<22} {args.lookups / t / 1e6:8.1f} M ids/s   {t_dict / t:6.2f}x dict   {note}"

    print(f"  {'variant':<22} {'throughput':>15}   {'vs dict':>11}")
    print(row("dict", t_dict, f"lookup + admission counting, admit after {args.admit_after}, no eviction"))
    print(row("torch.searchsorted", t_ss, "lookup only"))
    print(row(f"IdMap admit_after={args.admit_after}", t_map,
              f"bucket share {st['bucket_share']:.3f}, occupancy {st['occupancy']:.2f}, "
              f"admissions {st['admissions']:,.0f}, evictions {st['evictions']:,.0f}"))
    print(row("IdMap + bucket decay", t_decay, f"admit after {args.admit_after}, bucket_half_life_s = 8 batches: "
              f"{t_decay / t_map:.2f}x the time of the same map without"))
    print(row("IdMap admit_after=1", t_map1,
              f"bucket share {st1['bucket_share']:.3f}, occupancy {st1['occupancy']:.2f}, "
              f"admissions {st1['admissions']:,.0f}, evictions {st1['evictions']:,.0f}"))
    del keys, m, m1, md
    gc.collect()

    samples: list[tuple[int, float, float, float]] = []
    if args.churn_ids > 0:
        samples = churn(args)
        args.csv.parent.mkdir(parents=True, exist_ok=True)
        with args.csv.open("w", newline="") as fh:
            w = csv.writer(fh)
            w.writerow(["ids_seen", "rss_mb", "occupancy", "bucket_share"])
            w.writerows(samples)
        rss = [s[1] for s in samples]
        after_first = rss[1:] or rss
        print(f"RSS vs ids seen ({args.csv}): first sample {rss[0]:.0f} MB, min/max after it "
              f"{min(after_first):.0f}/{max(after_first):.0f} MB, last {rss[-1]:.0f} MB")
        print(ascii_plot(samples))
    print({"lookups": args.lookups, "dict_ids_s": round(args.lookups / t_dict),
           "searchsorted_ids_s": round(args.lookups / t_ss), "id_map_ids_s": round(args.lookups / t_map),
           "id_map_admit1_ids_s": round(args.lookups / t_map1),
           "id_map_decay_ids_s": round(args.lookups / t_decay), "id_map_vs_dict": round(t_dict / t_map, 2),
           "churn_rss_mb": [round(s[1]) for s in samples]})


if __name__ == "__main__":
    main()
