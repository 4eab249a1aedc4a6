"""The workers' greedy fast paths (`LogitsWorker.propose` / `verify` on rows that are all greedy without penalties,
logprobs, confidence or returned distributions) against the general path, token for token, ties included; the
batches that must keep the general path; the host-side branching of `SamplingBatch` / `processed_probs`."""

from __future__ import annotations

import sys

import pytest
import torch

import specray.engine.base as base
import specray.engine.tree_rows as tree_rows
from specray.engine.hf import HFWorker
from specray.engine.protocol import DraftMode, SeqSync
from specray.engine.rows import pad_rows
from specray.spec.noise import keyed_uniform, keyed_uniform_streams
from specray.spec.params import SamplingParams, VerifyMethod
from specray.spec.reference import ref_penalized_logits_row
from specray.spec.sampling import SamplingBatch, processed_probs
from specray.testing.fake import FakeWorker

VOCAB = 16


def first_argmax(row: torch.Tensor) -> int:
    """The lowest index of the largest value (the general path's tie rule), in plain Python."""
    vals = row.tolist()
    return max(range(len(vals)), key=lambda i: (vals[i], -i))


def tied_worker(name: str) -> FakeWorker:
    """A fake model whose logits take three values only: most rows have exact ties for the top."""
    w = FakeWorker(name, vocab=VOCAB, order=2, table_seed=3)
    w.table = torch.randint(0, 3, w.table.shape, generator=torch.Generator().manual_seed(7)).float()
    return w


@pytest.fixture
def spy(monkeypatch):
    """Counts the general paths' `processed_probs` calls made by the workers: in every engine module that calls it
    (the chains' paths in `base`, tree drafting in `tree_rows`), so no path escapes the count."""
    calls = []

    def counted(*args, **kwargs):
        calls.append(1)
        return processed_probs(*args, **kwargs)

    holders = [m for n, m in list(sys.modules.items())
               if n.startswith("specray.engine.") and getattr(m, "processed_probs", None) is processed_probs]
    assert {base, tree_rows} <= set(holders)
    for m in holders:
        monkeypatch.setattr(m, "processed_probs", counted)
    return calls


def greedy_walk(w: FakeWorker, context: list[int], draft: list[int]) -> list[int]:
    """Reference greedy verification of one row: accept while the draft is the first argmax, then emit it."""
    out = []
    for j in range(len(draft) + 1):
        y = first_argmax(w.next_logits(context + draft[:j]))
        out.append(y)
        if j == len(draft) or draft[j] != y:
            return out
    raise AssertionError("unreachable")


def drafts_for(w: FakeWorker, contexts: list[list[int]], lengths: list[int], gen: torch.Generator) -> list[list[int]]:
    """Each row's greedy continuation, cut to its length and corrupted at a random slot half of the time."""
    out = []
    for ctx, n in zip(contexts, lengths):
        d: list[int] = []
        for _ in range(n):
            d.append(first_argmax(w.next_logits(ctx + d)))
        if d and torch.rand(1, generator=gen).item() < 0.5:
            j = int(torch.randint(0, n, (1,), generator=gen))
            d[j] = (d[j] + 1 + int(torch.randint(0, VOCAB - 1, (1,), generator=gen))) % VOCAB
        out.append(d)
    return out


def test_tied_logits_are_tied():
    w = tied_worker("t")
    rows = w.table
    top = rows.max(dim=-1, keepdim=True).values
    assert ((rows == top).sum(-1) > 1).float().mean() > 0.5  # most rows: the top is shared


