"""Shared helpers for the HTTP end-to-end tests: a real uvicorn server on 127.0.0.1 over an in-process
`Coordinator` (tiny fp32 models), the test cascade config, and a module's `server` and openai `client` over it."""

from __future__ import annotations

import threading
import time
from typing import Any

import openai
import pytest

from specray.config import AppConfig
from specray.serve.http import build_http_app
from specray.serve.localcluster import free_port
from specray.serve.replica import Coordinator

MODEL = "tiny-cascade"


def app_config(tiny, max_context: int | None = None, **server: Any) -> AppConfig:
    """ngram -> mid -> target over the tiny family; `max_context` caps the model levels' context."""
    ctx = {"max_context": max_context} if max_context else {}
    return AppConfig.model_validate({
        "cascade": {"levels": [
            {"kind": "ngram", "num_speculative_tokens": 3},
            {"kind": "hf", "model": str(tiny.draft_dirs["mid"]), "name": "mid", "dtype": "float32",
             "num_speculative_tokens": 4, **ctx},
            {"kind": "hf", "model": str(tiny.target_dir), "name": "target", "dtype": "float32", **ctx},
        ]},
        "server": {"model_name": MODEL, "in_process": True, **server},
    })


class Server:
    """uvicorn serving `build_http_app(coord)` in a daemon thread; `url` is its base URL."""

    def __init__(self, coord: Coordinator) -> None:
        import uvicorn

        self.port = free_port()
        self.coord = coord
        config = uvicorn.Config(build_http_app(coord), host="127.0.0.1", port=self.port, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started:
            assert time.time() < deadline, "server did not start"
            time.sleep(0.05)
        self.url = f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


@pytest.fixture(scope="module")
def server(tiny):
    srv = Server(Coordinator(app_config(tiny)))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
