"""Real Ray for the tests in this folder: one local instance per module, or a 3-node local cluster."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

os.environ.setdefault("RAY_AUTH_MODE", "disabled")


@contextmanager
def local_ray(num_cpus: int = 8, resources: dict[str, float] | None = None) -> Iterator[None]:
    """A fresh single-node Ray owned by this process (address="local" never attaches to another cluster)."""
    import ray

    if ray.is_initialized():
        ray.shutdown()
    ray.init(address="local", num_cpus=num_cpus, resources=resources or {}, include_dashboard=False,
             logging_level="WARNING", log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def local_cluster():
    """Head + 2 workers (`DEFAULT_NODES`: head_node / draft / target) as separate `ray start` processes,
    with this process connected as the driver; every process is stopped by PID afterwards."""
    import ray

    from specray.serve.localcluster import LocalCluster

    if ray.is_initialized():
        ray.shutdown()
    cluster = LocalCluster()
    try:
        cluster.start()
        ray.init(address=cluster.address, logging_level="WARNING", log_to_driver=False)
        cluster.wait_for_nodes()
        yield cluster
    finally:
        ray.shutdown()
        cluster.stop()
        left = cluster.pids()
        assert not left, f"Ray processes left running: {left}"
