"""`shared_gloo_groups`: a one-rank engine's process groups are one gloo group (fewer loop threads waking), its
collectives still work, and its shutdown may destroy that group once per coordinator. Run in a child process: a
default process group made in pytest's own would be the one the vLLM tests' engines find."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

SCRIPT = textwrap.dedent("""
    import json, os, tempfile, time
    import torch, torch.distributed as dist
    from specray.engine.single_rank import shared_gloo_groups

    def gloo_threads():
        time.sleep(0.5)  # a group's loop threads start in the background
        return sum("gloo" in open(f"/proc/self/task/{t}/comm").read() for t in os.listdir("/proc/self/task"))

    def init():
        dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)

    out = {}
    init()
    base = gloo_threads()
    plain = [dist.new_group([0], backend="gloo") for _ in range(6)]
    out["plain_distinct"] = len({id(g) for g in plain})
    out["plain_threads"] = gloo_threads() - base
    dist.destroy_process_group()
    init()
    base = gloo_threads()
    with shared_gloo_groups():
        shared = [dist.new_group([0], backend="gloo") for _ in range(3)] + [dist.new_group(backend="gloo")]
        shared += [dist.new_group([0], timeout=None, backend="gloo") for _ in range(2)]
    out["shared_distinct"] = len({id(g) for g in shared})
    out["shared_threads"] = gloo_threads() - base
    out["outside_is_new"] = dist.new_group([0], backend="gloo") is not shared[0]
    x = torch.ones(3)
    dist.all_reduce(x, group=shared[0])
    out["all_reduce"] = x.tolist()
    for g in shared:  # a shutdown that destroys each coordinator's groups in turn
        dist.destroy_process_group(g)
    dist.destroy_process_group()
    init()  # a second engine in the same process: a new default group, a new shared group
    with shared_gloo_groups():
        again = dist.new_group([0], backend="gloo")
    out["second_is_new"] = again is not shared[0]
    y = torch.ones(2)
    dist.all_reduce(y, group=again)
    out["second_all_reduce"] = y.tolist()
    dist.destroy_process_group()
    print(json.dumps(out))
""")


def test_one_rank_gloo_groups_share_one_group_and_survive_repeated_destroys():
    root = Path(__file__).resolve().parents[2]  # this checkout's specray
    r = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120, cwd=root)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["plain_distinct"] == 6 and out["plain_threads"] >= 6  # each gloo group its own loop thread(s)
    assert out["shared_distinct"] == 1
    assert out["shared_threads"] * 3 < out["plain_threads"]  # one group's loop threads, not six groups'
    assert out["outside_is_new"]
    assert out["all_reduce"] == [1.0, 1.0, 1.0]
    assert out["second_is_new"] and out["second_all_reduce"] == [1.0, 1.0]
