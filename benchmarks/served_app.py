"""Start and stop a served config for the HTTP benchmarks: `serve run CONFIG.yaml` in its own process group.

    with serve_run(Path("serve_config.yaml"), startup_s=900) as (url, model):
        ...  # the app answers on url; stopped (and gone from url) on exit

Shared by bench_serve.py, bench_clients.py and bench_sla.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import yaml

ROOT = Path(__file__).resolve().parent.parent


def served(config: Path) -> tuple[str, str]:
    """(base URL, model id) from a Serve config file."""
    cfg = yaml.safe_load(config.read_text())
    http = cfg.get("http_options", {})
    app = cfg["applications"][0]
    url = f"http://{http.get('host', '127.0.0.1')}:{http.get('port', 8000)}{app.get('route_prefix', '/').rstrip('/')}"
    return url, app["args"]["config"]["server"]["model_name"]


def answers(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=2).status_code < 500
    except httpx.HTTPError:
        return False


def wait_ready(url: str, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"`serve run` exited with {proc.returncode} before the app was ready")
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(2)
    raise TimeoutError(f"{url} not ready after {timeout_s:.0f}s")


@contextmanager
def serve_run(config: Path, startup_s: float, log: Path | None = None) -> Iterator[tuple[str, str]]:
    """`serve run config` until the block ends; yields (base URL, model id) once GET /health answers 200.

    The app gets a fresh local Ray of its own (`--address local`): without it `serve run` would join the last
    cluster `ray start` made on this machine, whoever started it. Refuses to start when something already answers
    on the config's URL (that app would be measured instead), and on exit waits until nothing answers there, so
    the next config cannot find this one."""
    url, model = served(config)
    if answers(url):
        raise RuntimeError(f"something already answers on {url}: stop it first (`ray stop --force`)")
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    out = open(log, "w") if log else subprocess.DEVNULL  # noqa: SIM115 (closed below)
    cmd = [str(Path(sys.executable).parent / "serve"), "run", "--address", "local", str(config)]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT if log else subprocess.DEVNULL,
                            start_new_session=True)
    try:
        wait_ready(url, proc, startup_s)
        yield url, model
    finally:
        os.killpg(proc.pid, signal.SIGINT)  # `serve run` shuts the app and its Ray down on Ctrl-C
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        if log:
            out.close()
        deadline = time.monotonic() + 120
        while answers(url) and time.monotonic() < deadline:
            time.sleep(2)
