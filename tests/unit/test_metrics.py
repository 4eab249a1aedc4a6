"""specray's metrics in one process: Prometheus text with vLLM's names, counters equal to the sums of the requests'
statistics by drafter -> verifier pair, the gauges, the names Ray exports, and the Grafana dashboard only querying
metrics that exist."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from specray.coordinator.cascade import Level, Plan
from specray.coordinator.generate import generate
from specray.coordinator.stats import LevelStats, named_stats
from specray.metrics import CATALOG, NUM_DRAFTS, ROUND_LATENCY, RUNNING, SpecMetrics, exported_names
from specray.serve.protocol import usage_from_stats
from specray.spec.ngram import NgramConfig
from specray.testing.fake import FakeWorker

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "cluster" / "grafana-specray.json"


def _stats(drafts, draft_tokens, accepted, per_pos):
    st = LevelStats()
    st.num_drafts, st.draft_tokens, st.accepted_tokens, st.accepted_per_pos = drafts, draft_tokens, accepted, per_pos
    st.verify_calls, st.emitted_tokens = drafts, accepted + drafts
    return st


def _named(pairs: dict[str, LevelStats]) -> LevelStats:
    """A level's statistics made of the given pairs (as `named_stats` builds them)."""
    level = LevelStats()
    for name, st in pairs.items():
        level.merge(st)
        level.pairs[name] = st
    return level


def samples(m: SpecMetrics) -> dict[tuple, float]:
    out = {}
    for fam in text_string_to_metric_families(m.render().decode()):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def key(name, **lb):
    return name, tuple(sorted({"model_name": "x", **lb}.items()))


def test_counters_are_sums_of_request_stats_by_pair_and_parse_as_prometheus_text():
    m = SpecMetrics(model_name="x")
    reqs = [
        {"target": _named({"mid->target": _stats(3, 12, 7, [3, 2, 1, 1])})},
        {"mid": _named({"ngram->mid": _stats(5, 10, 4, [3, 1])}),
         "target": _named({"mid->target": _stats(2, 8, 8, [2, 2, 2, 2]), "ngram->target": _stats(1, 3, 0, [])})},
    ]
    for r in reqs:
        m.observe_request(r, "length", 10, 20, ttft=0.1, e2e=1.0)
    s = samples(m)
    assert s[key("vllm:spec_decode_num_draft_tokens_total", level="target", pair="mid->target")] == 20
    assert s[key("vllm:spec_decode_num_draft_tokens_total", level="target", pair="ngram->target")] == 3
    assert s[key("vllm:spec_decode_num_accepted_tokens_total", level="target", pair="mid->target")] == 15
    assert s[key("vllm:spec_decode_num_drafts_total", level="mid", pair="ngram->mid")] == 5
    assert s[key("vllm:spec_decode_num_accepted_tokens_per_pos_total", level="target", pair="mid->target",
                 position="0")] == 5
    assert key("vllm:spec_decode_num_accepted_tokens_total", level="target", pair="ngram->target") not in s  # 0
    # per level = the sum over its pairs = what the usage reports
    usage = [usage_from_stats(10, 20, r).speculation for r in reqs]
    assert m.value("vllm:spec_decode_num_draft_tokens_total", level="target") == sum(
        u["target"].draft_tokens for u in usage) == 23
    assert usage[1]["target"].pair == "mid+ngram->target" and usage[0]["target"].pair == "mid->target"
    assert s[key("specray_requests_total", finish_reason="length")] == 2
    assert s[key("vllm:request_success_total", finished_reason="length")] == 2
    assert s[key("vllm:prompt_tokens_total")] == 20 and s[key("vllm:generation_tokens_total")] == 40
    assert s[key("vllm:e2e_request_latency_seconds_count")] == 2
    assert s[key("vllm:request_time_per_output_token_seconds_count")] == 2


def test_stats_without_pairs_still_count():
    m = SpecMetrics(model_name="x")
    m.observe_request({"t": _stats(2, 8, 5, [2, 2, 1])}, "stop", 1, 2, ttft=None, e2e=0.1)
    assert m.value("vllm:spec_decode_num_draft_tokens_total", level="t", pair="unknown->t") == 8


def test_cancelled_and_failed_requests_count_as_vllm_finish_reasons_and_errors():
    m = SpecMetrics(model_name="x")
    m.observe_cancelled()
    m.observe_error("model_unavailable")
    m.observe_error("model_unavailable")
    s = samples(m)
    assert s[key("vllm:request_success_total", finished_reason="abort")] == 1
    assert s[key("vllm:request_success_total", finished_reason="error")] == 2
    assert s[key("specray_requests_total", finish_reason="cancelled")] == 1
    assert s[key("specray_request_errors_total", code="model_unavailable")] == 2
    assert m.value("vllm:prompt_tokens_total") == 0  # no usage was returned for them


