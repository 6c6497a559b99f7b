"""The scorer's user-row input layout (learner/scorer.py, issue 17 item 7): a request's user-side bags are pooled once
and added to every candidate, in every artifact format, with the scores of the per-candidate layout it replaces.

Tolerance: none against the per-candidate path (the same bags summed in the same order, then ``x + 0.0``:
observed bit-identical; ONNX Runtime's formats 1e-6, its Gemm is not bitwise repeatable from call to call), 1e-6
against the learner's eager fp32 DeepFM (as tests/unit/learner/test_artifact.py); the two reduced-precision
formats are held to it on their fp32 path (``fp32=True``).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from learner.artifact import build_artifact
from learner.artifact_manifest import decode_manifest
from learner.artifact_versions import ArtifactError
from learner.features import FeatureConfig
from learner.scorer import (
    CALIBRATED_FORMATS,
    CANDIDATE_ROWS_LAYOUT,
    FORMATS,
    POOLING_GRAPH_LAYOUT,
    REDUCED_PRECISION_FORMATS,
    USER_ROW_LAYOUT,
    Scorer,
    ScorerSpec,
    to_candidate_rows,
    with_empty_user_row,
)
from serving.model import ScoringModel
from stream.files import sha256_file
from tests.unit.learner.test_artifact import CFG, make_checkpoint, reference
from tests.unit.learner.test_onnx_int8_static import calibration_samples

TOL = 1e-6
USER_SIDE = ("user_id", "history", "ctx.device")  # pooled once per request; item_id and ctx.genres per candidate


def request_probe(cfg: FeatureConfig, b: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A random request in the user-row layout: values (N,), offsets (F + F*B + 1,), dense (B, Dd); the user row
    holds USER_SIDE's bags (a history of 0..20 rows), the candidates the others (genres 0..5 rows, empty included)."""
    rng = np.random.default_rng(seed)
    user_values, user_len, cand_values, cand_len = [], [], [], []
    for spec, (first, rows) in zip(cfg.fields, cfg.blocks, strict=True):
        if spec.name in USER_SIDE:
            n = 1 if spec.kind == "single" else int(rng.integers(0, 21))
            user_values.append(first + rng.integers(0, rows, n))
            user_len.append(n)
            cand_len.append(np.zeros(b, np.int64))
        else:
            lens = np.ones(b, np.int64) if spec.kind == "single" else rng.integers(0, 6, b)
            cand_values.append(first + rng.integers(0, rows, int(lens.sum())))
            cand_len.append(lens)
            user_len.append(0)
    lengths = np.concatenate([np.asarray(user_len, np.int64), *cand_len])  # (F + F*B,)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    values = np.concatenate(user_values + cand_values).astype(np.int64)
    dense = rng.normal(size=(b, len(cfg.dense))).astype(np.float32)
    return torch.from_numpy(values), torch.from_numpy(offsets), torch.from_numpy(dense)


