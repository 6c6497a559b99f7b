"""The serving artifact: what ``cache_refresh`` publishes and ``serving`` loads. The one data type they share.

Layout under a publish root::

    <root>/CURRENT                       the current version's name (replaced atomically)
    <root>/versions/<version>/
        manifest.json                    version, created, source checkpoint (path, samples_trained,
                                         offsets), feature_config, model settings, hot-set stats,
                                         format, scorer settings, files {name: {sha256, bytes}}
        scorer.pt | scorer.pt2 | scorer_state.pt   the scorer (torchscript | export | eager)
        cold_rows.npy                    float32 (num_rows, D + 1): the whole fused table, memory-mapped
    <root>/.staging/<version>-<pid>/     an artifact being built; never read by serving

The scorer is DeepFM's dense half (bias + first order + FM + MLP) plus the HOT rows of the fused
embedding table as buffers (``hot_ids`` sorted (H + 1,) with a sentinel, ``hot_vectors`` (H + 1, D + 1)),
placed on the scoring device (the GPU when there is one). Rows that are not hot are gathered by
:class:`ScoringModel` from the memory-mapped ``cold_rows.npy`` and handed in::

    Scorer.forward(values (N,) int64 global rows, offsets (F*B + 1,) int64 field-major bags,
                   dense (B, Dd) float32, given_rows (N, D + 1) float32, given_mask (N,) bool) -> (B,) probs

``given_mask[i]`` says "use ``given_rows[i]``" (a cold row or a delta override); otherwise the row is
looked up among the hot rows with a vectorized ``searchsorted``. Pooling is ``F.embedding_bag`` (mean)
over the gathered vectors, so bags are pooled exactly as the learner's fused ``nn.EmbeddingBag`` pools
them. The same ``Scorer`` class is stored three ways behind one interface:

* ``torchscript`` (default; the format the user asked for) - ``torch.jit.script`` + ``torch.jit.save``;
* ``export`` - ``torch.export.export`` with dynamic N and B, ``torch.export.save`` (the forward-looking
  format: TorchScript is deprecated in torch 2.13);
* ``eager`` - a state dict, rebuilt into a plain ``nn.Module`` (the baseline ``bench/serving.py`` compares).

Scoring runs in fp32. The learner's forward may run its dense part under bf16 autocast; the reference
the artifact must equal (``cache_refresh/validate.py``) is the learner's eager DeepFM in fp32, which it
matches to ~1e-7 on probabilities (tests/test_artifact.py).

Publishing: an artifact is staged in ``<root>/.staging/``, fsynced, verified (every file against the
manifest), renamed into ``versions/`` (same file system, so the rename is atomic) and only then named in
``CURRENT`` (temp file, fsync, ``os.replace``, fsync of the directory). A crash at any point leaves
``CURRENT`` naming a complete version (tested with SIGKILLs at every step, ``tests/test_faults_serving.py``).
A ``CURRENT`` that cannot be written (full or read-only file system) takes the new version back out of
``versions/``: nothing half-published stays. The last ``keep`` versions (and always the current one)
are kept; a pruned version is renamed to a hidden ``versions/.trash-*`` before it is deleted, so a
killed prune never leaves a half-deleted version behind. A refresh holds :func:`refresh_lock` for its
run (one refresh per root at a time) and first removes what killed runs left (:func:`clean_leftovers`:
staged directories of dead processes, trash, temp files); serving never reads any of them.

Rollback and the pin: :func:`rollback` verifies the older version, writes ``<root>/PINNED`` (JSON
``{"version", "rolled_back_from", "at"}``) and then points ``CURRENT`` at it. While ``PINNED`` names the
live version, serving applies no learner deltas to it: the learner kept training past the newer
artifact, so every delta it writes belongs to the model the operator just rolled away from (its dense
weights would bring that model back). The pin is the operator's decision, so only an operator ends it:
``publish(over_pin=True)`` (``streamrec refresh --now``) removes it; ``publish(over_pin=False)`` (the
scheduled refresh) raises :class:`PinHeld` and changes nothing. A pin naming another version than
``CURRENT`` (a crash between the two writes) is stale and ignored; an unreadable pin is treated as a pin
(fail closed: the model is staler, never the wrong one).

Errors: :class:`ArtifactError` for every artifact that cannot be used (missing, truncated or altered
files; a manifest that is not UTF-8, not JSON, not an object, lacks a key or has a key of the wrong type
or value; a ``CURRENT`` that names no valid version; a scorer that does not load or score); the message
names the file, what was wrong and what to do. No other exception escapes :func:`decode_manifest`,
:func:`read_current`, :func:`read_pin` or :meth:`ScoringModel.load` for a damaged artifact.
"""

from __future__ import annotations

import contextlib
import copy
import datetime as dt
import errno
import fcntl
import hashlib
import json
import logging
import math
import os
import re
import shutil
import threading
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from learner.checkpoint import fsync_dir, write_synced
from learner.features import FeatureConfig, FieldSpec
from learner.model import DeepFM, DenseArch, FMInteraction
from learner.row_mapper import RowMapper

ARTIFACT_FORMAT_VERSION = 1
FORMATS = ("torchscript", "export", "eager")
SCORER_FILES = {"torchscript": "scorer.pt", "export": "scorer.pt2", "eager": "scorer_state.pt"}
COLD_FILE = "cold_rows.npy"
ID_MAPS_FILE = "id_maps.pt"  # dynamic ids only: the learner's id maps (learner/row_mapper.py)
MANIFEST = "manifest.json"
CURRENT = "CURRENT"
PIN = "PINNED"
VERSIONS = "versions"
STAGING = ".staging"
LOCK = ".refresh.lock"
_TRASH = ".trash-"  # versions/.trash-<version>-<pid>: a pruned version being removed (list_versions skips it)
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")  # version and file names: no path separators
_SHA_RE = re.compile(r"[0-9a-f]{64}")
_MAX_MANIFEST = 16 << 20
_MAX_POINTER = 4096
_SENTINEL = torch.iinfo(torch.int64).max  # a row id no table reaches: keeps searchsorted in bounds
_STALE_STAGING_S = 3600.0
_HASH_CHUNK = 8 << 20


log = logging.getLogger("streamrec.artifact")


