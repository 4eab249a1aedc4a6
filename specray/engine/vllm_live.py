"""Live engine requests for the `vllm` backend: plain rows (and engine-verified drafts) served by steps of
vLLM requests kept alive across rounds.

Live decoding (plain rows)
--------------------------
Re-submitting a sequence every round would make plain decoding over this backend pay a prefill of the
block tail per token. So a row verified with an *empty* draft at temperature 0 (a plain-decoding round, or
an n-gram level that found no match) is a *live row*: it is served by ONE scheduler step of a vLLM request
that stays alive across rounds (``LLMEngine.add_request`` / ``step``, output kind DELTA), exactly as vLLM's
own generation loop runs it, and the tokens that step produced are returned. The worker records the tokens
each live request produced and checks them against the coordinator's text at every call: while the
coordinator's tokens are a prefix of the request's, the request goes on; where they differ (a row that was
rolled back, or served by another plan) it is aborted and re-added with the coordinator's tokens (a prefill
mostly served from the prefix cache).

Every engine step advances every live request, also those of sequences outside the current call (another
plan group this round, an exploration probe, a sequence that just finished). Such a request may run ONE
step ahead; before the next step, a request outside the call that still holds unserved tokens is aborted,
so a sequence that comes back next round keeps its warm request and a finished one costs at most one wasted
step. Every other engine request (scoring, proposals) runs through the same step loop, because
``LLM.generate`` would run each live request to its end. A call made only of live rows is reported as
``stepped``, so the coordinator times it apart from prompt scoring (kind "native"): the planner then prices
plain decoding (and engine verification, below) at the engine's decode speed. `specray.engine.vllm_native` builds on
this: the same live requests, on an engine that speculates by itself. ``live_decode=False`` turns it off.

Temperature > 0
---------------
vLLM's sampler draws with its own generator, not specray's keyed noise. That is exact in distribution for a
plain step (a sample from p) and for a deterministic draft verified in the step (vLLM's rejection sampler
without draft probabilities: accept x with probability p(x), else a sample from p with x removed), with vLLM
applying the row's temperature, top-k and top-p as plain vLLM sampling does. So a sampled row is live where
nobody can ask for its output again (`SamplingParams.reproducible` False: the request gave no seed) and its
method needs nothing but fresh randomness: plain rows, and deterministic drafts (n-gram, greedy model drafts).
Coupled verification (what seeded rows use: its keyed noise makes a seed's output independent of the drafter) is
live too on an in-process engine: the row runs as a greedy request whose logits are replaced by its coupled tokens
inside the step (`specray.engine.vllm_keyed`), so a plain step samples and a drafted step verifies exactly as the
hf backend does. Other seeded rows, rows with min_p or penalties, and rejection over a sampled draft (q must travel
with it) decode through scoring and keyed sampling. The live
request is added without a seed: a request re-added at a new position must not replay its random stream.

Engine verification (``engine_verify`` = E > 0)
-----------------------------------------------
Prompt scoring re-submits the sequence and its draft and costs several decode steps on a CPU. With
``engine_verify`` the engine is started with a speculative config, and a greedy row *with* a draft is a live
row too: before the step, the draft is handed to the scheduler as the request's ``spec_token_ids`` (replacing
what vLLM's own proposer put there; an empty list for a plain row), and vLLM verifies it inside its step with
its greedy rejection sampler, on KV it already holds. A row's tokens from the step are the target's greedy
tokens, so the row emits them up to the first one that differs from the draft (the correction) or one past
the draft's end (the bonus); a draft longer than E, or a request whose first step was a prefill, takes more
steps until the draft is decided (the coordinator sends a sequence's first round here without a draft,
`specray.coordinator.round`, so a prefill holds no first token back). Exact at temperature 0 by construction
(only the engine's greedy tokens are emitted); a round of specray's n-gram or draft model costs one engine
step, as vLLM's own speculation.
The engine runs in-process (the worker writes to its scheduler's requests).

Confidence (a level with ``draft_confidence``)
---------------------------------------------
A call that asks for the probability of each token (``verify(confidence=True)``, ``propose(stop_below=)``)
runs on live requests that return the produced token's logprob (``logprobs=0``; raw logprobs: the softmax of
the logits, as the hf backend reports a greedy row's); a live request made without them is re-added with them. A
greedy draft with a stop runs on live requests too, one engine step per token, and a row stops after its first
unsure token while the others go on (`_propose_live`); those that stopped keep stepping meanwhile, and their
extra tokens are kept, so that the next call may continue them.

`LiveRequests` is a mixin of `specray.engine.vllm.VLLMWorker` (it owns this state; the worker's constructor
sets it): ``engine`` (the LLMEngine), ``_live`` (seq id -> `_Live`), ``_keep`` (live requests allowed to
advance in the current call), ``_ids``, ``_scheduler`` (engine verification), ``live_decode``,
``engine_verify``, ``keyed``, ``_own_drafts``, ``max_context``, ``max_num_seqs``, and the counters ``engine_calls``,
``engine_seconds``, ``live_steps``, ``live_restarts``, ``live_served_tokens``, ``unserved``. Its step loop
(`_step`) is also the one every other engine request of the worker runs through.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from specray.engine.protocol import VerifyResult
from specray.engine.vllm_keyed import keyed_args
from specray.spec.params import SamplingParams, VerifyMethod

__all__ = ["LiveRequests"]


def _draws_sampled(sp: SamplingParams, keyed: bool, greedy: bool = False) -> bool:
    """Whether a live request for this row samples at its temperature with vLLM's generator (else it takes the
    argmax: greedy rows, greedy drafts, and keyed rows, whose logits carry the row's coupled tokens)."""
    return sp.temperature != 0 and not keyed and not greedy


def _token_probs(logprobs: Any, new: Sequence[int], name: str) -> list[float]:
    """The probability of each of the `new` tokens of one engine step, from the request's (delta) logprobs: a
    `FlatLogprobs` or vLLM's list of {token: Logprob} per position, the last len(new) positions being theirs."""
    if logprobs is None or len(logprobs) < len(new):
        raise RuntimeError(f"{name}: the engine returned logprobs for {0 if logprobs is None else len(logprobs)} "
                           f"positions of a step that produced {len(new)} tokens")
    first = len(logprobs) - len(new)
    if hasattr(logprobs, "start_indices"):  # FlatLogprobs
        probs = []
        for i, tok in enumerate(new):
            a, b = logprobs.start_indices[first + i], logprobs.end_indices[first + i]
            ids = logprobs.token_ids[a:b]
            probs.append(math.exp(logprobs.logprobs[a + ids.index(tok)]))
        return probs
    return [math.exp(logprobs[first + i][tok].logprob) for i, tok in enumerate(new)]

#: vLLM engines in one process share its forward context (a process-global), so two of them must not step at
#: once: an in-process cascade with overlap steps its drafter's engine on a second thread. Their steps take
#: turns here (correct, not parallel); served levels run each engine in its own actor process and overlap.
_ENGINE_STEP = threading.Lock()


@dataclass
class _Chunk:
    """Tokens one engine step produced for a live request: positions [start, end) of its text; the draft
    tokens the engine's own speculation verified in that step and how many it accepted (0, 0 without)."""

    start: int
    end: int
    drafts: int = 0
    accepted: int = 0


@dataclass
class _Live:
    """A vLLM request that keeps running across rounds for one sequence."""

    ext_id: str
    int_id: str
    tokens: list[int]  # prompt + everything vLLM produced for it so far
    base: int  # length of the prompt it was added with: it can serve positions from there on
    chunks: list[_Chunk] = field(default_factory=list)
    served: int = 0  # tokens[:served] are known to the coordinator
    finished: bool = False
    keyed: bool = False  # a greedy request drawing the row's coupled tokens (`specray.engine.vllm_keyed`)
    sampled: bool = False  # draws at the row's temperature with vLLM's own generator (else greedy)
    #: the probability the engine gave each token it produced, tokens[base:] (raw softmax: the engine runs with
    #: raw_logprobs); None: the request asks for no logprobs (`_ensure_live(..., confidence=True)` does)
    probs: list[float] | None = None


