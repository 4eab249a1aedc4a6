"""Layering: no module of `specray` is in an import cycle; `coordinator/` and `policy/` never import Ray; the
round's state and the planner import without torch (the planner can run where no model does)."""

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


def _all_modules() -> dict[str, Path]:
    """Every module of `specray`, a package named by its `__init__.py`."""
    out = {}
    for p in (ROOT / "specray").rglob("*.py"):
        parts = p.relative_to(ROOT).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return out


def _imports(path: Path, package: str = "") -> set[str]:
    """Every module named by an import anywhere in the file (function-level and TYPE_CHECKING ones included);
    relative imports are resolved against `package` (the file's package)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[:len(package.split(".")) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            if not module:
                continue
            out.add(module)
            out.update(f"{module}.{a.name}" for a in node.names)
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


def test_imports_resolve_relative_ones(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("from . import a\nfrom .b import c\nfrom ..d import e\nimport x.y\n"
                 "def g():\n    from specray.z import w\n")
    assert _imports(f, "specray.serve") == {"specray.serve", "specray.serve.a", "specray.serve.b", "specray.serve.b.c",
                                            "specray.d", "specray.d.e", "x.y", "specray.z", "specray.z.w"}


def test_specray_has_no_import_cycles():
    mods = _all_modules()
    assert {"specray", "specray.cli", "specray.serve.app", "specray.serve.protocol.errors"} <= set(mods)
    edges = {}
    for m, p in mods.items():
        package = m if p.name == "__init__.py" else m.rpartition(".")[0]
        edges[m] = {x for x in _imports(p, package) if x in mods and x != m}
    assert sum(map(len, edges.values())) > len(mods)  # the finder sees the package's imports
    assert _cycles(edges) == [], "import cycles: move what both sides need into a lower module"


def test_coordinator_and_policy_never_import_ray_or_http():
    for name, path in _modules().items():
        bad = {x for x in _imports(path) if x.split(".")[0] in ("ray", "fastapi", "starlette", "httpx")}
        assert not bad, f"{name} imports {sorted(bad)}: Ray and HTTP belong in specray/serve"


def test_round_state_and_planner_import_without_torch():
    code = ("import sys, specray.coordinator.state, specray.policy.planner, specray.policy.autoscale; "
            "print(sorted(m for m in ('torch', 'ray') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]"
