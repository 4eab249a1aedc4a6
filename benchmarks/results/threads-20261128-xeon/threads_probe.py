"""Plain decoding steps of serve_config.yaml's target (the 1.5B on vLLM, 2 threads) in this process, each step called
from: the main thread; one pool thread; two threads taking turns (two OpenMP teams); a new thread per step; and a
request through specray's `Scheduler`. Prints each step's median / mean / p90 and how many steps were more than 1.2x
the median. Run it with and without KMP_BLOCKTIME=5 (the Intel OpenMP runtime's default is 200 ms of spinning):

    P=benchmarks/results/threads-20261128-xeon/threads_probe.py
    LD_PRELOAD=$PWD/.venv/lib/libiomp5.so .venv/bin/python $P
    KMP_BLOCKTIME=5 LD_PRELOAD=$PWD/.venv/lib/libiomp5.so .venv/bin/python $P
"""

import asyncio
import statistics as st
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from specray.bench.cli import _load_levels, load_config
from specray.bench.workloads import load_workloads, prompt_ids
from specray.coordinator.cascade import CascadeEngine, Plan
from specray.coordinator.scheduler import Request, Scheduler
from specray.spec.params import SamplingParams

app = load_config("serve_config.yaml")
cfg = app.cascade
cfg.levels = cfg.levels[-1:]  # the target alone
levels = _load_levels(cfg, False)
tok = levels[-1].worker.tokenizer
ids = prompt_ids(tok, load_workloads(["code"])[0])
eng = CascadeEngine(levels)
pools = [ThreadPoolExecutor(1) for _ in range(2)]
PLAIN = Plan((0,), ())


def report(name: str, d: list[float]) -> None:
    med, p90 = st.median(d), sorted(d)[9 * len(d) // 10]
    print(f"{name:18s} median {med * 1000:4.0f} ms  mean {st.mean(d) * 1000:4.0f}  p90 {p90 * 1000:4.0f}"
          f"  slow (> 1.2 x median) {sum(x > 1.2 * med for x in d)}/{len(d)}", flush=True)


def steps(mode: str) -> None:
    s = eng.new_sequence(ids, SamplingParams(0.0), max_tokens=80)
    d, i = [], 0
    while not s.finished:
        t0 = time.perf_counter()
        if mode == "main thread":
            eng.step([s], PLAIN)
        elif mode == "one pool thread":
            pools[0].submit(eng.step, [s], PLAIN).result()
        elif mode == "two taking turns":
            pools[i % 2].submit(eng.step, [s], PLAIN).result()
        elif mode == "new thread each":
            th = threading.Thread(target=eng.step, args=([s], PLAIN))
            th.start()
            th.join()
        d.append(time.perf_counter() - t0)
        i += 1
    report(mode, d[1:])  # the first is the prefill


def scheduled() -> None:
    worker, times = levels[-1].worker, []
    verify = worker.verify

    def timed(*a, **kw):
        t0 = time.perf_counter()
        out = verify(*a, **kw)
        times.append(time.perf_counter() - t0)
        return out

    worker.verify = timed

    async def run() -> None:
        sched = Scheduler(eng, tok, max_batch_size=1)
        try:
            async for _ in sched.generate(Request(ids, SamplingParams(0.0), 80)):
                pass
        finally:
            await sched.close()

    asyncio.run(run())
    worker.verify = verify
    report("Scheduler", times[1:])


for m in ("main thread", "one pool thread", "two taking turns", "new thread each", "main thread"):
    steps(m)
scheduled()
scheduled()