@pytest.mark.parametrize("method", list(VerifyMethod))
def test_verify_fast_path_equals_general_path(method, spy):
    fast, general = tied_worker("fast"), tied_worker("general")
    gen = torch.Generator().manual_seed(int(method == VerifyMethod.COUPLED) + 11)
    ids = [f"r{b}" for b in range(5)]
    sampling = [SamplingParams(seed=b) for b in range(5)]
    for w in (fast, general):
        for b, sid in enumerate(ids):
            w.add(sid, [b % VOCAB, (3 * b + 1) % VOCAB, 5])
    accepted = 0
    for rnd in range(12):
        lengths = [(rnd + b) % 5 for b in range(5)]  # ragged, a row with no draft in every round
        drafts = drafts_for(fast, [fast.tokens(s) for s in ids], lengths, gen)
        kmax = max(lengths)
        q = torch.softmax(torch.randn(5, kmax, VOCAB, generator=gen), -1) if method == VerifyMethod.REJECTION else None
        expected = [greedy_walk(fast, fast.tokens(s), d) for s, d in zip(ids, drafts)]
        spy.clear()
        got = fast.verify(ids, drafts, q, sampling, method)
        assert not spy  # the fast path: no distributions built
        ref = general.verify(ids, drafts, q, sampling, method, return_probs=True)
        assert spy  # the general path
        assert got.token_ids == ref.token_ids == expected
        assert got.num_accepted == ref.num_accepted
        assert got.probs is None and got.confidence is None and got.logprobs is None
        for s in ids:
            assert fast.tokens(s) == general.tokens(s)
            assert fast._seqs[s].kv_len == general._seqs[s].kv_len
        accepted += sum(got.num_accepted)
    assert accepted > 5  # drafts were accepted, not only rejected


@pytest.mark.parametrize("mode", [DraftMode.GREEDY, DraftMode.COUPLED])
def test_propose_fast_path_equals_general_path(mode, spy):
    fast, general = tied_worker("fast"), tied_worker("general")
    ids = [f"r{b}" for b in range(4)]
    sampling = [SamplingParams(seed=b) for b in range(4)]
    for w in (fast, general):
        for b, sid in enumerate(ids):
            w.add(sid, [b, 2 * b + 1, 7])
    for k in ([4, 0, 2, 3], [1, 1, 1, 1], [0, 0, 0, 0]):
        contexts = [fast.tokens(s) for s in ids]
        expected: list[list[int]] = [[] for _ in ids]
        for b, (c, n) in enumerate(zip(contexts, k)):
            for _ in range(n):
                expected[b].append(first_argmax(fast.next_logits(c + expected[b])))
        spy.clear()
        got = fast.propose(ids, k, sampling, mode=mode)
        assert not spy
        # random mode keeps the general path (it returns q) and draws the argmax from a greedy row's one-hot
        ref = general.propose(ids, k, sampling, mode=DraftMode.RANDOM)
        assert spy or max(k) == 0
        assert got.token_ids == ref.token_ids == expected
        assert got.probs is None
        for s in ids:
            assert fast.tokens(s) == general.tokens(s)
            assert fast._seqs[s].kv_len == general._seqs[s].kv_len
        for s, n in zip(ids, k):  # the verifier takes the drafts back
            for w in (fast, general):
                w.rollback(s, len(w.tokens(s)) - n)


def test_mixed_greedy_and_sampled_rows_take_the_general_path(spy):
    batch, alone = tied_worker("batch"), tied_worker("alone")
    ids = ["g0", "s1", "g2"]
    sampling = [SamplingParams(seed=1), SamplingParams(temperature=0.9, top_k=5, seed=2), SamplingParams(seed=3)]
    gen = torch.Generator().manual_seed(5)
    for w in (batch, alone):
        for b, sid in enumerate(ids):
            w.add(sid, [b + 1, 4, 9])
    for rnd in range(8):
        lengths = [3, 2, 0] if rnd % 2 else [1, 4, 2]
        drafts = drafts_for(batch, [batch.tokens(s) for s in ids], lengths, gen)
        spy.clear()
        got = batch.verify(ids, drafts, None, sampling, VerifyMethod.DETERMINISTIC)
        assert spy  # a sampled row: the general path
        for b, sid in enumerate(ids):  # each row alone (a greedy row alone takes the fast path): the same tokens
            one = alone.verify([sid], [drafts[b]], None, [sampling[b]], VerifyMethod.DETERMINISTIC)
            assert got.token_ids[b] == one.token_ids[0]
        for b in (0, 2):
            assert got.token_ids[b] == greedy_walk(batch, batch.tokens(ids[b])[: -len(got.token_ids[b])], drafts[b])


