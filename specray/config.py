"""Configuration models (pydantic v2, extra fields forbidden so typos fail loudly).

vLLM's names are accepted beside specray's (`specray.compat`): ``max_model_len`` for a level's ``max_context``,
``served_model_name`` / ``max_num_seqs`` for the server's ``model_name`` / ``max_batch_size``, and at the top of
`AppConfig` vLLM's flat shape (``model`` + ``speculative_config``). Giving both names of one field is an error.

"method" has one meaning: which proposer drafts (vLLM's ``speculative_config.method``, and the request's
``speculation.method``). How a level checks drafts is its ``verify_method`` (``method`` on a level is the
deprecated old spelling).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import warnings
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator

from specray.compat import VLLM_APP_KEYS, app_dict_from_vllm, rename_vllm_names, served_name
from specray.spec.params import TreeShape, VerifyMethod

log = logging.getLogger(__name__)


def vllm_installed() -> bool:
    """Whether the vllm package can be imported here (looked up, not imported: importing it takes seconds);
    SPECRAY_NO_VLLM=1 says no (`kind: auto` levels then run on hf)."""
    return os.environ.get("SPECRAY_NO_VLLM") != "1" and importlib.util.find_spec("vllm") is not None


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())


#: `vllm.LLM` arguments that VLLMWorker derives from the level's fields or needs fixed for exact verification.
_ENGINE_ARGS_OWNED = frozenset({
    "model", "tokenizer", "dtype", "max_model_len", "logprobs_mode", "max_logprobs", "enable_prefix_caching",
})


class TreeConfig(_Strict):
    """A model level's token tree (`tree:` on a level): the shape of the tree it drafts per row instead of a chain."""

    width: int = Field(..., ge=1, le=16, description="Children per node: at each depth the best `width` nodes "
                       "(by the drafter's path probability) each get their `width` most likely children (sampled "
                       "under rejection verification). 1: chains.")
    depth: int | None = Field(None, ge=1, le=64, description="Levels of the tree; default: the level's K (the "
                              "round's K when the planner picks it).")
    max_nodes: int | None = Field(None, ge=1, le=256, description="Most nodes per tree (what the target scores "
                                  "in its forward, beside the row's pending tokens); default width x depth.")

    def shape(self) -> TreeShape:
        return TreeShape(self.width, self.depth, self.max_nodes)


