"""Token trees (spec/tree.py, spec/tree_verify.py): layout and validation, chains verified exactly as `verify`
does, batched == per-row reference, greedy/coupled walks, and statistical exactness
of deterministic and rejection trees."""

from __future__ import annotations

import functools
import zlib
from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specray.spec.noise import sample_tokens
from specray.spec.params import PLACEHOLDER_TOKEN_ID as PH
from specray.spec.params import SamplingParams, VerifyMethod
from specray.spec.reference import ref_verify_tree
from specray.spec.sampling import SamplingBatch, TokenHistory, apply_penalties, processed_probs
from specray.spec.suffix import SuffixConfig, SuffixDrafter
from specray.spec.tree import DraftTree, TreeBatch, pad_trees, sample_siblings, tree_from_topk
from specray.spec.tree_verify import tree_penalized_logits, verify_tree, verify_tree_logits
from specray.spec.verify import verify, verify_logits
from specray.testing.goodness import chi2_crit, chi2_stat

ALL_METHODS = list(VerifyMethod)
DRAFTER_SALT, VERIFIER_SALT, NEXT_ROUND_SALT = 0, 1, 7

# ------------------------------------------------------------------------------------------- layout


def test_tree_layout():
    #      root
    #     /    \
    #   0:5    1:6
    #   /  \     \
    # 2:7  3:8   4:9
    #  |
    # 5:1
    t = DraftTree((5, 6, 7, 8, 9, 1), (-1, -1, 0, 0, 1, 2))
    assert t.num_nodes == 6 and t.depths == (0, 0, 1, 1, 1, 2) and t.max_depth == 3
    assert t.children(-1) == (0, 1) and t.children(0) == (2, 3) and t.children(5) == ()
    assert t.paths() == [(0, 3), (1, 4), (0, 2, 5)]
    assert t.path_to(5) == (0, 2, 5) and not t.is_chain and t.distinct_siblings
    c = DraftTree.chain([4, 4, 2])
    assert c.parents == (-1, 0, 1) and c.is_chain and c.paths() == [(0, 1, 2)] and c.distinct_siblings
    assert DraftTree.chain([]).num_nodes == 0 and DraftTree.chain([]).max_depth == 0
    merged = DraftTree.from_paths([[5, 7, 1], [5, 8], [6, 9], [5, 7]])  # shared prefixes merged, first-seen order
    assert merged == DraftTree((5, 7, 1, 8, 6, 9), (-1, 0, 1, 0, -1, 4))
    assert not DraftTree((3, 3), (-1, -1)).distinct_siblings  # allowed: i.i.d. sampled siblings


