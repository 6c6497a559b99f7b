"""A manifest or a tensor pack's header (deltas, id maps) with a key repeated in one JSON object, at any depth, is
refused with the reason, as an event with a repeated key is (``stream.events.reject_duplicate_keys``).

``json.loads`` keeps the last of repeated keys silently, while another reader may take the first: the C++ loader
(``serving/cpp/score.cpp``) finds the manifest's first ``"scorer"``, so one manifest meant two things to two readers,
and a signature (computed over the parsed manifest) covered only the one Python saw."""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from cache_refresh.publish import publish
from learner import artifact_manifest as M
from learner import artifact_versions as V
from learner import tensorpack
from learner.artifact import build_artifact
from learner.artifact_manifest import decode_manifest
from learner.artifact_versions import ArtifactError
from learner.deltas import FORMAT, KIND, DeltaError, decode_delta
from serving.model import ScoringModel
from tests.unit.learner.test_artifact import make_checkpoint


@pytest.fixture(scope="module")
def manifest_text(tmp_path_factory: pytest.TempPathFactory) -> str:
    root = tmp_path_factory.mktemp("serving")
    v = publish(root, build_artifact(make_checkpoint(), root, np.arange(10)), keep=3)
    return (v / M.MANIFEST).read_text()


def with_duplicate(text: str, inside: str | None, key: str, value: object) -> str:
    """``text`` (a JSON object) with ``"key": value`` put first in the object under ``inside`` (the top level when
    None), before the key's own entry there: a parser keeping the last entry sees the original value."""
    m = json.loads(text)
    anchor = "{" if inside is None else f'"{inside}": {{'
    assert key in (m if inside is None else m[inside]) and anchor in text
    return text.replace(anchor, anchor + f'"{key}": {json.dumps(value)}, ', 1)


@pytest.mark.parametrize("inside, key, value", [
    (None, "scorer", {"num_fields": 1, "dim": 1, "num_dense": 0, "mlp": [1], "dropout": 0.0}),
    (None, "version", "other"),
    ("files", M.COLD_FILE, {"sha256": "0" * 64, "bytes": 1}),
    ("scorer", "mlp", [4]),
])
def test_a_manifest_with_a_repeated_key_at_any_level_is_refused_naming_it(
        manifest_text: str, inside: str | None, key: str, value: object) -> None:
    raw = with_duplicate(manifest_text, inside, key, value).encode()
    decode_manifest(manifest_text.encode())  # the manifest itself is good
    with pytest.raises(ArtifactError, match=f"duplicate key '{key}'"):
        decode_manifest(raw)


def test_serving_refuses_a_published_manifest_with_a_repeated_key(tmp_path: Path) -> None:
    v = publish(tmp_path, build_artifact(make_checkpoint(), tmp_path, np.arange(10)), keep=3)
    text = (v / M.MANIFEST).read_text()
    (v / M.MANIFEST).write_text(with_duplicate(text, None, "format", "eager"))
    with pytest.raises(ArtifactError, match="duplicate key 'format'"):
        ScoringModel.load(v)


def repack_header(raw: bytes, header: bytes) -> bytes:
    """An unsigned pack ``raw`` with its header replaced by ``header`` (length and checksum made right again)."""
    assert raw[:8] == tensorpack.MAGIC
    (hlen,) = struct.unpack("<Q", raw[40:48])
    body = struct.pack("<Q", len(header)) + header + raw[48 + hlen:]
    return raw[:8] + hashlib.sha256(body).digest() + body


def test_a_tensor_pack_header_with_a_repeated_key_is_refused() -> None:
    raw = tensorpack.pack({"kind": "a", "rows": torch.arange(3)})
    (hlen,) = struct.unpack("<Q", raw[40:48])
    header = raw[48:48 + hlen].rstrip()
    assert tensorpack.unpack(repack_header(raw, header))["kind"] == "a"  # the rebuilt pack itself is good
    forged = header.replace(b'"kind"', b'"kind": "b", "kind"', 1)
    with pytest.raises(tensorpack.PackError, match="duplicate key 'kind'"):
        tensorpack.unpack(repack_header(raw, forged))


def test_a_delta_whose_header_repeats_a_key_is_a_delta_error() -> None:
    raw = tensorpack.pack({"kind": KIND, "format": FORMAT})
    (hlen,) = struct.unpack("<Q", raw[40:48])
    header = raw[48:48 + hlen].rstrip()
    forged = header.replace(b'"format"', b'"format": %d, "format"' % (FORMAT + 1), 1)
    with pytest.raises(DeltaError, match="duplicate key 'format'"):
        decode_delta(repack_header(raw, forged), Path("d.delta"))


def test_a_rollback_pin_with_a_repeated_version_is_an_unreadable_pin_holding_whatever_is_live(tmp_path: Path) -> None:
    (tmp_path / V.PIN).write_text('{"version": "v001", "rolled_back_from": "v002", "at": 1.0}')
    assert V.read_pin(tmp_path) == V.Pin("v001", "v002", 1.0)
    (tmp_path / V.PIN).write_text('{"version": "v002", "version": "v001", "rolled_back_from": "v002", "at": 1.0}')
    pin = V.read_pin(tmp_path)
    assert pin is not None and pin.version is None and "duplicate key 'version'" in (pin.problem or "")
