"""Sampling primitives shared by drafting, plain decoding and verification: the distributions draws are made from.

Two ideas make speculative decoding in specray exact *and* reproducible:

1. `processed_probs` (here) turns logits into exactly the distribution plain sampling would draw from
   (penalties via `apply_penalties`, then temperature, min_p, top-k, top-p: vLLM's order). Verification
   then works on these probabilities, so a verified stream is an exact sample from what the user asked
   for, filters and penalties included.
2. Every random number is *keyed*, a pure function of (request seed, absolute position, stream, index), so the
   same request produces the same tokens whatever the batch it lands in, the machine, or the number of rounds
   it took: `specray.spec.noise` (the Philox streams, and `sample_tokens`, the draws made with them).
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from specray.spec.params import SamplingParams

__all__ = [
    "SamplingBatch",
    "TokenHistory",
    "apply_penalties",
    "on_device",
    "processed_probs",
    "raw_logprobs",
]

# First candidate-prefix length when searching the top-p cut.
_TOP_P_CANDIDATES = 1024


def on_device(t: torch.Tensor, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """`t` on `device` (and `dtype`), without dispatching a no-op `.to` when it is already there (each dispatched op
    costs the host time on a GPU, and the rounds make many)."""
    if t.device == device and (dtype is None or t.dtype == dtype):
        return t
    return t.to(device, dtype)


def _f32(x: float) -> float:
    """x rounded to float32, as the batch's tensors hold it (a host-side test must agree with the tensor's)."""
    return struct.unpack("f", struct.pack("f", x))[0]


def _host_greedy(p: SamplingParams) -> bool:
    """Whether the row's temperature tensor is 0 (a temperature below float32's range rounds to 0 there)."""
    return _f32(p.temperature) == 0


# --------------------------------------------------------------------------------------------------
# Per-row sampling parameters as tensors
# --------------------------------------------------------------------------------------------------


@dataclass
class SamplingBatch:
    """Sampling parameters of a batch of rows, as tensors so that all rows are processed at once.

    top_k 0 disables top-k; top_p 1 disables nucleus filtering; min_p 0 disables min_p; temperature 0 means
    greedy; penalties at 0 (presence, frequency) and 1 (repetition) are off. `host`: the rows' parameters on the host
    (from `from_params`, kept by `select` with a list), so that branching on them reads no tensor (on a GPU a read
    waits for the device); None: branches read the tensors.
    """

    temperature: torch.Tensor  # [B] float32
    top_k: torch.Tensor  # [B] int64
    top_p: torch.Tensor  # [B] float32
    seed: torch.Tensor  # [B] int64
    min_p: torch.Tensor | None = None  # [B] float32; None: 0 for every row
    presence: torch.Tensor | None = None  # [B] float32; None: no row is penalized (all three None)
    frequency: torch.Tensor | None = None  # [B] float32
    repetition: torch.Tensor | None = None  # [B] float32
    host: tuple[SamplingParams, ...] | None = None

    @classmethod
    def from_params(
        cls, params: Sequence[SamplingParams], device: torch.device | str | None = None
    ) -> SamplingBatch:
        """Build from per-request params; every seed must already be concrete (see `with_seed`)."""
        for i, p in enumerate(params):
            if p.seed is None:
                raise ValueError(f"params[{i}].seed is None: call SamplingParams.with_seed() on admission")

        penalized = any(p.penalized for p in params)
        with_min_p = any(p.min_p > 0 for p in params)
        # one float and one integer tensor, each built (and moved to the device) once; the fields are their rows
        floats = [[float(p.temperature) for p in params], [float(p.top_p) for p in params]]
        if with_min_p:
            floats.append([float(p.min_p) for p in params])
        if penalized:
            floats += [[float(p.presence_penalty) for p in params], [float(p.frequency_penalty) for p in params],
                       [float(p.repetition_penalty) for p in params]]
        f = torch.tensor(floats, dtype=torch.float32, device=device).unbind(0)
        top_k, seed = torch.tensor([[p.top_k for p in params], [p.seed for p in params]], dtype=torch.int64,
                                   device=device).view(2, len(params)).unbind(0)
        rest = list(f[2:])
        min_p = rest.pop(0) if with_min_p else None
        presence, frequency, repetition = rest if penalized else (None, None, None)
        return cls(f[0], top_k, f[1], seed, min_p, presence, frequency, repetition, host=tuple(params))

    def _map(self, fn: Callable[[torch.Tensor], torch.Tensor],
             host: tuple[SamplingParams, ...] | None) -> SamplingBatch:
        def opt(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else fn(t)

        return SamplingBatch(fn(self.temperature), fn(self.top_k), fn(self.top_p), fn(self.seed), opt(self.min_p),
                             opt(self.presence), opt(self.frequency), opt(self.repetition), host=host)

    def select(self, rows: torch.Tensor | list[int]) -> SamplingBatch:
        """The sub-batch made of `rows` (indices), in that order."""
        idx = torch.as_tensor(rows, dtype=torch.int64, device=self.temperature.device)
        host = None
        if self.host is not None and not isinstance(rows, torch.Tensor):
            host = tuple(self.host[int(r)] for r in rows)
        return self._map(lambda t: t[idx], host)

    def to(self, device: torch.device | str) -> SamplingBatch:
        """This batch on `device` (itself when it is already there)."""
        device = torch.device(device)
        if self.temperature.device == device:
            return self
        return self._map(lambda t: t.to(device), self.host)

    def __len__(self) -> int:
        return int(self.temperature.shape[0])

    @property
    def greedy(self) -> torch.Tensor:  # [B] bool
        return self.temperature == 0

    @property
    def all_greedy(self) -> bool:
        if self.host is not None:
            return all(_host_greedy(p) for p in self.host)
        return bool(self.greedy.all())

    @property
    def any_greedy(self) -> bool:
        if self.host is not None:
            return any(_host_greedy(p) for p in self.host)
        return bool(self.greedy.any())

    @property
    def penalized(self) -> bool:
        """Whether some row has a penalty (its logits then depend on the tokens seen so far)."""
        return self.repetition is not None


# --------------------------------------------------------------------------------------------------
# Penalties: the logits given the tokens seen so far
# --------------------------------------------------------------------------------------------------


@dataclass
class TokenHistory:
    """What the penalties of each row depend on: how often each token occurs in the output so far, and
    which tokens occur anywhere (prompt or output)."""

    output_counts: torch.Tensor  # [B, V] float32
    seen: torch.Tensor  # [B, V] bool

    @classmethod
    def from_tokens(
        cls, tokens: Sequence[Sequence[int]], prompt_lens: Sequence[int], vocab: int,
        device: torch.device | str | None = None,
    ) -> TokenHistory:
        """tokens[b] is row b's whole context (prompt, then output); its first prompt_lens[b] are the prompt."""
        prompts = [row[:n] for row, n in zip(tokens, prompt_lens)]
        return cls.from_parts(cls.seen_mask(prompts, vocab, device), [row[n:] for row, n in zip(tokens, prompt_lens)])

    @staticmethod
    def seen_mask(
        tokens: Sequence[Sequence[int]], vocab: int, device: torch.device | str | None = None,
    ) -> torch.Tensor:  # [B, V] bool
        """Which tokens occur in each row (a prompt's part of `seen`, which a worker can keep per sequence)."""
        seen = torch.zeros(len(tokens), vocab, dtype=torch.bool, device=device)
        lens = torch.tensor([len(row) for row in tokens], dtype=torch.int64, device=device)
        if int(lens.sum()) > 0:
            flat = torch.tensor([t for row in tokens for t in row], dtype=torch.int64, device=device)
            seen[torch.repeat_interleave(torch.arange(len(tokens), device=device), lens), flat] = True
        return seen

    @classmethod
    def from_parts(
        cls, prompt_seen: torch.Tensor,  # [B, V] bool
        outputs: Sequence[Sequence[int]],
    ) -> TokenHistory:
        """The history of rows whose prompts' tokens are `prompt_seen` and whose outputs so far are `outputs`."""
        bsz, vocab = prompt_seen.shape
        dev = prompt_seen.device
        counts = torch.zeros(bsz, vocab, dtype=torch.float32, device=dev)
        lens = torch.tensor([len(row) for row in outputs], dtype=torch.int64, device=dev)
        if int(lens.sum()) > 0:
            flat = torch.tensor([t for row in outputs for t in row], dtype=torch.int64, device=dev)
            row = torch.repeat_interleave(torch.arange(bsz, device=dev), lens)
            counts.index_put_((row, flat), torch.ones_like(flat, dtype=torch.float32), accumulate=True)
        return cls(counts, prompt_seen | (counts > 0))

    def select(self, rows: torch.Tensor | list[int]) -> TokenHistory:
        idx = torch.as_tensor(rows, dtype=torch.int64, device=self.seen.device)
        return TokenHistory(self.output_counts[idx], self.seen[idx])

    def add(self, rows: torch.Tensor | list[int], tokens: torch.Tensor) -> None:
        """Row rows[i] emitted tokens[i] (an output token): count it, in place."""
        idx = torch.as_tensor(rows, dtype=torch.int64, device=self.seen.device)
        tok = on_device(tokens, self.seen.device, torch.int64)
        self.output_counts.index_put_((idx, tok), torch.ones_like(tok, dtype=torch.float32), accumulate=True)
        self.seen[idx, tok] = True