class LevelConfig(_Strict):
    """One level of the cascade, smallest first; the last level is the target."""

    name: str | None = Field(None, description="Display name; defaults to the model name, 'ngram' or 'suffix'.")
    kind: Literal["ngram", "suffix", "hf", "vllm", "auto"] = Field(
        "hf", description="Proposer/engine backend of this level: a lookup proposer inside the coordinator (ngram: "
        "prompt lookup; suffix: SuffixDecoding over this and earlier requests' text; first level only) or a model "
        "engine. auto: vllm where vLLM is installed (the faster engine), else hf, said in a log line; decided where "
        "the config is read, and the vllm-only fields (engine_verify, engine_args, native_speculation) are dropped "
        "on the hf fallback.")
    model: str | None = Field(
        None, description="Known name (see `specray models list`), local folder or hub id. Not for ngram/suffix."
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "bfloat16", description="Weights and KV dtype. float32 for bit-stable exactness tests."
    )
    device: str = Field("cpu", description="torch device of this level's worker.")
    num_threads: int | None = Field(
        None, ge=1, description="torch intra-op threads of this level: its actor's process when served; in one "
        "process, every call of the level, from whatever thread (None: torch default)."
    )
    attn_implementation: Literal["sdpa", "eager"] = Field("sdpa", description="transformers attention kernel.")
    cpu_prepack: bool | None = Field(
        None, description="hf levels on a CPU: reorder the linear weights once into oneDNN's layout. bfloat16: a "
        "decoding step and a verification, which read every weight, run much faster where oneDNN computes bf16 "
        "(None: a probe at load decides, logged). float32 (true only): on CPUs without bf16 units a K+1-token "
        "verification then costs ~1.9 decoding steps instead of ~3, so speculation pays. false: never."
    )
    prompt_upcast: bool | None = Field(
        None, description="hf levels with bfloat16 / float16 weights on a CPU: run the linear layers of prefills "
        "and catch-ups (32 tokens or more) in float32, which some CPUs compute faster than bf16 once a forward "
        "is that large. None: a probe at load decides on this CPU; decoding steps and verifications are "
        "unchanged either way.")
    enable_prefix_caching: bool = Field(
        True, description="hf levels: a new request reuses the KV of a finished one whose tokens its prompt starts "
        "with (a conversation's next turn, a shared system prompt or document), so its prefill feeds only the rest. "
        "vLLM levels always cache prefixes (vLLM's own).")
    max_context: int | None = Field(None, ge=16, description="Context limit; defaults to the model's.")
    num_speculative_tokens: int = Field(
        4, ge=0, le=64, description="K: tokens this level proposes to the level above per round (a suffix level: "
        "the most it drafts; defaults to suffix_decoding_max_tree_depth there, as in vLLM)."
    )
    verify_method: VerifyMethod = Field(
        VerifyMethod.REJECTION,
        description="How this level verifies the level below at temperature > 0 (temperature 0 is always "
        "greedy). Rejection over an n-gram drafter is the deterministic method (q = delta). `method` is the "
        "deprecated old name.",
    )
    prompt_lookup_min: int = Field(
        1, ge=1, description="n-gram: shortest suffix to match. A level written here keeps specray's defaults "
        "(1..4, most recent occurrence); vLLM's shape (speculative_config method ngram) takes vLLM's (5..5, earliest).")
    prompt_lookup_max: int = Field(4, ge=1, description="n-gram: longest suffix to match (longest wins).")
    prompt_lookup_occurrence: Literal["recent", "earliest"] = Field(
        "recent", description="n-gram: which occurrence of the longest matching suffix drafts: the most recent, "
        "or the earliest (what vLLM's own n-gram proposer takes; often better on code editing).")
    prompt_lookup_max_spec_factor: float = Field(
        0.0, ge=0, le=64, description="n-gram: a match of m tokens drafts at most max(1, this x m) tokens "
        "(SuffixDecoding's rule; a one-token match predicts little, and a CPU target's step grows with the tokens it "
        "verifies). 0: drafts run to num_speculative_tokens, as in vLLM.")
    suffix_decoding_max_tree_depth: int = Field(
        24, ge=1, le=1024, description="suffix: depth of its suffix tries; a match plus its draft spans at most this "
        "many tokens (vLLM's knob and default).")
    suffix_decoding_max_cached_requests: int = Field(
        1000, ge=-1, description="suffix: the outputs of this many most recently started requests feed the global "
        "trie, evicted oldest first (0: only the request's own text; -1: no bound). Memory grows with depth x "
        "cached output tokens, which is why the default is below vLLM's 10000.")
    suffix_decoding_max_spec_factor: float = Field(
        1.0, ge=0, description="suffix: a match of m tokens drafts at most this x m tokens (vLLM's knob and default).")
    suffix_decoding_min_token_prob: float = Field(
        0.1, ge=0, le=1, description="suffix: stop a draft before a token whose estimated probability (from "
        "frequency counts along the path) is below this (vLLM's knob and default).")
    tree_width: int = Field(
        1, ge=1, le=16, description="suffix: draft a token tree with at most this many children per node (K nodes in "
        "all) instead of a chain, verified in one target forward (the accepted path plus one token). Only for a "
        "target that scores trees (hf; vllm verifies chains only, so the level drafts chains there, logged once) "
        "directly above the suffix level. 1 (default): chains.")
    tree: TreeConfig | None = Field(
        None, description="hf model level below the target: draft a token tree per row ({width, depth, max_nodes}) "
        "instead of a chain, verified in one target forward (the accepted path plus one token). Only where the "
        "level drafts directly for a target that scores trees (hf); elsewhere it drafts chains, logged once. "
        "Exact for every verification method. None: chains.")
    # --- where the level runs (Ray); ignored in-process and for lookup levels (they run inside the coordinator) ---
    num_cpus: float = Field(1.0, ge=0, description="CPUs reserved for this level's actor.")
    num_gpus: float = Field(0.0, ge=0, description="GPUs reserved for this level's actor (fractions allowed).")
    resources: dict[str, float] = Field(
        default_factory=dict, description="Custom Ray resources, e.g. {'draft': 1} to pin a level to a node."
    )
    accelerator_type: str | None = Field(None, description="Ray accelerator type, e.g. 'A100' or 'L4'.")
    engine_args: dict[str, Any] = Field(
        default_factory=dict,
        description="vllm only: extra keyword arguments for the engine (`vllm.LLM`), e.g. {tensor_parallel_size: 4, "
        "gpu_memory_utilization: 0.9, enforce_eager: false}. A level whose engine spans N = tensor x pipeline "
        "parallel GPUs runs all N inside its one actor, so it must reserve them: num_gpus: N.",
    )
    engine_verify: int = Field(
        0, ge=0, le=64,
        description="vllm only: verify greedy drafts of up to this many tokens inside the vLLM engine, in one decode "
        "step of a request kept alive in its scheduler (the engine is started with a speculative config whose "
        "drafts specray supplies), instead of by prompt scoring; plain rounds are plain steps of the same "
        "requests. Set it to the largest K proposed to this level. 0: prompt scoring. Rows at temperature > 0 "
        "without a seed are verified in the step too (vLLM's rejection sampler, drafts made greedily); seeded "
        "rows go through prompt scoring (exact keyed sampling). A native n-gram level does this by itself.",
    )
    draft_confidence: float = Field(
        0.0, ge=0.0, lt=1.0,
        description="A model level below the target: end a draft after a token this level gave a probability below "
        "this (its own confidence; greedy rows: the softmax of its logits). Unsure tokens are often rejected and "
        "what is drafted after them is wasted work. 0 (default): always draft K. Exact at any value. hf and vllm "
        "levels (vllm: from the engine's logprobs, its greedy drafts one engine step per token).",
    )
    inner_min_share: float | None = Field(
        None, ge=0.0, le=1.0,
        description="A middle level of a cascade: stop its inner rounds (the level below drafts, this one verifies) "
        "once fewer than this share of the round's rows still need draft tokens; the others keep the shorter "
        "drafts they have. An inner round costs both levels a whole step on a GPU however few its rows, so at large "
        "batches the last rounds for a few rows cost more than they add. Exact at any value. Default: 0.25 on a GPU "
        "(num_gpus > 0 or a device other than cpu), 0 (every row gets its whole draft) on a CPU, whose step time "
        "grows with the rows.",
    )
    native_speculation: dict[str, Any] | None = Field(
        None,
        description="vllm target only: the engine's own speculative decoding (vLLM's `speculative_config`), e.g. "
        "{method: ngram, num_speculative_tokens: 4, prompt_lookup_max: 4, prompt_lookup_min: 2} or {method: "
        "draft_model, model: <draft>, num_speculative_tokens: 3}. Plain rounds of this level are then vLLM "
        "speculating by itself (greedy rows and unseeded sampled rows; seeded rows at temperature > 0 decode plain "
        "through specray's exact keyed path).",
    )

    @model_validator(mode="before")
    @classmethod
    def _names(cls, data: Any) -> Any:
        data = rename_vllm_names(data, {"max_model_len": "max_context"}, "level")
        if isinstance(data, dict) and "method" in data:
            if "verify_method" in data:
                raise ValueError("level: give `verify_method` (`method` is its deprecated old name), not both")
            warnings.warn("a level's `method` is now `verify_method` (`method` names the proposer, as in vLLM)",
                          FutureWarning, stacklevel=2)
            data["verify_method"] = data.pop("method")
        return data

    @property
    def method(self) -> VerifyMethod:
        """Deprecated: `verify_method`."""
        return self.verify_method

    @model_validator(mode="after")
    def _check(self) -> LevelConfig:
        if self.kind == "auto":
            self._resolve_auto()
        # set to something else than their defaults (a dumped config carries every field, so "set" is not enough)
        suffix_knobs = sorted(f for f, info in type(self).model_fields.items()
                              if f.startswith("suffix_decoding_") and getattr(self, f) != info.default)
        if suffix_knobs and self.kind != "suffix":
            raise ValueError(f"{suffix_knobs[0]} is for suffix levels, not a {self.kind} level")
        if self.tree_width != 1 and self.kind != "suffix":
            raise ValueError(f"tree_width is for suffix levels (they draft token trees), not a {self.kind} level")
        if self.tree is not None:
            if self.is_lookup:
                raise ValueError(f"tree is for model levels, not a {self.kind} level"
                                 + (" (a suffix level takes tree_width)" if self.kind == "suffix" else ""))
            if self.kind == "vllm":
                raise ValueError("tree: a vllm level drafts chains only (no tree attention); use kind hf for a "
                                 "level that drafts token trees")
        if self.kind == "suffix" and "num_speculative_tokens" not in self.model_fields_set:
            self.num_speculative_tokens = min(64, self.suffix_decoding_max_tree_depth)
        if self.kind == "ngram":
            if self.prompt_lookup_max < self.prompt_lookup_min:
                raise ValueError("prompt_lookup_max must be >= prompt_lookup_min")
        elif self.prompt_lookup_max_spec_factor:
            raise ValueError(f"prompt_lookup_max_spec_factor is for ngram levels, not a {self.kind} level"
                             + (" (a suffix level takes suffix_decoding_max_spec_factor)" if self.kind == "suffix"
                                else ""))
        elif self.kind == "suffix":
            if self.model:
                raise ValueError("a suffix level takes no `model` (it drafts from text it has seen)")
        elif not self.model:
            raise ValueError(f"a {self.kind} level needs `model`")
        if not self.enable_prefix_caching and self.kind == "vllm":
            raise ValueError("enable_prefix_caching: a vllm level always caches prefixes (an engine argument specray "
                             "sets); it can be turned off for hf levels only")
        if self.prompt_upcast is not None and self.kind != "hf":
            raise ValueError(f"prompt_upcast is for hf levels (transformers on a CPU), not a {self.kind} level")
        if self.cpu_prepack and self.kind != "hf":
            raise ValueError(f"cpu_prepack is for hf levels (transformers on a CPU), not a {self.kind} level")
        if self.engine_args:
            self._check_engine_args()
        if self.native_speculation is not None:
            self._check_native()
        if self.engine_verify:
            if self.kind != "vllm":
                raise ValueError(f"engine_verify is for vllm levels; a {self.kind} level verifies in its forward pass")
            if self.engine_world_size > 1:
                raise ValueError("engine_verify hands drafts to the engine's scheduler in-process, which a multi-GPU "
                                 "engine (tensor/pipeline parallel) cannot")
            if self.native_speculation is not None:
                raise ValueError("engine_verify: a native level verifies specray's drafts in its engine already "
                                 "(n-gram method); drop engine_verify")
        return self

    def _resolve_auto(self) -> None:
        """kind auto -> vllm if the vllm package is importable here, else hf (with the vllm-only fields dropped)."""
        if vllm_installed():
            self.kind = "vllm"
            hf_only = {"prompt_upcast": self.prompt_upcast, "cpu_prepack": self.cpu_prepack}
            for field in (f for f, value in hf_only.items() if value is not None):
                log.info("level %s: kind auto runs on vLLM; %s (hf only) does not apply", self.display_name, field)
            self.prompt_upcast = self.cpu_prepack = None
            return
        self.kind = "hf"
        vllm_only = {"engine_verify": self.engine_verify, "engine_args": self.engine_args,
                     "native_speculation": self.native_speculation}
        dropped = [name for name, value in vllm_only.items() if value]
        log.warning("level %s: kind auto runs on the hf backend: vLLM is not installed here (or SPECRAY_NO_VLLM=1); "
                    "install it (`bash scripts/setup.sh --vllm`) for the faster engine%s", self.display_name,
                    f"; ignoring {', '.join(dropped)}" if dropped else "")
        self.engine_verify, self.engine_args, self.native_speculation = 0, {}, None

    def _check_native(self) -> None:
        from specray.engine.vllm_native import check_native_speculation

        if self.kind != "vllm":
            raise ValueError(f"native_speculation is for vllm levels; a {self.kind} level has no speculative engine")
        self.native_speculation = check_native_speculation(self.native_speculation)
        if self.engine_world_size > 1:
            raise ValueError("native_speculation: a native level runs its engine in-process, which a multi-GPU "
                             "engine (tensor/pipeline parallel) cannot")

    def _check_engine_args(self) -> None:
        if self.kind != "vllm":
            raise ValueError(f"engine_args is for vllm levels; a {self.kind} level takes none")
        if "speculative_config" in self.engine_args:
            raise ValueError("engine_args.speculative_config: give vLLM's own speculation as `native_speculation` "
                             "(a native level; specray maps its acceptance into the metrics and the planner)")
        owned = sorted(set(self.engine_args) & _ENGINE_ARGS_OWNED)
        if owned:
            raise ValueError(f"engine_args {owned}: set by specray (use the level's model/dtype/max_context; "
                             "logprob and prefix-caching settings are what exact verification relies on)")
        sizes = {k: self.engine_args.get(k, 1) for k in ("tensor_parallel_size", "pipeline_parallel_size")}
        for key, n in sizes.items():
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise ValueError(f"engine_args.{key} must be a positive integer, got {n!r}")
        world = self.engine_world_size
        if world > 1 and self.num_gpus != world:
            raise ValueError(
                f"engine_args asks for {world} GPUs (tensor_parallel_size x pipeline_parallel_size) but num_gpus is "
                f"{self.num_gpus:g}: the engine's GPU workers run inside this level's actor, which must reserve "
                f"them all (num_gpus: {world})"
            )

    @property
    def engine_world_size(self) -> int:
        """GPUs one engine of this level spans (tensor x pipeline parallel; 1 without engine_args)."""
        args = self.engine_args
        return int(args.get("tensor_parallel_size", 1)) * int(args.get("pipeline_parallel_size", 1))

    @property
    def is_lookup(self) -> bool:
        """A lookup proposer (ngram, suffix): runs inside the coordinator, no model, no actor."""
        return self.kind in ("ngram", "suffix")

    @property
    def tail_cut(self) -> float:
        """`inner_min_share` with its default resolved (see the field)."""
        if self.inner_min_share is not None:
            return self.inner_min_share
        return 0.25 if self.num_gpus > 0 or self.device != "cpu" else 0.0

    @property
    def display_name(self) -> str:
        return self.name or (self.kind if self.is_lookup else self.model) or self.kind


