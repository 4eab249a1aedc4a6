"""Suffix drafter: the worked example, what it proposes (repeats in the prompt, earlier requests' outputs), the
adaptive length and probability cut, exact counts under growth and eviction, bounded memory, determinism."""

import doctest
import random
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import specray.spec.suffix as suffix_mod
from specray.spec.suffix import SuffixConfig, SuffixDrafter
from specray.spec.suffix_trie import SuffixTrie


def test_docstring_worked_example():
    res = doctest.testmod(suffix_mod, optionflags=doctest.ELLIPSIS)
    assert res.attempted >= 8 and res.failed == 0


def _cfg(**kw) -> SuffixConfig:
    base = dict(num_speculative_tokens=16, max_tree_depth=16, max_cached_requests=8, max_spec_factor=1.0,
                min_token_prob=0.1)
    base.update(kw)
    return SuffixConfig(**base)


def _window_counts(seqs: list[list[int]], depth: int) -> Counter:
    """Brute force: for every token string x of length 1..depth, the windows seq[s : s + depth] it prefixes."""
    c: Counter = Counter()
    for seq in seqs:
        for s in range(len(seq)):
            w = tuple(seq[s : s + depth])
            for j in range(1, len(w) + 1):
                c[w[:j]] += 1
    return c


def _trie_counts(trie: SuffixTrie) -> Counter:
    c: Counter = Counter()
    stack = [((), trie.root)]
    while stack:
        path, node = stack.pop()
        for t, ch in (node.children or {}).items():
            assert ch.count > 0  # nodes no window passes through are freed
            c[path + (t,)] = ch.count
            if ch.seq is not None:  # a tail: one window, its path implicit
                assert ch.count == 1 and not ch.children
                chain = ch.seq[ch.pos : min(ch.lim, len(ch.seq))]
                for j in range(1, len(chain) + 1):
                    c[path + (t, *chain[:j])] = 1
            else:
                stack.append((path + (t,), ch))
    return c


def _explicit_nodes(trie: SuffixTrie) -> int:
    n, stack = 0, [trie.root]
    while stack:
        node = stack.pop()
        n += 1
        stack.extend((node.children or {}).values())
    return n


@settings(max_examples=60, deadline=None)
@given(
    depth=st.integers(1, 6),
    ops=st.lists(st.tuples(st.integers(0, 3), st.lists(st.integers(0, 3), max_size=7), st.booleans()), max_size=25),
)
def test_trie_counts_are_exact_under_growth_and_removal(depth, ops):
    """Every node counts exactly the windows through it, sequences growing in pieces and removed at random;
    node_count is the number of nodes held."""
    trie = SuffixTrie(depth)
    held: dict[int, list[int]] = {}
    for key, toks, drop in ops:
        if drop and key in held:
            trie.remove(key)
            del held[key]
        else:
            trie.extend(key, toks)
            held.setdefault(key, []).extend(toks)
        want = _window_counts(list(held.values()), depth)
        assert _trie_counts(trie) == +want
        assert trie.node_count == _explicit_nodes(trie) <= 1 + len(+want)
        assert trie.root.count == sum(len(s) for s in held.values())


def _distinct(rng: random.Random, n: int, lo: int) -> list[int]:
    return rng.sample(range(lo, lo + 10 * n + 10), n)


