"""Where the planner's trace records go (`PolicyConfig.trace_file`): one JSON line per planned round, appended to a
file, for the served app and `specray bench` alike."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

__all__ = ["PendingTrace", "json_lines"]

log = logging.getLogger(__name__)


def json_lines(path: str) -> Callable[[dict[str, Any]], None]:
    """A sink that appends each record to `path` as one JSON line (line-buffered: readable while it runs)."""
    out = open(path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115 - open for the planner's life

    def write(record: dict[str, Any]) -> None:
        out.write(json.dumps(record) + "\n")

    return write


class PendingTrace:
    """Holds the latest answer's record until its round's seconds arrive (`flush`), then hands it to `sink`; a sink
    that fails is logged, never raised into planning."""

    def __init__(self, sink: Callable[[dict[str, Any]], None]) -> None:
        self.sink = sink
        self.record: dict[str, Any] | None = None

    def hold(self, record: dict[str, Any]) -> None:
        """The next answer's record: the one still held goes out first, without its round's seconds."""
        if self.record is not None:
            self.flush(None)
        self.record = record

    def note(self, **fields: Any) -> None:
        """Add `fields` (what the round reported besides its seconds) to the record held."""
        if self.record is not None:
            self.record.update(fields)

    def flush(self, seconds: float | None) -> None:
        record, self.record = self.record, None
        if record is None:
            return
        record["round_s"] = None if seconds is None else round(seconds, 4)
        try:
            self.sink(record)
        except Exception:  # a trace sink must never break planning
            log.exception("planner trace failed")
