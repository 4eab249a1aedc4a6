"""Levels with their own torch thread counts in one process, called from any thread.

OpenMP counts belong to the OS thread, and torch sets a thread's count only at its first parallel op. vLLM's
CPU attention sizes a step's schedule with the thread's count and refuses a kernel run with another, so a vLLM
level first called from a new thread (the scheduler's, the look-ahead's) failed beside an hf level with
`num_threads` ("Check failed: input->metadata->thread_num == thread_num"). The counts are read here as vLLM's
kernels read them: straight from the OpenMP runtime, which leaves torch's lazy setting alone.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import pytest
import torch

from specray.engine.threads import torch_threads

T = TypeVar("T")

_OMP = ctypes.CDLL(None)  # the OpenMP runtime loaded in this process (torch's, or a preloaded one)


def omp_threads() -> int:
    """The calling thread's OpenMP count, read without letting torch set it."""
    return int(_OMP.omp_get_max_threads())


def in_new_thread(fn: Callable[[], T]) -> T:
    """Run fn in a thread that torch has not set yet (its OpenMP count is still OpenMP's default)."""
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(fn).result()


def fresh_count() -> int:
    return in_new_thread(omp_threads)


def counts_apart_from(*taken: int) -> list[int]:
    """Small thread counts other than `taken` (the box's own default among them)."""
    return [n for n in (1, 2, 3, 4) if n not in taken]


def test_torch_threads_holds_one_count_through_the_block_in_a_new_thread():
    fresh = fresh_count()
    process, inner = counts_apart_from(fresh)[:2]
    before = torch.get_num_threads()
    torch.set_num_threads(process)  # another level's count, given last: what torch sets new threads to
    try:
        def block() -> tuple[int, list[int], int]:
            start = omp_threads()
            seen = []
            with torch_threads(inner):
                seen.append(omp_threads())
                torch.randn(64, 64) @ torch.randn(64, 64)  # a parallel op: torch's lazy setting would run here
                torch.arange(1 << 16).sum()
                seen.append(omp_threads())
            return start, seen, omp_threads()

        start, seen, after = in_new_thread(block)
        assert start == fresh != process  # the case that failed: torch had not set the thread yet
        assert seen == [inner, inner]
        assert after == process  # the thread's own count (torch's, once set) comes back

        def unset() -> list[int]:
            with torch_threads(None):  # no count of its own: the thread's, fixed before the block runs
                first = omp_threads()
                torch.randn(64, 64) @ torch.randn(64, 64)
                return [first, omp_threads()]

        assert in_new_thread(unset) == [process, process]
    finally:
        torch.set_num_threads(before)


# ----- an hf level and a vLLM level with different counts in one process --------------------------------------
KV = 16 << 20
PROMPTS = ["def fibonacci(n):", "The quick brown fox jumps over the lazy dog. The quick brown", "Hello"]


def test_hf_and_vllm_levels_keep_their_counts_in_every_thread(tiny_root, monkeypatch):
    """The cascade's calls from the caller's thread, from a new thread and with the look-ahead thread drafting:
    every vLLM attention schedule is built with the vLLM level's count (so the kernel runs with it too), and the
    text is the same whichever thread ran it."""
    pytest.importorskip("vllm")
    import vllm._custom_ops as vllm_ops

    from specray.coordinator.cascade import CascadeEngine, Level
    from specray.coordinator.generate import generate
    from specray.engine.hf import HFWorker
    from specray.engine.vllm import VLLMWorker
    from specray.testing.tiny import tiny_family

    fam = tiny_family(tiny_root, heads=2, kv_heads=1)  # vLLM's CPU attention needs head_dim >= 32
    hf_n, vllm_n = counts_apart_from(fresh_count())[:2]
    before = torch.get_num_threads()
    vt = VLLMWorker(str(fam.target_dir), name="t", dtype="float32", kv_cache_bytes=KV, max_context=1024,
                    num_threads=vllm_n)
    try:
        hmid = HFWorker(str(fam.draft_dirs["mid"]), name="mid", dtype="float32", num_threads=hf_n)
        built = []
        schedule = vllm_ops.cpu_attn_get_scheduler_metadata

        def recording(*args, **kwargs):
            built.append(omp_threads())
            return schedule(*args, **kwargs)

        monkeypatch.setattr(vllm_ops, "cpu_attn_get_scheduler_metadata", recording)

        def plain() -> list[list[int]]:
            return [r.token_ids for r in generate([Level("t", worker=vt)], PROMPTS, max_tokens=12,
                                                  ignore_eos=True).results]

        def run(overlap: bool) -> list[list[int]]:
            engine = CascadeEngine([Level("mid", worker=hmid, k=4), Level("t", worker=vt)], overlap=overlap)
            out = generate(engine, PROMPTS, max_tokens=12, ignore_eos=True)
            assert out.stats["t"].accepted_tokens > 0
            assert (engine.ahead_rows > 0) == overlap  # the look-ahead thread drafted (the hf level) beside vLLM
            return [r.token_ids for r in out.results]

        # vLLM first in a new thread (as the scheduler's round threads run plain decoding): the step's model ops
        # made torch set the thread between the attention's schedule and its kernel
        text = in_new_thread(plain)
        assert built and set(built) == {vllm_n}
        built.clear()
        assert run(False) == text  # greedy speculation keeps the target's text
        assert built and set(built) == {vllm_n}  # not the hf level's count, given last in this thread
        built.clear()
        assert in_new_thread(lambda: run(True)) == text
        assert built and set(built) == {vllm_n}
        assert plain() == text
        ht = HFWorker(str(fam.target_dir), name="t", dtype="float32", num_threads=hf_n)
        hf_text = generate([Level("t", worker=ht)], PROMPTS, max_tokens=12, ignore_eos=True).results
        assert [r.token_ids for r in hf_text] == text  # vLLM's text is the model's, whatever its thread count
    finally:
        vt.close()
        torch.set_num_threads(before)
