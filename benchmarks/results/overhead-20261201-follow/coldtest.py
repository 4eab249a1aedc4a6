import sys, time
sys.path.insert(0, '/work/main'); sys.path.insert(0, '/work/main/benchmarks')
import bench_overhead as bo
from specray.testing.sim import SimWorker, StepCostModel
import specray.testing.sim as sim
from specray.coordinator.cascade import CascadeEngine, Level
from specray.coordinator.generate import generate
mode, base = sys.argv[1], float(sys.argv[2])
if mode == 'spin':
    class T: pass
    t = T(); t.monotonic = time.monotonic; t.perf_counter = time.perf_counter
    def sp(dt):
        end = time.monotonic() + dt
        while time.monotonic() < end: pass
    t.sleep = sp; sim.time = t
specs = bo.PRESET_LEVELS['gpu']
ws = [SimWorker(s.name, StepCostModel(base, 0.0, 'x'), **s.worker_kwargs()) for s in specs]
eng = CascadeEngine([Level(w.name, worker=w, k=4, method='greedy') for w in ws])
prompts = bo.make_prompts(1)
generate(eng, prompts, max_tokens=8, ignore_eos=True)
for w in ws: w.clear_trace()
t0=time.monotonic(); out = generate(eng, prompts, max_tokens=300, ignore_eos=True); t1=time.monotonic()
recs=[r for w in ws for r in w.trace]; rounds = max(r.rounds for r in out.results)
busy=bo.union_length([(r['start'],r['end']) for r in recs if r['kind'] in bo.MODEL_KINDS],t0,t1)
print(f'{mode} base {base*1000:.1f} ms: overhead/round {1000*(t1-t0-busy)/rounds:.3f} ms')
