"""Scaling out the learner: examples/s on 1 process and on N ranks (torchrun, gloo), memory per rank against the
single-process table, and the largest table that trains on N ranks but not on 1 under a memory cap.

Each run trains ``--steps`` steps of ``--step-rows`` synthetic samples (ids uniform over the table, the default
model: DeepFM, D = 16, MLP 400-400-400, the dense part's autocast as ``amp = auto`` resolves here) from memory,
so the figures are the training step's, not Kafka's. One process is the production single-process path
(``learner.model.DeepFM`` + ``learner.trainer.Trainer``, fused row-wise Adagrad); N ranks are the distributed
mode's (``learner/sharded_model.py`` DMP row-wise + ``learner/sharded_trainer.py``), each rank training its own
``--step-rows`` per step (the global step is N times larger). examples/s of N ranks = N * step_rows * steps /
the slowest rank's time. Memory: each process's peak RSS (``ru_maxrss``), and the table + optimizer bytes it
holds (one process: the whole table; a rank: its rows).

The memory cap: a table "trains" under ``--cap-mib`` when every process's peak RSS stays under it (checked
after the run, no cgroup here); the largest table that trains on N ranks and not on 1 is reported.

    python bench/scaling.py                                   # 1 vs 2 ranks, tables of 1 M, 4 M, 12 M rows
    python bench/scaling.py --rows 1000000 12000000 --steps 20 --cap-mib 1100 --rounds 3
    python bench/scaling.py --rows 1000000 --id-capacity 200000   # dynamic user and item ids (the id maps' cost)

``--id-capacity N``: user and item ids are dynamic (``N`` own rows each beside the buckets, admitted at first
sight), their ids drawn Zipf(1.1) from 10 N, so ids are admitted and evicted all along; every step maps its batch
first (one process: ``RowMapper.apply``; N ranks: ``learner/sharded_ids.py``: every rank's ids all-gathered, each
rank mapping those that fall in its share of the maps, the rows all-gathered back). The id maps' bytes (a rank's:
its shares) are printed beside the tables'.

Threads: one process uses all the machine's cores (torch's default), each of N ranks cores / N (torchrun's
OMP_NUM_THREADS=1 overridden to that), so both use the same cores; the single process is also run on 1 thread
(``1 thread``): on a machine other processes load, a 2-thread process loses far more to the contention than two
1-thread ranks do, and the ratio against it separates that from the sharding.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from learner.batch import TensorBatch  # noqa: E402
from learner.config import Amp  # noqa: E402
from learner.features import FeatureConfig, default_config  # noqa: E402
from learner.model import autocast_dtype  # noqa: E402


def config(rows: int, id_capacity: int = 0) -> FeatureConfig:
    """user, item (history sharing it) and 3 context fields over about ``rows`` rows (``id_capacity`` > 0: user and
    item ids dynamic, ``id_capacity`` of the rows each their own rows, the rest buckets)."""
    buckets = max(1000, (rows - 2 * id_capacity) // 2)
    return default_config({"genres": "multi", "device": "single", "city": "single"}, buckets=buckets,
                          ctx_buckets=1000, embedding_dim=16, id_capacity=id_capacity)


def synthetic(cfg: FeatureConfig, b: int, rng: np.random.Generator, step: int = 0) -> TensorBatch:
    """One batch of ``b`` samples: every field one id (history and genres 3), rows uniform over each block; a
    dynamic field's ids (keys) Zipf(1.1) over 10x its capacity, on their bucket rows until mapped."""
    values, lengths, keys = [], [], []
    for spec, (first, n) in zip(cfg.fields, cfg.blocks, strict=True):
        k = 3 if spec.kind != "single" else 1
        owner = cfg.owner(spec)
        if owner.capacity > 0:
            ids = np.minimum(rng.zipf(1.1, b * k), 10 * owner.capacity).astype(np.int64)
            keys.append(ids)
            values.append(first + ids % owner.num_buckets)
        else:
            values.append(first + rng.integers(0, n, b * k))
            keys.append(np.zeros(b * k, np.int64))
        lengths.append(np.full(b, k))
    lens = np.concatenate(lengths)
    offsets = np.zeros(len(lens) + 1, np.int64)
    np.cumsum(lens, out=offsets[1:])
    labels = (rng.random(b) < 0.1).astype(np.float32)
    return TensorBatch(torch.from_numpy(np.concatenate(values)), torch.from_numpy(offsets), torch.zeros((b, 0)),
                       torch.from_numpy(labels), np.array([f"i{k}" for k in range(b)], object),
                       np.full(b, 1000 * step, np.int64), keys=np.concatenate(keys) if cfg.dynamic else None)


