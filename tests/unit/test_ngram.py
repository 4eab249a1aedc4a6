"""n-gram proposer: small integer tables with vLLM's knob semantics."""

import pytest

from specray.spec.ngram import NgramConfig, propose_ngram


@pytest.mark.parametrize(
    "tokens,k,lo,hi,expected",
    [
        ([1, 2, 3, 4, 2, 3], 4, 2, 3, [4, 2, 3]),  # the docstring's worked example
        ([1, 2, 3, 4, 2, 3], 1, 2, 3, [4]),  # k caps the draft
        ([1, 2, 3], 2, 1, 2, []),  # no earlier occurrence
        ([5, 1, 2, 9, 1, 2, 8, 1, 2], 2, 2, 2, [8, 1]),  # most recent occurrence wins
        ([7, 1, 2, 3, 9, 2, 3, 6, 1, 2, 3], 3, 1, 3, [9, 2, 3]),  # longest suffix (3-gram) beats later 2-gram
        ([7, 1, 2, 3, 9, 2, 3, 6, 1, 2, 3], 3, 1, 2, [6, 1, 2]),  # capped at 2: most recent [2, 3]
        ([4, 4, 4, 4], 3, 1, 3, [4]),  # overlapping match runs into the suffix itself
        ([1, 2, 1], 3, 1, 1, [2, 1]),
        ([1], 3, 1, 3, []),
        ([], 3, 1, 3, []),
        ([1, 2, 1, 2], 0, 1, 3, []),  # k = 0
    ],
)
def test_table(tokens, k, lo, hi, expected):
    assert propose_ngram(tokens, k, lo, hi) == expected


def test_config_validation_and_default_k():
    cfg = NgramConfig(num_speculative_tokens=2, prompt_lookup_min=1, prompt_lookup_max=3)
    assert cfg.propose([1, 2, 3, 1, 2]) == [3, 1]
    assert cfg.propose([1, 2, 3, 1, 2], k=1) == [3]
    with pytest.raises(ValueError):
        NgramConfig(prompt_lookup_min=3, prompt_lookup_max=2)
    with pytest.raises(ValueError):
        NgramConfig(prompt_lookup_min=0)


@pytest.mark.parametrize(
    "tokens,k,lo,hi,recent,earliest",
    [
        ([5, 1, 2, 9, 1, 2, 8, 1, 2], 2, 2, 2, [8, 1], [9, 1]),  # the docstring's example
        ([7, 1, 2, 3, 9, 2, 3, 6, 1, 2, 3], 3, 1, 2, [6, 1, 2], [9, 2, 3]),  # capped at 2: [2, 3] at 2 or 5
        ([7, 1, 2, 3, 9, 2, 3, 6, 1, 2, 3], 3, 1, 3, [9, 2, 3], [9, 2, 3]),  # one 3-gram occurrence: no choice
        ([4, 4, 4, 4], 3, 1, 3, [4], [4]),  # [4,4,4] occurs once earlier (overlapping the suffix)
        ([4, 4, 4, 4], 3, 1, 1, [4], [4, 4, 4]),  # the first 4 is followed by three more
    ],
)
def test_occurrence_choice(tokens, k, lo, hi, recent, earliest):
    assert propose_ngram(tokens, k, lo, hi, occurrence="recent") == recent
    assert propose_ngram(tokens, k, lo, hi, occurrence="earliest") == earliest
    assert NgramConfig(k, lo, hi, occurrence="earliest").propose(tokens) == earliest
    with pytest.raises(ValueError, match="occurrence"):
        NgramConfig(occurrence="latest")


def test_earliest_is_vllms_proposer():
    """occurrence="earliest" drafts exactly what vLLM's own n-gram proposer drafts (its KMP search over the
    reversed tokens), on random sequences over small vocabularies where matches of every length abound."""
    import numpy as np

    mod = pytest.importorskip("vllm.v1.spec_decode.ngram_proposer")
    fn = mod._find_longest_matched_ngram_and_propose_tokens
    fn = getattr(fn, "py_func", fn)  # the numba function's Python body: same code, no compile
    rng = np.random.default_rng(0)
    checked = 0
    for _ in range(1500):
        n = int(rng.integers(1, 40))
        vocab = int(rng.integers(2, 6))
        tokens = rng.integers(0, vocab, size=n).astype(np.int32)
        lo = int(rng.integers(1, 4))
        hi = lo + int(rng.integers(0, 4))
        k = int(rng.integers(1, 7))
        theirs = fn(tokens, lo, hi, 10**6, k).tolist()
        ours = propose_ngram(tokens.tolist(), k, lo, hi, occurrence="earliest")
        assert ours == theirs, (tokens.tolist(), k, lo, hi)
        checked += bool(theirs)
    assert checked > 750  # most cases drafted something (990 of 1500 with this seed)


