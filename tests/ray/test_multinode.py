"""A three-level cascade spread over a real 3-node local cluster (separate `ray start` processes)."""

from __future__ import annotations

import time

import pytest

from specray.config import CascadeConfig, LevelConfig, PlacementConfig
from specray.coordinator.cascade import Level
from specray.coordinator.generate import generate
from specray.engine.hf import HFWorker
from tests.ray.test_faults import PROMPTS as STREAM_PROMPTS
from tests.ray.test_faults import Server, Stream, actor_config, run_streams, wait_for

pytestmark = pytest.mark.ray

PROMPTS = ["def fibonacci(n):", "The quick brown fox jumps over the lazy dog. The quick brown", "Hello"]


def test_levels_run_on_their_nodes_and_output_is_exact(local_cluster, tiny):
    import ray

    from specray.serve.launch import launch_levels

    node_of = {}  # custom resource -> node id
    for n in ray.nodes():
        for res in ("head_node", "draft", "target"):
            if n["Alive"] and res in n["Resources"]:
                node_of[res] = n["NodeID"]
    assert len(set(node_of.values())) == 3

    def hf(name: str, path, res: str, **kw) -> LevelConfig:
        return LevelConfig(kind="hf", model=str(path), name=name, dtype="float32", num_cpus=1, resources={res: 1},
                           **kw)

    cfg = CascadeConfig(
        levels=[hf("small", tiny.draft_dirs["small"], "head_node", num_speculative_tokens=2),
                hf("mid", tiny.draft_dirs["mid"], "draft", num_speculative_tokens=4),
                hf("target", tiny.target_dir, "target")],
        placement=PlacementConfig(strategy="SPREAD"),
    )
    plain = generate([Level("target", worker=HFWorker(str(tiny.target_dir), dtype="float32"))], PROMPTS,
                     max_tokens=16, ignore_eos=True)
    with launch_levels(cfg, name_prefix="multinode", start_timeout_s=120) as lc:
        for name, res in [("small", "head_node"), ("mid", "draft"), ("target", "target")]:
            info = lc.workers[name].info()
            assert info["node_id"] == node_of[res] == lc.info[name]["bundle_node_id"], name
        got = generate(lc.levels, PROMPTS, max_tokens=16, ignore_eos=True)
        assert [r.token_ids for r in got.results] == [r.token_ids for r in plain.results]
        assert got.stats["target"].accepted_tokens > 0


def test_worker_node_stopped_its_level_is_dropped_nothing_hangs(local_cluster, tiny):
    """Stop (SIGKILL) the node that holds the draft level, mid-stream: Ray cannot restart the actor anywhere
    (no other node has the `draft` resource), so the cascade goes on without it, exactly, and nothing hangs.
    Runs last in this module: the cluster has one node less afterwards."""
    from specray.serve.replica import Coordinator

    cfg = actor_config(tiny, resources={"mid": {"draft": 1}, "target": {"target": 1}},
                       placement={"strategy": "SPREAD"})
    coord = Coordinator(cfg)
    srv = Server(coord)
    try:
        ref = run_streams(srv.url, STREAM_PROMPTS[:4])
        assert all(not s.errors for s in ref)
        draft_node = coord._launched.workers["mid"].info()["node_id"]
        assert draft_node != coord._launched.workers["target"].info()["node_id"]

        def stop_node(streams: list[Stream]) -> None:
            wait_for(lambda: min(len(s.chunks) for s in streams) >= 2, 60, "every stream to start")
            local_cluster.kill_node(draft_node)

        t0 = time.monotonic()
        faulty = run_streams(srv.url, STREAM_PROMPTS[:4], during=stop_node, timeout_s=120)
        assert time.monotonic() - t0 < 120
        for want, got in zip(ref, faulty):
            assert not got.errors and got.done, got.errors
            assert got.text == want.text
        assert coord.engine.level_status()["mid"] == "down"
        # later requests keep being served by what is left, exactly, while the level stays away
        again = run_streams(srv.url, STREAM_PROMPTS[:2], timeout_s=120)
        assert [s.text for s in again] == [s.text for s in ref[:2]]
        assert coord.engine.level_status()["mid"] == "down"
    finally:
        srv.stop()
        coord._launched.shutdown()
