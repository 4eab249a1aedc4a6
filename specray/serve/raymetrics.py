"""specray's metrics through Ray's metrics pipeline: the cluster-wide view, as Ray Serve LLM exports vLLM's.

Each replica records into `ray.serve.metrics` instruments (Ray's `ray.util.metrics` with the replica's
`deployment`, `replica` and `application` labels added). Every process sends them to its node's metrics
agent, which serves them to Prometheus at `http://<node>:<metrics-export-port>/metrics` together with Ray's
own metrics. So a counter there is the sum over every replica that ever served (one series per replica),
whatever replica a request landed on, and the pools' metrics are reachable in pools mode. One replica's
`/metrics` route only shows that replica's registry.

Names: Ray refuses ':' and prefixes `ray_`, so `vllm:spec_decode_num_drafts` is exported as
`ray_vllm_spec_decode_num_drafts_total` (vLLM's Ray stat logger, which Ray Serve LLM uses, does the same),
and `specray_batch_size` as `ray_specray_batch_size` (`MetricSpec.exported`). Values reach the agent at
Ray's report interval (`metrics_report_interval_ms`, 10 s by default).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from specray.metrics import CATALOG, MetricSpec


class RayMetricsSink:
    """A `MetricsSink` over Ray metrics; build it in the process that records (a replica's constructor)."""

    def __init__(self, catalog: Iterable[MetricSpec] = CATALOG) -> None:
        from ray.serve import metrics as serve_metrics  # outside a replica: plain ray.util.metrics, no Serve labels

        self._m: dict[str, Any] = {}
        for spec in catalog:
            if spec.kind == "counter":
                m = serve_metrics.Counter(spec.ray_name, spec.doc, tag_keys=spec.labels)
            elif spec.kind == "gauge":
                m = serve_metrics.Gauge(spec.ray_name, spec.doc, tag_keys=spec.labels)
            else:
                m = serve_metrics.Histogram(spec.ray_name, spec.doc, boundaries=list(spec.buckets),
                                            tag_keys=spec.labels)
            self._m[spec.name] = m

    def inc(self, spec: MetricSpec, labels: Sequence[str], value: float) -> None:
        if value > 0:  # Ray refuses increments <= 0
            self._m[spec.name].inc(value, tags=dict(zip(spec.labels, labels)))

    def set(self, spec: MetricSpec, labels: Sequence[str], value: float) -> None:
        self._m[spec.name].set(value, tags=dict(zip(spec.labels, labels)))

    def observe(self, spec: MetricSpec, labels: Sequence[str], value: float) -> None:
        self._m[spec.name].observe(value, tags=dict(zip(spec.labels, labels)))
