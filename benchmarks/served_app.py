"""Start and stop a served config for the HTTP benchmarks: `serve run CONFIG.yaml` in its own process group.

    with serve_run(Path("serve_config.yaml"), startup_s=900) as (url, model, pid):
        ...  # the app answers on url; stopped (and gone from url) on exit

Shared by bench_serve.py, bench_clients.py and bench_sla.py. `paused(app.pid)` stops the app's processes (Ray's
included) for a block, so that an engine measured meanwhile has the box to itself, as it would without the app.
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
from typing import NamedTuple

import httpx
import yaml

ROOT = Path(__file__).resolve().parent.parent


class App(NamedTuple):
    url: str  # base URL
    model: str  # the model id requests name
    pid: int  # the `serve run` process: its descendants are Ray's processes and the app's


def processes() -> dict[int, tuple[int, float]]:
    """pid -> (parent pid, CPU seconds so far, user + system) of every process on the box (Linux /proc)."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
                out[int(d)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / tick)
            except (OSError, IndexError, ValueError):  # gone meanwhile
                pass
    return out


def descendants(root: int, procs: dict[int, tuple[int, float]] | None = None) -> list[int]:
    """`root` and its descendants among `procs` (default: every process now), breadth first: each parent before
    its children."""
    procs = processes() if procs is None else procs
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in sorted(procs.items()):
        children.setdefault(ppid, []).append(pid)
    order = [root]
    for pid in order:
        order.extend(children.get(pid, ()))
    return order


def tree(root: int, procs: dict[int, tuple[int, float]] | None = None) -> set[int]:
    """`root` and its descendants among `procs` (default: every process now)."""
    return set(descendants(root, procs))


@contextmanager
def paused(root: int) -> Iterator[set[int]]:
    """`root` and its descendants stopped (SIGSTOP) for the block and continued after it; yields their pids.

    An idle Ray app is not idle: its GCS, raylet, dashboard agent, Serve controller, proxy and replicas keep
    about a third of a 2-core box busy (benchmarks/README.md section 0). A peer engine asked beside it would
    share the cores with them, which a user running that engine alone would not. Stopped, they use nothing; no
    request of theirs may be in flight (their timers see one long pause: Ray's health checks allow it)."""
    stopped: list[int] = []
    try:
        for pid in descendants(root):  # each parent stopped before its children
            try:
                os.kill(pid, signal.SIGSTOP)
                stopped.append(pid)
            except ProcessLookupError:
                pass
        yield set(stopped)
    finally:
        for pid in reversed(stopped):
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass


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
def serve_run(config: Path, startup_s: float, log: Path | None = None) -> Iterator[App]:
    """`serve run config` until the block ends; yields the `App` once GET /health answers 200.

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
        yield App(url, model, proc.pid)
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
