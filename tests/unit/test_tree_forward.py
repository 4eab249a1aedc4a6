"""Token trees in the engine: one batched forward scores a tree per row (tree attention mask, positions by
depth) and keeping an accepted path compacts its KV, exactly as if the path had been fed as a chain (fp32)."""

from __future__ import annotations

import random

import pytest
import torch

from specray.engine.hf import HFWorker
from specray.engine.protocol import SeqSync
from specray.engine.tree_rows import TokenTree, tree_window
from specray.engine.vllm import VLLMWorker
from specray.spec.params import SamplingParams, VerifyMethod
from specray.spec.sampling import SamplingBatch
from specray.spec.tree import DraftTree
from specray.spec.tree_verify import verify_tree_logits
from specray.testing.fake import FakeWorker
from specray.testing.sim import SimWorker
from specray.testing.tiny import build_tiny_model, load_tiny

G = [SamplingParams(seed=0)]


def path_to(parents, i: int) -> list[int]:
    """Node indices root -> i."""
    out = []
    while i >= 0:
        out.append(i)
        i = parents[i]
    return out[::-1]


def full_logits(model, ids: list[int]) -> torch.Tensor:
    """Reference: a no-cache forward of the whole sequence alone. -> [len(ids), V]"""
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def next_logits(w, seq_id: str, extra: list[int]) -> torch.Tensor:
    """Logits a worker computes for its pending tokens + extra through its cache (a chain). -> [len(extra) + 1, V]"""
    (s,) = w._prepare([seq_id], None)
    x = s.tokens[s.kv_len :] + extra
    return w._forward([s], [x], [len(extra) + 1])


@pytest.mark.parametrize("q", [1, 2, 5, 9])
def test_tree_window_is_the_ancestor_relation(q):
    rng = random.Random(q)
    parents = torch.tensor([[rng.randrange(-1, j) for j in range(q)] for _ in range(3)]
                           + [list(range(-1, q - 1))], dtype=torch.long)  # three random forests and a chain
    depth, window = tree_window(parents)
    for b in range(parents.shape[0]):
        par = parents[b].tolist()
        for j in range(q):
            anc = path_to(par, j)
            assert depth[b, j] == len(anc) - 1
            assert window[b, j].nonzero().flatten().tolist() == sorted(anc)
    assert torch.equal(window[-1], torch.ones(q, q, dtype=torch.bool).tril())


CASES = [("llama", "sdpa"), ("llama", "eager"), ("gpt2", "sdpa")]


@pytest.fixture(scope="module", params=CASES, ids=["-".join(c) for c in CASES])
def loaded(request, tiny, tmp_path_factory):
    family, impl = request.param
    d = tiny.target_dir if family == "llama" else build_tiny_model(
        tmp_path_factory.mktemp(family) / family, tiny.tokenizer_dir, family=family, seed=3)
    return HFWorker(str(d), name=f"{family}-{impl}", dtype="float32", attn_implementation=impl), load_tiny(d)


@pytest.fixture
def model(loaded):
    """(worker, reference model); the sequences a test leaves behind are freed after it."""
    yield loaded
    w = loaded[0]
    for sid in list(w._seqs):
        w.free(sid)


def test_attention_implementation_is_the_one_asked_for(model):
    w, _ = model
    assert w.eager == w.name.endswith("eager")
    assert w.capabilities().tree_verify


# a tree with branching at the root and below, siblings with distinct ids; a deep chain-shaped branch
BRANCHY = TokenTree((11, 12, 13, 14, 15, 16, 17, 18), (-1, -1, 0, 0, 1, 3, -1, 5))


