import os
import sys
import time
from pathlib import Path

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ["VLLM_LOGGING_LEVEL"] = "ERROR"
import torch
import torch.distributed as dist

torch.set_num_threads(2)
mode = sys.argv[1]
if mode == "alias":
    orig = dist.new_group
    shared = {}

    def new_group(ranks=None, *a, **k):
        if dist.is_initialized() and dist.get_world_size() == 1:
            if "pg" not in shared:
                shared["pg"] = orig(ranks, *a, **k)
            return shared["pg"]
        return orig(ranks, *a, **k)

    dist.new_group = new_group
ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))
from vllm import LLM, SamplingParams  # noqa: E402

from specray.engine.models import resolve_model  # noqa: E402

p = str(resolve_model("qwen2.5-coder-1.5b-instruct"))
llm = LLM(
    model=p,
    dtype="bfloat16",
    enforce_eager=True,
    distributed_executor_backend="uni",
    max_num_seqs=4,
    kv_cache_memory_bytes=1 << 30,
)
if mode == "alias":
    dist.new_group = orig
names = [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]  # noqa: SIM115
print(mode, "gloo threads", sum("gloo" in n for n in names), "threads", len(names), flush=True)
sp = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
llm.generate(["hello"], sp, use_tqdm=False)
tot = 0.0
n = 0
for _r in range(3):
    for q in [
        "def quicksort(arr):",
        "Write a haiku about the sea.",
        "class LinkedList:",
        "Explain TCP in one paragraph.",
    ]:
        t = time.perf_counter()
        o = llm.generate([q], sp, use_tqdm=False)
        tot += time.perf_counter() - t
        n += len(o[0].outputs[0].token_ids)
print(mode, "tok/s", round(n / tot, 3), flush=True)
