"""Verifying token trees (`specray.spec.tree` has the layout): every row's tree in one batched walk, emitting the
accepted path plus one correction/bonus token, exactly as plain decoding would.

Methods (see `verify_tree`; all reduce to `verify.verify` on a chain, noise included)
------------------------------------------------------------------------------------
GREEDY / COUPLED walk from the root, moving to the child whose token is the verifier's own token y at that
slot (argmax, or the keyed Gumbel argmax of the slot's absolute position); the first slot without such a child
emits y. Every emitted token is therefore exactly the one plain (greedy / coupled) decoding emits.

DETERMINISTIC and REJECTION try the children of the current node one after the other ("multi-round" speculative
sampling, SpecInfer). Round r targets p_r (p_1 = the slot's p) with proposal q_r: the child is accepted with
probability min(1, p_r(x) / q_r(x)); on rejection p_(r+1) = normalize(max(p_r - q_r, 0)); when every child is
rejected the final token is drawn from the last residual. Each round is one step of ordinary rejection sampling
*targeting p_r*, so its output (the accepted child, or a draw from p_(r+1) standing for "continue") is
distributed as p_r, provided the proposed token is independent of the earlier rounds' coins:

    P(emit y) = q_r(y) min(1, p_r(y) / q_r(y)) + P(reject) p_(r+1)(y)
              = min(q_r(y), p_r(y)) + sum_z max(p_r(z) - q_r(z), 0) * max(p_r(y) - q_r(y), 0) / sum_z (...)
              = p_r(y).

By induction from the last round back to the first, the token emitted at a node's slot has law p_1 = p.
- DETERMINISTIC: q_r = delta of the r-th child (distinct tokens, chosen without looking at the verifier's
  noise): accept with p_r(x); the residual is p_r without x, renormalised.
- REJECTION: the children were drawn i.i.d. from q (the drafter's distribution at that node; they may repeat),
  so q_r = q for every round and the r-th draw is independent of the rounds before it.
The accepted child's subtree was drafted from that child's context, and its slot holds the target's conditional
distribution given the path, so by induction on depth the emitted sequence follows the target's law exactly.

Noise: the r-th child of a node at depth d uses index r of keyed_uniform(seed, positions + d, accept_stream(salt))
and the final draw index 0 of residual_stream(salt) at the final slot's position, so index 0 is exactly what
chain verification uses, and a walk (which visits one node per depth) never uses a number twice.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specray.spec.noise import accept_stream, coupled_argmax, inverse_cdf_sample, keyed_uniform, residual_stream
from specray.spec.params import PLACEHOLDER_TOKEN_ID, VerifyMethod
from specray.spec.sampling import SamplingBatch, TokenHistory, apply_penalties, processed_probs
from specray.spec.tree import DraftTree, TreeBatch, pad_trees
from specray.spec.verify import RESIDUAL_EPS, VerifyOutput

__all__ = ["TreeVerifyOutput", "tree_penalized_logits", "verify_tree", "verify_tree_logits"]


@dataclass
class TreeVerifyOutput(VerifyOutput):
    """`VerifyOutput` (emitted tokens, accepted count) plus the accepted nodes."""

    path: torch.Tensor  # [B, N] int64: accepted node indices root -> leaf, then -1

    @property
    def final_token(self) -> torch.Tensor:  # [B] int64: the correction/bonus token
        return self.output_ids.gather(1, self.num_accepted.unsqueeze(-1)).squeeze(-1)

    def path_lists(self) -> list[list[int]]:
        return [row[:n] for row, n in zip(self.path.tolist(), self.num_accepted.tolist())]


def _assemble(batch: TreeBatch, path: torch.Tensor, num_accepted: torch.Tensor, final: torch.Tensor
              ) -> TreeVerifyOutput:
    bsz, n = path.shape
    tok = torch.where(path >= 0, batch.token_ids.gather(1, path.clamp(min=0)), PLACEHOLDER_TOKEN_ID)
    out = torch.cat([tok, tok.new_full((bsz, 1), PLACEHOLDER_TOKEN_ID)], dim=1)
    out.scatter_(1, num_accepted.unsqueeze(-1), final.unsqueeze(-1))
    return TreeVerifyOutput(output_ids=out, num_accepted=num_accepted, path=path)


def _walk_matching(y: torch.Tensor, batch: TreeBatch) -> TreeVerifyOutput:  # y [B, N + 1]
    """Follow the child whose token is the verifier's own token y of the slot; emit y where there is none."""
    bsz, slots = y.shape
    kids = batch.children  # [B, S, W]
    kid_tok = batch.token_ids.gather(1, kids.clamp(min=0).view(bsz, -1)).view(kids.shape)
    match = (kid_tok == y.unsqueeze(-1)) & (kids >= 0)
    nxt = torch.full_like(y, -1)  # [B, S]: the child to move to from each slot
    if kids.shape[2]:
        first = match.to(torch.int64).argmax(dim=-1, keepdim=True)  # first matching child (siblings distinct)
        nxt = torch.where(match.any(dim=-1), kids.gather(2, first).squeeze(-1), nxt)
    rows = torch.arange(bsz, device=y.device)
    slot = torch.zeros(bsz, dtype=torch.int64, device=y.device)
    path = torch.full((bsz, slots - 1), -1, dtype=torch.int64, device=y.device)
    n = torch.zeros_like(slot)
    for _ in range(batch.max_depth):
        c = nxt[rows, slot]
        move = c >= 0
        if not bool(move.any()):
            break
        path[rows[move], n[move]] = c[move]
        slot = torch.where(move, c + 1, slot)
        n = n + move.to(torch.int64)
    return _assemble(batch, path, n, y[rows, slot])


