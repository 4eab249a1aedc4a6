"""A three-level cascade spread over a real 3-node local cluster (separate `ray start` processes)."""

from __future__ import annotations

import pytest

from specray.config import CascadeConfig, LevelConfig, PlacementConfig
from specray.coordinator.cascade import Level
from specray.coordinator.generate import generate
from specray.engine.hf import HFWorker

pytestmark = pytest.mark.ray

PROMPTS = ["def fibonacci(n):", "The quick brown fox jumps over the lazy dog. The quick brown", "Hello"]


def test_levels_run_on_their_nodes_and_output_is_exact(local_cluster, tiny):
    import ray

    from specray.serve.actors import launch_levels

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
