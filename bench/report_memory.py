"""Memory of ``streamrec report``'s read of a run log (``monitor.report.read_run_log``) per byte of the log.

Writes a run log the monitor could have written (``--scrapes`` cycles, 10 s apart, of a learner, a joiner and
serving, each scrape with what they export: per-partition lags and watermarks, per-field coverage and bucket shares,
the gradient-norm histogram's buckets, per-tier lookups; with ``--undrawn``, also the series no section of the report
draws that the learner exports, per-field gradient-norm and time-to-admission histograms, ~3/4 of the samples as in
the ML-1M demo's run log; a clock step back half-way), then reads it in a fresh process (peak RSS is per process:
``ru_maxrss``) after its imports, and again under tracemalloc (which grows RSS itself). Prints the log's size, the
growth of the peak RSS over the process's own before the read and tracemalloc's peak, each also over the log's size.
``--root`` reads it with another tree's ``monitor.report`` (a ``git archive`` of main: before and after on one log).

    python bench/report_memory.py                  # 4,600 cycles, ~27 MiB
    python bench/report_memory.py --scrapes 1000   # quicker
    python bench/report_memory.py --undrawn --root /tmp/report_mem_base   # main's read of the same log
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
FIELDS = [f"f{i:02d}_{name}" for i, name in enumerate(("user_id", "item_id", "device", "city", "position", "hour",
                                                        "weekday", "genre", "age", "gender", "zip", "occupation"))]

_CHILD = """
import json, resource, sys, tracemalloc
sys.path.insert(0, {root!r})
from monitor import report
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
if {traced!r}:
    tracemalloc.start()
rec = report.read_run_log({path!r})
_, peak = tracemalloc.get_traced_memory()
grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
print(json.dumps({{"rss_growth": grown, "tracemalloc_peak": peak,
                   "scrapes": sum(len(s) for s in rec.scrapes.values())}}))
