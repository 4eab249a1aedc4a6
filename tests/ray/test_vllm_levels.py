"""A cascade of vLLM levels over Ray actors: n-gram -> a vLLM draft level -> a vLLM target verifying inside its
engine step, with overlap (the draft actor's engine drafts the next round while the target's engine steps, each
in its own process). Greedy output equals plain greedy token for token; unseeded sampled rows run through the
same engines (verified in the target's step) and stay well formed. Skipped without vllm installed."""

from __future__ import annotations

import pytest

from specray.config import CascadeConfig, LevelConfig
from specray.coordinator.cascade import CascadeEngine, Level
from specray.coordinator.generate import generate
from specray.engine.hf import HFWorker
from specray.spec.params import SamplingParams
from tests.ray.conftest import local_ray

pytestmark = [pytest.mark.ray, pytest.mark.slow]  # in process: tests/unit/test_vllm_worker.py

PROMPTS = ["def fibonacci(n):", "The quick brown fox jumps over the lazy dog. The quick brown", "Hello"]


@pytest.fixture(scope="module")
def fam(tiny_root):
    pytest.importorskip("vllm")
    from specray.testing.tiny import tiny_family

    return tiny_family(tiny_root, heads=2, kv_heads=1)  # vLLM's CPU attention needs head_dim >= 32


def _vllm(name: str, path, **kw) -> LevelConfig:
    return LevelConfig(kind="vllm", name=name, model=str(path), dtype="float32", num_threads=1, num_cpus=1,
                       max_context=1024, engine_args={"kv_cache_memory_bytes": 16 << 20, "max_num_seqs": 16}, **kw)


def test_overlapped_vllm_cascade_over_actors_equals_plain(fam):
    from specray.serve.launch import launch_levels

    plain = generate([Level("t", worker=HFWorker(str(fam.target_dir), name="t", dtype="float32"))], PROMPTS,
                     max_tokens=20, ignore_eos=True)
    cfg = CascadeConfig(levels=[
        LevelConfig(kind="ngram", num_speculative_tokens=3, prompt_lookup_max=3),
        _vllm("mid", fam.draft_dirs["mid"], num_speculative_tokens=4),
        _vllm("t", fam.target_dir, engine_verify=4),
    ])
    with local_ray(num_cpus=4), launch_levels(cfg, name_prefix="vllm3") as lc:
        engine = CascadeEngine(lc.levels, overlap=True)
        assert engine.levels[-1].engine_verify == 4
        got = generate(engine, PROMPTS, max_tokens=20, ignore_eos=True)
        assert [r.token_ids for r in got.results] == [r.token_ids for r in plain.results]
        assert engine.ahead_rows > 0 and got.stats["t"].accepted_tokens > 0
        # sampled rows without a seed: drafted greedily by the mid level, verified in the target's step
        sp = SamplingParams(temperature=0.8, top_k=20)
        got = generate(engine, PROMPTS, max_tokens=12, ignore_eos=True, sampling=sp)
        assert all(len(r.token_ids) == 12 for r in got.results)
        assert all(0 <= t < engine.levels[-1].caps.vocab_size for r in got.results for t in r.token_ids)
