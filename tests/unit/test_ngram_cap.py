"""An n-gram level that caps its drafts by their match's length (`prompt_lookup_max_spec_factor`): configured from the
config and the CLI, exact (greedy equals plain decoding, flat and nested), and measured and priced by the planner at
the drafts it makes: the round tells the planner what each row asked for, a capped draft accepted whole ends its
round, and the target's verification is priced at the tokens such drafts feed."""

from __future__ import annotations

import pytest

from specray.config import LevelConfig
from specray.coordinator.cascade import CascadeEngine, Level, Plan
from specray.coordinator.generate import generate, level_from_config
from specray.policy.planner import Planner
from specray.spec.ngram import NgramConfig
from specray.spec.params import SamplingParams, VerifyMethod
from tests.unit.test_cascade import PROMPTS, draft, target
from tests.unit.test_confidence_pricing import Seen
from tests.unit.test_planner import _dummy

# texts that repeat themselves, so the lookup matches often and with matches of every length
REPEATING = [[1, 2, 3, 4, 5, 6, 7, 1, 2, 3], [4, 5, 6, 7, 1, 2, 3, 4, 5, 9, 4, 5], *PROMPTS]


def test_the_factor_is_configured_on_ngram_levels_only():
    lvl = level_from_config(LevelConfig(kind="ngram", num_speculative_tokens=8, prompt_lookup_max_spec_factor=2))
    assert lvl.ngram is not None and lvl.ngram.max_spec_factor == 2.0 and lvl.stops_drafts
    plain = level_from_config(LevelConfig(kind="ngram", num_speculative_tokens=8))
    assert plain.ngram is not None and plain.ngram.max_spec_factor == 0.0 and not plain.stops_drafts
    with pytest.raises(ValueError, match="prompt_lookup_max_spec_factor is for ngram levels"):
        LevelConfig(kind="hf", model="m", prompt_lookup_max_spec_factor=2)
    with pytest.raises(ValueError, match="suffix_decoding_max_spec_factor"):
        LevelConfig(kind="suffix", prompt_lookup_max_spec_factor=2)
    with pytest.raises(ValueError):
        LevelConfig(kind="ngram", prompt_lookup_max_spec_factor=-1)


def test_the_cli_passes_the_factor(monkeypatch):
    from specray import cli

    seen = {}

    def fake_load(levels, *a, **kw):
        seen["levels"] = levels
        raise SystemExit(0)

    monkeypatch.setattr("specray.loading.load_levels", fake_load)
    with pytest.raises(SystemExit):
        cli.main(["generate", "--ngram", "--prompt-lookup-max-spec-factor", "1.5", "--model", "m", "x"])
    assert seen["levels"].levels[0].prompt_lookup_max_spec_factor == 1.5


@pytest.mark.parametrize("factor", [0.5, 1.0, 2.0])
def test_greedy_with_capped_lookups_equals_plain(factor):
    ref = [r.token_ids for r in generate([Level("target", worker=target())], REPEATING, max_tokens=30,
                                         ignore_eos=True).results]
    capped = NgramConfig(8, 1, 4, max_spec_factor=factor)
    for levels in ([Level("ngram", ngram=capped, k=8), Level("target", worker=target())],
                   [Level("ngram", ngram=capped, k=8), Level("d", worker=draft(0.5), k=4),
                    Level("target", worker=target())]):
        out = generate(levels, REPEATING, max_tokens=30, ignore_eos=True)
        assert [r.token_ids for r in out.results] == ref


def test_seeded_samples_with_capped_lookups_equal_plain():
    sp = SamplingParams(0.8, seed=11)
    levels = [Level("ngram", ngram=NgramConfig(8, 1, 4, max_spec_factor=1.0), k=8),
              Level("target", worker=target(), method=VerifyMethod.COUPLED)]
    ref = generate([Level("target", worker=target(), method=VerifyMethod.COUPLED)], REPEATING, max_tokens=25,
                   sampling=sp, ignore_eos=True)
    out = generate(levels, REPEATING, max_tokens=25, sampling=sp, ignore_eos=True)
    assert [r.token_ids for r in out.results] == [r.token_ids for r in ref.results]


def test_the_round_tells_the_planner_what_a_capped_lookup_was_asked():
    levels = [Level("ngram", ngram=NgramConfig(8, 1, 4, max_spec_factor=1.0), k=8),
              Level("target", worker=target(), method=VerifyMethod.GREEDY)]
    engine = CascadeEngine(levels)
    seen = Seen()
    engine.observers.append(seen)
    seqs = [engine.new_sequence(p, SamplingParams(0.0), max_tokens=40) for p in REPEATING]
    for _ in range(8):
        engine.step([s for s in seqs if not s.finished], Plan((0, 1), (8,)))
    assert seen.drafted and not [v for v in seen.verified if v[:2] == (1, 0)]
    lens = [n for *_, d, _a, _w in seen.drafted for n in d]
    for _lvl, _low, d, acc, asked in seen.drafted:
        assert all(0 <= n <= 4 and n <= w <= 8 and a <= n for n, a, w in zip(d, acc, asked))  # 1 x a match <= 4
    assert max(lens) > 0 and min(n for n in lens if n) < 4


