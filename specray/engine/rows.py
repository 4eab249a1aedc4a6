"""A `LogitsWorker`'s rows: the state it keeps per sequence, the forward it runs over them, and what it reads off
their logits besides the tokens (rows padded to one slot count, how sure a level was of each token, the raw
log-probabilities a request asked for, the history its penalties count).

Plain functions over `SeqState`, so the worker's general paths, its greedy fast paths (`specray.engine.greedy`)
and its token trees (`specray.engine.tree_rows`) share them without sharing a class.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from specray.spec.params import SamplingParams, TokenLogprob
from specray.spec.sampling import SamplingBatch, TokenHistory, on_device, raw_logprobs


@dataclass
class SeqState:
    slot: int
    tokens: list[int]
    kv_len: int = 0
    #: (prompt length, [V] bool: the tokens of the prompt), kept for the penalties (the prompt never changes)
    prompt_seen: tuple[int, torch.Tensor] | None = None
    #: (token_ids, parents) of the tree `score_tree` fed last, whose KV follows `tokens[:kv_len]`
    tree: tuple[tuple[int, ...], tuple[int, ...]] | None = None


class Forward(Protocol):
    """`LogitsWorker._forward`: the one thing a backend supplies (see there)."""

    def __call__(
        self,
        seqs: Sequence[SeqState],
        inputs: Sequence[Sequence[int]],
        keep: Sequence[int],
        parents: Sequence[Sequence[int]] | None = None,
    ) -> torch.Tensor: ...  # [sum(keep), V]


def commit(seqs: Sequence[SeqState], emitted: Sequence[Sequence[int]], num_accepted: Sequence[int]) -> None:
    """Append each row's emitted tokens (its accepted drafts and one correction/bonus token): the text up to
    the last one has valid KV (the drafts were fed), the last one is pending."""
    for s, toks, n in zip(seqs, emitted, num_accepted):
        s.kv_len = len(s.tokens) + n
        s.tokens.extend(toks)


def pad_rows(
    flat: torch.Tensor,  # [sum(keep), V] rows of each batch row, concatenated
    keep: Sequence[int],
) -> torch.Tensor:  # [B, max(keep), V], zeros past a row's own keep[b]
    """The rows of a ragged forward's logits padded to one slot count: a reshape when every row has the same
    count, else one scatter (not a copy per row)."""
    n = max(keep, default=0)
    if all(k == n for k in keep):
        return flat.reshape(len(keep), n, flat.shape[-1])
    out = flat.new_zeros(len(keep), n, flat.shape[-1])
    dest = [b * n + j for b, k in enumerate(keep) for j in range(k)]
    out.view(-1, flat.shape[-1])[torch.tensor(dest, dtype=torch.long, device=flat.device)] = flat
    return out


def token_confidence(
    logits: torch.Tensor,  # [N, V] raw logits
    p: torch.Tensor,  # [N, V] the processed distributions the tokens were drawn from (one-hot for greedy rows)
    tokens: torch.Tensor,  # [N] long
    sb: SamplingBatch,  # N rows
    normalized: bool = False,
) -> torch.Tensor:  # [N] float32
    """How sure a level was of each token: its probability under the row's sampling distribution, or for a
    greedy row (whose distribution is a one-hot) under the softmax of the raw logits. `normalized`: `logits` are
    already log-probabilities over the whole vocabulary (vLLM's raw logprobs, -inf outside the top-w it
    returned), so they are not normalised again."""
    idx = tokens.view(-1, 1)
    picked = logits.float().gather(1, idx)[:, 0]
    raw = torch.exp(picked if normalized else picked - torch.logsumexp(logits.float(), dim=-1))
    drawn = p.gather(1, idx)[:, 0]
    return torch.where(on_device(sb.temperature, raw.device) == 0, raw, drawn)


def emitted_confidence(
    logits: torch.Tensor,  # [B, n, V] raw logits; slot j predicts a row's j-th emitted token
    p: torch.Tensor,  # [B, n, V] the processed distributions at the same slots
    emitted: Sequence[Sequence[int]],  # B rows of 1..n tokens
    sb: SamplingBatch,  # B rows
    normalized: bool = False,
) -> list[list[float]]:
    """`token_confidence` of each row's emitted tokens, all rows in one call (a short row is padded with its
    last token, and the padding cut off again)."""
    bsz, n, v = logits.shape
    ids = torch.tensor([list(e) + [e[-1]] * (n - len(e)) for e in emitted], dtype=torch.long,
                       device=logits.device)  # [B, n]
    c = token_confidence(logits.reshape(-1, v), p.reshape(-1, p.shape[-1]), ids.reshape(-1),
                         sb.select([b for b in range(bsz) for _ in range(n)]), normalized)
    return [row[: len(e)] for row, e in zip(c.view(bsz, n).tolist(), emitted)]


def emitted_logprobs(
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


def penalty_history(seqs: Sequence[SeqState], sampling: Sequence[SamplingParams],
                    vocab_size: int) -> TokenHistory | None:
    """The tokens each row's penalties count (None when no row is penalized): a sequence's tokens past its
    prompt are output, whether committed or drafted by this level in this call. The prompt's mask is kept on
    the row (`SeqState.prompt_seen`)."""
    if not any(sp.penalized for sp in sampling):
        return None
    masks = []
    for s, sp in zip(seqs, sampling):
        n = min(sp.prompt_len, len(s.tokens))
        if s.prompt_seen is None or s.prompt_seen[0] != n:
            s.prompt_seen = (n, TokenHistory.seen_mask([s.tokens[:n]], vocab_size)[0])
        masks.append(s.prompt_seen[1])
    return TokenHistory.from_parts(torch.stack(masks), [s.tokens[s.prompt_seen[0] :] for s in seqs])
