"""Plain decoding step of specray's engine-verifying vLLM target in this process, ms per step (median of 4 x 24).

    python engine_step.py THREADS [WORKLOAD]
"""

import itertools
import os
import statistics
import sys
import time

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

import torch
from vllm import SamplingParams
from vllm.sampling_params import RequestOutputKind

from specray.bench.workloads import load_shipped, prompt_ids
from specray.engine.vllm import VLLMWorker

threads = int(sys.argv[1])
worker = VLLMWorker("qwen2.5-coder-1.5b-instruct", dtype="bfloat16", num_threads=threads, engine_verify=16,
                    kv_cache_bytes=2 << 30)
ids = prompt_ids(worker.tokenizer, load_shipped(sys.argv[2] if len(sys.argv) > 2 else "code")[0])
torch.set_num_threads(threads)
counter = itertools.count()


def steps(engine, n: int = 24) -> float:
    rid = f"r{next(counter)}"
    sp = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True, detokenize=False,
                        output_kind=RequestOutputKind.DELTA)
    engine.reset_prefix_cache()
    engine.add_request(rid, {"prompt_token_ids": list(ids)}, sp)
    engine.step()  # the prefill
    t0 = time.perf_counter()
    for _ in range(n):
        engine.step()
    ms = (time.perf_counter() - t0) / n * 1000
    engine.abort_request([rid])
    while engine.has_unfinished_requests():
        engine.step()
    return ms


runs = [steps(worker.engine) for _ in range(4)]
print(f"RESULT specray threads={threads} step_ms {statistics.median(runs):.1f} ({' '.join(f'{x:.0f}' for x in runs)})")