def _planner(factor: float) -> Planner:
    return Planner([Level("ngram", ngram=NgramConfig(8, 1, 4, max_spec_factor=factor), k=8),
                    Level("t", worker=_dummy("t"))], k_max=8, rerank_every=1)


def test_a_capped_lookup_is_priced_at_the_drafts_it_makes():
    capped, full = _planner(2.0), _planner(0.0)
    for p in (capped, full):
        for q in (1, 3, 9):
            for _ in range(3):
                p.on_call(1, "verify", 1, q, 0.1 + 0.01 * q)
    for _ in range(30):  # asked for 8, every row matched and drafted 2 tokens, both accepted
        capped.on_drafted(1, 0, [2, 2], [2, 2], [8, 8])
        full.on_verify(1, 0, [2, 2], [2, 2])
    pr = capped.pricing
    assert round(pr.drafted(0, 1, 8)) == 2 and full.pricing.drafted(0, 1, 8) == 8
    plan = Plan((0, 1), (8,))
    # verified over the lengths the drafts run to: nearly always 2 (a stop after 2 measured 60 times)
    verify = pr.verify_times(0, 1, 8)[8]
    v2, v3 = pr._verify_time(1, 2), pr._verify_time(1, 3)
    assert v2 < verify < v2 + 0.1 * (v3 - v2)
    assert pr.round_time(plan, 1) == pytest.approx(verify + pr.ngram_cost + pr.overhead)
    assert pr.round_time(plan, 1) < full.pricing.round_time(plan, 1)  # 9 tokens fed there
    # a capped draft accepted whole ended its round: K 8 emits the 2 tokens and one more
    assert capped.expected_length(plan, 1) == pytest.approx(3.0, abs=0.2)
    assert full.expected_length(plan, 1) > 3.5
    # the vectorised ranking prices it as the one-by-one pricing does
    for plan_, gp in capped.explain(1):
        assert gp == pytest.approx(capped.pricing.goodput(plan_, 1), rel=1e-9)


def test_shadow_lookups_measure_how_far_capped_drafts_run():
    """A switched-off capped lookup is still looked up every round (shadow drafts): how far its drafts run is
    measured there too, so its plans are priced at what they would feed before any of them runs."""
    capped, full = _planner(2.0), _planner(0.0)
    for p in (capped, full):
        for q in (1, 3, 9):
            for _ in range(3):
                p.on_call(1, "verify", 1, q, 0.1 + 0.01 * q)
        for _ in range(30):
            p.on_shadow(1, 0, [2, 2, 0], [2, 1, 0], 8)
    assert round(capped.pricing.drafted(0, 1, 8)) == 2 and full.pricing.drafted(0, 1, 8) == 8
    assert capped.measurements.stops[0].n_obs == 30
    plan = Plan((0, 1), (8,))
    assert capped.pricing.round_time(plan, 1) < full.pricing.round_time(plan, 1)


def test_a_copy_seen_by_shadow_lookups_wakes_the_ranking_under_plain_decoding():
    """Plain decoding held between rankings (a ranking budget of many rounds): a round in which a row's whole shadow
    draft matched the target's text (a copy starting) makes the next answer a ranking, which switches to the
    lookup at once; a shadow draft that missed keeps the held plan."""
    def planner() -> Planner:
        p = Planner([Level("ngram", ngram=NgramConfig(8, 1, 4), k=8), Level("t", worker=_dummy("t"))],
                    k_max=8, rerank_every=1000)
        for q in (1, 5, 9):
            for _ in range(3):
                p.on_call(1, "verify", 1, q, 0.1 + 0.05 * q)  # each draft token costs a third of a step
        # rounds of the lookup: after a row's whole draft was accepted the next one is too (a copy), else rejected
        for whole in [True] * 4 + [False] * 6 + [True] * 4 + [False] * 6:
            p.on_call(1, "verify", 1, 5, 0.35)
            p.on_verify(1, 0, [4], [4 if whole else 0])
        return p

    for matched in (True, False):
        p = planner()
        reasons = []
        for _ in range(5):  # the warm-up's answers, a ranking, then held rounds
            p.on_call(1, "verify", 1, 1, 0.15)
            p.on_shadow(1, 0, [4], [0], 8)  # rows cold: plain decoding ranks best
            reasons.append(p.last_reason if p.plan(1) == p.plain else "lookup")
        assert reasons[-3:] == ["ranked", "hold", "hold"]
        p.on_call(1, "verify", 1, 1, 0.15)
        p.on_shadow(1, 0, [4], [4 if matched else 1], 8)
        chosen = p.plan(1)
        if matched:
            assert p.last_reason == "ranked" and 0 in chosen.levels
        else:
            assert p.last_reason == "hold" and chosen == p.plain