def test_tree_validation_errors():
    with pytest.raises(ValueError, match="token_ids has 2 nodes but parents has 1"):
        DraftTree((1, 2), (-1,))
    with pytest.raises(ValueError, match=r"token_ids\[1\]=-3"):
        DraftTree((1, -3), (-1, 0))
    with pytest.raises(ValueError, match=r"parents\[1\]=1 must be in \[-1, 1\)"):
        DraftTree((1, 2), (-1, 1))
    with pytest.raises(ValueError, match=r"parents\[0\]=-2"):
        DraftTree((1,), (-2,))
    with pytest.raises(IndexError, match="node 3"):
        DraftTree.chain([1, 2]).children(3)
    with pytest.raises(ValueError, match="placeholders only at the end"):
        TreeBatch.from_tensors(torch.tensor([[1, PH, 2]]), torch.tensor([[-1, 0, 0]]))
    with pytest.raises(ValueError, match="tree row 1, node 1"):
        TreeBatch.from_tensors(torch.tensor([[1, 2], [1, 2]]), torch.tensor([[-1, 0], [-1, 1]]))
    with pytest.raises(ValueError, match=r"trees\[1\] has 3 nodes"):
        pad_trees([DraftTree.chain([1]), DraftTree.chain([1, 2, 3])], max_nodes=2)
    with pytest.raises(ValueError, match="repeats a token"):
        tree_from_topk([[1, 2], [3, 3]])
    with pytest.raises(ValueError, match=r"topk_probs\[0\]"):
        tree_from_topk([[1, 2]], [[0.5]])
    with pytest.raises(ValueError, match="tree_width=0"):
        tree_from_topk([[1, 2]], tree_width=0)

    sb = SamplingBatch.from_params([SamplingParams(1.0, seed=1)])
    p = torch.full((1, 3, 4), 0.25)
    pos = torch.tensor([0])
    twins = [DraftTree((2, 2), (-1, -1))]
    for method in (VerifyMethod.GREEDY, VerifyMethod.DETERMINISTIC, VerifyMethod.COUPLED):
        with pytest.raises(ValueError, match="row 0 has siblings with the same token"):
            verify_tree(method, p, twins, None, sb, pos, 0)
    with pytest.raises(ValueError, match="needs the drafter's probabilities"):
        verify_tree(VerifyMethod.REJECTION, p, twins, None, sb, pos, 0)
    with pytest.raises(ValueError, match=r"draft_probs must be \[B, N\+1, V\]"):
        verify_tree(VerifyMethod.REJECTION, p, twins, torch.full((1, 3, 5), 0.2), sb, pos, 0)
    with pytest.raises(ValueError, match=r"target_probs must be \[B, N\+1, V\] = \(1, 4, 4\)"):
        verify_tree(VerifyMethod.GREEDY, p, pad_trees([DraftTree.chain([1])], max_nodes=3), None, sb, pos, 0)
    with pytest.raises(ValueError, match="more than the 2 slots"):
        verify_tree(VerifyMethod.GREEDY, p, [DraftTree.chain([1, 2, 3])], None, sb, pos, 0)
    with pytest.raises(ValueError, match="got 2 trees for 1 rows"):
        verify_tree(VerifyMethod.GREEDY, p, twins * 2, None, sb, pos, 0)
    with pytest.raises(ValueError, match="must have B=1"):
        verify_tree(VerifyMethod.GREEDY, p, [DraftTree.chain([1])], None, sb, torch.tensor([0, 1]), 0)
    # REJECTION with repeated siblings is fine
    out = verify_tree(VerifyMethod.REJECTION, p, twins, torch.full((1, 3, 4), 0.25), sb, pos, 0)
    assert out.num_accepted.tolist() == [1]  # p == q: the first sibling is always accepted


def _random_tree(gen: torch.Generator, n: int, vocab: int, distinct: bool) -> DraftTree:
    tokens: list[int] = []
    parents: list[int] = []
    for i in range(n):
        par = int(torch.randint(-1, i, (1,), generator=gen)) if i else -1
        if int(torch.randint(3, (1,), generator=gen)) and i:  # bias towards deep trees
            par = i - 1
        taken = {t for t, q in zip(tokens, parents) if q == par} if distinct else set()
        free = [v for v in range(vocab) if v not in taken]
        if not free:
            break
        tokens.append(free[int(torch.randint(len(free), (1,), generator=gen))])
        parents.append(par)
    return DraftTree(tuple(tokens), tuple(parents))


def test_pad_trees_indexes_children_and_depths():
    gen = torch.Generator().manual_seed(3)
    trees = [_random_tree(gen, int(torch.randint(0, 9, (1,), generator=gen)), 4, distinct=b % 2 == 0)
             for b in range(40)]
    batch = pad_trees(trees)
    assert batch.max_nodes == max(t.num_nodes for t in trees) and len(batch) == 40
    assert batch.max_depth == max(t.max_depth for t in trees)
    for b, t in enumerate(trees):
        n = t.num_nodes
        assert batch.num_nodes[b] == n
        assert batch.token_ids[b, :n].tolist() == list(t.token_ids) and (batch.token_ids[b, n:] == PH).all()
        assert batch.depths[b, :n].tolist() == list(t.depths)
        assert bool(batch.repeated_siblings[b]) == (not t.distinct_siblings)
        for s in range(batch.max_nodes + 1):
            kids = [c for c in batch.children[b, s].tolist() if c >= 0]
            assert kids == (list(t.children(s - 1)) if s <= n else [])


# ---------------------------------------------------------------------------- chains == verify.verify


