"""The serving artifact: what the learner's checkpoint becomes, ``cache_refresh`` publishes and ``serving`` loads.

The one file format those stages share, so it lives here beside the checkpoints and deltas it is
built from: the layout of a publish root, the manifest and its checks, :func:`build_artifact` and
:func:`verify`, and the READERS of a publish root (``CURRENT``, the versions, the rollback pin). Writing
a root (publish, rollback, pruning, the refresh lock, cleanup) is ``cache_refresh/publish.py``; the
scorer module is ``learner/scorer.py``; the loaded, scoring runtime is ``serving/model.py``.

Layout under a publish root::

    <root>/CURRENT                       the current version's name (replaced atomically)
    <root>/PINNED                        a rollback pin (JSON; cache_refresh/publish.py)
    <root>/versions/<version>/
        manifest.json                    version, created, source checkpoint (path, samples_trained,
                                         offsets, delta_seq: the last learner delta it includes, or
                                         null), feature_config, model settings, hot-set stats,
                                         format, scorer settings (``input_layout``: the scorer's input
                                         layout, learner/scorer.py; absent in artifacts from before the
                                         user-row layout, which serving still loads; 3 for the onnx
                                         formats' pooling graph), files {name:
                                         {sha256, bytes}},
                                         signature (when the refresh has a signing key)
        scorer.pt | scorer.pt2 | scorer_state.pt | scorer.safetensors | scorer.onnx + scorer.safetensors
                                         the scorer (torchscript | export | eager | safetensors | onnx: the
                                         graph and the tensors beside it, learner/onnx_scorer.py)
        cold_rows.npy                    float32 (num_rows, D + 1): the whole fused table (serving copies it)
        id_maps.pt | id_maps.pack        dynamic ids only: the learner's id maps (learner/row_mapper.py), a
                                         weights-only torch.save, or (safetensors and onnx artifacts) a
                                         learner.tensorpack: such an artifact unpickles nothing
    <root>/.staging/<version>-<pid>/     an artifact being built; never read by serving

Every file serving reads is listed in the manifest's ``files``, opened once and checked (regular file, one
link, size, sha256) on the open file, and loaded from that same open file (:func:`open_artifact`,
``serving.model.ScoringModel.load``): a file renamed over a listed one after its check is never what is loaded.

Signatures: with a signing key (``signing_key_file``: :func:`learner.tensorpack.load_signing_key`) the
manifest carries ``signature``, the hex HMAC-SHA256 of :func:`canonical_manifest` (the manifest without
``signature``, as JSON with sorted keys and no spaces). A reader with a key (:func:`decode_manifest`,
:func:`read_manifest`, :func:`verify` given ``signing_key``) refuses an unsigned manifest or one whose
signature does not match right after parsing it, before any other file of the version is opened; since
the manifest lists every file's sha256, a signed manifest authenticates the whole artifact. A reader
without a key ignores the signature.

Paths: names read from the root (``CURRENT``, ``PINNED``, the entries of ``versions/``) must be plain
version names (:func:`is_version_name`: letters, digits, ``. _ -``, no path separator, not starting with
a dot, so never ``..``); manifest file names likewise. A version directory must resolve (symlinks
followed) to a directory inside ``<root>/versions``, and every artifact file (the manifest included) to a
file inside its version directory: a symlink leaving them is an ArtifactError (:func:`version_path`,
:func:`read_current`, :func:`verify`), and :func:`list_versions` leaves such entries out; the files the manifest
lists are opened without following a symlink at all (:func:`open_artifact`).

Errors: :class:`ArtifactError` for every artifact that cannot be used (missing, truncated or altered
files; a manifest that is not UTF-8, not JSON, repeats a key, not an object, lacks a key or has a key of the
wrong type or value; a ``CURRENT`` that names no valid version; a scorer that does not load or score); the message
names the file, what was wrong and what to do. No other exception escapes :func:`decode_manifest`,
:func:`read_current`, :func:`read_pin` or ``serving.model.ScoringModel.load`` for a damaged artifact.
"""

from __future__ import annotations

import datetime as dt
import errno
import hashlib
import json
import logging
import math
import os
import re
import shutil
import stat
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch

from learner.config import parse_mlp
from learner.features import FeatureConfig, FieldSpec
from learner.model import DeepFM
from learner.scorer import (
    CANDIDATE_ROWS_LAYOUT,
    FORMATS,
    ONNX_FORMATS,
    PICKLE_FREE_FORMATS,
    POOLING_GRAPH_LAYOUT,
    SCORER_EXTRA_FILES,
    SCORER_FILES,
    SCORER_LAYOUTS,
    USER_ROW_LAYOUT,
    Scorer,
    ScorerSpec,
    hot_buffers,
)
from learner.scorer_files import save_scorer
from learner.tensorpack import PackError, SigningKey, pack, unpack
from stream.errors import BadMessage, StreamrecError
from stream.events import count_keys, reject_duplicate_keys
from stream.files import finite_json, fsync_dir, open_entry, open_regular, sha256_file, write_synced

__all__ = ["ARTIFACT_FORMAT_VERSION", "COLD_FILE", "CURRENT", "FORMATS", "ID_MAPS_FILE", "ID_MAPS_PACK", "MANIFEST",
           "PIN", "SCORER_FILES", "SIGNATURE", "STAGING", "VERSIONS", "ArtifactError", "ArtifactFiles", "Pin",
           "build_artifact", "canonical_manifest", "check_checkpoint", "check_signature", "current_version",
           "decode_manifest", "eager_model", "feature_config_from", "is_version_name", "list_versions", "map_table",
           "new_version_name", "open_artifact", "pin_holding", "read_current", "read_id_maps", "read_manifest",
           "read_pin", "read_table", "verify", "version_path", "versions_dir"]

ARTIFACT_FORMAT_VERSION = 1
COLD_FILE = "cold_rows.npy"
ID_MAPS_FILE = "id_maps.pt"  # dynamic ids only: the learner's id maps (learner/row_mapper.py), torch.save
ID_MAPS_PACK = "id_maps.pack"  # the same as a learner.tensorpack (safetensors artifacts: nothing unpickled)
SIGNATURE = "signature"  # the manifest key of its HMAC-SHA256 (with a signing key)
MANIFEST = "manifest.json"
CURRENT = "CURRENT"
PIN = "PINNED"
VERSIONS = "versions"
STAGING = ".staging"
log = logging.getLogger("streamrec.artifact")
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")  # version and file names: no path separators
_SHA_RE = re.compile(r"[0-9a-f]{64}")
_MAX_MANIFEST = 16 << 20
_MAX_POINTER = 4096