class ArtifactError(Exception):
    """An artifact that cannot be used: missing, truncated or altered files, or an unreadable manifest."""


class PinHeld(ArtifactError):
    """``publish(..., over_pin=False)`` found a rollback pin holding the live version; nothing changed."""

    def __init__(self, message: str, pin: Pin) -> None:
        super().__init__(message)
        self.pin = pin


# -- TorchScript deprecation warnings ------------------------------------------------------------
@contextlib.contextmanager
def _quiet_torchscript() -> Iterator[None]:
    """Silence exactly torch 2.13's "`torch.jit.<fn>` is deprecated" warnings around our own calls.

    They repeat on every script/save/load and carry no news for an operator (the export format is the
    migration path, documented above); every other warning still shows. Only used around build/load,
    never around scoring (``warnings.catch_warnings`` is process-wide while it is active).
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"`torch\.jit\.\w+` is deprecated", category=DeprecationWarning)
        yield


# -- the scorer ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class ScorerSpec:
    """What it takes to rebuild a Scorer (stored in the manifest)."""

    num_fields: int
    dim: int
    num_dense: int
    mlp: tuple[int, ...]
    dropout: float

    def to_dict(self) -> dict[str, Any]:
        return {"num_fields": self.num_fields, "dim": self.dim, "num_dense": self.num_dense,
                "mlp": list(self.mlp), "dropout": self.dropout}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ScorerSpec:
        return cls(int(d["num_fields"]), int(d["dim"]), int(d["num_dense"]), tuple(int(x) for x in d["mlp"]),
                   float(d["dropout"]))


class Scorer(nn.Module):
    """DeepFM's dense half + the hot rows. Parameter names match DeepFM's (``dense_arch.*``, ``bias``)."""

    def __init__(self, spec: ScorerSpec, hot_ids: torch.Tensor, hot_vectors: torch.Tensor) -> None:
        super().__init__()
        self.num_fields, self.dim = spec.num_fields, spec.dim
        self.fm = FMInteraction()
        self.dense_arch = DenseArch(spec.num_fields * spec.dim + spec.num_dense, spec.mlp, spec.dropout)
        self.bias = nn.Parameter(torch.zeros(1))
        self.register_buffer("hot_ids", hot_ids)  # (H + 1,) int64 sorted, last = sentinel
        self.register_buffer("hot_vectors", hot_vectors)  # (H + 1, D + 1) float32, last = zeros

    def forward(self, values: torch.Tensor, offsets: torch.Tensor, dense: torch.Tensor,
                given_rows: torch.Tensor, given_mask: torch.Tensor) -> torch.Tensor:
        pos = torch.searchsorted(self.hot_ids, values)  # (N,) in [0, H]: the sentinel keeps it in range
        hot = self.hot_vectors[pos]  # (N, D + 1)
        vectors = torch.where(given_mask.unsqueeze(1), given_rows, hot)  # (N, D + 1)
        index = torch.ones_like(values).cumsum(0) - 1  # arange(N) on values' device (no device constant)
        pooled = F.embedding_bag(index, vectors, offsets, mode="mean", include_last_offset=True)  # (F*B, D+1)
        pooled = pooled.view(self.num_fields, -1, self.dim + 1).transpose(0, 1)  # (B, F, D + 1)
        emb, first = pooled[:, :, : self.dim], pooled[:, :, self.dim]  # (B, F, D), (B, F)
        x = torch.cat([emb.flatten(1), dense], dim=1)  # (B, F*D + Dd)
        logits = self.bias + first.sum(dim=1) + self.fm(emb) + self.dense_arch(x)  # (B,)
        return torch.sigmoid(logits)


def _hot_buffers(table: torch.Tensor, hot_rows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    rows = np.unique(np.asarray(hot_rows, dtype=np.int64))  # sorted, unique
    if len(rows) and (rows[0] < 0 or rows[-1] >= table.shape[0]):
        raise ArtifactError(f"hot rows must lie in [0, {table.shape[0]}), got [{rows[0]}, {rows[-1]}]")
    ids = torch.from_numpy(np.append(rows, _SENTINEL))  # (H + 1,)
    vectors = torch.cat([table[torch.from_numpy(rows)], torch.zeros(1, table.shape[1])])  # (H + 1, D + 1)
    return ids, vectors.contiguous()


# -- eager reference and model settings -----------------------------------------------------------
def parse_mlp(mlp: Any) -> tuple[int, ...]:
    """The learner stores ``mlp`` as ``"400,400,400"``; a list or tuple is accepted as well."""
    if isinstance(mlp, (list, tuple)):
        return tuple(int(x) for x in mlp)
    return tuple(int(x) for x in re.findall(r"\d+", str(mlp)))


def eager_model(checkpoint: dict[str, Any]) -> DeepFM:
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
    samples = src.get("samples_trained")
    if samples is not None and not (_int(samples) and samples >= 0):
        raise bad(f"source.samples_trained is {_show(samples)}, expected an integer >= 0 or null")
    for key in ("checkpoint", "lineage", "topic"):
        if src.get(key) is not None and not isinstance(src[key], str):
            raise bad(f"source.{key} is {_show(src[key])}, expected a string or null")
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
    for needed in (SCORER_FILES[fmt], COLD_FILE):
        if needed not in files:
            raise bad(f"files does not list {needed}, which a {fmt} artifact reads")


def decode_manifest(raw: bytes, where: str | Path = MANIFEST) -> dict[str, Any]:
    """The manifest in ``raw`` (the bytes of ``manifest.json``), every key this code reads checked.

    Raises :class:`ArtifactError` naming the problem for any other bytes: not UTF-8, not JSON, not an
    object, another ``artifact_format_version``, a missing key, a key of the wrong type or value, a file
    name with a path in it, a feature config or scorer spec that does not hold together. Extra keys are
    allowed (newer writers may add some).
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
    except (ValueError, RecursionError) as exc:
        raise bad(f"not valid JSON ({str(exc)[:120]})") from None
    if not isinstance(m, dict):
        raise bad(f"holds {_show(m)}, expected a JSON object")
    afv = m.get("artifact_format_version")
    if not _int(afv) or afv != ARTIFACT_FORMAT_VERSION:
        raise ArtifactError(f"{where}: artifact format {_show(afv)}, this streamrec reads {ARTIFACT_FORMAT_VERSION}; "
                            "rebuild it with `streamrec refresh --now`")
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
    where = f"checkpoint {checkpoint.get('path') if isinstance(checkpoint, dict) else None}"
    if not isinstance(checkpoint, dict) or not isinstance(checkpoint.get("meta"), dict):
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
    state = checkpoint.get("model")
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ArtifactError(f"{where}: model is not a state dict of tensors")
    table = state.get("sparse.bag.weight")
    want = (cfg.num_rows, cfg.embedding_dim + 1)
    if table is None or tuple(table.shape) != want:
        raise ArtifactError(f"{where}: table shape {None if table is None else tuple(table.shape)} does not match "
                            f"its feature config {want}")
    for k, v in state.items():
        if v.is_floating_point() and v.numel() and not bool(torch.isfinite(v).all()):
            raise ArtifactError(f"{where}: weight {k!r} holds {int((~torch.isfinite(v)).sum())} non-finite values: "
                                "the learner diverged; this checkpoint is not published (the live artifact keeps "
                                "serving); fix the learner or refresh from an earlier checkpoint")
    return cfg