def test_tree_forward_equals_chain_forwards_of_every_path(model):
    """A ragged batch in a non-contiguous slot order: rows with pending tokens (a fresh short prompt, a synced
    append), a branchy tree, a plain chain, no draft, a single node; each node's logits equal a no-cache forward of
    the text plus its root-to-node path, slot 0 that of the text."""
    w, ref = model
    prompts = [list(range(5, 5 + n)) for n in (20, 4, 13, 30, 9)]
    trees = [BRANCHY, TokenTree.chain([21, 22, 23, 24]), None, TokenTree((31,), (-1,)),
             TokenTree((41, 42, 43, 44, 45), (-1, 0, 0, -1, 3))]
    ids = [f"r{i}" for i in range(len(prompts))]
    for sid, p in zip(ids, prompts):
        w.add(sid, p)
    w.verify(ids[2:3], [[]], None, G, VerifyMethod.GREEDY)  # row 2 has its KV, one pending token
    w.verify(ids[:1], [[]], None, G, VerifyMethod.GREEDY)
    order = [3, 0, 4, 2, 1]
    sync = [SeqSync(len(prompts[0]) + 1, (7, 8, 9)) if b == 0 else None for b in order]  # row 0: 4 pending
    texts = {b: w.tokens(ids[b]) for b in order}
    texts[0] = texts[0][: len(prompts[0]) + 1] + [7, 8, 9]
    got = w.score_tree([ids[b] for b in order], [trees[b] for b in order], sync=sync)
    n_max = max(len(t.token_ids) if t else 0 for t in trees)
    assert got.shape == (len(order), n_max + 1, w.vocab_size)
    for r, b in enumerate(order):
        text, tree = texts[b], trees[b]
        assert w.tokens(ids[b]) == text and w._seqs[ids[b]].kv_len == len(text)
        torch.testing.assert_close(got[r, 0], full_logits(ref, text)[-1], atol=1e-5, rtol=1e-5)
        n = len(tree.token_ids) if tree else 0
        for i in range(n):
            path = [tree.token_ids[j] for j in path_to(tree.parents, i)]
            torch.testing.assert_close(got[r, i + 1], full_logits(ref, text + path)[-1], atol=1e-5, rtol=1e-5)
        assert not got[r, n + 1 :].any()
    for sid in ids:
        w.free(sid)


def greedy_tree(ref, text: list[int]) -> tuple[TokenTree, list[int], list[int]]:
    """A tree whose greedy path is nodes (1, 3, 5) beside decoys (no node sits at its depth's index) -> (tree,
    path, the greedy continuation of 4 tokens)."""
    g = []
    for _ in range(4):
        g.append(int(full_logits(ref, text + g)[-1].argmax()))
    other = lambda t: (t + 1) % 50 + 3  # never t itself: a decoy sibling
    tree = TokenTree((other(g[0]), g[0], other(g[1]), g[1], other(g[2]), g[2], other(g[1])),
                     (-1, -1, 0, 1, 3, 3, 1))
    return tree, [1, 3, 5], g


