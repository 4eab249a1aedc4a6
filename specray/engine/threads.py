"""Each level's torch thread count, held per call in whatever thread calls it.

Levels that share a process (the in-process cascade, `specray bench`) may each be configured with their own
`num_threads`, and their calls come from several threads: the caller's, the scheduler's round threads, the
look-ahead thread. OpenMP thread counts belong to the OS thread, and torch sets a thread's count lazily: a
thread's first parallel torch op (or `torch.get_num_threads`) replaces OpenMP's default (the number of CPUs, or
OMP_NUM_THREADS) with the count last given to `torch.set_num_threads` anywhere in the process.

vLLM's CPU attention needs one count for a whole engine step: it sizes its schedule with the thread's OpenMP
count when it builds the step's metadata, and refuses to run the kernel when the count has changed since
("Check failed: input->metadata->thread_num == thread_num"). In a thread that torch has not set yet, the
model's first torch ops in between change it (from the CPU count to another level's `num_threads`).

So every call of a worker runs under `torch_threads(num_threads)`: torch sets the thread first, then the
level's count holds for the whole call (metadata and kernel alike), and the caller's count comes back after.
Switching between different counts costs time (OpenMP re-forms its team), so levels that share a thread do
best with one count.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Concatenate, ParamSpec, Protocol, TypeVar

import torch

__all__ = ["HasThreads", "pinned", "torch_threads"]

P = ParamSpec("P")
R = TypeVar("R")
W = TypeVar("W", bound="HasThreads")


class HasThreads(Protocol):
    """A worker whose calls `pinned` runs with its own thread count."""

    #: torch intra-op threads of this worker's calls (None: the calling thread's count)
    num_threads: int | None


@contextlib.contextmanager
def torch_threads(n: int | None) -> Iterator[None]:
    """Run the block with `n` torch (OpenMP) threads in the calling thread, then give back its count.

    The thread's count is read first, which makes torch set it now rather than at the block's first parallel
    op; so even with n None the count is fixed for the whole block."""
    before = torch.get_num_threads()
    if not n or n == before:
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def pinned(method: Callable[Concatenate[W, P], R]) -> Callable[Concatenate[W, P], R]:
    """Decorate a worker method so that it runs with the worker's `num_threads` (`torch_threads`)."""

    @functools.wraps(method)
    def run(self: W, *args: P.args, **kwargs: P.kwargs) -> R:
        with torch_threads(self.num_threads):
            return method(self, *args, **kwargs)

    return run
