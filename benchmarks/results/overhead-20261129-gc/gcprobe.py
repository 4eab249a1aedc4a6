"""How often and how long the coordinator's garbage collector runs during bench_overhead's measure() calls."""
import gc
import sys
import time

sys.path.insert(0, "benchmarks")
import bench_overhead

log = []
t = {}


def cb(phase, info):
    if phase == "start":
        t["s"] = time.perf_counter()
    else:
        log.append((info["generation"], time.perf_counter() - t["s"], time.perf_counter()))


gc.callbacks.append(cb)
windows = []
orig = bench_overhead.measure


def measure(*a, **kw):
    s = time.perf_counter()
    out = orig(*a, **kw)
    windows.append((s, time.perf_counter()))
    return out


bench_overhead.measure = measure
t0 = time.perf_counter()
rc = bench_overhead.main(sys.argv[1:])
print("windows", [round(e - s, 2) for s, e in windows])
log = [x for x in log if any(s <= x[2] <= e for s, e in windows)]
for g in (0, 1, 2):
    d = [x[1] for x in log if x[0] == g]
    if d:
        print(f"gen{g}: {len(d)} collections, total {sum(d) * 1e3:.1f} ms, max {max(d) * 1e3:.2f} ms, "
              f"median {sorted(d)[len(d) // 2] * 1e3:.3f} ms")
print("wall", time.perf_counter() - t0)
