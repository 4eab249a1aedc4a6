"""Launching a cascade's model levels: one Ray actor per level, in one placement group (`launch_levels`).

`launch_levels` reserves the placement group, starts the actors (`specray.serve.level_actor.LevelActor`) with each
level's resources, waits until they have loaded their models, checks that their tokenizers agree, and returns
ready-to-use `Level`s over `ActorWorker`s (n-gram levels run in the caller's process). Nothing stays running
after an error.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.exceptions import RayActorError, RayTaskError
from ray.util.placement_group import PlacementGroup, remove_placement_group

from specray.config import CascadeConfig, LevelConfig
from specray.coordinator.state import Level
from specray.engine.tokenizer_check import TokenizerMismatchError
from specray.serve.actor_client import _first_line, _last_line
from specray.serve.actors import ActorWorker, RemoteNesting
from specray.serve.level_actor import LevelActor, LevelStartError, WorkerFactory
from specray.serve.placement import actor_options, bundle_nodes, in_bundle, level_bundle, reserve

__all__ = ["LaunchedCascade", "default_factory", "launch_levels"]

log = logging.getLogger(__name__)


@dataclass
class LaunchedCascade:
    """The running cascade: `levels` feed `CascadeEngine`; `shutdown()` kills the actors and frees the PG."""

    levels: list[Level]
    actors: dict[str, Any]  # level name -> actor handle (model levels only)
    workers: dict[str, ActorWorker]
    placement_group: PlacementGroup | None
    info: dict[str, dict[str, Any]] = field(default_factory=dict)  # level name -> info() at start-up
    tokenizer_fingerprint: str | None = None
    #: for `CascadeEngine(..., nesting=)`: middle levels draft beside their models (None: `cascade.nested` off)
    nesting: RemoteNesting | None = None

    def shutdown(self) -> None:
        """Kill every actor (no restart) and remove the placement group; idempotent. A no-op once Ray is
        shut down (the cluster took the actors with it; calling Ray then would start a new local one)."""
        if not ray.is_initialized():
            self.actors.clear()
            self.placement_group = None
            return
        for w in self.workers.values():
            w.close()
        for handle in self.actors.values():
            try:
                ray.kill(handle, no_restart=True)
            except Exception:  # already gone
                pass
        self.actors.clear()
        if self.placement_group is not None:
            try:
                remove_placement_group(self.placement_group)
            except Exception:
                pass
            self.placement_group = None

    def __enter__(self) -> LaunchedCascade:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def default_factory(cfg: LevelConfig) -> WorkerFactory:
    """The production factory of a model level: `create_worker(cfg)`, run inside the actor."""
    from specray.coordinator.generate import create_worker

    return functools.partial(create_worker, cfg)


def launch_levels(
    cfg: CascadeConfig,
    factories: Sequence[WorkerFactory | None] | None = None,
    name_prefix: str | None = "specray",
    namespace: str | None = None,
    placement_timeout_s: float | None = None,
    start_timeout_s: float | None = None,
    call_timeout_s: float | None = None,
    transport: str | None = None,
    poll: bool | None = None,
) -> LaunchedCascade:
    """Start one actor per model level (in one placement group) and return the cascade's `Level`s.

    factories: aligned with `cfg.levels`; None (or a None entry) uses `create_worker(level config)`.
    Entries of n-gram levels are ignored: those levels run in the caller's process.
    name_prefix: actors are named "<prefix>.<level>" (None: anonymous). Raises `PlacementError` if the
    bundles cannot be reserved within `placement_timeout_s` (default: `cfg.placement.timeout_s`),
    `LevelStartError` if an actor fails to start within `start_timeout_s` (default: `cfg.start_timeout_s`),
    and `TokenizerMismatchError` if two model levels disagree on the tokenizer; nothing stays running
    after an error. transport: how rounds reach the actors (default `cfg.transport`; module docstring); poll: the
    direct transport polls near a due frame (default `cfg.poll`).
    """
    from specray.coordinator.generate import level_from_config

    if factories is not None and len(factories) != len(cfg.levels):
        raise ValueError(f"factories must be aligned with the {len(cfg.levels)} levels, got {len(factories)}")
    model_idx = [i for i, lc in enumerate(cfg.levels) if not lc.is_lookup]
    names = [cfg.levels[i].display_name for i in model_idx]
    placement_timeout_s = cfg.placement.timeout_s if placement_timeout_s is None else placement_timeout_s
    start_timeout_s = cfg.start_timeout_s if start_timeout_s is None else start_timeout_s
    pg = None
    if cfg.placement.enabled:
        pg_name = f"{name_prefix}.pg" if name_prefix else None
        pg = reserve(names, [level_bundle(cfg.levels[i]) for i in model_idx], cfg.placement.strategy,
                     placement_timeout_s, name=pg_name)
    launched = LaunchedCascade([], {}, {}, pg)
    try:
        remote_cls = ray.remote(LevelActor)
        for j, i in enumerate(model_idx):
            lc = cfg.levels[i]
            factory = (factories[i] if factories is not None else None) or default_factory(lc)
            threads = lc.num_threads or max(1, round(lc.num_cpus))
            opts = actor_options(lc)
            if name_prefix:
                opts["name"] = f"{name_prefix}.{lc.display_name}"
            if namespace is not None:
                opts["namespace"] = namespace
            launched.actors[lc.display_name] = remote_cls.options(
                max_restarts=-1, max_task_retries=0, scheduling_strategy=in_bundle(pg, j), **opts,
            ).remote(factory, threads)
        infos = _wait_ready(launched.actors, start_timeout_s)
        launched.info = infos
        launched.tokenizer_fingerprint = _check_tokenizers(infos)
        if pg is not None:
            where = bundle_nodes(pg)
            for j, name in enumerate(names):
                infos[name]["expected_bundle_index"] = j
                infos[name]["bundle_node_id"] = where.get(j)
        for lc in cfg.levels:
            if lc.is_lookup:
                launched.levels.append(level_from_config(lc))
                continue
            w = ActorWorker(launched.actors[lc.display_name], timeout_s=call_timeout_s, info=infos[lc.display_name],
                            level=lc.display_name, transport=transport or cfg.transport,
                            poll=cfg.poll if poll is None else poll)
            launched.workers[lc.display_name] = w
            launched.levels.append(level_from_config(lc, worker=w))
        if cfg.nested:
            launched.nesting = RemoteNesting(relay=cfg.relay, follow=cfg.follows)
    except BaseException:
        launched.shutdown()
        raise
    return launched


def _wait_ready(actors: dict[str, Any], timeout_s: float) -> dict[str, dict[str, Any]]:
    """info() of every actor, waited for together (models load in parallel)."""
    refs = {name: h.info.remote() for name, h in actors.items()}
    pending = list(refs.values())
    ready, pending = ray.wait(pending, num_returns=len(pending), timeout=timeout_s)
    if pending:
        slow = [n for n, r in refs.items() if r in pending]
        raise LevelStartError(f"levels {slow} did not become ready within {timeout_s:.0f}s "
                              "(model still loading, or their resources are not available)")
    out = {}
    for name, ref in refs.items():
        try:
            out[name] = ray.get(ref)
        except (RayActorError, RayTaskError) as e:
            raise LevelStartError(f"level {name!r} failed to start: {_first_line(e)} ... {_last_line(e)}") from e
    return out


def _check_tokenizers(infos: dict[str, dict[str, Any]]) -> str | None:
    """All model levels that have a tokenizer must share it (vocab and eos), else draft ids are meaningless."""
    named = [(n, i) for n, i in infos.items() if i.get("tokenizer_fingerprint")]
    if not named:
        return None
    ref_name, ref = named[0]
    for name, i in named[1:]:
        if i["tokenizer_fingerprint"] != ref["tokenizer_fingerprint"]:
            raise TokenizerMismatchError(
                f"models {ref_name!r} and {name!r} do not share a tokenizer (vocab fingerprints "
                f"{ref['tokenizer_fingerprint'][:12]} vs {i['tokenizer_fingerprint'][:12]}), so draft token ids "
                "cannot be verified across them"
            )
        if i["tokenizer_eos_id"] != ref["tokenizer_eos_id"]:
            raise TokenizerMismatchError(
                f"models {ref_name!r} and {name!r} do not share a tokenizer: eos id {ref['tokenizer_eos_id']} "
                f"vs {i['tokenizer_eos_id']}"
            )
    return ref["tokenizer_fingerprint"]