@settings(max_examples=80, deadline=None)
@given(seed=st.integers(0, 10**6), span=st.integers(2, 10), j=st.integers(1, 9), factor=st.sampled_from([1.0, 2.0]))
def test_a_span_repeated_in_the_prompt_is_proposed(seed, span, j, factor):
    """prompt = A + S + B + S[:j] (all tokens distinct): the draft continues S from where the text left it."""
    j = min(j, span - 1)
    rng = random.Random(seed)
    a, s, b = _distinct(rng, 5, 0), _distinct(rng, span, 1000), _distinct(rng, 5, 5000)
    prompt = a + s + b + s[:j]
    depth, k = 12, 6
    d = SuffixDrafter(_cfg(max_tree_depth=depth, max_spec_factor=factor))
    d.start("r", prompt)
    draft = d.propose("r", prompt, max_k=k)
    follow = s[j:] + b + s[:j]
    assert draft and draft == follow[: len(draft)]
    # the longest match (j tokens) alone allows this many; a shorter match may draft more
    assert len(draft) >= min(k, int(j * factor), depth - j)
    assert len(draft) <= k


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10**6), n=st.integers(3, 12), j=st.integers(1, 11))
def test_an_earlier_requests_output_is_proposed_to_a_later_one(seed, n, j):
    j = min(j, n - 1)
    rng = random.Random(seed)
    out = _distinct(rng, n, 1000)
    d = SuffixDrafter(_cfg(max_spec_factor=4.0))
    d.start("first", _distinct(rng, 6, 0))
    d.extend("first", out)
    d.finish("first")
    prompt = _distinct(rng, 6, 5000) + out[:j]
    d.start("second", prompt)
    draft = d.draft("second", prompt, max_k=16)
    assert draft.source == "global"
    assert draft.token_ids == out[j:][: min(16, 4 * j)]
    # without the global cache the second request has nothing to copy
    off = SuffixDrafter(_cfg(max_cached_requests=0))
    off.start("first", [1, 2])
    off.extend("first", out)
    off.finish("first")
    off.start("second", prompt)
    assert off.propose("second", prompt, max_k=16) == []
    assert off.cached == []


def test_the_live_output_of_a_concurrent_request_is_shared():
    """As in vLLM's suffix method, an output enters the global trie as it is generated."""
    d = SuffixDrafter(_cfg())
    d.start("a", [1, 2])
    d.extend("a", [50, 51, 52, 53])
    d.start("b", [7, 50, 51])
    assert d.propose("b", [7, 50, 51], max_k=4) == [52, 53]


def test_clear_forgets_every_output_and_a_running_request_restarts():
    d = SuffixDrafter(_cfg())
    d.release("a", [1, 2, 50, 51, 52, 53], prompt_len=2)  # a finished request's output
    assert d.propose_seq("b", [7, 50, 51], 3, [7, 50, 51], max_k=4) == [52, 53]
    d.clear()
    assert d.cached == [] and d.active == set() and d.node_count == SuffixDrafter(_cfg()).node_count
    assert d.propose_seq("b", [7, 50, 51], 3, [7, 50, 51], max_k=4) == []  # as if it had never run
    assert d.active == {"b"} and d.cached == ["b"]


@pytest.mark.parametrize(
    "factor,expected",
    [(0.0, []), (0.5, [3]), (1.0, [3, 4]), (1.5, [3, 4, 5]), (2.0, [3, 4, 5, 6]), (10.0, [3, 4, 5, 6, 7, 8, 9, 0, 1])],
)
def test_the_length_adapts_to_the_match(factor, expected):
    """[1, 2] (m = 2) occurred once before: at most factor * 2 tokens. At factor 10 the match [2] (m = 1) drafts
    one token more than [1, 2] can: its window (depth 10) reaches one token further."""
    text = [1, 2, 3, 4, 5, 6, 7, 8, 9, 0, 1, 2]
    d = SuffixDrafter(_cfg(max_spec_factor=factor, max_tree_depth=10, min_token_prob=0.0))
    d.start("r", text)
    got = d.draft("r", text, max_k=16)
    assert got.token_ids == expected
    assert len(got.token_ids) <= int(got.match_len * factor)


def test_longer_matches_draft_further():
    """With factor 1, a match of m tokens drafts at most m: the context's longer match wins the longer draft."""
    d = SuffixDrafter(_cfg(max_spec_factor=1.0))
    text = [9, 8, 7, 1, 2, 3, 4, 5, 6, 0]
    d.start("r", text)
    assert d.propose("r", text + [7, 1], max_k=8) == [2, 3]  # [7, 1]: m = 2
    assert d.propose("r", text + [9, 8, 7, 1], max_k=8) == [2, 3, 4, 5]  # m = 4
    assert d.propose("r", text + [9, 8, 7, 1], max_k=3) == [2, 3, 4]  # max_k caps it


