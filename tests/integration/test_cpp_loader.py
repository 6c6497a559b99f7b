"""C++ loading (issue 17, item 4): serving/cpp's streamrec_score, built with cmake against the libtorch inside the
torch wheel, loads the TorchScript artifact and scores a request exactly as the Python server does.

The build is part of the test (one per session, in a temp directory: ~25 s on 2 cores); a missing cmake or
compiler, or a build error, FAILS the test with the tool's output - it never skips. The Python side is the real
request path: ``ScoringApp.handle("POST", "/v1/score", body)`` over the published artifact, with the user's
history; the C++ side gets the same request's row tensors from ``serving/cpp_request.py``.

Tolerance: none. The C++ program runs the same TorchScript graph on the same float32 inputs in the same
libtorch, and prints each probability with 9 significant digits (float32 round-trips), so the scores are
expected bit-identical (observed: max |difference| 0.0). A C++ build against another libtorch may differ by ~1e-7.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from learner.config import Device
from serving.app import JSON, ScoringApp
from serving.cpp_request import encode_request, read_inputs, write_inputs
from serving.cpp_request import main as cpp_request_main
from serving.metrics import ServingMetrics
from serving.model import ScoringModel
from serving.settings import ServeSettings
from serving.swap import ModelHolder, ModelUpdater
from stream.features import hash_value
from stream.ids import stable_hash
from tests.integration.test_serving import CFG, REQUEST, TinyLearner, publish_version

CPP_DIR = Path(__file__).resolve().parents[2] / "serving" / "cpp"
BUILD_TIMEOUT_S = 300


# -- the C++ program, built once per session ------------------------------------------------------------
def _run_tool(cmd: list[str], what: str) -> str:
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
    except FileNotFoundError as exc:
        pytest.fail(f"{what}: {cmd[0]} is not installed ({exc}); the C++ loader test needs cmake and a C++ compiler")
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{what}: timed out after {BUILD_TIMEOUT_S} s:\n{exc.stdout!s}\n{exc.stderr!s}")
    if proc.returncode != 0:
        pytest.fail(f"{what} failed (exit {proc.returncode}): {' '.join(cmd)}\n{proc.stdout}\n{proc.stderr}")
    return proc.stdout


@pytest.fixture(scope="session")
def streamrec_score(tmp_path_factory: pytest.TempPathFactory) -> Path:
    build = tmp_path_factory.mktemp("cpp_build")
    t0 = time.monotonic()
    _run_tool(["cmake", "-S", str(CPP_DIR), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release",
               f"-DCMAKE_PREFIX_PATH={torch.utils.cmake_prefix_path}"], "cmake configure")
    _run_tool(["cmake", "--build", str(build), "-j2"], "cmake build")
    exe = build / "streamrec_score"
    assert exe.is_file(), f"the build left no {exe}"
    print(f"streamrec_score built in {time.monotonic() - t0:.1f} s")
    return exe


def cpp(exe: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([str(exe), *args], capture_output=True, text=True, timeout=120)
    if check:
        assert proc.returncode == 0, f"streamrec_score {' '.join(args)}: exit {proc.returncode}\n{proc.stderr}"
    return proc


def cpp_scores(exe: Path, version_dir: Path, request_dir: Path) -> np.ndarray:
    out = cpp(exe, "score", str(version_dir), str(request_dir)).stdout
    return np.array([float(x) for x in out.split()], dtype=np.float32)


# -- the Python server over a published artifact ---------------------------------------------------------
class FakeHistory:
    """``UserHistory.as_of`` over a dict (user hash -> clicked item hashes, oldest first)."""

    def __init__(self, clicks: dict[int, list[int]]) -> None:
        self.clicks = clicks

    def as_of(self, users: list[int], _ts: list[int]) -> list[list[int]]:
        return [list(self.clicks.get(u, [])) for u in users]


def make_app(root: Path, history: FakeHistory) -> ScoringApp:
    ss = ServeSettings(port=0, publish_root=root, device=Device.CPU)  # the C++ program scores on the CPU
    holder = ModelHolder()
    metrics = ServingMetrics(holder.model)
    ModelUpdater(holder, metrics, root, None, device="cpu").check_now()  # what ScoringService.start does first
    return ScoringApp(ss, holder, metrics, history, version="test")  # type: ignore[arg-type]  # a duck


def served_scores(app: ScoringApp, request: dict[str, Any]) -> np.ndarray:
    status, ctype, body = app.handle("POST", "/v1/score", json.dumps(request).encode())
    assert (status, ctype) == (200, JSON), body
    return np.array(json.loads(body)["scores"], dtype=np.float32)  # float64 of the float32 scores: exact


USER_HISTORY = [17, "i9", 3]  # raw item ids, oldest first


def big_request(seed: int, n: int = 100) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    items: list[Any] = [int(x) for x in rng.integers(0, 1000, n)]
    items[::7] = [{"item_id": f"s{k}", "context": {"genres": ["Drama", str(k % 5)]}, "dense": {"price": k / 10}}
                  for k in range(len(items[::7]))]
    return {"user_id": 4242, "items": items, "context": {"device": "android", "year": 1997}, "dense": {"price": 0.5}}


@pytest.fixture(scope="module")
def published(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(publish root, version dir): a third of the rows hot, so both the hot and the cold path score."""
    root = tmp_path_factory.mktemp("cpp") / "serving"
    version_dir = publish_version(TinyLearner(seed=5), root, "v001")
    return root, version_dir


