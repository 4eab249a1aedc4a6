"""specray's metrics: one catalog, one recorder, and sinks that export what it records.

Names follow vLLM where vLLM has the metric (`vllm:spec_decode_*`, `vllm:num_requests_running`, ...) with
vLLM's `model_name` label, plus specray's labels: `level` (the verifying level) and `pair` (the drafter ->
verifier pair, "ngram->mid"; see `specray.coordinator.stats`) on the speculative-decoding counters. specray's own
metrics (rounds, planner, router) are named `specray_*`.

Sinks (`MetricsSink`) receive the recorder's events; `SpecMetrics` always records into a `PrometheusSink`
(this process's registry: `/metrics` of one replica, `specray generate`, tests) and into any sink it is given.
Under Ray Serve, `specray.serve.raymetrics.RayMetricsSink` sends the same events through Ray's metrics
pipeline, which every node's metrics agent exports with replica labels: the cluster-wide scrape. Ray renames
them (`vllm:x` -> `ray_vllm_x`, `specray_x` -> `ray_specray_x`); `exported_names` gives those names.

Counters only count; rates are PromQL (docs/metrics.md has more):

    acceptance rate per pair:
        sum by (pair) (rate(ray_vllm_spec_decode_num_accepted_tokens_total[1m]))
          / sum by (pair) (rate(ray_vllm_spec_decode_num_draft_tokens_total[1m]))
    mean acceptance length (tokens per verification, incl. the bonus/correction token):
        1 + rate(ray_vllm_spec_decode_num_accepted_tokens_total[1m]) / rate(ray_vllm_spec_decode_num_drafts_total[1m])

A request is counted when it ends: a finished one adds its tokens and speculation statistics, so after N
requests the counters' increase equals the sum of the `usage` their responses carried.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics import MetricWrapperBase

from specray.coordinator.stats import LevelStats, pair_name

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
TOKEN_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.4, 0.8, 1.6, 3.2, 6.4)
ROUND_BUCKETS = (0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)

#: Ray's metrics agent puts this before every application metric name
RAY_PREFIX = "ray_"
#: planner regimes (`specray_regime` has one series per regime, 1 for the current one)
REGIMES = ("cascade", "draft", "ngram", "none")
#: vLLM's finished_reason for specray's finish reasons
_VLLM_REASON = {"stop": "stop", "length": "length", "cancelled": "abort", "error": "error", "abort": "abort"}

Kind = Literal["counter", "gauge", "histogram"]


@dataclass(frozen=True)
class MetricSpec:
    """One metric: its kind, name as vLLM writes it (may hold ':'), help text, label names, histogram buckets."""

    kind: Kind
    name: str
    doc: str
    labels: tuple[str, ...]
    buckets: tuple[float, ...] = ()

    @property
    def ray_name(self) -> str:
        """The name given to Ray: ':' is refused there, so `vllm:x` becomes `vllm_x` (as vLLM's own Ray stat
        logger, used by Ray Serve LLM, does)."""
        return re.sub(r"[^a-zA-Z0-9_]", "_", self.name)

    def sample_names(self, base: str) -> tuple[str, ...]:
        if self.kind == "counter":
            return (base + "_total",)
        if self.kind == "histogram":
            return (base + "_bucket", base + "_sum", base + "_count")
        return (base,)

    @property
    def exported(self) -> tuple[str, ...]:
        """Sample names on a node's metrics agent (the cluster-wide scrape)."""
        return self.sample_names(RAY_PREFIX + self.ray_name)

    @property
    def local(self) -> tuple[str, ...]:
        """Sample names in this process's registry (one replica's `/metrics`)."""
        return self.sample_names(self.name)


def _spec_decode(name: str, doc: str, *extra: str) -> MetricSpec:
    return MetricSpec("counter", name, doc, ("model_name", "level", "pair", *extra))


NUM_DRAFTS = _spec_decode("vllm:spec_decode_num_drafts", "Verification calls that had at least one draft token.")
NUM_DRAFT_TOKENS = _spec_decode("vllm:spec_decode_num_draft_tokens", "Draft tokens proposed to the level.")
NUM_ACCEPTED_TOKENS = _spec_decode("vllm:spec_decode_num_accepted_tokens", "Draft tokens the level accepted.")
ACCEPTED_PER_POS = _spec_decode("vllm:spec_decode_num_accepted_tokens_per_pos",
                                "Accepted draft tokens by position in the draft (0-based).", "position")
