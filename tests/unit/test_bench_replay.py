"""benchmarks/bench_planner_replay.py: recorded greedy outputs replayed through the real round code."""

from __future__ import annotations

import importlib.util
import random
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_planner_replay.py"
_spec = importlib.util.spec_from_file_location("bench_planner_replay", _PATH)
replay_mod = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(replay_mod)


def _rows(n: int = 2, seed: int = 0) -> list[dict]:
    """Prompts that hold a span the outputs copy (n-gram drafts accept there) and fresh text around it."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        span = [rng.randrange(3, 60) for _ in range(12)]
        prompt = [rng.randrange(3, 60) for _ in range(20)] + span + [rng.randrange(3, 60) for _ in range(5)]
        output = [rng.randrange(3, 60) for _ in range(6)] + span + [rng.randrange(3, 60) for _ in range(6)] + span
        rows.append({"prompt": prompt, "output": output})
    return rows


def test_every_mode_replays_the_recorded_outputs_and_the_fixed_ngram_takes_fewer_forwards():
    kwargs, k_max, ngram = replay_mod.policy_kwargs(None)
    cost = replay_mod.CostCurve(base=0.002, per_token=0.0001, knee=9)
    res = replay_mod.replay(_rows(), cost=cost, fixed=[4, 8], planner_kwargs=kwargs, k_max=k_max, ngram=ngram,
                            vocab=64, scale=1.0, noise=0.0)
    modes = res["modes"]
    assert set(modes) == {"adaptive", "none", "ngram4", "ngram8"}
    total = sum(len(r["output"]) for r in _rows())
    assert all(m["tokens"] == total for m in modes.values())  # each checked token for token inside `replay`
    assert modes["ngram8"]["forwards"] < modes["ngram4"]["forwards"] < modes["none"]["forwards"]
    assert sum(modes["adaptive"]["plans"].values()) > 0
    assert res["planner_over_best_fixed"] > 0 and res["planner_over_plain"] > 0


def test_rows_served_together_share_forwards():
    """--batch 3: the rows of a chunk are admitted together and decode in the same forwards."""
    kwargs, k_max, ngram = replay_mod.policy_kwargs(None)
    cost = replay_mod.CostCurve(base=0.001, per_token=0.0, knee=9, per_row=0.0)
    rows = _rows(3, seed=1)
    one = replay_mod.replay(rows, cost=cost, fixed=[4], planner_kwargs=kwargs, k_max=k_max, ngram=ngram, vocab=64,
                            scale=1.0, noise=0.0)
    three = replay_mod.replay(rows, cost=cost, fixed=[4], planner_kwargs=kwargs, k_max=k_max, ngram=ngram,
                              vocab=64, scale=1.0, noise=0.0, batch=3)
    assert three["batch"] == 3 and three["modes"]["none"]["tokens"] == one["modes"]["none"]["tokens"]
    assert three["modes"]["none"]["forwards"] < one["modes"]["none"]["forwards"]


def test_a_target_off_its_script_is_an_error():
    target = replay_mod.ScriptedTarget([[1, 2, 3, 4]], replay_mod.CostCurve(base=0.0), vocab=8)
    assert target._script([1, 2]) == [1, 2, 3, 4]
    with pytest.raises(ValueError, match="none of the recorded scripts"):
        target._script([1, 3])


def test_the_cost_curve_is_flat_to_its_knee():
    c = replay_mod.CostCurve(base=0.16, per_token=0.006, knee=9, per_row=0.01)
    assert c(1, 1) == c(1, 9) == pytest.approx(0.16)
    assert c(1, 17) == pytest.approx(0.16 + 8 * 0.006)
    assert c(2, 5) == pytest.approx(0.16 + 0.006 + 0.01)


def test_a_measured_width_curve_is_interpolated_and_extended():
    c = replay_mod.CostCurve(per_token=0.01, per_row=0.0, widths=replay_mod.parse_widths("1:0.15,3:0.13,5:0.14"))
    assert c(1, 1) == pytest.approx(0.15) and c(1, 2) == pytest.approx(0.14) and c(1, 3) == pytest.approx(0.13)
    assert c(1, 7) == pytest.approx(0.14 + 2 * 0.01)  # beyond the largest measured: per_token a token
    assert c(2, 2) == c(1, 4)  # indexed by the tokens the step feeds


def test_samples_of_one_prompt_replay_their_own_paths():
    """Sampled records: several outputs of one prompt. Each replayed request leads with a marker of its own, so the
    scripted target follows that request's path, in every mode and served together too."""
    kwargs, k_max, ngram = replay_mod.policy_kwargs(None)
    cost = replay_mod.CostCurve(base=0.001, per_token=0.0, knee=9, per_row=0.0)
    base = _rows(1, seed=2)[0]
    rng = random.Random(3)
    samples = [{"prompt": base["prompt"], "output": base["output"][:4 + s] + [rng.randrange(3, 60) for _ in range(9)],
                "sample": s} for s in range(3)]
    assert len({tuple(r["output"]) for r in samples}) == 3
    marked = replay_mod._distinct_prompts(samples + _rows(1, seed=4), vocab=64)
    assert [r["prompt"][0] for r in marked[:3]] == [63, 62, 61] and marked[3]["prompt"] == _rows(1, seed=4)[0]["prompt"]
    for batch in (1, 3):
        res = replay_mod.replay(samples, cost=cost, fixed=[4], planner_kwargs=kwargs, k_max=k_max, ngram=ngram,
                                vocab=64, scale=1.0, noise=0.0, batch=batch)
        assert all(m["tokens"] == sum(len(r["output"]) for r in samples) for m in res["modes"].values())