def _walk_sampled(
    target_probs: torch.Tensor,  # [B, N + 1, V]
    batch: TreeBatch,
    draft_probs: torch.Tensor | None,  # [B, >= N, V] REJECTION, None for DETERMINISTIC
    seed: torch.Tensor,  # [B]
    positions: torch.Tensor,  # [B]
    salt: int,
) -> TreeVerifyOutput:
    """Multi-round speculative sampling down the tree (module docstring), all rows at once.

    Per depth, the children of each row's current node are tried in order with the j-th keyed uniform; p_r is
    kept normalised in float64 (the first round uses the slot's p as is, exactly as chain verification does),
    and the final token is drawn from the last *unnormalised* residual (or the slot's p when nothing was
    rejected), again as chain verification does.
    """
    bsz, slots, vocab = target_probs.shape
    dev = target_probs.device
    rows = torch.arange(bsz, device=dev)
    width = batch.width
    slot = torch.zeros(bsz, dtype=torch.int64, device=dev)
    n = torch.zeros_like(slot)  # accepted so far = depth of the current slot
    active = torch.ones(bsz, dtype=torch.bool, device=dev)
    path = torch.full((bsz, slots - 1), -1, dtype=torch.int64, device=dev)
    final_w = torch.zeros(bsz, vocab, dtype=torch.float64, device=dev)
    final_n = torch.zeros_like(slot)
    for _ in range(batch.max_depth + 1):
        p = target_probs[rows, slot].double()  # [B, V] p_r
        w = p  # what the final token is drawn from if the row stops here
        chosen = torch.full_like(slot, -1)
        if width:
            kids = batch.children[rows, slot]  # [B, W]
            u = keyed_uniform(seed, positions + n, accept_stream(salt), width).double()  # [B, W]
            x_all = batch.token_ids.gather(1, kids.clamp(min=0)).clamp(min=0)  # [B, W]; padding masked by `has`
            if draft_probs is not None:
                q = draft_probs[rows, slot.clamp(max=draft_probs.shape[1] - 1)].double()  # [B, V]
            trying = active.clone()
            for j in range(width):
                has = trying & (kids[:, j] >= 0)
                if not bool(has.any()):
                    break
                x = x_all[:, j : j + 1]
                p_x = p.gather(1, x).squeeze(-1)
                if draft_probs is None:  # q_r = delta_x: accept w.p. p_r(x); residual p_r without x
                    accept = u[:, j] < p_x
                    residual = p.scatter(1, x, 0.0)
                else:  # accept w.p. min(1, p_r(x) / q(x)); residual max(p_r - q, 0)
                    accept = u[:, j] * q.gather(1, x).squeeze(-1) < p_x
                    residual = (p - q).clamp(min=0.0)
                chosen = torch.where(has & accept, kids[:, j], chosen)
                rejected = has & ~accept
                mass = residual.cumsum(dim=-1)[:, -1:]
                ok = (rejected & (mass.squeeze(-1) > RESIDUAL_EPS)).unsqueeze(-1)
                w = torch.where(ok, residual, torch.where(rejected.unsqueeze(-1), p, w))
                p = torch.where(ok, residual / mass, p)
                trying &= ~(has & accept)
        stop = active & (chosen < 0)
        final_w = torch.where(stop.unsqueeze(-1), w, final_w)
        final_n = torch.where(stop, n, final_n)
        move = active & (chosen >= 0)
        if not bool(move.any()):
            break
        path[rows[move], n[move]] = chosen[move]
        slot = torch.where(move, chosen + 1, slot)
        n = n + move.to(torch.int64)
        active = move
    u_final = keyed_uniform(seed, positions + final_n, residual_stream(salt), 1)[:, 0]
    return _assemble(batch, path, final_n, inverse_cdf_sample(final_w, u_final))


