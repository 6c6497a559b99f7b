"""Peak memory of serving's read of one large learner delta: the file read into one writable buffer that the
decoded tensors are views of (``learner.deltas.load_delta``, since 2026-12-04) against the same file read as
``bytes`` and decoded (``decode_delta(path.read_bytes())``: each tensor copied out of them). The loader before the
buffer (read with a 4 GiB size hint, ``bytes`` copied again, each tensor copied, a whole-tensor finiteness mask)
measured 3.67x the file's size in peak RSS growth on the same delta (2026-12-04, a scratch script).

Each read runs in a fresh process (peak RSS is per process: ``ru_maxrss``), after its imports; the figure is the
growth of the peak RSS over the process's own before the read, and tracemalloc's peak, each over the file's size.
Writes the delta (in another process: a child's peak RSS starts at its parent's) (``--rows`` x ``--dim`` float32
vectors, the default 2 M x 33 ~ 280 MB) to a temporary directory first.

    python bench/delta_memory.py                # 2 M rows
    python bench/delta_memory.py --rows 500000  # quicker
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
from pathlib import Path
sys.path.insert(0, {root!r})
import torch
from learner.deltas import DeltaWriter
w = DeltaWriter(Path({directory!r}), {rows}, every_s=1.0)
g = torch.Generator().manual_seed(0)
w.write_rows(torch.arange({rows}), torch.randn({rows}, {dim}, generator=g),
             {{"bias": torch.zeros(1), "w": torch.randn(64, 64, generator=g)}}, 1000)
"""

_CHILD = """
import json, resource, sys, tracemalloc
from pathlib import Path
sys.path.insert(0, {root!r})
from learner.deltas import decode_delta, list_deltas, load_delta
(_, _, path), = list_deltas(Path({directory!r}))
size = path.stat().st_size
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
tracemalloc.start()
d = load_delta(path) if {mode!r} == "buffer" else decode_delta(path.read_bytes(), path)
_, peak = tracemalloc.get_traced_memory()
grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
print(json.dumps({{"size": size, "rss_growth": grown, "tracemalloc_peak": peak, "rows": int(d.rows.numel())}}))
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=2_000_000)
    ap.add_argument("--dim", type=int, default=33, help="values per row (embedding dim + 1)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        # written by a child too: this process stays small, since a child's peak RSS starts at its parent's at fork
        subprocess.run([sys.executable, "-c", _WRITE.format(root=str(ROOT), directory=tmp, rows=args.rows,
                                                            dim=args.dim)], check=True)
        out = {}
        for mode in ("bytes", "buffer"):
            code = _CHILD.format(root=str(ROOT), directory=tmp, mode=mode)
            res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
            r = json.loads(res.stdout.strip().splitlines()[-1])
            out[mode] = {"rss_growth_mb": round(r["rss_growth"] / 1e6, 1),
                         "rss_growth_x_file": round(r["rss_growth"] / r["size"], 2),
                         "tracemalloc_peak_x_file": round(r["tracemalloc_peak"] / r["size"], 2)}
            size_mb = round(r["size"] / 1e6, 1)
    print(f"delta of {args.rows:,} rows x {args.dim}: {size_mb} MB")
    for mode, label in (("bytes", "read as bytes, tensors copied out"), ("buffer", "one buffer, tensors views of it")):
        o = out[mode]
        print(f"  {label:40s} peak RSS +{o['rss_growth_mb']} MB ({o['rss_growth_x_file']}x the file), "
              f"tracemalloc peak {o['tracemalloc_peak_x_file']}x")
    print(json.dumps({"bench": "delta_memory", "file_mb": size_mb, **out}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