def test_min_token_prob_cuts_branches():
    """After [5] the text went to 6 three times and to 7 once; after [5, 6] to 1 twice, to 2 once; after
    [5, 6, 1] to 0 twice; the depth (4) ends the walk there."""
    text = [5, 6, 1, 0, 5, 6, 1, 0, 5, 6, 2, 0, 5, 7, 0]
    ctx = text + [5]

    def draft(p):
        d = SuffixDrafter(_cfg(min_token_prob=p, max_spec_factor=8.0, max_tree_depth=4))
        d.start("r", text)
        return d.draft("r", ctx, max_k=8)

    full = draft(0.1)
    assert full.token_ids == [6, 1, 0] and full.match_len == 1
    assert full.probs == pytest.approx([3 / 4, 3 / 4 * 2 / 3, 1 / 2 * 2 / 2])
    assert draft(0.6).token_ids == [6]  # 6 (3/4) kept, 1 (1/2) cut
    assert draft(0.76).token_ids == []  # even the first branch is below it
    assert draft(0.5).token_ids == [6, 1, 0]  # >= keeps a token at exactly the threshold


def test_ties_go_to_the_most_recent_and_are_flagged():
    d = SuffixDrafter(_cfg())
    d.start("r", [1, 2, 1, 3, 1])
    got = d.draft("r", [1, 2, 1, 3, 1], max_k=1)
    assert got.token_ids == [3] and not got.unique  # 2 and 3 followed 1 once each: 3 came last
    d.start("s", [1, 2, 1, 2, 1, 3, 1])
    got = d.draft("s", [1, 2, 1, 2, 1, 3, 1], max_k=1)
    assert got.token_ids == [2]  # counts first


def test_lifecycle_errors_and_observe():
    d = SuffixDrafter(_cfg())
    with pytest.raises(ValueError, match="not active"):
        d.propose("x", [1, 2])
    with pytest.raises(ValueError, match="not active"):
        d.extend("x", [1])
    d.observe("x", [1, 2, 3, 1, 2], prompt_len=3)
    d.observe("x", [1, 2, 3, 1, 2, 3, 1], prompt_len=3)
    assert d._local["x"].tokens(0) == [1, 2, 3, 1, 2, 3, 1]
    assert d._global.tokens(0) == [1, 2, 3, 1]  # slot 0
    with pytest.raises(ValueError, match="already active"):
        d.start("x", [1])
    d.finish("x")
    with pytest.raises(ValueError, match="not active"):
        d.finish("x")
    d.start("x", [4])  # the same id again: a new slot, the first one's output stays
    assert d.cached == ["x", "x"] and d._global.tokens(0) == [1, 2, 3, 1] and d._global.tokens(1) == []
    assert d.propose("x", [4], max_k=0) == []


@pytest.mark.parametrize("bad", [dict(max_tree_depth=0), dict(max_cached_requests=-2), dict(max_spec_factor=-1),
                                 dict(min_token_prob=1.5), dict(num_speculative_tokens=-1)])
