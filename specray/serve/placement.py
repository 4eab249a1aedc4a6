"""One placement group per cascade: one bundle per model level, reserved together or not at all.

Reserving all levels at once (instead of actor by actor) means a cascade either gets every device it
needs or fails fast with a message that names the level that does not fit, rather than half-starting and
hanging. The strategy comes from `PlacementConfig` (SPREAD puts the levels on different nodes).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from specray.config import LevelConfig

#: Ray adds this much of `accelerator_type:<X>` to a request made with `accelerator_type=X`.
ACCELERATOR_SHARE = 0.001


class PlacementError(TimeoutError):
    """The levels' resources could not be reserved (infeasible, or not free within the timeout)."""


def level_bundle(cfg: LevelConfig) -> dict[str, float]:
    """The placement-group bundle of one model level: exactly what its actor requests (see `actor_options`)."""
    bundle: dict[str, float] = {"CPU": float(cfg.num_cpus)}
    if cfg.num_gpus:
        bundle["GPU"] = float(cfg.num_gpus)
    bundle.update({k: float(v) for k, v in cfg.resources.items()})
    if cfg.accelerator_type:
        bundle[f"accelerator_type:{cfg.accelerator_type}"] = ACCELERATOR_SHARE
    bundle = {k: v for k, v in bundle.items() if v > 0}
    if not bundle:
        raise ValueError(
            f"level {cfg.display_name!r} requests no resources, and a placement-group bundle cannot be empty: "
            "set num_cpus > 0 (or resources), or disable placement"
        )
    return bundle


def actor_options(cfg: LevelConfig) -> dict[str, Any]:
    """Ray resource options of a level's actor (must fit inside its bundle)."""
    opts: dict[str, Any] = {"num_cpus": cfg.num_cpus, "num_gpus": cfg.num_gpus}
    if cfg.resources:
        opts["resources"] = dict(cfg.resources)
    if cfg.accelerator_type:
        opts["accelerator_type"] = cfg.accelerator_type
    if cfg.kind == "vllm":
        from specray.engine.vllm import preload_env  # no vllm import: only a file lookup

        env = preload_env(cfg.num_gpus)
        if env:  # vLLM on CPU wants the Intel OpenMP runtime preloaded; it only acts at process start
            opts["runtime_env"] = {"env_vars": env}
    return opts


def in_bundle(pg: PlacementGroup | None, index: int) -> PlacementGroupSchedulingStrategy | str:
    """Scheduling strategy for an actor of ours.

    Never leave it unset: inside a Serve replica Ray captures child actors into the replica's own
    placement group (placement_group_capture_child_tasks=True), where they either do not fit or wait
    forever. So: our bundle explicitly, or "DEFAULT" to escape the capture.
    """
    if pg is None:
        return "DEFAULT"
    return PlacementGroupSchedulingStrategy(
        placement_group=pg, placement_group_bundle_index=index, placement_group_capture_child_tasks=False
    )


def _describe_cluster() -> str:
    try:
        nodes = [n for n in ray.nodes() if n.get("Alive")]
    except Exception:  # pragma: no cover - only for the error message
        return "cluster state unavailable"
    parts = []
    for n in nodes:
        res = {k: v for k, v in n.get("Resources", {}).items() if not k.startswith(("node:", "memory", "object_"))}
        parts.append(f"node {n['NodeID'][:8]}: {res}")
    avail = {k: v for k, v in ray.available_resources().items() if "_group_" not in k and not k.startswith("node:")}
    return "; ".join(parts) + f"; available now: {avail}"


def reserve(
    names: Sequence[str], bundles: Sequence[dict[str, float]], strategy: str, timeout_s: float, name: str | None = None
) -> PlacementGroup:
    """Create one placement group and wait for it; on timeout remove it and raise `PlacementError`."""
    pg = placement_group(list(bundles), strategy=strategy, name=name or "")
    try:
        ready = pg.wait(timeout_seconds=max(timeout_s, 0.0))
    except BaseException:
        remove_placement_group(pg)
        raise
    if not ready:
        remove_placement_group(pg)
        wanted = ", ".join(f"{n!r} (bundle {i}): {b}" for i, (n, b) in enumerate(zip(names, bundles)))
        raise PlacementError(
            f"could not place the cascade's levels with strategy {strategy} within {timeout_s:.0f}s: {wanted}. "
            f"Cluster: {_describe_cluster()}. Check the levels' num_cpus/num_gpus/resources/accelerator_type "
            f"(and that SPREAD/STRICT_SPREAD have enough nodes)."
        )
    return pg


def bundle_nodes(pg: PlacementGroup) -> dict[int, str]:
    """Bundle index -> node id (hex) where Ray reserved it."""
    table = ray.util.placement_group_table(pg)
    return {int(k): v for k, v in table.get("bundles_to_node_id", {}).items()}
