"""A multi-node Ray cluster on one machine (head + workers as separate `ray start` processes), for tests
and development. `cluster/local.sh` is the shell twin of this module.

Why not `ray stop`: it kills every Ray process of the user on the box, including other people's or other
tests' clusters. Each cluster here gets its own `--temp-dir` (a short /tmp/srl-* folder, since Unix socket
paths are limited to ~107 characters), so its processes are found by that folder in their command line
(plus the Ray client server, found by its GCS address), and are stopped by PID: raylets first (their
agents and workers exit with them), then the head's services; whatever ignores SIGTERM gets SIGKILL.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

#: Ray's worker processes use ports 10002-19999 by default; our ports must stay out of that range.
_WORKER_PORT_RANGE = range(10002, 20000)


@dataclass(frozen=True)
class NodeSpec:
    """One node of the local cluster. Small memory and object store keep start-up and RAM low."""

    num_cpus: float = 1
    resources: dict[str, float] = field(default_factory=dict)
    memory: int = 2_000_000_000
    object_store_memory: int = 100_000_000


#: head + two workers with distinct custom resources (pin levels with resources={"draft": 1} etc.).
DEFAULT_NODES = (
    NodeSpec(1, {"head_node": 1}),
    NodeSpec(1, {"draft": 2}),
    NodeSpec(1, {"target": 2}, memory=3_000_000_000),
)


def free_port() -> int:
    """An unused TCP port on 127.0.0.1 that nothing else is about to take. Not one from `bind(("127.0.0.1", 0))`: the
    kernel hands those, and the local ports of outgoing connections, out of its ephemeral range, where a Ray that
    starts before our server binds takes dozens (a Serve proxy then failed to bind the port picked for it). So a
    port below that range and above Ray's worker ports, at random, checked free; the kernel's pick where no such
    range exists."""
    lo = _ephemeral_low()
    below = range(_WORKER_PORT_RANGE.stop, lo - 1)  # port + 1 is also kept free (a cluster's client port)
    for port in random.sample(below, k=min(len(below), 64)):
        if _bindable(port) and _bindable(port + 1):
            return port
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _WORKER_PORT_RANGE and port + 1 not in _WORKER_PORT_RANGE:
            return port


def _ephemeral_low() -> int:
    """The lowest port of the kernel's ephemeral range (Linux: `ip_local_port_range`; elsewhere IANA's 49152)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 49152


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _ray_bin() -> str:
    exe = Path(sys.executable).parent / "ray"
    return str(exe) if exe.exists() else (shutil.which("ray") or "ray")


def _proc_table() -> dict[int, tuple[int, str]]:
    """pid -> (ppid, command line) for every process we can read."""
    out: dict[int, tuple[int, str]] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
            with open(f"/proc/{d}/stat") as f:
                stat = f.read()
            ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        out[int(d)] = (ppid, cmd)
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[-1][:1] not in ("Z", "X")
    except OSError:
        return False


