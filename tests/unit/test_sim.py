"""SimWorker (a FakeWorker that lasts as long as a model's forwards would) and the overhead benchmark's
in-process measurement. Fast, no Ray."""

from __future__ import annotations

import json
import pickle
import time

import pytest

from specray.coordinator.cascade import Level
from specray.coordinator.generate import generate
from specray.spec.params import SamplingParams
from specray.testing.fake import FakeWorker
from specray.testing.sim import PRESETS, SimWorker, StepCostModel, read_trace, sim_factory, union_length
from tests._bench import load_bench

GREEDY = [SamplingParams().with_seed()]
PROMPT = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8]


def test_propose_lasts_k_forwards_of_the_cost_model():
    cost = StepCostModel(0.005, 0.0)
    w = SimWorker("d", cost, vocab=16, order=2)
    w.add("s", PROMPT)
    t0 = time.monotonic()
    prop = w.propose(["s"], [3], GREEDY)
    elapsed = time.monotonic() - t0
    assert len(prop.token_ids[0]) == 3
    rec = w.trace[-1]
    assert rec["kind"] == "propose" and rec["batch"] == 1 and rec["forwards"] == 3
    assert rec["cost_s"] == pytest.approx(3 * cost.forward_s(1))
    assert elapsed >= rec["cost_s"] and rec["end"] - rec["start"] >= rec["cost_s"]
    assert elapsed < rec["cost_s"] + 1.0  # loose: only that it does not sleep for something else


def test_verify_cost_counts_the_tokens_it_feeds():
    cost = StepCostModel(0.002, 0.001)
    w = SimWorker("t", cost, vocab=16, order=2)
    w.add("s", PROMPT)
    w.verify(["s"], [[1, 2, 3]], None, GREEDY, "greedy")
    rec = w.trace[-1]
    # batched prefill: the prompt's pending tokens and the draft go through one forward
    assert rec["kind"] == "verify" and rec["forwards"] == 1 and rec["tokens"] == len(PROMPT) + 3
    assert rec["cost_s"] == pytest.approx(cost.forward_s(len(PROMPT) + 3))
    assert rec["end"] - rec["start"] >= rec["cost_s"]


def test_a_knee_makes_the_first_tokens_fed_free():
    cost = StepCostModel(0.010, 0.002, knee_tokens=16)
    assert cost.forward_s(1) == cost.forward_s(16) == pytest.approx(0.010)
    assert cost.forward_s(48) == pytest.approx(0.010 + 0.002 * 32)
    with pytest.raises(ValueError):
        StepCostModel(0.010, knee_tokens=-1)


def test_simulation_does_not_change_tokens():
    kw = dict(vocab=16, order=2, table_seed=0)
    cost = StepCostModel(0.0005, 0.0)
    prompts = [PROMPT, [7, 7, 1, 2], list(range(16))]
    plain = generate([Level("t", worker=FakeWorker("t", **kw))], prompts, max_tokens=20, ignore_eos=True)
    fake = generate([Level("d", worker=FakeWorker("d", noise=0.5, **kw), k=3, method="greedy"),
                     Level("t", worker=FakeWorker("t", **kw), method="greedy")], prompts, max_tokens=20,
                    ignore_eos=True)
    sim = generate([Level("d", worker=SimWorker("d", cost, noise=0.5, **kw), k=3, method="greedy"),
                    Level("t", worker=SimWorker("t", cost, **kw), method="greedy")], prompts, max_tokens=20,
                   ignore_eos=True)
    want = [r.token_ids for r in plain.results]
    assert [r.token_ids for r in fake.results] == want
    assert [r.token_ids for r in sim.results] == want
    assert sim.stats["t"].accepted_tokens == fake.stats["t"].accepted_tokens > 0


def test_trace_is_written_as_json_lines(tmp_path):
    path = tmp_path / "t.jsonl"
    w = SimWorker("t", StepCostModel(0.001), vocab=16, order=2, trace_path=str(path))
    w.add("s", PROMPT)
    w.propose(["s"], [2], GREEDY)
    w.verify(["s"], [[]], None, GREEDY, "greedy")
    w.free("s")
    assert not path.exists() or path.read_text() == ""  # never written inside a timed call
    w.stats()
    lines = path.read_text().splitlines()
    recs = [json.loads(x) for x in lines]
    assert [r["kind"] for r in recs] == ["add", "propose", "verify", "free"]
    assert all(r["worker"] == "t" and r["start"] <= r["end"] for r in recs)
    assert recs == w.trace
    assert read_trace(str(path), start=recs[1]["start"], end=recs[2]["end"]) == recs[1:3]
    assert read_trace(str(tmp_path / "missing.jsonl")) == []


