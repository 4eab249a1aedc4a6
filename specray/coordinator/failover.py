"""Level failover: a draft level whose call fails is dropped from the cascade and taken back once it answers.

Dropping a draft level is exact (drafts are only proposals). Its epoch is bumped, so every sequence re-adds
itself there on the next call (a restarted actor lost them all). A down level is probed at most every
`retry_after_s`, in a thread that the round waits for only `probe_wait_s`: a level whose node is gone can
leave the call pending for a long time, and the round loop (every other request) must not stall on it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Collection, Sequence

from specray.coordinator.state import Level, Plan

__all__ = ["Failover", "LevelCallError"]

log = logging.getLogger(__name__)


class LevelCallError(RuntimeError):
    """A worker call of one level failed; `level` is its index. Below the target the engine drops the level
    and retries the round without it; the target failing is fatal to the round's requests."""

    def __init__(self, level: int, name: str, cause: BaseException) -> None:
        super().__init__(f"level {name!r} failed: {type(cause).__name__}: {cause}")
        self.level, self.name, self.cause = level, name, cause


class Failover:
    """Which levels are down, when to probe them, and each level's epoch (bumped when it is marked down)."""

    def __init__(self, levels: Sequence[Level]) -> None:
        self.levels = list(levels)
        self.top = len(self.levels) - 1
        self.retry_after_s = 2.0
        self.probe_wait_s = 0.05
        self.epoch = [0] * len(self.levels)
        self.down: dict[int, float] = {}  # level -> monotonic time of the next health probe
        self._probing: set[int] = set()
        self._lock = threading.Lock()

    def available(self, plan: Plan, failed: Collection[int] = ()) -> Plan:
        """The plan without levels that are down (probing those whose retry time has come) and without `failed`
        (levels that failed earlier in this round: never probed back within it, so a round's retries end)."""
        if not self.down and not failed:
            return plan
        keep = [(i, k) for i, k in zip(plan.levels[:-1], plan.k)
                if i not in failed and (i not in self.down or self.probe(i))]
        if len(keep) == len(plan.k):
            return plan  # a hybrid plan stays hybrid; one losing its model is the lookup's plan
        levels = (*[i for i, _ in keep], self.top)
        return Plan(levels, tuple(k for _, k in keep), tree=plan.tree if levels[0] == plan.levels[0] else 0)

    def probe(self, i: int) -> bool:
        """Is down level `i` back? A slow answer takes the level back at a later round."""
        with self._lock:
            if i not in self.down:
                return True
            if i in self._probing or time.monotonic() < self.down[i]:
                return False
            self._probing.add(i)
            self.down[i] = time.monotonic() + self.retry_after_s
        done = threading.Event()

        def check() -> None:
            try:
                self.levels[i].worker.stats()
                ok = True
            except Exception:
                ok = False
            with self._lock:
                self._probing.discard(i)
                if ok and self.down.pop(i, None) is not None:
                    log.warning("level %r is back in the cascade", self.levels[i].name)
                elif not ok and i in self.down:
                    self.down[i] = time.monotonic() + self.retry_after_s
            done.set()

        threading.Thread(target=check, name=f"specray-probe-{self.levels[i].name}", daemon=True).start()
        done.wait(self.probe_wait_s)
        with self._lock:
            return i not in self.down

    def mark_down(self, i: int, exc: BaseException) -> None:
        with self._lock:
            self.epoch[i] += 1
            self.down[i] = time.monotonic() + self.retry_after_s
        log.warning("dropping level %r from the cascade until it answers again: %s", self.levels[i].name, exc)

    def status(self) -> dict[str, str]:
        return {lv.name: ("down" if i in self.down else "up") for i, lv in enumerate(self.levels)}
