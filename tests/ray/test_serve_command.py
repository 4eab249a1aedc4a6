"""`specray serve MODEL --draft M --ngram` as a user runs it: a subprocess that starts its own Ray and Serve on a
free port, serves the openai client, and stops cleanly on SIGTERM (tiny models built at test time)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import openai
import pytest

from specray.serve.localcluster import free_port

pytestmark = pytest.mark.ray

ROOT = Path(__file__).resolve().parents[2]


def test_specray_serve_one_liner_serves_the_openai_client(tiny):
    port = free_port()
    target, mid = str(tiny.target_dir), str(tiny.draft_dirs["mid"])
    cmd = [sys.executable, "-m", "specray.cli", "serve", target, "--draft", mid, "--ngram", "--served-model-name",
           "tiny", "--dtype", "float32", "--threads", "1", "--num-cpus", "0.5", "--max-num-seqs", "4",
           "--port", str(port), "--address", "local", "--k", "3", "--k", "4"]
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    lines: list[str] = []
    ready = threading.Event()

    def read() -> None:
        for line in proc.stdout:
            lines.append(line)
            if "specray: serving" in line:
                ready.set()

    threading.Thread(target=read, daemon=True).start()
    try:
        deadline = time.monotonic() + 240
        while not ready.wait(1.0) and proc.poll() is None:
            assert time.monotonic() < deadline, "specray serve did not start in time:\n" + "".join(lines)
        assert ready.is_set(), "specray serve exited:\n" + "".join(lines)
        served = next(ln for ln in lines if "specray: serving" in ln)
        assert f"http://127.0.0.1:{port}/v1" in served
        assert f"ngram->{mid}" in served and f"{mid}->{target}" in served  # drafter -> verifier pairs
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=120)
        assert [m.id for m in client.models.list().data] == ["tiny"]
        kw = dict(model="tiny", prompt="def fibonacci(n):", max_tokens=12, temperature=0,
                  extra_body={"ignore_eos": True})
        spec = client.completions.create(**kw)
        plain = client.completions.create(**{**kw, "extra_body": {"ignore_eos": True,
                                                                  "speculation": {"method": "none"}}})
        assert spec.choices[0].text == plain.choices[0].text and spec.usage.completion_tokens == 12
        assert sum(v["draft_tokens"] for v in spec.model_dump()["usage"]["speculation"].values()) > 0
        proc.send_signal(signal.SIGTERM)  # stops like Ctrl-C: Serve and its Ray shut down
        assert proc.wait(timeout=120) == 0, "".join(lines)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