def test_config_validation(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        SuffixConfig(**bad)


def _stream(seed: int, n: int):
    """Requests over a small vocabulary with recurring phrases: (prompt, output) pairs."""
    rng = random.Random(seed)
    phrases = [[rng.randrange(40) for _ in range(rng.randint(3, 8))] for _ in range(12)]
    for _ in range(n):
        prompt = [t for _ in range(rng.randint(1, 3)) for t in rng.choice(phrases)]
        out = [t for _ in range(rng.randint(1, 4)) for t in rng.choice(phrases)][: rng.randint(1, 24)]
        yield prompt, out


def test_memory_stays_bounded_over_a_10k_request_stream():
    """10k requests through a cache of 16: nodes never exceed depth x cached output tokens, and after the stream
    the global trie counts exactly what one built from the 16 requests it still holds counts."""
    cfg = _cfg(max_tree_depth=6, max_cached_requests=16)
    d = SuffixDrafter(cfg)
    outs: dict[int, list[int]] = {}
    peak = 0
    for i, (prompt, out) in enumerate(_stream(0, 10_000)):
        d.start(i, prompt)
        ctx = list(prompt)
        for t in out[:2]:  # a few drafting steps per request
            d.propose(i, ctx, max_k=4)
            d.extend(i, [t])
            ctx.append(t)
        d.extend(i, out[2:])
        d.finish(i)
        outs[i] = out
        cached_tokens = sum(len(outs[r]) for r in d.cached)
        assert len(d.cached) <= 16
        assert d.node_count <= 1 + cfg.max_tree_depth * cached_tokens
        peak = max(peak, d.node_count)
    assert d.cached == list(range(10_000 - 16, 10_000))
    fresh = SuffixTrie(cfg.max_tree_depth)
    for r in d.cached:
        fresh.extend(r, outs[r])
    assert _trie_counts(d._global) == _trie_counts(fresh)
    # paths made explicit by windows since evicted stay explicit (not re-merged into tails): a few more nodes
    assert fresh.node_count <= d._global.node_count == _explicit_nodes(d._global) <= 2 * fresh.node_count
    assert peak <= 1 + 6 * 16 * 24


def test_deterministic():
    """Two drafters fed the same stream draft the same tokens; the drafts do not depend on dict history."""
    drafts = []
    for _ in range(2):
        d = SuffixDrafter(_cfg(max_tree_depth=8, max_cached_requests=4, max_spec_factor=2.0))
        got = []
        for i, (prompt, out) in enumerate(_stream(1, 300)):
            d.start(f"r{i}", prompt)
            ctx = list(prompt)
            for t in out:
                got.append(tuple(d.propose(f"r{i}", ctx, max_k=5)))
                d.extend(f"r{i}", [t])
                ctx.append(t)
            d.finish(f"r{i}")
        drafts.append(got)
    assert drafts[0] == drafts[1]
    assert sum(bool(g) for g in drafts[0]) > len(drafts[0]) // 3  # the recurring phrases do get drafted


@pytest.mark.parametrize("depth,cached,factor,min_prob", [(8, 4, 1.0, 0.13), (24, 16, 2.0, 0.27), (6, -1, 0.5, 0.0)])
@pytest.mark.parametrize("stream", ["random", "phrases"])
def test_drafts_match_arctic_inference(stream, depth, cached, factor, min_prob):
    """Peer check against Arctic Inference's SuffixDecodingCache (what vLLM's `suffix` method runs), driven the
    way vLLM drives it: two requests at a time, each drafting then taking one token. Wherever no tie rule
    decided our draft (`unique`), its draft is the same; ties are where their hash-map order and our recency
    rule may differ. Skipped without it: `bash scripts/build_arctic_suffix.sh` builds it into .arctic/ (then run
    with PYTHONPATH=.:.arctic)."""
    arctic = pytest.importorskip("arctic_inference.suffix_decoding")
    import numpy as np

    ours = SuffixDrafter(SuffixConfig(max_tree_depth=depth, max_cached_requests=cached, max_spec_factor=factor,
                                      min_token_prob=min_prob))
    theirs = arctic.SuffixDecodingCache(max_tree_depth=depth, max_cached_requests=cached)
    rng = random.Random(depth)
    if stream == "random":
        reqs = [([rng.randrange(5) for _ in range(rng.randint(1, 20))],
                 [rng.randrange(5) for _ in range(rng.randint(1, 30))]) for _ in range(60)]
    else:
        reqs = list(_stream(depth, 60))
    unique = same = steps = drafted = 0
    for a in range(0, len(reqs), 2):
        pair = [(f"q{a + i}", *reqs[a + i]) for i in range(2) if a + i < len(reqs)]
        for rid, prompt, _ in pair:
            ours.start(rid, prompt)
            theirs.start_request(rid, np.asarray(prompt, dtype=np.int32))
        ctx = {rid: list(prompt) for rid, prompt, _ in pair}
        for step in range(max(len(out) for _, _, out in pair)):
            for rid, _, out in pair:
                if step >= len(out):
                    continue
                c = ctx[rid]
                k = rng.randint(1, 12)
                mine = ours.draft(rid, c, max_k=k)
                # they match m < len(pattern) tokens: a sentinel lets a short context match whole, as ours does
                pattern = c[-depth:] if len(c) >= depth else [-1] + c
                got = theirs.speculate(rid, np.asarray(pattern, dtype=np.int32), max_spec_tokens=k,
                                       max_spec_factor=factor, min_token_prob=min_prob)
                steps += 1
                drafted += bool(got.token_ids)
                if mine.unique:
                    unique += 1
                    assert mine.token_ids == list(got.token_ids), (rid, c, k)
                same += mine.token_ids == list(got.token_ids)
                ours.extend(rid, [out[step]])
                theirs.add_active_response(rid, [out[step]])
                c.append(out[step])
        for rid, _, _ in pair:
            ours.finish(rid)
            theirs.stop_request(rid)
    assert drafted > steps // 2 and unique >= 40  # non-vacuous: they drafted, and many drafts had no tie
    assert same >= 0.75 * steps  # ties included, the two mostly agree (80-97% on these streams)


# --- as a cascade level ------------------------------------------------------------------------------------


def _target():
    from specray.testing.fake import FakeWorker

    return FakeWorker("target", vocab=16, order=2, table_seed=0)


PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 1, 2, 3, 4, 5], [0], [2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 3]]


