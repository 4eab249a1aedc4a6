"""A client that disconnects mid-stream frees its sequence on every level within about one round."""

from __future__ import annotations

import time

import httpx

from tests.e2e.test_http_openai import MODEL, Server, app_config


def _live(coord) -> list[int]:
    return [lv.worker.stats().live_sequences for lv in coord.levels if lv.worker is not None]


def test_disconnect_frees_every_level(tiny):
    from specray.serve.replica import Coordinator

    coord = Coordinator(app_config(tiny))
    srv = Server(coord)
    try:
        with httpx.Client(timeout=60) as client, client.stream("POST", srv.url + "/v1/completions", json={
            "model": MODEL, "prompt": "def fibonacci(n):", "max_tokens": 400, "stream": True, "ignore_eos": True,
        }) as r:
            lines = r.iter_lines()
            got = [next(lines) for _ in range(3)]
            assert all(g.startswith("data: ") for g in got if g)
            assert max(_live(coord)) == 1  # the sequence lives on the levels while streaming
            cache_bytes = [lv.worker.stats().cached_tokens for lv in coord.levels if lv.worker is not None]
            assert max(cache_bytes) > 0
        # the connection is closed here
        deadline = time.time() + 10
        while max(_live(coord)) and time.time() < deadline:
            time.sleep(0.05)
        assert _live(coord) == [0, 0]
        assert all(lv.worker.stats().cached_tokens == 0 for lv in coord.levels if lv.worker is not None)
        assert coord.scheduler.num_active == 0
        # and the server keeps serving
        ok = httpx.post(srv.url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 3})
        assert ok.status_code == 200
    finally:
        srv.stop()
