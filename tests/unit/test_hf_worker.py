"""HF backend on tiny models: ragged batched forwards, rollback, exact cascades (fp32)."""

from __future__ import annotations

import pytest
import torch

from specray.config import CascadeConfig, LevelConfig
from specray.coordinator.cascade import Level
from specray.coordinator.generate import build_levels, generate
from specray.engine.hf import HFWorker
from specray.engine.protocol import DraftMode, SeqSync
from specray.engine.tokenizer_check import TokenizerMismatchError
from specray.spec.ngram import NgramConfig
from specray.spec.params import SamplingParams, VerifyMethod
from specray.testing.tiny import build_tiny_model, load_tiny, train_tokenizer

G = [SamplingParams(seed=0)]


def full_logits(model, ids: list[int]) -> torch.Tensor:
    """Reference: a no-cache forward of the whole sequence alone. -> [len(ids), V]"""
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def worker_logits(w: HFWorker, seq_id: str, extra: list[int]) -> torch.Tensor:
    """Logits the worker computes for its pending tokens + extra, through its cache. -> [n, V]"""
    (s,) = w._prepare([seq_id], None)
    x = s.tokens[s.kv_len :] + extra
    return w._forward([s], [x], [len(x)]), s.kv_len


@pytest.fixture(scope="module")
def worker(tiny):
    return HFWorker(str(tiny.target_dir), name="t", dtype="float32")


@pytest.fixture(scope="module")
def ref(tiny):
    return load_tiny(tiny.target_dir)


def test_rollback_equals_fresh_prefill(worker, ref, tiny):
    prompt = worker.tokenizer.encode("def fibonacci(n):\n    if n < 2:")
    worker.add("r", prompt)
    prop = worker.propose(["r"], [6], G, mode=DraftMode.GREEDY)
    assert len(prop.token_ids[0]) == 6
    for j in (4, 1, 0):
        worker.rollback("r", len(prompt) + j)
        new = [5, 17, 3]
        got, kv_len = worker_logits(worker, "r", new)
        seq = prompt + prop.token_ids[0][:j] + new
        exp = full_logits(ref, seq)[kv_len:]
        torch.testing.assert_close(got, exp, atol=1e-5, rtol=1e-5)
    worker.free("r")


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral", "gpt2"])
def test_ragged_batched_verify_matches_unbatched(family, tmp_path, tiny):
    d = build_tiny_model(tmp_path / family, tiny.tokenizer_dir, family=family, seed=3)
    w = HFWorker(str(d), dtype="float32")
    ref = load_tiny(d)
    prompts = [list(range(5, 5 + n)) for n in (3, 17, 9, 40)]
    drafts = [[7, 8, 9, 10], [], [11], [12, 13]]
    for i, p in enumerate(prompts):
        w.add(str(i), p)
    seqs = w._prepare([str(i) for i in range(4)], None)
    # non-contiguous row order through the cache
    order = [2, 0, 3, 1]
    batch = [seqs[i] for i in order]
    inputs = [s.tokens[s.kv_len :] + drafts[i] for s, i in zip(batch, order)]
    keep = [len(drafts[i]) + 1 for i in order]
    flat = w._forward(batch, inputs, keep)
    o = 0
    for i, n in zip(order, keep):
        exp = full_logits(ref, prompts[i] + drafts[i])[-n:]
        torch.testing.assert_close(flat[o : o + n], exp, atol=2e-5, rtol=1e-5)
        o += n


def test_propose_is_model_greedy_and_sync_rolls_back(worker, ref):
    prompt = [3, 9, 27, 81 % 50]
    worker.add("g", prompt)
    prop = worker.propose(["g"], [5], G)
    with torch.no_grad():
        exp = ref.generate(torch.tensor([prompt]), max_new_tokens=5, do_sample=False, pad_token_id=0)[0, 4:].tolist()
    assert prop.token_ids[0] == exp
    # keep 2 of the drafts, append other tokens, and continue: equals greedy from that text
    worker.propose(["g"], [0], G, sync=[SeqSync(len(prompt) + 2, (1, 2, 3))])
    assert worker.tokens("g") == prompt + exp[:2] + [1, 2, 3]
    res = worker.verify(["g"], [[]], None, G, VerifyMethod.GREEDY)
    assert res.token_ids[0] == [int(full_logits(ref, prompt + exp[:2] + [1, 2, 3])[-1].argmax())]
    got, kv_len = worker_logits(worker, "g", [7])
    torch.testing.assert_close(got, full_logits(ref, worker.tokens("g") + [7])[kv_len:], atol=1e-5, rtol=1e-5)
    worker.free("g")
    assert worker.stats().live_sequences == 0


