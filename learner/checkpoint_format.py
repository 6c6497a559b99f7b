"""The checkpoint format: what a loaded checkpoint is, its versions, and its meta's checked fields.

Types and versions: a loaded checkpoint is a :class:`Checkpoint` (its path, format version, meta and
state, with the typed feature and model config and the model-shaping settings it was trained with).
``FORMAT_VERSION`` counts layout changes; :func:`upgrade` brings every older version up to date, one
explicit step per version, so readers only ever see the current layout. Version history:

1. the first layout (meta: samples_trained, steps, offsets, partition_rows, duplicates, feature_config,
   model, metrics, topic, lineage; state: model, sparse_opt, dense_opt, metrics, recent_ids, id_maps,
   cold_users, cold_metrics, warm_metrics);
2. ``meta["shape"]``: the model-shaping settings (``learner.config.SHAPE_SETTINGS``) a restore
   compares; upgraded from 1 by deriving them from the feature config and model settings;
3. ``meta["delta_seq"]``: the seq of the last serving delta written before it (``learner/deltas.py``; every
   later delta is newer than it, none is in it), or None without deltas. The refresh copies it into the
   artifact's ``source``, where a freshly loaded model starts counting the deltas pruned before it read them;
   upgraded from 2 as None (not known: such an artifact counts no gap before its first delta).

A file of a newer version than this streamrec reads is a :class:`CheckpointError` (exit 1 at the CLI).

The meta's counts (:func:`count`, :func:`partition_counts`, and :func:`state_counts` for the learner states'
own), the fields that must have a JSON type (:data:`TYPED_FIELDS`, :func:`mistyped`) and the samples topic the
offsets are of (:data:`TOPIC_IDENTITY`, :func:`same_topic`) are read here, for both readers (this module's
:func:`_opened` and ``learner/sharded_checkpoint.py``). Where checkpoints are written and read:
``learner/checkpoint.py``.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from learner.checkpoint_lineage import _LINEAGE_RE
from learner.config import ModelConfig, parse_mlp
from learner.features import FeatureConfig
from stream.errors import StreamrecError
from stream.samples import CTX_PREFIX

log = logging.getLogger("streamrec.checkpoint")


FORMAT_VERSION = 3


class CheckpointError(StreamrecError):
    """A checkpoint file this streamrec cannot use (a newer format, not a checkpoint); names file and fix."""


@dataclass(frozen=True)
class Checkpoint(Mapping[str, Any]):
    """One loaded checkpoint in the current layout (:func:`upgrade` ran): typed fields over the raw file.

    ``ckpt["meta"]``, ``ckpt["model"]``, ``ckpt["path"]`` ... still read the stored layout (the artifact
    checks validate exactly that, since a file may be damaged); the typed views are parsed on access.
    """

    path: Path
    meta: Mapping[str, Any]
    state: Mapping[str, Any]

    @property
    def format_version(self) -> int:
        return int(self.meta["format_version"])

    @property
    def feature_config(self) -> FeatureConfig:
        return FeatureConfig.from_dict(self.meta["feature_config"])

    @property
    def model_config(self) -> ModelConfig:
        return ModelConfig.from_meta(self.meta["model"])

    @property
    def shape(self) -> dict[str, Any]:
        """The model-shaping settings it was trained with (``learner.config.shape_of``)."""
        return dict(self.meta["shape"])

    @property
    def samples_trained(self) -> int:
        return count(self.meta, "samples_trained")

    @property
    def steps(self) -> int:
        return count(self.meta, "steps")

    @property
    def duplicates(self) -> int:
        return count(self.meta, "duplicates")

    @property
    def offsets(self) -> dict[int, int]:
        """Samples partition -> offset of the next message to train."""
        return partition_counts(self.meta, "offsets")  # (librdkafka reads -1 as the end, -2 as the start)

    @property
    def partition_rows(self) -> dict[int, int]:
        return partition_counts(self.meta, "partition_rows")

    # -- the stored layout, as a read-only mapping ------------------------------------------------------
    def __getitem__(self, key: str) -> Any:
        if key == "meta":
            return self.meta
        if key == "path":
            return str(self.path)
        return self.state[key]

    def __iter__(self) -> Iterator[str]:
        yield from ("meta", "path", *self.state)

    def __len__(self) -> int:
        return 2 + len(self.state)


def count(meta: Mapping[str, Any], name: str, least: int = 0) -> int:
    """``meta[name]``, an integer (no bool, no fraction, no text) of at least ``least``; else a ValueError naming the
    field (KeyError: absent). A checkpoint's counts are read through it: ``"samples_trained": "many"`` was resumed
    as the text (a TypeError at the first step trained), ``64.5`` or ``true`` as a number."""
    v = meta[name]
    if type(v) is not int or v < least:
        raise ValueError(f'"{name}" is {str(v)[:80]!r}, not an integer of at least {least}')
    return v


def state_counts(state: str, counts: Mapping[str, Any]) -> None:
    """A ValueError naming the learner state ``state`` and the first of ``counts`` (name -> value) that is no
    :func:`count` (an integer >= 0): a damaged or edited checkpoint's state, refused at load (the restore uses the
    previous checkpoint) instead of breaking every batch trained after it."""
    for name in counts:
        try:
            count(counts, name)
        except ValueError as exc:
            raise ValueError(f"{state}: {exc}") from None


def partition_counts(meta: Mapping[str, Any], name: str) -> dict[int, int]:
    """``meta[name]`` as partition -> count, every key a partition number's decimal text and every value a
    :func:`count`; else a ValueError naming the field (``{"0": 1.5}`` was resumed at offset 1); KeyError: absent
    (every checkpoint records both maps: no offsets read as none started every partition at 0, and each retained
    sample was trained again)."""
    v = meta[name]
    if not (isinstance(v, dict) and all(isinstance(p, str) and re.fullmatch("[0-9]+", p) and type(n) is int and n >= 0
                                        for p, n in v.items())):
        raise ValueError(f'"{name}" is {str(v)[:80]!r}, not a map of partition -> integer of at least 0')
    return {int(p): n for p, n in v.items()}


# The meta fields the restores compare or carry on besides the counts, and the JSON type each must have, for both
# readers (this one and learner/sharded_checkpoint.py); absent is allowed here. Mistyped, a check was skipped:
# ``"topic": 5`` resumed another topic's checkpoint (check_topic compares a string only), ``"lineage": {}`` continued
# the directory's lineage instead of the checkpoint's, ``"shape": []`` compared no shaping setting.
TYPED_FIELDS: dict[str, type] = {"shape": dict, "topic": str, "lineage": str, "topic_id": str, "cluster_id": str}


TOPIC_IDENTITY = ("topic_id", "cluster_id")  # which samples topic the offsets are of (:func:`same_topic`)


def topic_recorded(meta: Mapping[str, Any]) -> dict[str, str]:
    """The :data:`TOPIC_IDENTITY` fields ``meta`` records (none: a checkpoint written before they were)."""
    return {k: meta[k] for k in TOPIC_IDENTITY if k in meta}


def mistyped(meta: Mapping[str, Any]) -> str | None:
    """Which of ``meta``'s :data:`TYPED_FIELDS` has another type, with its value; None: none."""
    for name, kind in TYPED_FIELDS.items():
        if name in meta and not isinstance(meta[name], kind):
            return f'"{name}" is {str(meta[name])[:80]!r}, not a {"JSON object" if kind is dict else "string"}'
    if "lineage" in meta and not _LINEAGE_RE.fullmatch(meta["lineage"]):  # ("abc": the directory's continued)
        return f'"lineage" is {str(meta["lineage"])[:80]!r}, not a lineage id (32 hex digits, as every save writes)'
    return None