def test_union_length_counts_overlaps_once_and_clips():
    assert union_length([(0, 2), (1, 3), (5, 6)]) == pytest.approx(4.0)
    assert union_length([(0, 2), (1, 3), (5, 6)], lo=1.5, hi=5.5) == pytest.approx(2.0)
    assert union_length([]) == 0.0


def test_presets_and_factory():
    for name, decode_ms in [("llama-1b", 3), ("llama-8b", 8), ("llama-70b-tp4", 15)]:
        c = PRESETS[name]
        assert c.step_s(1) == pytest.approx(decode_ms / 1000)
        assert c.forward_s(5) < 1.05 * c.forward_s(1)  # memory-bound: a few tokens cost about one
        assert "http" in c.source
    assert PRESETS["qwen-cpu-0.5b"].forward_s(9) == pytest.approx(0.200)
    assert "benchmarks/README.md" in PRESETS["qwen-cpu-1.5b"].source
    factory = pickle.loads(pickle.dumps(sim_factory("x", "llama-1b", vocab=16, order=2)))
    w = factory()
    assert isinstance(w, SimWorker) and w.name == "x" and w.cost == PRESETS["llama-1b"]


def test_bench_inproc_measurement_smoke():
    b = load_bench("bench_overhead")
    tiny = StepCostModel(0.002, 0.0)
    specs = tuple(b.LevelSpec(s.name, s.noise, s.noise_seed, step_cost=tiny, order=2) for s in b.PRESET_LEVELS["gpu"])
    client = b.ClientLog()
    backend = b.InprocBackend(specs, 4, client)
    r = b.measure(backend, client, "gpu", "cascade", batch=1, max_tokens=8, overlap=False, k=4, warmup_tokens=4)
    assert r["tokens"] == 8 and r["rounds"] >= 1
    assert 0 < r["model_s"] <= r["wall_s"]
    assert 0 < r["fraction_of_ideal"] <= 1.05
    assert r["overhead_ms_per_round"] >= 0
    assert r["per_level"]["llama-70b-tp4"]["calls_per_round"]["verify"] == pytest.approx(1.0)
    assert r["per_level"]["llama-1b"]["calls"]["propose"] >= 1
    assert set(r["acceptance"]) == {"llama-1b->llama-8b", "llama-8b->llama-70b-tp4"}
    assert r["bound"]["bound"] > 0


def test_transition_gaps_add_up_to_a_sequential_rounds_overhead():
    """bench_overhead's gaps by transition: the idle time between one model call and the next, per round, named
    by the two calls; with the time before the first and after the last call they are the whole overhead."""
    b = load_bench("bench_overhead")
    rec = [{"worker": w, "kind": k, "start": s, "end": e} for w, k, s, e in
           [("s", "propose", 1.0, 2.0), ("m", "verify", 2.5, 3.0), ("t", "verify", 3.25, 4.0),
            ("s", "propose", 4.5, 5.0), ("m", "verify", 5.0, 6.0), ("t", "verify", 6.5, 7.0), ("t", "add", 7.0, 8.0)]]
    g = b.transition_gaps(rec, 0.5, 7.5, rounds=2)
    assert g["ms_per_round"] == {"s:propose > m:verify": 250.0, "m:verify > t:verify": 375.0,
                                 "t:verify > s:propose": 250.0}
    assert g["per_round"] == {"s:propose > m:verify": 1.0, "m:verify > t:verify": 1.0,
                              "t:verify > s:propose": 0.5}
    assert g["edges_ms_per_round"] == 500.0
    wall, model = 7.0, 1.0 + 0.5 + 0.75 + 0.5 + 1.0 + 0.5  # seconds: the model calls, one at a time
    assert sum(g["ms_per_round"].values()) + g["edges_ms_per_round"] == pytest.approx(1000 * (wall - model) / 2)


def test_the_client_log_times_relayed_calls_as_their_kind():
    """A relayed verification counts as a `verify` from when the coordinator waits for the verdict, and a propose
    that relays its drafts as a `propose` (bench_overhead's per-level calls and hops)."""
    b = load_bench("bench_overhead")

    class Pending:
        def result(self):
            return "verdict"

    class Worker:
        def verify_later(self, *a, **kw):
            return Pending()

        def propose_relayed(self, *a, **kw):
            return "drafts", True

    client = b.ClientLog()
    w = Worker()
    client.patch("t", w)
    client.patch("t", w)  # patched once only
    pending = w.verify_later(["a"], fill=[0])
    assert client.calls == []  # not yet waiting
    assert pending.result() == "verdict"
    assert w.propose_relayed() == ("drafts", True)
    assert [(c.level, c.method) for c in client.calls] == [("t", "verify"), ("t", "propose")]