def test_a_suffix_level_is_exact_and_learns_from_earlier_requests():
    """Greedy through `generate`: a suffix level (alone or under a draft model) gives plain decoding's tokens;
    the same prompts a second time draft from the first time's outputs (global trie): fewer rounds."""
    from specray.coordinator.generate import generate
    from specray.coordinator.state import Level
    from specray.spec.params import VerifyMethod
    from specray.testing.fake import FakeWorker

    plain = [r.token_ids for r in generate([Level("target", worker=_target())], PROMPTS, max_tokens=25,
                                           ignore_eos=True).results]
    sx = SuffixDrafter(SuffixConfig(num_speculative_tokens=6, max_tree_depth=12, max_cached_requests=64))
    levels = [Level("suffix", suffix=sx), Level("target", worker=_target(), method=VerifyMethod.REJECTION)]
    first = generate(levels, PROMPTS, max_tokens=25, ignore_eos=True)
    assert [r.token_ids for r in first.results] == plain
    assert sx.active == set() and len(sx.cached) == len(PROMPTS)  # every sequence released into the cache
    again = generate(levels, PROMPTS, max_tokens=25, ignore_eos=True)
    assert [r.token_ids for r in again.results] == plain
    assert again.rounds < first.rounds
    assert again.stats["target"].accepted_tokens > first.stats["target"].accepted_tokens
    draft = FakeWorker("d", vocab=16, order=2, table_seed=0, noise=0.5, noise_seed=1)
    sx3 = SuffixDrafter(SuffixConfig(num_speculative_tokens=3, max_tree_depth=8))
    three = [Level("suffix", suffix=sx3), Level("d", worker=draft, k=4), Level("target", worker=_target())]
    assert [r.token_ids for r in generate(three, PROMPTS, max_tokens=25, ignore_eos=True).results] == plain
    assert draft.stats().live_sequences == 0 and sx3.active == set()


def test_a_suffix_level_at_temperature():
    """Sampled rows: rejection over the suffix level is the deterministic method (its drafts are not sampled);
    seeded outputs repeat, and coupled verification gives plain decoding's tokens."""
    from specray.coordinator.calls import LevelCalls
    from specray.coordinator.generate import generate
    from specray.coordinator.state import Level
    from specray.spec.params import SamplingParams, VerifyMethod

    sp = [SamplingParams(temperature=0.9, top_k=10, seed=7 + s) for s in range(len(PROMPTS))]

    def run(method, suffix=True):
        levels = [Level("target", worker=_target(), method=method)]
        if suffix:
            levels.insert(0, Level("suffix", suffix=SuffixDrafter(SuffixConfig(num_speculative_tokens=4))))
        return [r.token_ids for r in generate(levels, PROMPTS, max_tokens=20, sampling=sp,
                                              ignore_eos=True).results], levels

    a, levels = run(VerifyMethod.REJECTION)
    assert LevelCalls(levels, None, None).method(1, 0) is VerifyMethod.DETERMINISTIC
    assert run(VerifyMethod.REJECTION)[0] == a
    assert run(VerifyMethod.COUPLED)[0] == run(VerifyMethod.COUPLED, suffix=False)[0]


