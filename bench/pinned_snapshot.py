"""The cost of serving's one-snapshot request path (serving.model.PinnedModel) against mapping and scoring on the live
model directly: encode + score of 1 user x 100 candidates on the small trained artifact of the unit tests, in this
process, best of 5 x 200 calls per round. Run: python bench/pinned_snapshot.py [--rounds 3]"""

from __future__ import annotations

import argparse
import sys
import tempfile
import timeit
from pathlib import Path

import torch

# bench/serving.py would shadow the serving package when this runs as a script from bench/
sys.path[:1] = [str(Path(__file__).resolve().parents[1])]

from serving.features import FeatureEncoder  # noqa: E402
from serving.model import ScoringModel  # noqa: E402
from serving.request import parse_request  # noqa: E402
from tests.unit.serving.test_unknown_ids import trained_artifact  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    model = ScoringModel.load(trained_artifact(Path(tempfile.mkdtemp())))
    enc = FeatureEncoder(model)
    req = parse_request({"user_id": 5, "items": list(range(100))}, max_candidates=100)

    def direct() -> torch.Tensor:
        v, o, d = enc.encode(req, [])
        return model.score_request(torch.from_numpy(v), torch.from_numpy(o), torch.from_numpy(d))

    def pinned() -> torch.Tensor:
        pin = model.pinned()
        v, o, d = enc.encode(req, [], None, 10**6, pin)
        return pin.score_request(torch.from_numpy(v), torch.from_numpy(o), torch.from_numpy(d))

    direct(), pinned()  # warm up
    for r in range(args.rounds):
        a = min(timeit.repeat(direct, number=200, repeat=5)) / 200 * 1e6
        b = min(timeit.repeat(pinned, number=200, repeat=5)) / 200 * 1e6
        print(f"round {r}: direct {a:.1f} us, pinned {b:.1f} us, ratio {b / a:.3f}")


if __name__ == "__main__":
    main()
