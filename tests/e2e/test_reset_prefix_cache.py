"""`POST /reset_prefix_cache` over real HTTP: after it the levels prefill a prompt they had cached (no prefix hit),
it answers 409 while a request runs and 401 without the API key, and `specray bench --url` calls it before each
mode's pass (so a later mode does not find the earlier mode's prompts prefilled)."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from specray.config import LevelConfig
from specray.serve.replica import Coordinator
from tests.e2e.conftest import MODEL, Server, app_config

PROMPT = "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n"


def _hits(url: str) -> dict[str, int]:
    levels = httpx.get(f"{url}/health", timeout=30).json()["levels"]
    return {name: lv["prefix_cache_hits"] for name, lv in levels.items() if isinstance(lv, dict)}


def _ask(url: str, max_tokens: int = 4, **headers: str) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": max_tokens,
                                                     "temperature": 0}, headers=headers, timeout=120)


def test_a_reset_makes_the_levels_prefill_a_cached_prompt_again(tiny):
    srv = Server(Coordinator(app_config(tiny)))
    try:
        assert _ask(srv.url).status_code == 200
        first = _hits(srv.url)
        assert set(first) == {"mid", "target"}
        assert _ask(srv.url).status_code == 200
        cached = _hits(srv.url)
        assert all(cached[n] > first[n] for n in first)  # the same prompt again: both levels reuse its prefix
        r = httpx.post(f"{srv.url}/reset_prefix_cache", timeout=60)
        assert r.status_code == 200 and r.json() == {"reset": ["mid", "target"]}
        assert _ask(srv.url).status_code == 200
        assert _hits(srv.url) == cached  # prefilled whole: no level found it cached
    finally:
        srv.stop()


def test_a_reset_empties_a_suffix_levels_store(tiny):
    cfg = app_config(tiny)
    cfg.cascade.levels[0] = LevelConfig(kind="suffix")
    srv = Server(Coordinator(cfg))
    try:
        assert _ask(srv.url, 8).status_code == 200
        store = srv.coord.levels[0].suffix
        empty = type(store)(store.config).node_count
        assert store.cached and store.node_count > empty  # the finished request's output is kept for later ones
        r = httpx.post(f"{srv.url}/reset_prefix_cache", timeout=60)
        assert r.status_code == 200 and r.json() == {"reset": ["suffix", "mid", "target"]}
        assert store.cached == [] and store.node_count == empty
    finally:
        srv.stop()


def test_busy_and_unauthenticated_resets_are_refused(tiny):
    srv = Server(Coordinator(app_config(tiny, api_key="sekret")))
    try:
        assert httpx.post(f"{srv.url}/reset_prefix_cache", timeout=30).status_code == 401
        auth = {"Authorization": "Bearer sekret"}
        done = threading.Event()
        worker = threading.Thread(target=lambda: (_ask(srv.url, 400, **auth), done.set()), daemon=True)
        worker.start()
        deadline = time.time() + 60
        while srv.coord.scheduler.num_active == 0 and not done.is_set():
            assert time.time() < deadline
            time.sleep(0.01)
        if done.is_set():
            pytest.skip("the request finished before the reset could be sent")
        r = httpx.post(f"{srv.url}/reset_prefix_cache", headers=auth, timeout=30)
        assert r.status_code == 409 and r.json()["error"]["code"] == "busy"
        assert "running" in r.json()["error"]["message"]
        worker.join(120)
        assert httpx.post(f"{srv.url}/reset_prefix_cache", headers=auth, timeout=30).status_code == 200
    finally:
        srv.stop()