def test_greedy_rows_with_a_repetition_penalty_take_the_general_path(spy):
    w = tied_worker("pen")
    prompts = [[1, 2, 3], [4, 4, 5]]
    ids = ["a", "b"]
    sampling = [SamplingParams(seed=0, repetition_penalty=1.5, prompt_len=3), SamplingParams(seed=1, prompt_len=3)]
    gen = torch.Generator().manual_seed(9)
    for sid, p in zip(ids, prompts):
        w.add(sid, p)
    differs = 0
    for _ in range(10):
        drafts = drafts_for(w, [w.tokens(s) for s in ids], [3, 2], gen)
        ctx = [w.tokens(s) for s in ids]
        spy.clear()
        got = w.verify(ids, drafts, None, sampling, VerifyMethod.GREEDY)
        assert spy  # a penalized row: the general path
        # row a: accept while the draft is the first argmax of the penalized logits (the drafts count as output)
        d, out = drafts[0], []
        for j in range(len(d) + 1):
            logits = w.next_logits(ctx[0] + d[:j])
            pen = ref_penalized_logits_row(logits, ctx[0][:3], ctx[0][3:] + d[:j], 0.0, 0.0, 1.5)
            y = first_argmax(pen)
            out.append(y)
            differs += y != first_argmax(logits)
            if j == len(d) or d[j] != y:
                break
        assert got.token_ids[0] == out
        assert got.token_ids[1] == greedy_walk(w, ctx[1], drafts[1])  # row b: plain greedy, in the same batch
    assert differs  # the penalty changed tokens: the fast path would have been wrong


def test_penalized_greedy_propose_takes_the_general_path(spy):
    w = tied_worker("pen")
    prompt = [1, 2, 3]
    w.add("a", prompt)
    sp = SamplingParams(seed=0, repetition_penalty=1.5, prompt_len=3)
    got = w.propose(["a"], [6], [sp], mode=DraftMode.GREEDY).token_ids[0]
    assert spy
    out: list[int] = []
    for _ in range(6):
        logits = w.next_logits(prompt + out)
        out.append(first_argmax(ref_penalized_logits_row(logits, prompt, out, 0.0, 0.0, 1.5)))
    assert got == out


def test_greedy_rows_with_logprobs(spy):
    """Logprobs leave drafting on the fast path (a draft reports none) and put verification on the general one."""
    w = tied_worker("lp")
    w.add("a", [1, 2, 3])
    sp = SamplingParams(seed=0, logprobs=2)
    prop = w.propose(["a"], [3], [sp], mode=DraftMode.GREEDY)
    assert not spy
    w.rollback("a", 3)
    res = w.verify(["a"], prop.token_ids, None, [sp], VerifyMethod.GREEDY)
    assert spy
    assert res.token_ids[0] == greedy_walk(w, [1, 2, 3], prop.token_ids[0])
    assert res.logprobs is not None and len(res.logprobs[0]) == len(res.token_ids[0])


