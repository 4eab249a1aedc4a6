"""Prometheus metrics, named as vLLM names its speculative-decoding metrics (plus a `level` label).

Counters only count; rates are PromQL, not gauges:

    acceptance rate per level:
        rate(spec_decode_num_accepted_tokens_total[1m]) / rate(spec_decode_num_draft_tokens_total[1m])
    mean acceptance length (tokens per verification, incl. the bonus/correction token):
        1 + rate(spec_decode_num_accepted_tokens_total[1m]) / rate(spec_decode_num_drafts_total[1m])
    acceptance at position p:
        rate(spec_decode_num_accepted_tokens_per_pos_total{position="p"}[1m]) / rate(spec_decode_num_drafts_total[1m])
    P90 end-to-end latency:
        histogram_quantile(0.9, rate(specray_e2e_request_latency_seconds_bucket[5m]))

Requests are counted when they end (finished, stopped, cancelled or failed), so after N requests each
counter equals the sum of the per-request statistics returned in their `usage`.
"""

from __future__ import annotations

from collections.abc import Mapping

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from specray.coordinator.stats import LevelStats

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
TOKEN_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.4, 0.8, 1.6, 3.2, 6.4)


class SpecMetrics:
    """All of specray's metrics in one registry (one per coordinator process)."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, registry: CollectorRegistry | None = None, model_name: str = "specray") -> None:
        self.registry = registry or CollectorRegistry()
        self.model_name = model_name
        r, lv = self.registry, ["model_name", "level"]
        self.num_drafts = Counter("spec_decode_num_drafts", "Verification calls that had at least one draft token.",
                                  lv, registry=r)
        self.num_draft_tokens = Counter("spec_decode_num_draft_tokens", "Draft tokens proposed to the level.", lv,
                                        registry=r)
        self.num_accepted_tokens = Counter("spec_decode_num_accepted_tokens", "Draft tokens the level accepted.", lv,
                                           registry=r)
        self.accepted_per_pos = Counter("spec_decode_num_accepted_tokens_per_pos",
                                        "Accepted draft tokens by position in the draft (0-based).",
                                        [*lv, "position"], registry=r)
        self.requests = Counter("specray_requests", "Requests ended, by finish reason.",
                                ["model_name", "finish_reason"], registry=r)
        self.prompt_tokens = Counter("specray_prompt_tokens", "Prompt tokens of ended requests.", ["model_name"],
                                     registry=r)
        self.generation_tokens = Counter("specray_generation_tokens", "Generated tokens of ended requests.",
                                         ["model_name"], registry=r)
        self.ttft = Histogram("specray_time_to_first_token_seconds", "Time to first token.", ["model_name"],
                              buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("specray_time_per_output_token_seconds", "Mean time per output token after the first.",
                              ["model_name"], buckets=TOKEN_BUCKETS, registry=r)
        self.e2e = Histogram("specray_e2e_request_latency_seconds", "End-to-end request latency.", ["model_name"],
                             buckets=LATENCY_BUCKETS, registry=r)
        self.round_latency = Histogram("specray_round_latency_seconds", "Duration of one batched round.",
                                       ["model_name", "plan"], buckets=LATENCY_BUCKETS, registry=r)
        self.batch_size = Gauge("specray_batch_size", "Active sequences in the running batch.", ["model_name"],
                                registry=r)
        self.plan_sequences = Gauge("specray_plan_sequences", "Sequences that ran each plan in the last round.",
                                    ["model_name", "plan"], registry=r)
        self.regime = Gauge("specray_regime", "1 for the planner's current regime (cascade/draft/ngram/none).",
                            ["model_name", "regime"], registry=r)
        self._last_plans: set[str] = set()

    # ----- recording ------------------------------------------------------------------------------
    def observe_request(
        self, stats: Mapping[str, LevelStats] | None, finish_reason: str, prompt_tokens: int, completion_tokens: int,
        ttft: float | None, e2e: float,
    ) -> None:
        m = self.model_name
        self.requests.labels(m, finish_reason).inc()
        self.prompt_tokens.labels(m).inc(prompt_tokens)
        self.generation_tokens.labels(m).inc(completion_tokens)
        self.e2e.labels(m).observe(e2e)
        if ttft is not None:
            self.ttft.labels(m).observe(ttft)
            if completion_tokens > 1:
                self.tpot.labels(m).observe((e2e - ttft) / (completion_tokens - 1))
        for level, st in (stats or {}).items():
            if st.num_drafts == 0:
                continue
            self.num_drafts.labels(m, level).inc(st.num_drafts)
            self.num_draft_tokens.labels(m, level).inc(st.draft_tokens)
            self.num_accepted_tokens.labels(m, level).inc(st.accepted_tokens)
            for pos, count in enumerate(st.accepted_per_pos):
                if count:
                    self.accepted_per_pos.labels(m, level, str(pos)).inc(count)

    def observe_round(
        self, batch_size: int, plan_sizes: Mapping[str, int], seconds: float, regime: str | None = None
    ) -> None:
        m = self.model_name
        if regime is not None:
            for name in ("cascade", "draft", "ngram", "none"):
                self.regime.labels(m, name).set(1.0 if name == regime else 0.0)
        self.batch_size.labels(m).set(batch_size)
        for plan in list(self._last_plans):
            if plan not in plan_sizes:
                self.plan_sequences.labels(m, plan).set(0)
        for plan, n in plan_sizes.items():
            self.plan_sequences.labels(m, plan).set(n)
            self.round_latency.labels(m, plan).observe(seconds)
        self._last_plans = set(plan_sizes)

    def render(self) -> bytes:
        return generate_latest(self.registry)
