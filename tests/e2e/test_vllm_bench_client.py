"""vLLM's own serving benchmark client against specray's OpenAI server, unchanged: streaming chat requests of
its random dataset, every one must succeed, and the time to first token it measures must agree with the
server's own histogram (the server's clock starts when the request arrives, so it times a part of what the
client times: the rest is the client, the connection and HTTP on 127.0.0.1). Skipped without vllm."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from specray.serve.app import Coordinator
from tests.e2e.conftest import MODEL, Server, app_config

N = 8


def _ttft(url: str) -> tuple[float, float]:
    """(sum, count) of the server's time-to-first-token histogram."""
    total = count = 0.0
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        if fam.name.endswith("time_to_first_token_seconds"):
            for s in fam.samples:
                if s.name.endswith("_sum"):
                    total += s.value
                elif s.name.endswith("_count"):
                    count += s.value
    return total, count


def test_vllm_benchmark_client_completes_and_its_ttft_matches_the_servers(tiny, tmp_path):
    pytest.importorskip("vllm")
    srv = Server(Coordinator(app_config(tiny)))
    try:
        s0, c0 = _ttft(srv.url)
        out = tmp_path / "bench.json"
        cmd = [sys.executable, str(Path(__file__).with_name("vllm_bench_client.py")), str(out),
               "--backend", "openai-chat", "--base-url", srv.url, "--endpoint", "/v1/chat/completions",
               "--model", MODEL, "--tokenizer", str(tiny.target_dir), "--dataset-name", "random",
               "--random-input-len", "32", "--random-output-len", "16", "--num-prompts", str(N),
               "--max-concurrency", "2", "--ignore-eos", "--temperature", "0", "--seed", "0"]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        res = json.loads(out.read_text())
        s1, c1 = _ttft(srv.url)
    finally:
        srv.stop()
    assert res["completed"] == N and res["failed"] == 0, res
    assert res["total_output_tokens"] == N * 16
    assert c1 - c0 == N
    client, server = res["mean_ttft_ms"] / 1000, (s1 - s0) / (c1 - c0)
    assert server <= client * 1.02, (server, client)  # the server times a part of the client's interval
    # within 10%, or (tiny models: a first token in tens of ms) within the client's own HTTP time on loopback
    assert client - server <= max(0.1 * client, 0.03), (server, client)
