"""The layers hold: each stage imports only the stages below it, the settings loader only from commands,
no import cycle between modules (function-level imports included), no plugin loading by name, and
``streamrec/`` stays the thin process edge. Read from the source with ``ast``, so nothing is imported."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("stream", "learner", "serving", "monitor", "cache_refresh", "streamrec")
# What each stage may import (besides itself and third-party libraries): dependencies point down.
MAY_IMPORT = {
    "stream": set(),
    "learner": {"stream"},
    "monitor": {"stream"},
    "serving": {"stream", "learner"},
    "cache_refresh": {"stream", "learner", "serving", "monitor"},
    "streamrec": {"stream", "learner", "serving", "monitor", "cache_refresh"},
}
EDGE_MAX_LINES = 2000


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def sources() -> dict[str, Path]:
    return {module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def imports_of(path: Path, name: str) -> set[str]:
    """Every module ``path`` imports, at any level (inside functions too), resolved to project modules."""
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            out.add(base)
            out.update(f"{base}.{a.name}" for a in node.names)  # `from pkg import module`
    return {m for m in out if m.split(".")[0] in PACKAGES}


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    mods = sources()
    return {name: {m for m in imports_of(path, name) if m in mods and m != name} for name, path in mods.items()}


def test_every_stage_imports_only_the_stages_below_it(graph: dict[str, set[str]]) -> None:
    upward = sorted(f"{src} -> {dst}" for src, dsts in graph.items() for dst in dsts
                    if dst.split(".")[0] != src.split(".")[0]
                    and dst.split(".")[0] not in MAY_IMPORT[src.split(".")[0]])
    assert upward == []


def test_the_settings_loader_is_imported_only_by_commands(graph: dict[str, set[str]]) -> None:
    users = sorted(src for src, dsts in graph.items() if "streamrec.settings" in dsts)
    assert users and all(u.startswith("streamrec.commands") or u == "streamrec.cli" for u in users), users


def test_no_import_cycle_between_modules(graph: dict[str, set[str]]) -> None:
    # Package __init__ files are containers: `from pkg import mod` reaches mod, not a cycle through pkg.
    edges = {s: {d for d in ds if d not in PACKAGES and sources()[d].name != "__init__.py"} for s, ds in graph.items()}
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                cycles.append([*path[path.index(nxt):], nxt])
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for n in sorted(edges):
        if n not in state:
            visit(n, [n])
    assert cycles == []


def test_no_module_is_loaded_by_name() -> None:
    dynamic = sorted(str(p.relative_to(ROOT)) for p in sources().values()
                     if "import_module" in p.read_text() or "__import__(" in p.read_text())
    assert dynamic == []


def test_streamrec_is_only_the_process_edge() -> None:
    lines = sum(len(p.read_text().splitlines()) for p in (ROOT / "streamrec").rglob("*.py"))
    assert lines < EDGE_MAX_LINES, f"streamrec/ has {lines} lines"


def test_the_command_line_and_the_joiner_load_without_torch() -> None:
    # torch is ~180 MB of a process and a second of its start: only a command that runs the model imports it, when it
    # runs. `streamrec report` imported cache_refresh.run_records at the top (it reads the artifacts' manifest module,
    # which imports torch): every command, the joiner's included, paid for it (peak RSS 430 -> 610 MB, bench/joiner.py)
    code = ("import sys; from streamrec.cli import build_parser; build_parser(); "
            "import stream.joiner.worker, stream.joiner.kafka_driver, stream.joiner.faust_delivery; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch')[:5])")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True,
                         timeout=120)
    assert out.stdout.strip() == "[]", out.stdout


def test_the_layer_check_sees_an_upward_import(tmp_path: Path) -> None:
    # The checker itself: a stream module importing the learner is found.
    bad = tmp_path / "stream" / "bad.py"
    bad.parent.mkdir()
    bad.write_text("def f():\n    from learner.model import DeepFM\n    return DeepFM\n")
    assert "learner.model" in imports_of(bad, "stream.bad")
