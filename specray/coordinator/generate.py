"""In-process cascade: build levels from configuration and run `generate(...)` without Ray.

This is the same round loop (`CascadeEngine`) the Ray coordinator drives; here the workers live in this
process. Plain decoding is the target alone (or `plain=True`), through the same code path.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from specray.config import CascadeConfig, LevelConfig
from specray.coordinator.cascade import (
    CascadeEngine,
    GenerationResult,
    Level,
    LevelStats,
    Plan,
    Seq,
    run_to_completion,
)
from specray.coordinator.stats import named_stats
from specray.engine.protocol import Worker
from specray.spec.ngram import NgramConfig
from specray.spec.params import SamplingParams
from specray.spec.suffix import SuffixConfig, SuffixDrafter


def create_worker(cfg: LevelConfig) -> Worker:
    """Construct the worker of a model level (imports the backend only when used)."""
    if cfg.kind == "hf":
        from specray.engine.hf import HFWorker

        return HFWorker(
            cfg.model or "", name=cfg.display_name, dtype=cfg.dtype, device=cfg.device,
            num_threads=cfg.num_threads, attn_implementation=cfg.attn_implementation,
            max_context=cfg.max_context, cpu_prepack=cfg.cpu_prepack, prefix_caching=cfg.enable_prefix_caching,
            prompt_upcast=cfg.prompt_upcast,
        )
    if cfg.kind == "vllm":
        if cfg.native_speculation is not None:
            from specray.engine.vllm_native import NativeVLLMWorker

            return NativeVLLMWorker(cfg.model or "", native_speculation=cfg.native_speculation,
                                    **vllm_worker_kwargs(cfg))
        from specray.engine.vllm import VLLMWorker

        return VLLMWorker(cfg.model or "", **vllm_worker_kwargs(cfg))
    raise ValueError(f"level kind {cfg.kind!r} has no worker")


def vllm_worker_kwargs(cfg: LevelConfig) -> dict[str, Any]:
    """Keyword arguments of `VLLMWorker` for a vllm level (besides the model); imports nothing of vLLM.

    `engine_args` go to the engine as they are, over the worker's CPU-oriented defaults. On a GPU level
    (num_gpus > 0) the KV cache is sized by vLLM's `gpu_memory_utilization` instead of the worker's fixed
    1 GiB. An engine spanning several GPUs (tensor/pipeline parallel) cannot use the worker's in-process
    "uni" executor: it gets vLLM's multiprocessing executor, whose GPU processes are children of the
    level's actor and use the GPUs Ray assigned to it (so the level reserves them all: num_gpus = TP x PP).
    vLLM's "ray" executor would instead ask Ray for GPUs the actor already holds.
    """
    engine = dict(cfg.engine_args)
    if cfg.engine_world_size > 1:
        engine.setdefault("distributed_executor_backend", "mp")
    kwargs: dict[str, Any] = dict(name=cfg.display_name, dtype=cfg.dtype, num_threads=cfg.num_threads,
                                  max_context=cfg.max_context, engine_kwargs=engine)
    if cfg.engine_verify:
        kwargs["engine_verify"] = cfg.engine_verify
    if cfg.num_gpus > 0:
        kwargs["kv_cache_bytes"] = None
    return kwargs


def level_from_config(cfg: LevelConfig, worker: Worker | None = None) -> Level:
    if cfg.kind == "ngram":
        ng = NgramConfig(cfg.num_speculative_tokens, cfg.prompt_lookup_min, cfg.prompt_lookup_max,
                         cfg.prompt_lookup_occurrence, cfg.prompt_lookup_max_spec_factor)
        return Level(cfg.display_name, ngram=ng, k=cfg.num_speculative_tokens, method=cfg.verify_method)
    if cfg.kind == "suffix":
        sx = SuffixDrafter(SuffixConfig(
            cfg.num_speculative_tokens, cfg.suffix_decoding_max_tree_depth, cfg.suffix_decoding_max_cached_requests,
            cfg.suffix_decoding_max_spec_factor, cfg.suffix_decoding_min_token_prob, cfg.tree_width))
        return Level(cfg.display_name, suffix=sx, k=cfg.num_speculative_tokens, method=cfg.verify_method,
                     tree_width=cfg.tree_width)
    # native_k (a native vLLM target's own K) comes from the worker (`Level.__post_init__`)
    return Level(cfg.display_name, worker=worker or create_worker(cfg), k=cfg.num_speculative_tokens,
                 method=cfg.verify_method, confidence=cfg.draft_confidence,
                 tree=cfg.tree.shape() if cfg.tree is not None else None, inner_min_share=cfg.tail_cut)


def build_levels(cfg: CascadeConfig, on_level: Callable[[Level], None] | None = None) -> list[Level]:
    """Create every level and check that all model levels share one tokenizer; `on_level` is called as each
    level is ready (a progress display while models load)."""
    from specray.engine.tokenizer_check import check_tokenizers

    levels = []
    for lc in cfg.levels:
        levels.append(level_from_config(lc))
        if on_level is not None:
            on_level(levels[-1])
    named = [(lvl.name, lvl.worker.tokenizer) for lvl in levels if lvl.worker is not None]
    if len(named) > 1:
        check_tokenizers(named)
    return levels


@dataclass
class Batch:
    """Results of one `generate` call plus the summed per-level statistics."""

    results: list[GenerationResult]
    stats: dict[str, LevelStats]

    @property
    def rounds(self) -> int:
        return sum(r.rounds for r in self.results)


def _stop_ids(levels: Sequence[Level], tokenizer) -> set[int]:
    ids: set[int] = set()
    target = levels[-1].worker
    ids.update(getattr(target, "eos_token_ids", ()) or ())
    if tokenizer is not None and getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    return ids


def generate(
    levels: Sequence[Level] | CascadeEngine,
    prompts: Sequence[str | Sequence[int]],
    *,
    max_tokens: int = 64,
    sampling: SamplingParams | Sequence[SamplingParams] | None = None,
    plan: Plan | Callable[[int], Plan] | None = None,
    plain: bool = False,
    stop: Sequence[str] = (),
    ignore_eos: bool = False,
    chat: bool = False,
    tokenizer=None,
    overlap: bool = False,
    on_tokens: Callable[[int, list[int]], None] | None = None,
) -> Batch:
    """Generate for a batch of prompts (text or token ids) with the cascade; returns tokens, text, stats.

    `plain=True` runs the target alone (plain decoding, same loop). `plan` is a fixed `Plan` or a planner
    (a callable batch size -> Plan, e.g. `specray.policy.planner.Planner(levels).attach(engine)`).
    `chat=True` wraps text prompts in the tokenizer's chat template. Greedy output equals plain greedy
    output token for token; at temperature > 0 the output is an exact sample from the target.
    `overlap=True` drafts the next round while the target verifies this one (`CascadeEngine`; levels given as a
    list only: an engine keeps its own setting).
    `on_tokens(i, new_ids)` is called with the tokens of prompt `i` as each round accepts them (streaming).
    """
    engine = levels if isinstance(levels, CascadeEngine) else CascadeEngine(levels, overlap=overlap)
    if plain:
        plan = Plan((engine.top,), ())
    tok = tokenizer or getattr(engine.levels[-1].worker, "tokenizer", None)
    sampling = SamplingParams() if sampling is None else sampling
    params = [sampling] * len(prompts) if isinstance(sampling, SamplingParams) else list(sampling)
    if len(params) != len(prompts):
        raise ValueError("one SamplingParams per prompt, or one for all")
    stop_ids = set() if ignore_eos else _stop_ids(engine.levels, tok)
    seqs: list[Seq] = []
    for p, sp in zip(prompts, params):
        if isinstance(p, str):
            if tok is None:
                raise ValueError("text prompts need a tokenizer")
            if chat:
                ids = tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                              tokenize=True, return_dict=False)
                ids = list(ids["input_ids"] if isinstance(ids, dict) else ids)
            else:
                ids = tok.encode(p)
        else:
            ids = list(p)
        seqs.append(engine.new_sequence(ids, sp, max_tokens, stop_ids))

    index = {s.seq_id: i for i, s in enumerate(seqs)}
    stop_strs = [s for s in stop if s]
    t_start = time.perf_counter()
    first: dict[str, float] = {}

    def accepted(s: Seq, new: list[int]) -> None:
        first.setdefault(s.seq_id, time.perf_counter() - t_start)
        if stop_strs and tok is not None:
            text = tok.decode(s.output, skip_special_tokens=True)
            if any(x in text for x in stop_strs):
                s.finished, s.finish_reason = True, "stop"
        if on_tokens is not None:
            on_tokens(index[s.seq_id], new)

    run_to_completion(engine, seqs, plan, accepted)
    results = []
    total: dict[str, LevelStats] = {}
    for s in seqs:
        text = None
        if tok is not None:
            text = tok.decode(s.output, skip_special_tokens=True)
            for x in stop_strs:
                cut = text.find(x)
                if cut >= 0:
                    text = text[:cut]
        stats = named_stats([lv.name for lv in engine.levels], s.stats)
        for name, st in stats.items():
            total.setdefault(name, LevelStats()).merge(st)
        results.append(GenerationResult(s.output, text, s.finish_reason or "length", s.rounds, stats,
                                        first.get(s.seq_id),
                                        list(s.logprobs) if s.sampling.logprobs is not None else None))
    return Batch(results, total)
