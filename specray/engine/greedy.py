"""The workers' greedy fast paths: one argmax and one host read per forward, no distributions built.

A row that is greedy without penalties has a one-hot processed distribution at the argmax of its raw logits
(first index on ties, as `processed_probs` makes it), so every draft mode but random (which returns q) drafts
that token and every verification method accepts while the draft equals it. `LogitsWorker` takes these paths
when every row of a call is such a row (`plain_greedy`) and nothing else is asked of the call (logprobs,
confidence, returned distributions); the results equal the general paths' token for token, ties included.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specray.engine.rows import Forward, SeqState
from specray.spec.params import SamplingParams
from specray.spec.tree import ROOT, DraftTree


def plain_greedy(sampling: Sequence[SamplingParams], logprobs: bool = True) -> bool:
    """Whether every row is greedy without penalties (and, where they would be reported, without logprobs): its
    token is then the argmax of the raw logits (first index on ties, as `processed_probs` makes it), which the
    workers' fast paths compute alone."""
    return all(sp.greedy and not sp.penalized and (sp.logprobs is None or not logprobs) for sp in sampling)


def plain_tree(tree: DraftTree) -> bool:
    """Non-negative tokens and distinct siblings: the trees a greedy walk takes as they are (others go through
    `TreeBatch`, which rejects or handles them)."""
    pairs = set(zip(tree.parents, tree.token_ids))
    return len(pairs) == len(tree.token_ids) and all(t >= 0 for t in tree.token_ids)


def propose_greedy(forward: Forward, seqs: Sequence[SeqState], k: Sequence[int]) -> list[list[int]]:
    """`LogitsWorker.propose` of plain greedy rows: k[b] argmax tokens per row, each appended as a tentative
    token; one batched forward, one argmax and one read per step."""
    out: list[list[int]] = [[] for _ in seqs]
    for t in range(max(k, default=0)):
        rows = [b for b in range(len(seqs)) if k[b] > t]
        batch = [seqs[b] for b in rows]
        logits = forward(batch, [s.tokens[s.kv_len :] for s in batch], [1] * len(batch))  # [B_t, V]
        for b, s, tok in zip(rows, batch, logits.argmax(dim=-1).tolist()):
            s.kv_len = len(s.tokens)
            s.tokens.append(tok)
            out[b].append(tok)
    return out


def accept_greedy(
    drafts: Sequence[Sequence[int]],
    flat: torch.Tensor,  # [sum(len(d) + 1), V] raw logits of each row's draft slots, rows concatenated
) -> tuple[list[list[int]], list[int]]:
    """`LogitsWorker.verify` of plain greedy rows: accept while the draft equals the argmax, emit the argmax at
    the stop. Returns (emitted tokens, accepted count) per row."""
    y = flat.argmax(dim=-1).tolist()
    emitted: list[list[int]] = []
    n_acc: list[int] = []
    o = 0
    for d in drafts:
        n = 0
        while n < len(d) and d[n] == y[o + n]:
            n += 1
        emitted.append(y[o : o + n + 1])
        n_acc.append(n)
        o += len(d) + 1
    return emitted, n_acc


def walk_tree_greedy(
    trees: Sequence[DraftTree],
    logits: torch.Tensor,  # [B, N_max + 1, V] raw logits per slot
) -> tuple[list[list[int]], list[int]]:
    """`LogitsWorker.verify_tree` of plain greedy rows on `plain_tree` trees: follow the child whose token is
    the slot's argmax, emit the argmax where none is. Returns (path, final token) per row; the walk runs on the
    host."""
    y = logits.argmax(dim=-1).tolist()  # [B][N_max + 1]
    paths: list[list[int]] = []
    final: list[int] = []
    for yb, t in zip(y, trees):
        child = {(p, tok): i for i, (tok, p) in enumerate(zip(t.token_ids, t.parents))}
        path: list[int] = []
        slot = 0
        while (nxt := child.get((path[-1] if path else ROOT, yb[slot]))) is not None:
            path.append(nxt)
            slot = nxt + 1
        paths.append(path)
        final.append(yb[slot])
    return paths, final


def greedy_children(
    logits: torch.Tensor,  # [M, V] raw logits after each expanded parent
    width: int,
) -> tuple[list[list[int]], list[list[float]], list[list[bool]]]:
    """`draft_children` of plain greedy rows in every mode but random: a parent's top `width` raw logits, scored
    by their log-softmax (a child of probability 0 is unusable, except the first). Returns (tokens, scores,
    usable), [M][W] each."""
    top = torch.topk(logits, min(width, logits.shape[-1]), dim=-1).indices  # [M, W]
    kscore = torch.log_softmax(logits.double(), dim=-1).gather(1, top).tolist()
    usable = [[j == 0 or sc > float("-inf") for j, sc in enumerate(row)] for row in kscore]
    return top.tolist(), kscore, usable
