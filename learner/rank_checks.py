"""What every rank checks before the group trains (``streamrec train`` on N ranks, ``learner/sharded_daemon.py``):
the settings the distributed mode cannot honour (:func:`check_settings`), the same settings on every rank
(:func:`check_same_settings`, but :data:`RANK_LOCAL_SETTINGS`; ``checkpoint_dir`` the directory rank 0 writes, by
the token in its :data:`GROUP_FILE`), the same Kafka cluster (:func:`check_same_cluster`, :func:`cluster_mismatch`)
and the checkpoint directory held by rank 0 (:func:`hold_checkpoint_dir`). Each collective one raises the same
ConfigError on every rank, so none waits in a collective for a rank that stopped.
"""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

from learner import checkpoint
from learner.config import LearnerSettings, SparseOptimizer
from learner.distributed import all_gather_objects, broadcast_object
from stream.config import KafkaSettings
from stream.errors import ConfigError, shown
from stream.files import describe_os_error, write_atomic
from stream.limits import DEFAULT_LIMITS, EventLimits


def check_settings(ls: LearnerSettings) -> None:
    """The settings the distributed mode cannot honour: a ConfigError naming each and the fix."""
    bad = []
    if ls.sparse_optimizer is not SparseOptimizer.ROWWISE_ADAGRAD:
        bad.append(f"sparse_optimizer = {ls.sparse_optimizer.value} (only rowwise_adagrad is sharded: fbgemm's CPU "
                   "kernels have no Adam, and its CUDA Adam was not tried here)")
    if bad:
        raise ConfigError("streamrec train on several ranks cannot use: " + "; ".join(bad))


# [learner] settings each rank may set for itself: its host's loader and metrics endpoint, and paths only rank 0
# opens (the deltas it writes, their signing key). checkpoint_dir is every rank's, but may be mounted at another path
# on another host: check_same_settings checks that it is rank 0's directory, not that its path is rank 0's.
RANK_LOCAL_SETTINGS = frozenset({"num_workers", "prefetch_factor", "persistent_workers", "pin_memory", "metrics_port",
                                 "metrics_host", "deltas_dir", "signing_key_file", "deltas_redis_url",
                                 "checkpoint_dir"})
GROUP_FILE = ".group"  # in checkpoint_dir: rank 0's token of this start (check_same_settings)


def check_same_settings(kafka: KafkaSettings, ls: LearnerSettings, rank: int,
                        limits: EventLimits = DEFAULT_LIMITS) -> None:
    """Collective, every rank at start: a ConfigError on EVERY rank (so none waits in a collective for the others)
    when the ranks were started with different settings, e.g. one host's config file or environment differing.
    Each rank decides from its own value (its step's size, its stop at ``max_samples``, its learning rates, its
    topic), so a difference made the ranks' collectives diverge or their replicas drift apart, and a rank with
    another ``checkpoint_dir`` wrote its shards where no load looks while rank 0 renamed a checkpoint without them
    into place as complete. The ``[learner]`` settings but :data:`RANK_LOCAL_SETTINGS`, the samples topic and the
    ``[limits]`` bounds a samples message is read under (``kafka_dataset.check_strings``: a message dead-lettered on
    one rank was trained on another, as its partition fell) must be equal; ``checkpoint_dir`` must be the directory
    rank 0 writes (a token rank 0 writes there, read by every rank)."""
    import uuid

    mine = {f.name: getattr(ls, f.name) for f in fields(ls) if f.name not in RANK_LOCAL_SETTINGS}
    mine["[kafka] samples_topic"] = kafka.samples_topic
    mine.update({f"[limits] {name}": getattr(limits, name) for name in ("max_str_len", "max_key_len")})
    everyone = all_gather_objects(mine)
    differ = {k: [e.get(k) for e in everyone] for k in everyone[0]
              if any(e.get(k) != everyone[0][k] for e in everyone[1:])}
    if differ:
        raise ConfigError("the ranks were started with different settings (every rank must use the same [learner], "
                          "[kafka] samples_topic and [limits]): " + "; ".join(
                              f"{k}: " + ", ".join(f"rank {r} {v!r}" for r, v in enumerate(vals))
                              for k, vals in differ.items()))
    token = broadcast_object(uuid.uuid4().hex if rank == 0 else None)
    group_file, refused = Path(ls.checkpoint_dir) / GROUP_FILE, None
    if rank == 0:  # its failure (a full disk, a read-only directory) goes to every rank: none waits for a rank 0 gone
        try:
            group_file.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(group_file, token.encode())
        except OSError as exc:
            refused = (f"[learner] checkpoint_dir {ls.checkpoint_dir}: rank 0 cannot write its {GROUP_FILE} "
                       f"({describe_os_error(exc)}): free space there, fix its permissions, or name another")
    refused = broadcast_object(refused)  # after rank 0's write: the others read the token only after it
    if refused is not None:
        raise ConfigError(refused)
    try:
        seen = group_file.read_text() == token
    except OSError:
        seen = False
    dirs = all_gather_objects((seen, str(ls.checkpoint_dir)))
    elsewhere = [(r, d) for r, (ok, d) in enumerate(dirs) if not ok]
    if elsewhere:
        raise ConfigError("checkpoint_dir must be one directory every rank sees (rank 0 writes each checkpoint's "
                          f"metadata, every rank its shards): rank 0 writes {dirs[0][1]} but " + ", ".join(
                              f"rank {r}'s {d}" for r, d in elsewhere) + " is not that directory")


