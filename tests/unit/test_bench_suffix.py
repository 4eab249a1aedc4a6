"""`specray bench`'s lookup modes and streams: suffix, suffix-tree and hybrid run on tiny models, appear in a report
that validates, and give mode none's greedy outputs token for token; suffix-tree really drafts trees; a workload
is a stream (at batch 1 one suffix store per mode sees its requests in file order and learns from the earlier
outputs; the next workload or batch size starts empty); the shipped stream sets (screening, agent) load."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specray.bench.cli import run_bench
from specray.bench.report import validate
from specray.bench.runner import DEFAULT_MODES, SUFFIX_MODES, InProcessTarget
from specray.bench.workloads import load_shipped
from specray.spec.params import SamplingParams
from specray.spec.suffix import SuffixDrafter
from tests.unit.test_bench import _args, _tiny_flags

#: two streams: a repeated prompt (the suffix store can draft the second answer from the first) and chat
ROWS = [
    {"workload": "repeat", "prompt": "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):"},
    {"workload": "repeat", "prompt": "The river ran quietly past the old mill, and the miller's"},
    {"workload": "repeat", "prompt": "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):"},
    {"workload": "chat", "messages": [{"role": "user", "content": "What is the capital of France?"}]},
    {"workload": "chat", "messages": [{"role": "user", "content": "What is the capital of Spain?"}]},
]


@pytest.fixture
def stream(tmp_path) -> Path:
    path = tmp_path / "stream.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in ROWS) + "\n")
    return path


def test_lookup_modes_run_validate_and_equal_none(tiny, stream):
    report = run_bench(_args(*_tiny_flags(tiny, stream, "--modes", "none", *SUFFIX_MODES, "--batch", "1", "2",
                                          "--tree-width", "3", "--no-warmup")))
    validate(report)
    assert report["schema"] == "specray.bench/5"
    assert report["settings"]["modes"] == ["none", *SUFFIX_MODES] and report["skipped"] == []
    assert report["target"]["mode_levels"] == {"suffix": ["suffix", "target"], "suffix-tree": ["suffix", "target"],
                                               "hybrid": ["suffix", "mid", "target"]}
    assert report["target"]["tree_width"] == 3
    assert report["outputs_identical"] is True, report["mismatches"]
    assert report["outputs_compared"] == 3 * 2 * len(ROWS)  # 3 modes against none, 2 batch sizes
    res = {(r["workload"], r["batch"], r["name"]): r for r in report["results"]}
    assert set(res) == {(w, b, m) for w in ("repeat", "chat") for b in (1, 2) for m in ("none", *SUFFIX_MODES)}
    for b in (1, 2):
        for m in SUFFIX_MODES:
            levels = res[("repeat", b, m)]["levels"]
            assert list(levels)[-1] == "target" and levels["target"]["accepted_tokens"] > 0
            assert res[("repeat", b, m)]["bound"] > 1
        tree = res[("repeat", b, "suffix-tree")]["levels"]["target"]
        assert tree["tree_drafts"] > 0 and tree["tree_nodes"] >= tree["tree_drafts"]
        chain = res[("repeat", b, "suffix")]["levels"]["target"]
        assert chain["tree_drafts"] == 0 and chain["tree_nodes"] == 0
        pairs = res[("repeat", b, "hybrid")]["levels"]["target"]["pairs"]
        assert set(pairs) <= {"suffix->target", "mid->target"} and pairs  # per row: suffix match, else the model


def test_a_workload_is_a_stream_in_file_order_on_one_store(tiny, stream, monkeypatch):
    seen: list[tuple[int, tuple[int, ...]]] = []  # (store, prompt) as each request leaves a suffix store
    release = SuffixDrafter.release

    def spy(self, request_id, tokens, prompt_len):
        seen.append((id(self), tuple(tokens[:prompt_len])))
        return release(self, request_id, tokens, prompt_len)

    monkeypatch.setattr(SuffixDrafter, "release", spy)
    report = run_bench(_args(*_tiny_flags(tiny, stream, "--modes", "none", "suffix", "--no-warmup")))
    assert report["outputs_identical"] is True
    from transformers import AutoTokenizer

    from specray.bench.workloads import load_prompts, prompt_ids

    tok = AutoTokenizer.from_pretrained(str(tiny.target_dir))
    prompts = [tuple(prompt_ids(tok, r)) for r in load_prompts(stream)]
    stores = list(dict.fromkeys(s for s, _ in seen))
    assert len(stores) == 2  # one store per workload (each starts empty), shared by its requests
    for store, rows in zip(stores, ([0, 1, 2], [3, 4])):
        assert [p for s, p in seen if s == store] == [prompts[i] for i in rows]  # file order


def test_the_store_learns_across_the_stream_and_new_stream_empties_it(tiny):
    from specray.bench.cli import suffix_factory
    from specray.config import CascadeConfig, LevelConfig
    from specray.coordinator.generate import build_levels

    cfg = CascadeConfig(levels=[LevelConfig(kind="hf", model=str(tiny.target_dir), dtype="float32", name="target")])
    suffix, width = suffix_factory(cfg, _args("--suffix-k", "12"))
    assert width == 4 and suffix(1).k == 12
    target = InProcessTarget(build_levels(cfg), SamplingParams(), suffix=suffix)
    row = [(0, {"prompt": "The committee met on Tuesday to discuss"})]

    def accepted() -> tuple[list[int], int]:
        res = target.run("suffix", row, 1, 16).requests[0]
        return res.output, res.stats["target"].accepted_tokens

    first, acc0 = accepted()
    again, acc1 = accepted()  # the same request later in the stream drafts from the first one's output
    assert again == first and acc1 >= len(first) // 2 > acc0
    target.new_stream()
    fresh, acc2 = accepted()
    assert fresh == first and acc2 == acc0  # an empty store: as the first time


def test_new_stream_empties_the_cascades_own_suffix_level(tiny):
    """A config's suffix level learns from every request, plain ones too: without new_stream a mode after `none`
    would draft the outputs `none` wrote for the same prompts."""
    from specray.config import CascadeConfig, LevelConfig
    from specray.coordinator.generate import build_levels

    cfg = CascadeConfig(levels=[LevelConfig(kind="suffix"),
                                LevelConfig(kind="hf", model=str(tiny.target_dir), dtype="float32", name="target")])
    target = InProcessTarget(build_levels(cfg), SamplingParams())
    row = [(0, {"prompt": "The committee met on Tuesday to discuss"})]

    def accepted(mode: str) -> tuple[list[int], int]:
        res = target.run(mode, row, 1, 16).requests[0]
        return res.output, res.stats["target"].accepted_tokens

    plain, _ = accepted("none")
    copied, acc_after_plain = accepted("cascade")
    assert copied == plain and acc_after_plain >= len(plain) // 2  # drafted from none's output
    target.new_stream()
    fresh, acc_cold = accepted("cascade")
    assert fresh == plain and acc_cold < acc_after_plain
    target.new_stream()
    assert accepted("cascade")[1] == acc_cold  # each pass starts from the same empty store


def test_unavailable_lookup_modes_say_why(tiny, stream):
    report = run_bench(_args("--model", str(tiny.target_dir), "--dtype", "float32", "--backend", "hf",
                             "--workload-file", str(stream), "--max-tokens", "4", "--quiet", "--no-warmup",
                             "--modes", "none", "suffix", "hybrid", "suffix-tree", "--tree-width", "1",
                             "--limit", "1"))
    assert report["settings"]["workloads"] == {"repeat": 1, "chat": 1}  # a stream's first request
    assert {r["requests"] for r in report["results"]} == {1}
    reasons = {s["name"]: s["reason"] for s in report["skipped"]}
    assert set(reasons) == {"hybrid", "suffix-tree"}
    assert "no draft model" in reasons["hybrid"] and "--tree-width 1" in reasons["suffix-tree"]
    assert set(DEFAULT_MODES).isdisjoint(SUFFIX_MODES)  # asked for by name
    with pytest.raises(ValueError, match="--limit"):
        run_bench(_args(*_tiny_flags(tiny, stream, "--limit", "0")))


def test_stream_sets_load():
    screening = load_shipped("screening")
    assert len(screening) == 20
    agent = load_shipped("agent")
    assert len(agent) >= 8 and {r["workload"] for r in agent} == {"agent"}
    for prev, row in zip(agent, agent[1:]):  # each turn holds every earlier tool call and result
        assert row["messages"][: len(prev["messages"])] == prev["messages"]
        assert len(row["messages"]) == len(prev["messages"]) + 2
    calls = [m["content"] for m in agent[-1]["messages"] if m["role"] == "assistant"]
    assert len(calls) == len(agent) - 1
    for step, text in enumerate(calls, 1):  # one fixed JSON schema, repeated
        call = json.loads(text)
        assert list(call) == ["step", "thought", "tool", "arguments"] and call["step"] == step
        assert isinstance(call["arguments"], dict)