def apply_penalties(
    logits: torch.Tensor,  # [B, T, V]
    sb: SamplingBatch,
    history: TokenHistory | None,
    draft_ids: torch.Tensor | None = None,  # [B, T-1] int64, PLACEHOLDER-padded: the tokens before slots 1..T-1
) -> torch.Tensor:  # [B, T, V] float32
    """The logits after each row's repetition, frequency and presence penalties, as vLLM applies them.

    Slot j of a row follows the row's history plus draft_ids[:, :j] (the drafts are the output if they are
    accepted), so verification of K drafts penalizes each slot exactly as plain decoding would at that position.
    Rows without penalties come out unchanged (their logits in float32). In order: repetition (logit / r where
    positive, logit * r otherwise, for every token seen in the prompt or the output), then - frequency * count,
    then - presence for every token in the output.
    """
    x = logits.float()
    if not sb.penalized:
        return x
    if history is None:
        raise ValueError("penalized rows need their TokenHistory")
    bsz, steps, vocab = x.shape
    dev = x.device
    counts = on_device(history.output_counts, dev).unsqueeze(1).expand(bsz, steps, vocab)  # [B, T, V]
    if steps > 1:
        if draft_ids is None or draft_ids.shape != (bsz, steps - 1):
            raise ValueError(f"draft_ids must be [B, T-1] = {(bsz, steps - 1)} for {steps} slots")
        d = on_device(draft_ids, dev, torch.int64)
        one_hot = torch.zeros(bsz, steps, vocab, dtype=torch.float32, device=dev)
        one_hot[:, 1:].scatter_(-1, d.clamp(min=0).unsqueeze(-1), (d >= 0).float().unsqueeze(-1))
        counts = counts + one_hot.cumsum(dim=1)  # slot j: the history and drafts 0..j-1
    in_output = counts > 0
    seen = on_device(history.seen, dev).unsqueeze(1) | in_output
    rep = on_device(sb.repetition, dev).view(bsz, 1, 1)
    penalty = torch.where(seen, rep, torch.ones_like(rep))
    x = torch.where(x > 0, x / penalty, x * penalty)
    x = x - on_device(sb.frequency, dev).view(bsz, 1, 1) * counts
    return x - on_device(sb.presence, dev).view(bsz, 1, 1) * in_output.float()


