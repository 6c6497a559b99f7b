"""An artifact's manifest: its keys and their checks, its signature, and the checks of a checkpoint to become one.

``manifest.json`` of a version directory (its keys: ``learner/artifact.py``'s layout) is decoded and every key this
code reads checked (:func:`decode_manifest`, :func:`read_manifest`); the feature config in it and in a checkpoint
(:func:`feature_config_from`), and a checkpoint before it is built into an artifact (:func:`check_checkpoint`). The
names of the files an artifact holds are here, since the manifest lists them. The version directories and
:class:`~learner.artifact_versions.ArtifactError` are ``learner/artifact_versions.py``; building an artifact and
opening its files ``learner/artifact.py``.

Signatures: with a signing key (``signing_key_file``: :func:`learner.tensorpack.load_signing_key`) the
manifest carries ``signature``, the hex HMAC-SHA256 of :func:`canonical_manifest` (the manifest without
``signature``, as JSON with sorted keys and no spaces). A reader with a key (:func:`decode_manifest`,
:func:`read_manifest`, :func:`verify` given ``signing_key``) refuses an unsigned manifest or one whose
signature does not match right after parsing it, before any other file of the version is opened; since
the manifest lists every file's sha256, a signed manifest authenticates the whole artifact. A reader
without a key ignores the signature.

(:func:`verify` is ``learner/artifact.py``'s.)
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from learner.artifact_versions import NAME_RE, ArtifactError, check_version_dir, num, read_regular, resolve_inside
from learner.config import parse_mlp
from learner.features import FeatureConfig, FieldSpec
from learner.scorer import (
    CANDIDATE_ROWS_LAYOUT,
    FORMATS,
    ONNX_FORMATS,
    PICKLE_FREE_FORMATS,
    POOLING_GRAPH_LAYOUT,
    SCORER_EXTRA_FILES,
    SCORER_FILES,
    SCORER_LAYOUTS,
    Scorer,
    ScorerSpec,
)
from learner.tensorpack import SigningKey
from stream.errors import BadMessage, shown
from stream.events import count_keys, reject_duplicate_keys

__all__ = ["ARTIFACT_FORMAT_VERSION", "COLD_FILE", "ID_MAPS_FILE", "ID_MAPS_PACK", "MANIFEST", "SIGNATURE",
           "canonical_manifest", "check_checkpoint", "check_signature", "decode_manifest", "feature_config_from",
           "read_manifest"]


ARTIFACT_FORMAT_VERSION = 1
COLD_FILE = "cold_rows.npy"
ID_MAPS_FILE = "id_maps.pt"  # dynamic ids only: the learner's id maps (learner/row_mapper.py), torch.save
ID_MAPS_PACK = "id_maps.pack"  # the same as a learner.tensorpack (safetensors artifacts: nothing unpickled)
SIGNATURE = "signature"  # the manifest key of its HMAC-SHA256 (with a signing key)
MANIFEST = "manifest.json"
_SHA_RE = re.compile(r"[0-9a-f]{64}")
_MAX_MANIFEST = 16 << 20


# -- manifest and checkpoint checks ----------------------------------------------------------------
_FIELD_TYPES: dict[str, tuple[Any, bool]] = {  # FieldSpec attribute: (check, may be None)
    "name": (lambda v: isinstance(v, str) and v != "", False),
    "kind": (lambda v: v in ("single", "multi", "sequence"), False),
    "num_buckets": (lambda v: type(v) is int and v >= 1, False),
    "shares": (lambda v: isinstance(v, str), True),
    "capacity": (lambda v: type(v) is int and v >= 0, False),
    "admit_after": (lambda v: type(v) is int and v >= 0, False),
    "ttl_s": (lambda v: num(v) and v >= 0, True),
    "init": (lambda v: v in ("bucket", "zero"), False),
    "bucket_half_life_s": (lambda v: num(v) and v > 0, True),
}


def feature_config_from(d: Any, where: str) -> FeatureConfig:
    """A :class:`FeatureConfig` from its ``to_dict()`` form, every field type-checked: ArtifactError otherwise."""
    def bad(what: str) -> ArtifactError:
        return ArtifactError(f"{where}: feature_config {what}; the file was not written by this streamrec's "
                             "learner or refresh (rebuild it with `streamrec refresh --now`)")

    if not isinstance(d, dict):
        raise bad(f"is {shown(d)}, expected an object")
    fields = d.get("fields")
    if not isinstance(fields, (list, tuple)) or not fields:  # a list in JSON, a tuple in a checkpoint
        raise bad(f"fields is {shown(fields)}, expected a non-empty list")
    specs = []
    for i, f in enumerate(fields):
        if not isinstance(f, dict) or "name" not in f or set(f) - set(_FIELD_TYPES):
            raise bad(f"fields[{i}] is {shown(f)}, expected an object with name and only {sorted(_FIELD_TYPES)}")
        for key, value in f.items():
            check, nullable = _FIELD_TYPES[key]
            if not ((value is None and nullable) or (value is not None and check(value))):
                raise bad(f"fields[{i}].{key} is {shown(value)}")
        specs.append(f)
    dense, dim, version = d.get("dense", []), d.get("embedding_dim"), d.get("version", 1)
    if not (isinstance(dense, (list, tuple)) and all(isinstance(x, str) for x in dense)):
        raise bad(f"dense is {shown(dense)}, expected a list of names")
    if not (isinstance(dim, int) and not isinstance(dim, bool) and 1 <= dim <= 65536):
        raise bad(f"embedding_dim is {shown(dim)}, expected an integer in [1, 65536]")
    if type(version) is not int:
        raise bad(f"version is {shown(version)}, expected an integer")
    try:
        cfg = FeatureConfig(tuple(FieldSpec(**f) for f in specs), dense=tuple(dense), embedding_dim=dim,
                            version=version)
        cfg.blocks  # noqa: B018 - validates `shares`
    except (ValueError, TypeError, StopIteration) as exc:
        raise bad(f"is inconsistent ({exc})") from None
    return cfg


def _check_source(src: Any, bad: Any) -> None:
    if not isinstance(src, dict):
        raise bad(f"source is {shown(src)}, expected an object")
    for key in ("samples_trained", "delta_seq"):
        value = src.get(key)
        if value is not None and not (type(value) is int and value >= 0):
            raise bad(f"source.{key} is {shown(value)}, expected an integer >= 0 or null")
    for key in ("checkpoint", "lineage", "topic"):
        if src.get(key) is not None and not isinstance(src[key], str):
            raise bad(f"source.{key} is {shown(src[key])}, expected a string or null")
    created = src.get("created")
    if created is not None and not (num(created) and created >= 0):
        raise bad(f"source.created is {shown(created)}, expected a unix time >= 0 or null")
    if not isinstance(src.get("offsets", {}), dict):
        raise bad(f"source.offsets is {shown(src.get('offsets'))}, expected an object")


def _check_files(files: Any, fmt: str, bad: Any) -> None:
    if not isinstance(files, dict) or not files:
        raise bad(f"files is {shown(files)}, expected an object of {{name: {{sha256, bytes}}}}")
    for name, want in files.items():
        if not NAME_RE.fullmatch(name):
            raise bad(f"files names {shown(name)}, not a plain file name of this directory")
        if not (isinstance(want, dict) and isinstance(want.get("sha256"), str) and _SHA_RE.fullmatch(want["sha256"])
                and type(want.get("bytes")) is int and want["bytes"] >= 0):
            raise bad(f"files[{name!r}] is {shown(want)}, expected {{sha256: 64 hex digits, bytes: integer >= 0}}")
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
        raise ArtifactError(f"{where}: signature is {shown(sig)}, not 64 hex digits: refused; {fix}")
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
        raise bad(f"holds {shown(m)}, expected a JSON object")
    if signing_key is not None:
        check_signature(m, signing_key, where)
    afv = m.get("artifact_format_version")
    if type(afv) is not int or afv != ARTIFACT_FORMAT_VERSION:
        raise ArtifactError(f"{where}: artifact format {shown(afv)}, this streamrec reads {ARTIFACT_FORMAT_VERSION}; "
                            f"{_NEWER if isinstance(afv, int) and afv > ARTIFACT_FORMAT_VERSION else _REBUILD}")
    missing = [k for k in ("version", "created", "created_utc", "format", "source", "feature_config", "model",
                           "scorer", "hot_set", "files") if k not in m]
    if missing:
        raise bad(f"missing {', '.join(missing)}")
    if not (isinstance(m["version"], str) and NAME_RE.fullmatch(m["version"])):
        raise bad(f"version is {shown(m['version'])}, expected a plain name (letters, digits, . _ -)")
    if not num(m["created"]) or not isinstance(m["created_utc"], str):
        raise bad(f"created {shown(m['created'])} / created_utc {shown(m['created_utc'])}: expected a unix time "
                  "and a string")
    fmt = m["format"]
    if isinstance(fmt, str) and fmt not in FORMATS and NAME_RE.fullmatch(fmt):  # a format added after this version
        raise ArtifactError(f"{where}: format {fmt!r} is not one this streamrec reads ({', '.join(FORMATS)}); {_NEWER}")
    if not isinstance(fmt, str) or fmt not in FORMATS:
        raise bad(f"format is {shown(fmt)}, expected one of {', '.join(FORMATS)}")
    for key in ("model", "hot_set"):
        if not isinstance(m[key], dict):
            raise bad(f"{key} is {shown(m[key])}, expected an object")
    _check_source(m["source"], bad)
    _check_files(m["files"], fmt, bad)
    cfg = feature_config_from(m["feature_config"], where)
    sc = m["scorer"]
    ok = (isinstance(sc, dict) and all(type(sc.get(k)) is int for k in ("num_fields", "dim", "num_dense"))
          and isinstance(sc.get("mlp"), list) and all(type(x) is int and 1 <= x <= 1 << 20 for x in sc["mlp"])
          and num(sc.get("dropout")) and 0 <= sc["dropout"] < 1)
    if not ok:
        raise bad(f"scorer is {shown(sc)}, expected {{num_fields, dim, num_dense, mlp: [sizes], dropout}}")
    layout = sc.get("input_layout", CANDIDATE_ROWS_LAYOUT)  # absent: a scorer from before the user-row layout
    if type(layout) is not int or layout not in SCORER_LAYOUTS:
        raise ArtifactError(f"{where}: scorer input_layout {shown(layout)}, this streamrec reads "
                            f"{', '.join(map(str, SCORER_LAYOUTS))}; "
                            f"{_NEWER if isinstance(layout, int) and layout > max(SCORER_LAYOUTS) else _REBUILD}")
    if layout == POOLING_GRAPH_LAYOUT and fmt not in ONNX_FORMATS:
        raise bad(f"scorer input_layout {layout} (a pooling ONNX graph) with format {fmt!r}")
    if (sc["num_fields"], sc["dim"], sc["num_dense"]) != (cfg.num_fields, cfg.embedding_dim, len(cfg.dense)):
        raise bad(f"scorer (fields {sc['num_fields']}, dim {sc['dim']}, dense {sc['num_dense']}) does not match the "
                  f"feature config ({cfg.num_fields}, {cfg.embedding_dim}, {len(cfg.dense)})")
    return m


def check_checkpoint(checkpoint: Any) -> FeatureConfig:
    """That ``checkpoint`` (``learner.checkpoint_read.load_latest``) can become an artifact; returns its config.

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
        raise ArtifactError(f"{where}: meta.model is {shown(ms)}, expected the model settings with mlp")
    try:
        layers_ok = all(x >= 1 for x in parse_mlp(ms["mlp"]))
    except (ValueError, TypeError):
        layers_ok = False
    if not layers_ok or not num(ms.get("dropout", 0.0)):
        raise ArtifactError(f"{where}: meta.model mlp {shown(ms['mlp'])} / dropout {shown(ms.get('dropout'))} "
                            "are not layer sizes and a rate")
    samples = meta.get("samples_trained")
    if not (type(samples) is int and samples >= 0):
        raise ArtifactError(f"{where}: meta.samples_trained is {shown(samples)}, expected an integer >= 0")
    delta_seq = meta.get("delta_seq")
    if delta_seq is not None and not (type(delta_seq) is int and delta_seq >= 0):
        raise ArtifactError(f"{where}: meta.delta_seq is {shown(delta_seq)}, expected an integer >= 0 or null")
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
        raise ArtifactError(f"{where}: its dense weights do not match its model settings (mlp {shown(ms['mlp'])}, "
                            f"{cfg.num_fields} fields, dim {cfg.embedding_dim}, {len(cfg.dense)} dense): "
                            f"{'; '.join(parts)}")


def read_manifest(version_dir: Path, signing_key: SigningKey | None = None) -> dict[str, Any]:
    """The checked manifest of ``version_dir`` (:func:`decode_manifest`, with ``signing_key`` its signature
    first); ArtifactError if missing or bad, or when the directory or the manifest is a symlink leaving the
    directory that holds it."""
    version_dir = check_version_dir(version_dir)
    path = version_dir / MANIFEST
    resolve_inside(path, version_dir, "the manifest must be a file of its version directory")
    try:
        raw = read_regular(path, _MAX_MANIFEST)
        if len(raw) > _MAX_MANIFEST:
            raise ArtifactError(f"{path} has more than a manifest's {_MAX_MANIFEST} bytes: the artifact is corrupt")
    except FileNotFoundError:
        raise ArtifactError(f"{path} is missing: {version_dir} is not a complete artifact") from None
    except OSError as exc:  # (a directory, a FIFO: read_regular's ArtifactError)
        raise ArtifactError(f"{path} cannot be read ({exc}); check the publish root's permissions") from None
    return decode_manifest(raw, path, signing_key)
