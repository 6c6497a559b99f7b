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

Publishing: an artifact is staged in ``<root>/.staging/``, fsynced, renamed into ``versions/`` (same
file system, so the rename is atomic) and only then named in ``CURRENT`` (temp file, fsync,
``os.replace``, fsync of the directory). A crash at any point leaves ``CURRENT`` naming a complete
version. The last ``keep`` versions (and always the current one) are kept.

Errors: :class:`ArtifactError` for every artifact that cannot be used (missing, truncated or altered
files, a manifest this code cannot read); the message names the file and what was wrong.
"""

from __future__ import annotations

import contextlib
import copy
import datetime as dt
import hashlib
import json
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
from learner.features import FeatureConfig
from learner.model import DeepFM, DenseArch, FMInteraction
from learner.row_mapper import RowMapper

ARTIFACT_FORMAT_VERSION = 1
FORMATS = ("torchscript", "export", "eager")
SCORER_FILES = {"torchscript": "scorer.pt", "export": "scorer.pt2", "eager": "scorer_state.pt"}
COLD_FILE = "cold_rows.npy"
ID_MAPS_FILE = "id_maps.pt"  # dynamic ids only: the learner's id maps (learner/row_mapper.py)
MANIFEST = "manifest.json"
CURRENT = "CURRENT"
VERSIONS = "versions"
STAGING = ".staging"
_SENTINEL = torch.iinfo(torch.int64).max  # a row id no table reaches: keeps searchsorted in bounds
_STALE_STAGING_S = 3600.0
_HASH_CHUNK = 8 << 20


class ArtifactError(Exception):
    """An artifact that cannot be used: missing, truncated or altered files, or an unreadable manifest."""


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


# -- files ---------------------------------------------------------------------------------------
def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(_HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{threading.get_ident()}")
    write_synced(tmp, lambda fh: fh.write(data))
    os.replace(tmp, path)
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
    meta = checkpoint["meta"]
    cfg = FeatureConfig.from_dict(meta["feature_config"])
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
                       "offsets": meta.get("offsets", {}), "topic": meta.get("topic"),
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
    try:
        name = (Path(root) / CURRENT).read_text().strip()
    except FileNotFoundError:
        return None
    return name or None


def read_current(root: Path) -> Path | None:
    """The current version's directory, or None when nothing was published (or it is gone)."""
    name = current_version(root)
    if name is None:
        return None
    path = _versions_dir(root) / name
    return path if path.is_dir() else None


def _set_current(root: Path, version: str) -> None:
    _write_atomic(Path(root) / CURRENT, (version + "\n").encode())


def _prune(root: Path, keep: int) -> list[str]:
    current = current_version(root)
    removed = []
    for name in list_versions(root)[: -max(1, keep)]:
        if name != current:
            shutil.rmtree(_versions_dir(root) / name, ignore_errors=True)
            removed.append(name)
    return removed


def publish(root: Path, staged_dir: Path, keep: int) -> Path:
    """Move a staged artifact into ``versions/`` and make it current; keep the last ``keep`` versions."""
    root, staged_dir = Path(root), Path(staged_dir)
    manifest = _read_manifest(staged_dir)
    version = manifest["version"]
    versions = _versions_dir(root)
    versions.mkdir(parents=True, exist_ok=True)
    target = versions / version
    if target.exists():
        raise ArtifactError(f"version {version} already exists in {versions}; refusing to overwrite it")
    os.rename(staged_dir, target)  # atomic: same file system (staging lives inside root)
    fsync_dir(versions)
    _set_current(root, version)
    _prune(root, keep)
    return target


def rollback(root: Path) -> str:
    """Make the version before the current one current again; returns its name."""
    versions = list_versions(root)
    current = current_version(root)
    older = [v for v in versions if current is None or v < current]
    if not older:
        raise ArtifactError(f"no version older than {current!r} in {_versions_dir(root)} to roll back to "
                            f"(published: {versions or 'none'})")
    _set_current(root, older[-1])
    return older[-1]


def _read_manifest(version_dir: Path) -> dict[str, Any]:
    path = Path(version_dir) / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        raise ArtifactError(f"{path} is missing: {version_dir} is not a complete artifact") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ArtifactError(f"{path} is not valid JSON ({exc}): the artifact is corrupt") from None
    if manifest.get("artifact_format_version") != ARTIFACT_FORMAT_VERSION:
        raise ArtifactError(f"{path}: artifact format {manifest.get('artifact_format_version')!r}, this streamrec "
                            f"reads {ARTIFACT_FORMAT_VERSION}; rebuild it with `streamrec refresh --now`")
    return manifest