TREE_DRAFTS = _spec_decode("specray_spec_decode_num_tree_drafts",
                           "Verifications of a draft token tree (also counted in num_drafts).")
TREE_NODES = _spec_decode("specray_spec_decode_num_tree_nodes",
                          "Nodes of the draft trees verified (also counted in num_draft_tokens).")
RUNNING = MetricSpec("gauge", "vllm:num_requests_running", "Requests in the running batch.", ("model_name",))
WAITING = MetricSpec("gauge", "vllm:num_requests_waiting", "Requests waiting for a place in the batch.",
                     ("model_name",))
PROMPT_TOKENS = MetricSpec("counter", "vllm:prompt_tokens", "Prompt tokens of finished requests.", ("model_name",))
GENERATION_TOKENS = MetricSpec("counter", "vllm:generation_tokens", "Generated tokens of finished requests.",
                               ("model_name",))
REQUEST_SUCCESS = MetricSpec("counter", "vllm:request_success",
                             "Requests ended, by vLLM's finished_reason (stop, length, abort, error).",
                             ("model_name", "finished_reason"))
TTFT = MetricSpec("histogram", "vllm:time_to_first_token_seconds", "Time to first token.", ("model_name",),
                  LATENCY_BUCKETS)
TPOT = MetricSpec("histogram", "vllm:request_time_per_output_token_seconds",
                  "Mean time per output token after the first, per request.", ("model_name",), TOKEN_BUCKETS)
E2E = MetricSpec("histogram", "vllm:e2e_request_latency_seconds", "End-to-end request latency.", ("model_name",),
                 LATENCY_BUCKETS)
REQUESTS = MetricSpec("counter", "specray_requests",
                      "Requests ended, by finish reason (stop, length, cancelled, error).",
                      ("model_name", "finish_reason"))
ERRORS = MetricSpec("counter", "specray_request_errors",
                    "Requests that failed while generating, by error code (model_unavailable, invalid_request).",
                    ("model_name", "code"))
ROUND_LATENCY = MetricSpec("histogram", "specray_round_latency_seconds",
                           "Duration of one batched round (draft + verify), by plan.", ("model_name", "plan"),
                           ROUND_BUCKETS)
PLANNER_ROUNDS = MetricSpec(
    "counter", "specray_planner_rounds", "Rounds by the plans they ran, the batch's power-of-two bucket and why the "
    "planner chose them (ranked, hold, warmup, explore, plain_probe, table; request: every sequence ran its own).",
    ("model_name", "plan", "batch_bucket", "reason"))
PLANNER_SECONDS = MetricSpec(
    "counter", "specray_planner_round_seconds", "Wall seconds of those rounds (labels as specray_planner_rounds).",
    ("model_name", "plan", "batch_bucket", "reason"))
BATCH_SIZE = MetricSpec("gauge", "specray_batch_size", "Sequences in the last round (0 when idle).",
                        ("model_name",))
PLAN_SEQUENCES = MetricSpec("gauge", "specray_plan_sequences", "Sequences that ran each plan in the last round.",
                            ("model_name", "plan"))
REGIME = MetricSpec("gauge", "specray_regime", "1 for the planner's current regime (cascade/draft/ngram/none).",
                    ("model_name", "regime"))
ROUTED = MetricSpec("counter", "specray_routed_requests", "Requests the router sent to each pool.",
                    ("model_name", "pool"))
POOL_INFLIGHT = MetricSpec("gauge", "specray_pool_inflight", "Requests the router has in flight per pool.",
                           ("model_name", "pool"))
BREAK_EVEN = MetricSpec("gauge", "specray_break_even_batch",
                        "Batch per replica past which plain decoding wins (the router's threshold).", ("model_name",))

#: every metric specray records, in one place (sinks create them all up front)
CATALOG: tuple[MetricSpec, ...] = (
    NUM_DRAFTS, NUM_DRAFT_TOKENS, NUM_ACCEPTED_TOKENS, ACCEPTED_PER_POS, TREE_DRAFTS, TREE_NODES, RUNNING, WAITING,
    PROMPT_TOKENS, GENERATION_TOKENS, REQUEST_SUCCESS, TTFT, TPOT, E2E, REQUESTS, ERRORS, ROUND_LATENCY, BATCH_SIZE,
    PLAN_SEQUENCES, REGIME, ROUTED, POOL_INFLIGHT, BREAK_EVEN, PLANNER_ROUNDS, PLANNER_SECONDS,
)
#: the router's own metrics in pools mode (the pools record the requests they run: each is counted once)
ROUTER_METRICS = frozenset({ROUTED.name, POOL_INFLIGHT.name, BREAK_EVEN.name})


