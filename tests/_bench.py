"""The benchmark scripts (benchmarks/*.py: scripts, not a package) as modules, for the tests that exercise them."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


def load_bench(script: str) -> ModuleType:
    """benchmarks/<script>.py as the module `<script>_under_test`, loaded once and registered in `sys.modules` (so
    its dataclasses, and what pickles them, resolve their module)."""
    name = f"{script}_under_test"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{script}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod
