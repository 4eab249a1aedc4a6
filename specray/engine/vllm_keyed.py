"""Keyed noise inside vLLM's step: seeded rows at temperature > 0 decoded and verified by the engine itself.

A seeded request is verified by the coupled method (`specray.spec.noise`): at every position p the target emits
y_p = argmax_v log p_p(v) + g(seed, p)[v], with p_p the processed distribution (temperature, top-k, top-p) and g
keyed Gumbel noise, so its output depends on (seed, target) alone, never on which level drafted. vLLM's sampler
draws with its own generator, so such rows used to be scored outside the engine's step (a prefill of the row's
tail per round). Here the row runs as a *greedy* vLLM request whose logits, at every position the step scores, are
replaced by a one-hot at y_p: vLLM's greedy sampler then emits y_p on a plain step, and its greedy rejection sampler
accepts a draft token exactly when it equals y_p and emits y_p after the last accepted one (correction or bonus).
That is coupled verification, token for token the hf backend's (`tests/unit/test_vllm_worker.py`).

vLLM 0.32 applies a custom logits processor to the sampled row of each request only, and refuses one on an engine
with a speculative config. `install` (before an engine starts) therefore adds `KeyedNoise` to every engine's
processors and has the rejection sampler call it on the draft positions too (`apply_drafts`), with each request's
draft count known while it samples the bonus rows (`bonus_offsets`). A request opts in through its
`extra_args[KEY]` (`keyed_args`); every other request is untouched, and a step without such a request costs a
dictionary lookup. Rows with min_p or penalties are not served this way (the worker scores them, as before).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch

from specray.spec.noise import coupled_argmax
from specray.spec.params import SamplingParams
from specray.spec.sampling import SamplingBatch, processed_probs

__all__ = ["KEY", "KeyedNoise", "install", "keyed_args"]

#: the `extra_args` entry that marks a vLLM request as keyed: [seed, temperature, top_k, top_p]
KEY = "specray_keyed"


def keyed_args(sp: SamplingParams) -> dict[str, Any]:
    """The vLLM `SamplingParams.extra_args` of a keyed request drawing like `sp` (its seed must be concrete)."""
    if sp.seed is None:
        raise ValueError("a keyed request needs a concrete seed")
    return {KEY: [int(sp.seed), float(sp.temperature), int(sp.top_k), float(sp.top_p)]}


class KeyedNoise:
    """A vLLM logits processor (duck-typed to `vllm.v1.sample.logits_processor.LogitsProcessor`) that turns each
    keyed request's logits into a one-hot at its coupled token (module docstring). State per persistent-batch
    index: the request's params, prompt length and live output list (vLLM appends to it), from `update_state`."""

    def __init__(self, vllm_config: Any = None, device: Any = None, is_pin_memory: bool = False) -> None:
        self._rows: dict[int, tuple[SamplingParams, int, list[int]]] = {}
        #: while the rejection sampler runs: each request's draft count in this step (its bonus row follows them)
        self.bonus_offsets: Sequence[int] | None = None

    def is_argmax_invariant(self) -> bool:
        return False  # it decides the argmax

    def update_state(self, batch_update: Any) -> None:
        """vLLM's persistent-batch changes, in its order: removed, added, moved (unidirectional or swapped)."""
        if batch_update is None:
            return
        rows = self._rows
        for index in batch_update.removed:
            rows.pop(index, None)
        for index, params, prompt, output in batch_update.added:
            key = (getattr(params, "extra_args", None) or {}).get(KEY)
            if key is None:
                rows.pop(index, None)
            else:
                seed, temperature, top_k, top_p = key
                rows[index] = (SamplingParams(float(temperature), int(top_k), float(top_p), int(seed)),
                               len(prompt or ()), output)
        for a, b, direction in batch_update.moved:
            ra, rb = rows.pop(a, None), rows.pop(b, None)
            if ra is not None:
                rows[b] = ra
            if rb is not None and getattr(direction, "name", "") == "SWAP":
                rows[a] = rb

    def _position(self, index: int) -> int:
        """The absolute position of the next token of the request at `index` (its prompt and committed output)."""
        _sp, prompt_len, output = self._rows[index]
        return prompt_len + len(output)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:  # [B, V]: one row per request, in batch order
        """The sampled row of each keyed request (its bonus row in a speculative step: after its drafts)."""
        if not self._rows:
            return logits
        offsets = self.bonus_offsets
        rows = [i for i in self._rows if i < logits.shape[0]]
        positions = [self._position(i) + (int(offsets[i]) if offsets is not None and i < len(offsets) else 0)
                     for i in rows]
        return self._one_hot(logits, rows, [self._rows[i][0] for i in rows], positions)

    def apply_drafts(self, logits: torch.Tensor, num_draft_tokens: Sequence[int]) -> torch.Tensor:
        """The draft positions of a speculative step: logits [sum(num_draft_tokens), V], each request's draft
        positions in batch order (the rejection sampler's target logits)."""
        if not self._rows:
            return logits
        rows: list[int] = []
        params: list[SamplingParams] = []
        positions: list[int] = []
        start = 0
        for i, n in enumerate(num_draft_tokens):
            if n and i in self._rows:
                base = self._position(i)
                for j in range(int(n)):
                    rows.append(start + j)
                    params.append(self._rows[i][0])
                    positions.append(base + j)
            start += int(n)
        return self._one_hot(logits, rows, params, positions)

    @staticmethod
    def _one_hot(logits: torch.Tensor, rows: list[int], params: list[SamplingParams],
                 positions: list[int]) -> torch.Tensor:
        """logits[rows] := 0 at each row's coupled token, -inf elsewhere (in place; returns `logits`)."""
        if not rows:
            return logits
        idx = torch.tensor(rows, dtype=torch.long, device=logits.device)
        sb = SamplingBatch.from_params(params, device=logits.device)
        probs = processed_probs(logits[idx].float().unsqueeze(1), sb)[:, 0]  # [M, V]
        pos = torch.tensor(positions, dtype=torch.long, device=logits.device)
        tok = coupled_argmax(probs, sb.seed, pos)  # [M]
        hot = torch.full((len(rows), logits.shape[1]), float("-inf"), dtype=logits.dtype, device=logits.device)
        hot.scatter_(1, tok.view(-1, 1), 0.0)
        logits[idx] = hot
        return logits