class PlacementConfig(_Strict):
    """How the model levels of one cascade are reserved together (one placement-group bundle per level)."""

    strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = Field(
        "PACK", description="Ray placement strategy; SPREAD/STRICT_SPREAD put levels on different nodes."
    )
    enabled: bool = Field(True, description="Reserve a placement group; off: plain actors with their resources.")
    timeout_s: float = Field(
        60.0, gt=0, description="How long to wait for the levels' resources (on an autoscaling cluster: long enough "
        "for new GPU nodes to join) before failing with a message naming the level that does not fit.",
    )


class CascadeConfig(_Strict):
    """The levels, small to large. A single level is plain decoding with the target."""

    levels: list[LevelConfig] = Field(..., min_length=1, description="Levels, smallest first; last = target.")
    placement: PlacementConfig = Field(default_factory=PlacementConfig, description="Placement of the levels.")
    start_timeout_s: float = Field(
        600.0, gt=0, description="How long the level actors have to load their models (Ray deployments)."
    )
    transport: Literal["direct", "compiled", "call"] = Field(
        "direct", description="How the coordinator reaches its level actors each round: a socket of the level's own "
        "(direct), a Ray Compiled Graph per level (its reader keeps a CPU core busy while idle), or plain actor calls "
        "(nodes that cannot reach each other's ephemeral ports).",
    )
    poll: bool = Field(
        False, description="Direct transport: both ends of a level's connection poll the socket just before a frame "
        "is due (calls of GPU-speed levels: due within 50 ms) instead of waking a parked thread. Pays only where "
        "cores are spare (benchmarks/README.md section 6); off: they park.",
    )
    nested: bool = Field(
        True, description="A middle level of a cascade runs its inner rounds beside its model, calling the level "
        "below directly (direct transport): one hop from the coordinator per round instead of two per inner round. "
        "Off: the coordinator makes every call.",
    )
    relay: bool = Field(
        True, description="With nested drafting, the level right below the target (a middle level after its inner "
        "rounds, or a plan's only drafter after its propose) sends its drafts to the target's actor itself, and the "
        "target replies to the coordinator (direct transport): one transfer and the coordinator's work between the "
        "two calls come off every round without overlap. Off: the drafts come back through the coordinator.",
    )
    follow: bool | None = Field(
        None, description="With relays, the target also sends its verdict to a nested middle level, which drafts "
        "the next round on it at once (rounds drafted without overlap, at most 64 rows): the verdict's trip to the "
        "coordinator, the coordinator's commit and plan, and its request to the middle level come off the round's "
        "critical path; rows that joined get their first draft from the next follow-on. A request that asks "
        "something else (the plan changed) cancels the follow-on and waits for its inner round under way. "
        "Default: on where every model level runs on a GPU (num_gpus > 0 or a device other than cpu), whose steps "
        "are short enough for that path to count; off on CPU levels, whose steps take a hundred times longer and "
        "share the cores a cancelled follow-on would take.",
    )

    @property
    def follows(self) -> bool:
        """`follow` with its default resolved (see the field)."""
        if self.follow is not None:
            return self.follow
        models = [lvl for lvl in self.levels if not lvl.is_lookup]
        return all(lvl.num_gpus > 0 or lvl.device != "cpu" for lvl in models)

    @model_validator(mode="after")
    def _check(self) -> CascadeConfig:
        for i, lvl in enumerate(self.levels):
            if lvl.is_lookup and i != 0:
                raise ValueError(f"a lookup level ({lvl.kind}) can only be the first level: it drafts from the text, "
                                 "never from a level below it")
        if self.levels[-1].is_lookup:
            raise ValueError("the last level (the target) must be a model")
        if self.levels[-1].tree is not None:
            raise ValueError(f"level {self.levels[-1].display_name!r}: tree is for a level that drafts; the target "
                             "verifies (give tree to the level below it)")
        for lvl in self.levels[:-1]:
            if lvl.native_speculation is not None:
                raise ValueError(f"level {lvl.display_name!r}: native_speculation only on the target (last level); "
                                 "a native engine cannot draft for a level above it")
        names = [lvl.display_name for lvl in self.levels]
        if len(set(names)) != len(names):
            raise ValueError(f"level names must be unique, got {names}; set `name`")
        return self

    @classmethod
    def from_yaml(cls, path: str | Path) -> CascadeConfig:
        return cls.model_validate(yaml.safe_load(Path(path).read_text()))


