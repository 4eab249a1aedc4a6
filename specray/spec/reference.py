"""Slow, obviously-correct per-row implementations used to check the batched code in tests.

Everything here loops over rows, slots and vocabulary entries in Python, following the textbook
definitions one step at a time. It draws the same keyed noise as the batched code and does its
arithmetic in float64 in the same order, so for identical inputs it returns identical tokens.
"""

from __future__ import annotations

import math

import torch

from specray.spec.noise import accept_stream, gumbel_noise, keyed_uniform, residual_stream
from specray.spec.params import PLACEHOLDER_TOKEN_ID, VerifyMethod
from specray.spec.sampling import SamplingBatch
from specray.spec.tree import DraftTree
from specray.spec.tree_verify import TreeVerifyOutput
from specray.spec.verify import RESIDUAL_EPS, VerifyOutput

__all__ = [
    "ref_coupled_token",
    "ref_inverse_cdf",
    "ref_penalized_logits_row",
    "ref_processed_probs_row",
    "ref_sample_token",
    "ref_uniform",
    "ref_verify",
    "ref_verify_row",
    "ref_verify_tree",
    "ref_verify_tree_row",
]


def ref_uniform(seed: int, position: int, stream: int, index: int = 0) -> float:
    """The keyed uniform of one (seed, position, stream, index)."""
    return float(keyed_uniform(torch.tensor([seed]), torch.tensor([position]), stream, index + 1)[0, index])


def _first_argmax(values: list[float]) -> int:
    best = 0
    for i, v in enumerate(values):
        if v > values[best]:
            best = i
    return best


def ref_penalized_logits_row(
    logits: torch.Tensor,  # [V]
    prompt: list[int],
    output: list[int],
    presence: float,
    frequency: float,
    repetition: float,
) -> torch.Tensor:  # [V] float32
    """vLLM's penalties on one row, token by token: repetition over the prompt and the output, then frequency
    (times the count in the output), then presence (once for a token in the output); float32 arithmetic."""
    f32 = torch.float32
    rep, freq, pres = (torch.tensor(v, dtype=f32) for v in (repetition, frequency, presence))
    out = []
    for v, x in enumerate(logits.float()):
        count = output.count(v)
        if v in prompt or count:
            x = x / rep if x > 0 else x * rep
        x = x - freq * torch.tensor(float(count), dtype=f32)
        x = x - pres * torch.tensor(1.0 if count else 0.0, dtype=f32)
        out.append(x)
    return torch.stack(out)


def ref_processed_probs_row(
    logits: torch.Tensor,  # [V]
    temperature: float,
    top_k: int,
    top_p: float,
    min_p: float = 0.0,
) -> torch.Tensor:  # [V] float32
    """Temperature, then min_p, then top-k, then top-p, then softmax, for one row; ties at a cut are all kept."""
    vocab = logits.shape[0]
    if temperature == 0:
        out = torch.zeros(vocab, dtype=torch.float32)
        out[_first_argmax(logits.float().tolist())] = 1.0
        return out
    x = (logits.float() / torch.tensor(temperature, dtype=torch.float32)).tolist()
    if min_p > 0:  # p(v) >= min_p * max p  <=>  x_v - max x >= log(min_p)
        log_min = float(torch.tensor(min_p, dtype=torch.float32).double().log())
        top = max(x)
        x = [v if v - top >= log_min else -math.inf for v in x]
    if 0 < top_k < vocab:
        kth = sorted(x, reverse=True)[top_k - 1]
        x = [v if v >= kth else -math.inf for v in x]
    top_p = float(torch.tensor(top_p, dtype=torch.float32))  # the batch stores top_p as float32
    if top_p < 1:
        top = max(x)
        exps = [math.exp(v - top) for v in x]  # float64 softmax of the top-k survivors
        norm = math.fsum(exps)
        probs = [e / norm for e in exps]
        cum = 0.0
        cut = 0.0
        for prob in sorted(probs, reverse=True):  # smallest prefix reaching top_p
            cum += prob
            cut = prob
            if cum >= top_p:
                break
        x = [v if prob >= cut else -math.inf for v, prob in zip(x, probs, strict=True)]
    return torch.softmax(torch.tensor(x, dtype=torch.float32), dim=0)