# -- files ---------------------------------------------------------------------------------------
def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(_HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _write_atomic(path: Path, data: bytes) -> None:
    """Temp file, fsync, ``os.replace``, fsync of the directory. On failure ``path`` is as it was and the
    temp file is removed (best effort: a process killed in between leaves it for :func:`clean_leftovers`)."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{threading.get_ident()}")
    try:
        write_synced(tmp, lambda fh: fh.write(data))
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)


def new_version_name(now: float | None = None) -> str:
    """``YYYYMMDDTHHMMSSmmmZ``: UTC, sorts in time order."""
    t = dt.datetime.fromtimestamp(time.time() if now is None else now, tz=dt.timezone.utc)
    return t.strftime("%Y%m%dT%H%M%S") + f"{t.microsecond // 1000:03d}Z"


def _export_inputs(spec: ScorerSpec, cfg: FeatureConfig) -> tuple[torch.Tensor, ...]:
    b, n = 3, 3 * spec.num_fields + 2
    lengths = torch.ones(spec.num_fields * b, dtype=torch.int64)
    lengths[0] = 3
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    values = torch.randint(0, cfg.num_rows, (n,), dtype=torch.int64)
    return (values, offsets, torch.zeros(b, spec.num_dense), torch.zeros(n, spec.dim + 1),
            torch.zeros(n, dtype=torch.bool))


def _save_scorer(scorer: Scorer, fmt: str, path: Path, spec: ScorerSpec, cfg: FeatureConfig) -> None:
    if fmt == "torchscript":
        with _quiet_torchscript():
            scripted = torch.jit.script(scorer)
            write_synced(path, lambda fh: torch.jit.save(scripted, fh))
    elif fmt == "export":
        n, b = torch.export.Dim("n", min=1), torch.export.Dim("b", min=1)
        dynamic = ({0: n}, {0: spec.num_fields * b + 1}, {0: b}, {0: n}, {0: n})
        ep = torch.export.export(scorer, _export_inputs(spec, cfg), dynamic_shapes=dynamic)
        write_synced(path, lambda fh: torch.export.save(ep, fh))
    elif fmt == "eager":
        write_synced(path, lambda fh: torch.save(scorer.state_dict(), fh))
    else:
        raise ArtifactError(f"unknown artifact format {fmt!r}; expected one of {', '.join(FORMATS)}")


def _load_scorer(fmt: str, path: Path, spec: ScorerSpec, device: str) -> nn.Module:
    if fmt == "torchscript":
        with _quiet_torchscript():
            return torch.jit.load(str(path), map_location=device).eval()
    if fmt == "export":
        return torch.export.load(str(path)).module().to(device)
    if fmt == "eager":
        state = torch.load(path, map_location=device, weights_only=True)
        scorer = Scorer(spec, state["hot_ids"], state["hot_vectors"])
        scorer.load_state_dict(state)
        return scorer.to(device).eval()
    raise ArtifactError(f"{path}: unknown artifact format {fmt!r}; this streamrec reads {', '.join(FORMATS)}")


# -- build and publish ---------------------------------------------------------------------------
def _clean_stale_staging(root: Path) -> None:
    staging = root / STAGING
    if not staging.is_dir():
        return
    for d in staging.iterdir():
        with contextlib.suppress(OSError):
            if time.time() - d.stat().st_mtime > _STALE_STAGING_S:
                shutil.rmtree(d, ignore_errors=True)


_PID_RE = re.compile(r"-(\d+)(?:-\d+)?$")  # <version>-<pid> (staging), .<name>.tmp-<pid>-<thread> (temp files)


def _owner_gone(name: str) -> bool:
    """Whether the process named at the end of ``name`` is gone from this host (False when unsure)."""
    m = _PID_RE.search(name)
    if m is None:
        return False
    pid = int(m.group(1))
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except (PermissionError, OverflowError):
        return False
    return False


def clean_leftovers(root: Path) -> list[str]:
    """Remove what killed refreshes left under ``root``; returns the paths removed (relative to ``root``).

    That is: staged artifacts (``.staging/<version>-<pid>``) whose process is gone or that are older than an
    hour, versions a killed prune had begun to remove (``versions/.trash-*``), and temp files of
    :func:`_write_atomic` whose process is gone. Call it holding :func:`refresh_lock`, so that no other
    refresh is building: a staged directory of a live process is never touched. None of these is ever
    read by serving or named by ``CURRENT``; removing them only frees the space (a staged artifact holds
    a whole copy of the cold rows).
    """
    root = Path(root)
    removed: list[str] = []

    def rm(path: Path) -> None:
        try:
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()
            removed.append(str(path.relative_to(root)))
        except OSError as exc:
            log.warning("could not remove the leftover %s (%s)", path, exc)

    staging = root / STAGING
    if staging.is_dir():
        for d in sorted(staging.iterdir()):
            try:
                old = time.time() - d.stat().st_mtime > _STALE_STAGING_S
            except OSError:
                continue
            if old or _owner_gone(d.name):
                rm(d)
    versions = _versions_dir(root)
    if versions.is_dir():
        for d in sorted(versions.iterdir()):
            if d.name.startswith(_TRASH):
                rm(d)
    if root.is_dir():
        for f in sorted(root.iterdir()):
            if f.name.startswith(".") and ".tmp-" in f.name and f.is_file() and _owner_gone(f.name):
                rm(f)
    return removed


@contextlib.contextmanager
def refresh_lock(root: Path) -> Iterator[None]:
    """Hold ``<root>/.refresh.lock`` (``flock``, exclusive, not waiting) for one refresh run.

    One refresh at a time per publish root (a manual ``--now`` while the scheduled run builds fails at
    once instead of racing it), and a refresh holding it knows that every staged artifact of a dead
    process is garbage (:func:`clean_leftovers`). The kernel releases the lock when the process dies,
    SIGKILL included, so a killed run never blocks the next one. :func:`rollback` does not take it (an
    operator's rollback must not wait for a build); a run that would publish over a rollback pin made
    meanwhile checks for it again right before publishing (``publish(over_pin=False)``).
    ArtifactError when the lock is held (naming the pid written in it) or the root cannot be opened.
    """
    root = Path(root)
    path = root / LOCK
    try:
        root.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError:
            fd = os.open(path, os.O_RDONLY)  # a read-only root: the lock still works, publishing fails later
    except OSError as exc:
        raise ArtifactError(f"cannot open the publish root's lock {path}: {describe_os_error(exc)}") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode("ascii", "replace").strip() or "unknown"
            raise ArtifactError(f"another refresh (pid {holder}) is running on {root}: it holds {path}; this run "
                                "does nothing (the live artifact is untouched)") from None
        with contextlib.suppress(OSError):
            os.ftruncate(fd, 0)
            os.pwrite(fd, str(os.getpid()).encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the flock


def describe_os_error(exc: OSError) -> str:
    """An OSError in words an operator acts on (a full or read-only publish root says so)."""
    what = {errno.ENOSPC: "the file system is full (no space left on device)",
            errno.EDQUOT: "the disk quota is exceeded",
            errno.EROFS: "the file system is read-only",
            errno.EACCES: "permission denied",
            errno.EPERM: "operation not permitted"}.get(exc.errno or -1)
    where = f" ({exc.filename})" if exc.filename else ""
    return f"{what}{where}: {exc.strerror or exc}" if what else f"{type(exc).__name__}: {exc}"


def build_artifact(checkpoint: dict[str, Any], out_dir: Path, hot_rows: np.ndarray, format: str = "torchscript",
                   hot_stats: dict[str, Any] | None = None, version: str | None = None) -> Path:
    """Stage a complete artifact for ``checkpoint`` under the publish root ``out_dir``; returns the staged dir.

    ``hot_rows`` (int64, any order, duplicates allowed) are global rows of the fused table placed in the
    scorer. The staged directory (``out_dir/.staging/<version>-<pid>``) is complete and fsynced when this
    returns; :func:`publish` makes it a version. On error nothing is left behind.
    """
    if format not in FORMATS:
        raise ArtifactError(f"unknown artifact format {format!r}; expected one of {', '.join(FORMATS)}")
    t0 = time.monotonic()
    root = Path(out_dir)
    _clean_stale_staging(root)
    cfg = check_checkpoint(checkpoint)
    meta = checkpoint["meta"]
    ms = meta["model"]
    spec = ScorerSpec(cfg.num_fields, cfg.embedding_dim, len(cfg.dense), parse_mlp(ms["mlp"]),
                      float(ms.get("dropout", 0.0)))
    state = checkpoint["model"]
    table = state["sparse.bag.weight"].detach().float().cpu().contiguous()  # (num_rows, D + 1)
    if tuple(table.shape) != (cfg.num_rows, cfg.embedding_dim + 1):
        raise ArtifactError(f"checkpoint {checkpoint.get('path')}: table shape {tuple(table.shape)} does not match "
                            f"its feature config ({cfg.num_rows}, {cfg.embedding_dim + 1})")
    hot_ids, hot_vectors = _hot_buffers(table, hot_rows)
    scorer = Scorer(spec, hot_ids, hot_vectors)
    scorer.load_state_dict({**_dense_state(state), "hot_ids": hot_ids, "hot_vectors": hot_vectors})
    scorer.eval()

    version = version or new_version_name()
    staged = root / STAGING / f"{version}-{os.getpid()}"
    staged.mkdir(parents=True, exist_ok=False)
    try:
        scorer_file = SCORER_FILES[format]
        _save_scorer(scorer, format, staged / scorer_file, spec, cfg)
        write_synced(staged / COLD_FILE, lambda fh: np.save(fh, table.numpy(), allow_pickle=False))
        names = [scorer_file, COLD_FILE]
        if checkpoint.get("id_maps"):  # dynamic ids: serving maps raw ids to the rows the learner used
            write_synced(staged / ID_MAPS_FILE, lambda fh: torch.save(checkpoint["id_maps"], fh))
            names.append(ID_MAPS_FILE)
        files = {}
        for name in names:
            p = staged / name
            files[name] = {"sha256": _sha256(p), "bytes": p.stat().st_size}
        h = len(hot_ids) - 1
        manifest = {
            "artifact_format_version": ARTIFACT_FORMAT_VERSION,
            "version": version,
            "created": time.time(),
            "created_utc": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "format": format,
            "source": {"checkpoint": checkpoint.get("path"), "samples_trained": meta.get("samples_trained"),
                       "lineage": meta.get("lineage"), "offsets": meta.get("offsets", {}), "topic": meta.get("topic"),
                       "metrics": meta.get("metrics", {})},
            "feature_config": cfg.to_dict(),
            "model": {k: (v if isinstance(v, (int, float, str, bool, type(None))) else str(v)) for k, v in ms.items()},
            "scorer": spec.to_dict(),
            "hot_set": {**(hot_stats or {}), "rows": h, "share_of_table": h / max(1, cfg.num_rows),
                        "bytes": int(hot_vectors.numel() * 4)},
            "files": files,
            "build_seconds": round(time.monotonic() - t0, 3),
        }
        write_synced(staged / MANIFEST, lambda fh: fh.write(json.dumps(manifest, indent=2, sort_keys=True).encode()))
        fsync_dir(staged)
    except BaseException:
        shutil.rmtree(staged, ignore_errors=True)
        raise
    return staged


def _versions_dir(root: Path) -> Path:
    return Path(root) / VERSIONS


def list_versions(root: Path) -> list[str]:
    """Published versions, oldest first."""
    d = _versions_dir(root)
    if not d.is_dir():
        return []
    return sorted(p.name for p in d.iterdir() if p.is_dir() and not p.name.startswith("."))


def current_version(root: Path) -> str | None:
    """The name in ``CURRENT``; None when nothing was published. ArtifactError when it names no valid version."""
    path = Path(root) / CURRENT
    try:
        raw = path.read_bytes()[: _MAX_POINTER + 1]
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
                            f"from {_versions_dir(root)} into it")
    return name


def read_current(root: Path) -> Path | None:
    """The current version's directory, or None when nothing was published (or it is gone).

    ArtifactError when ``CURRENT`` holds something that is not a version name."""
    name = current_version(root)
    if name is None:
        return None
    path = _versions_dir(root) / name
    return path if path.is_dir() else None


def _set_current(root: Path, version: str) -> None:
    _write_atomic(Path(root) / CURRENT, (version + "\n").encode())


@dataclass(frozen=True)
class Pin:
    """``<root>/PINNED``: the version a rollback returned to; serving applies no deltas to it (see above)."""

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
        raw = path.read_bytes()[:_MAX_POINTER + 1]
    except FileNotFoundError:
        return None
    except OSError as exc:
        return Pin(None, None, None, f"{path} cannot be read ({exc})")
    try:
        d = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        d = None
    ok = (isinstance(d, dict) and isinstance(d.get("version"), str) and _NAME_RE.fullmatch(d["version"])
          and (d.get("rolled_back_from") is None or isinstance(d["rolled_back_from"], str))
          and (d.get("at") is None or _num(d["at"])))
    if not ok or len(raw) > _MAX_POINTER:
        return Pin(None, None, None, f"{path} holds {_show(raw[:60])}, not a rollback pin; deltas stay paused "
                   "and scheduled refreshes do not publish until an operator publishes (`streamrec refresh --now`)")
    return Pin(d["version"], d.get("rolled_back_from"), d.get("at"))


def _clear_pin(root: Path) -> None:
    path = Path(root) / PIN
    if path.exists():
        path.unlink(missing_ok=True)
        fsync_dir(Path(root))


def _prune(root: Path, keep: int) -> list[str]:
    """Remove all but the last ``keep`` versions (never the current one). Each is first renamed to a hidden
    ``versions/.trash-*`` name (atomic), then deleted: a prune killed half-way leaves a hidden directory
    that :func:`clean_leftovers` removes, never a half-deleted version that :func:`rollback` could pick."""
    current = current_version(root)
    removed = []
    for name in list_versions(root)[: -max(1, keep)]:
        if name != current:
            trash = _versions_dir(root) / f"{_TRASH}{name}-{os.getpid()}"
            try:
                os.rename(_versions_dir(root) / name, trash)
            except OSError as exc:
                log.warning("could not prune version %s (%s); it stays", name, exc)
                continue
            shutil.rmtree(trash, ignore_errors=True)
            removed.append(name)
    return removed


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


def publish(root: Path, staged_dir: Path, keep: int, over_pin: bool = True) -> Path:
    """Verify a staged artifact, move it into ``versions/`` and make it current (clearing a rollback pin);
    keep the last ``keep`` versions.

    ArtifactError, with nothing changed, when the staged files do not verify, or when ``CURRENT`` cannot be
    written (a full or read-only file system: the version moved into ``versions/`` is removed again, so
    nothing half-published stays). With ``over_pin=False`` (the scheduled refresh) a rollback pin holding
    the live version is respected: :class:`PinHeld`, nothing changed. After ``CURRENT`` names the new
    version the publish has happened; clearing the pin and pruning are then best effort (logged): a pin
    left behind names an older version and is stale, a version left behind is pruned next time.
    """
    root, staged_dir = Path(root), Path(staged_dir)
    manifest = verify(staged_dir)
    version = manifest["version"]
    if not over_pin:
        pin = pin_holding(root)
        if pin is not None:
            raise PinHeld(f"{root / PIN} pins {pin.version or 'the live version'}"
                          + (f" (rolled back from {pin.rolled_back_from})" if pin.rolled_back_from else "")
                          + (f" [{pin.problem}]" if pin.problem else "")
                          + f": {version} was not published; an operator ends the pin with `streamrec refresh "
                          "--now`", pin)
    versions = _versions_dir(root)
    target = versions / version
    try:
        previous = current_version(root)
    except ArtifactError:
        previous = None
    try:
        versions.mkdir(parents=True, exist_ok=True)
        if target.exists():
            raise ArtifactError(f"version {version} already exists in {versions}; refusing to overwrite it")
        os.rename(staged_dir, target)  # atomic: same file system (staging lives inside root)
    except OSError as exc:
        raise ArtifactError(f"could not move {staged_dir.name} into {versions}: {describe_os_error(exc)}; nothing "
                            f"was published, CURRENT still names {previous or 'nothing'}") from exc
    try:
        fsync_dir(versions)
        fsync_dir(staged_dir.parent)
        _set_current(root, version)
    except OSError as exc:
        try:
            now = current_version(root)
        except ArtifactError:
            now = None
        if now != version:  # CURRENT still names the previous version: take the new one back out
            with contextlib.suppress(OSError):
                os.rename(target, staged_dir)  # the caller removes its staged directory
            if target.exists():
                shutil.rmtree(target, ignore_errors=True)
            raise ArtifactError(f"could not make {version} current in {root}: {describe_os_error(exc)}; nothing "
                                f"was published, CURRENT still names {previous or 'nothing'}") from exc
        log.warning("%s is current, but making that durable failed (%s)", version, describe_os_error(exc))
    try:
        _clear_pin(root)  # after CURRENT: a pin naming an older version is stale from here on
    except OSError as exc:
        log.warning("%s is current; removing the stale rollback pin failed (%s): it names an older version and "
                    "is ignored", version, describe_os_error(exc))
    try:
        _prune(root, keep)
    except OSError as exc:
        log.warning("%s is current; pruning old versions failed (%s): they are pruned next time", version,
                    describe_os_error(exc))
    return target


def rollback(root: Path) -> str:
    """Make the version before the current one current again and pin it; returns its name.

    The older version is verified first (size and sha256 of every file): a damaged one is an ArtifactError
    and ``CURRENT`` stays as it was. The pin (``PINNED``) stops serving from applying learner deltas to the
    rolled-back version, and scheduled refreshes from publishing over it, until an operator publishes
    (``streamrec refresh --now``; see the module docstring)."""
    root = Path(root)
    versions = [v for v in list_versions(root) if _NAME_RE.fullmatch(v)]
    current = current_version(root)
    older = [v for v in versions if current is None or v < current]
    if not older:
        raise ArtifactError(f"no version older than {current!r} in {_versions_dir(root)} to roll back to "
                            f"(published: {versions or 'none'})")
    target = older[-1]
    try:
        verify(_versions_dir(root) / target)
    except ArtifactError as exc:
        raise ArtifactError(f"cannot roll back to {target}: {exc}; CURRENT still names {current}") from None
    now = time.time()
    _write_atomic(root / PIN, json.dumps({"version": target, "rolled_back_from": current, "at": now,
                                          "at_utc": dt.datetime.fromtimestamp(now, tz=dt.timezone.utc)
                                          .isoformat(timespec="seconds")}).encode())
    _set_current(root, target)
    return target


def _read_manifest(version_dir: Path) -> dict[str, Any]:
    """The checked manifest of ``version_dir`` (:func:`decode_manifest`); ArtifactError if missing or bad."""
    path = Path(version_dir) / MANIFEST
    try:
        if path.stat().st_size > _MAX_MANIFEST:
            raise ArtifactError(f"{path} has {path.stat().st_size} bytes, more than a manifest's {_MAX_MANIFEST}: "
                                "the artifact is corrupt")
        raw = path.read_bytes()
    except FileNotFoundError:
        raise ArtifactError(f"{path} is missing: {version_dir} is not a complete artifact") from None
    except IsADirectoryError:
        raise ArtifactError(f"{path} is a directory, not a manifest: the artifact is corrupt") from None
    except OSError as exc:
        raise ArtifactError(f"{path} cannot be read ({exc}); check the publish root's permissions") from None
    return decode_manifest(raw, path)


def verify(version_dir: Path, manifest: dict[str, Any] | None = None) -> dict[str, Any]:
    """Check every file's size and sha256 against the manifest; returns the manifest."""
    version_dir = Path(version_dir)
    manifest = manifest or _read_manifest(version_dir)
    for name, want in manifest["files"].items():
        p = version_dir / name
        if not p.is_file():
            raise ArtifactError(f"{p} is missing (listed in the manifest): the artifact is incomplete")
        try:
            size = p.stat().st_size
        except OSError as exc:
            raise ArtifactError(f"{p} cannot be read ({exc})") from None
        if size != want["bytes"]:
            raise ArtifactError(f"{p} has {size} bytes, the manifest says {want['bytes']}: the file is truncated "
                                "or was replaced; republish with `streamrec refresh --now` or roll back")
        try:
            digest = _sha256(p)
        except OSError as exc:
            raise ArtifactError(f"{p} cannot be read ({exc}); check the publish root's permissions") from None
        if digest != want["sha256"]:
            raise ArtifactError(f"{p}: sha256 {digest[:16]}... does not match the manifest's {want['sha256'][:16]}...: "
                                "the file is corrupt; republish with `streamrec refresh --now` or roll back")
    return manifest


# -- loading and scoring --------------------------------------------------------------------------
@dataclass(frozen=True)
class _Live:
    """Everything one score call reads, swapped as a whole by apply_delta (so readers never see half)."""

    scorer: nn.Module
    override_ids: np.ndarray  # (R,) int64 sorted
    override_vectors: np.ndarray  # (R, D + 1) float32
    delta_seq: int


class ScoringModel:
    """A loaded artifact: hot rows on ``device``, cold rows memory-mapped, delta overrides on top.

    Thread-safety: ``score`` may run in several threads while one thread calls ``apply_delta``; each
    call of ``score`` reads one consistent snapshot (scorer, overrides, sequence number).
    """

    def __init__(self, version_dir: Path, manifest: dict[str, Any], scorer: nn.Module, cold: np.ndarray,
                 device: str) -> None:
        self.version_dir = Path(version_dir)
        self.manifest = manifest
        self.version: str = manifest["version"]
        self.format: str = manifest["format"]
        self.feature_config = FeatureConfig.from_dict(manifest["feature_config"])
        self.spec = ScorerSpec.from_dict(manifest["scorer"])
        self.device = torch.device(device)
        self._cold = cold  # (num_rows, D + 1) float32 memmap
        hot_ids = dict(scorer.named_buffers())["hot_ids"] if self.format != "export" else None
        if hot_ids is None:
            hot_ids = _export_hot_ids(scorer)
        self._hot_ids = hot_ids.cpu().numpy()  # (H + 1,) sorted, last = sentinel
        self._blocks = self.feature_config.blocks
        if ID_MAPS_FILE in manifest.get("files", {}):
            try:
                id_maps = torch.load(self.version_dir / ID_MAPS_FILE, map_location="cpu", weights_only=True)
                self._mapper = RowMapper.from_state(self.feature_config, id_maps)
            except Exception as exc:  # noqa: BLE001 - an unreadable id map is a bad artifact
                raise ArtifactError(f"{self.version_dir / ID_MAPS_FILE}: cannot load the id maps ({exc})") from exc
        else:
            self._mapper = RowMapper.from_state(self.feature_config, None)
        self._live = _Live(scorer, np.zeros(0, np.int64), np.zeros((0, self.spec.dim + 1), np.float32), 0)
        self._count_lock = threading.Lock()
        self.hot_lookups = 0
        self.cold_lookups = 0

    @classmethod
    def load(cls, version_dir: Path, device: str = "cpu", verify_files: bool = True,
             smoke: bool = True) -> ScoringModel:
        """Load (and by default verify, size and sha256 of every file) one artifact version.

        Every reason it cannot be used is an :class:`ArtifactError`: the manifest (:func:`decode_manifest`),
        a manifest naming another version than its directory under ``versions/``, the files, the cold rows'
        dtype and shape, the scorer, the id maps, and (``smoke``) one probe scored to a finite probability.
        """
        version_dir = Path(version_dir)
        manifest = verify(version_dir) if verify_files else _read_manifest(version_dir)  # verify reads it first
        if version_dir.parent.name == VERSIONS and manifest["version"] != version_dir.name:
            raise ArtifactError(f"{version_dir / MANIFEST}: names version {manifest['version']!r} but lies in "
                                f"{version_dir.name!r}: the directory was renamed or copied; publish it with "
                                "`streamrec refresh --now` instead")
        fmt = manifest["format"]
        cfg = FeatureConfig.from_dict(manifest["feature_config"])
        spec = ScorerSpec.from_dict(manifest["scorer"])
        try:
            cold = np.load(version_dir / COLD_FILE, mmap_mode="r", allow_pickle=False)
            if cold.dtype != np.float32 or cold.shape != (cfg.num_rows, cfg.embedding_dim + 1):
                raise ArtifactError(f"{version_dir / COLD_FILE}: {cold.dtype} {cold.shape}, expected float32 "
                                    f"({cfg.num_rows}, {cfg.embedding_dim + 1})")
            scorer = _load_scorer(fmt, version_dir / SCORER_FILES[fmt], spec, device)
            model = cls(version_dir, manifest, scorer, cold, device)
        except ArtifactError:
            raise
        except Exception as exc:  # noqa: BLE001 - any unreadable file is a bad artifact
            raise ArtifactError(f"{version_dir}: cannot load the artifact ({type(exc).__name__}: {exc})") from exc
        if smoke:
            model._smoke_test()
        return model

    def _smoke_test(self) -> None:
        """Score two probe samples (each field's first row): a scorer that does not fit its manifest fails here,
        at load, instead of on every request."""
        cfg = self.feature_config
        b = 2
        values = torch.tensor([first for first, _ in cfg.blocks for _ in range(b)], dtype=torch.int64)
        offsets = torch.arange(cfg.num_fields * b + 1, dtype=torch.int64)
        try:
            p = self.score(values, offsets, torch.zeros(b, len(cfg.dense)))
            ok = tuple(p.shape) == (b,) and bool(torch.isfinite(p).all()) and bool(((p >= 0) & (p <= 1)).all())
        except Exception as exc:  # noqa: BLE001 - whatever the scorer raises, the artifact is unusable
            raise ArtifactError(f"{self.version_dir}: the scorer does not score a probe ({type(exc).__name__}: "
                                f"{str(exc)[:300]}); republish with `streamrec refresh --now`") from exc
        finally:
            self.hot_lookups = self.cold_lookups = 0
        if not ok:
            raise ArtifactError(f"{self.version_dir}: the scorer answered {p.tolist()} for a probe of {b} samples, "
                                "expected finite probabilities; republish with `streamrec refresh --now`")

    # -- rows --------------------------------------------------------------------------------------
    def map_rows(self, field_index: int, hashed: np.ndarray) -> np.ndarray:
        """Global rows of field ``field_index``'s hashed values (int64 (N,) -> int64 (N,)).

        Static fields: ``first + v mod buckets`` (learner/features.py); dynamic fields: the learner's id
        map as of the source checkpoint (admitted ids their own rows, the others their hash buckets).
        """
        return self._mapper.rows(field_index, hashed)

    def _mapper_from(self, state: Any) -> RowMapper:
        try:
            return RowMapper.from_state(self.feature_config, state)
        except Exception as exc:  # noqa: BLE001 - any malformed id map state is a misfit
            raise ValueError(f"id maps do not fit model {self.version}: {type(exc).__name__}: {exc}") from exc

    def replace_id_maps(self, state: dict[str, Any]) -> None:
        """Map ids with newer id maps (a learner delta's): built aside, then swapped in one assignment."""
        self._mapper = self._mapper_from(state)

    def map_batch(self, tb: Any) -> None:
        """Rewrite a ``learner.batch.TensorBatch``'s dynamic-field rows in place (read-only lookups)."""
        self._mapper.apply(tb, 0.0, train=False)

    @property
    def delta_seq(self) -> int:
        return self._live.delta_seq

    @property
    def source_samples(self) -> int | None:
        """``samples_trained`` of the source checkpoint (deltas at or below it are inside); None: unknown."""
        return self.manifest["source"].get("samples_trained")

    @property
    def lineage(self) -> str | None:
        """The source checkpoint's lineage (``learner/checkpoint.py``); None for artifacts built without one."""
        return self.manifest["source"].get("lineage")

    @property
    def hot_rows(self) -> int:
        return len(self._hot_ids) - 1

    def _given(self, live: _Live, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(given_rows (N, D + 1), given_mask (N,)): cold rows from the mmap, delta overrides on top."""
        n = len(values)
        pos = np.searchsorted(self._hot_ids, values)
        hot = self._hot_ids[pos] == values  # pos <= H: the sentinel is last
        given = np.zeros((n, self.spec.dim + 1), np.float32)
        mask = ~hot
        if len(live.override_ids):
            opos = np.minimum(np.searchsorted(live.override_ids, values), len(live.override_ids) - 1)
            over = live.override_ids[opos] == values
            cold = mask & ~over
            given[over] = live.override_vectors[opos[over]]
            mask |= over
        else:
            cold = mask
        cold_idx = np.flatnonzero(cold)
        if len(cold_idx):
            given[cold_idx] = self._cold[values[cold_idx]]
        n_cold = len(cold_idx)
        with self._count_lock:
            self.cold_lookups += n_cold
            self.hot_lookups += n - n_cold
        return given, mask

    @torch.inference_mode()
    def score(self, values: torch.Tensor, offsets: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
        """Click probabilities (B,) for field-major bags of global rows (learner.batch.TensorBatch layout)."""
        live = self._live
        v = values.cpu().numpy() if values.device.type != "cpu" else values.numpy()
        given, mask = self._given(live, v)
        dev = self.device
        return live.scorer(values.to(dev), offsets.to(dev), dense.to(dev, torch.float32),
                           torch.from_numpy(given).to(dev), torch.from_numpy(mask).to(dev))

    # -- deltas ------------------------------------------------------------------------------------
    def apply_delta(self, rows: torch.Tensor, vectors: torch.Tensor, dense_state: dict[str, torch.Tensor] | None,
                    seq: int, id_maps: dict[str, Any] | None = None) -> None:
        """Override rows (R,) with vectors (R, D + 1); replace the dense weights when ``dense_state`` is given,
        and the id maps when ``id_maps`` is.

        All or nothing: every part is checked against this model first (integer rows inside the table,
        vectors of the model's width, finite values, dense names, shapes and floating dtypes, id maps of this
        feature config) and a misfit is a ``ValueError`` that leaves the model as it was. Overrides win over
        hot and cold rows and accumulate until the next full artifact. A new snapshot is built off to the side
        and swapped in with one assignment, so concurrent ``score`` calls see either the old or the new state
        (the id maps are swapped right after the rows they point at). ``dense_state`` uses DeepFM's names
        (``dense_arch.*``, ``bias``; ``sparse.*`` keys are ignored).
        """
        live = self._live
        if not isinstance(rows, torch.Tensor) or rows.is_floating_point() or rows.is_complex() or rows.dim() != 1:
            raise ValueError(f"apply_delta: rows must be a 1-D integer tensor, got {_describe(rows)}")
        if not isinstance(vectors, torch.Tensor) or not vectors.is_floating_point():
            raise ValueError(f"apply_delta: vectors must be a floating tensor, got {_describe(vectors)}")
        r = rows.detach().cpu().numpy().astype(np.int64, copy=False)
        vec = vectors.detach().cpu().float().numpy()
        if vec.shape != (len(r), self.spec.dim + 1):
            raise ValueError(f"apply_delta: vectors have shape {vec.shape}, expected ({len(r)}, {self.spec.dim + 1})")
        if len(r) and (r.min() < 0 or r.max() >= self._cold.shape[0]):
            raise ValueError(f"apply_delta: rows must lie in [0, {self._cold.shape[0]}), got [{r.min()}, {r.max()}]")
        if not np.isfinite(vec).all():
            raise ValueError(f"apply_delta: vectors hold {int((~np.isfinite(vec)).sum())} non-finite values")
        scorer = live.scorer
        if dense_state is not None:
            scorer = self._with_dense(scorer, dense_state)
        mapper = self._mapper_from(id_maps) if id_maps is not None else None
        ids = np.concatenate([live.override_ids, r])
        vecs = np.concatenate([live.override_vectors, vec])
        # Keep the LAST occurrence of every row (the newest vector): unique over the reversed order.
        rev_ids = ids[::-1]
        uniq, first_in_rev = np.unique(rev_ids, return_index=True)
        keep = len(ids) - 1 - first_in_rev
        self._live = _Live(scorer, uniq, np.ascontiguousarray(vecs[keep]), int(seq))
        if mapper is not None:  # rows first, then the map that points at them
            self._mapper = mapper

    def _with_dense(self, scorer: nn.Module, dense_state: dict[str, torch.Tensor]) -> nn.Module:
        if not isinstance(dense_state, dict):
            raise ValueError(f"apply_delta: dense_state must be a dict of tensors, got {_describe(dense_state)}")
        for k, v in dense_state.items():
            if not isinstance(k, str) or not isinstance(v, torch.Tensor) or not v.is_floating_point():
                raise ValueError(f"apply_delta: dense_state[{k!r}] must be a floating tensor, got {_describe(v)}")
            if v.numel() and not bool(torch.isfinite(v).all()):
                raise ValueError(f"apply_delta: dense_state[{k!r}] holds non-finite values")
        new = {k: v.detach().to(self.device, torch.float32) for k, v in dense_state.items()
               if not k.startswith("sparse.")}
        current = {k: v for k, v in scorer.state_dict().items() if k not in ("hot_ids", "hot_vectors")}
        missing, unknown = set(current) - set(new), set(new) - set(current)
        if missing or unknown:
            raise ValueError(f"apply_delta: dense_state does not match the scorer (missing {sorted(missing)}, "
                             f"unknown {sorted(unknown)})")
        for k, v in new.items():
            if tuple(v.shape) != tuple(current[k].shape):
                raise ValueError(f"apply_delta: dense_state[{k!r}] has shape {tuple(v.shape)}, "
                                 f"expected {tuple(current[k].shape)}")
        # Share the (large) hot buffers between old and new scorer; copy only the dense weights.
        clone = _clone_sharing_hot(scorer)
        with torch.no_grad():
            params = dict(clone.named_parameters())
            buffers = dict(clone.named_buffers())
            for k, v in new.items():
                (params.get(k) if k in params else buffers[k]).copy_(v)
        return clone


def _describe(v: Any) -> str:
    if isinstance(v, torch.Tensor):
        return f"{v.dtype} tensor of shape {tuple(v.shape)}"
    return f"a {type(v).__name__}"


def _clone_sharing_hot(scorer: nn.Module) -> nn.Module:
    """A copy of ``scorer`` whose parameters are its own and whose hot buffers are shared (not copied)."""
    shared: dict[int, Any] = {id(b): b for name, b in scorer.named_buffers()
                              if name.endswith(("hot_ids", "hot_vectors"))}
    with warnings.catch_warnings():
        # Copying an exported module's pytree specs trips a deprecation inside torch.fx (not our call).
        warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated",
                                category=FutureWarning)
        clone = copy.deepcopy(scorer, memo=dict(shared))
    # TorchScript's C++ deepcopy ignores the memo: point the clone back at the original hot buffers.
    for name, b in list(clone.named_buffers()):
        original = next((t for n, t in scorer.named_buffers() if n == name), None)
        if id(b) not in shared and original is not None and id(original) in shared and "." not in name:
            setattr(clone, name, original)
    return clone


def _export_hot_ids(module: nn.Module) -> torch.Tensor:
    for name, b in module.named_buffers():
        if name.endswith("hot_ids"):
            return b
    raise ArtifactError("the exported scorer has no hot_ids buffer")