class ServerConfig(_Strict):
    """The coordinator deployment: batching and the HTTP API."""

    model_name: str = Field("specray", description="Model id served on /v1/models and expected in requests "
                            "(vLLM: served_model_name).")
    max_batch_size: int = Field(32, ge=1, le=1024, description="Sequences in the running batch at most "
                                "(vLLM: max_num_seqs).")
    pipeline: bool = Field(
        False, description="Overlap drafting of one half of the batch with verification of the other "
        "(levels on different devices)."
    )
    overlap: bool = Field(
        False, description="Draft the next round while the target verifies this one (the levels below the "
        "target on another thread, device or actor); the look-ahead is the next draft when the target accepts "
        "all of this one. Pays where drafting and verifying can run at the same time (docs/architecture.md, 'Overlap')."
    )
    in_process: bool = Field(
        False, description="Run the model levels inside the coordinator process instead of one Ray actor per "
        "level (single-box development and tests)."
    )
    default_max_tokens: int = Field(
        16, ge=1, description="max_tokens of /v1/completions when the request omits it (OpenAI's default)."
    )
    api_key: str | None = Field(None, description="If set (or SPECRAY_API_KEY), requests need 'Bearer <key>'.")
    max_request_bytes: int = Field(1 << 20, ge=1024, description="Largest accepted request body.")
    log_prompts: bool = Field(False, description="Write prompts to the logs (off: only sizes are logged).")
    strict_fields: bool = Field(
        False, description="Refuse request fields that are not parameters of specray with a 400 (off: accept them "
        "and name them in a warning, as vLLM does)."
    )

    @model_validator(mode="before")
    @classmethod
    def _names(cls, data: Any) -> Any:
        data = rename_vllm_names(data, {"served_model_name": "model_name", "max_num_seqs": "max_batch_size"},
                                 "server")
        if isinstance(data, dict) and "model_name" in data:
            data["model_name"] = served_name(data["model_name"], "server.model_name")
        return data