class LiveRequests:
    """The live-request half of `VLLMWorker` (module docstring)."""

    name: str
    engine: Any
    keyed: bool

    def _abort(self, seq_ids: Sequence[str]) -> None:
        gone = [self._live.pop(s) for s in seq_ids if s in self._live]
        for lv in gone:
            for c in lv.chunks:
                if c.start >= lv.served:
                    self.unserved["tokens"] += c.end - c.start
                    if c.drafts:
                        self.unserved["drafts"] += 1
                        self.unserved["draft_tokens"] += c.drafts
                        self.unserved["accepted_tokens"] += c.accepted
        ids = [lv.ext_id for lv in gone if not lv.finished]
        if ids:
            self.engine.abort_request(ids)

    def _spec_before(self) -> dict[str, Any]:
        """Hook (native level): per live sequence, the state of the engine's own speculation counters."""
        return {}

    def _spec_step(self, seq_id: str, before: dict[str, Any]) -> tuple[int, int]:
        """Hook (native level): (draft tokens, accepted) of the engine's own speculation in the last step."""
        return 0, 0

    def _step(self) -> dict[str, Any]:
        """One scheduler step. Live requests outside the current call that already ran ahead (unserved tokens)
        are aborted first; the tokens of the others are recorded. Returns the finished outputs of the other
        requests (scoring, proposals)."""
        self._abort([s for s, lv in self._live.items() if s not in self._keep and len(lv.tokens) > lv.served])
        by_ext = {lv.ext_id: (s, lv) for s, lv in self._live.items()}
        before = self._spec_before()
        t0 = time.perf_counter()
        with _ENGINE_STEP:
            outs = self.engine.step()
        self.engine_seconds += time.perf_counter() - t0
        self.engine_calls += 1
        done: dict[str, Any] = {}
        for out in outs:
            hit = by_ext.get(out.request_id)
            if hit is None:
                if out.finished:
                    done[out.request_id] = out
                continue
            s, lv = hit
            new = [int(t) for t in out.outputs[0].token_ids]
            d, a = self._spec_step(s, before)
            if new:
                if d and a != len(new) - 1:
                    raise RuntimeError(f"{self.name}: vLLM accepted {a} drafts but emitted {len(new)} tokens")
                lv.chunks.append(_Chunk(len(lv.tokens), len(lv.tokens) + len(new), d, a))
                lv.tokens.extend(new)
                if lv.probs is not None:
                    lv.probs.extend(_token_probs(out.outputs[0].logprobs, new, self.name))
            if out.finished:
                lv.finished = True
        return done

    def _live_row(self, draft: Sequence[int], sp: SamplingParams, method: VerifyMethod, return_probs: bool) -> bool:
        """Whether the row is served by its live request (module docstring): greedy rows, coupled rows where the
        engine applies the keyed noise (`_keyed_row`), and sampled rows whose draws need no keyed noise."""
        if not self.live_decode or return_probs:
            return False
        if sp.temperature != 0 and not self._keyed_row(sp, method) and (
                sp.reproducible or method is VerifyMethod.COUPLED
                or (draft and method is not VerifyMethod.DETERMINISTIC) or sp.min_p > 0 or sp.penalized):
            return False  # min_p and penalties: the keyed path applies them as every level does
        return not draft or self.engine_verify > 0

    def _keyed_row(self, sp: SamplingParams, method: VerifyMethod) -> bool:
        """A sampled row verified by the coupled method that the engine serves with specray's keyed noise inside
        its step (`specray.engine.vllm_keyed`): a greedy request whose logits are its coupled tokens."""
        return (self.keyed and sp.temperature != 0 and method is VerifyMethod.COUPLED and sp.min_p == 0
                and not sp.penalized)

    def _set_drafts(self, lv: _Live, draft: Sequence[int]) -> None:
        """The draft the engine verifies for `lv` in its next step (replacing its own proposer's)."""
        req = self._scheduler.requests.get(lv.int_id) if self._scheduler is not None else None
        if req is None:
            raise RuntimeError(f"{self.name}: live request {lv.ext_id!r} is not in the scheduler")
        req.spec_token_ids = list(draft[: self.engine_verify])

    def _is_live(self, seq_id: str, toks: list[int], keyed: bool | None = None, sampled: bool | None = None,
                 confidence: bool = False) -> bool:
        """Whether the row's live request can serve the coordinator's tokens as they are, draws as asked
        (`keyed`, `sampled`; None: either way) and, with `confidence`, reports its tokens' probabilities."""
        lv = self._live.get(seq_id)
        n = len(toks)
        return lv is not None and lv.base <= n <= len(lv.tokens) and lv.tokens[:n] == toks and (
            len(lv.tokens) > n or not lv.finished) and (keyed is None or lv.keyed == keyed) and (
            sampled is None or lv.sampled == sampled) and (not confidence or lv.probs is not None)

    def _ensure_live(self, seq_id: str, toks: list[int], sampling: SamplingParams, keyed: bool = False,
                     greedy: bool = False, confidence: bool = False) -> _Live:
        """The live request of a row, consistent with the coordinator's tokens (re-added if not). `keyed`: a
        greedy request whose logits are the row's coupled tokens (`specray.engine.vllm_keyed`); `greedy`: the
        argmax whatever the row's temperature (greedy drafts); `confidence`: the engine also returns the
        probability of each token it produces (`_Live.probs`)."""
        lv = self._live.get(seq_id)
        n = len(toks)
        sampled = _draws_sampled(sampling, keyed, greedy)
        if self._is_live(seq_id, toks, keyed, sampled, confidence):
            return lv
        if lv is not None:
            self._abort([seq_id])
            self.live_restarts += 1
        from vllm import SamplingParams as VSamplingParams
        from vllm.sampling_params import RequestOutputKind

        if n >= self.max_context:
            raise ValueError(f"{self.name}: sequence {seq_id!r} of {n} tokens has no room left in the context")
        common = dict(max_tokens=self.max_context - n, ignore_eos=True, detokenize=False, skip_special_tokens=False,
                      output_kind=RequestOutputKind.DELTA)
        if confidence:
            common.update(logprobs=0, flat_logprobs=True)  # the produced token's own logprob
        if keyed:
            sp = VSamplingParams(temperature=0.0, extra_args=keyed_args(sampling), **common)
        elif sampled:
            sp = VSamplingParams(temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p,
                                 **common)
        else:
            sp = VSamplingParams(temperature=0.0, **common)
        ext = f"specray-live-{seq_id}-{next(self._ids)}"
        int_id = self.engine.add_request(ext, {"prompt_token_ids": list(toks)}, sp)
        lv = self._live[seq_id] = _Live(ext, int_id if isinstance(int_id, str) else ext, list(toks), n, served=n,
                                        keyed=keyed, sampled=sampled, probs=[] if confidence else None)
        return lv

    @staticmethod
    def _serve(lv: _Live, n: int) -> tuple[list[int], int, bool]:
        """The tokens after position n up to the end of the engine step's chunk holding n, the engine's own
        drafts credited to them (the chunk's drafts past the offset; accepted = len - 1), and whether the chunk
        is the request's first step (a prefill: no draft was possible)."""
        for j, c in enumerate(lv.chunks):
            if c.start <= n < c.end:
                off = n - c.start
                toks = lv.tokens[n : c.end]
                drafts = max(c.drafts - off, 0) if c.drafts else 0
                return toks, drafts, j == 0
        raise AssertionError("no chunk holds the position")  # pragma: no cover - guarded by the caller

    def _verify_live(
        self,
        seq_ids: Sequence[str],
        seqs: list[list[int]],
        draft_ids: Sequence[Sequence[int]],
        draft_probs: torch.Tensor | None,
        sampling: Sequence[SamplingParams],
        method: VerifyMethod,
        salt: int,
        live: list[int],
        confidence: bool = False,
    ) -> VerifyResult:
        """`verify` of a call with live rows (indices `live`): the other rows are scored first, then the live
        requests step until every live row is decided. `confidence`: also the probability of each emitted token
        (`VerifyResult.confidence`)."""
        live_set = set(live)
        other = [b for b in range(len(seq_ids)) if b not in live_set]
        self._abort([seq_ids[b] for b in other])  # their text moves on without the live request
        self._keep = {seq_ids[b] for b in live}
        out_ids: list[list[int]] = [[] for _ in seq_ids]
        n_acc = [0] * len(seq_ids)
        native_drafts = [0] * len(seq_ids)
        cold = [False] * len(seq_ids)
        conf: list[list[float]] | None = [[] for _ in seq_ids] if confidence else None
        try:
            if other:
                probs = None
                if draft_probs is not None:
                    probs = draft_probs[torch.tensor(other, dtype=torch.long)]
                res = self._verify_scored([seqs[b] for b in other], [draft_ids[b] for b in other], probs,
                                          [sampling[b] for b in other], method, salt, False, confidence)
                for j, b in enumerate(other):
                    out_ids[b], n_acc[b] = res.token_ids[j], res.num_accepted[j]
                    if conf is not None:
                        conf[b] = res.confidence[j]
            keyed = {b: self._keyed_row(sampling[b], method) for b in live}
            sampled = {b: _draws_sampled(sampling[b], keyed[b]) for b in live}
            fresh = {b for b in live  # a prefill in this call
                     if not self._is_live(seq_ids[b], seqs[b], keyed[b], sampled[b], confidence)}
            lives = {b: self._ensure_live(seq_ids[b], seqs[b], sampling[b], keyed[b], confidence=confidence)
                     for b in live}
            while True:
                need = [b for b in live if self._wants_step(lives[b], len(seqs[b]), draft_ids[b])]
                if not need:
                    break
                if len(self._live) > self.max_num_seqs:
                    # more live requests than the engine runs at once: decided rows would keep their slots
                    # (a live request runs until it ends), so they leave and the waiting ones get stepped
                    self._keep = {seq_ids[b] for b in need}
                stalled = [b for b in need if lives[b].finished]
                if stalled:
                    raise RuntimeError(f"{self.name}: vLLM finished {seq_ids[stalled[0]]!r} before the round")
                if self.engine_verify:
                    for b in need:  # specray's draft (or none: a plain step) unless the engine drafts itself
                        if draft_ids[b] or not self._own_drafts:
                            done = len(lives[b].tokens) - len(seqs[b])
                            self._set_drafts(lives[b], list(draft_ids[b])[done:])
                self._step()
                self.live_steps += 1
            for b in live:
                n, lv = len(seqs[b]), lives[b]
                if draft_ids[b]:
                    # the engine's greedy tokens from n on; the draft is accepted up to the first difference
                    d = list(draft_ids[b])
                    got = lv.tokens[n:]
                    a = 0
                    while a < len(d) and a < len(got) - 1 and got[a] == d[a]:
                        a += 1
                    toks = got[: a + 1]
                else:
                    toks, native_drafts[b], cold[b] = self._serve(lv, n)
                    a = len(toks) - 1
                cold[b] = cold[b] or b in fresh
                if conf is not None and lv.probs is not None:
                    conf[b] = lv.probs[n - lv.base : n - lv.base + len(toks)]
                lv.served = n + len(toks)
                seqs[b].extend(toks)
                out_ids[b], n_acc[b] = toks, a
                self.live_served_tokens += len(toks)
        finally:
            self._keep = set()
        return VerifyResult(out_ids, n_acc, None, confidence=conf, native_drafts=native_drafts, native_cold=cold,
                            stepped=not other)

    def _propose_live(self, seq_ids: Sequence[str], seqs: list[list[int]], k: Sequence[int],
                      sampling: Sequence[SamplingParams], stop_below: float) -> list[list[int]]:
        """Greedy drafts on live requests, one engine step per token, so that a row can stop after a token the
        engine gave a probability below `stop_below` (kept, as the hf backend keeps it). `seqs` are extended
        with the drafts."""
        out: list[list[int]] = [[] for _ in seqs]
        rows = [b for b in range(len(seqs)) if k[b] > 0]
        start = {b: len(seqs[b]) for b in rows}
        lives = {b: self._ensure_live(seq_ids[b], seqs[b], sampling[b], greedy=True, confidence=True) for b in rows}
        active = list(rows)
        self._keep = {seq_ids[b] for b in rows}  # rows that stopped run ahead: their next call may continue them
        try:
            while True:
                still = []
                for b in active:
                    lv, n = lives[b], start[b]
                    got = lv.tokens[n : n + k[b]]
                    probs = lv.probs[n - lv.base : n - lv.base + len(got)]
                    unsure = next((i for i, p in enumerate(probs) if p < stop_below), None)
                    out[b] = got if unsure is None else got[: unsure + 1]
                    if unsure is None and len(got) < k[b] and not lv.finished:
                        still.append(b)
                active = still
                if not active:
                    break
                if len(self._live) > self.max_num_seqs:  # as in `_verify_live`: the waiting rows get the slots
                    self._keep = {seq_ids[b] for b in active}
                if self.engine_verify:
                    for b in active:  # a plain step: no draft of specray's, and the engine drafts nothing itself
                        self._set_drafts(lives[b], [])
                self._step()
                self.live_steps += 1
        finally:
            self._keep = set()
        for b in rows:
            seqs[b].extend(out[b])
            lives[b].served = start[b] + len(out[b])
            self.live_served_tokens += len(out[b])
        return out

    @staticmethod
    def _wants_step(lv: _Live, n: int, draft: Sequence[int]) -> bool:
        """Whether a live row needs another engine step: it has no token past n yet, or (a drafted row) every
        token it has past n equals the draft and the draft goes on past them (not yet verified to its end)."""
        got = len(lv.tokens) - n
        if got <= 0:
            return True
        if not draft or got > len(draft):
            return False
        return lv.tokens[n:] == list(draft[:got])
