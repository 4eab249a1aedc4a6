"""Workloads: prompts from JSONL files, shared by `specray bench` and `specray verify`.

One JSON object per line:

    {"workload": "extraction", "messages": [{"role": "user", "content": "..."}], "max_tokens": 96}
    {"workload": "code", "prompt": "def quicksort(xs):", "max_tokens": 64}

`prompt` (raw text, tokenized as is) or `messages` (chat, wrapped in the tokenizer's chat template), exactly one;
`max_tokens` (a positive integer) and `workload` (a name) are optional. Blank lines are skipped. Every error names
the file and line. The sample sets shipped with specray (specray/bench/data/*.jsonl) are picked by name
(`shipped_names()`, `load_shipped`).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from importlib import resources
from pathlib import Path
from typing import Any

__all__ = ["load_prompts", "load_shipped", "load_workloads", "prompt_ids", "shipped_names", "shipped_path"]

def _check_row(row: Any, where: str) -> dict[str, Any]:
    """`row` if it is a valid workload line, else a ValueError that starts with `where` (file:line)."""
    if not isinstance(row, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(row).__name__}")
    if ("prompt" in row) == ("messages" in row):
        raise ValueError(f"{where}: give exactly one of `prompt` (text) or `messages` (chat)")
    if "prompt" in row and not isinstance(row["prompt"], str):
        raise ValueError(f"{where}: `prompt` must be a string")
    if "messages" in row:
        msgs = row["messages"]
        if not isinstance(msgs, list) or not msgs:
            raise ValueError(f"{where}: `messages` must be a non-empty list of {{role, content}} objects")
        for j, m in enumerate(msgs):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise ValueError(f"{where}: `messages[{j}]` must be an object with string `role` and `content`")
    if "max_tokens" in row and (isinstance(row["max_tokens"], bool) or not isinstance(row["max_tokens"], int)
                                or row["max_tokens"] < 1):
        raise ValueError(f"{where}: `max_tokens` must be a positive integer, got {row['max_tokens']!r}")
    if "workload" in row and not isinstance(row["workload"], str):
        raise ValueError(f"{where}: `workload` must be a string")
    return row


def load_prompts(path: str | Path) -> list[dict[str, Any]]:
    """The JSONL prompts of `path`; a clear ValueError naming the line for anything else."""
    path = Path(path)
    rows = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{n}: not JSON ({exc.msg})") from None
        rows.append(_check_row(row, f"{path}:{n}"))
    if not rows:
        raise ValueError(f"{path}: no prompts")
    return rows


def _data_dir():
    return resources.files("specray.bench") / "data"


def shipped_names() -> list[str]:
    """The names of the sample sets shipped with specray (the data files' stems), sorted."""
    return sorted(p.name[: -len(".jsonl")] for p in _data_dir().iterdir() if p.name.endswith(".jsonl"))


def shipped_path(name: str) -> Path:
    """The file of shipped set `name`; a ValueError listing the known names otherwise."""
    names = shipped_names()
    if name not in names:
        raise ValueError(f"unknown workload {name!r}: shipped sets are {', '.join(names)} "
                         "(or give your own with --workload-file F.jsonl)")
    return Path(str(_data_dir() / f"{name}.jsonl"))


def load_shipped(name: str) -> list[dict[str, Any]]:
    """The rows of shipped set `name`, each labelled with `workload` (the set's name unless the line says)."""
    return [{"workload": name, **row} for row in load_prompts(shipped_path(name))]


def load_workloads(names: Sequence[str] = (), files: Iterable[str | Path] = ()) -> list[dict[str, Any]]:
    """Shipped sets by name, then the users' files (a line without `workload` is labelled by its file's stem)."""
    rows = [row for name in names for row in load_shipped(name)]
    for f in files:
        rows += [{"workload": Path(f).stem, **row} for row in load_prompts(f)]
    if not rows:
        raise ValueError("no workloads: give --workload NAME ... or --workload-file F.jsonl")
    return rows


def prompt_ids(tok: Any, row: dict[str, Any]) -> list[int]:
    """The token ids of a row: `messages` through the tokenizer's chat template (with the generation prompt),
    `prompt` encoded as is."""
    if "messages" in row:
        ids = tok.apply_chat_template(row["messages"], add_generation_prompt=True, tokenize=True, return_dict=False)
        return list(ids["input_ids"] if isinstance(ids, dict) else ids)
    return list(tok.encode(row["prompt"]))
