"""Ray Serve LLM's builder name for specray: a Serve config written for `ray.serve.llm:build_openai_app` runs
with only its import path changed to `specray.serve.llm:build_openai_app`.

    applications:
      - name: llm_app
        import_path: specray.serve.llm:build_openai_app
        args:
          llm_configs:
            - model_loading_config: {model_id: qwen-1.5b, model_source: qwen2.5-coder-1.5b-instruct}
              engine_kwargs:
                max_model_len: 4096
                speculative_config: {method: draft_model, model: qwen2.5-coder-0.5b-instruct,
                                     num_speculative_tokens: 4}
              deployment_config: {autoscaling_config: {min_replicas: 1, max_replicas: 2}}

How each field maps (and what does not): `specray.compat.app_from_llm_config` and docs/migration.md.
"""

from __future__ import annotations

from typing import Any

from specray.serve.app import build_app


def build_openai_app(llm_serving_args: Any):
    """The specray application for Ray Serve LLM's `LLMServingArgs` ({"llm_configs": [one LLMConfig]}, as a
    dict or the object); `specray.serve.app:build_app` takes the same args."""
    return build_app(llm_serving_args)


__all__ = ["build_app", "build_openai_app"]