def verify_tree(
    method: VerifyMethod,
    target_probs: torch.Tensor,  # [B, N + 1, V] processed probs; slot 0 after the root, slot i + 1 after node i
    trees: Sequence[DraftTree] | TreeBatch,
    draft_probs: torch.Tensor | None,  # [B, N + 1, V] or [B, N, V]: q each slot's children were drawn from
    sb: SamplingBatch,
    positions: torch.Tensor,  # [B] int64 absolute position of the root's children (slot 0's token)
    salt: int,
) -> TreeVerifyOutput:
    """Verify a ragged batch of draft trees (module docstring); a chain gives exactly `verify.verify`'s result.

    GREEDY:        follow the child equal to argmax p; emit argmax at the stop.
    COUPLED:       follow the child equal to argmax(log p + g(seed, position)); the output for a seed is what
                   plain coupled sampling emits, whatever the tree.
    DETERMINISTIC: children are deterministic drafts (distinct tokens): try them in order, accept child x with
                   p'(x), p' = p without the rejected siblings, renormalised; all rejected: sample p'.
    REJECTION:     children are i.i.d. draws from q = draft_probs at their parent's slot (they may repeat):
                   accept with min(1, p'(x) / q(x)), on rejection p' <- normalize(max(p' - q, 0)); all
                   rejected: sample the last residual.
    Rows with temperature 0 have one-hot p and so are verified greedily by every method. The last slot of
    draft_probs (after node N - 1, which never has children) is never read, so [B, N, V] also works.
    """
    method = VerifyMethod(method)
    if target_probs.dim() != 3:
        raise ValueError(f"target_probs must be [B, N+1, V], got shape {tuple(target_probs.shape)}")
    bsz, slots, vocab = target_probs.shape
    dev = target_probs.device
    if isinstance(trees, TreeBatch):
        batch = trees
    else:
        if len(trees) != bsz:
            raise ValueError(f"got {len(trees)} trees for {bsz} rows of target_probs")
        batch = pad_trees(trees, max_nodes=slots - 1, device=dev)
    if len(batch) != bsz or batch.max_nodes + 1 != slots:
        raise ValueError(
            f"target_probs must be [B, N+1, V] = {(len(batch), batch.max_nodes + 1, vocab)} for these trees, "
            f"got {tuple(target_probs.shape)}"
        )
    if len(sb) != bsz or positions.shape != (bsz,):
        raise ValueError(
            f"SamplingBatch ({len(sb)} rows) and positions {tuple(positions.shape)} must have B={bsz}"
        )
    if method != VerifyMethod.REJECTION and bool(batch.repeated_siblings.any()):
        b = int(batch.repeated_siblings.nonzero()[0, 0])
        raise ValueError(
            f"tree of row {b} has siblings with the same token: {method.value} verification needs distinct "
            "siblings (only rejection verification takes repeated i.i.d. sampled siblings)"
        )
    if method == VerifyMethod.REJECTION and batch.max_nodes > 0:
        if draft_probs is None:
            raise ValueError("REJECTION verification needs the drafter's probabilities (draft_probs)")
        if draft_probs.shape not in ((bsz, slots, vocab), (bsz, slots - 1, vocab)):
            raise ValueError(
                f"draft_probs must be [B, N+1, V] = {(bsz, slots, vocab)} (or [B, N, V]), "
                f"got {tuple(draft_probs.shape)}"
            )
        draft_probs = draft_probs.to(dev)
    batch = TreeBatch(*(t.to(dev) for t in (batch.token_ids, batch.parents, batch.depths, batch.num_nodes,
                                              batch.children, batch.repeated_siblings)))
    sb = sb.to(dev)
    positions = positions.to(dev, torch.int64)
    if method == VerifyMethod.GREEDY:
        return _walk_matching(target_probs.argmax(dim=-1), batch)
    if method == VerifyMethod.COUPLED:
        slot_pos = positions.unsqueeze(-1) + batch.slot_depths()  # [B, S]
        y = coupled_argmax(
            target_probs.reshape(bsz * slots, vocab), sb.seed.repeat_interleave(slots), slot_pos.reshape(-1)
        ).view(bsz, slots)
        return _walk_matching(y, batch)
    q = draft_probs if method == VerifyMethod.REJECTION and batch.max_nodes > 0 else None
    return _walk_sampled(target_probs, batch, q, sb.seed, positions, salt)


