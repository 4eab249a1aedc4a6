"""Keyed noise: every random number specray draws, and the token draws made with it.

Every random number is a counter-based hash (Philox-4x32-10) of (request seed, absolute position, stream,
index). No global RNG state is consumed, so the same request produces the same tokens whatever the batch it
lands in, the machine, or the number of rounds it took. Streams separate the independent uses of noise at one
position:

- `COUPLED_STREAM` (0): Gumbel noise shared by *all* levels (that sharing is the coupling);
- `accept_stream(salt)`: the accept/reject coin of level `salt`;
- `residual_stream(salt)`: the inverse-CDF draw of level `salt` (corrections, bonus tokens, random-mode
  drafting and plain decoding).

The distributions the draws are made from: `specray.spec.sampling`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from specray.spec.sampling import SamplingBatch, on_device

__all__ = [
    "COUPLED_STREAM",
    "SAMPLE_MODES",
    "accept_stream",
    "coupled_argmax",
    "gumbel_noise",
    "inverse_cdf_sample",
    "keyed_uniform",
    "keyed_uniform_at",
    "keyed_uniform_streams",
    "philox4x32",
    "residual_stream",
    "sample_tokens",
]

#: Stream of the Gumbel noise used by coupled drafting/verification; the same for every level.
COUPLED_STREAM = 0

#: Modes accepted by `sample_tokens`.
SAMPLE_MODES = ("random", "coupled", "greedy")

_MASK32 = 0xFFFFFFFF
# Philox-4x32 multipliers and Weyl key increments (Salmon et al., "Parallel random numbers: as easy as
# 1, 2, 3", SC 2011).
_PHILOX_M0 = 0xD2511F53
_PHILOX_M1 = 0xCD9E8D57
_PHILOX_W0 = 0x9E3779B9
_PHILOX_W1 = 0xBB67AE85
_PHILOX_ROUNDS = 10
# Philox words computed per chunk on CPU: small enough to stay in cache, big enough to amortise op overhead.
_CPU_CHUNK = 1 << 14


def accept_stream(salt: int) -> int:
    """Stream of the accept/reject uniforms of level `salt` (odd, never the coupled stream)."""
    return 2 * salt + 1


def residual_stream(salt: int) -> int:
    """Stream of the inverse-CDF uniforms of level `salt` (even and > 0, never the coupled stream)."""
    return 2 * salt + 2


# --------------------------------------------------------------------------------------------------
# Keyed (counter-based) uniforms and Gumbel noise
# --------------------------------------------------------------------------------------------------


def _mulhilo32(m: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(high, low) 32-bit halves of the 64-bit product m * x, for m < 2**32 and int64 x in [0, 2**32).

    The multiplier is split into 16-bit limbs so that no intermediate reaches 2**63 (int64 overflow).
    """
    t_lo = x * (m & 0xFFFF)  # < 2**48
    t_hi = x * (m >> 16)  # < 2**48
    s = t_lo + ((t_hi & 0xFFFF) << 16)  # < 2**49
    return (t_hi >> 16) + (s >> 32), s & _MASK32


