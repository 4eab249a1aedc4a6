"""Verification and sampled proposals by prompt scoring for the `vllm` backend.

How the distributions are obtained
----------------------------------
The engine runs with ``logprobs_mode="raw_logprobs"``: every logprob it returns is ``log_softmax`` of the
raw logits, before temperature or filters. For prompt positions that is true of every mode (vLLM's prompt
tokens never go through the sampling processors), so ``processed_logprobs`` would not help for scoring.

* verify: the sequence plus its draft is one prompt scored with ``prompt_logprobs=w`` (the top-w raw
  logprobs at every draft slot, plus the drafted token's own), and one greedy token is generated with
  ``logprobs=w`` for the bonus slot. vLLM turns the prompt logprobs of *every* prompt position into Python
  lists, so rows wider than `prompt_logprobs_max_width` (64) are scored instead with one 1-token generation
  request per slot (``prompt[:n+j]``, ``logprobs=w``), all in the same engine call.
* propose (greedy): one temperature-0 generation of k tokens. propose (random / coupled): k steps of one
  generated token with ``logprobs=w``, each sampled here with the keyed noise of `specray.spec.noise`.

From the top-w raw logprobs we rebuild the *processed* distribution exactly (the filtered-out tokens get
-inf, which is what top-k/top-p do anyway) and hand it to `specray.spec.verify`, the code the hf backend
uses. Raw logprobs are the logits shifted by a per-row constant, so temperature, top-k, top-p and softmax
give the same distribution as on the logits (to fp32 round-off). The width w per row:

* temperature 0: w = 1 (the argmax);
* temperature > 0 with top_k = k > 0: w = k + 1 -- the k kept tokens plus one to see whether the k-th is
  tied with the next (`processed_probs` keeps every tied token); on a tie w grows until the tie ends;
* temperature > 0 with top_k = 0: w = the whole vocabulary (``-1``), because the temperature-scaled
  normaliser and the top-p cut depend on every logit. Exact but slow for large vocabularies (the engine
  turns ``V`` floats per slot into Python lists: ~0.6 s per slot at V = 151,936 on this CPU);
  ``full_vocab_logprobs=False`` refuses such rows instead.

So every method (greedy, deterministic, rejection, coupled) and every (temperature, top_k, top_p) is exact,
and bit-compatible in its noise with the hf backend: the same keyed streams draw the same tokens from the
same distributions (up to the backends' logit round-off). Nothing is approximated: where the support
cannot be had (``full_vocab_logprobs=False``), the call fails with `UnsupportedSamplingError`.

Prefix caching and prompt logprobs: vLLM skips reading the prefix cache for prompt-logprob requests unless
told otherwise; we tell it otherwise and check `num_cached_tokens` -- prompt logprobs only exist for
positions the engine recomputed. A row whose draft slots fell inside a cache hit (a block identical to an
earlier sequence's) is scored again with the cache read disabled.

`PromptScoring` is a mixin of `specray.engine.vllm.VLLMWorker`, which provides ``_generate`` and ``_params``
(engine requests run to completion through the worker's step loop) and sets ``vocab_size``,
``full_vocab_logprobs``, ``prompt_logprobs_max_width`` and the counter ``rescored_rows``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from specray.engine.protocol import VerifyResult
from specray.engine.rows import emitted_confidence
from specray.spec.params import PLACEHOLDER_TOKEN_ID, SamplingParams, VerifyMethod
from specray.spec.sampling import SamplingBatch, processed_probs
from specray.spec.verify import verify as verify_batch

__all__ = ["FULL", "PromptScoring", "UnsupportedSamplingError"]

#: prompt_logprobs / logprobs value meaning "the whole vocabulary"
FULL = -1


class UnsupportedSamplingError(NotImplementedError):
    """The requested (method, sampling parameters) cannot be served exactly by this vLLM worker."""


class PromptScoring:
    """The prompt-scoring half of `VLLMWorker` (module docstring)."""

    name: str
    vocab_size: int

    def _width(self, sp: SamplingParams) -> int:
        """Top-w raw logprobs needed to rebuild the processed distribution of a row exactly."""
        if sp.temperature == 0:
            return 1
        if 0 < sp.top_k < self.vocab_size - 1:
            return sp.top_k + 1
        if not self.full_vocab_logprobs:
            raise UnsupportedSamplingError(
                f"{self.name}: temperature {sp.temperature} with top_k={sp.top_k} needs the full distribution "
                "(every logit sets the normaliser and the top-p cut), and full_vocab_logprobs is off. Set "
                "top_k > 0, temperature 0, or enable full_vocab_logprobs (exact, slower for large vocabularies)."
            )
        return FULL

    @staticmethod
    def _slots(flat, start: int, count: int):
        """(token ids, raw logprobs) of `count` consecutive positions of a FlatLogprobs, from `start`.

        Each position holds the scored token first, then the top-w tokens in rank order."""
        for i in range(start, start + count):
            a, b = flat.start_indices[i], flat.end_indices[i]
            yield flat.token_ids[a:b], flat.logprobs[a:b]

    def _complete(self, lps: list[float], sp: SamplingParams) -> bool:
        """Whether a top-w list (descending) shows the whole top-k support: every token tied with the k-th is
        in it, which holds when its last value is strictly below the k-th."""
        if sp.temperature == 0 or len(lps) >= self.vocab_size:
            return True
        return lps[sp.top_k - 1] > lps[-1]

    def _jobs(self, b: int, n: int, m: int, w: int) -> list[tuple[int, int, int, int]]:
        """Engine requests scoring row b's last m prompt slots and the next position, as
        (row, first slot, prompt length, prompt slots scored). Narrow rows: one request with prompt logprobs.
        Wide rows: one generation request per slot, because vLLM turns prompt logprobs of *every* prompt
        position into Python lists (prompt length x w values)."""
        if m == 0 or (w != FULL and w <= self.prompt_logprobs_max_width):
            return [(b, 0, n, m)]
        return [(b, j, n - m + j, 0) for j in range(m + 1)]

    def _score(
        self, prompts: list[list[int]], n_score: list[int], sampling: Sequence[SamplingParams]
    ) -> list[list[tuple[list[int], list[float]]]]:
        """For each row: (ids, raw logprobs) of the top-w tokens at its last n_score[b] prompt slots and at the
        next position. Rescores rows whose slots were served from the prefix cache or whose cut was tied."""
        widths = [self._width(sp) for sp in sampling]
        read = [True] * len(prompts)
        result: list[list[Any]] = [[None] * (m + 1) for m in n_score]
        jobs = [j for b, p in enumerate(prompts) for j in self._jobs(b, len(p), n_score[b], widths[b])]
        while jobs:
            outs = self._generate(
                [prompts[b][:n] for b, _, n, _ in jobs],
                [self._params(max_tokens=1, logprobs=widths[b], read_cache=read[b],
                              prompt_logprobs=widths[b] if m else None) for b, _, _, m in jobs],
            )
            again: list[tuple[int, int, int, int]] = []
            redo: set[int] = set()
            for (b, j0, n, m), out in zip(jobs, outs):
                if m and (out.num_cached_tokens or 0) > n - m - 1:
                    # prompt logprobs exist only for recomputed positions: score again without the cache
                    read[b] = False
                    self.rescored_rows += 1
                    again.append((b, j0, n, m))
                    continue
                slots = list(self._slots(out.prompt_logprobs, n - m, m)) if m else []
                slots += list(self._slots(out.outputs[0].logprobs, 0, 1))
                if not all(self._complete(lps[1:], sampling[b]) for _, lps in slots):
                    redo.add(b)  # a tie at the top-k cut runs past w: widen the whole row
                    continue
                for j, (ids, lps) in enumerate(slots):
                    result[b][j0 + j] = (ids[1:], lps[1:])
            for b in redo:
                widths[b] = FULL if widths[b] * 4 >= self.vocab_size else widths[b] * 4
                again = [j for j in again if j[0] != b] + self._jobs(b, len(prompts[b]), n_score[b], widths[b])
            jobs = again
        return result

    def _dense(self, slots: list[list[tuple[list[int], list[float]]]], width: int) -> torch.Tensor:
        """[B, width, V] raw logprobs with -inf outside the returned top-w tokens."""
        x = torch.full((len(slots), width, self.vocab_size), float("-inf"), dtype=torch.float32)
        bi: list[int] = []
        si: list[int] = []
        ti: list[int] = []
        vals: list[float] = []
        for b, row in enumerate(slots):
            for j, (ids, lps) in enumerate(row):
                bi.extend([b] * len(ids))
                si.extend([j] * len(ids))
                ti.extend(ids)
                vals.extend(lps)
        if ti:
            x[torch.tensor(bi), torch.tensor(si), torch.tensor(ti)] = torch.tensor(vals, dtype=torch.float32)
        return x

    def _verify_scored(
        self,
        seqs: list[list[int]],
        draft_ids: Sequence[Sequence[int]],
        draft_probs: torch.Tensor | None,
        sampling: Sequence[SamplingParams],
        method: VerifyMethod,
        salt: int,
        return_probs: bool,
        confidence: bool = False,
    ) -> VerifyResult:
        """Verification by prompt scoring of rows whose text is `seqs` (extended in place); `confidence`: also
        each emitted token's probability (`specray.engine.rows.token_confidence`)."""
        kmax = max((len(d) for d in draft_ids), default=0)
        slots = self._score([s + [int(t) for t in d] for s, d in zip(seqs, draft_ids)],
                            [len(d) for d in draft_ids], sampling)
        # row b has len(d)+1 slots; pad to K+1 with the bonus slot's values (masked by the draft padding)
        raw = self._dense([row + [row[-1]] * (kmax + 1 - len(row)) for row in slots], kmax + 1)
        draft = torch.full((len(seqs), kmax), PLACEHOLDER_TOKEN_ID, dtype=torch.long)
        for b, d in enumerate(draft_ids):
            if d:
                draft[b, : len(d)] = torch.tensor(list(d), dtype=torch.long)
        sb = SamplingBatch.from_params(sampling)
        p = processed_probs(raw, sb)  # [B, K+1, V]
        positions = torch.tensor([len(s) for s in seqs], dtype=torch.long)
        q = None
        if method == VerifyMethod.REJECTION:
            if draft_probs is None and kmax > 0:
                raise ValueError(f"{self.name}: rejection verification needs the drafter's probabilities")
            q = p.new_zeros(len(seqs), 0, p.shape[-1]) if kmax == 0 else draft_probs[:, :kmax].to(torch.float32)
        res = verify_batch(method, p, draft, q, sb, positions, salt)
        out_ids, n_acc = res.output_ids.tolist(), [int(n) for n in res.num_accepted.tolist()]
        emitted: list[list[int]] = []
        for b, s in enumerate(seqs):
            toks = [int(t) for t in out_ids[b][: n_acc[b] + 1]]
            s.extend(toks)
            emitted.append(toks)
        n = max(len(e) for e in emitted)
        out_probs = p[:, :n].clone() if return_probs else None
        conf = emitted_confidence(raw[:, :n], p[:, :n], emitted, sb, normalized=True) if confidence else None
        return VerifyResult(emitted, n_acc, out_probs, confidence=conf)

