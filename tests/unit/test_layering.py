"""Layering: `coordinator/` and `policy/` have no import cycles and never import Ray; the round's state and the
planner import without torch (the planner can run where no model does)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("coordinator", "policy")


def _modules() -> dict[str, Path]:
    return {f"specray.{pkg}.{p.stem}": p for pkg in PACKAGES for p in (ROOT / "specray" / pkg).glob("*.py")
            if p.stem != "__init__"}


def _imports(path: Path) -> set[str]:
    """Every module named by an import anywhere in the file (function-level and TYPE_CHECKING ones included)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
    return out


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in edges:
        if v not in index:
            visit(v)
    return found


def test_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_coordinator_and_policy_have_no_import_cycles():
    mods = _modules()
    edges = {m: {x for x in _imports(p) if x in mods and x != m} for m, p in mods.items()}
    assert _cycles(edges) == []


def test_coordinator_and_policy_never_import_ray_or_http():
    for name, path in _modules().items():
        bad = {x for x in _imports(path) if x.split(".")[0] in ("ray", "fastapi", "starlette", "httpx")}
        assert not bad, f"{name} imports {sorted(bad)}: Ray and HTTP belong in specray/serve"


def test_round_state_and_planner_import_without_torch():
    code = ("import sys, specray.coordinator.state, specray.policy.planner, specray.policy.autoscale; "
            "print(sorted(m for m in ('torch', 'ray') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]"