def check_same_cluster(bootstrap_servers: str, identity: dict[str, str]) -> None:
    """Collective, every rank before it reads: the same ConfigError on EVERY rank unless all read one Kafka cluster's
    samples topic. ``identity``: this rank's ``stream.kafka_topics.topic_identity``, asked of its own
    ``bootstrap_servers``.
    The offsets a checkpoint restores (and rank 0's topic-id check of them, ``_partitions``) are of rank 0's cluster;
    a rank started against another cluster (its host's config file or environment) read its partitions there from
    offsets that mean nothing in it: records below them skipped, others trained twice, all without a word."""
    if (why := cluster_mismatch(all_gather_objects((bootstrap_servers, identity)))) is not None:
        raise ConfigError(why)


def cluster_mismatch(seen: list[tuple[str, dict[str, str]]]) -> str | None:
    """Why the ranks' ``(bootstrap_servers, topic identity)`` (rank order) are not one cluster, or None. Two ranks
    whose brokers both name their cluster agree when the cluster ids are equal (another address of it is fine) and
    the topic ids, where both are given, too; where either gives no id (a broker without them, or one not answering)
    only equal ``bootstrap_servers`` tell they read the same cluster."""
    servers0, ident0 = seen[0]

    def agrees(servers: str, ident: dict[str, str]) -> bool:
        if not (ident.get("cluster_id") and ident0.get("cluster_id")):
            return servers == servers0
        return ident["cluster_id"] == ident0["cluster_id"] and (
            not (ident.get("topic_id") and ident0.get("topic_id")) or ident["topic_id"] == ident0["topic_id"])

    if all(agrees(*each) for each in seen[1:]):
        return None
    return ("[kafka] bootstrap_servers: the ranks read the samples topic from different Kafka clusters (or from "
            "brokers that do not say they are one): " + ", ".join(
                f"rank {r} {shown(servers)} (cluster {ident.get('cluster_id', 'unknown')}, topic id "
                f"{ident.get('topic_id', 'unknown')})" for r, (servers, ident) in enumerate(seen)) +
            ". The checkpoint's offsets are of one cluster's partitions: give every rank the same [kafka] "
            "bootstrap_servers (STREAMREC_KAFKA_BOOTSTRAP_SERVERS on each host): the cluster the checkpoint was "
            "trained from")


def hold_checkpoint_dir(ls: LearnerSettings, rank: int) -> int | None:
    """Collective, every rank at start, before any checkpoint is read: rank 0 takes ``<checkpoint_dir>/LOCK``
    (:func:`learner.checkpoint_directory.hold_directory`, the single-process learner's lock, so a job and a
    single-process learner exclude each other too), and one broadcast tells every rank whether it did: if not, the same
    ConfigError on every rank, naming the holder (none waits in a collective for a rank 0 that stopped). Two jobs on one
    directory numbered their serving deltas from their own counters and pruned each other's checkpoints. Rank 0's
    descriptor (None on the others) for :func:`learner.checkpoint_directory.release_directory`; forked DataLoader
    workers do not keep it."""
    fd, refused = None, None
    if rank == 0:
        try:
            fd = checkpoint.hold_directory(Path(ls.checkpoint_dir))
        except ConfigError as exc:
            refused = str(exc)
        except OSError as exc:  # its pid cannot be written (a full disk; one it cannot open is a ConfigError)
            refused = (f"[learner] checkpoint_dir {ls.checkpoint_dir}: rank 0 cannot take its {checkpoint.LOCK} "
                       f"({describe_os_error(exc)}): fix the directory's permissions, or name another")
    refused = broadcast_object(refused)
    if refused is not None:
        raise ConfigError(refused)
    return fd