def verify(version_dir: Path, manifest: dict[str, Any] | None = None) -> dict[str, Any]:
    """Check every file's size and sha256 against the manifest; returns the manifest."""
    version_dir = Path(version_dir)
    manifest = manifest or _read_manifest(version_dir)
    for name, want in manifest["files"].items():
        p = version_dir / name
        if not p.is_file():
            raise ArtifactError(f"{p} is missing (listed in the manifest): the artifact is incomplete")
        size = p.stat().st_size
        if size != want["bytes"]:
            raise ArtifactError(f"{p} has {size} bytes, the manifest says {want['bytes']}: the file is truncated "
                                "or was replaced; republish with `streamrec refresh --now` or roll back")
        digest = _sha256(p)
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
    def load(cls, version_dir: Path, device: str = "cpu", verify_files: bool = True) -> ScoringModel:
        """Load (and by default verify, size and sha256 of every file) one artifact version."""
        version_dir = Path(version_dir)
        manifest = _read_manifest(version_dir)
        if verify_files:
            verify(version_dir, manifest)
        fmt = manifest.get("format")
        if fmt not in FORMATS:
            raise ArtifactError(f"{version_dir}: unknown format {fmt!r}; this streamrec reads {', '.join(FORMATS)}")
        spec = ScorerSpec.from_dict(manifest["scorer"])
        try:
            cold = np.load(version_dir / COLD_FILE, mmap_mode="r")
            scorer = _load_scorer(fmt, version_dir / SCORER_FILES[fmt], spec, device)
        except ArtifactError:
            raise
        except Exception as exc:  # noqa: BLE001 - any unreadable file is a bad artifact
            raise ArtifactError(f"{version_dir}: cannot load the artifact ({type(exc).__name__}: {exc})") from exc
        cfg = FeatureConfig.from_dict(manifest["feature_config"])
        if cold.dtype != np.float32 or cold.shape != (cfg.num_rows, cfg.embedding_dim + 1):
            raise ArtifactError(f"{version_dir / COLD_FILE}: {cold.dtype} {cold.shape}, expected float32 "
                                f"({cfg.num_rows}, {cfg.embedding_dim + 1})")
        return cls(version_dir, manifest, scorer, cold, device)

    # -- rows --------------------------------------------------------------------------------------
    def map_rows(self, field_index: int, hashed: np.ndarray) -> np.ndarray:
        """Global rows of field ``field_index``'s hashed values (int64 (N,) -> int64 (N,)).

        Static fields: ``first + v mod buckets`` (learner/features.py); dynamic fields: the learner's id
        map as of the source checkpoint (admitted ids their own rows, the others their hash buckets).
        """
        return self._mapper.rows(field_index, hashed)

    def replace_id_maps(self, state: dict[str, Any]) -> None:
        """Map ids with newer id maps (a learner delta's): built aside, then swapped in one assignment."""
        try:
            mapper = RowMapper.from_state(self.feature_config, state)
        except (KeyError, ValueError, TypeError) as exc:
            raise ValueError(f"id maps do not fit model {self.version}: {exc}") from exc
        self._mapper = mapper

    def map_batch(self, tb: Any) -> None:
        """Rewrite a ``learner.batch.TensorBatch``'s dynamic-field rows in place (read-only lookups)."""
        self._mapper.apply(tb, 0.0, train=False)

    @property
    def delta_seq(self) -> int:
        return self._live.delta_seq

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
                    seq: int) -> None:
        """Override rows (R,) with vectors (R, D + 1); replace the dense weights when ``dense_state`` is given.

        Overrides win over hot and cold rows and accumulate until the next full artifact. A new snapshot
        is built off to the side and swapped in with one assignment, so concurrent ``score`` calls see
        either the old or the new state. ``dense_state`` uses DeepFM's names (``dense_arch.*``, ``bias``;
        ``sparse.*`` keys are ignored).
        """
        live = self._live
        r = rows.detach().cpu().numpy().astype(np.int64, copy=False)
        vec = vectors.detach().cpu().float().numpy()
        if vec.shape != (len(r), self.spec.dim + 1):
            raise ValueError(f"apply_delta: vectors have shape {vec.shape}, expected ({len(r)}, {self.spec.dim + 1})")
        if len(r) and (r.min() < 0 or r.max() >= self._cold.shape[0]):
            raise ValueError(f"apply_delta: rows must lie in [0, {self._cold.shape[0]}), got [{r.min()}, {r.max()}]")
        ids = np.concatenate([live.override_ids, r])
        vecs = np.concatenate([live.override_vectors, vec])
        # Keep the LAST occurrence of every row (the newest vector): unique over the reversed order.
        rev_ids = ids[::-1]
        uniq, first_in_rev = np.unique(rev_ids, return_index=True)
        keep = len(ids) - 1 - first_in_rev
        scorer = live.scorer
        if dense_state is not None:
            scorer = self._with_dense(scorer, dense_state)
        self._live = _Live(scorer, uniq, np.ascontiguousarray(vecs[keep]), int(seq))

    def _with_dense(self, scorer: nn.Module, dense_state: dict[str, torch.Tensor]) -> nn.Module:
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