def test_accepted_path_compacts_to_a_chain(model):
    """Keep the greedy path of a tree whose every path node must move: text, kv_len, stats and the next
    step's logits equal those of sequences that verified the same tokens as a chain; rollback after it too."""
    w, ref = model
    prompt, other = [3, 9, 27, 31, 4, 4, 17, 8, 2, 5, 6], [12, 14, 16, 18]
    rows = ["a", "b", "c"]  # row b: an empty tree (no draft) in the same batch; c: a short prompt, all pending
    chains = [f"chain-{r}" for r in rows]
    for sid, p in zip(rows + chains, [prompt, prompt, other] * 2):
        w.add(sid, p)
    (tree_a, path, g), (tree_c, _, g_c) = greedy_tree(ref, prompt), greedy_tree(ref, other)
    logits = w.score_tree(rows, [tree_a, None, tree_c])
    bonus = [int(logits[0, path[-1] + 1].argmax()), int(logits[1, 0].argmax()), int(logits[2, path[-1] + 1].argmax())]
    assert [tree_a.token_ids[i] for i in path] + [bonus[0]] == g  # the greedy path, then greedy's next token
    assert [tree_c.token_ids[i] for i in path] + [bonus[2]] == g_c
    appended = w.accept_paths(rows, [path, [], path], bonus)
    res = w.verify(chains, [g[:3], [], g_c[:3]], None, G * 3, VerifyMethod.GREEDY)
    assert appended == res.token_ids and res.num_accepted == [3, 0, 3]
    for sid, cid in zip(rows, chains):
        assert w.tokens(sid) == w.tokens(cid)
        assert w._seqs[sid].kv_len == w._seqs[cid].kv_len
    assert w.stats().cached_tokens == 2 * (2 * len(prompt) + len(other) + 6)
    extra = [7, 19, 23]
    for sid, cid in zip(rows, chains):
        torch.testing.assert_close(next_logits(w, sid, extra), next_logits(w, cid, extra), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(next_logits(w, sid, extra), full_logits(ref, w.tokens(sid) + extra)[-4:],
                                   atol=1e-5, rtol=1e-5)
    # rollback into the compacted path, then a new tree on top
    for sid in ("a", "chain-a"):
        w.rollback(sid, len(prompt) + 2)
    torch.testing.assert_close(next_logits(w, "a", extra), next_logits(w, "chain-a", extra), atol=1e-5, rtol=1e-5)
    text = w.tokens("a")
    assert text == prompt + g[:2]
    again = w.score_tree(["a"], [BRANCHY])
    torch.testing.assert_close(again[0, 0], full_logits(ref, text)[-1], atol=1e-5, rtol=1e-5)
    p = path_to(BRANCHY.parents, 7)
    torch.testing.assert_close(again[0, 8], full_logits(ref, text + [BRANCHY.token_ids[i] for i in p])[-1],
                               atol=1e-5, rtol=1e-5)
    w.accept_path("a", p)  # no bonus: the last path token is the pending one
    assert w.tokens("a") == text + [BRANCHY.token_ids[i] for i in p]
    torch.testing.assert_close(next_logits(w, "a", extra), full_logits(ref, w.tokens("a") + extra)[-4:],
                               atol=1e-5, rtol=1e-5)


def test_a_path_compacts_after_the_cache_grew_inside_a_forward(model):
    """A prompt longer than the cache's first capacity grows its pools inside the (inference-mode) forward;
    compacting an accepted path afterwards, outside that forward, still works and gives a chain's logits."""
    w, ref = model
    prompt = [(7 * i) % 40 + 3 for i in range(w.cache.capacity + 9)]
    w.add("long", prompt)
    w.verify(["long"], [[]], None, G, VerifyMethod.GREEDY)  # the prefill grows the pools
    assert w.cache.capacity > len(prompt)
    text = w.tokens("long")
    tree, path, g = greedy_tree(ref, text)
    res = w.verify_tree(["long"], [tree], None, G, VerifyMethod.GREEDY)
    assert res.token_ids == [g] and res.num_accepted == [3]
    torch.testing.assert_close(next_logits(w, "long", [5, 6]), full_logits(ref, w.tokens("long") + [5, 6])[-3:],
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("method", [VerifyMethod.GREEDY, VerifyMethod.COUPLED])
def test_tree_rounds_through_verify_tree_logits_equal_plain_decoding(model, method):
    """score_tree -> `spec.tree_verify.verify_tree_logits` -> accept_paths, round after round: the text equals plain
    decoding's (greedy; coupled with a seed, whose output does not depend on the drafts). The trees hold plain
    decoding's next two tokens among decoys (at depth 1 or 2, or not at all), so paths of every length and
    every node are accepted and compacted."""
    w, _ = model
    sps = [SamplingParams(0.0, seed=1), SamplingParams(0.0, seed=2)]
    if method == VerifyMethod.COUPLED:
        sps = [SamplingParams(1.0, seed=7), SamplingParams(0.9, top_k=20, seed=8)]
    prompts = [[3, 9, 27, 31, 4], [12, 14, 16, 18, 20, 22, 24, 26, 28, 30]]
    plain, tree_rows = ["p0", "p1"], ["t0", "t1"]
    for sid, p in zip(plain + tree_rows, prompts * 2):
        w.add(sid, p)
    n = 10
    for _ in range(n + 2):
        w.verify(plain, [[], []], None, sps, method)
    truth = [w.tokens(sid) for sid in plain]
    rng = random.Random(0)
    lengths: set[int] = set()
    for r in range(2 * n):
        if min(len(w.tokens(sid)) - len(p) for sid, p in zip(tree_rows, prompts)) >= n:
            break
        trees = []
        for sid, t in zip(tree_rows, truth):
            m = len(w.tokens(sid))
            g0, g1 = t[m], t[m + 1]
            x, y, z = ((g + 1 + rng.randrange(40)) % 60 for g in (g0, g1, g0))  # != g0, != g1
            shape = r % 3  # the truth: two deep, one deep (its child a decoy), absent
            tokens = {0: (x, g0, g1, y, z), 1: (x, g0, y, z, y), 2: (x, z, y, x, y)}[shape]
            trees.append(DraftTree(tokens, (-1, -1, 1, 1, 0)) if shape < 2 else DraftTree(tokens, (-1, -1, 0, 0, 1)))
        logits = w.score_tree(tree_rows, trees)
        positions = torch.tensor([len(w.tokens(sid)) for sid in tree_rows])
        out = verify_tree_logits(method, logits, trees, None, SamplingBatch.from_params(sps), positions, 0)
        paths = [[i for i in row if i >= 0] for row in out.path.tolist()]
        assert w.accept_paths(tree_rows, paths, out.final_token.tolist()) == out.token_lists()
        lengths.update(len(p) for p in paths)
    for sid, t, p in zip(tree_rows, truth, prompts):
        assert w.tokens(sid)[: len(p) + n] == t[: len(p) + n]
    assert lengths == {0, 1, 2}


def test_an_unaccepted_tree_is_dropped_by_the_next_call(model):
    w, ref = model
    prompt = [4, 8, 15, 16, 23, 42]
    w.add("d", prompt)
    w.score_tree(["d"], [BRANCHY])
    res = w.verify(["d"], [[]], None, G, VerifyMethod.GREEDY)  # as if no tree had been scored
    assert res.token_ids == [[int(full_logits(ref, prompt)[-1].argmax())]]
    with pytest.raises(ValueError, match="no scored tree"):
        w.accept_path("d", [])
    w.free("d")


def test_bad_trees_and_paths_are_refused_with_the_field_named(model):
    w, _ = model
    w.add("e", [5, 6, 7])
    with pytest.raises(ValueError, match=r"trees\[0\]\.parents\[1\] = 1"):
        w.score_tree(["e"], [TokenTree((1, 2), (-1, 1))])
    with pytest.raises(ValueError, match=r"trees\[0\] has 2 token_ids but 1 parents"):
        w.score_tree(["e"], [TokenTree((1, 2), (-1,))])
    w.score_tree(["e"], [BRANCHY])
    with pytest.raises(ValueError, match="not a root-to-leaf path"):
        w.accept_path("e", [0, 4])  # node 4 is a child of node 1
    with pytest.raises(ValueError, match="not a root-to-leaf path"):
        w.accept_path("e", [2])
    assert w.tokens("e") == [5, 6, 7]  # a refused path changes nothing
    assert w.accept_path("e", [0, 3, 5, 7], 9) == [11, 14, 16, 18, 9]
    w.free("e")


def test_fake_worker_trees_match_its_chains():
    """The fake scores a node from the text plus the node's ancestors; keeping a path equals chain verify."""
    w, chain = FakeWorker(vocab=8, order=2), FakeWorker(vocab=8, order=2)
    assert w.capabilities().tree_verify
    prompt = [1, 2, 3]
    for x in (w, chain):
        x.add("f", prompt)
    tree = TokenTree((4, 5, 6, 7, 0), (-1, -1, 0, 1, 3))
    logits = w.score_tree(["f"], [tree])
    torch.testing.assert_close(logits[0, 0], w.next_logits(prompt))
    for i in range(5):
        ctx = prompt + [tree.token_ids[j] for j in path_to(tree.parents, i)]
        torch.testing.assert_close(logits[0, i + 1], w.next_logits(ctx))
    path = [1, 3, 4]
    res = chain.verify(["f"], [[5, 7, 0]], None, G, VerifyMethod.GREEDY)
    toks = res.token_ids[0]
    w.accept_path("f", path[: res.num_accepted[0]], toks[-1])
    assert w.tokens("f") == chain.tokens("f")
    assert w.stats().cached_tokens == chain.stats().cached_tokens


def test_sim_worker_times_a_tree_forward_by_the_tokens_fed():
    w = SimWorker("s", vocab=8, order=2)
    w.add("t", [1, 2, 3])
    w.score_tree(["t"], [BRANCHY._replace(token_ids=tuple(t % 8 for t in BRANCHY.token_ids))])
    (rec,) = [r for r in w.trace if r["kind"] == "score_tree"]
    assert rec["forwards"] == 1 and rec["tokens"] == 3 + len(BRANCHY.token_ids)


def test_vllm_workers_verify_chains_only():
    v = VLLMWorker.__new__(VLLMWorker)  # no engine needed to refuse
    v.name = "v"
    with pytest.raises(NotImplementedError, match="v: the vllm backend verifies chains only"):
        v.score_tree(["x"], [BRANCHY])
    with pytest.raises(NotImplementedError, match="chains only"):
        v.accept_paths(["x"], [[0]])