class PolicyConfig(_Strict):
    """How the plan (active levels, K per level) is chosen each round for requests without an override."""

    adaptive: bool = Field(
        True, description="Pick the plan with the best live goodput for the current batch each round; off: always "
        "the configured levels and K."
    )
    k_max: int = Field(8, ge=1, le=32, description="Largest K the planner considers per level.")
    hysteresis: float = Field(0.05, ge=0, description="Relative goodput gain needed to switch plans.")
    patience: int = Field(3, ge=1, description="Rounds a better plan must keep winning before a switch that starts "
                          "or stops a model drafter (other switches follow the ranking at once).")
    decisive: float = Field(1.0, ge=0, description="Relative goodput gain above which falling back to plain "
                            "decoding happens at once (no patience): 1.0 = plain predicted 2x better.")
    explore_every: int = Field(50, ge=2, description="Rounds between probes of levels not in the current plan.")
    margin: float = Field(
        0.1, ge=0, description="Relative goodput gain over plain decoding a speculative plan must be predicted to "
        "have to be chosen: its extra round cost is certain, its gain an estimate from earlier rows (0.1: 10%). A "
        "plan whose round takes less than this share of time beyond a plain round needs only that share.")
    explore_budget: float | None = Field(
        0.02, gt=0, le=1, description="Largest share of the time exploration may cost: a probe waits until its "
        "extra seconds over a round of the held plan (predicted, or as the latest probe measured, catch-up "
        "included) are at most this share of the seconds served at the batch's size (power-of-two bucket) since "
        "the latest probe. null: every explore_every rounds.")
    rerank_every: int = Field(
        1, ge=1, description="Rank the candidate plans on at most one round in this many (at an unchanged batch "
        "size; a new batch size ranks at once); the others keep the held plan.")
    rerank_budget: float | None = Field(
        0.005, gt=0, le=1, description="Largest share of the time the ranking may take: ranking prices every (levels, "
        "K) candidate, milliseconds of the coordinator's CPU, so after a ranking that took t the next waits t / budget "
        "(GPU-speed rounds rank every many rounds, CPU-speed ones every round or two). null: rank by rerank_every "
        "alone.")
    rerank_surprise: float = Field(
        0.25, gt=0, le=1, description="Rank again at once, whatever rerank_every and rerank_budget say, when the held "
        "plan's goodput, priced again on a held round from what its rounds measured, has fallen by this share below "
        "its goodput when it was chosen (a lookup whose copy ended drafts nothing for rounds on end). 1: never.")
    calibrate: bool = Field(
        False, description="Correct each plan family's predicted goodput by what its rounds delivered: measured "
        "against predicted tokens per round and round seconds, decayed (`specray.policy.calibration`). Off by "
        "default: at batch 1 on the served levels it trailed the uncalibrated planner on code (benchmarks/README.md, "
        "'Calibrating the planner by its plans' own rounds'). false: the goodput model's prices stand.")
    table: list[tuple[int, int, int | str]] | None = Field(
        None, description="Static override [[min_batch, max_batch, plan], ...]: plan is K (0 = plain), 'none', "
        "'ngram', 'draft', 'cascade', 'hybrid' or a plan name like 'ngram:3>draft:4>target' (hybrid: "
        "'ngram:3|draft:4>target'); first match wins."
    )

    trace_file: str | None = Field(
        None, description="Append one JSON line per planned round to this file (in the coordinator's process): the "
        "batch, the plan chosen and why, on ranked rounds the best candidates and plain decoding with their "
        "predicted goodput and round time and the drafters' backlog, and the round's measured seconds. What to "
        "read when a deployment speculates more or less than expected; null: off.")

    def planner_kwargs(self) -> dict:
        """The `specray.policy.planner.Planner` keyword arguments of this policy (`k_max` apart: callers may
        override it)."""
        return dict(table=self.table, hysteresis=self.hysteresis, patience=self.patience,
                    explore_every=self.explore_every, decisive=self.decisive, rerank_every=self.rerank_every,
                    rerank_budget=self.rerank_budget, rerank_surprise=self.rerank_surprise,
                    explore_budget=self.explore_budget, margin=self.margin,
                    calibrate=self.calibrate)