def _params(gen: torch.Generator, rows: int, vocab: int, temps: tuple[float, ...]) -> SamplingBatch:
    params = []
    for i in range(rows):
        t = temps[int(torch.randint(len(temps), (1,), generator=gen))]
        top_k = int(torch.randint(0, vocab + 2, (1,), generator=gen)) if i % 2 else 0
        top_p = (1.0, 0.95, 0.7, 0.3)[int(torch.randint(4, (1,), generator=gen))]
        params.append(SamplingParams(t, top_k=top_k, top_p=top_p, seed=int(torch.randint(2**62, (1,), generator=gen))))
    return SamplingBatch.from_params(params)


@pytest.mark.parametrize("method", ALL_METHODS)
@pytest.mark.parametrize("temps", [(0.0,), (0.7,), (1.0,), (0.0, 0.7, 1.0)])
def test_chain_trees_verify_exactly_like_verify(method, temps):
    """A chain tree gives `verify`'s result token for token (same noise): trees strictly generalise chains."""
    gen = torch.Generator().manual_seed(11 * ALL_METHODS.index(method) + len(temps) + round(10 * sum(temps)))
    accepted = 0
    for _ in range(6):
        rows = 24
        k, vocab = int(torch.randint(0, 6, (1,), generator=gen)), int(torch.randint(2, 14, (1,), generator=gen))
        sb = _params(gen, rows, vocab, temps)
        scale = float(torch.rand((), generator=gen)) * 4
        p = processed_probs(torch.randn(rows, k + 1, vocab, generator=gen) * scale, sb)
        q = processed_probs(torch.randn(rows, k + 1, vocab, generator=gen) * scale, sb)
        positions = torch.randint(0, 2**40, (rows,), generator=gen)
        sampled = torch.stack([sample_tokens(q[:, j], sb, positions + j, "random", DRAFTER_SALT) for j in range(k)],
                              dim=1) if k else torch.zeros(rows, 0, dtype=torch.int64)
        kind = torch.randint(3, (rows, 1), generator=gen)
        drafts = torch.where(kind == 0, sampled, torch.where(kind == 1, p[:, :k].argmax(-1),
                                                             torch.randint(vocab, (rows, k), generator=gen)))
        num = torch.randint(0, k + 1, (rows, 1), generator=gen)
        drafts = torch.where(torch.arange(k) < num, drafts, PH)
        chains = [DraftTree.chain([t for t in row if t != PH]) for row in drafts.tolist()]
        q_arg = q[:, :k] if method == VerifyMethod.REJECTION else None
        want = verify(method, p, drafts, q_arg, sb, positions, VERIFIER_SALT)
        for draft_probs in (q_arg, q if method == VerifyMethod.REJECTION else None):  # [B, N, V] and [B, N+1, V]
            got = verify_tree(method, p, chains, draft_probs, sb, positions, VERIFIER_SALT)
            assert torch.equal(got.output_ids, want.output_ids)
            assert torch.equal(got.num_accepted, want.num_accepted)
            assert got.path_lists() == [list(range(n)) for n in want.num_accepted.tolist()]
            assert torch.equal(got.final_token, want.output_ids.gather(1, want.num_accepted[:, None])[:, 0])
        accepted += int(want.num_accepted.sum())
    assert accepted > 0


# ------------------------------------------------------------------------------ batched == reference


def _random_tree_problem(gen: torch.Generator, method: VerifyMethod, rows: int, n_max: int, vocab: int,
                         temps: tuple[float, ...]) -> tuple:
    sb = _params(gen, rows, vocab, temps)
    scale = float(torch.rand((), generator=gen)) * 4
    p = processed_probs(torch.randn(rows, n_max + 1, vocab, generator=gen) * scale, sb)
    q = processed_probs(torch.randn(rows, n_max + 1, vocab, generator=gen) * scale, sb)
    positions = torch.randint(0, 2**40, (rows,), generator=gen)
    distinct = method != VerifyMethod.REJECTION
    trees = [_random_tree(gen, int(torch.randint(0, n_max + 1, (1,), generator=gen)), vocab, distinct)
             for _ in range(rows)]
    # Make the target like some of the drafted tokens so that paths get accepted deep into the trees.
    for b, t in enumerate(trees):
        for i in range(t.num_nodes):
            if int(torch.randint(2, (1,), generator=gen)):
                s = t.parents[i] + 1
                p[b, s] = 0.2 * p[b, s] + 0.8 * torch.nn.functional.one_hot(torch.tensor(t.token_ids[i]), vocab)
    p = processed_probs(torch.log(p.clamp(min=1e-30)), sb)  # re-apply the rows' filters
    return p, trees, q if method == VerifyMethod.REJECTION else None, sb, positions