def test_gauges_follow_the_queue_the_rounds_and_go_idle():
    m = SpecMetrics(model_name="x")
    m.observe_queue(3, 2)
    m.observe_round(3, {"ngram:4>target": 2, "target": 1}, 0.2, regime="ngram")
    s = samples(m)
    assert s[key("vllm:num_requests_running")] == 3 and s[key("vllm:num_requests_waiting")] == 2
    assert s[key("specray_regime", regime="ngram")] == 1 and s[key("specray_regime", regime="none")] == 0
    assert s[key("specray_batch_size")] == 3
    assert s[key("specray_plan_sequences", plan="target")] == 1
    assert s[key("specray_round_latency_seconds_count", plan="ngram:4>target")] == 1
    m.observe_round(1, {"target": 1}, 0.1)
    assert samples(m)[key("specray_plan_sequences", plan="ngram:4>target")] == 0
    m.observe_queue(0, 0)
    s = samples(m)
    assert s[key("specray_batch_size")] == 0 and s[key("specray_plan_sequences", plan="target")] == 0
    assert s[key("vllm:num_requests_running")] == 0


def test_planner_rounds_and_seconds_by_plan_bucket_and_reason():
    """`specray_planner_rounds_total` / `specray_planner_round_seconds_total`: what a user tuning the planner reads --
    how many rounds and seconds went to probes against held plans, per batch bucket (powers of two)."""
    m = SpecMetrics(model_name="x")
    m.observe_round(8, {"target": 8}, 0.3, regime="none", reason="ranked")
    m.observe_round(7, {"target": 7}, 0.2, regime="none", reason="hold")
    m.observe_round(8, {"ngram:4>target": 2, "target": 6}, 1.5, regime="none", reason="explore")
    m.observe_round(3, {"target": 3}, 0.1)  # no planner: no reason, not counted
    s = samples(m)
    assert s[key("specray_planner_rounds_total", plan="target", batch_bucket="8", reason="ranked")] == 1
    assert s[key("specray_planner_round_seconds_total", plan="target", batch_bucket="8", reason="hold")] == 0.2
    probe = dict(plan="ngram:4>target + target", batch_bucket="8", reason="explore")
    assert s[key("specray_planner_rounds_total", **probe)] == 1
    assert s[key("specray_planner_round_seconds_total", **probe)] == 1.5
    assert m.value("specray_planner_rounds_total") == 3


def test_router_metrics():
    m = SpecMetrics(model_name="x")
    m.observe_routed("target")
    m.observe_pool_inflight("target", 2)
    m.observe_break_even(3.5)
    s = samples(m)
    assert s[key("specray_routed_requests_total", pool="target")] == 1
    assert s[key("specray_pool_inflight", pool="target")] == 2 and s[key("specray_break_even_batch")] == 3.5


def test_names_as_ray_exports_them():
    assert NUM_DRAFTS.name == "vllm:spec_decode_num_drafts"
    assert NUM_DRAFTS.exported == ("ray_vllm_spec_decode_num_drafts_total",)
    assert NUM_DRAFTS.local == ("vllm:spec_decode_num_drafts_total",)
    assert RUNNING.exported == ("ray_vllm_num_requests_running",)
    assert ROUND_LATENCY.exported == tuple(f"ray_specray_round_latency_seconds_{s}" for s in ("bucket", "sum", "count"))
    assert len({spec.name for spec in CATALOG}) == len(CATALOG)
    assert all(spec.labels[0] == "model_name" for spec in CATALOG)