class ArtifactError(StreamrecError):
    """An artifact that cannot be used: missing, truncated or altered files, or an unreadable manifest."""


def is_version_name(name: str) -> bool:
    """Whether ``name`` is a plain version (or file) name: letters, digits, ``. _ -``; no path in it."""
    return _NAME_RE.fullmatch(name) is not None


# -- eager reference and model settings -----------------------------------------------------------
def eager_model(checkpoint: Mapping[str, Any]) -> DeepFM:
    """The learner's DeepFM in fp32 eval mode, rebuilt from a checkpoint (``learner.checkpoint.load_latest``).

    Built the way ``learner/daemon.py`` builds it (feature config and model settings from the meta),
    with autocast off: this is the reference an artifact's scores must equal.
    """
    meta = checkpoint["meta"]
    cfg = FeatureConfig.from_dict(meta["feature_config"])
    ms = meta["model"]
    model = DeepFM(cfg, mlp=parse_mlp(ms["mlp"]), dropout=float(ms.get("dropout", 0.0)), autocast_dtype=None)
    model.load_state_dict(checkpoint["model"])
    return model.eval()


def _dense_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().float().clone() for k, v in state.items() if not k.startswith("sparse.")}


# -- manifest and checkpoint checks ----------------------------------------------------------------
def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _show(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


_FIELD_TYPES: dict[str, tuple[Any, bool]] = {  # FieldSpec attribute: (check, may be None)
    "name": (lambda v: isinstance(v, str) and v != "", False),
    "kind": (lambda v: v in ("single", "multi", "sequence"), False),
    "num_buckets": (lambda v: _int(v) and v >= 1, False),
    "shares": (lambda v: isinstance(v, str), True),
    "capacity": (lambda v: _int(v) and v >= 0, False),
    "admit_after": (lambda v: _int(v) and v >= 0, False),
    "ttl_s": (lambda v: _num(v) and v >= 0, True),
    "init": (lambda v: v in ("bucket", "zero"), False),
    "bucket_half_life_s": (lambda v: _num(v) and v > 0, True),
}


def feature_config_from(d: Any, where: str) -> FeatureConfig:
    """A :class:`FeatureConfig` from its ``to_dict()`` form, every field type-checked: ArtifactError otherwise."""
    def bad(what: str) -> ArtifactError:
        return ArtifactError(f"{where}: feature_config {what}; the file was not written by this streamrec's "
                             "learner or refresh (rebuild it with `streamrec refresh --now`)")

    if not isinstance(d, dict):
        raise bad(f"is {_show(d)}, expected an object")
    fields = d.get("fields")
    if not isinstance(fields, (list, tuple)) or not fields:  # a list in JSON, a tuple in a checkpoint
        raise bad(f"fields is {_show(fields)}, expected a non-empty list")
    specs = []
    for i, f in enumerate(fields):
        if not isinstance(f, dict) or "name" not in f or set(f) - set(_FIELD_TYPES):
            raise bad(f"fields[{i}] is {_show(f)}, expected an object with name and only {sorted(_FIELD_TYPES)}")
        for key, value in f.items():
            check, nullable = _FIELD_TYPES[key]
            if not ((value is None and nullable) or (value is not None and check(value))):
                raise bad(f"fields[{i}].{key} is {_show(value)}")
        specs.append(f)
    dense, dim, version = d.get("dense", []), d.get("embedding_dim"), d.get("version", 1)
    if not (isinstance(dense, (list, tuple)) and all(isinstance(x, str) for x in dense)):
        raise bad(f"dense is {_show(dense)}, expected a list of names")
    if not (isinstance(dim, int) and not isinstance(dim, bool) and 1 <= dim <= 65536):
        raise bad(f"embedding_dim is {_show(dim)}, expected an integer in [1, 65536]")
    if not _int(version):
        raise bad(f"version is {_show(version)}, expected an integer")
    try:
        cfg = FeatureConfig(tuple(FieldSpec(**f) for f in specs), dense=tuple(dense), embedding_dim=dim,
                            version=version)
        cfg.blocks  # noqa: B018 - validates `shares`
    except (ValueError, TypeError, StopIteration) as exc:
        raise bad(f"is inconsistent ({exc})") from None
    return cfg


def _check_source(src: Any, bad: Any) -> None:
    if not isinstance(src, dict):
        raise bad(f"source is {_show(src)}, expected an object")
    for key in ("samples_trained", "delta_seq"):
        value = src.get(key)
        if value is not None and not (_int(value) and value >= 0):
            raise bad(f"source.{key} is {_show(value)}, expected an integer >= 0 or null")
    for key in ("checkpoint", "lineage", "topic"):
        if src.get(key) is not None and not isinstance(src[key], str):
            raise bad(f"source.{key} is {_show(src[key])}, expected a string or null")
    created = src.get("created")
    if created is not None and not (_num(created) and created >= 0):
        raise bad(f"source.created is {_show(created)}, expected a unix time >= 0 or null")
    if not isinstance(src.get("offsets", {}), dict):
        raise bad(f"source.offsets is {_show(src.get('offsets'))}, expected an object")


def _check_files(files: Any, fmt: str, bad: Any) -> None:
    if not isinstance(files, dict) or not files:
        raise bad(f"files is {_show(files)}, expected an object of {{name: {{sha256, bytes}}}}")
    for name, want in files.items():
        if not _NAME_RE.fullmatch(name):
            raise bad(f"files names {_show(name)}, not a plain file name of this directory")
        if not (isinstance(want, dict) and isinstance(want.get("sha256"), str) and _SHA_RE.fullmatch(want["sha256"])
                and _int(want.get("bytes")) and want["bytes"] >= 0):
            raise bad(f"files[{name!r}] is {_show(want)}, expected {{sha256: 64 hex digits, bytes: integer >= 0}}")
    for needed in (SCORER_FILES[fmt], *SCORER_EXTRA_FILES.get(fmt, ()), COLD_FILE):
        if needed not in files:
            raise bad(f"files does not list {needed}, which a {fmt} artifact reads")
    if ID_MAPS_FILE in files and ID_MAPS_PACK in files:
        raise bad(f"files lists both {ID_MAPS_FILE} and {ID_MAPS_PACK}; an artifact has one id maps file")
    if fmt in PICKLE_FREE_FORMATS and ID_MAPS_FILE in files:
        raise bad(f"files lists {ID_MAPS_FILE}, a pickle, in a {fmt} artifact (which unpickles nothing; its id "
                  f"maps are {ID_MAPS_PACK})")


def canonical_manifest(manifest: Mapping[str, Any]) -> bytes:
    """The bytes a manifest's signature covers: the manifest without ``signature``, as JSON with sorted keys,
    no spaces and ASCII escapes (independent of how the file itself is indented)."""
    body = {k: v for k, v in manifest.items() if k != SIGNATURE}
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode("ascii")


def check_signature(manifest: Mapping[str, Any], key: SigningKey, where: str | Path = MANIFEST) -> None:
    """ArtifactError unless ``manifest`` carries ``key``'s signature of :func:`canonical_manifest`."""
    sig = manifest.get(SIGNATURE)
    fix = ("publish it again with a refresh that has the same signing_key_file (`streamrec refresh --now`), or "
           "roll back to a signed version")
    if sig is None:
        raise ArtifactError(f"{where}: the manifest is unsigned, and this reader has a signing key (signing_key_file "
                            f"{key.source or 'set'}): refused before any other file was opened; {fix}")
    if not (isinstance(sig, str) and _SHA_RE.fullmatch(sig)):
        raise ArtifactError(f"{where}: signature is {_show(sig)}, not 64 hex digits: refused; {fix}")
    try:
        body = canonical_manifest(manifest)
    except (TypeError, ValueError) as exc:  # JSON from a file always re-encodes; kept so nothing else escapes
        raise ArtifactError(f"{where}: the manifest cannot be re-encoded to check its signature ({exc})") from None
    if not key.verify(body, sig):
        raise ArtifactError(f"{where}: signature does not match this reader's signing key: the manifest was altered "
                            f"or signed with another key; refused before any other file was opened; {fix}")


_REBUILD = "rebuild it with `streamrec refresh --now`"
# (a refresh of the newer streamrec builds the same again: the reader is what is behind)
_NEWER = ("a newer streamrec built it: upgrade the streamrec reading it (serving, or a refresh job rolled back behind "
          "the live artifact) to it; upgrade serving before the refresh job (README, Upgrades)")


def decode_manifest(raw: bytes, where: str | Path = MANIFEST,
                    signing_key: SigningKey | None = None) -> dict[str, Any]:
    """The manifest in ``raw`` (the bytes of ``manifest.json``), every key this code reads checked.

    Raises :class:`ArtifactError` naming the problem for any other bytes: not UTF-8, not JSON, a key repeated in
    one object at any depth (readers disagree on which one counts), not an object, (with ``signing_key``)
    unsigned or a signature that does not match, checked first, another ``artifact_format_version``, a ``format``
    name this version does not know (a newer streamrec's: the error says to upgrade the reader), a missing key, a
    key of the wrong type or value, a file name with a path in it, a feature config or scorer spec that does not
    hold together. Extra keys are allowed (newer writers may add some).
    """
    where = str(where)

    def bad(what: str) -> ArtifactError:
        return ArtifactError(f"{where}: {what}: the artifact is corrupt or not this streamrec's; republish with "
                             "`streamrec refresh --now` or roll back with `streamrec refresh --rollback`")

    try:
        text = bytes(raw).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise bad(f"not UTF-8 ({exc})") from None
    try:
        m = json.loads(text)
        reject_duplicate_keys(raw, count_keys(m))  # json keeps the last; the C++ loader reads the first "scorer"
    except BadMessage as exc:
        raise bad(str(exc)) from None
    except (ValueError, RecursionError) as exc:
        raise bad(f"not valid JSON ({str(exc)[:120]})") from None
    if not isinstance(m, dict):
        raise bad(f"holds {_show(m)}, expected a JSON object")
    if signing_key is not None:
        check_signature(m, signing_key, where)
    afv = m.get("artifact_format_version")
    if not _int(afv) or afv != ARTIFACT_FORMAT_VERSION:
        raise ArtifactError(f"{where}: artifact format {_show(afv)}, this streamrec reads {ARTIFACT_FORMAT_VERSION}; "
                            f"{_NEWER if isinstance(afv, int) and afv > ARTIFACT_FORMAT_VERSION else _REBUILD}")
    missing = [k for k in ("version", "created", "created_utc", "format", "source", "feature_config", "model",
                           "scorer", "hot_set", "files") if k not in m]
    if missing:
        raise bad(f"missing {', '.join(missing)}")
    if not (isinstance(m["version"], str) and _NAME_RE.fullmatch(m["version"])):
        raise bad(f"version is {_show(m['version'])}, expected a plain name (letters, digits, . _ -)")
    if not _num(m["created"]) or not isinstance(m["created_utc"], str):
        raise bad(f"created {_show(m['created'])} / created_utc {_show(m['created_utc'])}: expected a unix time "
                  "and a string")
    fmt = m["format"]
    if isinstance(fmt, str) and fmt not in FORMATS and _NAME_RE.fullmatch(fmt):  # a format added after this version
        raise ArtifactError(f"{where}: format {fmt!r} is not one this streamrec reads ({', '.join(FORMATS)}); {_NEWER}")
    if not isinstance(fmt, str) or fmt not in FORMATS:
        raise bad(f"format is {_show(fmt)}, expected one of {', '.join(FORMATS)}")
    for key in ("model", "hot_set"):
        if not isinstance(m[key], dict):
            raise bad(f"{key} is {_show(m[key])}, expected an object")
    _check_source(m["source"], bad)
    _check_files(m["files"], fmt, bad)
    cfg = feature_config_from(m["feature_config"], where)
    sc = m["scorer"]
    ok = (isinstance(sc, dict) and _int(sc.get("num_fields")) and _int(sc.get("dim")) and _int(sc.get("num_dense"))
          and isinstance(sc.get("mlp"), list) and all(_int(x) and 1 <= x <= 1 << 20 for x in sc["mlp"])
          and _num(sc.get("dropout")) and 0 <= sc["dropout"] < 1)
    if not ok:
        raise bad(f"scorer is {_show(sc)}, expected {{num_fields, dim, num_dense, mlp: [sizes], dropout}}")
    layout = sc.get("input_layout", CANDIDATE_ROWS_LAYOUT)  # absent: a scorer from before the user-row layout
    if not _int(layout) or layout not in SCORER_LAYOUTS:
        raise ArtifactError(f"{where}: scorer input_layout {_show(layout)}, this streamrec reads "
                            f"{', '.join(map(str, SCORER_LAYOUTS))}; "
                            f"{_NEWER if isinstance(layout, int) and layout > max(SCORER_LAYOUTS) else _REBUILD}")
    if layout == POOLING_GRAPH_LAYOUT and fmt not in ONNX_FORMATS:
        raise bad(f"scorer input_layout {layout} (a pooling ONNX graph) with format {fmt!r}")
    if (sc["num_fields"], sc["dim"], sc["num_dense"]) != (cfg.num_fields, cfg.embedding_dim, len(cfg.dense)):
        raise bad(f"scorer (fields {sc['num_fields']}, dim {sc['dim']}, dense {sc['num_dense']}) does not match the "
                  f"feature config ({cfg.num_fields}, {cfg.embedding_dim}, {len(cfg.dense)})")
    return m


def check_checkpoint(checkpoint: Any) -> FeatureConfig:
    """That ``checkpoint`` (``learner.checkpoint.load_latest``) can become an artifact; returns its config.

    ArtifactError naming the problem otherwise: no meta, a malformed feature config or model settings, no
    embedding table, a table of the wrong shape, or non-finite weights (a diverged learner must not be
    published; the previous artifact keeps serving).
    """
    where = f"checkpoint {checkpoint.get('path') if isinstance(checkpoint, Mapping) else None}"
    if not isinstance(checkpoint, Mapping) or not isinstance(checkpoint.get("meta"), Mapping):
        raise ArtifactError(f"{where}: has no meta object; it is not a streamrec learner checkpoint")
    meta = checkpoint["meta"]
    cfg = feature_config_from(meta.get("feature_config"), where)
    ms = meta.get("model")
    if not isinstance(ms, dict) or "mlp" not in ms:
        raise ArtifactError(f"{where}: meta.model is {_show(ms)}, expected the model settings with mlp")
    try:
        layers_ok = all(x >= 1 for x in parse_mlp(ms["mlp"]))
    except (ValueError, TypeError):
        layers_ok = False
    if not layers_ok or not _num(ms.get("dropout", 0.0)):
        raise ArtifactError(f"{where}: meta.model mlp {_show(ms['mlp'])} / dropout {_show(ms.get('dropout'))} "
                            "are not layer sizes and a rate")
    samples = meta.get("samples_trained")
    if not (_int(samples) and samples >= 0):
        raise ArtifactError(f"{where}: meta.samples_trained is {_show(samples)}, expected an integer >= 0")
    delta_seq = meta.get("delta_seq")
    if delta_seq is not None and not (_int(delta_seq) and delta_seq >= 0):
        raise ArtifactError(f"{where}: meta.delta_seq is {_show(delta_seq)}, expected an integer >= 0 or null")
    state = checkpoint.get("model")
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ArtifactError(f"{where}: model is not a state dict of tensors")
    table = state.get("sparse.bag.weight")
    want = (cfg.num_rows, cfg.embedding_dim + 1)
    if table is None or tuple(table.shape) != want:
        raise ArtifactError(f"{where}: table shape {None if table is None else tuple(table.shape)} does not match "
                            f"its feature config {want}")
    _check_dense_state(where, cfg, ms, state)
    for k, v in state.items():
        if v.is_floating_point() and v.numel() and not bool(torch.isfinite(v).all()):
            raise ArtifactError(f"{where}: weight {k!r} holds {int((~torch.isfinite(v)).sum())} non-finite values: "
                                "the learner diverged; this checkpoint is not published (the live artifact keeps "
                                "serving); fix the learner or refresh from an earlier checkpoint")
    return cfg


# -- build -------------------------------------------------------------------------------------
_TIME_NAME_RE = re.compile(r"\d{8}T\d{9}Z")  # new_version_name's form


def _time_name(t: dt.datetime) -> str:
    return t.strftime("%Y%m%dT%H%M%S") + f"{t.microsecond // 1000:03d}Z"


def new_version_name(now: float | None = None, root: Path | None = None) -> str:
    """``YYYYMMDDTHHMMSSmmmZ``: UTC, sorts in time order.

    With ``root`` (a publish root), also after every name of that form in its ``versions/``: when the clock is at or
    behind the newest one (it went back: a clock set ahead and corrected, a restored VM), the name is 1 ms after that
    one. Name order is publish order, which pruning (the newest ``keep_versions`` names stay) and rollback (the newest
    name before ``CURRENT``) go by: after the clock went back, a new version sorted before the ones published while it
    was ahead, so pruning deleted the version just replaced (the rollback target) and kept the older ones for ever, and
    a rollback went to an older model than the one live before, or found none."""
    name = _time_name(dt.datetime.fromtimestamp(time.time() if now is None else now, tz=dt.timezone.utc))
    if root is None:
        return name
    d = versions_dir(root)
    try:
        names = [p.name for p in d.iterdir()] if d.is_dir() else []
    except OSError:
        names = []
    for newest in sorted((n for n in names if _TIME_NAME_RE.fullmatch(n)), reverse=True):
        if name > newest:
            return name
        try:
            later = _time_name(dt.datetime.strptime(newest[:-1], "%Y%m%dT%H%M%S%f") + dt.timedelta(milliseconds=1))
        except (ValueError, OverflowError):  # of the form, but no time (month 13, year 9999's last ms): not ours
            continue
        if later in names:  # newest + 1 ms is year 9999's last ms, there already: no name can follow it
            log.warning("%s holds %s, the last name of its form: no version name can follow it, so the new version "
                        "is named by the clock, %s; remove the versions named in year 9999 for names to keep the "
                        "order of publishing", d, later, name)
            return name
        break
    else:
        return name
    log.warning("the clock (%s) is not after the newest version in %s (%s): the new version is named %s, so that "
                "names keep the order of publishing (pruning and rollback go by it)", name, d, newest, later)
    return later


def _check_dense_state(where: str, cfg: FeatureConfig, ms: Mapping[str, Any],
                       state: Mapping[str, torch.Tensor]) -> None:
    """ArtifactError unless the checkpoint's dense weights (every key but ``sparse.*``) are exactly the scorer's, each
    of its shape: a missing, extra or reshaped weight would otherwise fail later in ``load_state_dict`` with a
    page of torch's text. The scorer is built on the meta device (shapes only, no memory)."""
    with torch.device("meta"):
        spec = ScorerSpec(cfg.num_fields, cfg.embedding_dim, len(cfg.dense), parse_mlp(ms["mlp"]),
                          float(ms.get("dropout", 0.0)))
        scorer = Scorer(spec, torch.zeros(1, dtype=torch.int64), torch.zeros(1, cfg.embedding_dim + 1))
    want = {k: tuple(v.shape) for k, v in scorer.state_dict().items() if k not in ("hot_ids", "hot_vectors")}
    # weights the scorer fills itself when a state lacks them (its load hooks: calibration, from before it existed)
    optional = want.keys() - set(scorer.load_state_dict({}, strict=False, assign=True).missing_keys)
    have = {k: tuple(v.shape) for k, v in state.items() if not k.startswith("sparse.")}
    missing, extra = sorted(want.keys() - have.keys() - optional), sorted(have.keys() - want.keys())
    reshaped = sorted(k for k in want.keys() & have.keys() if want[k] != have[k])
    if missing or extra or reshaped:
        parts = ([f"missing {', '.join(missing[:5])}"] if missing else []) + \
                ([f"unexpected {', '.join(extra[:5])}"] if extra else []) + \
                [f"{k} is {have[k]}, expected {want[k]}" for k in reshaped[:5]]
        raise ArtifactError(f"{where}: its dense weights do not match its model settings (mlp {_show(ms['mlp'])}, "
                            f"{cfg.num_fields} fields, dim {cfg.embedding_dim}, {len(cfg.dense)} dense): "
                            f"{'; '.join(parts)}")


def build_artifact(checkpoint: Mapping[str, Any], out_dir: Path, hot_rows: np.ndarray, format: str = "torchscript",
                   hot_stats: dict[str, Any] | None = None, version: str | None = None,
                   signing_key: SigningKey | None = None, between: Callable[[], object] | None = None) -> Path:
    """Stage a complete artifact for ``checkpoint`` under the publish root ``out_dir``; returns the staged dir.

    ``hot_rows`` (int64, any order, duplicates allowed) are global rows of the fused table placed in the
    scorer. The staged directory (``out_dir/.staging/<version>-<pid>``) is complete and fsynced when this
    returns; ``cache_refresh.publish.publish`` makes it a version. On error nothing is left behind. With
    ``signing_key`` the manifest carries its ``signature`` (module docstring). ``between`` (a caller's stop check)
    is called between the units of the build (the scorer saved, each file written, each file hashed): what it raises
    ends the build, its staged directory removed.
    """
    between = between or (lambda: None)
    if format not in FORMATS:
        raise ArtifactError(f"unknown artifact format {format!r}; expected one of {', '.join(FORMATS)}")
    t0 = time.monotonic()
    root = Path(out_dir)
    cfg = check_checkpoint(checkpoint)
    meta = checkpoint["meta"]
    ms = meta["model"]
    spec = ScorerSpec(cfg.num_fields, cfg.embedding_dim, len(cfg.dense), parse_mlp(ms["mlp"]),
                      float(ms.get("dropout", 0.0)),
                      POOLING_GRAPH_LAYOUT if format in ONNX_FORMATS else USER_ROW_LAYOUT)
    state = checkpoint["model"]
    table = state["sparse.bag.weight"].detach().float().cpu().contiguous()  # (num_rows, D + 1)
    if tuple(table.shape) != (cfg.num_rows, cfg.embedding_dim + 1):
        raise ArtifactError(f"checkpoint {checkpoint.get('path')}: table shape {tuple(table.shape)} does not match "
                            f"its feature config ({cfg.num_rows}, {cfg.embedding_dim + 1})")
    try:
        hot_ids, hot_vectors = hot_buffers(table, hot_rows)
    except ValueError as exc:
        raise ArtifactError(str(exc)) from None
    scorer = Scorer(spec, hot_ids, hot_vectors)
    scorer.load_state_dict({**_dense_state(state), "hot_ids": hot_ids, "hot_vectors": hot_vectors})
    scorer.eval()
    between()

    version = version or new_version_name(root=root)  # after every version already in root
    if not is_version_name(version):
        raise ArtifactError(f"version {version!r} is not a plain version name (letters, digits, . _ -)")
    staged = root / STAGING / f"{version}-{os.getpid()}"
    staged.mkdir(parents=True, exist_ok=False)
    try:
        scorer_file = SCORER_FILES[format]
        save_scorer(scorer, format, staged / scorer_file, spec, cfg)
        between()
        write_synced(staged / COLD_FILE, lambda fh: np.save(fh, table.numpy(), allow_pickle=False))
        between()
        names = [scorer_file, *SCORER_EXTRA_FILES.get(format, ()), COLD_FILE]
        if checkpoint.get("id_maps"):  # dynamic ids: serving maps raw ids to the rows the learner used
            if format in PICKLE_FREE_FORMATS:  # nothing of a safetensors (or onnx) artifact is a pickle
                data = pack(checkpoint["id_maps"])
                write_synced(staged / ID_MAPS_PACK, lambda fh: fh.write(data))
                names.append(ID_MAPS_PACK)
            else:
                write_synced(staged / ID_MAPS_FILE, lambda fh: torch.save(checkpoint["id_maps"], fh))
                names.append(ID_MAPS_FILE)
        files = {}
        for name in names:
            between()
            p = staged / name
            files[name] = {"sha256": sha256_file(p), "bytes": p.stat().st_size}
        between()
        h = len(hot_ids) - 1
        manifest = {
            "artifact_format_version": ARTIFACT_FORMAT_VERSION,
            "version": version,
            "created": time.time(),
            "created_utc": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "format": format,
            "source": {"checkpoint": checkpoint.get("path"), "samples_trained": meta.get("samples_trained"),
                       "lineage": meta.get("lineage"), "offsets": meta.get("offsets", {}), "topic": meta.get("topic"),
                       "metrics": meta.get("metrics", {}), "delta_seq": meta.get("delta_seq"),
                       "created": meta.get("created")},  # when the training state was saved: the model's age
            "feature_config": cfg.to_dict(),
            "model": {k: (v if isinstance(v, (int, float, str, bool, type(None))) else str(v)) for k, v in ms.items()},
            "scorer": spec.to_dict(),
            "hot_set": {**(hot_stats or {}), "rows": h, "share_of_table": h / max(1, cfg.num_rows),
                        "bytes": int(hot_vectors.numel() * 4)},
            "files": files,
            "build_seconds": round(time.monotonic() - t0, 3),
        }
        manifest = finite_json(manifest)  # strict JSON: a checkpoint's NaN AUC is null
        text = json.dumps(manifest, indent=2, sort_keys=True, allow_nan=False)
        if signing_key is not None:  # sign what a reader parses back (JSON turns int keys into strings, ...)
            manifest = json.loads(text)
            manifest[SIGNATURE] = signing_key.sign(canonical_manifest(manifest))
            text = json.dumps(manifest, indent=2, sort_keys=True)
        write_synced(staged / MANIFEST, lambda fh: fh.write(text.encode()))
        fsync_dir(staged)
    except BaseException:
        shutil.rmtree(staged, ignore_errors=True)
        raise
    return staged


# -- reading a publish root -----------------------------------------------------------------------
def _read_regular(path: Path, limit: int) -> bytes:
    """At most ``limit + 1`` bytes of ``path`` (so a caller notices a longer file without reading it whole).

    ``CURRENT``, ``PINNED`` and manifests are read on serving's updater thread (and at its start): a FIFO put in
    their place blocked that thread for good (no swap, no delta, a service that never started) and a symlink to
    ``/dev/zero`` never ended. So they are opened with :func:`stream.files.open_regular`: anything but a regular file
    is its :class:`~stream.files.NotRegularFile`, an OSError as ``open`` raises (FileNotFoundError, ...), which the
    callers report as an unreadable file."""
    with open_regular(path) as (fh, _):
        chunks, n = [], 0
        while n <= limit and (chunk := fh.read(limit + 1 - n)):
            chunks.append(chunk)
            n += len(chunk)
        return b"".join(chunks)


def versions_dir(root: Path) -> Path:
    """``<root>/versions``."""
    return Path(root) / VERSIONS


def _resolve_inside(path: Path, parent: Path, what: str) -> Path:
    """``path`` with every symlink resolved; ArtifactError unless that is an entry directly inside ``parent``
    (resolved too: a publish root that is itself a symlink is fine)."""
    try:
        target, home = Path(path).resolve(), Path(parent).resolve()
    except (OSError, RuntimeError) as exc:  # a symlink loop
        raise ArtifactError(f"{path} cannot be resolved ({exc}): {what}; refused") from None
    if target.parent != home:
        raise ArtifactError(f"{path} resolves to {target}, outside {home} (a symlink or a path leaving it): {what}; "
                            "refused. Publish with `streamrec refresh --now`, which writes plain directories and files")
    return target


def _check_version_dir(version_dir: Path) -> Path:
    """``version_dir`` as an absolute path; ArtifactError when it resolves outside the directory holding it."""
    version_dir = Path(os.path.abspath(version_dir))
    _resolve_inside(version_dir, version_dir.parent, f"a version directory must lie in {version_dir.parent}")
    return version_dir


def list_versions(root: Path) -> list[str]:
    """Published versions, oldest first: the entries of ``versions/`` with a version name that are directories
    inside it (hidden entries, other names and symlinks resolving elsewhere are left out)."""
    d = versions_dir(root)
    if not d.is_dir():
        return []
    home = d.resolve()
    out = []
    for p in d.iterdir():
        if p.name.startswith(".") or not is_version_name(p.name):
            continue
        try:
            if p.is_dir() and p.resolve().parent == home:
                out.append(p.name)
        except (OSError, RuntimeError):  # a symlink loop, or gone meanwhile
            continue
    return sorted(out)


def version_path(root: Path, name: str) -> Path:
    """``<root>/versions/<name>``, checked: ArtifactError when ``name`` is not a version name or the entry
    resolves outside ``<root>/versions`` (a symlink). It need not exist."""
    if not (isinstance(name, str) and is_version_name(name)):
        raise ArtifactError(f"{_show(name)} is not a version name (letters, digits, . _ -): refused")
    path = versions_dir(root) / name
    _resolve_inside(path, versions_dir(root), f"a version must be a directory in {versions_dir(root)}")
    return path


def current_version(root: Path) -> str | None:
    """The name in ``CURRENT``; None when nothing was published. ArtifactError when it names no valid version."""
    path = Path(root) / CURRENT
    try:
        raw = _read_regular(path, _MAX_POINTER)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise ArtifactError(f"{path} cannot be read ({exc}); check the publish root's permissions") from None
    try:
        name = raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        name = None
    if name == "":
        return None
    if name is None or len(raw) > _MAX_POINTER or not _NAME_RE.fullmatch(name):
        raise ArtifactError(f"{path} holds {_show(raw[:60])}, not a version name: it was not written by "
                            "`streamrec refresh`; publish again with `streamrec refresh --now` or write a version "
                            f"from {versions_dir(root)} into it")
    return name


def read_current(root: Path) -> Path | None:
    """The current version's directory, or None when nothing was published (or it is gone).

    ArtifactError when ``CURRENT`` holds something that is not a version name, or names an entry that
    resolves outside ``<root>/versions`` (:func:`version_path`)."""
    name = current_version(root)
    if name is None:
        return None
    path = versions_dir(root) / name
    return version_path(root, name) if path.is_dir() else None


@dataclass(frozen=True)
class Pin:
    """``<root>/PINNED``: the version a rollback returned to; serving applies no deltas to it
    (``cache_refresh/publish.py`` explains the pin)."""

    version: str | None  # None: the pin file is unreadable; it then pins whatever is live (fail closed)
    rolled_back_from: str | None
    at: float | None
    problem: str | None = None

    def holds(self, version: str) -> bool:
        return self.version is None or self.version == version


def read_pin(root: Path) -> Pin | None:
    """The rollback pin, None when there is none. An unreadable pin is a Pin with ``problem`` set."""
    path = Path(root) / PIN
    try:
        raw = _read_regular(path, _MAX_POINTER)
    except FileNotFoundError:
        return None
    except OSError as exc:  # (not a regular file too: unreadable, so it pins whatever is live: fail closed)
        return Pin(None, None, None, f"{path} cannot be read ({exc})")
    why = ""
    try:
        d = json.loads(raw.decode("utf-8"))
        reject_duplicate_keys(raw, count_keys(d))  # two versions in one pin: which one holds is not ours to guess
    except BadMessage as exc:
        d, why = None, f" ({exc})"
    except (UnicodeDecodeError, ValueError, RecursionError):
        d = None
    ok = (isinstance(d, dict) and isinstance(d.get("version"), str) and _NAME_RE.fullmatch(d["version"])
          and (d.get("rolled_back_from") is None
               or (isinstance(d["rolled_back_from"], str) and _NAME_RE.fullmatch(d["rolled_back_from"])))
          and (d.get("at") is None or _num(d["at"])))
    if not ok or len(raw) > _MAX_POINTER:
        return Pin(None, None, None, f"{path} holds {_show(raw[:60])}, not a rollback pin{why}; deltas stay paused "
                   "and scheduled refreshes do not publish until an operator publishes (`streamrec refresh --now`)")
    return Pin(d["version"], d.get("rolled_back_from"), d.get("at"))


def pin_holding(root: Path) -> Pin | None:
    """The rollback pin that holds the live version now (or an unreadable pin, which holds whatever is
    live), else None (no pin, or a stale one naming another version than ``CURRENT``)."""
    pin = read_pin(root)
    if pin is None:
        return None
    if pin.problem is not None:
        return pin
    try:
        current = current_version(root)
    except ArtifactError:
        return pin  # CURRENT unreadable: fail closed, as serving does with an unreadable pin
    return pin if current is not None and pin.holds(current) else None


def read_manifest(version_dir: Path, signing_key: SigningKey | None = None) -> dict[str, Any]:
    """The checked manifest of ``version_dir`` (:func:`decode_manifest`, with ``signing_key`` its signature
    first); ArtifactError if missing or bad, or when the directory or the manifest is a symlink leaving the
    directory that holds it."""
    version_dir = _check_version_dir(version_dir)
    path = version_dir / MANIFEST
    _resolve_inside(path, version_dir, "the manifest must be a file of its version directory")
    try:
        raw = _read_regular(path, _MAX_MANIFEST)
        if len(raw) > _MAX_MANIFEST:
            raise ArtifactError(f"{path} has more than a manifest's {_MAX_MANIFEST} bytes: the artifact is corrupt")
    except FileNotFoundError:
        raise ArtifactError(f"{path} is missing: {version_dir} is not a complete artifact") from None
    except OSError as exc:  # (a directory, a FIFO: _read_regular's ArtifactError)
        raise ArtifactError(f"{path} cannot be read ({exc}); check the publish root's permissions") from None
    return decode_manifest(raw, path, signing_key)


class ArtifactFiles:
    """The files a manifest lists, each opened once (:func:`open_artifact`): ``files[name]`` is that open file, at its
    start, the one its checks (and digest) were made on, so what is loaded from it is what was verified. Close it (a
    ``with`` block) once loaded: a memory map of one (:func:`map_table`) stays valid."""

    def __init__(self, version_dir: Path, manifest: dict[str, Any], opened: dict[str, BinaryIO]) -> None:
        self.version_dir, self.manifest, self._opened = version_dir, manifest, opened

    def __contains__(self, name: object) -> bool:
        return name in self._opened

    def __getitem__(self, name: str) -> BinaryIO:
        fh = self._opened[name]
        fh.seek(0)
        return fh

    def path(self, name: str) -> Path:
        """Where ``name`` was opened (for messages: the file loaded is the open one, never this path again)."""
        return self.version_dir / name

    def close(self) -> None:
        for fh in self._opened.values():
            fh.close()

    def __enter__(self) -> ArtifactFiles:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_REPUBLISH = "republish with `streamrec refresh --now` or roll back"


def _open_dir(version_dir: Path) -> int:
    """A descriptor of ``version_dir``, checked to be the directory its path resolves to inside the directory holding
    it (:func:`_resolve_inside`), so the files opened relative to it are entries of that directory."""
    try:
        fd = os.open(version_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        raise ArtifactError(f"{version_dir} cannot be opened as a version directory ({exc})") from None
    try:
        target = _resolve_inside(version_dir, version_dir.parent, f"a version directory must lie in "
                                                                  f"{version_dir.parent}")
        st, here = os.fstat(fd), os.stat(target)
        if (st.st_dev, st.st_ino) != (here.st_dev, here.st_ino):
            raise ArtifactError(f"{version_dir} was replaced while it was opened: refused; {_REPUBLISH}")
    except BaseException:
        os.close(fd)
        raise
    return fd


def _check_sha256(path: Path | str, got: str, want: str) -> None:
    if got != want:
        raise ArtifactError(f"{path}: sha256 {got[:16]}... does not match the manifest's {want[:16]}...: the file is "
                            f"corrupt; {_REPUBLISH}")


def _open_listed(dir_fd: int, path: Path, want: Mapping[str, Any], digest: bool, hash_now: bool = True) -> BinaryIO:
    """``path`` (a listed file) opened once relative to its directory's descriptor, not following a symlink, and
    checked on that descriptor: a regular file (a FIFO hung every loader's blocking open; ``/dev/zero`` was read
    without end), not a hard link (another path could change it after its check, before its load: the refresh writes
    every file afresh; copy a publish root, never ``cp -al``), and with ``digest`` the manifest's size and (unless not
    ``hash_now``: the loader hashes what it reads) sha256 read from it."""
    try:
        fd = open_entry(dir_fd, path.name)
    except FileNotFoundError:
        raise ArtifactError(f"{path} is missing (listed in the manifest): the artifact is incomplete") from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise ArtifactError(f"{path} is a symlink: artifact files are read only as plain files of their "
                                f"version directory; refused unread; {_REPUBLISH}") from None
        raise ArtifactError(f"{path} cannot be read ({exc}); check the publish root's permissions") from None
    fh = open(fd, "rb", closefd=True)  # noqa: SIM115 - the caller's (ArtifactFiles) to close
    fh.raw.name = str(path)  # type: ignore[attr-defined]  # (its name in loaders' messages: the path, not the fd)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ArtifactError(f"{path} is not a regular file (mode {stat.filemode(st.st_mode)}): refused unread; "
                                f"{_REPUBLISH}")
        if st.st_nlink > 1:
            raise ArtifactError(f"{path} is a hard link ({st.st_nlink} names): another path could change it after "
                                "its check, before it is loaded; refused unread. Copy a publish root, never "
                                f"hard-link it; {_REPUBLISH}")
        os.set_blocking(fd, True)
        if digest:
            if st.st_size != want["bytes"]:
                raise ArtifactError(f"{path} has {st.st_size} bytes, the manifest says {want['bytes']}: the file is "
                                    f"truncated or was replaced; {_REPUBLISH}")
        if digest and hash_now:
            try:
                got = sha256_file(fh)
            except OSError as exc:
                raise ArtifactError(f"{path} cannot be read ({exc}); check the publish root's permissions") from None
            _check_sha256(path, got, want["sha256"])
    except BaseException:
        fh.close()
        raise
    return fh


def open_artifact(version_dir: Path, manifest: dict[str, Any] | None = None, signing_key: SigningKey | None = None,
                  digests: bool = True, hashed_on_read: Collection[str] = ()) -> ArtifactFiles:
    """Every file ``manifest`` lists (read, with ``signing_key`` its signature checked first, when not given), each
    opened once and checked on the open file (:func:`_open_listed`; with ``digests`` its size and sha256 too), as
    :class:`ArtifactFiles`: the loader reads those open files, so a file renamed over a listed one after its check is
    never what is loaded. ArtifactError for a version directory or a file that is a symlink or a path resolving outside
    where it belongs (module docstring; a symlink inside the version directory is refused too: every file is opened
    without following one), missing, not a regular file, a hard link, or (``digests``) of another size or digest.

    ``hashed_on_read``: names whose sha256 the loader takes from the very bytes it reads (:func:`read_table` given the
    manifest's digest) instead of here, so that bytes rewritten in place between a check and the read are never what is
    loaded; their size is checked here all the same."""
    version_dir = _check_version_dir(version_dir)
    if manifest is None:  # (the one-argument call without a key: tests wrap read_manifest)
        manifest = read_manifest(version_dir) if signing_key is None else read_manifest(version_dir, signing_key)
    elif signing_key is not None:
        check_signature(manifest, signing_key, version_dir / MANIFEST)
    dir_fd = _open_dir(version_dir)
    opened: dict[str, BinaryIO] = {}
    try:
        for name, want in manifest["files"].items():
            path = version_dir / name
            _resolve_inside(path, version_dir, "artifact files must be files of their version directory")
            opened[name] = _open_listed(dir_fd, path, want, digests, hash_now=name not in hashed_on_read)
    except BaseException:
        for fh in opened.values():
            fh.close()
        raise
    finally:
        os.close(dir_fd)
    return ArtifactFiles(version_dir, manifest, opened)


def verify(version_dir: Path, manifest: dict[str, Any] | None = None,
           signing_key: SigningKey | None = None) -> dict[str, Any]:
    """Check every file's size and sha256 against the manifest (read and, with ``signing_key``, its signature
    checked first when not given); returns the manifest. ArtifactError as :func:`open_artifact` (which a loader
    calls instead, to load the files it checked)."""
    with open_artifact(version_dir, manifest, signing_key) as files:
        return files.manifest


def _table_header(fh: BinaryIO) -> tuple[tuple[int, ...], bool, np.dtype, int]:
    """(shape, fortran order, dtype, offset of the first value) of the ``.npy`` in ``fh``. ValueError for a file that
    is not an ``.npy`` of plain values (no pickles)."""
    fh.seek(0)
    version = np.lib.format.read_magic(fh)
    if version == (1, 0):
        shape, fortran, dtype = np.lib.format.read_array_header_1_0(fh)
    elif version == (2, 0):
        shape, fortran, dtype = np.lib.format.read_array_header_2_0(fh)
    else:
        raise ValueError(f".npy format version {version}, expected 1.0 or 2.0")
    if dtype.hasobject:
        raise ValueError(f"an .npy of {dtype} holds Python objects (pickles): refused")
    return shape, fortran, dtype, fh.tell()


def map_table(fh: BinaryIO) -> np.memmap:
    """The ``.npy`` table in the open file ``fh`` (``COLD_FILE``), memory-mapped read-only from that file (not copied,
    not opened again by path). ValueError for a file that is not an ``.npy`` of plain values (no pickles).

    A map reads the file as it is now: a row read after the file was truncated in place kills the process (SIGBUS),
    and bytes rewritten in place are read unverified. For loads that only read the table once (the layered mode's
    bucket rows, a refresh writing Redis); a table read per request is :func:`read_table`'s copy."""
    shape, fortran, dtype, offset = _table_header(fh)
    return np.memmap(fh, dtype=dtype, mode="r", shape=shape, order="F" if fortran else "C", offset=offset)


def read_table(fh: BinaryIO, sha256: str | None = None) -> np.ndarray:
    """The ``.npy`` table in the open file ``fh`` (``COLD_FILE``), read into this process's memory (read-only), so
    that nothing done to the file afterwards (truncated or rewritten in place) reaches what serving reads per
    request. ValueError as :func:`map_table`, and for a file shorter than its header says (naming both sizes).

    ``sha256``: the manifest's digest of the file, checked on the bytes read (the header, the table as copied, any
    bytes past it): an ArtifactError when they differ (``open_artifact(hashed_on_read=...)``). One read of the file
    instead of a hash pass and a copy pass, and no moment between the check and the read. A file refused for what its
    bytes say (its header, its size) before that is refused for its digest when that does not match: a header damaged
    in place was otherwise reported as a truncated file, the manifest's digest never named."""
    try:
        shape, fortran, dtype, offset = _table_header(fh)
        want = offset + math.prod(shape) * dtype.itemsize
        if (size := os.fstat(fh.fileno()).st_size) < want:  # before allocating what a header claims
            _short_table(fh, size, want, shape, dtype)
        table = np.empty(shape, dtype, order="F" if fortran else "C")
        into: Any = (table.T if fortran else table).reshape(-1).view(np.uint8)  # (bytes,) a view: the table, file order
        got = 0
        while got < len(into) and (n := os.preadv(fh.fileno(), [into[got:]], offset + got)):
            got += n
        if got < len(into):  # truncated while it was read
            _short_table(fh, offset + got, want, shape, dtype)
    except ValueError:
        if sha256 is not None:  # the whole file hashed (this error path only): not the manifest's, said so
            _check_sha256(getattr(fh, "name", COLD_FILE), _digest_around(fh.fileno(), 0, b""), sha256)
        raise
    if sha256 is not None:
        _check_sha256(getattr(fh, "name", COLD_FILE), _digest_around(fh.fileno(), offset, into), sha256)
    table.flags.writeable = False
    return table


def _digest_around(fd: int, offset: int, body: Any) -> str:
    """The sha256 of the file ``fd`` whose bytes ``offset`` .. ``offset + len(body)`` were read into ``body``: its
    header read again, ``body`` itself (the bytes loaded), then whatever follows it in the file."""
    h = hashlib.sha256(os.pread(fd, offset, 0))
    h.update(body)
    at = offset + len(body)
    while chunk := os.pread(fd, 8 << 20, at):
        h.update(chunk)
        at += len(chunk)
    return h.hexdigest()


def _short_table(fh: BinaryIO, size: int, want: int, shape: tuple[int, ...], dtype: np.dtype) -> None:
    raise ValueError(f"{getattr(fh, 'name', COLD_FILE)} holds {size} bytes, its .npy header says {want} ({shape} "
                     f"{dtype}): the file is truncated; {_REPUBLISH}")


def read_id_maps(files: ArtifactFiles) -> dict[str, Any] | None:
    """The id maps the manifest lists (``id_maps.pack``: a tensorpack, nothing unpickled; ``id_maps.pt``: a
    weights-only ``torch.load``), read from the files :func:`open_artifact` opened (and checked), or None when it
    lists none. ArtifactError when the file does not load or holds no object."""
    if ID_MAPS_PACK in files:
        path = files.path(ID_MAPS_PACK)
        try:
            state = unpack(files[ID_MAPS_PACK].read())
        except (PackError, OSError) as exc:
            raise ArtifactError(f"{path}: cannot load the id maps ({exc})") from None
    elif ID_MAPS_FILE in files:
        path = files.path(ID_MAPS_FILE)
        try:
            state = torch.load(files[ID_MAPS_FILE], map_location="cpu", weights_only=True)
        except Exception as exc:  # noqa: BLE001 - unpickling errors, torn zips, I/O: a bad artifact
            raise ArtifactError(f"{path}: cannot load the id maps ({type(exc).__name__}: {str(exc)[:300]})") from None
    else:
        return None
    if not isinstance(state, dict):
        raise ArtifactError(f"{path}: holds a {type(state).__name__}, expected the id maps object")
    return state