def test_sync_start_adds_or_restarts_a_sequence_inside_the_call(worker, ref):
    """`SeqSync.start(text)` (keep 0): the call itself registers the sequence, or replaces a stale copy (a level
    rejoining after a failure); the result equals add + the same call."""
    text = [3, 9, 27, 31, 4, 4]
    worker.add("s-ref", text)
    want = worker.verify(["s-ref"], [[5, 6]], None, G, VerifyMethod.GREEDY).token_ids
    got = worker.verify(["s-new"], [[5, 6]], None, G, VerifyMethod.GREEDY, sync=[SeqSync.start(text)]).token_ids
    assert got == want and worker.tokens("s-new") == worker.tokens("s-ref")
    worker.propose(["s-new"], [4], G)  # state that a restart must drop
    again = worker.verify(["s-new"], [[5, 6]], None, G, VerifyMethod.GREEDY, sync=[SeqSync.start(text)]).token_ids
    assert again == want and worker.tokens("s-new") == worker.tokens("s-ref")
    torch.testing.assert_close(worker_logits(worker, "s-new", [7])[0], worker_logits(worker, "s-ref", [7])[0])
    for s in ("s-ref", "s-new"):
        worker.free(s)


def test_rejection_probs_come_back(worker):
    sp = [SamplingParams(temperature=0.8, seed=5)]
    worker.add("p", [4, 5, 6])
    prop = worker.propose(["p"], [3], sp, mode=DraftMode.RANDOM, level=0)
    assert prop.probs is not None and prop.probs.shape == (1, 3, worker.vocab_size)
    torch.testing.assert_close(prop.probs.sum(-1), torch.ones(1, 3))
    worker.free("p")


def _levels(tiny, setup: str, method=VerifyMethod.GREEDY, dtype="float32"):
    t = lambda: Level("t", worker=HFWorker(str(tiny.target_dir), name="t", dtype=dtype), method=method)
    mid = lambda k=3: Level("mid", worker=HFWorker(str(tiny.draft_dirs["mid"]), name="mid", dtype=dtype), k=k,
                            method=method)
    small = lambda: Level("small", worker=HFWorker(str(tiny.draft_dirs["small"]), name="small", dtype=dtype), k=2)
    return {
        "plain": lambda: [t()],
        "ngram": lambda: [Level("ngram", ngram=NgramConfig(4, 1, 3)), t()],
        "draft": lambda: [mid(4), t()],
        "cascade_ngram": lambda: [Level("ngram", ngram=NgramConfig(3, 1, 3)), mid(5), t()],
        "cascade_models": lambda: [small(), mid(4), t()],
    }[setup]()


PROMPTS = [
    "def fibonacci(n):",
    "The quick brown fox jumps over the lazy dog. The quick brown",
    "class Stack:\n    def __init__(self):\n        self.items = []\n    def push(self, x):",
    "Hello",
    "word_count(text: str) -> dict[str, int]: counts = {} for w in text.split(): counts",
]


def test_speculative_greedy_equals_plain_greedy(tiny, ref):
    outs = {}
    for setup in ["plain", "ngram", "draft", "cascade_ngram", "cascade_models"]:
        batch = generate(_levels(tiny, setup), PROMPTS, max_tokens=24, ignore_eos=True)
        outs[setup] = [r.token_ids for r in batch.results]
        if setup != "plain":
            assert batch.stats["t"].accepted_tokens > 0, setup
    for setup, out in outs.items():
        assert out == outs["plain"], setup
    # and plain greedy equals transformers' own greedy generate, prompt by prompt
    w = HFWorker(str(tiny.target_dir), dtype="float32")
    for p, out in zip(PROMPTS, outs["plain"]):
        ids = w.tokenizer.encode(p)
        with torch.no_grad():
            exp = ref.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False, pad_token_id=0)
        assert out == exp[0, len(ids) :].tolist()


def test_coupled_same_seed_same_tokens_whatever_the_drafter(tiny):
    sp = [SamplingParams(temperature=1.0, top_k=50, seed=1234 + i) for i in range(len(PROMPTS))]
    outs = {}
    for setup in ["plain", "ngram", "draft", "cascade_models"]:
        batch = generate(_levels(tiny, setup, VerifyMethod.COUPLED), PROMPTS, max_tokens=20, sampling=sp,
                         ignore_eos=True)
        outs[setup] = [r.token_ids for r in batch.results]
    for setup, out in outs.items():
        assert out == outs["plain"], setup
    other = generate(_levels(tiny, "plain", VerifyMethod.COUPLED), PROMPTS, max_tokens=20, ignore_eos=True,
                     sampling=[SamplingParams(temperature=1.0, top_k=50, seed=99 + i) for i in range(len(PROMPTS))])
    assert [r.token_ids for r in other.results] != outs["plain"]


def test_bf16_cascade_runs(tiny):
    batch = generate(_levels(tiny, "cascade_ngram", dtype="bfloat16"), PROMPTS[:2], max_tokens=8, ignore_eos=True)
    assert all(len(r.token_ids) == 8 for r in batch.results)