def raw_logprobs(
    logits: torch.Tensor,  # [N, V] raw logits
    tokens: torch.Tensor,  # [N] int64
    top: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # [N], [N, top] int64, [N, top] float32
    """log_softmax of the raw logits (before penalties, temperature and filters: vLLM's default
    `logprobs_mode`, "raw_logprobs"): each token's log-probability and the `top` most likely tokens with theirs
    (descending)."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    chosen = lp.gather(-1, on_device(tokens, lp.device).view(-1, 1)).squeeze(-1)
    if top <= 0:
        return chosen, torch.zeros(lp.shape[0], 0, dtype=torch.int64), lp.new_zeros(lp.shape[0], 0)
    vals, ids = torch.topk(lp, min(top, lp.shape[-1]), dim=-1)
    return chosen, ids, vals


# --------------------------------------------------------------------------------------------------
# Logits -> the distribution plain sampling draws from
# --------------------------------------------------------------------------------------------------


def _filter_thresholds(
    x: torch.Tensor,  # [R, V] float32 temperature-scaled logits
    top_k: torch.Tensor,  # [R] int64
    top_p: torch.Tensor,  # [R] float32
    host: Sequence[SamplingParams] | None = None,
) -> torch.Tensor:  # [R, 1] float32
    """Per-row logit threshold: tokens whose scaled logit is below it are filtered out. Masks x in place.

    Avoids a full sort of the vocabulary: top-k needs the k largest logits, and top-p only the sorted
    prefix that reaches top_p, found with `topk` on a candidate count that grows x8 for the rows whose
    prefix was too short (a full sort only for very flat rows). `host`: the parameters of the rows (any
    repetition of them), so that the branches read no tensor.
    """
    rows, vocab = x.shape
    neg_inf = torch.full((rows, 1), float("-inf"), device=x.device)
    k = top_k.clamp(max=vocab).unsqueeze(-1)  # [R, 1]
    thr = neg_inf
    if host is not None:
        k_max = max((min(p.top_k, vocab) for p in host), default=0)
        any_p, every_row = any(_f32(p.top_p) < 1 for p in host), all(_f32(p.top_p) < 1 for p in host)
    else:
        k_max = int(k.max()) if rows else 0
        use_p = top_p < 1
        any_p, every_row = bool(use_p.any()), bool(use_p.all())
    if k_max > 0:
        kth = torch.topk(x, k_max, dim=-1).values.gather(-1, (k - 1).clamp(min=0))
        thr = torch.where(k > 0, kth, neg_inf)
        x.masked_fill_(x < thr, float("-inf"))  # in place: the caller applies a threshold >= thr anyway
    if not any_p:
        return thr
    use_p = top_p < 1
    p_rows = use_p.nonzero().squeeze(-1)
    xs = x if every_row else x.index_select(0, p_rows)  # [P, V] (no copy in the common all-rows case)
    goal = top_p.index_select(0, p_rows).double().unsqueeze(-1)  # [P, 1]
    # log-normaliser with a float64 sum (float32 exp): cumulative masses are then accurate to ~1e-7.
    top = xs.amax(dim=-1, keepdim=True)  # [P, 1], finite: the top token survives top-k
    lse = top.double() + torch.log(torch.exp(xs - top).sum(dim=-1, keepdim=True, dtype=torch.float64))
    thr_p = torch.empty((p_rows.shape[0], 1), device=x.device)
    pending = torch.arange(p_rows.shape[0], device=x.device)
    m = min(vocab, _TOP_P_CANDIDATES)
    while True:
        vals = torch.topk(xs, m, dim=-1).values  # [P', m] descending
        csum = torch.exp(vals.double() - lse).cumsum(dim=-1)
        done = (csum[:, -1:] >= goal).squeeze(-1) | (m == vocab)
        n_keep = ((csum < goal).sum(dim=-1, keepdim=True) + 1).clamp(max=m)
        thr_p[pending[done]] = vals.gather(-1, n_keep - 1)[done]
        if bool(done.all()):
            break
        # Rows whose prefix was too short (flat distributions) try again with 8x more candidates.
        pending, xs, lse, goal = pending[~done], xs[~done], lse[~done], goal[~done]
        m = min(vocab, m * 8)
    if every_row:
        return torch.maximum(thr, thr_p)
    return thr.index_put((p_rows,), torch.maximum(thr.index_select(0, p_rows), thr_p))


def processed_probs(
    logits: torch.Tensor,  # [B, T, V] any float dtype
    sb: SamplingBatch,
) -> torch.Tensor:  # [B, T, V] float32
    """The distribution plain sampling from these logits would draw from, per row's parameters.

    Order: logits / temperature, then min_p, then top-k, then top-p, then softmax (vLLM's order; penalties come
    before, on the logits: `apply_penalties`). Filters are *value thresholds*, so ties are resolved by keeping
    every tied token (and the result never depends on sort order):

    - min_p keeps every token whose probability is >= min_p times the top token's (x - max x >= log min_p);
    - top-k keeps every token whose logit is >= the k-th largest logit (may keep more than k on ties);
    - top-p takes the smallest prefix of tokens by decreasing probability whose cumulative probability
      (of the top-k renormalised distribution, summed in float64) is >= top_p, and keeps every token whose
      logit is >= the smallest logit of that prefix. The top token is always kept. top_p == 1 is off.

    Rows with temperature 0 give a one-hot at the argmax of the given logits (first index on ties), so
    every verification method reduces to greedy verification on them.
    """
    if logits.dim() != 3:
        raise ValueError(f"logits must be [B, T, V], got shape {tuple(logits.shape)}")
    bsz, steps, vocab = logits.shape
    if len(sb) != bsz:
        raise ValueError(f"SamplingBatch has {len(sb)} rows, logits have {bsz}")
    if logits.numel() == 0:
        return torch.zeros(logits.shape, dtype=torch.float32, device=logits.device)
    dev = logits.device
    host = sb.host
    if host is not None and all(_host_greedy(p) for p in host):  # one-hots only: no scaling, filters or softmax
        return torch.zeros(logits.shape, dtype=torch.float32, device=dev).scatter_(
            -1, logits.argmax(dim=-1, keepdim=True), 1.0)
    temp = on_device(sb.temperature, dev, torch.float32)
    greedy = temp == 0
    x = logits.float() / torch.where(greedy, torch.ones_like(temp), temp).view(bsz, 1, 1)
    top_k = on_device(sb.top_k, dev)
    top_p = on_device(sb.top_p, dev, torch.float32)
    if host is not None:  # the tensors' tests below, on the host (float32 values)
        filtered = [not _host_greedy(p) and (0 < p.top_k < vocab or _f32(p.top_p) < 1) for p in host]
        any_filter, all_filter, any_greedy = any(filtered), all(filtered), any(_host_greedy(p) for p in host)
    else:
        needs_filter = ~greedy & ((top_k > 0) & (top_k < vocab) | (top_p < 1))
        any_filter, all_filter, any_greedy = bool(needs_filter.any()), bool(needs_filter.all()), bool(greedy.any())
    if sb.min_p is not None:
        min_p = on_device(sb.min_p, dev, torch.float32)
        use_min_p = ~greedy & (min_p > 0)
        if (any(not _host_greedy(p) and _f32(p.min_p) > 0 for p in host) if host is not None
                else bool(use_min_p.any())):
            # vLLM's min_p: drop p(v) < min_p * max p, i.e. x_v - max x < log(min_p) (in float64)
            log_min = torch.where(use_min_p, min_p.double().log(), float("-inf")).view(bsz, 1, 1)
            drop = (x.double() - x.amax(dim=-1, keepdim=True).double()) < log_min
            x = x.masked_fill_(drop, float("-inf"))
    if all_filter:  # no gather/scatter copies of the (large) logits
        flat = x.view(-1, vocab)
        thr = _filter_thresholds(flat, top_k.repeat_interleave(steps), top_p.repeat_interleave(steps), host)
        x = flat.masked_fill_(flat < thr, float("-inf")).view(bsz, steps, vocab)
    elif any_filter:
        if host is not None:
            rows = torch.tensor([i for i, f in enumerate(filtered) if f], dtype=torch.int64, device=dev)
        else:
            rows = needs_filter.nonzero().squeeze(-1)
        sub = x.index_select(0, rows).view(-1, vocab)  # [R*T, V]
        thr = _filter_thresholds(
            sub, top_k[rows].repeat_interleave(steps), top_p[rows].repeat_interleave(steps),
            None if host is None else [p for p, f in zip(host, filtered) if f],
        )
        sub = sub.masked_fill_(sub < thr, float("-inf")).view(-1, steps, vocab)
        x = x.index_copy_(0, rows, sub)
    probs = torch.softmax(x, dim=-1)
    if any_greedy:
        one_hot = torch.zeros_like(probs).scatter_(-1, logits.argmax(dim=-1, keepdim=True), 1.0)
        probs = torch.where(greedy.view(bsz, 1, 1), one_hot, probs)
    return probs
