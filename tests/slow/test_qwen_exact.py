"""Real models (slow): Qwen2.5-Coder 0.5B -> 1.5B in fp32, speculative greedy == plain 1.5B greedy."""

from __future__ import annotations

import pytest

from specray.coordinator.cascade import Level
from specray.coordinator.generate import generate
from specray.spec.ngram import NgramConfig
from specray.spec.params import VerifyMethod

pytestmark = pytest.mark.slow

PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number.",
    "Rename `x` to `count` in: def inc(x):\n    x = x + 1\n    return x",
    "What is the capital of France? Answer in one sentence.",
]


@pytest.fixture(scope="module")
def workers():
    from specray.engine.hf import HFWorker

    draft = HFWorker("qwen2.5-coder-0.5b-instruct", name="draft", dtype="float32")
    target = HFWorker("qwen2.5-coder-1.5b-instruct", name="target", dtype="float32")
    return draft, target


def test_qwen_cascade_greedy_equals_plain_greedy(workers):
    draft, target = workers
    g = VerifyMethod.GREEDY
    plain = generate([Level("target", worker=target, method=g)], PROMPTS, max_tokens=32, chat=True)
    spec = generate([Level("draft", worker=draft, k=4), Level("target", worker=target, method=g)], PROMPTS,
                    max_tokens=32, chat=True)
    cascade = generate([Level("ngram", ngram=NgramConfig(4, 1, 3)), Level("draft", worker=draft, k=4, method=g),
                        Level("target", worker=target, method=g)], PROMPTS, max_tokens=32, chat=True)
    # the benchmark's headline configuration: n-gram (earliest) K 8 -> 0.5B K 16 with confidence stops -> 1.5B,
    # drafting ahead beside the verification with the bounded look-ahead, three rows of different lengths
    headline = generate([Level("ngram", ngram=NgramConfig(8, 1, 4, "earliest")),
                         Level("draft", worker=draft, k=16, method=g, confidence=0.6),
                         Level("target", worker=target, method=g)], PROMPTS, max_tokens=32, chat=True, overlap=True)
    ref = [r.token_ids for r in plain.results]
    assert [r.token_ids for r in spec.results] == ref
    assert [r.token_ids for r in cascade.results] == ref
    assert [r.token_ids for r in headline.results] == ref
    assert spec.stats["target"].acceptance_rate > 0.5
    assert "def" in plain.results[0].text