# -- tests -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("request_name", ["readme_request", "100_candidates"])
def test_cpp_scores_equal_the_python_servers(streamrec_score: Path, published: tuple[Path, Path], tmp_path: Path,
                                             request_name: str) -> None:
    root, version_dir = published
    request: dict[str, Any] = REQUEST if request_name == "readme_request" else big_request(seed=3)
    history = [hash_value(x) for x in USER_HISTORY]
    app = make_app(root, FakeHistory({hash_value(request["user_id"]): history}))
    served = served_scores(app, request)

    model = ScoringModel.load(version_dir)
    values, offsets, dense = encode_request(model, request, history)
    request_dir = write_inputs(tmp_path / "req", values, offsets, dense)
    # both paths of the scorer are exercised: rows among its hot buffer and rows handed in from cold_rows.npy
    model.score_request(torch.from_numpy(values), torch.from_numpy(offsets), torch.from_numpy(dense))
    assert model.hot_lookups > 0 and model.cold_lookups > 0

    got = cpp_scores(streamrec_score, version_dir, request_dir)
    assert got.shape == served.shape == (len(request["items"]),)
    diff = float(np.max(np.abs(got - served)))
    assert np.array_equal(got, served), f"C++ and Python scores differ: max |difference| {diff:.3g}"


def test_the_cli_writes_the_files_the_cpp_program_reads_and_prints_the_same_scores(
        streamrec_score: Path, published: tuple[Path, Path], tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    _, version_dir = published
    body = tmp_path / "request.json"
    body.write_text(json.dumps(big_request(seed=8, n=20)))
    assert cpp_request_main([str(version_dir), str(body), str(tmp_path / "req"), "--history", *map(str, USER_HISTORY),
                             "--scores"]) == 0
    python_out = capsys.readouterr().out
    values, offsets, dense = read_inputs(tmp_path / "req")
    assert (values.dtype, offsets.dtype, dense.dtype) == (np.int64, np.int64, np.float32)
    assert len(offsets) == CFG.num_fields * (20 + 1) + 1 and dense.shape == (20, len(CFG.dense))  # (F + F*B + 1,)
    assert cpp(streamrec_score, "score", str(version_dir), str(tmp_path / "req")).stdout == python_out


def test_cpp_stable_hash_equals_stream_ids(streamrec_score: Path) -> None:
    """What a C++ service must reproduce to build rows itself: BLAKE2b-64 of the id's text (stream/ids.py)."""
    ids: list[Any] = [0, 1, 123, 2**63 - 1, "123", "u42", "i7", "", "Drama", "é漢字🙂", "x" * 127, "y" * 128,
                      "z" * 129, "w" * 1000, True, False, 1.5]
    texts = [x if isinstance(x, str) else str(x) for x in ids]  # the canonical text stable_hash hashes
    out = cpp(streamrec_score, "hash", *texts).stdout.split()
    assert [int(x) for x in out] == [stable_hash(x) for x in ids]


def test_cpp_refuses_inputs_it_cannot_score(streamrec_score: Path, published: tuple[Path, Path],
                                            tmp_path: Path) -> None:
    _, version_dir = published
    n = CFG.num_fields
    offsets = np.arange(n + 1, dtype=np.int64)
    bad_row = write_inputs(tmp_path / "bad_row", np.full(n, CFG.num_rows, np.int64), offsets,
                           np.zeros((1, len(CFG.dense)), np.float32))
    proc = cpp(streamrec_score, "score", str(version_dir), str(bad_row), check=False)
    assert proc.returncode == 1 and f"rows must lie in [0, {CFG.num_rows})" in proc.stderr
    wrong_dtype = tmp_path / "wrong_dtype"
    shutil.copytree(bad_row, wrong_dtype)
    np.save(wrong_dtype / "values.npy", np.zeros(n, np.int32))
    proc = cpp(streamrec_score, "score", str(version_dir), str(wrong_dtype), check=False)
    assert proc.returncode == 1 and "values.npy: dtype <i4, expected <i8" in proc.stderr
    proc = cpp(streamrec_score, "score", str(tmp_path / "nowhere"), str(bad_row), check=False)
    assert proc.returncode == 1 and "scorer.pt" in proc.stderr


def test_an_artifact_from_before_the_user_row_layout_is_refused_with_the_fix(
        streamrec_score: Path, published: tuple[Path, Path], tmp_path: Path) -> None:
    """The C++ program hands the scorer the user-row layout; a manifest without ``scorer.input_layout`` (a scorer
    that takes the per-candidate layout) is refused, naming the republish, instead of scoring garbage."""
    _, version_dir = published
    old = tmp_path / "old"
    shutil.copytree(version_dir, old)
    manifest = json.loads((old / "manifest.json").read_text())
    del manifest["scorer"]["input_layout"]
    (old / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True))
    model = ScoringModel.load(version_dir)
    values, offsets, dense = encode_request(model, REQUEST, [hash_value(x) for x in USER_HISTORY])
    request_dir = write_inputs(tmp_path / "req", values, offsets, dense)
    assert cpp(streamrec_score, "score", str(version_dir), str(request_dir)).returncode == 0
    proc = cpp(streamrec_score, "score", str(old), str(request_dir), check=False)
    assert proc.returncode == 1 and "input_layout 1" in proc.stderr and "streamrec refresh --now" in proc.stderr
