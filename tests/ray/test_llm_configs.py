"""A Ray Serve LLM-style config (llm_configs) deploys on a real local Ray with only its import_path changed, and
answers the openai client with speculation (tiny models built at test time)."""

from __future__ import annotations

import os
from pathlib import Path

import openai
import pytest
import yaml

from specray.serve.localcluster import free_port

pytestmark = pytest.mark.ray


def llm_tiny_config(tiny) -> dict:
    text = (Path(__file__).parent / "serve_config_llm_tiny.yaml").read_text()
    text = text.replace("${TINY_MID}", str(tiny.draft_dirs["mid"])).replace("${TINY_TARGET}", str(tiny.target_dir))
    return yaml.safe_load(text)


def test_llm_configs_yaml_deploys_and_answers(tiny):
    import ray
    from ray import serve
    from ray.serve.schema import ServeDeploySchema

    cfg = llm_tiny_config(tiny)
    ServeDeploySchema.model_validate(cfg)
    app_cfg = cfg["applications"][0]
    from ray._common.utils import import_attr
    from ray.serve._private.api import call_user_app_builder_with_args_if_necessary

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"RAY_AUTH_MODE": "disabled", "TOKENIZERS_PARALLELISM": "false"}})
    port = free_port()
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        # what `serve run` does with an application's import_path and args
        app = call_user_app_builder_with_args_if_necessary(import_attr(app_cfg["import_path"]), app_cfg["args"])
        serve.run(app, name=app_cfg["name"], route_prefix=app_cfg["route_prefix"])
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=120)
        assert [m.id for m in client.models.list().data] == ["tiny"]  # model_loading_config.model_id
        kw = dict(model="tiny", prompt="def fibonacci(n):", max_tokens=16, temperature=0,
                  extra_body={"ignore_eos": True})
        spec = client.completions.create(**kw)
        plain = client.completions.create(**{**kw, "extra_body": {"ignore_eos": True,
                                                                  "speculation": {"method": "none"}}})
        assert spec.choices[0].text == plain.choices[0].text and spec.usage.completion_tokens == 16
        # the draft model (the only drafter) drafted for the target
        assert sum(v["draft_tokens"] for v in spec.model_dump()["usage"]["speculation"].values()) > 0
        with pytest.raises(openai.BadRequestError):  # engine_kwargs.max_model_len is the context limit
            client.completions.create(model="tiny", prompt="x", max_tokens=600)
        chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=4, temperature=0)
        assert chat.choices[0].message.role == "assistant"
    finally:
        serve.shutdown()
        ray.shutdown()