def test_pairs_name_each_drafter_of_a_level_and_sum_to_its_totals():
    """The planner switching plans between rounds: the target verifies drafts from the n-gram and from the
    draft model; each is its own pair, and the pairs add up to the level."""
    levels = [Level("ngram", ngram=NgramConfig(3, 1, 3)),
              Level("d", worker=FakeWorker("d", vocab=16, order=2, table_seed=0, noise=0.5, noise_seed=1), k=3),
              Level("target", worker=FakeWorker("target", vocab=16, order=2, table_seed=0))]
    plans = iter([Plan((0, 2), (3,)), Plan((1, 2), (3,)), Plan((0, 1, 2), (3, 3))] * 50)
    prompts = [[1, 2, 3, 1, 2, 3, 1, 2], [4, 5, 6, 7, 4, 5, 6, 7]]
    batch = generate(levels, prompts, max_tokens=30, ignore_eos=True, plan=lambda _n: next(plans))
    target, mid = batch.stats["target"], batch.stats["d"]
    assert set(target.pairs) == {"ngram->target", "d->target"} and set(mid.pairs) == {"ngram->d"}
    assert target.pair == "ngram+d->target" and mid.pair == "ngram->d"
    for level in (target, mid):
        for field in ("num_drafts", "draft_tokens", "accepted_tokens"):
            assert sum(getattr(p, field) for p in level.pairs.values()) == getattr(level, field) > 0, field
    m = SpecMetrics(model_name="x")
    for r in batch.results:
        m.observe_request(r.stats, r.finish_reason, 8, len(r.token_ids), ttft=0.1, e2e=1.0)
    for pair, st in target.pairs.items():
        assert m.value("vllm:spec_decode_num_accepted_tokens_total", level="target", pair=pair) == st.accepted_tokens
    spec = usage_from_stats(8, 30, batch.results[0].stats).model_dump()["speculation"]
    assert set(spec["target"]["pairs"]) <= {"ngram->target", "d->target"} and spec["d"]["pair"] == "ngram->d"


def test_named_stats_orders_levels_and_pairs():
    raw = {(2, 1): _stats(1, 2, 1, [1]), (1, 0): _stats(1, 3, 3, [1, 1, 1]), (2, 0): _stats(2, 4, 0, []),
           (2, None): _stats(0, 0, 0, [])}
    raw[(2, None)].verify_calls = raw[(2, None)].emitted_tokens = 4  # plain rounds: counted in the level only
    named = named_stats(["ngram", "mid", "target"], raw)
    assert list(named) == ["mid", "target"]
    assert list(named["target"].pairs) == ["ngram->target", "mid->target"]
    assert named["target"].verify_calls == 3 + 4 and sum(p.verify_calls for p in named["target"].pairs.values()) == 3


# ------------------------------------------------------------------------------------------- the dashboard

_GROUPING = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless", "offset"}


def promql_metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects: identifiers left once strings, label matchers, ranges,
    grouping label lists, function calls and keywords are taken out."""
    e = re.sub(r'"(?:[^"\\]|\\.)*"', "", expr)
    e = re.sub(r"\{[^}]*\}", " ", e)
    e = re.sub(r"\[[^\]]*\]", " ", e)
    e = _GROUPING.sub(" ", e)
    names = set()
    for m in re.finditer(r"[a-zA-Z_:][a-zA-Z0-9_:]*", e):
        rest = e[m.end():].lstrip()
        if rest.startswith("(") or m.group() in _KEYWORDS:
            continue
        names.add(m.group())
    return names


def test_promql_metric_names_finds_bare_and_selected_metrics():
    expr = ('histogram_quantile(0.9, sum by (le, plan) (rate(ray_a_bucket{x=~"$m", y="b{c}"}[5m]))) / '
            "ignoring(position) group_left sum(ray_b) + 1")
    assert promql_metric_names(expr) == {"ray_a_bucket", "ray_b"}


def test_grafana_dashboard_queries_only_exported_metrics():
    dash = json.loads(DASHBOARD.read_text())
    known = exported_names()
    titles, used = set(), set()
    for p in dash["panels"]:
        titles.add(p["title"])
        assert p["targets"], p["title"]
        for t in p["targets"]:
            names = promql_metric_names(t["expr"])
            assert names, f"{p['title']}: no metric in {t['expr']!r}"
            for name in names:
                assert name in known, f"{p['title']}: {name} is not exported"
            used |= names
    for var in dash["templating"]["list"]:
        if var["type"] == "query":
            inner = re.fullmatch(r"label_values\((\w+), *\w+\)", var["query"])
            assert inner and inner.group(1) in known, var["query"]
    assert {"Acceptance rate by level", "Mean acceptance length (tokens per verification)"} <= titles
    assert any("P90" in t for t in titles) and any("Regime" in t for t in titles)
    # the queue, finish reasons, errors, round latency and the router are on it
    for name in ("ray_vllm_num_requests_running", "ray_vllm_num_requests_waiting", "ray_vllm_request_success_total",
                 "ray_specray_request_errors_total", "ray_specray_round_latency_seconds_bucket",
                 "ray_specray_routed_requests_total", "ray_specray_pool_inflight", "ray_specray_break_even_batch"):
        assert name in used, name


@pytest.mark.parametrize("bad", ['sum(rate(spec_decode_num_drafts_total{model_name=~"$model"}[1m]))',
                                 "sum(ray_vllm_num_requests_running) + ray_specray_nope"])
def test_the_dashboard_check_rejects_unknown_names(bad):
    assert not promql_metric_names(bad) <= exported_names()