class LocalCluster:
    """Start/stop a local multi-node cluster. Use as a context manager so it is torn down on failure too.

    >>> with LocalCluster() as c:           # doctest: +SKIP
    ...     ray.init(address=c.address)
    ...     c.wait_for_nodes()
    """

    def __init__(
        self, nodes: Sequence[NodeSpec] = DEFAULT_NODES, port: int | None = None, temp_dir: str | None = None,
        keep_logs: bool = False,
    ) -> None:
        if not nodes:
            raise ValueError("a cluster needs at least the head node")
        self.nodes = list(nodes)
        self.port = port or free_port()
        self.client_port = free_port()
        self.temp_dir = temp_dir or tempfile.mkdtemp(prefix="srl-", dir="/tmp")
        self.keep_logs = keep_logs
        self.env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _args(self, spec: NodeSpec) -> list[str]:
        return [
            f"--num-cpus={spec.num_cpus:g}", f"--resources={json.dumps(spec.resources)}",
            f"--memory={spec.memory}", f"--object-store-memory={spec.object_store_memory}",
            f"--temp-dir={self.temp_dir}", "--disable-usage-stats",
        ]

    def start(self, timeout_s: float = 120.0) -> str:
        """Start the head, then the workers; return the GCS address. Stops everything on failure."""
        ray = _ray_bin()
        try:
            head = [ray, "start", "--head", f"--port={self.port}", f"--ray-client-server-port={self.client_port}",
                    "--include-dashboard=false", *self._args(self.nodes[0])]
            subprocess.run(head, env=self.env, check=True, capture_output=True, text=True, timeout=timeout_s)
            # one node at a time: started in parallel on a 2-core box, a raylet timed out registering
            for spec in self.nodes[1:]:
                subprocess.run([ray, "start", f"--address={self.address}", *self._args(spec)], env=self.env,
                               check=True, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.CalledProcessError as e:
            self.stop()
            out = f"{e.stdout or ''}{e.stderr or ''}"[-4000:]
            raise RuntimeError(f"`{' '.join(e.cmd[1:3])}` failed:\n{out}") from e
        except BaseException:
            self.stop()
            raise
        return self.address

    def wait_for_nodes(self, n: int | None = None, timeout_s: float = 60.0) -> list[dict]:
        """Wait until `n` (default: all) nodes are alive; needs `ray.init(address=self.address)` first."""
        import ray

        n = n or len(self.nodes)
        deadline = time.monotonic() + timeout_s
        while True:
            alive = [x for x in ray.nodes() if x.get("Alive")]
            if len(alive) >= n:
                return alive
            if time.monotonic() > deadline:
                raise TimeoutError(f"only {len(alive)} of {n} Ray nodes alive after {timeout_s:.0f}s")
            time.sleep(0.2)

    def pids(self) -> list[int]:
        """Every live process of this cluster: by temp dir or client-server address, plus descendants."""
        table = _proc_table()
        client = re.compile(rf"ray\.util\.client\.server .*--address=\S+:{self.port}\b")
        ours = re.compile(re.escape(self.temp_dir.rstrip("/")) + r"(/|\s|$)")
        roots = {pid for pid, (_, cmd) in table.items()
                 if pid != os.getpid() and (ours.search(cmd) or client.search(cmd))}
        found = set(roots)
        grew = True
        while grew:
            kids = {pid for pid, (ppid, _) in table.items() if ppid in found} - found
            found |= kids
            grew = bool(kids)
        return sorted(p for p in found if _alive(p))

    def kill_node(self, node_id: str) -> list[int]:
        """Simulate losing a node: SIGKILL its raylet (found by its `--node_id=` argument, the hex id of
        `ray.nodes()`) and everything under it (agents, workers); returns the killed PIDs."""
        table = _proc_table()
        raylets = {pid for pid in self.pids() if f"--node_id={node_id}" in table.get(pid, (0, ""))[1]}
        if not raylets:
            raise ValueError(f"no raylet of this cluster has node id {node_id}")
        found, grew = set(raylets), True
        while grew:
            kids = {pid for pid, (ppid, _) in table.items() if ppid in found} - found
            found |= kids
            grew = bool(kids)
        _signal(sorted(found), signal.SIGKILL)
        _wait_gone(sorted(found), 10)
        return sorted(found)

    def stop(self, grace_s: float = 5.0) -> None:
        """Stop every process of this cluster by PID (never `ray stop`), then remove its files."""
        table = _proc_table()
        pids = self.pids()
        raylets = [p for p in pids if "/raylet/raylet " in table.get(p, (0, ""))[1] + " "]
        _signal(raylets, signal.SIGTERM)
        _wait_gone(raylets, grace_s)
        rest = self.pids()
        _signal(rest, signal.SIGTERM)
        _wait_gone(rest, min(grace_s, 2.0))
        left = self.pids()
        _signal(left, signal.SIGKILL)  # e.g. the autoscaler monitor ignores SIGTERM
        _wait_gone(left, grace_s)
        addr_file = Path("/tmp/ray/ray_current_cluster")
        try:
            if addr_file.read_text().strip().endswith(f":{self.port}"):
                addr_file.unlink()
        except OSError:
            pass
        if not self.keep_logs:
            shutil.rmtree(self.temp_dir, ignore_errors=True)

    def __enter__(self) -> LocalCluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _signal(pids: Sequence[int], sig: int) -> None:
    for p in pids:
        try:
            os.kill(p, sig)
        except ProcessLookupError:
            pass


def _wait_gone(pids: Sequence[int], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