def tree_penalized_logits(
    logits: torch.Tensor,  # [B, N + 1, V] the verifier's raw logits at each slot
    sb: SamplingBatch,
    history: TokenHistory | None,
    trees: TreeBatch,
) -> torch.Tensor:  # [B, N + 1, V] float32
    """`apply_penalties` for trees: slot i + 1 follows the row's history plus the tokens on the path to node i
    (what the output is if that path is accepted), exactly as a chain's slot follows the drafts before it."""
    x = logits.float()
    if not sb.penalized:
        return x
    if history is None:
        raise ValueError("penalized rows need their TokenHistory")
    bsz, slots, vocab = x.shape
    dev = x.device
    tok = torch.nn.functional.one_hot(trees.token_ids.clamp(min=0), vocab).to(dev, torch.float32)  # [B, N, V]
    on_path = trees.ancestors().to(dev, torch.float32) @ (tok * trees.valid.to(dev).unsqueeze(-1))  # [B, N, V]
    path_counts = torch.cat([on_path.new_zeros(bsz, 1, vocab), on_path], dim=1)  # [B, S, V] (S = 1 for N = 0)
    counts = history.output_counts.to(dev).unsqueeze(1) + path_counts
    seen = history.seen.to(dev).unsqueeze(1) | (counts > 0)
    rows = torch.arange(bsz, device=dev).repeat_interleave(slots)
    flat = TokenHistory(counts.reshape(bsz * slots, vocab), seen.reshape(bsz * slots, vocab))
    return apply_penalties(x.reshape(bsz * slots, 1, vocab), sb.to(dev).select(rows), flat).view(bsz, slots, vocab)


def verify_tree_logits(
    method: VerifyMethod,
    target_logits: torch.Tensor,  # [B, N + 1, V]
    trees: Sequence[DraftTree] | TreeBatch,
    draft_probs: torch.Tensor | None,  # [B, N + 1, V] or [B, N, V] (REJECTION only)
    sb: SamplingBatch,
    positions: torch.Tensor,  # [B]
    salt: int,
    history: TokenHistory | None = None,
) -> TreeVerifyOutput:
    """`verify_tree` on the verifier's raw logits: applies the rows' penalties (along each slot's path) and
    sampling parameters first."""
    batch = trees if isinstance(trees, TreeBatch) else pad_trees(
        trees, max_nodes=target_logits.shape[1] - 1, device=target_logits.device)
    logits = tree_penalized_logits(target_logits, sb, history, batch)
    return verify_tree(method, processed_probs(logits, sb), batch, draft_probs, sb, positions, salt)
