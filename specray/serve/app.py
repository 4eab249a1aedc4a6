"""Serve application builders: `build_app` (`import_path: specray.serve.app:build_app`) binds the `Coordinator`
(`specray.serve.replica`) as a Serve deployment, or the regime pools' router (`specray.serve.pools`).

    serve run specray.serve.app:build_app   # or a Serve config file naming it
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from specray.config import AppConfig
from specray.serve.replica import Coordinator


def app_config_from_args(args: Mapping[str, Any] | None) -> tuple[AppConfig, dict[str, Any]]:
    """The AppConfig and Serve deployment options an application's `args` describe, in any of the shapes
    `build_app` takes: AppConfig fields (specray's or vLLM's flat names), {"config": {...}},
    {"config_path": "file.yaml"}, or Ray Serve LLM's {"llm_configs": [...]} (`specray.compat`)."""
    if hasattr(args, "model_dump"):  # a ray.serve.llm.LLMServingArgs object
        args = args.model_dump(exclude_unset=True)  # type: ignore[union-attr]
    args = dict(args or {})
    if "llm_configs" in args:
        from specray.compat import app_from_llm_serving_args

        app, options = app_from_llm_serving_args(args)
        return AppConfig.model_validate(app), options
    if "config_path" in args:
        return AppConfig.from_yaml(args.pop("config_path")), {}
    return AppConfig.model_validate(args.pop("config", args)), {}


def build_app(args: Mapping[str, Any] | None = None):
    """Serve application builder (`import_path: specray.serve.app:build_app`, `args` = AppConfig fields).

    `args` may also be {"config_path": "file.yaml"}, {"config": {...}}, or Ray Serve LLM's {"llm_configs": [...]}
    (then its deployment_config sets the Coordinator deployment's options). Deployment options (replicas,
    autoscaling, ray_actor_options) also come from the Serve config file's `deployments:` section.
    """
    cfg, options = app_config_from_args(args)
    return build_coordinator_app(cfg, options)


def build_coordinator_app(cfg: AppConfig, options: Mapping[str, Any] | None = None):
    """The bound Coordinator deployment of `cfg` (or the regime pools' router), with Serve deployment `options`
    (Ray Serve LLM's deployment_config keys) over specray's defaults."""
    from ray import serve

    options = dict(options or {})
    if cfg.pools is not None:  # autoscaling by regime: a router in front of a speculative and a target pool
        if options:
            raise ValueError(f"deployment options {sorted(options)}: a pools app sizes its deployments in "
                             "`pools.speculative` / `pools.target`")
        from specray.serve.pools import build_pools_app

        return build_pools_app(cfg)
    # Serve's default max_ongoing_requests (5) would cap the running batch far below max_batch_size; leave
    # room for a full batch waiting behind a full batch, plus health/metrics calls.
    from specray.serve.raymetrics import RayMetricsSink

    actor = {"num_cpus": 0.5, **(options.pop("ray_actor_options", None) or {})}
    actor.pop("num_gpus", None)  # the model levels reserve the GPUs; the coordinator holds none
    opts = {"name": "Coordinator", "max_ongoing_requests": 2 * cfg.server.max_batch_size + 8, **options,
            "ray_actor_options": actor}
    deployment = serve.deployment(**opts)(serve.ingress()(Coordinator))
    return deployment.bind(cfg.model_dump(mode="json"), metric_sinks=(RayMetricsSink,), freeze_heap=True)