def test_suffix_level_config():
    from specray.config import CascadeConfig, LevelConfig
    from specray.coordinator.generate import level_from_config

    lc = LevelConfig(kind="suffix", suffix_decoding_max_tree_depth=16, suffix_decoding_max_cached_requests=5,
                     suffix_decoding_max_spec_factor=2.0, suffix_decoding_min_token_prob=0.2)
    assert lc.display_name == "suffix" and lc.is_lookup
    assert lc.num_speculative_tokens == 16  # K defaults to the tree depth, as in vLLM
    lvl = level_from_config(lc)
    assert lvl.is_ngram and lvl.worker is None and lvl.k == 16
    assert lvl.suffix.config == SuffixConfig(16, 16, 5, 2.0, 0.2, tree_width=1)  # the level's tree_width (chains)
    assert LevelConfig(kind="suffix", num_speculative_tokens=3).num_speculative_tokens == 3
    with pytest.raises(ValueError, match="suffix_decoding_max_spec_factor is for suffix levels"):
        LevelConfig(kind="hf", model="m", suffix_decoding_max_spec_factor=2.0)
    with pytest.raises(ValueError, match="takes no `model`"):
        LevelConfig(kind="suffix", model="m")
    with pytest.raises(ValueError, match="suffix_decoding_min_token_prob"):
        LevelConfig(kind="suffix", suffix_decoding_min_token_prob=2)
    target = {"kind": "hf", "model": "t"}
    with pytest.raises(ValueError, match=r"lookup level \(suffix\) can only be the first"):
        CascadeConfig(levels=[target, {"kind": "suffix"}, target])
    with pytest.raises(ValueError, match="must be a model"):
        CascadeConfig(levels=[{"kind": "suffix"}])


def test_a_suffix_level_on_tiny_models(tiny):
    """Real (tiny) transformers models built from a config: suffix > target and suffix > draft > target (drafting
    ahead on a second thread) give plain greedy decoding's tokens; asking again drafts from the cached outputs."""
    from specray.config import CascadeConfig, LevelConfig
    from specray.coordinator.generate import build_levels, generate

    prompts = ["def fibonacci(n):", "class Stack:\n    def push(self, x):", "def is_prime(n: int) -> bool:"]
    hf = dict(kind="hf", dtype="float32")
    target = LevelConfig(model=str(tiny.target_dir), **hf)
    plain = [r.token_ids for r in generate(build_levels(CascadeConfig(levels=[target])), prompts,
                                           max_tokens=16, ignore_eos=True).results]
    suffix = LevelConfig(kind="suffix", num_speculative_tokens=6)
    two = build_levels(CascadeConfig(levels=[suffix, target]))
    first = generate(two, prompts, max_tokens=16, ignore_eos=True)
    again = generate(two, prompts, max_tokens=16, ignore_eos=True)
    assert [r.token_ids for r in first.results] == plain == [r.token_ids for r in again.results]
    assert again.rounds < first.rounds  # the second time, the first time's outputs are drafted
    draft = LevelConfig(model=str(tiny.draft_dirs["mid"]), num_speculative_tokens=4, **hf)
    three = build_levels(CascadeConfig(levels=[suffix, draft, target]))
    out = generate(three, prompts, max_tokens=16, ignore_eos=True, overlap=True)
    assert [r.token_ids for r in out.results] == plain
    assert three[0].suffix.active == set() and len(three[0].suffix.cached) == len(prompts)