class PoolsConfig(_Strict):
    """Autoscaling by regime (docs/serving.md): a Router deployment in front of two pools that Serve scales apart.
    SpeculativePool replicas run the whole cascade, TargetPool replicas the target alone; each request goes
    to the speculative pool while its batch per replica stays below the break-even batch, else to the target."""

    break_even_batch: int | None = Field(
        None, ge=1, description="Static break-even batch for routing; None: live, from the speculative pool's "
        "planner (its cost model, or its `policy.table`).",
    )
    initial_break_even: int = Field(4, ge=1, description="Break-even used until the speculative pool reports one.")
    refresh_s: float = Field(1.0, gt=0, description="How often the router re-reads break-even and replica counts.")
    speculative: dict[str, Any] = Field(
        default_factory=dict, description="Serve deployment options of SpeculativePool (merged over the defaults: "
        "autoscaling with DraftPoolPolicy, 1..4 replicas); `autoscaling_config` keys merge one by one.",
    )
    target: dict[str, Any] = Field(
        default_factory=dict, description="Serve deployment options of TargetPool (defaults: autoscaling with "
        "TargetPoolPolicy, 1..4 replicas).",
    )


class AppConfig(_Strict):
    """Everything `build_app` needs: the cascade, the server and the policy (and, optionally, regime pools)."""

    cascade: CascadeConfig
    server: ServerConfig = Field(default_factory=ServerConfig)
    policy: PolicyConfig = Field(default_factory=PolicyConfig)
    pools: PoolsConfig | None = Field(None, description="Regime pools instead of one coordinator deployment.")

    @model_validator(mode="before")
    @classmethod
    def _vllm_shape(cls, data: Any) -> Any:
        """vLLM's flat names at the top (model, speculative_config, served_model_name, ...): `specray.compat`."""
        if isinstance(data, dict) and VLLM_APP_KEYS & set(data):
            return app_dict_from_vllm(data)
        return data

    @classmethod
    def from_yaml(cls, path: str | Path) -> AppConfig:
        return cls.model_validate(yaml.safe_load(Path(path).read_text()))
