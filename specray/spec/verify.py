"""Batched, lossless verification of drafted tokens.

Glossary
--------
draft (tokens)
    The K tokens a drafter (n-gram lookup, small model, or a lower cascade level) proposes for the
    positions after a sequence's last token. Rows are ragged: row b has `num_draft[b]` leading real
    draft tokens, then `PLACEHOLDER_TOKEN_ID` padding.
accepted (tokens)
    The longest prefix of the draft that the verifier keeps. Each kept token is distributed exactly as
    if the verifier had sampled it itself.
recovered / correction token
    Emitted at the first rejected slot instead of the draft token, drawn so that the slot's overall
    distribution is exactly the verifier's (e.g. from normalize(max(p - q, 0)) for rejection sampling).
bonus token
    When the whole draft is accepted, the verifier has already computed the distribution of the next
    position, so one more token is sampled from it for free.

Each call emits `num_accepted + 1` tokens per row: accepted drafts, then one recovered or bonus token.

Every random number is keyed by (request seed, absolute position, stream) (see `sampling.py`), so the
result of a row does not depend on the batch, the device or the number of rounds, and `reference.py`
reproduces it exactly with per-row Python loops.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from specray.spec.noise import accept_stream, coupled_argmax, inverse_cdf_sample, keyed_uniform_streams, residual_stream
from specray.spec.params import PLACEHOLDER_TOKEN_ID, VerifyMethod
from specray.spec.sampling import SamplingBatch, on_device, processed_probs

__all__ = ["RESIDUAL_EPS", "VerifyOutput", "count_drafts", "verify", "verify_logits"]

#: A rejection residual with total mass <= this is treated as empty and replaced by p. Its true mass is
#: TV(p, q) >= q(x) - p(x) > 0 whenever a rejection happens, so this only catches float round-off.
RESIDUAL_EPS = 1e-12


@dataclass
class VerifyOutput:
    """Result of verifying one batch of drafts."""

    output_ids: torch.Tensor  # [B, K+1] int64: accepted drafts, one recovered/bonus token, then padding
    num_accepted: torch.Tensor  # [B] int64: accepted draft tokens per row

    @property
    def num_emitted(self) -> torch.Tensor:  # [B] int64
        return self.num_accepted + 1

    def token_lists(self) -> list[list[int]]:
        """Emitted tokens of each row, without padding."""
        return [
            row[: n + 1] for row, n in zip(self.output_ids.tolist(), self.num_accepted.tolist(), strict=True)
        ]


def count_drafts(draft_ids: torch.Tensor) -> torch.Tensor:  # [B, K] -> [B] int64
    """Number of leading non-placeholder tokens per row (placeholders are only allowed at the end)."""
    return (draft_ids != PLACEHOLDER_TOKEN_ID).to(torch.int64).cumprod(dim=-1).sum(dim=-1)


def _assemble(
    draft_ids: torch.Tensor,  # [B, K]
    num_accepted: torch.Tensor,  # [B]
    final_token: torch.Tensor,  # [B] recovered or bonus token
) -> VerifyOutput:
    bsz, k = draft_ids.shape
    slots = torch.arange(k + 1, device=draft_ids.device)
    padded = torch.cat([draft_ids, draft_ids.new_full((bsz, 1), PLACEHOLDER_TOKEN_ID)], dim=1)
    n = num_accepted.unsqueeze(-1)
    out = torch.where(
        slots < n, padded, torch.where(slots == n, final_token.unsqueeze(-1), PLACEHOLDER_TOKEN_ID)
    )
    return VerifyOutput(output_ids=out, num_accepted=num_accepted)


def _leading_true(mask: torch.Tensor) -> torch.Tensor:  # [B, K] bool -> [B] int64
    return mask.to(torch.int64).cumprod(dim=-1).sum(dim=-1)


def _slot_positions(positions: torch.Tensor, slots: int) -> torch.Tensor:  # [B] -> [B, slots]
    return positions.unsqueeze(-1) + torch.arange(slots, device=positions.device)


def _accept_while_equal(
    y: torch.Tensor,  # [B, K+1] the verifier's own token at each slot
    draft_ids: torch.Tensor,  # [B, K]
    num_draft: torch.Tensor,  # [B]
) -> VerifyOutput:
    """Accept while the draft equals the verifier's token y_j; emit y at the stop (mismatch or bonus)."""
    k = draft_ids.shape[1]
    valid = torch.arange(k, device=draft_ids.device) < num_draft.unsqueeze(-1)
    n = _leading_true((draft_ids == y[:, :k]) & valid)
    return _assemble(draft_ids, n, y.gather(1, n.unsqueeze(-1)).squeeze(-1))


