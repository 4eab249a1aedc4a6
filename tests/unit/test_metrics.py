"""Prometheus text format of specray's metrics, and the Grafana dashboard only using metrics that exist."""

from __future__ import annotations

import json
import re
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from specray.coordinator.stats import LevelStats
from specray.metrics import SpecMetrics

ROOT = Path(__file__).resolve().parents[2]


def _stats(drafts, draft_tokens, accepted, per_pos):
    st = LevelStats()
    st.num_drafts, st.draft_tokens, st.accepted_tokens, st.accepted_per_pos = drafts, draft_tokens, accepted, per_pos
    st.verify_calls, st.emitted_tokens = drafts, accepted + drafts
    return st


def samples(m: SpecMetrics) -> dict[tuple, float]:
    out = {}
    for fam in text_string_to_metric_families(m.render().decode()):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_counters_are_sums_of_request_stats_and_parse_as_prometheus_text():
    m = SpecMetrics(model_name="x")
    reqs = [{"target": _stats(3, 12, 7, [3, 2, 1, 1])}, {"target": _stats(2, 8, 8, [2, 2, 2, 2]),
                                                         "mid": _stats(5, 10, 4, [3, 1])}]
    for r in reqs:
        m.observe_request(r, "length", 10, 20, ttft=0.1, e2e=1.0)
    s = samples(m)
    key = lambda name, **lb: (name, tuple(sorted({"model_name": "x", **lb}.items())))
    assert s[key("spec_decode_num_draft_tokens_total", level="target")] == 20
    assert s[key("spec_decode_num_accepted_tokens_total", level="target")] == 15
    assert s[key("spec_decode_num_drafts_total", level="mid")] == 5
    assert s[key("spec_decode_num_accepted_tokens_per_pos_total", level="target", position="0")] == 5
    assert s[key("specray_requests_total", finish_reason="length")] == 2
    assert s[key("specray_e2e_request_latency_seconds_count")] == 2
    m.observe_round(4, {"ngram:4>target": 4}, 0.2, regime="ngram")
    s = samples(m)
    assert s[key("specray_regime", regime="ngram")] == 1 and s[key("specray_regime", regime="none")] == 0
    assert s[key("specray_batch_size")] == 4


def test_grafana_dashboard_uses_existing_metrics():
    dash = json.loads((ROOT / "cluster" / "grafana-specray.json").read_text())
    m = SpecMetrics(model_name="x")
    m.observe_request({"t": _stats(1, 2, 1, [1])}, "stop", 1, 2, ttft=0.1, e2e=0.2)
    m.observe_round(1, {"t": 1}, 0.1, regime="none")
    known = {s[0] for s in samples(m)}
    titles = set()
    for p in dash["panels"]:
        titles.add(p["title"])
        for t in p["targets"]:
            for name in re.findall(r"\b(spec_decode_\w+|specray_\w+)\b", t["expr"]):
                assert name in known, f"{p['title']}: {name} is not exported"
    assert {"Acceptance rate by level", "Mean acceptance length (tokens per verification)"} <= titles
    assert any("P90" in t for t in titles) and any("Regime" in t for t in titles)