def test_mismatched_tokenizers_fail_at_startup(tiny, tmp_path):
    other_tok = train_tokenizer(tmp_path / "tok1", variant=1)
    other = build_tiny_model(tmp_path / "other", other_tok, seed=0)
    cfg = CascadeConfig(levels=[LevelConfig(kind="hf", model=str(other), name="odd-draft", dtype="float32"),
                                LevelConfig(kind="hf", model=str(tiny.target_dir), name="target", dtype="float32")])
    with pytest.raises(TokenizerMismatchError, match="odd-draft.*target|target.*odd-draft"):
        build_levels(cfg)


def test_cpu_prepack_keeps_greedy_output(tiny):
    def run(prepack: bool):
        w = HFWorker(str(tiny.target_dir), name="t", dtype="float32", cpu_prepack=prepack)
        lv = [Level("ngram", ngram=NgramConfig(3, 1, 3)), Level("t", worker=w)]
        return [r.token_ids for r in generate(lv, PROMPTS, max_tokens=16, ignore_eos=True).results]

    assert run(True) == run(False)
    with pytest.raises(ValueError, match="cpu_prepack"):
        HFWorker(str(tiny.target_dir), dtype="float16", cpu_prepack=True)



@pytest.fixture(scope="module")
def models(tiny):
    """The target and both drafters, loaded once: a worker serves one cascade after another (every sequence is
    freed at the end of `generate`)."""
    return {name: HFWorker(str(path), name=name, dtype="float32")
            for name, path in (("t", tiny.target_dir), ("mid", tiny.draft_dirs["mid"]),
                               ("small", tiny.draft_dirs["small"]))}


def _shared_levels(models, setup: str, method: VerifyMethod) -> list[Level]:
    t = Level("t", worker=models["t"], method=method)
    mid = Level("mid", worker=models["mid"], k=4, method=method)
    return {
        "plain": lambda: [t],
        "ngram": lambda: [Level("ngram", ngram=NgramConfig(4, 1, 3)), t],
        "draft": lambda: [mid, t],
        "cascade_ngram": lambda: [Level("ngram", ngram=NgramConfig(3, 1, 3)), mid, t],
        "cascade_models": lambda: [Level("small", worker=models["small"], k=2), mid, t],
    }[setup]()


@pytest.mark.parametrize("method", list(VerifyMethod))
def test_penalties_and_logprobs_at_temperature_zero_equal_plain_under_every_method(models, ref, method):
    """Greedy rows with penalties and logprobs, beside a sampled row (so the configured method really verifies
    the batch: greedy rows alone are verified greedily whatever the method): under every speculation method the
    tokens equal plain decoding's, and so do the target's raw log-probabilities at every emitted position, which
    also equal a whole-sequence forward of the model."""
    greedy = SamplingParams(0.0, presence_penalty=1.0, frequency_penalty=0.8, repetition_penalty=1.8, logprobs=3)
    sps = [greedy] * len(PROMPTS)
    sps[1] = SamplingParams(0.8, seed=11, min_p=0.05, repetition_penalty=1.2, logprobs=3)
    rows = [b for b in range(len(PROMPTS)) if b != 1]
    got = {}
    for setup in ["plain", "ngram", "draft", "cascade_ngram", "cascade_models"]:
        batch = generate(_shared_levels(models, setup, method), PROMPTS, max_tokens=12, sampling=sps,
                         ignore_eos=True)
        assert all(len(r.logprobs) == len(r.token_ids) == 12 for r in batch.results)
        assert setup in ("plain", "ngram") or batch.stats["t"].accepted_tokens > 0, setup
        got[setup] = [(batch.results[b].token_ids, batch.results[b].logprobs) for b in rows]
    for setup, out in got.items():
        for (toks, lps), (toks0, lps0) in zip(out, got["plain"]):
            assert toks == toks0, setup
            assert [[a for a, _ in lp.top] for lp in lps] == [[a for a, _ in lp.top] for lp in lps0], setup
            torch.testing.assert_close(torch.tensor([[lp.logprob, *(v for _, v in lp.top)] for lp in lps]),
                                       torch.tensor([[lp.logprob, *(v for _, v in lp.top)] for lp in lps0]),
                                       atol=1e-4, rtol=0)
    unpenalized = generate(_shared_levels(models, "plain", method), [PROMPTS[b] for b in rows], max_tokens=12,
                           ignore_eos=True)
    assert [r.token_ids for r in unpenalized.results] != [toks for toks, _ in got["plain"]]
    tok = models["t"].tokenizer
    for b, (toks, lps) in zip(rows, got["plain"]):
        ids = tok.encode(PROMPTS[b])
        want = torch.log_softmax(full_logits(ref, ids + toks)[len(ids) - 1 : -1], dim=-1)  # [12, V]
        torch.testing.assert_close(torch.tensor([lp.logprob for lp in lps]),
                                   want.gather(1, torch.tensor(toks).view(-1, 1))[:, 0], atol=1e-4, rtol=0)
        top = want.topk(3, dim=-1)
        assert [[a for a, _ in lp.top] for lp in lps] == top.indices.tolist()
