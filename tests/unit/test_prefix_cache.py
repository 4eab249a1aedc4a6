"""Prefix caching in the hf backend's KV cache: a finished sequence's slot is reused, without copying, by a new
prompt that starts with its tokens, and decoding from the reused KV equals decoding from a fresh prefill."""

from __future__ import annotations

import pytest
import torch

from specray.coordinator.cascade import Level
from specray.coordinator.generate import generate
from specray.engine.hf import MIN_PREFIX, HFWorker
from specray.engine.kv_cache import SlotKVCache, _common_prefix


def _cache(min_prefix: int = 4, slots: int = 2) -> SlotKVCache:
    return SlotKVCache(1, 1, 2, torch.float32, initial_slots=slots, initial_capacity=8, min_prefix=min_prefix)


def test_common_prefix():
    assert _common_prefix([1, 2, 3, 4], [1, 2, 3, 4], 10) == 4
    assert _common_prefix([1, 2, 3, 4], [1, 2, 9, 4], 10) == 2
    assert _common_prefix([1, 2, 3, 4], [1, 2, 3, 4, 5], 3) == 3
    assert _common_prefix([5], [1], 10) == 0 and _common_prefix([], [1], 10) == 0
    a = list(range(1000))
    for n in (1, 2, 499, 500, 999):
        assert _common_prefix(a, a[:n] + [-1] * (1000 - n), 2000) == n


def test_a_released_slot_is_reused_for_the_longest_shared_prefix():
    c = _cache()
    s0, n0 = c.allocate([1, 2, 3, 4, 5, 6])
    s1, _ = c.allocate([7, 8, 9, 10, 11])
    assert n0 == 0 and s0 != s1
    c.release(s0, [1, 2, 3, 4, 5, 6])
    c.release(s1, [1, 2, 3, 4, 5, 6, 7, 8, 9])
    slot, n = c.allocate([1, 2, 3, 4, 5, 6, 7, 8, 0, 0])
    assert (slot, n) == (s1, 8)  # the longer match wins
    slot, n = c.allocate([1, 2, 3, 4, 5, 6])
    assert (slot, n) == (s0, 5)  # never the whole prompt: its last token is fed for the logits
    assert (c.prefix_hits, c.prefix_tokens) == (2, 13)


def test_short_matches_and_no_caching_take_an_empty_slot_first():
    c = _cache(min_prefix=4, slots=3)
    a, _ = c.allocate([1, 2, 3, 4, 5])
    c.release(a, [1, 2, 3, 4, 5])
    slot, n = c.allocate([1, 2, 3, 9, 9, 9])  # 3 shared < min_prefix: an empty slot, the kept one survives
    assert n == 0 and slot != a
    slot2, n2 = c.allocate([1, 2, 3, 4, 5, 6])
    assert (slot2, n2) == (a, 5)
    off = _cache(min_prefix=0)
    s, _ = off.allocate([1, 2, 3, 4, 5])
    off.release(s, [1, 2, 3, 4, 5])
    assert off.allocate([1, 2, 3, 4, 5, 6])[1] == 0


def test_kept_slots_are_evicted_before_the_pool_grows():
    c = _cache(min_prefix=2, slots=2)
    a, _ = c.allocate([1, 2, 3])
    b, _ = c.allocate([4, 5, 6])
    c.release(a, [1, 2, 3])
    c.release(b, [4, 5, 6])
    s, n = c.allocate([7, 8, 9])  # nothing shared, no empty slot: the least recently released kept slot
    assert (s, n) == (a, 0) and c.num_slots == 2
    assert c.allocate([4, 5, 6, 7]) == (b, 3)
    s3, _ = c.allocate([9, 9, 9])
    assert c.num_slots == 4 and s3 not in (a, b)


@pytest.fixture(scope="module")
def target(tiny):
    return str(tiny.target_dir)


def test_worker_decodes_the_same_from_a_reused_prefix(tiny, target):
    """A turn that extends a finished one (its prompt + output + a new message) decodes the same tokens whether
    its prefix KV comes from the finished turn's slot or from a fresh prefill, in fp32 and with a draft."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(target)
    first = tok.encode("def fibonacci(n):\n    if n < 2:")
    cached = HFWorker(target)
    fresh = HFWorker(target, prefix_caching=False)
    outs = {}
    for name, w in (("cached", cached), ("fresh", fresh)):
        out1 = generate([Level("t", worker=w)], [first], max_tokens=10, ignore_eos=True).results[0].token_ids
        second = first + out1 + tok.encode("\n\nclass Stack:")
        draft = HFWorker(str(tiny.draft_dirs["mid"]), prefix_caching=name == "cached")
        levels = [Level("d", worker=draft, k=3), Level("t", worker=w)]
        outs[name] = (out1, generate(levels, [second], max_tokens=12, ignore_eos=True).results[0].token_ids)
    assert outs["cached"] == outs["fresh"]
    st = cached.stats().extra
    assert st["prefix_cache_hits"] >= 1 and st["prefix_cache_tokens"] >= len(first) + 10 - 1
    assert fresh.stats().extra["prefix_cache_hits"] == 0
    assert len(first) >= MIN_PREFIX


def test_prefix_caching_feeds_only_the_new_tokens(target):
    """The reused positions are not fed again: the second request's prefill forwards cover only its new tail."""
    w = HFWorker(target)
    prompt = list(range(5, 45))
    generate([Level("t", worker=w)], [prompt], max_tokens=4, ignore_eos=True)
    fed: list[int] = []
    forward = w._forward

    def counting(seqs, inputs, keep, parents=None):
        fed.append(sum(len(x) for x in inputs))
        return forward(seqs, inputs, keep, parents)

    w._forward = counting
    generate([Level("t", worker=w)], [prompt + [7, 8, 9]], max_tokens=2, ignore_eos=True)
    assert sum(fed) <= 3 + 4 + 2  # the 3 new prompt tokens, the 4 outputs of the first request, the 2 steps


def test_a_benchmark_stream_starts_with_empty_prefix_caches(target):
    """`specray bench` gives each mode its own cold pass: new_stream forgets the prompts earlier passes cached."""
    from specray.bench.runner import InProcessTarget
    from specray.spec.params import SamplingParams

    w = HFWorker(target)
    bench = InProcessTarget([Level("t", worker=w)], SamplingParams())
    bench.run("none", [(0, {"workload": "w", "prompt": "def fibonacci(n): return n"})], 1, 4)
    assert w.cache._kept  # the finished request's prompt is cached
    bench.new_stream()
    assert not w.cache._kept
    prompt = list(range(5, 30))
    w.add("a", prompt)
    assert w._seqs["a"].kv_len == 0