def _greedy(target_probs, draft_ids, draft_probs, sb, positions, salt, num_draft) -> VerifyOutput:
    return _accept_while_equal(target_probs.argmax(dim=-1), draft_ids, num_draft)


def _coupled(target_probs, draft_ids, draft_probs, sb, positions, salt, num_draft) -> VerifyOutput:
    # y_j = argmax(log p_j + g(seed, pos + j)): the token the verifier samples at slot j whatever the draft.
    bsz, slots, vocab = target_probs.shape
    y = coupled_argmax(
        target_probs.reshape(bsz * slots, vocab),
        sb.seed.repeat_interleave(slots),
        _slot_positions(positions, slots).reshape(-1),
    ).view(bsz, slots)
    return _accept_while_equal(y, draft_ids, num_draft)


def _verify_sampled(
    target_probs: torch.Tensor,  # [B, K+1, V]
    draft_ids: torch.Tensor,  # [B, K]
    draft_probs: torch.Tensor | None,  # [B, K, V] for REJECTION, None for DETERMINISTIC
    sb: SamplingBatch,
    positions: torch.Tensor,  # [B]
    salt: int,
    num_draft: torch.Tensor,  # [B]
) -> VerifyOutput:
    """Rejection sampling (q = draft_probs), or its q = delta_x special case when draft_probs is None.

    All accept decisions are made at once; the first rejection per row is found with a cumprod; then one
    [B, V] distribution per row (residual at the rejected slot, or p at the bonus slot) is sampled.
    Comparisons are made in float64 where u * q(x) is exact, so the reference reproduces them bit for bit.
    The accept coins of slots 0..K-1 and the residual draws of slots 0..K come from one Philox evaluation (the
    draw at the stop is then picked), not one per stream.
    """
    bsz, slots, vocab = target_probs.shape
    k = slots - 1
    seed = sb.seed
    x = draft_ids.clamp(min=0)  # placeholders -> any valid index; masked by `valid` below
    valid = torch.arange(k, device=draft_ids.device) < num_draft.unsqueeze(-1)  # [B, K]
    p_x = target_probs[:, :k].gather(-1, x.unsqueeze(-1)).squeeze(-1).double()  # [B, K]
    offsets = list(range(k)) + list(range(k + 1))  # per row: accept coins at slots 0..K-1, then residual draws
    streams = [accept_stream(salt)] * k + [residual_stream(salt)] * (k + 1)
    both = keyed_uniform_streams(
        seed.repeat_interleave(2 * k + 1),
        (positions.unsqueeze(-1) + torch.tensor(offsets, dtype=torch.int64, device=positions.device)).reshape(-1),
        streams * bsz,
    ).view(bsz, 2 * k + 1)
    u = both[:, :k].double()
    if draft_probs is None:
        accept = u < p_x  # min(1, p(x) / 1)
    else:
        q_x = draft_probs.gather(-1, x.unsqueeze(-1)).squeeze(-1).double()
        accept = u * q_x < p_x  # u < min(1, p(x) / q(x)); q(x) = 0 accepts any x with p(x) > 0
    n = _leading_true(accept & valid)  # [B]

    idx = n.view(bsz, 1, 1).expand(bsz, 1, vocab)
    p_n = target_probs.gather(1, idx).squeeze(1).double()  # [B, V]
    weights = p_n
    if k > 0:
        rejected = n < num_draft
        if draft_probs is None:
            x_n = x.gather(1, n.clamp(max=k - 1).unsqueeze(-1))
            residual = p_n.scatter(-1, x_n, 0.0)  # p with the rejected token removed
        else:
            q_n = draft_probs.gather(1, idx.clamp(max=k - 1)).squeeze(1).double()
            residual = (p_n - q_n).clamp(min=0.0)
        has_mass = residual.cumsum(dim=-1)[:, -1] > RESIDUAL_EPS
        weights = torch.where((rejected & has_mass).unsqueeze(-1), residual, p_n)
    u_final = both[:, k:].gather(1, n.unsqueeze(-1)).squeeze(-1)  # the residual draw at slot n
    return _assemble(draft_ids, n, inverse_cdf_sample(weights, u_final))