def _keyed(sampling_metadata: Any) -> list[KeyedNoise]:
    procs = getattr(getattr(sampling_metadata, "logitsprocs", None), "non_argmax_invariant", ())
    return [p for p in procs if isinstance(p, KeyedNoise)]


@functools.cache
def install() -> None:
    """Wire `KeyedNoise` into every vLLM engine this process starts from now on (module docstring): added to the
    processors each model runner builds, applied by the rejection sampler to draft positions, and told each
    request's draft count while the bonus rows are sampled. Idempotent."""
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.rejection_sampler import RejectionSampler
    from vllm.v1.worker import gpu_model_runner

    build = gpu_model_runner.build_logitsprocs

    def build_logitsprocs(vllm_config: Any, device: Any, is_pin_memory: bool, *args: Any, **kwargs: Any) -> Any:
        procs = build(vllm_config, device, is_pin_memory, *args, **kwargs)
        return LogitsProcessors([*procs.all, KeyedNoise(vllm_config, device, is_pin_memory)])

    gpu_model_runner.build_logitsprocs = build_logitsprocs

    apply_logits_processors = RejectionSampler.apply_logits_processors
    forward = RejectionSampler.forward

    def apply_with_drafts(self: Any, logits: torch.Tensor, sampling_metadata: Any, metadata: Any) -> torch.Tensor:
        logits = apply_logits_processors(self, logits, sampling_metadata, metadata)
        for proc in _keyed(sampling_metadata):
            logits = proc.apply_drafts(logits, metadata.num_draft_tokens)
        return logits

    def forward_with_offsets(self: Any, metadata: Any, draft_probs: Any, logits: torch.Tensor,
                             sampling_metadata: Any) -> Any:
        procs = _keyed(sampling_metadata)
        for proc in procs:
            proc.bonus_offsets = list(metadata.num_draft_tokens)
        try:
            return forward(self, metadata, draft_probs, logits, sampling_metadata)
        finally:
            for proc in procs:
                proc.bonus_offsets = None

    RejectionSampler.apply_logits_processors = apply_with_drafts
    RejectionSampler.forward = forward_with_offsets
