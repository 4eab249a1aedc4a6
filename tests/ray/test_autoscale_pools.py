"""Autoscaling by regime on a real local Serve: the Router routes past-break-even traffic to the target pool,
whose custom policy grows it; when speculation stops (no speculative rounds), the draft pool shrinks; every
greedy output equals plain decoding whichever pool served it; streaming and cancellation pass the router."""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from specray.serve.localcluster import free_port

pytestmark = pytest.mark.ray

HERE = Path(__file__).parent
APP = "specray"
PROMPTS = ["def fibonacci(n):", "class Stack:", "The quick brown fox", "import os"]


def pools_config(tiny) -> dict:
    text = (HERE / "serve_config_pools_tiny.yaml").read_text()
    text = text.replace("${TINY_MID}", str(tiny.draft_dirs["mid"])).replace("${TINY_TARGET}", str(tiny.target_dir))
    return yaml.safe_load(text)


def replica_counts(app: str = APP, names: tuple[str, ...] = ("SpeculativePool", "TargetPool")) -> dict[str, int]:
    """Replicas per deployment that are running or on their way (what the policy asked for)."""
    from ray import serve

    deps = serve.status().applications[app].deployments
    return {name: sum(n for state, n in deps[name].replica_states.items() if state in ("RUNNING", "STARTING"))
            for name in names}