def as_batch(values: torch.Tensor, offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    v, o = to_candidate_rows(values.numpy(), offsets.numpy(), CFG.num_fields)
    return torch.from_numpy(v), torch.from_numpy(o)


@pytest.fixture(scope="module")
def ckpt() -> dict:
    return make_checkpoint(seed=3)


# -- the layout's own functions ----------------------------------------------------------------------------
def test_to_candidate_rows_repeats_the_user_row_in_front_of_every_candidates_bag() -> None:
    # F = 2, B = 3: field 0 in the user row (rows 7, 8), field 1 per candidate (1 | none | 2, 3)
    values = np.array([7, 8, 1, 2, 3], np.int64)
    offsets = np.array([0, 2, 2, 2, 2, 2, 3, 3, 5], np.int64)  # user: [7 8] []; cands f0: [] [] []; f1: [1] [] [2 3]
    v, o = to_candidate_rows(values, offsets, 2)
    assert v.tolist() == [7, 8, 7, 8, 7, 8, 1, 2, 3]
    assert o.tolist() == [0, 2, 4, 6, 7, 7, 9]  # (F*B + 1,)


def test_with_empty_user_row_puts_f_empty_bags_in_front_of_a_batch() -> None:
    assert with_empty_user_row(torch.tensor([0, 1, 3, 4]), 3).tolist() == [0, 0, 0, 0, 1, 3, 4]


# -- every format ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", FORMATS)
def test_every_format_scores_a_request_as_the_per_candidate_path_and_the_learner(tmp_path: Path, ckpt: dict,
                                                                                 fmt: str) -> None:
    calibration = [calibration_samples(200)] if fmt in CALIBRATED_FORMATS else None  # its activation scales
    model = ScoringModel.load(build_artifact(ckpt, tmp_path, np.arange(0, CFG.num_rows, 3), format=fmt,
                                             calibration=calibration))
    # the onnx formats' stored graph pools (input layout 3); every format takes requests in the user-row layout
    assert model.input_layout == USER_ROW_LAYOUT
    assert model.spec.input_layout == (POOLING_GRAPH_LAYOUT if fmt.startswith("onnx") else USER_ROW_LAYOUT)
    for b, seed in ((1, 1), (7, 2), (100, 3)):
        values, offsets, dense = request_probe(CFG, b, seed)
        bv, bo = as_batch(values, offsets)
        read = model.hot_lookups + model.cold_lookups
        got = model.score_request(values, offsets, dense)  # (B,)
        assert model.hot_lookups + model.cold_lookups - read == len(values)  # the user's rows once, not per candidate
        assert b == 1 or len(values) < len(bv)
        per_candidate = model.score(bv, bo, dense)  # the user's bags repeated per candidate: the old request path
        assert got.shape == (b,)
        if fmt.startswith("onnx"):  # the same pooled input; ONNX Runtime's threaded Gemm is not bitwise repeatable
            assert torch.allclose(got, per_candidate, atol=TOL, rtol=0), (got - per_candidate).abs().max()
        else:
            assert torch.equal(got, per_candidate), (got - per_candidate).abs().max()
        want = reference(ckpt, bv, bo, dense)
        exact = model.score_request(values, offsets, dense, fp32=True)  # the inexact formats' fp32 path
        assert torch.allclose(exact, want, atol=TOL, rtol=0), (fmt, (exact - want).abs().max())
        if fmt not in REDUCED_PRECISION_FORMATS:
            assert torch.allclose(exact, got, atol=TOL, rtol=0)


def test_a_bag_pooled_once_in_the_user_row_equals_it_pooled_for_each_candidate_bit_for_bit(ckpt: dict) -> None:
    spec = ScorerSpec(CFG.num_fields, CFG.embedding_dim, len(CFG.dense), (32, 16), 0.0)
    table = ckpt["model"]["sparse.bag.weight"]
    hot = torch.arange(0, CFG.num_rows, 2)
    scorer = Scorer(spec, torch.cat([hot, torch.tensor([torch.iinfo(torch.int64).max])]),
                    torch.cat([table[hot], torch.zeros(1, CFG.embedding_dim + 1)])).eval()
    values, offsets, dense = request_probe(CFG, 50, seed=9)
    bv, bo = as_batch(values, offsets)

    def given(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mask = v % 2 == 1  # the odd rows are not hot: handed in
        return table[v] * mask.unsqueeze(1), mask

    with torch.no_grad():
        once = scorer.pool(values, offsets, *given(values))  # (B, F, D + 1)
        repeated = scorer.pool(bv, with_empty_user_row(bo, CFG.num_fields), *given(bv))
        eager = F.embedding_bag(bv, table, bo, mode="mean", include_last_offset=True)  # the learner's pooling
    assert torch.equal(once, repeated)
    assert torch.allclose(once, eager.view(CFG.num_fields, 50, -1).transpose(0, 1), atol=1e-7, rtol=0)


# -- artifacts from before the layout ----------------------------------------------------------------------
class CandidateRowsScorer(Scorer):
    """The scorer as published before the user-row layout: every bag per candidate, offsets (F*B + 1,)."""

    def pool(self, values: torch.Tensor, offsets: torch.Tensor, given_rows: torch.Tensor,
             given_mask: torch.Tensor) -> torch.Tensor:
        hot_ids, hot_vectors = self.hot_ids, self.hot_vectors
        assert isinstance(hot_ids, torch.Tensor) and isinstance(hot_vectors, torch.Tensor)
        pos = torch.searchsorted(hot_ids, values)
        given = given_mask.to(hot_vectors.dtype)
        index = torch.ones_like(values).cumsum(0) - 1
        summed = (F.embedding_bag(pos, hot_vectors, offsets, mode="sum", per_sample_weights=1.0 - given,
                                  include_last_offset=True)
                  + F.embedding_bag(index, given_rows, offsets, mode="sum", per_sample_weights=given,
                                    include_last_offset=True))  # (F*B, D + 1)
        lengths = (offsets[1:] - offsets[:-1]).clamp(min=1).to(summed.dtype).unsqueeze(1)
        return (summed / lengths).view(self.num_fields, -1, self.dim + 1).transpose(0, 1)  # (B, F, D + 1)


def as_published_before_the_layout(version_dir: Path, scorer_file: Path | None) -> None:
    """Rewrite ``version_dir`` as an older refresh wrote it: no ``scorer.input_layout``, and (given) its scorer.pt."""
    manifest = json.loads((version_dir / "manifest.json").read_text())
    del manifest["scorer"]["input_layout"]
    if scorer_file is not None:
        (version_dir / "scorer.pt").write_bytes(scorer_file.read_bytes())
        manifest["files"]["scorer.pt"] = {"sha256": sha256_file(version_dir / "scorer.pt"),
                                          "bytes": (version_dir / "scorer.pt").stat().st_size}
    (version_dir / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True))


def test_an_artifact_from_before_the_user_row_layout_keeps_loading_and_scores_requests_the_same(
        tmp_path: Path, ckpt: dict) -> None:
    new = build_artifact(ckpt, tmp_path / "new", np.arange(0, CFG.num_rows, 3), format="torchscript")
    old = build_artifact(ckpt, tmp_path / "old", np.arange(0, CFG.num_rows, 3), format="torchscript")
    current = ScoringModel.load(new)
    legacy = CandidateRowsScorer(current.spec, *(dict(current._live.scorer.named_buffers())[k]
                                                 for k in ("hot_ids", "hot_vectors")))
    legacy.load_state_dict(current._live.scorer.state_dict())
    torch.jit.save(torch.jit.script(legacy.eval()), str(tmp_path / "legacy.pt"))
    as_published_before_the_layout(old, tmp_path / "legacy.pt")

    model = ScoringModel.load(old)  # the load's probe scores it both ways
    assert model.input_layout == CANDIDATE_ROWS_LAYOUT
    values, offsets, dense = request_probe(CFG, 40, seed=5)
    bv, bo = as_batch(values, offsets)
    assert torch.equal(model.score_request(values, offsets, dense), current.score_request(values, offsets, dense))
    assert torch.equal(model.score(bv, bo, dense), current.score(bv, bo, dense))


def test_a_scorer_that_does_not_take_its_manifests_layout_is_refused_at_load_naming_the_refresh(
        tmp_path: Path, ckpt: dict) -> None:
    staged = build_artifact(ckpt, tmp_path, np.arange(10), format="torchscript")
    as_published_before_the_layout(staged, None)  # a user-row scorer.pt under a manifest that says otherwise
    with pytest.raises(ArtifactError, match=r"streamrec refresh --now"):
        ScoringModel.load(staged)


def test_an_unknown_scorer_input_layout_is_refused_naming_the_refresh(tmp_path: Path, ckpt: dict) -> None:
    staged = build_artifact(ckpt, tmp_path, np.arange(10), format="safetensors")
    manifest = json.loads((staged / "manifest.json").read_text())
    assert manifest["scorer"]["input_layout"] == USER_ROW_LAYOUT
    for bad in (3, "2", None):
        manifest["scorer"]["input_layout"] = bad
        with pytest.raises(ArtifactError, match=r"input_layout .*streamrec refresh --now"):
            decode_manifest(json.dumps(manifest).encode())