def philox4x32(
    counter: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],  # 4 x [...] int64 in [0, 2**32)
    key: tuple[torch.Tensor, torch.Tensor],  # 2 x [...] int64 in [0, 2**32)
    rounds: int = _PHILOX_ROUNDS,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # 4 x [...] int64 in [0, 2**32)
    """Philox-4x32 bijection of a 128-bit counter under a 64-bit key, with 32-bit words held in int64.

    Crush-resistant, stateless and embarrassingly parallel: word-for-word the same on every device.
    """
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for r in range(rounds):
        if r:
            k0 = (k0 + _PHILOX_W0) & _MASK32
            k1 = (k1 + _PHILOX_W1) & _MASK32
        hi0, lo0 = _mulhilo32(_PHILOX_M0, c0)
        hi1, lo1 = _mulhilo32(_PHILOX_M1, c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return c0, c1, c2, c3


def _keyed_words(
    seed: torch.Tensor,  # [N] int64
    position: torch.Tensor,  # [N] int64
    stream: int | Sequence[int],
    total: int,
    locate: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
) -> torch.Tensor:  # [total, 4] int64 32-bit words
    """Philox blocks for `total` (row, block) pairs; `locate` maps flat ids to them, one chunk at a time.

    Key = seed (two 32-bit limbs); counter = (block, stream, position low, position high). `stream`: one for every
    row, or each row's own (a sequence of N).
    """
    per_row = not isinstance(stream, int)
    streams = list(stream) if per_row else [stream]
    if not all(0 <= s < 2**32 for s in streams):
        raise ValueError(f"stream must be in [0, 2**32), got {stream}")
    dev = seed.device
    seed = on_device(seed, dev, torch.int64)
    position = on_device(position, dev, torch.int64)
    seed_lo, seed_hi = seed & _MASK32, (seed >> 32) & _MASK32
    pos_lo, pos_hi = position & _MASK32, (position >> 32) & _MASK32
    c1 = torch.tensor(streams if per_row else stream, dtype=torch.int64, device=dev)
    words = torch.empty((total, 4), dtype=torch.int64, device=dev)
    chunk = _CPU_CHUNK if dev.type == "cpu" else max(total, 1)
    for start in range(0, total, chunk):
        row, block = locate(torch.arange(start, min(total, start + chunk), dtype=torch.int64, device=dev))
        out = philox4x32((block, c1[row] if per_row else c1, pos_lo[row], pos_hi[row]), (seed_lo[row], seed_hi[row]))
        words[start : start + chunk] = torch.stack(out, dim=-1)
    return words


def _to_uniform(words: torch.Tensor) -> torch.Tensor:
    """32-bit words -> ((w >> 9) + 0.5) / 2**23: 2**23 equally spaced float32 values, never 0 or 1."""
    return ((words >> 9).to(torch.float32) + 0.5) * (2.0**-23)


def keyed_uniform(
    seed: torch.Tensor,  # [N] int64
    position: torch.Tensor,  # [N] int64
    stream: int,
    n: int,
) -> torch.Tensor:  # [N, n] float32, strictly inside (0, 1)
    """Uniforms that are a pure function of (seed, position, stream, index); no RNG state is used.

    Philox-4x32-10 with key = seed and counter = (index // 4, stream, position low, position high); each
    call of the bijection yields four words, used for indices 4c..4c+3 (so index i of a long request is
    the same number as index i of a short one).
    """
    if seed.shape != position.shape or seed.dim() != 1:
        raise ValueError(
            f"seed, position must be [N] tensors, got {tuple(seed.shape)}, {tuple(position.shape)}"
        )
    n_blocks = (n + 3) // 4
    rows = seed.shape[0]

    def locate(flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        row = flat // n_blocks
        return row, flat - row * n_blocks

    words = _keyed_words(seed, position, stream, rows * n_blocks, locate)
    return _to_uniform(words.view(rows, n_blocks * 4)[:, :n])


def keyed_uniform_at(
    seed: torch.Tensor,  # [N] int64
    position: torch.Tensor,  # [N] int64
    stream: int,
    rows: torch.Tensor,  # [M] int64 row of each requested value
    index: torch.Tensor,  # [M] int64 index of each requested value
) -> torch.Tensor:  # [M] float32
    """keyed_uniform(seed, position, stream, n)[rows, index] without computing the other entries."""
    words = _keyed_words(seed, position, stream, rows.shape[0], lambda f: (rows[f], index[f] >> 2))
    return _to_uniform(words.gather(1, (index & 3).unsqueeze(-1)).squeeze(-1))


def keyed_uniform_streams(
    seed: torch.Tensor,  # [N] int64
    position: torch.Tensor,  # [N] int64
    streams: Sequence[int],  # N streams
) -> torch.Tensor:  # [N] float32
    """keyed_uniform(seed[i], position[i], streams[i], 1)[0, 0] for every i, in one Philox evaluation: the uniforms
    of several streams (a verification's accept coins and its residual draws) for the cost of one call."""
    if seed.shape != position.shape or seed.dim() != 1 or len(streams) != seed.shape[0]:
        raise ValueError(f"seed, position must be [N] tensors and streams N long, got {tuple(seed.shape)}, "
                         f"{tuple(position.shape)}, {len(streams)}")
    rows = seed.shape[0]
    words = _keyed_words(seed, position, streams, rows, lambda f: (f, torch.zeros_like(f)))
    return _to_uniform(words[:, 0])


def _gumbel(u: torch.Tensor) -> torch.Tensor:
    # float64 then one rounding, so that it is the same float32 on every device.
    return (-torch.log(-torch.log(u.double()))).float()


def gumbel_noise(
    seed: torch.Tensor,  # [N] int64
    position: torch.Tensor,  # [N] int64
    vocab: int,
) -> torch.Tensor:  # [N, V] float32
    """Standard Gumbel noise g = -log(-log u) on the coupled stream, shared by every level."""
    return _gumbel(keyed_uniform(seed, position, COUPLED_STREAM, vocab))


#: Every keyed Gumbel value lies in [-log(-log(2**-24)), -log(-log(1 - 2**-24))] ~ [-2.81, 16.64], a range
#: below 19.5 nats, so a token whose log-probability is 20 nats below the row's best can never win the
#: Gumbel-max: `coupled_argmax` skips its noise, and the result is exactly the full computation's.
_GUMBEL_PRUNE_NATS = 20.0


def coupled_argmax(
    probs: torch.Tensor,  # [N, V] processed probabilities
    seed: torch.Tensor,  # [N] int64
    position: torch.Tensor,  # [N] int64
) -> torch.Tensor:  # [N] int64
    """argmax_v log p(v) + gumbel_noise(seed, position)[v], first index on ties (scores in float64).

    Noise is only computed for tokens that can win (see _GUMBEL_PRUNE_NATS): with top-k/top-p or a
    peaked distribution that is a small part of the vocabulary, which makes coupling cheap.
    """
    n, vocab = probs.shape
    cand = probs >= probs.amax(dim=-1, keepdim=True) * math.exp(-_GUMBEL_PRUNE_NATS)  # [N, V]
    n_cand = int(cand.sum())
    if 4 * n_cand >= probs.numel():  # dense: whole Philox blocks are cheaper than single words
        g = gumbel_noise(seed, position, vocab).double()
        return (torch.log(probs.double()) + g).argmax(dim=-1)
    rows, cols = cand.nonzero(as_tuple=True)  # row-major: columns ascend within a row
    u = keyed_uniform_at(seed, position, COUPLED_STREAM, rows, cols)
    scores = torch.log(probs[rows, cols].double()) + _gumbel(u).double()  # [M]
    best = torch.full((n,), float("-inf"), dtype=torch.float64, device=probs.device)
    best = best.scatter_reduce(0, rows, scores, reduce="amax")
    first = torch.full((n,), vocab, dtype=torch.int64, device=probs.device)
    winners = torch.where(scores == best[rows], cols, vocab)
    return first.scatter_reduce(0, rows, winners, reduce="amin")


# --------------------------------------------------------------------------------------------------
# Drawing tokens
# --------------------------------------------------------------------------------------------------


def inverse_cdf_sample(
    weights: torch.Tensor,  # [N, V] float64, non-negative, not necessarily normalised
    u: torch.Tensor,  # [N] float in (0, 1)
) -> torch.Tensor:  # [N] int64
    """The first token whose cumulative weight exceeds u * total; never a token of zero weight.

    On CPU the float64 cumulative sum is sequential per row, so a per-row Python loop reproduces it
    exactly (a GPU scan may differ in the last bit, which can only matter at an exact CDF boundary).
    """
    cdf = weights.cumsum(dim=-1)
    r = (u.double() * cdf[:, -1]).unsqueeze(-1)
    return (cdf <= r).sum(dim=-1).clamp(max=weights.shape[-1] - 1)


def sample_tokens(
    probs: torch.Tensor,  # [B, V] processed probabilities
    sb: SamplingBatch,
    positions: torch.Tensor,  # [B] int64 absolute position of the token being sampled
    mode: str,
    salt: int,
) -> torch.Tensor:  # [B] int64
    """Draw one token per row, for drafting and plain decoding.

    random:  inverse CDF with keyed_uniform(seed, pos, residual_stream(salt)) (what REJECTION and
             DETERMINISTIC verification use for their bonus token, so K=0 verification == this);
    coupled: argmax(log p + gumbel_noise(seed, pos)): the token COUPLED verification would emit;
    greedy:  argmax p.
    """
    if probs.dim() != 2:
        raise ValueError(f"probs must be [B, V], got shape {tuple(probs.shape)}")
    if mode == "greedy":
        return probs.argmax(dim=-1)
    seed = on_device(sb.seed, probs.device)
    positions = on_device(positions, probs.device, torch.int64)
    if mode == "random":
        u = keyed_uniform(seed, positions, residual_stream(salt), 1)[:, 0]
        return inverse_cdf_sample(probs.double(), u)
    if mode == "coupled":
        return coupled_argmax(probs, seed, positions)
    raise ValueError(f"unknown sampling mode {mode!r}; expected one of {SAMPLE_MODES}")