def test_plain_rounds_feed_the_cache_and_diverging_text_restarts():
    """Sequences decoded without drafts (a plain plan) still leave their output to later requests; a request whose
    text stops extending what the drafter holds is restarted from the new text."""
    from specray.coordinator.cascade import Plan
    from specray.coordinator.generate import generate
    from specray.coordinator.state import Level

    sx = SuffixDrafter(SuffixConfig(num_speculative_tokens=8, max_spec_factor=4.0))
    levels = [Level("suffix", suffix=sx), Level("target", worker=_target())]
    plain = generate(levels, PROMPTS[:2], max_tokens=20, ignore_eos=True, plan=Plan((1,), ()))
    assert sx.active == set() and sx.cached == ["seq-0", "seq-1"]
    out = plain.results[1].token_ids
    ctx = PROMPTS[1] + out[:6]
    assert sx.propose_seq("new", ctx, len(PROMPTS[1]), ctx, 8) == out[6:14]
    sx.propose_seq("new", [9, 9, 9], 2, [9, 9, 9], 4)  # not an extension of what "new" held: restarted
    assert sx._local["new"].tokens(0) == [9, 9, 9]
    sx.release("new", [9, 9, 9, 8], 2)
    assert sx.active == set() and sx._global.tokens(next(reversed(sx._cached))) == [9, 8]


# ------------------------------------------------------------------------------------------ draft trees


def test_tree_branches_where_the_text_did():
    """The text of test_min_token_prob_cuts_branches: after [5] it went to 6 (3/4) and 7 (1/4); after [5, 6] to 1
    (2/3) and 2 (1/3); then to 0. Best-first by path probability, ties to the candidate found first."""
    text = [5, 6, 1, 0, 5, 6, 1, 0, 5, 6, 2, 0, 5, 7, 0]
    ctx = text + [5]

    def tree(p=0.1, max_nodes=8, width=4):
        d = SuffixDrafter(_cfg(min_token_prob=p, max_spec_factor=8.0, max_tree_depth=4, tree_width=width))
        d.start("r", text)
        return d.draft_tree("r", ctx, max_nodes=max_nodes)

    full = tree()
    assert (full.token_ids, full.parents) == ([6, 1, 0, 7, 2, 0, 0], [-1, 0, 1, -1, 0, 3, 4])
    assert full.probs == pytest.approx([3 / 4, 1 / 2, 1 / 2, 1 / 4, 1 / 4, 1 / 4, 1 / 4])
    assert full.match_len == 1 and full.score == pytest.approx(2.75)
    assert tree(max_nodes=4).token_ids == [6, 1, 0, 7]  # the node budget keeps the most likely
    # min_token_prob 0.3 cuts the quarter branches of match [5] (score 1.75), so the match [0, 5] wins (score 2):
    # 6 (2/3), 7 (1/3); after [0, 5, 6] 2 and 1 (1/3 each, 2 seen last); after [0, 5, 7] 0.
    cut = tree(p=0.3)
    assert (cut.token_ids, cut.parents, cut.match_len) == ([6, 7, 2, 1, 0], [-1, -1, 0, 0, 1], 2)
    assert cut.score == pytest.approx(2.0)
    assert tree(width=1).token_ids == [6, 1, 0]  # one child per node: the chain `propose` drafts
    d = SuffixDrafter(_cfg(min_token_prob=0.1, max_spec_factor=8.0, max_tree_depth=4))
    d.start("r", text)
    t = d.propose_tree("r", ctx, max_nodes=8, tree_width=2)
    assert t.token_ids == (6, 1, 0, 7, 2, 0, 0) and t.parents == (-1, 0, 1, -1, 0, 3, 4)
    assert d.propose_tree_seq("s", text, len(text), ctx, max_nodes=8) == t  # the round loop's entry point
    assert d.propose_tree("r", ctx, max_nodes=0).num_nodes == 0