def same_topic(recorded: Mapping[str, Any], now: Mapping[str, str], topic: str) -> bool:
    """Whether the checkpoint's offsets are of ``topic`` as it is now: ``recorded`` (:func:`topic_recorded`) against
    ``now`` (``stream.kafka_topics.topic_identity``, what a save records): False, said as an ERROR naming both ids,
    when both give a topic id and they differ. The topic was deleted and created again since, or the broker is another
    cluster's: resuming at the saved offsets of a new topic already written past them skipped every record below them
    without a word (a shorter one is told by its end: ``learner.kafka_dataset._start_over_past_end``). A checkpoint
    written before topic ids were recorded, or a broker that gives none, passes (resumed as before)."""
    was, new = recorded.get("topic_id"), now.get("topic_id")
    if not was or not new or was == new:
        return True
    log.error("the checkpoint was trained from samples topic %r with topic id %s (cluster %s), and %r now has topic id "
              "%s (cluster %s): the topic was deleted and created again, or this is another cluster, and the "
              "checkpoint's offsets are not of it. Training every partition from its first record", topic, was,
              recorded.get("cluster_id", "unknown"), topic, new, now.get("cluster_id", "unknown"))
    return False


def _opened(path: Path, raw: dict[str, Any]) -> Checkpoint:
    """``raw`` (loaded from ``path``) upgraded (:func:`upgrade`'s CheckpointError) as a :class:`Checkpoint`; a
    ValueError when a field of its meta is :func:`mistyped` (a damaged file: the previous checkpoint is used)."""
    raw = upgrade(raw, path)
    ckpt = Checkpoint(path, raw["meta"], {k: v for k, v in raw.items() if k not in ("meta", "path")})
    if (bad := mistyped(ckpt.meta)) is not None:
        raise ValueError(f"checkpoint {path} is damaged: its meta's {bad}")
    return ckpt