def rss_peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def worker(args: argparse.Namespace) -> None:
    cfg = config(args.rows[0], args.id_capacity)
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    torch.set_num_threads(args.threads or max(1, (os.cpu_count() or 1) // world))
    rng = np.random.default_rng(rank)
    n_batches = args.steps + 3 if cfg.dynamic else 8  # mapping rewrites a batch's rows: each batch used once
    batches = [synthetic(cfg, args.step_rows, rng, i) for i in range(n_batches)]
    map_bytes = 0
    map_s = [0.0]  # seconds spent mapping ids (dynamic ids only)
    amp = autocast_dtype(Amp.AUTO, torch.device("cpu"))
    if world == 1:
        from learner.model import DeepFM
        from learner.optim import make_optimizers
        from learner.progressive import ProgressiveMetrics
        from learner.trainer import Trainer

        model = DeepFM(cfg, autocast_dtype=amp)
        sparse, dense = make_optimizers(model, 0.05, 0.001, initial_accumulator=1e-5)
        trainer = Trainer(model, sparse, dense, metrics=ProgressiveMetrics())
        local_bytes = cfg.num_rows * ((cfg.embedding_dim + 1) * 4 + 4)  # table + row-wise Adagrad's one float
        from learner.row_mapper import RowMapper

        mapper = RowMapper(cfg)
        map_bytes = sum(m.nbytes() for m in mapper.maps.values())

        def step(b: TensorBatch) -> np.ndarray:
            if mapper.active:
                t = time.perf_counter()
                mapper.apply(b, float(b.ts.max()) / 1000.0, model=model, sparse_opt=sparse)
                map_s[0] += time.perf_counter() - t
            return trainer.test_then_train(b)
    else:
        import torch.distributed as dist

        from learner.distributed import RankContext
        from learner.progressive import ProgressiveMetrics
        from learner.sharded_model import ShardedDeepFM, feature_names, fused_state, shard, table_weight
        from learner.sharded_trainer import ShardedTrainer

        RankContext.from_env(os.environ).init()
        sharded = ShardedDeepFM(cfg, (400, 400, 400), 0.0, 0, amp, table_device=torch.device("meta"))
        dmp = shard(sharded, world, torch.device("cpu"), 0.05, 1e-8, 1e-5, seed=0)
        dense_opt = torch.optim.Adam([p for n, p in sharded.named_parameters() if not n.startswith("sparse.")],
                                     lr=0.001)
        st = ShardedTrainer(dmp, dense_opt, feature_names(cfg), torch.device("cpu"), ProgressiveMetrics())
        local_bytes = sum(s.tensor.numel() * 4 for s in table_weight(dmp).local_shards())
        local_bytes += sum(s.tensor.numel() * 4 for s in fused_state(dmp)["momentum1"].local_shards())

        from learner.sharded_ids import ShardedRowMapper
        from learner.sharded_model import state_scale

        ids = ShardedRowMapper.of(cfg, dmp, 1e-5 * state_scale(cfg.embedding_dim))
        map_bytes = ids.nbytes()  # this rank's shares of the maps

        def step(b: TensorBatch) -> np.ndarray:
            if ids.active:
                t = time.perf_counter()
                ids.apply(b, dmp)
                map_s[0] += time.perf_counter() - t
            return st.test_then_train(b, len(b))
    for b in batches[:3]:  # warm-up
        step(b)
    if world > 1:
        dist.barrier()
    t0 = time.perf_counter()
    map_s[0] = 0.0
    for i in range(args.steps):
        step(batches[3 + i] if cfg.dynamic else batches[i % len(batches)])
    elapsed = time.perf_counter() - t0
    if world > 1:
        times = [None] * world
        dist.all_gather_object(times, elapsed)
        elapsed = max(times)  # type: ignore[type-var]
    out = {"rank": rank, "world": world, "rows": cfg.num_rows, "examples_per_s": world * args.step_rows * args.steps
           / elapsed, "rss_peak_mib": rss_peak_mib(), "table_mib": local_bytes / 2**20,
           "single_table_mib": cfg.num_rows * ((cfg.embedding_dim + 1) * 4 + 4) / 2**20,
           "id_maps_mib": map_bytes / 2**20, "id_map_ms_per_step": 1000 * map_s[0] / args.steps}
    Path(args.out, f"rank-{rank}.json").write_text(json.dumps(out))  # ranks share stdout: lines would interleave
    if world > 1:
        dist.destroy_process_group()


def run(ranks: int, args: argparse.Namespace, rows: int, threads: int = 0) -> list[dict]:
    out = Path(tempfile.mkdtemp(prefix="scaling-"))
    here = [sys.executable, str(Path(__file__).resolve()), "--worker", "--rows", str(rows), "--steps",
            str(args.steps), "--step-rows", str(args.step_rows), "--threads", str(threads), "--out", str(out),
            "--id-capacity", str(args.id_capacity)]
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    env.update(MALLOC_TRIM_THRESHOLD_="68719476736", MALLOC_MMAP_THRESHOLD_="33554432")
    cmd = here if ranks == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                                   str(ranks), *here[1:]]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    results = [json.loads(p.read_text()) for p in sorted(out.glob("rank-*.json"))]
    shutil.rmtree(out, ignore_errors=True)
    if proc.returncode != 0 or not results:
        return [{"rank": 0, "world": ranks, "rows": rows, "failed": proc.stderr[-500:]}]
    return sorted(results, key=lambda r: r["rank"])


def best_of(args: argparse.Namespace, rows: int) -> tuple[list[dict], list[dict], list[dict]]:
    """(1 process, N ranks, 1 process on 1 thread), run in turn ``--rounds`` times; each the round with the most
    examples/s (other processes load the machine: the best round is the one they disturbed least)."""
    best: list[list[dict]] = [[], [], []]
    for _ in range(args.rounds):
        for i, res in enumerate((run(1, args, rows), run(args.ranks, args, rows), run(1, args, rows, threads=1))):
            if not best[i] or "failed" in best[i][0] or (
                    "failed" not in res[0] and res[0]["examples_per_s"] > best[i][0]["examples_per_s"]):
                best[i] = res
    return best[0], best[1], best[2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--rows", type=int, nargs="+", default=[1_000_000, 4_000_000, 12_000_000],
                    help="table sizes (rows) to try")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=3, help="runs of each variant, in turn; the best is rated")
    ap.add_argument("--step-rows", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--cap-mib", type=float, default=1400.0, help="peak RSS a process may reach (MiB)")
    ap.add_argument("--id-capacity", type=int, default=0,
                    help="own rows per dynamic user and item field (0: static ids); see the module docstring")
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    print(f"# {' '.join(sys.argv)}  (cores: {os.cpu_count()}, cap {args.cap_mib:.0f} MiB peak RSS per process)")
    print(f"{'table rows':>12} {'table MiB':>9} | {'1 proc ex/s':>11} {'1 thread':>8} {'RSS MiB':>8} | "
          f"{args.ranks} ranks ex/s  ratio  ratio/1 thread  per-rank table MiB  per-rank RSS MiB")
    largest = None
    for rows in args.rows:
        one, many, single = best_of(args, rows)
        o, o1 = one[0], single[0]
        if "failed" in o or "failed" in o1 or any("failed" in r for r in many):
            print(f"{rows:>12} failed: {(o.get('failed') or o1.get('failed') or many[0].get('failed'))!r}")
            continue
        ratio = many[0]["examples_per_s"] / o["examples_per_s"]
        tables = "/".join(f"{r['table_mib']:.0f}" for r in many)
        rss = "/".join(f"{r['rss_peak_mib']:.0f}" for r in many)
        ratio1 = many[0]["examples_per_s"] / o1["examples_per_s"]
        print(f"{o['rows']:>12} {o['single_table_mib']:>9.0f} | {o['examples_per_s']:>11.0f} "
              f"{o1['examples_per_s']:>8.0f} {o['rss_peak_mib']:>8.0f} | {many[0]['examples_per_s']:>11.0f}  "
              f"{ratio:>5.2f}  {ratio1:>14.2f}  {tables:>18}  {rss:>16}"
              + (f"  id maps MiB {o['id_maps_mib']:.0f} (1 proc) "
                 + "/".join(f"{r['id_maps_mib']:.0f}" for r in many)
                 + f" (per rank), mapping ms/step {o['id_map_ms_per_step']:.1f} "
                 f"(1 proc) {many[0]['id_map_ms_per_step']:.1f} (rank 0)" if args.id_capacity else ""))
        if o["rss_peak_mib"] > args.cap_mib and all(r["rss_peak_mib"] <= args.cap_mib for r in many):
            largest = o["rows"]
    print(f"largest table that trains on {args.ranks} ranks but not on 1 under {args.cap_mib:.0f} MiB per process: "
          + (f"{largest:,} rows" if largest else "none of the sizes tried"))


if __name__ == "__main__":
    main()