def _feed(d: SuffixDrafter, seed: int, alphabet: int) -> list[int]:
    """Two earlier requests (global trie) and an active one over a small alphabet: text with many branches."""
    rng = random.Random(seed)
    for r in range(2):
        d.start(f"old{r}", [rng.randrange(alphabet) for _ in range(rng.randint(0, 5))])
        d.extend(f"old{r}", [rng.randrange(alphabet) for _ in range(rng.randint(5, 40))])
        d.finish(f"old{r}")
    text = [rng.randrange(alphabet) for _ in range(rng.randint(1, 60))]
    d.start("r", text)
    return text


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10**6), depth=st.integers(2, 8), factor=st.sampled_from([0.5, 1.0, 3.0]),
       min_prob=st.sampled_from([0.0, 0.1, 0.3]), k=st.integers(0, 12))
def test_width_one_trees_are_the_chain(seed, depth, factor, min_prob, k):
    d = SuffixDrafter(_cfg(max_tree_depth=depth, max_spec_factor=factor, min_token_prob=min_prob))
    text = _feed(d, seed, 3)
    chain = d.draft("r", text, max_k=k)
    tree = d.draft_tree("r", text, max_nodes=k, tree_width=1)
    assert tree.token_ids == chain.token_ids and tree.probs == chain.probs and tree.score == chain.score
    assert tree.parents == list(range(-1, len(chain.token_ids) - 1))
    assert (tree.match_len, tree.source) == (chain.match_len, chain.source)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10**6), depth=st.integers(2, 8), factor=st.sampled_from([0.5, 1.0, 3.0]),
       min_prob=st.sampled_from([0.0, 0.05, 0.2]), k=st.integers(1, 16), width=st.integers(1, 4))
def test_trees_are_the_most_likely_continuations(seed, depth, factor, min_prob, k, width):
    """Brute force over the text's windows: every node continues the matched suffix as the text did, with the
    path probability count(suffix + path) / count(suffix); at most `width` children per node, distinct; the
    budget holds; best-first: no candidate left out (a continuation of a node or of the root, among its parent's
    `width` most frequent) is more likely than a node taken, or, below the budget, above min_token_prob."""
    d = SuffixDrafter(_cfg(max_tree_depth=depth, max_spec_factor=factor, min_token_prob=min_prob,
                           max_cached_requests=0))
    text = _feed(d, seed, 4)
    got = d.draft_tree("r", text, max_nodes=k, tree_width=width)
    tree = d.propose_tree("r", text, max_nodes=k, tree_width=width)
    assert list(tree.token_ids) == got.token_ids and list(tree.parents) == got.parents
    n, m = tree.num_nodes, got.match_len
    if n == 0:
        return
    assert n <= min(k, int(m * factor + 1e-6)) and tree.distinct_siblings
    assert all(len(tree.children(i)) <= width for i in range(-1, n))
    counts = _window_counts([text], depth)
    suffix = tuple(text[-m:])

    def prob(path: tuple[int, ...]) -> float:
        return counts[suffix + path] / counts[suffix]

    paths = {i: tuple(tree.token_ids[j] for j in tree.path_to(i)) for i in range(n)}
    for i, path in paths.items():
        assert got.probs[i] == pytest.approx(prob(path)) and got.probs[i] >= min_prob
    taken = set(paths.values())
    worst = min(got.probs)
    for parent in [()] + list(paths.values()):
        options = sorted((counts[suffix + parent + (t,)], t) for t in range(4) if counts[suffix + parent + (t,)])
        top = options[::-1][:width]
        if len(options) > width and options[-width - 1][0] == top[-1][0]:
            continue  # a count tie at the width cut: recency decides which enter, not checked here
        for _, t in top:
            if parent + (t,) not in taken:
                assert prob(parent + (t,)) <= worst + 1e-12
                assert n == min(k, int(m * factor + 1e-6)) or prob(parent + (t,)) < min_prob


def test_tree_width_config():
    with pytest.raises(ValueError, match="tree_width"):
        SuffixConfig(tree_width=0)
    d = SuffixDrafter(_cfg())
    d.start("r", [1, 2])
    with pytest.raises(ValueError, match="tree_width=0"):
        d.draft_tree("r", [1, 2], tree_width=0)
    with pytest.raises(ValueError, match="not active"):
        d.draft_tree("x", [1, 2])