class Watcher:
    """Polls `serve.status()` in the background and keeps every observation. A context manager: the thread
    must never outlive its test, since a `serve.status()` after `ray.shutdown()` would start a stray local Ray
    that later tests' `ray.init` collides with (and it only polls while Ray is initialized, for that reason)."""

    def __init__(self, app: str = APP, names: tuple[str, ...] = ("SpeculativePool", "TargetPool")) -> None:
        self.app, self.names = app, names
        self.seen: list[tuple[float, dict[str, int]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import ray

        while not self._stop.is_set():
            if ray.is_initialized():
                try:
                    self.seen.append((time.monotonic(), replica_counts(self.app, self.names)))
                except Exception:
                    pass
            self._stop.wait(0.25)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)

    def __enter__(self) -> Watcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def max(self, name: str) -> int:
        return max((c[name] for _, c in self.seen), default=0)

    def min(self, name: str) -> int:
        return min(c[name] for _, c in self.seen)


async def sustained(request, workers: int, min_each: int, until, max_s: float) -> list:
    """Closed-loop load: `workers` clients each send `request(w, j)` one after another, at least `min_each`
    times, and go on until `until()` holds or `max_s` passes. Autoscaling reacts to load that lasts, so a
    fixed number of requests would test this box's speed (finished in 0.7 s here, before any metrics push)."""
    stop = asyncio.Event()

    async def worker(w: int) -> list:
        outs, j = [], 0
        while j < min_each or not stop.is_set():
            outs.append(await request(w, j))
            j += 1
        return outs

    async def monitor() -> None:
        deadline = time.monotonic() + max_s
        while not until() and time.monotonic() < deadline:
            await asyncio.sleep(0.25)
        stop.set()

    res = await asyncio.gather(monitor(), *[worker(w) for w in range(workers)])
    return [o for outs in res[1:] for o in outs]


@pytest.fixture(scope="module")
def pools_app(tiny):
    import ray
    from ray import serve

    from specray.serve.app import build_app

    tree = str(Path(__file__).resolve().parents[2])
    env = {"RAY_AUTH_MODE": "disabled", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": os.pathsep.join(p for p in (tree, os.environ.get("PYTHONPATH")) if p)}
    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": env}, _system_config={"metrics_report_interval_ms": 1000})
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    app_cfg = pools_config(tiny)["applications"][0]
    t0 = time.monotonic()
    handle = serve.run(build_app(app_cfg["args"]), name=APP, route_prefix="/")
    print(f"\npools app up in {time.monotonic() - t0:.1f}s")
    try:
        yield handle, f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


def test_pools_serve_config_validates(tiny):
    from ray.serve.schema import ServeDeploySchema

    from specray.config import AppConfig

    cfg = pools_config(tiny)
    ServeDeploySchema.model_validate(cfg)
    app = AppConfig.model_validate(cfg["applications"][0]["args"]["config"])
    assert app.pools is not None and app.pools.break_even_batch is None  # live, from the planner


def routed(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics").text
    return {s.labels["pool"]: s.value for fam in text_string_to_metric_families(text) for s in fam.samples
            if s.name == "specray_routed_requests_total"}


def test_load_grows_the_target_pool_and_idle_speculation_shrinks_the_draft_pool(pools_app):
    handle, url = pools_app
    from ray import serve

    spec_pool = serve.get_deployment_handle("SpeculativePool", APP)
    code = spec_pool.describe.remote().result()["specray_file"]
    assert code.startswith(str(Path(__file__).resolve().parents[2])), code  # replicas run this tree
    assert replica_counts() == {"SpeculativePool": 1, "TargetPool": 1}

    workers, max_tokens = 12, 48
    with Watcher() as watcher:
        def grown() -> bool:
            return watcher.max("TargetPool") > 1 and watcher.max("SpeculativePool") == 2

        async def load():
            async with httpx.AsyncClient(base_url=url, timeout=240) as client:
                async def request(w: int, j: int) -> tuple[str, dict]:
                    p = PROMPTS[(w + j) % len(PROMPTS)]
                    r = await client.post("/v1/completions", json={
                        "model": "tiny", "prompt": p, "max_tokens": max_tokens, "temperature": 0,
                        "ignore_eos": True})
                    assert r.status_code == 200, r.text
                    return p, r.json()
                return await sustained(request, workers, 3, grown, max_s=90)

        t0 = time.monotonic()
        outs = asyncio.run(load())
        t_load = time.monotonic() - t0
        during = [c for t, c in watcher.seen if t <= t0 + t_load]
        counts = routed(url)
        # plain references, served by the target pool (speculation "none")
        plain = {p: handle.generate.remote(p, max_tokens=max_tokens, ignore_eos=True,
                                           speculation={"method": "none"}).result()["text"] for p in PROMPTS}
        served = {"speculative": 0, "target": 0}
        for i, (p, out) in enumerate(outs):
            assert out["choices"][0]["text"] == plain[p], f"request {i} ({p!r}) differs from plain decoding"
            drafted = sum(st["draft_tokens"] for st in (out["usage"].get("speculation") or {}).values())
            served["speculative" if drafted else "target"] += 1
        print(f"\nload of {len(outs)} requests in {t_load:.1f}s; routed {counts}; served {served}; replicas "
              f"during load {sorted({tuple(c.values()) for c in during})}")
        assert served["speculative"] >= 2 and served["target"] >= 2, served  # both pools answered, identically
        assert counts.get("speculative", 0) == served["speculative"] and counts.get("target", 0) == served["target"]
        assert watcher.max("TargetPool") > 1, "the target pool did not grow past 1 replica under 90 s of load"
        assert watcher.max("SpeculativePool") == 2, "the saturated, speculating draft pool did not grow in 90 s"

        # idle: no speculative rounds in the window -> the draft pool shrinks to min; the target pool too
        deadline = time.monotonic() + 40
        while replica_counts() != {"SpeculativePool": 1, "TargetPool": 1}:
            assert time.monotonic() < deadline, f"pools did not shrink back: {replica_counts()}"
            time.sleep(0.5)
    print(f"shrunk back to {replica_counts()} {time.monotonic() - t0 - t_load:.1f}s after the load")


def test_streaming_and_cancellation_through_the_router(pools_app):
    handle, url = pools_app
    ref = handle.generate.remote(PROMPTS[0], max_tokens=16, ignore_eos=True).result()
    chunks = list(handle.options(stream=True).generate_stream.remote(PROMPTS[0], max_tokens=16, ignore_eos=True))
    assert "".join(c["text"] for c in chunks) == ref["text"] and chunks[-1]["finished"]
    # HTTP stream abandoned after two events: the pool must drop the sequence
    body = {"model": "tiny", "prompt": PROMPTS[1], "max_tokens": 900, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        events = 0
        for line in r.iter_lines():
            if line.startswith("data: {"):
                json.loads(line[6:])
                events += 1
                if events == 2:
                    break
    assert events == 2
    closed = time.monotonic()
    deadline = closed + 20
    while True:
        h = handle.health.remote().result()
        active = {p: v.get("active") for p, v in h["pools"].items()}
        if sum(h["inflight"].values()) == 0 and not any(active.values()):
            break
        assert time.monotonic() < deadline, f"cancelled stream still running: {h['inflight']} {active}"
        time.sleep(0.2)
    print(f"\ncancelled stream freed in the pools {time.monotonic() - closed:.2f}s after the client left")
    text = httpx.get(url + "/metrics").text
    ended = {s.labels["finish_reason"]: s.value for fam in text_string_to_metric_families(text) for s in fam.samples
             if s.name == "specray_requests_total"}
    assert ended.get("cancelled", 0) >= 1, ended
    assert httpx.get(url + "/health").json()["status"] == "ok"


def test_pools_metrics_reach_the_node_agent_counted_once(pools_app):
    """Pools mode through Ray's metrics pipeline: the pools' request metrics are on the node metrics agent
    (each request counted once, by the pool that ran it: the router exports only its routing metrics), and
    their increase equals the responses' usage."""
    import ray

    from tests.ray.test_metrics_export import scrape

    _, url = pools_app
    node = ray.nodes()[0]
    agent = f"http://{node['NodeManagerAddress']}:{node['MetricsExportPort']}/metrics"

    def view() -> Counter:
        out: Counter = Counter()
        for s in scrape(agent):
            if s.labels.get("application") != APP:
                continue
            dep = s.labels["deployment"]
            if s.name in ("ray_vllm_request_success_total", "ray_vllm_generation_tokens_total"):
                out[s.name, dep] += s.value
            elif s.name == "ray_specray_routed_requests_total":
                out[s.name, dep, s.labels["pool"]] += s.value
        return out

    def settled() -> Counter:  # no report in flight from earlier tests: two scrapes a report apart agree
        while True:
            a = view()
            time.sleep(1.5)
            if view() == a:
                return a

    before = settled()
    want: Counter = Counter()
    for i, method in enumerate(["none", "ngram", "none", "ngram"]):
        body = {"model": "tiny", "prompt": PROMPTS[i], "max_tokens": 5 + i, "temperature": 0, "ignore_eos": True,
                "speculation": {"method": method}}
        r = httpx.post(url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        dep, pool = ("TargetPool", "target") if method == "none" else ("SpeculativePool", "speculative")
        want["ray_vllm_request_success_total", dep] += 1
        want["ray_vllm_generation_tokens_total", dep] += r.json()["usage"]["completion_tokens"]
        want["ray_specray_routed_requests_total", "Router", pool] += 1
    deadline = time.monotonic() + 20
    while True:
        got = view()
        got.subtract(before)
        if +got == want:
            break
        assert time.monotonic() < deadline, (dict(+got), dict(want))
        time.sleep(0.5)


@pytest.mark.slow
def test_coordinator_policy_scales_cascade_replicas_by_break_even(pools_app, tiny):
    """The default layout (one cascade per Coordinator replica) with CoordinatorPolicy: break-even 3 x headroom
    0.75 sizes each replica for 2.25 sequences, so 8 concurrent clients need more than one replica."""
    from ray import serve

    from specray.config import AppConfig
    from specray.serve.replica import Coordinator

    args = pools_config(tiny)["applications"][0]["args"]["config"]
    cfg = AppConfig.model_validate({k: v for k, v in args.items() if k != "pools"})
    auto = {"min_replicas": 1, "max_replicas": 2, "initial_replicas": 1, "metrics_interval_s": 0.25,
            "look_back_period_s": 1.0, "upscale_delay_s": 0, "downscale_delay_s": 0,
            "policy": {"policy_function": "specray.serve.autoscaling:CoordinatorPolicy",
                       "policy_kwargs": {"utilization": 1.0, "headroom": 0.75, "downscale_after_s": 2}}}
    dep = serve.deployment(name="Coordinator", ray_actor_options={"num_cpus": 0}, max_ongoing_requests=24,
                           autoscaling_config=auto)(serve.ingress()(Coordinator))
    h = serve.run(dep.bind(cfg.model_dump(mode="json")), name="coord", route_prefix="/coord")
    try:
        with Watcher("coord", ("Coordinator",)) as watcher:
            async def request(w: int, j: int) -> tuple[str, dict]:
                p = PROMPTS[(w + j) % len(PROMPTS)]
                return p, await h.generate.remote(p, max_tokens=48, ignore_eos=True)

            t0 = time.monotonic()
            outs = asyncio.run(sustained(request, 8, 3, lambda: watcher.max("Coordinator") == 2, max_s=90))
            print(f"\ncoordinator app: {len(outs)} requests in {time.monotonic() - t0:.1f}s, replicas seen "
                  f"{sorted({c['Coordinator'] for _, c in watcher.seen})}")
            plain = {p: h.generate.remote(p, max_tokens=48, ignore_eos=True, speculation={"method": "none"}).result()
                     for p in PROMPTS}
            assert all(out["token_ids"] == plain[p]["token_ids"] for p, out in outs)
            assert watcher.max("Coordinator") == 2, "CoordinatorPolicy did not scale out past break-even in 90 s"
            deadline = time.monotonic() + 30
            while replica_counts("coord", ("Coordinator",))["Coordinator"] != 1:
                assert time.monotonic() < deadline, "the coordinator did not scale back in"
                time.sleep(0.5)
    finally:
        serve.delete("coord")
