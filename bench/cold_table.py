"""What copying the cold table into memory at load costs (serving.model.ScoringModel.load, in_process mode) against
memory-mapping it (``map``, the code before: a file truncated in place then killed serving with SIGBUS), and what
hashing the bytes copied saves (``copy-after-hash``: a hash pass, then the copy; ``copy``: one read, hashed as copied,
as serving does): load time (verified, page cache warm) and the serving process's RSS (anonymous and file-backed)
after the load and after every row was read once, each mode in a fresh child process, alternated.
Run: python bench/cold_table.py [--rows 10000000] [--rounds 2]"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
# bench/serving.py would shadow the serving package when this runs as a script from bench/
sys.path[:1] = [str(ROOT)]

_CHILD = """
import json, sys, time
import numpy as np
import serving.model as M
from learner.artifact import _check_sha256, map_table, read_table
from stream.files import sha256_file
def hashed_first(load):  # the file hashed in a pass of its own, then loaded: the code before
    def run(fh, sha256=None):
        if sha256 is not None:
            _check_sha256(fh.name, sha256_file(fh), sha256)
        return load(fh)
    return run
if sys.argv[2] == "map":  # before: hashed, then memory-mapped
    M.read_table = hashed_first(map_table)
elif sys.argv[2] == "copy-after-hash":  # hashed, then copied: two reads
    M.read_table = hashed_first(read_table)
def rss():
    f = dict(l.split(":", 1) for l in open("/proc/self/status") if l.startswith(("VmRSS", "RssAnon", "RssFile")))
    return {k: int(v.split()[0]) // 1024 for k, v in f.items()}  # MiB
base = rss()
t = time.perf_counter()
model = M.ScoringModel.load(sys.argv[1], smoke=False)
load_s = time.perf_counter() - t
loaded = rss()
float(np.asarray(model.table[:, 0]).sum())  # every row's page read once: a long-running server's steady state
print(json.dumps({"load_s": load_s, "base": base, "loaded": loaded, "touched": rss()}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rows", type=int, default=10_000_000)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    import numpy as np

    from cache_refresh.publish import publish
    from learner.artifact import build_artifact
    serving_bench = _bench_serving()
    cfg = serving_bench.feature_config(args.rows)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "serving"
        t = time.perf_counter()
        version = publish(root, build_artifact(serving_bench.checkpoint(cfg), root, np.arange(args.rows // 10)),
                          keep=1)
        print(f"artifact of {args.rows:,} rows built in {time.perf_counter() - t:.1f} s: cold table "
              f"{(version / 'cold_rows.npy').stat().st_size / 2**20:.0f} MiB")
        for r in range(args.rounds):
            for mode in ("map", "copy-after-hash", "copy"):
                out = subprocess.run([sys.executable, "-c", _CHILD, str(version), mode], cwd=ROOT, check=True,
                                     capture_output=True, text=True).stdout.strip().splitlines()[-1]
                m = json.loads(out)
                print(f"round {r + 1} {mode:15}: load {m['load_s']:.3f} s; RSS MiB (anon/file) at start "
                      f"{m['base']['RssAnon']}/{m['base']['RssFile']}, loaded {m['loaded']['RssAnon']}/"
                      f"{m['loaded']['RssFile']}, every row read {m['touched']['RssAnon']}/{m['touched']['RssFile']}")


def _bench_serving() -> Any:
    import importlib.util
    spec = importlib.util.spec_from_file_location("bench_serving", ROOT / "bench" / "serving.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


if __name__ == "__main__":
    main()