def _assert_tree_matches_reference(method, p, trees, q, sb, positions, salt):
    got = verify_tree(method, p, trees, q, sb, positions, salt)
    want = ref_verify_tree(method, p, trees, q, sb, positions, salt)
    assert torch.equal(got.output_ids, want.output_ids)
    assert torch.equal(got.num_accepted, want.num_accepted)
    assert torch.equal(got.path, want.path)
    for t, path in zip(trees, got.path_lists()):  # a path goes down the tree from the root
        assert all(t.parents[c] == (path[j - 1] if j else -1) for j, c in enumerate(path))
    return got


@pytest.mark.parametrize("method", ALL_METHODS)
def test_batched_tree_verification_equals_reference(method):
    gen = torch.Generator().manual_seed(100 + ALL_METHODS.index(method))
    deep = 0
    for _ in range(6):
        vocab = int(torch.randint(2, 10, (1,), generator=gen))
        problem = _random_tree_problem(gen, method, 20, int(torch.randint(0, 9, (1,), generator=gen)), vocab,
                                       (0.0, 0.7, 1.0))
        out = _assert_tree_matches_reference(method, *problem, salt=2)
        deep += int((out.num_accepted >= 2).sum())
    assert deep > 0  # the cases exercise multi-level acceptance


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), rows=st.integers(1, 6), n_max=st.integers(0, 7), vocab=st.integers(1, 6),
       method=st.sampled_from(ALL_METHODS), salt=st.integers(0, 4))
def test_batched_tree_verification_equals_reference_hypothesis(seed, rows, n_max, vocab, method, salt):
    gen = torch.Generator().manual_seed(seed)
    _assert_tree_matches_reference(method, *_random_tree_problem(gen, method, rows, n_max, vocab, (0.0, 0.7, 1.0)),
                                   salt=salt)


# ------------------------------------------------------------------------------------ greedy, coupled


def test_greedy_follows_the_argmax_path():
    vocab = 10
    #        root (argmax 6)
    #      /     |      \
    #    0:5    1:6     2:7
    #     |    /   \
    #   3:1  4:2   5:3 (argmax after 6 is 3, after 3 is 9)
    #               |
    #              6:9 (argmax after 9 is 4: bonus)
    tree = DraftTree((5, 6, 7, 1, 2, 3, 9), (-1, -1, -1, 0, 1, 1, 5))
    argmax = [6, 1, 3, 0, 0, 0, 9, 4]  # per slot: root, then after each node
    p = torch.nn.functional.one_hot(torch.tensor([argmax]), vocab).float() * 0.6 + 0.04
    sb = SamplingBatch.from_params([SamplingParams(0.0, seed=1)] * 2)
    two = p.expand(2, -1, -1).clone()
    two[1, 6, :] = torch.nn.functional.one_hot(torch.tensor(8), vocab).float()  # row 1: argmax 8 after node 6
    trunc = DraftTree((5, 6, 7, 1, 2, 3), (-1, -1, -1, 0, 1, 1))  # row 1 without node 6: stops after node 5
    for method in ALL_METHODS:  # soft p under GREEDY; temperature 0 makes every method greedy
        probs = two if method == VerifyMethod.GREEDY else processed_probs(torch.log(two), sb)
        out = verify_tree(method, probs, [tree, trunc], torch.full((2, 8, vocab), 0.1), sb, torch.tensor([3, 9]), 0)
        assert out.path_lists() == [[1, 5, 6], [1, 5]], method
        assert out.token_lists() == [[6, 3, 9, 4], [6, 3, 8]], method


def _bigram(gen: torch.Generator, vocab: int, sb: SamplingBatch, scale: float = 1.5) -> torch.Tensor:
    """[V + 1, V] processed probs for one row's params: row 0 after the root, row 1 + v after token v."""
    return processed_probs(torch.randn(1, vocab + 1, vocab, generator=gen) * scale, sb)[0]


