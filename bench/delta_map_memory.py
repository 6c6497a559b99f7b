"""Peak memory and time of serving applying one learner delta's id maps: the new ``RowMapper`` built from the
delta's state beside the live one (``ScoringModel.apply_delta``), as lookups-only maps (serving's, since 2026-12-06)
against the learner's full maps (what serving built before: candidates and scratch too, 207 MiB per field at
capacity 1 M). ``default_config(id_capacity=N, admit_after=2)``: user and item ids dynamic, each map holding 0.9 N
admitted ids and 0.3 N candidates.

Each apply runs in a fresh process after the state is loaded and the live mapper built; the figure is the growth of
the peak RSS (``VmHWM``, reset through ``/proc/self/clear_refs``) over the RSS before, and tracemalloc's peak.

    python bench/delta_map_memory.py                      # id_capacity 200 k and 1 M
    python bench/delta_map_memory.py --capacity 200000    # quicker
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_WRITE = """
import sys
sys.path.insert(0, {root!r})
import numpy as np, torch
from learner.features import default_config
from learner.row_mapper import RowMapper
n = {n}
m = RowMapper(default_config({{}}, id_capacity=n, admit_after=2))
rng = np.random.default_rng(0)
for idm in m.maps.values():
    keys = rng.choice(1 << 40, size=int(1.2 * n), replace=False).astype(np.int64)
    idm.lookup(keys[:int(0.9 * n)], 1.0); idm.lookup(keys[:int(0.9 * n)], 2.0)  # admitted (admit_after=2)
    idm.lookup(keys[int(0.9 * n):], 3.0)  # candidates
torch.save(m.state_dict(), {path!r})
"""

_CHILD = """
import gc, json, sys, time, tracemalloc
from pathlib import Path
sys.path.insert(0, {root!r})
import torch
from learner.features import default_config
from learner.row_mapper import RowMapper
def status(field):
    return next(int(x.split()[1]) * 1024 for x in Path("/proc/self/status").read_text().splitlines()
                if x.startswith(field))
cfg, state = default_config({{}}, id_capacity={n}, admit_after=2), torch.load({path!r}, weights_only=True)
live = RowMapper.from_state(cfg, state, lookups_only={lookups_only})
gc.collect()
before = status("VmRSS:")
Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
tracemalloc.start()
t0 = time.perf_counter()
new = RowMapper.from_state(cfg, state, lookups_only={lookups_only})
seconds = time.perf_counter() - t0
peak = tracemalloc.get_traced_memory()[1]
print(json.dumps({{"seconds": seconds, "rss": status("VmHWM:") - before, "tracemalloc": peak,
                  "maps": sum(m.nbytes() for m in new.maps.values()), "rss_before": before}}))
"""


def _run(code: str) -> str:
    return subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--capacity", type=int, action="append", help="id_capacity (repeat; default 200 k and 1 M)")
    args = ap.parse_args()
    mib = 2 ** 20
    print("| id_capacity | maps | apply s | peak RSS growth MiB | tracemalloc peak MiB | maps MiB | RSS before MiB |")
    print("|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for n in args.capacity or [200_000, 1_000_000]:
            path = str(Path(tmp) / f"maps-{n}.pt")
            _run(_WRITE.format(root=str(ROOT), n=n, path=path))
            for kind, lookups_only in (("learner's (before)", False), ("lookups only (now)", True)):
                r = json.loads(_run(_CHILD.format(root=str(ROOT), n=n, path=path, lookups_only=lookups_only)))
                print(f"| {n:,} | {kind} | {r['seconds']:.2f} | {r['rss'] / mib:.0f} | {r['tracemalloc'] / mib:.0f} "
                      f"| {r['maps'] / mib:.0f} | {r['rss_before'] / mib:.0f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