def exported_names(catalog: Iterable[MetricSpec] = CATALOG) -> set[str]:
    """Every sample name the node metrics agents export for specray (what dashboards may query)."""
    return {n for spec in catalog for n in spec.exported}


class MetricsSink(Protocol):
    """Where recorded values go; `labels` are the values of `spec.labels`, in order."""

    def inc(self, spec: MetricSpec, labels: Sequence[str], value: float) -> None: ...

    def set(self, spec: MetricSpec, labels: Sequence[str], value: float) -> None: ...

    def observe(self, spec: MetricSpec, labels: Sequence[str], value: float) -> None: ...


class PrometheusSink:
    """A prometheus_client registry of its own: the metrics of this process, with vLLM's exact names."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, registry: CollectorRegistry | None = None, catalog: Iterable[MetricSpec] = CATALOG) -> None:
        self.registry = registry or CollectorRegistry()
        self._m: dict[str, MetricWrapperBase] = {}
        for spec in catalog:
            kw = {"registry": self.registry}
            if spec.kind == "counter":
                self._m[spec.name] = Counter(spec.name, spec.doc, spec.labels, **kw)
            elif spec.kind == "gauge":
                self._m[spec.name] = Gauge(spec.name, spec.doc, spec.labels, **kw)
            else:
                self._m[spec.name] = Histogram(spec.name, spec.doc, spec.labels, buckets=spec.buckets, **kw)

    def inc(self, spec: MetricSpec, labels: Sequence[str], value: float) -> None:
        self._m[spec.name].labels(*labels).inc(value)

    def set(self, spec: MetricSpec, labels: Sequence[str], value: float) -> None:
        self._m[spec.name].labels(*labels).set(value)

    def observe(self, spec: MetricSpec, labels: Sequence[str], value: float) -> None:
        self._m[spec.name].labels(*labels).observe(value)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class OnlySink:
    """Passes on only the named metrics to `sink` (the router exports its routing metrics alone)."""

    def __init__(self, sink: MetricsSink, names: Iterable[str]) -> None:
        self.sink, self.names = sink, frozenset(names)

    def inc(self, spec: MetricSpec, labels: Sequence[str], value: float) -> None:
        if spec.name in self.names:
            self.sink.inc(spec, labels, value)

    def set(self, spec: MetricSpec, labels: Sequence[str], value: float) -> None:
        if spec.name in self.names:
            self.sink.set(spec, labels, value)

    def observe(self, spec: MetricSpec, labels: Sequence[str], value: float) -> None:
        if spec.name in self.names:
            self.sink.observe(spec, labels, value)


class SpecMetrics:
    """Records specray's events into this process's registry and into every injected sink."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, registry: CollectorRegistry | None = None, model_name: str = "specray",
                 sinks: Sequence[MetricsSink] = ()) -> None:
        self.local = PrometheusSink(registry)
        self.registry = self.local.registry
        self.model_name = model_name
        self.sinks: tuple[MetricsSink, ...] = (self.local, *sinks)
        self._last_plans: set[str] = set()

    # ----- fan-out --------------------------------------------------------------------------------
    def _inc(self, spec: MetricSpec, value: float, *labels: str) -> None:
        if value:
            for s in self.sinks:
                s.inc(spec, (self.model_name, *labels), value)

    def _set(self, spec: MetricSpec, value: float, *labels: str) -> None:
        for s in self.sinks:
            s.set(spec, (self.model_name, *labels), value)

    def _observe(self, spec: MetricSpec, value: float, *labels: str) -> None:
        for s in self.sinks:
            s.observe(spec, (self.model_name, *labels), value)

    # ----- requests -------------------------------------------------------------------------------
    def observe_request(
        self, stats: Mapping[str, LevelStats] | None, finish_reason: str, prompt_tokens: int, completion_tokens: int,
        ttft: float | None, e2e: float,
    ) -> None:
        """A request that finished (stop or length): its tokens, latencies and speculation statistics."""
        self._ended(finish_reason)
        self._inc(PROMPT_TOKENS, prompt_tokens)
        self._inc(GENERATION_TOKENS, completion_tokens)
        self._observe(E2E, e2e)
        if ttft is not None:
            self._observe(TTFT, ttft)
            if completion_tokens > 1:
                self._observe(TPOT, (e2e - ttft) / (completion_tokens - 1))
        for level, st in (stats or {}).items():
            # statistics built without pairs (by hand) still count, under an unknown drafter
            for pair, ps in (st.pairs or {pair_name("unknown", level): st}).items():
                if ps.num_drafts == 0:
                    continue
                self._inc(NUM_DRAFTS, ps.num_drafts, level, pair)
                self._inc(NUM_DRAFT_TOKENS, ps.draft_tokens, level, pair)
                self._inc(NUM_ACCEPTED_TOKENS, ps.accepted_tokens, level, pair)
                for pos, count in enumerate(ps.accepted_per_pos):
                    self._inc(ACCEPTED_PER_POS, count, level, pair, str(pos))
                if ps.tree_drafts:
                    self._inc(TREE_DRAFTS, ps.tree_drafts, level, pair)
                    self._inc(TREE_NODES, ps.tree_nodes, level, pair)

    def observe_cancelled(self) -> None:
        """A request whose client went away before it finished."""
        self._ended("cancelled")

    def observe_error(self, code: str) -> None:
        """A request that failed while generating (`code`: the OpenAI error code it was answered with)."""
        self._ended("error")
        self._inc(ERRORS, 1, code)

    def _ended(self, reason: str) -> None:
        self._inc(REQUESTS, 1, reason)
        self._inc(REQUEST_SUCCESS, 1, _VLLM_REASON.get(reason, reason))

    # ----- the batch ------------------------------------------------------------------------------
    def observe_queue(self, running: int, waiting: int) -> None:
        self._set(RUNNING, running)
        self._set(WAITING, waiting)
        if running == 0:  # idle: no round will report it
            self._set(BATCH_SIZE, 0)
            for plan in self._last_plans:
                self._set(PLAN_SEQUENCES, 0, plan)
            self._last_plans = set()

    def observe_round(
        self, batch_size: int, plan_sizes: Mapping[str, int], seconds: float, regime: str | None = None,
        reason: str | None = None,
    ) -> None:
        """One round: its batch, sequences per plan, wall seconds, the planner's regime and why it chose the round's
        plans (`reason`; None: no planner). The per-reason counters are what to read when tuning the planner: the
        rounds and seconds spent on probes (`explore`, `plain_probe`) against the rest, per batch bucket."""
        if reason is not None:
            bucket = str(1 << max(0, int(batch_size) - 1).bit_length())
            plans = " + ".join(sorted(plan_sizes))
            self._inc(PLANNER_ROUNDS, 1, plans, bucket, reason)
            self._inc(PLANNER_SECONDS, seconds, plans, bucket, reason)
        if regime is not None:
            for name in REGIMES:
                self._set(REGIME, 1.0 if name == regime else 0.0, name)
        self._set(BATCH_SIZE, batch_size)
        for plan in self._last_plans - set(plan_sizes):
            self._set(PLAN_SEQUENCES, 0, plan)
        for plan, n in plan_sizes.items():
            self._set(PLAN_SEQUENCES, n, plan)
            self._observe(ROUND_LATENCY, seconds, plan)
        self._last_plans = set(plan_sizes)

    # ----- the router -----------------------------------------------------------------------------
    def observe_routed(self, pool: str) -> None:
        self._inc(ROUTED, 1, pool)

    def observe_pool_inflight(self, pool: str, inflight: int) -> None:
        self._set(POOL_INFLIGHT, inflight, pool)

    def observe_break_even(self, batch: float) -> None:
        self._set(BREAK_EVEN, batch)

    # ----- reading --------------------------------------------------------------------------------
    def render(self) -> bytes:
        """This process's metrics as Prometheus text (vLLM's names)."""
        return self.local.render()

    def value(self, sample: str, **labels: str) -> float:
        """The sum of this process's samples named `sample` whose labels include `labels` (tests, CLI)."""
        total = 0.0
        for fam in self.registry.collect():
            for s in fam.samples:
                if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items()):
                    total += s.value
        return total