def _slot_tables(table: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:  # [V+1, V], [B, N] -> [B, N+1, V]
    """The bigram model's distribution at each slot of trees whose nodes carry `tokens` (padding: the root's)."""
    idx = torch.cat([torch.zeros_like(tokens[:, :1]), tokens.clamp(min=-1) + 1], dim=1)
    return table[idx]


@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_coupled_tree_output_is_plain_coupled_sampling(temperature):
    gen = torch.Generator().manual_seed(5)
    rows, vocab, depth = 2000, 6, 4
    sb = SamplingBatch.from_params([SamplingParams(temperature, top_k=(0, 4)[i % 2], seed=10 * i) for i in range(rows)])
    tables = torch.stack([_bigram(gen, vocab, SamplingBatch.from_params([SamplingParams(temperature, top_k=k, seed=0)]))
                          for k in (0, 4)])  # [2, V+1, V]
    table = tables[torch.arange(rows) % 2]  # [B, V+1, V]
    positions = torch.randint(0, 2**30, (rows,), generator=gen)
    longest = 7 + depth + 2  # more than any tree below can emit
    plain = torch.zeros(rows, longest, dtype=torch.int64)  # what plain coupled decoding emits
    prev = torch.full((rows,), -1)
    for d in range(longest):
        plain[:, d] = sample_tokens(table[torch.arange(rows), prev + 1], sb, positions + d, "coupled", 0)
        prev = plain[:, d]
    trees = []
    for b in range(rows):
        t = _random_tree(gen, 7, vocab, distinct=True)
        if b % 3 == 0:  # some trees contain the plain path (a branch of it, or all of it)
            t = DraftTree.from_paths([[t.token_ids[i] for i in path] for path in t.paths()]
                                     + [plain[b, : 1 + b % (depth + 1)].tolist()])
        trees.append(t)
    batch = pad_trees(trees)
    probs = table[torch.arange(rows)[:, None], torch.cat([torch.zeros(rows, 1, dtype=torch.int64),
                                                          batch.token_ids.clamp(min=-1) + 1], dim=1)]
    out = verify_tree(VerifyMethod.COUPLED, probs, batch, None, sb, positions, VERIFIER_SALT)
    for b, toks in enumerate(out.token_lists()):
        assert toks == plain[b, : len(toks)].tolist()
        if b % 3 == 0:
            assert len(toks) >= 2 + b % (depth + 1)  # the plain path is in the tree: all of it is accepted
    assert float(out.num_accepted.float().mean()) > 0.5


def test_temperature_zero_rows_are_greedy_under_every_method():
    gen = torch.Generator().manual_seed(9)
    p, trees, _, _, positions = _random_tree_problem(gen, VerifyMethod.GREEDY, 30, 8, 5, (0.0,))
    sb = SamplingBatch.from_params([SamplingParams(0.0, seed=i) for i in range(30)])
    q = processed_probs(torch.randn(30, 9, 5, generator=gen), _params(gen, 30, 5, (1.0,)))
    want = verify_tree(VerifyMethod.GREEDY, p, trees, None, sb, positions, 0)
    assert int(want.num_accepted.sum()) > 10
    for method in ALL_METHODS:
        got = verify_tree(method, p, trees, q, sb, positions, 3)
        assert torch.equal(got.output_ids, want.output_ids), method
        assert torch.equal(got.path, want.path), method


# ------------------------------------------------------------------------------ statistical exactness

N_ROWS = 20_000
SHAPES = {"3x2": (3, 2), "2x2x2": (2, 2, 2), "chain": (1, 1)}  # children per node at each depth
FILTERS = {"plain": (0, 1.0), "top_k_top_p": (4, 0.9)}


def _shape_parents(widths: tuple[int, ...]) -> tuple[list[int], list[int], list[int]]:
    """Parents, depth and sibling rank of every node of the full tree with these widths, in level order."""
    parents, depths, ranks, level = [], [], [], [-1]
    for d, w in enumerate(widths):
        nxt = []
        for par in level:
            for r in range(w):
                nxt.append(len(parents))
                parents.append(par)
                depths.append(d)
                ranks.append(r)
        level = nxt
    return parents, depths, ranks


@functools.cache
def _stat_run(method: VerifyMethod, temperature: float, filt: str, shape: str, vocab: int = 6,
              q_scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """N_ROWS independent rounds (row b has its own seed) of one tree verification with a bigram target and a
    different bigram drafter; the second token of rows that emitted one comes from the next (plain) round.
    Returns (p table, emitted first two tokens [N, 2], num_accepted [N], repeated_siblings [N])."""
    top_k, top_p = FILTERS[filt]
    gen = torch.Generator().manual_seed(77 + vocab)
    one = SamplingBatch.from_params([SamplingParams(temperature, top_k=top_k, top_p=top_p, seed=0)])
    p_logits = torch.randn(1, vocab + 1, vocab, generator=gen) * 1.5
    p_table = processed_probs(p_logits, one)[0]
    q_table = processed_probs(0.5 * p_logits + q_scale * torch.randn(1, vocab + 1, vocab, generator=gen), one)[0]
    sb = one.select([0] * N_ROWS)
    case = zlib.crc32(repr((method.value, temperature, filt, shape, vocab, q_scale)).encode()) % 10**6
    sb.seed = torch.arange(N_ROWS, dtype=torch.int64) + 1_000_003 * case
    positions = torch.randint(0, 2**30, (N_ROWS,), generator=gen)
    parents, depths, ranks = _shape_parents(SHAPES[shape])
    n = len(parents)
    tokens = torch.zeros(N_ROWS, n, dtype=torch.int64)
    for i, (par, d, r) in enumerate(zip(parents, depths, ranks)):
        q_par = q_table[torch.zeros_like(tokens[:, 0]) if par < 0 else tokens[:, par] + 1]  # [N, V] q at the parent
        if r:
            continue  # siblings are drawn with their first sibling, below
        w = SHAPES[shape][d]
        if method == VerifyMethod.REJECTION:  # w i.i.d. draws from q with the drafter's keyed noise
            kids = sample_siblings(q_par, sb, positions + d, w, DRAFTER_SALT)
        else:  # w distinct tokens: a draw without replacement from q (Gumbel top-w), not the verifier's noise
            g = -torch.log(-torch.log(torch.rand(N_ROWS, vocab, generator=gen)))
            kids = torch.topk(torch.log(q_par) + g, w, dim=-1).indices
        tokens[:, i : i + w] = kids
    batch = TreeBatch.from_tensors(tokens, torch.tensor(parents).expand(N_ROWS, n))
    out = verify_tree(method, _slot_tables(p_table, tokens), batch, _slot_tables(q_table, tokens), sb, positions,
                      VERIFIER_SALT)
    first = out.output_ids[:, 0]
    nxt = sample_tokens(p_table[first + 1], sb, positions + 1, "random", NEXT_ROUND_SALT)
    second = torch.where(out.num_accepted >= 1, out.output_ids[:, 1], nxt)
    return p_table, torch.stack([first, second], dim=1), out.num_accepted, batch.repeated_siblings


def _assert_law(samples: list, law: dict) -> None:
    counts = Counter(samples)
    assert set(counts) <= {k for k, v in law.items() if v > 0}  # never a token outside the target's support
    stat, dof = chi2_stat(counts, law, len(samples))
    assert stat < chi2_crit(dof), f"chi2={stat:.1f} > {chi2_crit(dof):.1f} (dof {dof})"


# Every method meets both temperatures, both filters and both shapes.
STAT_CASES = [(m, t, f, s) for m in (VerifyMethod.DETERMINISTIC, VerifyMethod.REJECTION)
              for t, f, s in [(0.7, "plain", "3x2"), (0.7, "top_k_top_p", "2x2x2"), (1.0, "plain", "2x2x2"),
                              (1.0, "top_k_top_p", "3x2")]]


@pytest.mark.parametrize(("method", "temperature", "filt", "shape"), STAT_CASES,
                         ids=[f"{m.value}-T{t}-{f}-{s}" for m, t, f, s in STAT_CASES])
def test_tree_emits_the_target_law(method, temperature, filt, shape):
    """The first emitted token follows p(. | root) and the first two follow p(a) p(b | a) (chi-square)."""
    p, emitted, accepted, _ = _stat_run(method, temperature, filt, shape)
    vocab = p.shape[1]
    _assert_law(emitted[:, 0].tolist(), {a: float(p[0, a]) for a in range(vocab)})
    pair_law = {(a, b): float(p[0, a] * p[a + 1, b]) for a in range(vocab) for b in range(vocab)}
    _assert_law([tuple(r) for r in emitted.tolist()], pair_law)
    assert float((accepted >= 2).float().mean()) > 0.1  # deep paths are exercised


def test_repeated_sampled_siblings_are_exact():
    """A peaked drafter over a small vocabulary repeats siblings often; rejection trees stay exact."""
    p, emitted, _, repeated = _stat_run(VerifyMethod.REJECTION, 1.0, "plain", "3x2", vocab=3, q_scale=3.0)
    assert float(repeated.float().mean()) > 0.5
    _assert_law([tuple(r) for r in emitted.tolist()],
                {(a, b): float(p[0, a] * p[a + 1, b]) for a in range(3) for b in range(3)})


def test_wider_trees_accept_more_than_chains():
    """The point of trees: with the same drafter, branches get more tokens accepted per round than a chain."""
    _, _, tree_acc, _ = _stat_run(VerifyMethod.DETERMINISTIC, 1.0, "plain", "3x2")
    _, _, chain_acc, _ = _stat_run(VerifyMethod.DETERMINISTIC, 1.0, "plain", "chain")
    assert float(tree_acc.float().mean()) > float(chain_acc.float().mean()) + 0.2



# ----------------------------------------------------------------------------------- top-k trees


def test_tree_from_topk():
    ids = [[1, 2, 3], [4, 5], [6, 7]]
    probs = [[0.5, 0.3, 0.1], [0.9, 0.05], [0.8, 0.2]]
    # path probabilities: 1 .5, 2 .3, 3 .1 | 4 .45, 5 .025 | 6 .36, 7 .09
    assert tree_from_topk(ids, probs, max_nodes=4) == DraftTree((1, 2, 4, 6), (-1, -1, 0, 2))
    assert tree_from_topk(ids, probs, min_prob=0.09) == DraftTree((1, 2, 3, 4, 6, 7), (-1, -1, -1, 0, 3, 3))
    assert tree_from_topk(ids, probs, tree_width=1) == DraftTree.chain([1, 4, 6])
    assert tree_from_topk(ids) == DraftTree((1, 2, 3, 4, 5, 6, 7), (-1, -1, -1, 0, 0, 3, 3))
    assert tree_from_topk(ids, max_nodes=4) == DraftTree((1, 2, 3, 4), (-1, -1, -1, 0))  # shallowest first
    assert tree_from_topk([[1], [], [6]]) == DraftTree.chain([1])  # the spine ends where a depth is empty
    assert tree_from_topk([]).num_nodes == 0


# ----------------------------------------------------------------------------------------- penalties


def _penalized_problem(gen: torch.Generator, rows: int, vocab: int):
    params = [SamplingParams(1.0, seed=i, presence_penalty=0.4 * (i % 3), frequency_penalty=0.3,
                             repetition_penalty=(1.0, 1.5)[i % 2]) for i in range(rows)]
    sb = SamplingBatch.from_params(params)
    contexts = [torch.randint(vocab, (int(torch.randint(1, 8, (1,), generator=gen)),), generator=gen).tolist()
                for _ in range(rows)]
    history = TokenHistory.from_tokens(contexts, [len(c) // 2 for c in contexts], vocab)
    return sb, history


def test_tree_penalties_follow_each_slots_path():
    """Slot i + 1 is penalised as plain decoding would after the path to node i; chains as `apply_penalties`."""
    gen = torch.Generator().manual_seed(21)
    rows, vocab = 12, 6
    sb, history = _penalized_problem(gen, rows, vocab)
    trees = [_random_tree(gen, 7, vocab, distinct=True) for _ in range(rows)]
    batch = pad_trees(trees)
    logits = torch.randn(rows, batch.max_nodes + 1, vocab, generator=gen) * 2
    got = tree_penalized_logits(logits, sb, history, batch)
    for b, t in enumerate(trees):
        for s in range(t.num_nodes + 1):
            path = [t.token_ids[i] for i in t.path_to(s - 1)] if s else []
            one = sb.select([b])
            if path:
                want = apply_penalties(logits[b : b + 1, [0] * len(path) + [s]], one, history.select([b]),
                                       torch.tensor([path]))[0, -1]
            else:
                want = apply_penalties(logits[b : b + 1, [s]], one, history.select([b]))[0, 0]
            assert torch.equal(got[b, s], want)
    # chains: exactly what chain verification penalises, so verify_tree_logits == verify_logits
    k = 4
    drafts = torch.randint(vocab, (rows, k), generator=gen)
    drafts[::3, 2:] = PH
    chains = [DraftTree.chain([t for t in row if t != PH]) for row in drafts.tolist()]
    logits = torch.randn(rows, k + 1, vocab, generator=gen)
    chain_batch = pad_trees(chains)
    real = torch.arange(k + 1) <= chain_batch.num_nodes[:, None]  # slots after a chain's end are padding
    assert torch.equal(tree_penalized_logits(logits, sb, history, chain_batch)[real],
                       apply_penalties(logits, sb, history, drafts)[real])
    positions = torch.randint(0, 1000, (rows,), generator=gen)
    for method in (VerifyMethod.DETERMINISTIC, VerifyMethod.COUPLED):
        want = verify_logits(method, apply_penalties(logits, sb, history, drafts), drafts, None, sb, positions, 1)
        got = verify_tree_logits(method, logits, chains, None, sb, positions, 1, history)
        assert torch.equal(got.output_ids, want.output_ids)
    with pytest.raises(ValueError, match="TokenHistory"):
        tree_penalized_logits(logits, sb, None, chain_batch)


def test_ancestors():
    t = DraftTree((5, 6, 7, 8, 9, 1), (-1, -1, 0, 0, 1, 2))
    anc = pad_trees([t, DraftTree.chain([3])]).ancestors()
    for i in range(6):
        assert anc[0, i].nonzero().flatten().tolist() == sorted(t.path_to(i))
    assert anc[1].tolist()[0][:1] == [True] and not anc[1, 1:].any()


def test_sample_siblings():
    """Siblings are i.i.d. draws from q; the first is the token a chain drafter samples at that position."""
    gen = torch.Generator().manual_seed(4)
    rows, vocab, width = 20_000, 5, 3
    sb = SamplingBatch.from_params([SamplingParams(1.0, seed=i) for i in range(rows)])
    q = processed_probs(torch.randn(1, 1, vocab, generator=gen), sb.select([0]))[0].expand(rows, vocab)
    positions = torch.randint(0, 2**30, (rows,), generator=gen)
    kids = sample_siblings(q, sb, positions, width, DRAFTER_SALT)
    assert kids.shape == (rows, width)
    assert torch.equal(kids[:, 0], sample_tokens(q, sb, positions, "random", DRAFTER_SALT))
    law = {(a, b): float(q[0, a] * q[0, b]) for a in range(vocab) for b in range(vocab)}
    _assert_law([tuple(r) for r in kids[:, 1:].tolist()], law)  # independent pairs
    with pytest.raises(ValueError, match=r"probs must be \[B, V\]"):
        sample_siblings(q[None], sb, positions, width, 0)


def test_suffix_trees_verify():
    """Trees proposed by the suffix drafter (distinct siblings) verify under every method, as the reference does."""
    gen = torch.Generator().manual_seed(8)
    vocab, rows = 5, 16
    d = SuffixDrafter(SuffixConfig(num_speculative_tokens=8, max_tree_depth=6, max_spec_factor=4.0,
                                   min_token_prob=0.05, tree_width=3))
    text = torch.randint(vocab, (200,), generator=gen).tolist()
    d.start("r", text)
    trees = [d.propose_tree("r", text[: 50 + 9 * b]) for b in range(rows)]
    assert sum(len(t.children(-1)) > 1 for t in trees) > rows // 2  # they branch
    sb = _params(gen, rows, vocab, (0.0, 0.7, 1.0))
    p = processed_probs(torch.randn(rows, 9, vocab, generator=gen), sb)
    positions = torch.randint(0, 2**30, (rows,), generator=gen)
    for method in (VerifyMethod.GREEDY, VerifyMethod.DETERMINISTIC, VerifyMethod.COUPLED):
        _assert_tree_matches_reference(method, p, trees, None, sb, positions, 1)
