"""benchmarks/bench_gpu.py on a CPU (tiny shapes): the code that runs on a lent GPU machine must not rot here, and
`HFWorker` built from a model object must decode like one loaded from its folder. Fast, no Ray."""

from __future__ import annotations

import json

import pytest
import torch

from specray.coordinator.cascade import Level
from specray.coordinator.generate import generate
from specray.engine.hf import HFWorker
from specray.testing.tiny import load_tiny
from tests._bench import load_bench


def test_worker_from_a_model_object_decodes_like_one_from_its_folder(tiny):
    from transformers import AutoTokenizer

    prompt = AutoTokenizer.from_pretrained(tiny.target_dir).encode("def fibonacci(n):")
    by_path = HFWorker(str(tiny.target_dir))
    by_object = HFWorker(load_tiny(tiny.target_dir), name="object")
    assert by_object.name == "object" and by_object.tokenizer is None
    assert by_object.vocab_size == by_path.vocab_size
    outs = [generate([Level("t", worker=w)], [prompt], max_tokens=12, ignore_eos=True).results[0].token_ids
            for w in (by_path, by_object)]
    assert outs[0] == outs[1] and len(outs[0]) == 12


def test_no_attention_kernel_restriction_on_cpu(tiny):
    assert HFWorker(str(tiny.target_dir)).sdpa_backends is None  # PyTorch's own choice; only CUDA is restricted


def test_bench_gpu_runs_every_plan_on_cpu(tmp_path):
    b = load_bench("bench_gpu")
    out = tmp_path / "gpu.json"
    rc = b.main(["--sizes", "tiny", "--device", "cpu", "--batches", "1", "2", "--tokens", "6", "--out", str(out)])
    assert rc == 0
    r = json.loads(out.read_text())
    assert r["errors"] == []
    assert {(x["plan"], x["batch"]) for x in r["runs"]} == {(p, b) for p in ("plain", "draft", "cascade")
                                                             for b in (1, 2)}
    for x in r["runs"]:
        assert x["tokens"] == 6 * x["batch"] and x["rounds"] >= 1
        assert 0 < x["model_s"] <= x["wall_s"]
        assert 0 < x["fraction_of_ideal"] <= 1.0
        assert isinstance(x["greedy_equal_plain"], bool)
    plain = next(x for x in r["runs"] if x["plan"] == "plain" and x["batch"] == 1)
    assert plain["levels"]["tiny-big"]["calls_per_round"] >= 1.0
    for name in ("tiny-small", "tiny-big"):
        assert r["fit"][name]["calls"] > 0 and "base_s" in r["fit"][name]
        assert set(r["raw_step_s"][name]) == {"b1q1", "b1q5", "b64q1", "b64q5"}


def test_fit_recovers_a_line():
    b = load_bench("bench_gpu")
    calls = [(1, q, n, 0.01 + 0.001 * n) for n, q in [(1, 1), (4, 4), (16, 1), (64, 1), (80, 5)]]
    calls.append((1, 128, 128, 5.0))  # a prefill: left out of the fit
    f = b.fit(calls)
    assert f["calls"] == 5
    assert abs(f["base_s"] - 0.01) < 1e-9 and abs(f["per_token_s"] - 0.001) < 1e-9
    assert torch.isclose(torch.tensor(f["median_rel_error"]), torch.tensor(0.0), atol=1e-9)


def test_bench_gpu_count_ops_smoke():
    """`bench_gpu.py --count-ops`'s counter on tiny models: ops inside and outside the forwards, per plan."""
    mod = load_bench("bench_gpu")
    small, big = mod.worker("tiny-small", "cpu", 1), mod.worker("tiny-big", "cpu", 2)
    for w in (small, big):
        mod._mark_forwards(w.model)
    plans = [("plain", [Level("b", worker=big)], mod.Plan((0,), ())),
             ("draft", [Level("a", worker=small, k=2), Level("b", worker=big)], mod.Plan((0, 1), (2,)))]
    rows = mod.count_ops(plans, [1], 3, 512, torch.device("cpu"), log=lambda _msg: None)
    assert [(r["plan"], r["batch"]) for r in rows] == [("plain", 1), ("draft", 1)]
    for r in rows:
        assert r["rounds"] >= 1 and r["inside_per_round"] > 0 and r["outside_per_round"] > 0
        assert sum(r["outside_by_op_per_round"].values()) == pytest.approx(r["outside_per_round"])
    plain, draft = rows
    assert draft["inside_per_round"] > plain["inside_per_round"]  # two models' forwards per round
