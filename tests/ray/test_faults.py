"""Faults on a real local Ray, seen through real HTTP: a draft level's actor killed in the middle of 8 streams
(all finish, exact, the level leaves and rejoins the cascade), the target's actor killed (in-flight requests
end with a 503 error event, later requests succeed). Stopping a whole node: tests/ray/test_multinode.py."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Callable

import httpx
import pytest

from specray.config import AppConfig
from tests.e2e.conftest import Server
from tests.ray.conftest import local_ray

pytestmark = pytest.mark.ray

MODEL = "tiny-faults"
MAX_TOKENS = 240  # long enough that a kill after the first chunks lands mid-stream
PROMPTS = [
    "def fibonacci(n):",
    "Hello",
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "class Stack:\n    def push(self, x):",
    "a b a b a b",
    "import os\nimport sys\n",
    "x = 1; y = 2; z = x + y; print(z)",
    "for i in range(10):",
]


def actor_config(tiny, resources: dict[str, dict[str, float]] | None = None, **cascade) -> AppConfig:
    """ngram -> mid -> target, each model level in its own Ray actor; the plan is fixed (no planner), so
    which levels run is decided by faults alone."""
    res = resources or {}

    def hf(name: str, path, **kw):
        return {"kind": "hf", "model": str(path), "name": name, "dtype": "float32", "num_threads": 1,
                "num_cpus": 0.5, "resources": res.get(name, {}), **kw}

    return AppConfig.model_validate({
        "cascade": {"levels": [{"kind": "ngram", "num_speculative_tokens": 3},
                               hf("mid", tiny.draft_dirs["mid"], num_speculative_tokens=4),
                               hf("target", tiny.target_dir)], **cascade},
        "server": {"model_name": MODEL, "max_batch_size": 16},
        "policy": {"adaptive": False},
    })


class Stream(threading.Thread):
    """One streaming /v1/completions client: collects text chunks, error events and the [DONE] marker."""

    def __init__(self, url: str, prompt: str, max_tokens: int = MAX_TOKENS) -> None:
        super().__init__(daemon=True)
        self.url, self.prompt, self.max_tokens = url, prompt, max_tokens
        self.chunks: list[str] = []
        self.errors: list[dict] = []
        self.finish: str | None = None
        self.done = False
        self.failure: BaseException | None = None

    def run(self) -> None:
        body = {"model": MODEL, "prompt": self.prompt, "max_tokens": self.max_tokens, "stream": True, "temperature": 0,
                "ignore_eos": True}
        try:
            with httpx.Client(timeout=120) as c, c.stream("POST", self.url + "/v1/completions", json=body) as r:
                assert r.status_code == 200, r.read()
                for line in r.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[len("data: "):]
                    if data == "[DONE]":
                        self.done = True
                        break
                    obj = json.loads(data)
                    if "error" in obj:
                        self.errors.append(obj["error"])
                        continue
                    choice = obj["choices"][0]
                    self.chunks.append(choice["text"])
                    self.finish = choice.get("finish_reason") or self.finish
        except BaseException as exc:  # reported by the test, not swallowed
            self.failure = exc

    @property
    def text(self) -> str:
        return "".join(self.chunks)


def run_streams(url: str, prompts: list[str], during: Callable[[list[Stream]], None] | None = None,
                timeout_s: float = 180) -> list[Stream]:
    streams = [Stream(url, p) for p in prompts]
    for s in streams:
        s.start()
    if during is not None:
        during(streams)
    for s in streams:
        s.join(timeout_s)
        assert not s.is_alive(), f"stream for {s.prompt!r} hangs"
        assert s.failure is None, s.failure
    return streams


def wait_for(cond: Callable[[], bool], timeout_s: float, what: str, every: float = 0.02) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(every)


class CallRecorder:
    """An engine observer: which levels were called since `clear()`."""

    def __init__(self) -> None:
        self.levels: set[int] = set()

    def on_call(self, level: int, kind: str, batch: int, tokens: int, seconds: float) -> None:
        self.levels.add(level)

    def on_verify(self, *args, **kwargs) -> None:
        pass


@pytest.fixture(scope="module")
def served(tiny):
    from specray.serve.replica import Coordinator

    with local_ray(num_cpus=4):
        coord = Coordinator(actor_config(tiny))
        srv = Server(coord)
        try:
            yield coord, srv
        finally:
            srv.stop()
            coord._launched.shutdown()


def _pid(coord, level: str) -> int:
    return coord._launched.workers[level].info()["pid"]


def test_draft_actor_killed_mid_stream_all_finish_exactly_and_it_rejoins(served):
    coord, srv = served
    rec = CallRecorder()
    coord.engine.observers.append(rec)
    try:
        ref = run_streams(srv.url, PROMPTS)
        assert all(s.finish == "length" and s.done and not s.errors for s in ref)
        assert rec.levels == {1, 2}  # mid and target both ran (level 0, the n-gram, is not a worker)
        old_pid = _pid(coord, "mid")
        seen: list[str] = []

        def kill_mid(streams: list[Stream]) -> None:
            wait_for(lambda: min(len(s.chunks) for s in streams) >= 2, 60, "every stream to start")
            assert max(len(s.chunks) for s in streams) < MAX_TOKENS // 4  # really mid-stream
            os.kill(old_pid, signal.SIGKILL)
            while any(s.is_alive() for s in streams):
                seen.append(coord.engine.level_status()["mid"])
                time.sleep(0.01)

        faulty = run_streams(srv.url, PROMPTS, during=kill_mid)
        for want, got in zip(ref, faulty):
            assert not got.errors and got.done and got.finish == "length", (got.prompt, got.errors)
            assert got.text == want.text, got.prompt  # greedy: exactly the fault-free output
        assert "down" in seen, "the killed level was never dropped from the cascade"

        # Ray restarts the actor; the cascade probes it and takes it back
        wait_for(lambda: ok_request(srv) and coord.engine.level_status()["mid"] == "up", 60,
                 "the level to come back", every=0.5)
        assert _pid(coord, "mid") != old_pid
        rec.levels.clear()
        again = run_streams(srv.url, PROMPTS[:2])
        assert [s.text for s in again] == [s.text for s in ref[:2]]
        assert 1 in rec.levels, "the restarted level is not drafting again"
        assert all(st == "up" for st in coord.engine.level_status().values())
        assert coord.scheduler.num_active == 0
        assert [lv.worker.stats().live_sequences for lv in coord.levels if lv.worker is not None] == [0, 0]
    finally:
        coord.engine.observers.remove(rec)


def ok_request(srv: Server) -> bool:
    """One short request (also drives rounds, which is when the cascade probes a down level)."""
    r = httpx.post(srv.url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 4}, timeout=60)
    return r.status_code == 200


def test_target_actor_killed_in_flight_get_503_then_service_resumes(served):
    coord, srv = served
    ref = run_streams(srv.url, PROMPTS[:4])
    old_pid = _pid(coord, "target")

    def kill_target(streams: list[Stream]) -> None:
        wait_for(lambda: min(len(s.chunks) for s in streams) >= 2, 60, "every stream to start")
        os.kill(old_pid, signal.SIGKILL)

    t0 = time.monotonic()
    broken = run_streams(srv.url, PROMPTS[:4], during=kill_target)
    assert time.monotonic() - t0 < 90
    for s in broken:
        assert s.done and s.finish is None, s.prompt  # ended early, with the [DONE] marker
        assert len(s.errors) == 1, s.errors
        err = s.errors[0]
        assert err["status"] == 503 and err["code"] == "model_unavailable" and err["type"] == "server_error"
        assert "unavailable" in err["message"]
    # non-streaming requests during the restart are 503 with an OpenAI error body, or already succeed
    statuses = []
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        r = httpx.post(srv.url + "/v1/completions", json={"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 8,
                                                           "temperature": 0, "ignore_eos": True}, timeout=60)
        statuses.append(r.status_code)
        if r.status_code == 200:
            break
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] == "model_unavailable"
        time.sleep(0.5)
    assert statuses[-1] == 200, statuses
    assert _pid(coord, "target") != old_pid
    after = run_streams(srv.url, PROMPTS[:4])
    assert [s.text for s in after] == [s.text for s in ref]
    assert all(not s.errors for s in after)
    assert coord.scheduler.num_active == 0