@pytest.mark.parametrize("method", list(VerifyMethod))
def test_tree_fast_paths_equal_general_paths(method, spy):
    """propose_tree (greedy and coupled mode vs random mode, which keeps the general path) and verify_tree (vs
    return_probs, which keeps it) on tied logits: the same trees, emitted tokens and worker state."""
    mode = DraftMode.COUPLED if method == VerifyMethod.COUPLED else DraftMode.GREEDY
    d_fast, d_gen = tied_worker("d"), tied_worker("d")
    for w in (d_fast, d_gen):
        w.table = w.table + torch.randint(0, 2, w.table.shape, generator=torch.Generator().manual_seed(4)).float()
    t_fast, t_gen = tied_worker("t"), tied_worker("t")
    ids = [f"r{b}" for b in range(4)]
    sampling = [SamplingParams(seed=b) for b in range(4)]
    prompts = [[b, 2 * b + 1, 7] for b in range(4)]
    for w in (t_fast, t_gen):
        for sid, p in zip(ids, prompts):
            w.add(sid, p)
    syncs = [SeqSync.start(p) for p in prompts]
    gen = torch.Generator().manual_seed(1)
    accepted = 0
    for rnd in range(6):
        depth = [3, 0, 2, 4] if rnd % 2 else [2, 2, 2, 2]
        spy.clear()
        prop = d_fast.propose_tree(ids, depth, sampling, mode=mode, level=0, sync=syncs, width=2)
        assert not spy
        ref = d_gen.propose_tree(ids, depth, sampling, mode=DraftMode.RANDOM, level=0, sync=syncs, width=2)
        assert spy or max(depth) == 0
        assert prop.trees == ref.trees and prop.token_ids == ref.token_ids and prop.probs is None
        trees = prop.trees
        q = None
        if method == VerifyMethod.REJECTION:
            n = max(t.num_nodes for t in trees)
            q = torch.softmax(torch.randn(4, n + 1, VOCAB, generator=gen), -1)
        before = [t_fast.tokens(s) for s in ids]
        spy.clear()
        got = t_fast.verify_tree(ids, trees, q, sampling, method, level=1)
        assert not spy
        exp = t_gen.verify_tree(ids, trees, q, sampling, method, level=1, return_probs=True)
        assert spy
        assert got.token_ids == exp.token_ids and got.num_accepted == exp.num_accepted
        assert got.tree_nodes == exp.tree_nodes and got.probs is None
        for s in ids:
            assert t_fast.tokens(s) == t_gen.tokens(s)
            assert t_fast._seqs[s].kv_len == t_gen._seqs[s].kv_len
        for b, t in enumerate(trees):  # the walk: the first-argmax child at each slot, its argmax at the stop
            ctx, at, out = before[b], -1, []
            while True:
                y = first_argmax(t_fast.next_logits(ctx + out))
                kid = next((i for i in range(t.num_nodes) if t.parents[i] == at and t.token_ids[i] == y), None)
                out.append(y)
                if kid is None:
                    break
                at = kid
            assert got.token_ids[b] == out
        accepted += sum(got.num_accepted)
        syncs = [SeqSync(len(c), tuple(e)) for c, e in zip(before, got.token_ids)]
    assert accepted > 3


@pytest.fixture(scope="module")
def hf_pair(tiny):
    return HFWorker(str(tiny.target_dir), name="fast", dtype="float32"), HFWorker(str(tiny.target_dir), name="gen",
                                                                                  dtype="float32")


def test_hf_fast_path_equals_general_path(hf_pair, spy):
    fast, general = hf_pair
    ids = [f"h{b}" for b in range(3)]
    sampling = [SamplingParams(seed=b) for b in range(3)]
    prompts = [fast.tokenizer.encode(t) for t in ("def fibonacci(n):", "The river ran", "Weather report: cloudy")]
    for w in (fast, general):
        for sid, p in zip(ids, prompts):
            w.add(sid, p)
    accepted = 0
    for rnd in range(4):
        k = [4, 0, 2] if rnd % 2 else [3, 3, 3]  # ragged (a bool mask of logits) and uniform (their positions)
        spy.clear()
        prop = fast.propose(ids, k, sampling, mode=DraftMode.GREEDY)
        assert not spy
        ref_prop = general.propose(ids, k, sampling, mode=DraftMode.RANDOM)
        assert prop.token_ids == ref_prop.token_ids
        drafts = [list(d) for d in prop.token_ids]
        if rnd == 2:
            drafts[0][1] = (drafts[0][1] + 1) % fast.vocab_size  # a rejection
        for w, d in ((fast, prop.token_ids), (general, ref_prop.token_ids)):
            for sid, n in zip(ids, map(len, d)):
                w.rollback(sid, len(w.tokens(sid)) - n)
        spy.clear()
        got = fast.verify(ids, drafts, None, sampling, VerifyMethod.GREEDY)
        assert not spy
        ref = general.verify(ids, drafts, None, sampling, VerifyMethod.GREEDY, confidence=True)
        assert spy
        assert got.token_ids == ref.token_ids and got.num_accepted == ref.num_accepted
        accepted += sum(got.num_accepted)
        for sid in ids:
            assert fast.tokens(sid) == general.tokens(sid)
    assert accepted > 0
    for w in hf_pair:
        for sid in ids:
            w.free(sid)


def test_pad_rows():
    flat = torch.arange(12, dtype=torch.float32).view(6, 2)
    out = pad_rows(flat, [3, 1, 2])
    assert out.shape == (3, 3, 2)
    torch.testing.assert_close(out[0], flat[:3])
    torch.testing.assert_close(out[1], torch.stack([flat[3], torch.zeros(2), torch.zeros(2)]))
    torch.testing.assert_close(out[2, :2], flat[4:])
    assert (out[2, 2] == 0).all()
    torch.testing.assert_close(pad_rows(flat, [2, 2, 2]), flat.view(3, 2, 2))