def _rejection(target_probs, draft_ids, draft_probs, sb, positions, salt, num_draft) -> VerifyOutput:
    if draft_ids.shape[1] == 0:  # nothing to verify: the bonus token is plain sampling from p
        return _verify_sampled(target_probs, draft_ids, None, sb, positions, salt, num_draft)
    if draft_probs is None:
        raise ValueError("REJECTION verification needs the drafter's probabilities (draft_probs)")
    if draft_probs.shape != (*draft_ids.shape, target_probs.shape[-1]):
        raise ValueError(
            f"draft_probs must be [B, K, V] = {(*draft_ids.shape, target_probs.shape[-1])}, "
            f"got {tuple(draft_probs.shape)}"
        )
    return _verify_sampled(target_probs, draft_ids, draft_probs, sb, positions, salt, num_draft)


def _deterministic(target_probs, draft_ids, draft_probs, sb, positions, salt, num_draft) -> VerifyOutput:
    return _verify_sampled(target_probs, draft_ids, None, sb, positions, salt, num_draft)


_METHODS: dict[VerifyMethod, Callable[..., VerifyOutput]] = {
    VerifyMethod.GREEDY: _greedy,
    VerifyMethod.REJECTION: _rejection,
    VerifyMethod.DETERMINISTIC: _deterministic,
    VerifyMethod.COUPLED: _coupled,
}


def verify(
    method: VerifyMethod,
    target_probs: torch.Tensor,  # [B, K+1, V] processed probs; slot j is the token at positions[b] + j
    draft_ids: torch.Tensor,  # [B, K] int64, PLACEHOLDER_TOKEN_ID-padded at the end
    draft_probs: torch.Tensor | None,  # [B, K, V] drafter's processed probs (REJECTION only)
    sb: SamplingBatch,
    positions: torch.Tensor,  # [B] int64 absolute position of slot 0
    salt: int,
) -> VerifyOutput:
    """Verify a ragged batch of drafts against the verifier's distributions; see the module glossary.

    `salt` (the level index) separates this level's accept/residual noise from every other level's.
    GREEDY:        accept while draft == argmax p; emit argmax at the stop.
    REJECTION:     accept x w.p. min(1, p(x)/q(x)); on rejection sample normalize(max(p - q, 0)).
    DETERMINISTIC: q = delta_x: accept w.p. p(x); on rejection sample p without x.
    COUPLED:       accept while draft == argmax(log p + g(seed, position)); emit that token at the stop,
                   so the output for a seed is the same whatever the drafter.
    All methods emit a bonus token from slot num_draft when the whole draft is accepted. Rows with
    temperature 0 have one-hot p and so are verified greedily by every method.
    """
    fn = _METHODS[VerifyMethod(method)]
    if target_probs.dim() != 3:
        raise ValueError(f"target_probs must be [B, K+1, V], got shape {tuple(target_probs.shape)}")
    bsz, slots, _ = target_probs.shape
    if draft_ids.shape != (bsz, slots - 1):
        raise ValueError(f"draft_ids must be [B, K] = {(bsz, slots - 1)}, got {tuple(draft_ids.shape)}")
    if len(sb) != bsz or positions.shape != (bsz,):
        raise ValueError(
            f"SamplingBatch ({len(sb)} rows) and positions {tuple(positions.shape)} must have B={bsz}"
        )
    dev = target_probs.device
    sb = sb.to(dev)
    draft_ids = on_device(draft_ids, dev, torch.int64)
    positions = on_device(positions, dev, torch.int64)
    return fn(target_probs, draft_ids, draft_probs, sb, positions, salt, count_drafts(draft_ids))


def verify_logits(
    method: VerifyMethod,
    target_logits: torch.Tensor,  # [B, K+1, V]
    draft_ids: torch.Tensor,  # [B, K]
    draft_probs: torch.Tensor | None,  # [B, K, V] (REJECTION only)
    sb: SamplingBatch,
    positions: torch.Tensor,  # [B]
    salt: int,
) -> VerifyOutput:
    """`verify` on the verifier's raw logits: applies the rows' sampling parameters first."""
    return verify(method, processed_probs(target_logits, sb), draft_ids, draft_probs, sb, positions, salt)