"""


NORM_LE = ("1e-08", "1e-07", "1e-06", "1e-05", "0.0001", "0.001", "0.01", "0.03", "0.1", "0.3", "1.0", "3.0", "10.0",
           "100.0", "+Inf")  # learner/daemon.py _NORM_BUCKETS
ADMISSION_LE = ("1.0", "10.0", "60.0", "300.0", "900.0", "3600.0", "14400.0", "43200.0", "86400.0", "259200.0",
                "604800.0", "2592000.0", "+Inf")  # learner/daemon.py TIME_TO_ADMISSION_BUCKETS


def histogram(name: str, labels: dict[str, str], les: tuple[str, ...], n: int) -> list[list[Any]]:
    """A histogram's series as the learner exports them, ``n`` observations spread over its buckets."""
    return [*([f"{name}_bucket", {**labels, "le": le}, n * (k + 1) // len(les)] for k, le in enumerate(les)),
            [f"{name}_sum", labels, 0.3 * n], [f"{name}_count", labels, n]]


def undrawn_of(i: int) -> list[list[Any]]:
    """The learner's series no section of the report reads: a gradient-norm histogram per field, a time-to-admission
    histogram per dynamic-id field."""
    return [*(s for f in FIELDS for s in histogram("streamrec_learner_field_grad_norm", {"field": f}, NORM_LE, 10 * i)),
            *(s for f in FIELDS[:3] for s in histogram("streamrec_learner_id_time_to_admission_seconds", {"field": f},
                                                       ADMISSION_LE, i))]


def samples_of(source: str, i: int, rng: random.Random, undrawn: bool = False) -> list[list[Any]]:
    """What one scrape of ``source`` records at cycle ``i``: streamrec_* series only, as RunLog writes them."""
    if source == "learner":
        out: list[list[Any]] = [["streamrec_learner_samples_total", {}, 500 * i],
                                ["streamrec_learner_served_auc", {}, 0.7 + rng.random() / 100],
                                ["streamrec_learner_served_ne", {}, 0.9 + rng.random() / 100],
                                ["streamrec_learner_window_auc", {}, 0.71],
                                ["streamrec_learner_event_time_seconds", {}, 978_300_000 + 60 * i],
                                ["streamrec_learner_rss_bytes", {}, 2e9 + i]]
        out += [["streamrec_learner_lag_samples", {"partition": str(p)}, rng.randrange(10)] for p in range(8)]
        out += [[f"streamrec_learner_{m}", {"field": f}, rng.random()] for f in FIELDS
                for m in ("field_coverage", "bucket_share", "id_occupancy")]
        for part in ("dense", "embedding"):
            n = 10 * i
            out += [["streamrec_learner_grad_norm_bucket", {"part": part, "le": le}, int(n * q)]
                    for le, q in (("0.01", 0.1), ("0.1", 0.4), ("1.0", 0.8), ("10.0", 0.95), ("+Inf", 1.0))]
            out += [["streamrec_learner_grad_norm_sum", {"part": part}, 0.3 * n],
                    ["streamrec_learner_grad_norm_count", {"part": part}, n]]
        return out + (undrawn_of(i) if undrawn else [])
    if source == "joiner":
        out = [["streamrec_join_samples_total", {}, 480 * i], ["streamrec_join_pending_impressions", {}, 900],
               ["streamrec_events_total", {"stage": "join", "topic": "impressions"}, 500 * i],
               ["streamrec_events_total", {"stage": "join", "topic": "clicks"}, 40 * i]]
        return out + [["streamrec_join_watermark_ms", {"partition": str(p)}, 978_300_000_000 + 60_000 * i]
                      for p in range(8)]
    return [["streamrec_serving_requests_total", {}, 100 * i], ["streamrec_serving_hot_cache_hit_rate", {}, 0.9],
            ["streamrec_serving_delta_seq", {}, i // 6],
            *[["streamrec_serving_embedding_lookups_total", {"tier": tier}, 3000 * i] for tier in ("hot", "cold")]]


def write_log(path: Path, cycles: int, seed: int = 0, undrawn: bool = False) -> None:
    """A run log of ``cycles`` monitor cycles; the clock steps back 600 s half-way."""
    rng = random.Random(seed)
    with path.open("w") as f:
        f.write(json.dumps({"kind": "start", "t": 1e9, "sources": {}, "interval_s": 10, "rules": ["auc_low"]}) + "\n")
        for i in range(cycles):
            t = 1e9 + 10 * i - (600 if i >= cycles // 2 else 0)
            for source in ("learner", "joiner", "serving"):
                f.write(json.dumps({"kind": "scrape", "t": t, "source": source,
                                    "samples": samples_of(source, i, rng, undrawn)}) + "\n")
            f.write(json.dumps({"kind": "rules", "t": t, "states": {"auc_low": "inactive"}}) + "\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scrapes", type=int, default=4600, help="monitor cycles in the generated log")
    ap.add_argument("--undrawn", action="store_true", help="add the learner's series no section draws")
    ap.add_argument("--root", type=Path, default=ROOT, help="the tree whose monitor/report.py reads the log")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "run-log.jsonl"
        write_log(path, args.scrapes, undrawn=args.undrawn)
        size = path.stat().st_size
        rss, traced = (json.loads(subprocess.run(
            [sys.executable, "-c", _CHILD.format(root=str(args.root.resolve()), path=str(path), traced=on)],
            check=True, capture_output=True, text=True).stdout) for on in (False, True))  # tracemalloc grows RSS
    print(f"run log {size / 2**20:.1f} MiB, {rss['scrapes']:,} scrapes: peak RSS growth "
          f"{rss['rss_growth'] / 2**20:.0f} MiB ({rss['rss_growth'] / size:.2f}x), tracemalloc peak (another run) "
          f"{traced['tracemalloc_peak'] / 2**20:.0f} MiB ({traced['tracemalloc_peak'] / size:.2f}x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
