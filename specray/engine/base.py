"""Backend-independent half of a logits-producing worker: sequence state, sync, propose and verify.

A backend supplies one thing, a ragged batched forward (`_forward`), plus where its KV length lives.
The HF backend and the test fake both derive from this, so the protocol logic is written (and tested)
once.

Invariant per sequence: `tokens` is the worker's copy of the text; KV is valid for `tokens[:kv_len]`,
and at least one token is pending (the last one), because its logits predict the next position.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specray.engine.protocol import DraftMode, DraftProposal, SeqSync, VerifyResult, WorkerCaps, WorkerStats
from specray.spec.params import PLACEHOLDER_TOKEN_ID, SamplingParams, TokenLogprob, VerifyMethod
from specray.spec.sampling import (
    SamplingBatch,
    TokenHistory,
    apply_penalties,
    processed_probs,
    raw_logprobs,
    sample_tokens,
)
from specray.spec.verify import verify as verify_batch


@dataclass
class SeqState:
    slot: int
    tokens: list[int]
    kv_len: int = 0
    #: (prompt length, [V] bool: the tokens of the prompt), kept for the penalties (the prompt never changes)
    prompt_seen: tuple[int, torch.Tensor] | None = None


def token_confidence(
    logits: torch.Tensor,  # [N, V] raw logits
    p: torch.Tensor,  # [N, V] the processed distributions the tokens were drawn from (one-hot for greedy rows)
    tokens: torch.Tensor,  # [N] long
    sb: SamplingBatch,  # N rows
) -> torch.Tensor:  # [N] float32
    """How sure a level was of each token: its probability under the row's sampling distribution, or for a
    greedy row (whose distribution is a one-hot) under the softmax of the raw logits."""
    idx = tokens.view(-1, 1)
    raw = torch.exp(logits.float().gather(1, idx)[:, 0] - torch.logsumexp(logits.float(), dim=-1))
    drawn = p.gather(1, idx)[:, 0]
    return torch.where(sb.temperature.to(raw.device) == 0, raw, drawn)


class LogitsWorker(abc.ABC):
    """Implements the worker protocol on top of `_forward`; see `specray.engine.protocol.Worker`."""

    name: str
    vocab_size: int
    max_context: int
    eos_token_ids: tuple[int, ...] = ()
    #: declared abilities (`WorkerCaps`); a backend or test double that has them sets these
    native_k: int = 0
    live_decode: bool = False
    engine_verify: int = 0
    #: pending spans longer than this are prefilled alone, so a batched decode step stays short
    prefill_threshold: int = 8
    prefill_chunk: int = 512

    def __init__(self) -> None:
        self._seqs: dict[str, SeqState] = {}

    # ----- backend hooks ------------------------------------------------------------------------
    @abc.abstractmethod
    def _forward(self, seqs: Sequence[SeqState], inputs: Sequence[Sequence[int]], keep: Sequence[int]) -> torch.Tensor:
        """Feed inputs[b] at positions kv_len.. of each row; return logits [sum(keep), V] of the last keep[b]
        inputs of each row, rows concatenated. Must not change kv_len (the caller decides what is valid)."""

    def _allocate(self) -> int:
        return -1

    def _release(self, slot: int) -> None:
        return None

    def _cache_bytes(self) -> int:
        return 0

    def capabilities(self) -> WorkerCaps:
        return WorkerCaps(self.name, int(self.vocab_size), self.max_context, tuple(int(t) for t in self.eos_token_ids),
                          native_k=int(self.native_k), live_decode=bool(self.live_decode),
                          engine_verify=int(self.engine_verify), draft_confidence=True, penalties=True,
                          logprobs=True)

    # ----- sequence state -----------------------------------------------------------------------
    def add(self, seq_id: str, prompt_ids: Sequence[int]) -> None:
        if seq_id in self._seqs:
            raise ValueError(f"{self.name}: sequence {seq_id!r} already exists")
        if not prompt_ids:
            raise ValueError(f"{self.name}: sequence {seq_id!r} has an empty prompt")
        if len(prompt_ids) >= self.max_context:
            raise ValueError(f"{self.name}: prompt of {len(prompt_ids)} tokens exceeds the context {self.max_context}")
        self._seqs[seq_id] = SeqState(self._allocate(), list(prompt_ids))

    def free(self, seq_id: str) -> None:
        seq = self._seqs.pop(seq_id, None)
        if seq is not None:
            self._release(seq.slot)

    def rollback(self, seq_id: str, length: int) -> None:
        self._apply_sync(self._get(seq_id), SeqSync(length))

    def tokens(self, seq_id: str) -> list[int]:
        return list(self._get(seq_id).tokens)

    def stats(self) -> WorkerStats:
        return WorkerStats(
            live_sequences=len(self._seqs),
            cached_tokens=sum(s.kv_len for s in self._seqs.values()),
            cache_bytes=self._cache_bytes(),
        )

    def _get(self, seq_id: str) -> SeqState:
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise KeyError(f"{self.name}: unknown sequence {seq_id!r}") from None

    def _apply_sync(self, seq: SeqState, sync: SeqSync | None) -> None:
        if sync is None:
            return
        if not 0 < sync.keep <= len(seq.tokens):
            raise ValueError(f"{self.name}: cannot keep {sync.keep} of {len(seq.tokens)} tokens")
        del seq.tokens[sync.keep :]
        if seq.prompt_seen is not None and sync.keep < seq.prompt_seen[0]:
            seq.prompt_seen = None  # the prompt itself changed (never from the coordinator): recount it
        seq.tokens.extend(sync.append)
        seq.kv_len = min(seq.kv_len, sync.keep)  # rollback: a length, no copy

    def _prepare(self, seq_ids: Sequence[str], sync: Sequence[SeqSync | None] | None) -> list[SeqState]:
        if sync is not None:
            if len(sync) != len(seq_ids):
                raise ValueError("sync must be aligned with seq_ids")
            for sid, sy in zip(seq_ids, sync):
                if sy is not None and sy.keep == 0:  # (re)start the sequence with this prompt
                    self.free(sid)
                    self.add(sid, sy.append)
        seqs = [self._get(s) for s in seq_ids]
        if sync is not None:
            for seq, sy in zip(seqs, sync):
                if sy is not None and sy.keep > 0:
                    self._apply_sync(seq, sy)
        for seq in seqs:
            seq.kv_len = min(seq.kv_len, len(seq.tokens) - 1)  # keep one pending token
            while len(seq.tokens) - seq.kv_len > self.prefill_threshold:
                start = seq.kv_len
                chunk = seq.tokens[start : min(len(seq.tokens) - 1, start + self.prefill_chunk)]
                self._forward([seq], [chunk], [1])
                seq.kv_len = start + len(chunk)
        return seqs

    # ----- protocol: propose / verify -----------------------------------------------------------
    def propose(
        self,
        seq_ids: Sequence[str],
        k: Sequence[int],
        sampling: Sequence[SamplingParams],
        mode: str = DraftMode.GREEDY,
        level: int = 0,
        sync: Sequence[SeqSync | None] | None = None,
        stop_below: float = 0.0,
    ) -> DraftProposal:
        """Draft k[b] tokens per sequence, one batched forward per step; keep them as tentative tokens (a row
        stops early after a token it gave less than `stop_below`)."""
        seqs = self._prepare(seq_ids, sync)
        sb_all = SamplingBatch.from_params(sampling)
        kmax = max(k, default=0)
        out: list[list[int]] = [[] for _ in seqs]
        stopped = [False] * len(seqs)
        probs = None
        if mode == DraftMode.RANDOM and kmax > 0:
            probs = torch.zeros(len(seqs), kmax, self.vocab_size, dtype=torch.float32)
        history = self._history(seqs, sampling, sb_all) if kmax > 0 else None
        for t in range(kmax):
            rows = [b for b in range(len(seqs)) if k[b] > t and not stopped[b]]
            if not rows:
                break
            batch = [seqs[b] for b in rows]
            logits = self._forward(batch, [s.tokens[s.kv_len :] for s in batch], [1] * len(batch))  # [B_t, V]
            sb = sb_all.select(rows)
            hist = history.select(rows) if history is not None else None
            p = processed_probs(apply_penalties(logits[:, None, :], sb, hist), sb)[:, 0]  # [B_t, V]
            positions = torch.tensor([len(s.tokens) for s in batch], dtype=torch.long)
            sampled = sample_tokens(p, sb, positions, mode, level)  # [B_t]
            if history is not None:
                history.add(rows, sampled)
            conf = token_confidence(logits, p, sampled, sb).tolist() if stop_below > 0 else None
            toks = sampled.tolist()
            for i, (b, s) in enumerate(zip(rows, batch)):
                s.kv_len = len(s.tokens)
                s.tokens.append(int(toks[i]))
                out[b].append(int(toks[i]))
                if probs is not None:
                    probs[b, t] = p[i]
                if conf is not None and conf[i] < stop_below:
                    stopped[b] = True
        return DraftProposal(out, probs)

    def verify(
        self,
        seq_ids: Sequence[str],
        draft_ids: Sequence[Sequence[int]],
        draft_probs: torch.Tensor | None,
        sampling: Sequence[SamplingParams],
        method: VerifyMethod,
        level: int = 0,
        sync: Sequence[SeqSync | None] | None = None,
        return_probs: bool = False,
        confidence: bool = False,
    ) -> VerifyResult:
        """Score every draft in one forward, accept a prefix, append it and one correction/bonus token."""
        method = VerifyMethod(method)
        seqs = self._prepare(seq_ids, sync)
        kmax = max((len(d) for d in draft_ids), default=0)
        inputs = [s.tokens[s.kv_len :] + list(d) for s, d in zip(seqs, draft_ids)]
        keep = [len(d) + 1 for d in draft_ids]
        flat = self._forward(seqs, inputs, keep)  # [sum(keep), V]
        logits = flat.new_zeros(len(seqs), kmax + 1, flat.shape[-1])  # [B, K+1, V]
        draft = torch.full((len(seqs), kmax), PLACEHOLDER_TOKEN_ID, dtype=torch.long)  # [B, K]
        o = 0
        for b, (d, n) in enumerate(zip(draft_ids, keep)):
            logits[b, :n] = flat[o : o + n]
            o += n
            if d:
                draft[b, : len(d)] = torch.tensor(list(d), dtype=torch.long)
        sb = SamplingBatch.from_params(sampling)
        p = processed_probs(apply_penalties(logits, sb, self._history(seqs, sampling, sb), draft), sb)  # [B, K+1, V]
        positions = torch.tensor([len(s.tokens) for s in seqs], dtype=torch.long)
        q = None
        if method == VerifyMethod.REJECTION:
            if draft_probs is None and kmax > 0:
                raise ValueError(f"{self.name}: rejection verification needs the drafter's probabilities")
            q = p.new_zeros(len(seqs), 0, p.shape[-1]) if kmax == 0 else draft_probs[:, :kmax].to(torch.float32)
        res = verify_batch(method, p, draft, q, sb, positions, level)
        out_ids, n_acc = res.output_ids.tolist(), [int(n) for n in res.num_accepted.tolist()]
        emitted: list[list[int]] = []
        for b, s in enumerate(seqs):
            toks = [int(t) for t in out_ids[b][: n_acc[b] + 1]]
            s.kv_len = len(s.tokens) + n_acc[b]  # prefix and accepted drafts have valid KV
            s.tokens.extend(toks)
            emitted.append(toks)
        out_probs = p[:, : max(len(e) for e in emitted)].clone() if return_probs else None
        conf = None
        if confidence:
            n = max(len(e) for e in emitted)
            ids = torch.tensor([e + [e[-1]] * (n - len(e)) for e in emitted], dtype=torch.long)  # [B, n]
            c = token_confidence(logits[:, :n].reshape(-1, logits.shape[-1]), p[:, :n].reshape(-1, p.shape[-1]),
                                 ids.reshape(-1), sb.select([b for b in range(len(seqs)) for _ in range(n)]))
            c = c.view(len(seqs), n).tolist()
            conf = [row[: len(e)] for row, e in zip(c, emitted)]
        return VerifyResult(emitted, n_acc, out_probs, confidence=conf,
                            logprobs=_logprobs(logits, emitted, sampling))

    def _history(self, seqs: Sequence[SeqState], sampling: Sequence[SamplingParams],
                 sb: SamplingBatch) -> TokenHistory | None:
        """The tokens each row's penalties count (None when no row is penalized): a sequence's tokens past its
        prompt are output, whether committed or drafted by this level in this call."""
        if not sb.penalized:
            return None
        masks = []
        for s, sp in zip(seqs, sampling):
            n = min(sp.prompt_len, len(s.tokens))
            if s.prompt_seen is None or s.prompt_seen[0] != n:
                s.prompt_seen = (n, TokenHistory.seen_mask([s.tokens[:n]], self.vocab_size)[0])
            masks.append(s.prompt_seen[1])
        return TokenHistory.from_parts(torch.stack(masks), [s.tokens[s.prompt_seen[0] :] for s in seqs])


def _logprobs(
    logits: torch.Tensor,  # [B, K+1, V] raw logits; slot j predicts a row's j-th emitted token
    emitted: list[list[int]],
    sampling: Sequence[SamplingParams],
) -> list[list[TokenLogprob]] | None:
    """Raw log-probabilities of the emitted tokens (and the asked-for alternatives) of the rows that ask."""
    rows = [b for b, sp in enumerate(sampling) if sp.logprobs is not None]
    if not rows:
        return None
    top = max(sampling[b].logprobs or 0 for b in rows)
    flat = torch.cat([logits[b, : len(emitted[b])] for b in rows])  # [N, V]
    toks = torch.tensor([t for b in rows for t in emitted[b]], dtype=torch.long)
    chosen, ids, vals = raw_logprobs(flat, toks, top)
    chosen, ids, vals = chosen.tolist(), ids.tolist(), vals.tolist()
    out: list[list[TokenLogprob]] = [[] for _ in sampling]
    i = 0
    for b in rows:
        n = sampling[b].logprobs or 0
        for _ in emitted[b]:
            out[b].append(TokenLogprob(chosen[i], tuple(zip(ids[i][:n], vals[i][:n]))))
            i += 1
    return out