def _reference(tokens, k, min_n, max_n, occurrence):
    """The search written out as a Python loop over every start: what the C search must return."""
    if k <= 0:
        return []
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        suffix = tokens[len(tokens) - n:]
        starts = [s for s in range(len(tokens) - n) if tokens[s:s + n] == suffix]
        if starts:
            s = starts[0] if occurrence == "earliest" else starts[-1]
            return tokens[s + n:s + n + k]
    return []


def test_the_search_equals_a_loop_over_every_start():
    """Random texts over small vocabularies (matches of every length, many overlapping), and ids that share bytes
    (a byte-level match that straddles two ids must not count)."""
    import random

    rng = random.Random(0)
    for trial in range(3000):
        vocab = rng.choice([2, 3, 5, 300, 70000])
        tokens = [rng.randrange(vocab) for _ in range(rng.randrange(0, 60))]
        if trial % 7 == 0:  # ids whose bytes repeat inside each other: 0x0101..., 0x01, 256, 257
            tokens = [rng.choice([1, 256, 257, 65793, 16843009]) for _ in range(rng.randrange(0, 40))]
        lo = rng.randrange(1, 4)
        hi = lo + rng.randrange(0, 4)
        k = rng.randrange(0, 7)
        for occ in ("recent", "earliest"):
            assert propose_ngram(tokens, k, lo, hi, occ) == _reference(tokens, k, lo, hi, occ), (tokens, k, lo, hi)


def test_a_token_text_drafts_as_its_tokens_do():
    """The coordinator's and a middle level's cached texts: grown, rolled back and grown again, they draft what
    the plain token list drafts, a tail included."""
    from specray.spec.ngram import TokenText

    cfg = NgramConfig(4, 1, 3, occurrence="earliest")
    tokens = [5, 1, 2, 9, 1, 2, 8, 1, 2, 70000, 1]
    text = TokenText(tokens[:3]).catch_up(tokens)
    assert len(text) == len(tokens) and text.tokens() == tokens
    assert cfg.propose_text(text) == cfg.propose(tokens)
    assert cfg.propose_text(text, 2, tail=[2]) == cfg.propose([*tokens, 2], 2)
    text.truncate(5)
    text.extend([2, 9])
    assert text.tokens() == [5, 1, 2, 9, 1, 2, 9]
    assert cfg.propose_text(text) == cfg.propose([5, 1, 2, 9, 1, 2, 9]) == [1, 2, 9]
    assert cfg.propose_text(TokenText()) == []


def _match_length(tokens, lo, hi, occurrence):
    """The length of the suffix `_reference` drafts after (0: none)."""
    for n in range(min(hi, len(tokens) - 1), lo - 1, -1):
        suffix = tokens[len(tokens) - n:]
        if any(tokens[s:s + n] == suffix for s in range(len(tokens) - n)):
            return n
    return 0


def test_a_match_length_cap_shortens_a_draft_to_its_factor_times_the_match():
    """`max_spec_factor` f > 0: the uncapped draft cut to max(1, floor(f x m)) tokens, m the match's length; 0
    leaves it whole. Random texts, every occurrence rule, through the token list and the cached text alike."""
    import random

    from specray.spec.ngram import TokenText

    rng = random.Random(1)
    cut = 0
    for _ in range(2000):
        tokens = [rng.randrange(rng.choice([2, 3, 6])) for _ in range(rng.randrange(0, 50))]
        lo = rng.randrange(1, 3)
        hi = lo + rng.randrange(0, 4)
        k = rng.randrange(0, 12)
        f = rng.choice([0.0, 0.5, 1.0, 1.5, 2.0, 3.0])
        for occ in ("recent", "earliest"):
            whole = _reference(tokens, k, lo, hi, occ)
            m = _match_length(tokens, lo, hi, occ)
            want = whole[:max(1, int(f * m))] if f > 0 else whole
            cfg = NgramConfig(k, lo, hi, occ, max_spec_factor=f)
            assert cfg.propose(tokens) == want, (tokens, k, lo, hi, f)
            assert cfg.propose_text(TokenText(tokens)) == want
            cut += len(want) < len(whole)
    assert cut > 100  # the cap was binding often
    with pytest.raises(ValueError, match="max_spec_factor"):
        NgramConfig(4, 1, 4, max_spec_factor=-1.0)