def ref_inverse_cdf(weights: list[float], u: float) -> int:
    """First index whose running sum exceeds u * total (float64, left to right)."""
    total = 0.0
    for w in weights:
        total += w
    r = u * total
    cum = 0.0
    for i, w in enumerate(weights):
        cum += w
        if cum > r:
            return i
    return len(weights) - 1


def ref_coupled_token(probs: torch.Tensor, seed: int, position: int) -> int:  # probs [V]
    """argmax_v log p(v) + g_v with the coupled Gumbel noise of (seed, position)."""
    g = gumbel_noise(torch.tensor([seed]), torch.tensor([position]), probs.shape[0])[0].tolist()
    scores = [
        (math.log(p) if p > 0 else -math.inf) + gv for p, gv in zip(probs.double().tolist(), g, strict=True)
    ]
    return _first_argmax(scores)


def ref_sample_token(probs: torch.Tensor, seed: int, position: int, mode: str, salt: int) -> int:  # [V]
    if mode == "greedy":
        return _first_argmax(probs.tolist())
    if mode == "random":
        return ref_inverse_cdf(probs.double().tolist(), ref_uniform(seed, position, residual_stream(salt)))
    if mode == "coupled":
        return ref_coupled_token(probs, seed, position)
    raise ValueError(mode)


def ref_verify_row(
    method: VerifyMethod,
    target_probs: torch.Tensor,  # [K+1, V]
    drafts: list[int],  # the row's real draft tokens (no padding)
    draft_probs: torch.Tensor | None,  # [K, V] (REJECTION)
    seed: int,
    position: int,
    salt: int,
) -> list[int]:
    """Emitted tokens of one row: walk the draft slot by slot, stop at the first rejection."""
    method = VerifyMethod(method)
    out: list[int] = []
    for j, x in enumerate(drafts):
        p = target_probs[j].double().tolist()
        if method in (VerifyMethod.GREEDY, VerifyMethod.COUPLED):
            if method == VerifyMethod.GREEDY:
                y = _first_argmax(p)
            else:
                y = ref_coupled_token(target_probs[j], seed, position + j)
            out.append(y)
            if y != x:
                return out
            continue
        u = ref_uniform(seed, position + j, accept_stream(salt))
        accepted, residual = _ref_accept(method, u, p, draft_probs, j, x)
        if accepted:
            out.append(x)
            continue
        if sum(residual) <= RESIDUAL_EPS:
            residual = p
        out.append(ref_inverse_cdf(residual, ref_uniform(seed, position + j, residual_stream(salt))))
        return out
    n = len(drafts)  # everything accepted: bonus token from slot n
    mode = {VerifyMethod.GREEDY: "greedy", VerifyMethod.COUPLED: "coupled"}.get(method, "random")
    out.append(ref_sample_token(target_probs[n], seed, position + n, mode, salt))
    return out


def ref_verify(
    method: VerifyMethod,
    target_probs: torch.Tensor,  # [B, K+1, V]
    draft_ids: torch.Tensor,  # [B, K]
    draft_probs: torch.Tensor | None,  # [B, K, V]
    sb: SamplingBatch,
    positions: torch.Tensor,  # [B]
    salt: int,
) -> VerifyOutput:
    """`verify`, one row at a time."""
    bsz, slots, _ = target_probs.shape
    out = torch.full((bsz, slots), PLACEHOLDER_TOKEN_ID, dtype=torch.int64)
    num_accepted = torch.zeros(bsz, dtype=torch.int64)
    for b in range(bsz):
        drafts: list[int] = []
        for t in draft_ids[b].tolist():
            if t == PLACEHOLDER_TOKEN_ID:
                break
            drafts.append(t)
        emitted = ref_verify_row(
            method,
            target_probs[b],
            drafts,
            None if draft_probs is None else draft_probs[b],
            int(sb.seed[b]),
            int(positions[b]),
            salt,
        )
        out[b, : len(emitted)] = torch.tensor(emitted)
        num_accepted[b] = len(emitted) - 1
    return VerifyOutput(output_ids=out, num_accepted=num_accepted)


