"""Where the planner's trace records go (`PolicyConfig.trace_file`): one JSON line per planned round, appended to a
file, for the served app and `specray bench` alike."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

__all__ = ["json_lines"]


def json_lines(path: str) -> Callable[[dict[str, Any]], None]:
    """A sink that appends each record to `path` as one JSON line (line-buffered: readable while it runs)."""
    out = open(path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115 - open for the planner's life

    def write(record: dict[str, Any]) -> None:
        out.write(json.dumps(record) + "\n")

    return write
