"""Every Serve config the repository ships (the root `serve_config.yaml`, `benchmarks/configs/*.yaml`) is a valid
AppConfig: a field renamed or a value out of range in the code fails here, not when a user runs the file."""

from __future__ import annotations

from pathlib import Path

import pytest

from specray.bench.cli import load_config

ROOT = Path(__file__).resolve().parents[2]
FILES = [ROOT / "serve_config.yaml", *sorted((ROOT / "benchmarks" / "configs").glob("*.yaml"))]


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_shipped_config_is_a_valid_app_config(path):
    cfg = load_config(str(path))
    levels = cfg.cascade.levels
    assert len(levels) >= 2 and levels[-1].model == "qwen2.5-coder-1.5b-instruct"