def _seq_sum(values: list[float]) -> float:
    total = 0.0
    for v in values:
        total += v
    return total


def ref_verify_tree_row(
    method: VerifyMethod,
    target_probs: torch.Tensor,  # [N+1, V]: slot 0 after the root, slot i+1 after node i
    tree: DraftTree,
    draft_probs: torch.Tensor | None,  # [N+1 or N, V] (REJECTION): the q each slot's children were drawn from
    seed: int,
    position: int,  # absolute position of the root's children
    salt: int,
) -> tuple[list[int], int]:
    """(accepted path, final token) of one row: walk down the tree, trying each node's children in order."""
    method = VerifyMethod(method)
    path: list[int] = []
    node = -1
    while True:
        slot, depth = node + 1, len(path)
        kids = tree.children(node)
        if method in (VerifyMethod.GREEDY, VerifyMethod.COUPLED):
            if method == VerifyMethod.GREEDY:
                y = _first_argmax(target_probs[slot].tolist())
            else:
                y = ref_coupled_token(target_probs[slot], seed, position + depth)
            nxt = next((c for c in kids if tree.token_ids[c] == y), None)
            if nxt is None:
                return path, y
            path.append(nxt)
            node = nxt
            continue
        p = target_probs[slot].double().tolist()
        weights = p
        chosen = None
        for j, c in enumerate(kids):
            x = tree.token_ids[c]
            u = ref_uniform(seed, position + depth, accept_stream(salt), j)
            accepted, residual = _ref_accept(method, u, p, draft_probs, slot, x)
            if accepted:
                chosen = c
                break
            mass = _seq_sum(residual)
            if mass > RESIDUAL_EPS:  # the next sibling is tried against the renormalised residual
                weights = residual
                p = [r / mass for r in residual]
            else:
                weights = p
        if chosen is None:
            return path, ref_inverse_cdf(weights, ref_uniform(seed, position + depth, residual_stream(salt)))
        path.append(chosen)
        node = chosen


def ref_verify_tree(
    method: VerifyMethod,
    target_probs: torch.Tensor,  # [B, N+1, V]
    trees: list[DraftTree],
    draft_probs: torch.Tensor | None,  # [B, N+1 or N, V]
    sb: SamplingBatch,
    positions: torch.Tensor,  # [B]
    salt: int,
) -> TreeVerifyOutput:
    """`verify_tree`, one row at a time."""
    bsz, slots, _ = target_probs.shape
    out = torch.full((bsz, slots), PLACEHOLDER_TOKEN_ID, dtype=torch.int64)
    paths = torch.full((bsz, slots - 1), -1, dtype=torch.int64)
    num_accepted = torch.zeros(bsz, dtype=torch.int64)
    for b, tree in enumerate(trees):
        path, final = ref_verify_tree_row(
            method, target_probs[b], tree, None if draft_probs is None else draft_probs[b],
            int(sb.seed[b]), int(positions[b]), salt,
        )
        emitted = [tree.token_ids[i] for i in path] + [final]
        out[b, : len(emitted)] = torch.tensor(emitted)
        paths[b, : len(path)] = torch.tensor(path, dtype=torch.int64)
        num_accepted[b] = len(path)
    return TreeVerifyOutput(output_ids=out, num_accepted=num_accepted, path=paths)


def _ref_accept(method: VerifyMethod, u: float, p: list[float], draft_probs: torch.Tensor | None, slot: int,
                x: int) -> tuple[bool, list[float]]:
    """One accept test of draft token x against p (a row's slot), and the residual to sample from if it fails:
    rejection (q = draft_probs[slot]) or its q = delta_x case."""
    if method == VerifyMethod.REJECTION:
        assert draft_probs is not None
        q = draft_probs[slot].double().tolist()
        return u * q[x] < p[x], [max(pv - qv, 0.0) for pv, qv in zip(p, q, strict=True)]
    return u < p[x], [0.0 if v == x else pv for v, pv in enumerate(p)]