def _shape_of_v1(meta: Mapping[str, Any]) -> dict[str, Any]:
    """The shaping settings a version-1 checkpoint implies, from its feature config and model settings."""
    out: dict[str, Any] = {"mlp": ModelConfig(parse_mlp(meta["model"]["mlp"])).mlp_text,
                           "sparse_optimizer": meta["model"]["sparse_optimizer"]}
    fields = {f["name"]: f for f in meta["feature_config"]["fields"]}
    out["embedding_dim"] = meta["feature_config"]["embedding_dim"]
    if "user_id" in fields:
        u = fields["user_id"]
        out.update(buckets=u["num_buckets"], id_capacity=u["capacity"], admit_after=u["admit_after"],
                   id_ttl_s=u["ttl_s"], id_init=u["init"])
    ctx = [f for n, f in fields.items() if n.startswith(CTX_PREFIX)]
    if ctx:
        out["ctx_buckets"] = ctx[0]["num_buckets"]
    return out


def upgrade(raw: dict[str, Any], path: Path) -> dict[str, Any]:
    """``raw`` (a loaded file: ``{"meta": ..., **state}``) in the current layout; one step per version.

    CheckpointError for a file without a meta or of a newer version than this streamrec reads."""
    meta = raw.get("meta")
    version = meta.get("format_version") if isinstance(meta, dict) else None
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise CheckpointError(f"checkpoint {path} has no valid format_version ({version!r}): it is not a streamrec "
                              "learner checkpoint")
    if version > FORMAT_VERSION:
        raise CheckpointError(f"checkpoint {path} has format {version}, this streamrec reads up to {FORMAT_VERSION}: "
                              "upgrade streamrec, or train into a new checkpoint_dir")
    meta = dict(raw["meta"])
    if version == 1:  # 1 -> 2: record the shaping settings
        if "shape" not in meta:
            try:
                meta["shape"] = _shape_of_v1(meta)
            except (KeyError, TypeError, ValueError):
                pass  # a damaged meta: the artifact checks and the restore name what is wrong
        version = 2
    if version == 2:  # 2 -> 3: the last delta's seq, not known
        meta.setdefault("delta_seq", None)
        version = 3
    meta["format_version"] = version
    return {**raw, "meta": meta}