def test_sampling_batch_fields_and_host_copy():
    params = [SamplingParams(0.0, seed=1), SamplingParams(0.7, top_k=3, top_p=0.9, seed=2**62, min_p=0.1,
                                                          repetition_penalty=1.2, frequency_penalty=0.5,
                                                          presence_penalty=-0.25)]
    sb = SamplingBatch.from_params(params)
    assert sb.temperature.tolist() == [0.0, pytest.approx(0.7)] and sb.temperature.dtype == torch.float32
    assert sb.top_k.tolist() == [0, 3] and sb.top_k.dtype == torch.int64
    assert sb.seed.tolist() == [1, 2**62] and sb.seed.dtype == torch.int64
    assert sb.top_p.tolist() == [1.0, pytest.approx(0.9)]
    assert sb.min_p.tolist() == [0.0, pytest.approx(0.1)]
    assert sb.repetition.tolist() == [1.0, pytest.approx(1.2)]
    assert sb.frequency.tolist() == [0.0, 0.5] and sb.presence.tolist() == [0.0, -0.25]
    assert sb.host == tuple(params) and sb.any_greedy and not sb.all_greedy
    assert sb.select([1]).host == (params[1],) and not sb.select([1]).any_greedy
    assert sb.select(torch.tensor([1])).host is None and not sb.select(torch.tensor([1])).any_greedy
    assert sb.to("cpu") is sb
    plain = SamplingBatch.from_params([SamplingParams(0.5, seed=3)])
    assert plain.min_p is None and plain.repetition is None and not plain.penalized
    empty = SamplingBatch.from_params([])
    assert len(empty) == 0


@pytest.mark.parametrize("rows", [
    [SamplingParams(0.0, seed=0)] * 3,
    [SamplingParams(0.0, seed=0), SamplingParams(0.8, top_k=4, seed=1), SamplingParams(1.2, top_p=0.7, seed=2)],
    [SamplingParams(0.9, top_k=5, seed=0), SamplingParams(0.6, top_p=0.5, min_p=0.2, seed=1)],
    [SamplingParams(0.0, seed=0), SamplingParams(1.0, seed=1), SamplingParams(0.5, min_p=0.3, seed=2)],
    # values float32 rounds across a branch: a temperature that is 0 there, a top_p that is 1, a min_p that is 0
    [SamplingParams(1e-46, seed=0), SamplingParams(0.7, top_p=0.999999999, seed=1),
     SamplingParams(0.8, min_p=1e-50, top_k=3, seed=2)],
    [SamplingParams(1e-46, seed=0)] * 2,
])
def test_processed_probs_host_branches_equal_tensor_branches(rows):
    """Branching on the host copy of the parameters gives what branching on the tensors gives (ties included)."""
    logits = torch.randint(0, 4, (len(rows), 3, 40), generator=torch.Generator().manual_seed(2)).float()
    sb = SamplingBatch.from_params(rows)
    bare = SamplingBatch(sb.temperature, sb.top_k, sb.top_p, sb.seed, sb.min_p)  # no host copy
    assert bare.host is None
    torch.testing.assert_close(processed_probs(logits, sb), processed_probs(logits, bare), rtol=0, atol=0)


def test_keyed_uniform_streams_is_keyed_uniform_per_stream():
    seed = torch.tensor([0, 7, 2**62 + 5, 123, 7])
    position = torch.tensor([0, 3, 2**40 + 1, 9, 3])
    streams = [1, 2, 0, 2**32 - 1, 5]
    got = keyed_uniform_streams(seed, position, streams)
    for i, st in enumerate(streams):
        assert got[i] == keyed_uniform(seed[i : i + 1], position[i : i + 1], st, 1)[0, 0]
    assert len(set(got.tolist())) == 5
    with pytest.raises(ValueError):
        keyed_uniform_streams(seed, position, streams[:4])
    with pytest.raises(ValueError):
        keyed_uniform_streams(seed, position, [1, 2, 3, 2**32, 0])
