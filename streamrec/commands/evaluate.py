"""``streamrec evaluate``: offline and online evaluation on MovieLens."""

from __future__ import annotations

import argparse
import functools
from typing import Any

from streamrec.commands.common import EXIT_OK, add_common, count, default_help, emit, sources
from streamrec.settings import SettingsError

_d = functools.partial(default_help, None, "evaluate")  # [evaluate] key, else the tuned value: _d(key, builtin)


def add_parser(sub: Any) -> None:
    p = sub.add_parser("evaluate", help="measure the learner's AUC and logloss on MovieLens (offline or online)",
                       description="Train the streaming learner's DeepFM on MovieLens through the daemon's own "
                       "code path (hashed features in Arrow sample batches, to_tensors, test-then-train) and "
                       "report AUC and logloss. --protocol autoint is the offline protocol of AutoInt "
                       "(Song et al., CIKM 2019): rating > 3 is a positive, < 3 a negative, = 3 dropped; a random "
                       "8:1:1 train/valid/test split by --seed; epochs with early stopping on valid AUC; it "
                       "prints test AUC and logloss. --protocol online replays every rating in event-time order "
                       "(rating >= 4 is a click) through one test-then-train pass, each prediction made before "
                       "the model learns from its sample, and prints progressive AUC and logloss over the whole "
                       "stream and over its last 20 percent. Model settings default to the tuned ones; "
                       "[evaluate] in --config and STREAMREC_EVALUATE_<KEY> override them (embedding_dim, mlp, "
                       "dropout, lr_dense, lr_sparse, sparse_optimizer, weight_decay, batch_size, epochs, "
                       "patience, id_buckets, ctx_buckets, zip_buckets, history_len, history_delay_s, request_time, "
                       "eval_batch, threads, initial_accumulator, prior_click_rate, online_calibration), and flags "
                       "override those.",
                       epilog="Examples: streamrec evaluate --protocol autoint --features paper; "
                       "streamrec evaluate --protocol online --json. A full run takes a few minutes on 2 cores; "
                       "progress goes to stderr.")
    p.add_argument("--dataset", default="ml-1m", help="packaged data set (default: %(default)s)")
    p.add_argument("--cold-start", action="store_true",
                   help="compare cold-user progressive AUC/logloss of three treatments of new ids (shared zero "
                   "vector, hash buckets only, buckets + admission) on one time-ordered stream; --dataset "
                   "synthetic (steady arrival of new users) or ml-1m")
    p.add_argument("--variants", help="--cold-start: comma-separated subset of zero,buckets,admission")
    g = p.add_argument_group("--cold-start settings")
    g.add_argument("--capacity", type=int, help="own rows per id field (default 1000: fewer than the ids)")
    g.add_argument("--buckets", type=int, help="hash-bucket rows per id field for admission (default 2000)")
    g.add_argument("--admit-after", type=int, help="sightings before an id gets its own row (default 5)")
    g.add_argument("--boost", type=float, help="young-row learning-rate boost for admission (default 0)")
    g.add_argument("--cold-k", type=int, help="a user's first K impressions count as cold (default 10)")
    g.add_argument("--init", choices=["bucket", "zero"],
                   help="an admitted id's row starts as its bucket's vector or zero (admission; default bucket)")
    g.add_argument("--user-bucket-half-life-s", type=float,
                   help="idle user buckets shrink halfway to zero per S seconds of event time (admission; "
                   "default 60; 0 = never)")
    g.add_argument("--new-user-impressions", type=int,
                   help="synthetic: 1..N impressions per brand-new user (default 5)")
    g.add_argument("--new-user-session-s", type=float,
                   help="synthetic: spread a new user's impressions over a session of S seconds of event time, "
                   "interleaved with other users' (default 0: one consecutive burst)")
    p.add_argument("--protocol", choices=["autoint", "online", "delayed"],
                   help="autoint: offline 8:1:1 split, test AUC/logloss; online: one test-then-train pass in "
                   "event time, progressive AUC/logloss")
    p.add_argument("--features", choices=["paper", "default"],
                   help="paper: AutoInt's 7 fields, no ids (gender, age, occupation, zip, request time, release "
                   "year, genres); default: those plus user id, item id and the user's items rated >= 4 "
                   "strictly before the rating, last 50 (default: default)")
    p.add_argument("--history-delay-s", type=float,
                   help="default features: a rating >= 4 enters its user's history only S seconds after it, as a "
                   f"click delay makes it enter the joiner's history later ({_d('history_delay_s', '0')}: at once; "
                   "measures how much the offline history's head start is worth)")
    p.add_argument("--seed", type=count, default=42,
                   help="seed of the split, the epoch shuffles and the initial weights (default: %(default)s)")
    p.add_argument("--epochs", type=int, help="autoint: at most this many epochs (early stopping on valid AUC may "
                   "stop sooner); online always makes one pass")
    p.add_argument("--limit", type=count, help="use only the earliest N ratings in event time (quick looks; not "
                   "comparable with full runs)")
    g = p.add_argument_group("--protocol delayed: the joiner and the replay it simulates")
    g.add_argument("--emission", choices=["wait", "window", "fake_negative", "es_dfm"],
                   help="the joiner's emission policy "
                   f"({_d('emission', 'fake_negative')}, the joiner's; `streamrec join --help`)")
    g.add_argument("--elapsed-s", type=float, help="es_dfm: event time an impression waits for its click "
                   f"({_d('elapsed_s', '60')})")
    g.add_argument("--window-s", type=float, help=f"attribution window, event-time seconds ({_d('window_s', '1800')})")
    g.add_argument("--init-bias", action=argparse.BooleanOptionalAction, default=None,
                   help="start the model's bias at the logit of the observed click rate until 50 clicks "
                        f"(learner.delayed.BaseRateBias; {_d('init_bias', 'on')}, the daemon's)")
    g.add_argument("--syn-impressions", type=int, help="--dataset synthetic: impressions "
                   f"({_d('syn_impressions', '300000')})")
    g.add_argument("--syn-base-ctr", type=float, help="--dataset synthetic: the planted base click rate "
                   f"({_d('syn_base_ctr', '0.1')}; 0.004 for a low-CTR stream)")
    g = p.add_argument_group("model overrides (default: [evaluate] in --config / STREAMREC_EVALUATE_<KEY>, else the "
                             "tuned configuration of the protocol)")
    g.add_argument("--embedding-dim", type=int, help="embedding width")
    g.add_argument("--mlp", help="hidden layer widths, comma-separated, e.g. 400,400,400")
    g.add_argument("--dropout", type=float, help="dropout after each hidden layer")
    g.add_argument("--lr-dense", type=float, help="Adam learning rate of the dense weights")
    g.add_argument("--lr-sparse", type=float, help="row-wise Adagrad learning rate of the embedding table")
    g.add_argument("--batch-size", type=int, help="rows per training mini-batch")
    g.add_argument("--threads", type=int, help=f"torch CPU threads ({_d('threads', '2')})")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    add_common(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from learner.evaluation.config import EvalOverrides
    from learner.evaluation.protocols import describe, evaluate
    from stream.replay.movielens import DATASETS

    # the flags only one of the two modes reads: given to the other, a usage error (they were ignored without a word)
    other = ("features history_delay_s epochs syn_impressions syn_base_ctr" if args.cold_start else "variants capacity "
             "buckets admit_after boost cold_k init user_bucket_half_life_s new_user_impressions new_user_session_s")
    if given := [f"--{d.replace('_', '-')}" for d in other.split() if getattr(args, d) is not None]:
        raise SettingsError(f"{', '.join(given)}: not read {'with' if args.cold_start else 'without'} --cold-start")
    if args.cold_start:
        return _evaluate_cold_start(args)
    if args.protocol is None:
        raise SettingsError("--protocol autoint|online|delayed is required (or --cold-start)")
    if args.dataset not in DATASETS and not (args.dataset == "synthetic" and args.protocol == "delayed"):
        raise SettingsError(f"--dataset {args.dataset!r}: evaluate knows the packaged MovieLens data sets "
                            f"({', '.join(sorted(DATASETS))})")
    src = sources(args)
    over = src.build(EvalOverrides, "evaluate", embedding_dim=args.embedding_dim, mlp=args.mlp,
                     dropout=args.dropout, lr_dense=args.lr_dense, lr_sparse=args.lr_sparse,
                     batch_size=args.batch_size, threads=args.threads, history_delay_s=args.history_delay_s,
                     emission=args.emission, elapsed_s=args.elapsed_s, window_s=args.window_s,
                     init_bias=args.init_bias, syn_impressions=args.syn_impressions,
                     syn_base_ctr=args.syn_base_ctr)
    try:
        summary = evaluate(args.dataset, args.protocol, args.features or "default", args.seed, epochs=args.epochs,
                           config=over.to_config(), limit=args.limit, log=not args.quiet)
    except ValueError as exc:  # a bad override (--mlp 4x4, [evaluate] request_time = "day"): usage error, exit 2
        raise SettingsError(str(exc)) from None
    emit(args, summary, describe)
    return EXIT_OK


def _evaluate_cold_start(args: argparse.Namespace) -> int:
    from learner.cold_start import VARIANTS, ColdStartConfig, describe, evaluate_cold_start
    from stream.replay.movielens import DATASETS

    if args.dataset != "synthetic" and args.dataset not in DATASETS:
        raise SettingsError(f"--dataset {args.dataset!r}: --cold-start runs on synthetic or a packaged MovieLens "
                            f"data set ({', '.join(sorted(DATASETS))})")
    from dataclasses import replace

    from learner.evaluation.config import EvalConfig, EvalOverrides

    # [evaluate] and STREAMREC_EVALUATE_* as for the protocols, flags over them; batch_size is the variants' step
    over = sources(args).build(EvalOverrides, "evaluate", embedding_dim=args.embedding_dim, mlp=args.mlp,
                               dropout=args.dropout, lr_dense=args.lr_dense, lr_sparse=args.lr_sparse,
                               batch_size=args.batch_size, threads=args.threads, emission=args.emission,
                               elapsed_s=args.elapsed_s, window_s=args.window_s, init_bias=args.init_bias)
    try:
        overrides = over.to_config()
        replace(EvalConfig(), **overrides)  # its checks, before the data loads
    except ValueError as exc:  # --mlp 4x4, [evaluate] request_time = "day": a usage error, exit 2
        raise SettingsError(str(exc)) from None
    cs_over = {k: v for k, v in (("batch_size", overrides.pop("batch_size", None)), ("capacity", args.capacity),
                                 ("buckets", args.buckets), ("admit_after", args.admit_after),
                                 ("boost", args.boost), ("cold_k", args.cold_k), ("init", args.init),
                                 ("synthetic_new_user_impressions", args.new_user_impressions),
                                 ("synthetic_new_user_session_s", args.new_user_session_s)) if v is not None}
    if args.user_bucket_half_life_s is not None:  # 0 = never; a negative or NaN one is refused, not taken for never
        cs_over["user_bucket_half_life_s"] = args.user_bucket_half_life_s if args.user_bucket_half_life_s != 0 else None
    try:
        cs = ColdStartConfig(**cs_over)
    except ValueError as exc:  # --buckets 0, --cold-k -1, --boost nan: a usage error (exit 2), before the data loads
        raise SettingsError(str(exc)) from None
    variants = tuple(args.variants.split(",")) if args.variants else VARIANTS
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        raise SettingsError(f"--variants: unknown {sorted(unknown)}; known: {', '.join(VARIANTS)}")
    if args.protocol not in (None, "online", "delayed"):
        raise SettingsError("--cold-start runs with --protocol online (immediate labels, the default) or delayed "
                            "(served quality through the joiner's --emission policy)")
    summary = evaluate_cold_start(args.dataset, args.seed, config=overrides, cold=cs, limit=args.limit,
                                  variants=variants, log=not args.quiet, protocol=args.protocol or "online")
    emit(args, summary, describe)
    return EXIT_OK
