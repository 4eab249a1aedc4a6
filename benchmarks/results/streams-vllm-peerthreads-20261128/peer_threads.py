"""A vLLM peer engine asked for 1 thread: wall and CPU seconds of its prefill (does it stay on one core?).

    LD_PRELOAD=$PWD/.venv/lib/libiomp5.so .venv/bin/python \
        benchmarks/results/streams-vllm-peerthreads-20261128/peer_threads.py vllm_ngram    # or vllm_plain

The engine is built as `specray bench` builds its vLLM peers, in this process, then serves the first screening
prompt with its prefix cache emptied before each request. cpu/wall near 1: one core; near 2: both.
"""

import os
import resource
import sys
import time


def main(peer: str) -> None:
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine in this process: its CPU time is ours
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    sys.path.insert(0, os.getcwd())
    import torch
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    from specray.bench.peers import vllm_speculative_config
    from specray.bench.workloads import load_workloads, prompt_ids

    torch.set_num_threads(1)
    model = os.path.expanduser("~/.cache/specray/models/qwen2.5-coder-1.5b-instruct")
    ids = prompt_ids(AutoTokenizer.from_pretrained(model), load_workloads(["screening"])[0])
    spec = vllm_speculative_config(peer)
    llm = LLM(model=model, tokenizer=model, dtype="bfloat16", enforce_eager=True, max_model_len=4096,
              enable_prefix_caching=True, seed=0, disable_log_stats=False,
              **({"speculative_config": spec} if spec else {}))
    llm.generate([{"prompt_token_ids": ids[:8]}], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)

    def cpu() -> float:
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime

    for n in (1, 1, 1, 16):
        llm.reset_prefix_cache()
        c0, t0 = cpu(), time.perf_counter()
        out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0.0, max_tokens=n), use_tqdm=False)
        dt, dc = time.perf_counter() - t0, cpu() - c0
        ttft = getattr(out[0].metrics, "first_token_latency", None)
        print(f"RESULT {peer} prompt {len(ids)} max_tokens {n}: wall {dt:.2f}s cpu {dc:.2f}s (cpu/wall {dc / dt:.2f}) "
              f"ttft {ttft}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
