"""``streamrec train``: the continuous training daemon."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import logging
import os
import sys
from pathlib import Path
from typing import Any

from learner.config import LearnerSettings
from stream.config import RedisSettings
from stream.errors import close_after_error
from stream.limits import EventLimits
from stream.stop_signals import StopsTaken
from streamrec.commands.common import (
    EXIT_FAILED,
    EXIT_OK,
    add_common,
    add_kafka_flag,
    default_help,
    emit,
    kafka_settings,
    kv_lines,
    setup_logging,
    sources,
)


def add_parser(sub: Any) -> None:
    p = sub.add_parser("train", help="the continuous training daemon (DeepFM on the samples topic)",
                       description="Train DeepFM continuously on the samples topic: for every batch predict first "
                       "(progressive AUC/logloss), then learn; sparse embedding updates (row-wise Adagrad), the dense "
                       "part under fp16 autocast on CUDA and bf16 on a CPU that has it natively (--amp). "
                       "Checkpoints (model, optimizers, offsets) are written "
                       "atomically every --checkpoint-every-s / samples and at exit; on start the learner resumes "
                       "from the newest one at exactly its offsets, so each sample changes the model once however "
                       "often it crashes. Runs until SIGTERM (which checkpoints), or --max-samples, or "
                       "--exit-when-idle. --status prints the newest checkpoint's offsets and metrics.")
    p.add_argument("--status", action="store_true", help="print the latest checkpoint's state and exit")
    p.add_argument("--unshard", metavar="DIR", help="write the newest sharded checkpoint of --checkpoint-dir (a run "
                   "under torchrun) as one single-process checkpoint into DIR and exit: what `streamrec refresh` and "
                   "a one-process `streamrec train` read")
    d = functools.partial(default_help, LearnerSettings, "learner")  # d(key): "default: [learner] key, else <built-in>"
    p.add_argument("--checkpoint-dir", help=f"({d('checkpoint_dir')})")
    p.add_argument("--max-samples", type=int, help="stop after training this many samples")
    p.add_argument("--exit-when-idle", type=float, metavar="SECONDS", help="stop after this long without samples")
    p.add_argument("--batch-rows", type=int, help="rows read from Kafka per batch; whole samples messages are never "
                   f"split ({d('batch_rows')})")
    p.add_argument("--step-rows", type=int, help="rows per optimizer step: a batch trains as consecutive chunks of "
                   "this many rows, each predicted before it is learned; smaller is fresher and slower "
                   f"({d('step_rows')})")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], help=f"{d('device')}: CUDA when there is one")
    p.add_argument("--amp", choices=["auto", "on", "off"], help="mixed precision of the dense part: auto "
                   "is fp16 on CUDA, bf16 on a CPU with native bf16 (AVX512-BF16/AMX), fp32 otherwise (an AVX2 CPU "
                   f"emulates bf16 several times slower than fp32; {d('amp')})")
    p.add_argument("--num-workers", type=int, help=f"DataLoader workers reading partitions ({d('num_workers')})")
    p.add_argument("--metrics-port", type=int, help="serve Prometheus /metrics on this port")
    p.add_argument("--metrics-host", help="address the metrics listener binds "
                   f"({d('metrics_host')}: loopback only; 0.0.0.0 for every interface)")
    p.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"],
                   help="how much the process logs to stderr (default: %(default)s)")
    add_kafka_flag(p)
    add_common(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    src = sources(args)
    kafka = kafka_settings(args, src)
    ls = src.build(LearnerSettings, "learner", checkpoint_dir=args.checkpoint_dir, max_samples=args.max_samples,
                   exit_when_idle_s=args.exit_when_idle, batch_rows=args.batch_rows, step_rows=args.step_rows,
                   device=args.device, amp=args.amp,
                   num_workers=args.num_workers, metrics_port=args.metrics_port, metrics_host=args.metrics_host,
                   flag_names={"exit_when_idle_s": "--exit-when-idle"})
    rs, limits = src.build(RedisSettings, "redis"), src.build(EventLimits, "limits")  # delta channel; joiner's bounds
    if not ls.deltas_channel:  # the channel serving listens on: named from the [redis] prefix
        ls = dataclasses.replace(ls, deltas_channel=rs.deltas_channel)
    if args.unshard:
        from learner.sharded_checkpoint import unshard

        out = unshard(ls.checkpoint_dir, Path(args.unshard))
        emit(args, {"checkpoint": str(out)}, lambda d: f"unsharded into {d['checkpoint']}")
        return EXIT_OK
    if args.status:
        from learner.checkpoint_read import latest_meta

        meta = latest_meta(ls.checkpoint_dir)
        if meta is None:  # a directory of a run under torchrun: its newest sharded checkpoint
            from learner.sharded_checkpoint import latest

            found = latest(ls.checkpoint_dir, verify=False)  # its parts by size: no data file read
            meta = None if found is None else {**found[1], "path": str(found[0])}
        if meta is None:
            emit(args, {"checkpoint": None, "checkpoint_dir": str(ls.checkpoint_dir)},
                 lambda d: f"no checkpoint in {d['checkpoint_dir']}")
            return EXIT_FAILED
        status = {k: meta.get(k) for k in ("path", "created", "samples_trained", "steps", "offsets", "partition_rows",
                                       "duplicates", "metrics", "topic")}
        status["checksums"] = "not verified (--status reads no data file; a restore and --unshard verify them)"
        emit(args, status, lambda d: "latest checkpoint\n" + kv_lines(d))
        return EXIT_OK
    from learner.checkpoint_directory import check_directory

    # before any work (the metrics listener, the ranks, Kafka): a file there ended the learner in a traceback
    check_directory(ls.checkpoint_dir, "[learner] checkpoint_dir (--checkpoint-dir)")
    if ls.deltas_every_s > 0:
        check_directory(ls.deltas_dir, "[learner] deltas_dir")
    setup_logging(args.log_level)
    import torch

    from learner.distributed import RankContext

    # torchrun's environment, read here at the edge: WORLD_SIZE > 1 is the distributed mode
    ctx = RankContext.from_env(os.environ, ls.device.resolve(torch.cuda.is_available()))
    if ls.metrics_port is not None:
        from learner.distributed import metrics_registry
        from streamrec.commands.common import start_metrics

        start_metrics(ls.metrics_port + ctx.local_rank, ls.metrics_host,  # one port per rank of a host
                      "[learner] metrics_port / metrics_host (--metrics-port / --metrics-host)", metrics_registry(ctx))

    # Keep freed memory instead of returning it to the OS between steps (page faults cost 20-45% of a
    # bf16 step here, environment.md); only takes effect for this process's children, so set it early.
    for k, v in (("MALLOC_TRIM_THRESHOLD_", "68719476736"), ("MALLOC_MMAP_THRESHOLD_", "33554432")):
        os.environ.setdefault(k, v)
    if ctx.distributed:  # learner/sharded_daemon.py: TorchRec is imported only on this path
        from learner.sharded_daemon import run_ranks

        with StopsTaken(None) as stops:  # taken by run_ranks once its learner is built, to rank 0's summary here
            if (summary := run_ranks(kafka, ls, ctx, stops=stops, redis=rs, limits=limits)) is not None:  # rank 0
                emit(args, summary, lambda d: "train summary\n" + kv_lines(d))
        return EXIT_OK
    from learner.daemon import Learner

    learner = Learner(kafka, ls, redis=rs, limits=limits)
    print(f"training on {kafka.samples_topic} at {kafka.bootstrap_servers}, checkpoints in {ls.checkpoint_dir}",
          file=sys.stderr)
    with StopsTaken(learner.stop, lambda: learner.stopped) as stops:  # a stop after the run: the close, the summary
        try:
            summary = stops.run(learner.run)
        except BaseException:  # a close that fails too is logged, not raised in the place of what ended the run
            close_after_error(learner.close, "closing the learner", logging.getLogger("streamrec.train"))
            raise
        learner.close()
        emit(args, summary, _describe)
    return EXIT_OK


def _describe(d: dict[str, Any]) -> str:
    """The summary, led by served quality (learner/served.py): what users got, not what the learner was fed."""
    head = "train summary"
    sv = d.get("served", {}).get("all")
    if sv and sv.get("impressions"):
        cold = d["served"]["cold"]
        head += (f"\n  served quality ({sv['impressions']:,} impressions): AUC {sv['auc']:.4f}  logloss "
                 f"{sv['logloss']:.4f}  NE {sv['ne']:.4f}; cold users AUC {cold['auc']:.4f}  NE {cold['ne']:.4f}")
    return head + "\n" + kv_lines({k: v for k, v in d.items() if k != "settings"})
