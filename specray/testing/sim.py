"""Simulated accelerator levels: a `FakeWorker` that takes as long as a real model's step would.

`SimWorker` runs the real protocol logic of `FakeWorker` (so tokens, acceptance and every coordinator code path
are the real ones) and then sleeps until the call has lasted what the model would have taken on its device:
the sum of `StepCostModel.forward_s(tokens fed)` over every forward of the call. Everything else a round costs
(coordinator Python, Ray hops, serialization) then shows up as wall time outside the workers' busy intervals,
which is what `benchmarks/bench_overhead.py` measures. The worker's own sampling and acceptance run inside the
timed call, as a GPU engine runs them on the device. No Ray import here: the same worker runs in-process and
inside a level actor (build it there from `sim_factory(...)`, a picklable zero-argument factory).

Every call records its busy interval (`time.monotonic()`, one clock for all processes of a Linux machine, so
intervals of level actors on one box can be compared with the driver's), kind, batch size, forwards, tokens
fed and cost-model seconds in `SimWorker.trace`; with `trace_path` set, the records not written yet are appended
to that file as JSON lines when `stats()` (or `flush_trace()`) is called, never inside a timed call, so writing
the trace does not count as round overhead (the benchmark asks each level actor for its stats, then reads the
files back). Calls without a forward (`add`, `free`, `rollback`)
are recorded with zero cost: they count calls, not model time.

Cost presets (`PRESETS`): seconds per forward = `base_s + per_token_s * tokens fed` (tokens summed over the
batch's rows). A decode step at batch 1 is memory-bound (the weights are read once whatever the few tokens
fed), so `base_s` is the published batch-1 decode latency (less one token's `per_token_s`) and `per_token_s`
is the compute term, 2 x parameters FLOPs per token over the dense BF16 peak of the GPUs holding the model
(H100 SXM: 989 TFLOPS, 3.35 TB/s HBM3, NVIDIA's datasheet). It is added to the memory-bound step instead of
taking the roofline maximum, which is about what a realistic ~50% utilisation gives once the batch is
compute-bound: feeding 5 tokens at batch 1 costs about the same as 1; 64 rows x 5 tokens = 320 start to count.
KV-cache reads, which grow with the context and the batch, are not modelled.

Published numbers the GPU presets are built from:

- NVIDIA NIM for LLMs benchmarking, "Performance" (https://docs.nvidia.com/nim/benchmarking/llm/1.0.0/performance):
  inter-token latency (ITL) at concurrency 1 on H100: Llama-3.1-8b-instruct 4.63 ms (NIM 1.8.0; 4.37 ms in
  1.3.0), Llama-3.1-70b-instruct 13.21 ms (NIM 1.3.0), Llama-3.3-70b-instruct fp8 TP2 on 2 x H100 18.58 ms
  (5000 input / 500 output tokens) and 18.91 ms (500 / 2000). NIM's latency profiles are TensorRT-LLM engines,
  FP8 where the GPU has it; the precision and GPU count of the 8B and 70B tables are as stated on that page.
- vLLM's CI performance dashboard (https://buildkite.com/vllm/performance-benchmark/builds/9515), "latency
  tests", batch 8, 32 input / 128 output tokens, H200: latency_llama8B_tp1 833 ms mean (6.5 ms per step
  including the prefill), latency_llama70B_tp4 2078 ms (16.2 ms per step).

Derivations (BF16 weights; a fixed per-step cost of ~2.2 ms = NIM's 8B FP8 ITL of 4.63 ms less the 2.4 ms that
reading its 8.0 GB of FP8 weights takes at 3.35 TB/s):

- llama-1b (Llama 3.2 1B, 1.24 B parameters): 2.5 GB of weights = 0.74 ms at peak bandwidth, plus the fixed
  ~2.2 ms: ~3 ms. per_token_s = 2 x 1.24e9 / 989e12.
- llama-8b (Llama 3.1 8B, 8.03 B): 16.1 GB = 4.8 ms, plus ~2.2 ms: ~7 ms; vLLM's 6.5 ms per step on the H200
  scales to ~9 ms at the H100's bandwidth: 8 ms. per_token_s = 2 x 8.03e9 / 989e12.
- llama-70b-tp4 (Llama 3.1 70B, 70.6 B, tensor parallel 4): 141 GB / 4 GPUs = 35 GB read per GPU per step =
  10.5 ms at peak, plus the fixed cost and the all-reduces; NIM's 70B ITL 13.21 ms, its 70B fp8 TP2 (the same
  35 GB per GPU) 18.6-18.9 ms, vLLM's 70B TP4 16.2 ms per step on the H200: 15 ms.
  per_token_s = 2 x 70.6e9 / (4 x 989e12).

CPU presets (`qwen-cpu-*`), measured in this project: benchmarks/README.md, section 1, "Bounded look-ahead
(session 9, AMD EPYC box with AVX-512 and bf16)": Qwen2.5-Coder in bf16 on one thread, the 1.5B ~330-370 ms
per decoding step (q = 1), ~450-520 ms for 9 tokens and ~600 ms for 17; the 0.5B ~131 ms (q = 1) and ~200 ms
(q = 9). Fitted linear in the tokens fed (1.5B: 350 ms at 1 and 600 ms at 17 tokens; 0.5B: 131 ms at 1 and
200 ms at 9); batches above 1 were not measured there and extrapolate that line (a CPU is compute-bound).
"""

from __future__ import annotations

import functools
import json
import os
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from specray.engine.protocol import WorkerStats
from specray.engine.rows import SeqState
from specray.testing.fake import FakeWorker

__all__ = [
    "PRESETS",
    "SimWorker",
    "StepCostModel",
    "read_trace",
    "sim_factory",
    "union_length",
]


@dataclass(frozen=True)
class StepCostModel:
    """Seconds one forward of a model takes on its device: `base_s + per_token_s * max(0, tokens_fed - knee_tokens)`.

    tokens_fed: every token fed in that forward, summed over the batch's rows (a decode step of B rows feeds B;
    a verification of K drafts feeds B x (K + 1); a prefill the prompt's tokens). `knee_tokens`: how many tokens a
    forward feeds at no extra cost, a step that is flat until its compute saturates (0: linear from the first)."""

    base_s: float
    per_token_s: float = 0.0
    name: str | None = None
    source: str = ""
    knee_tokens: int = 0

    def __post_init__(self) -> None:
        if self.base_s < 0 or self.per_token_s < 0 or self.knee_tokens < 0:
            raise ValueError("costs and knee_tokens must be >= 0")

    def forward_s(self, tokens_fed: int) -> float:
        return self.base_s + self.per_token_s * max(0, int(tokens_fed) - self.knee_tokens)

    def step_s(self, batch: int = 1) -> float:
        """One decoding step of `batch` rows (one token each)."""
        return self.forward_s(batch)


_H100_BF16_FLOPS = 989e12
_NIM = "https://docs.nvidia.com/nim/benchmarking/llm/1.0.0/performance"
_VLLM_CI = "https://buildkite.com/vllm/performance-benchmark/builds/9515"
_FIXED = ("fixed per-step cost ~2.2 ms = NIM Llama-3.1-8b-instruct ITL 4.63 ms at concurrency 1 on H100 (" + _NIM
          + ") less 8.0 GB of FP8 weights / 3.35 TB/s")
_README_S9 = ("benchmarks/README.md, section 1, 'Bounded look-ahead (session 9, AMD EPYC box with AVX-512 and bf16)'"
              ": Qwen2.5-Coder bf16, 1 thread")


_GPU_RUN = ("benchmarks/bench_gpu.py, benchmarks/results/gpu-20261126-h200-lean.json (measured, "
            "benchmarks/README.md section 8)")


def _gpu(name: str, decode_s: float, params: float, gpus: int, source: str) -> StepCostModel:
    per_token = 2.0 * params / (_H100_BF16_FLOPS * gpus)
    return StepCostModel(decode_s - per_token, per_token, name, source)


def _linear(name: str, q1: tuple[int, float], q2: tuple[int, float], source: str) -> StepCostModel:
    (n1, s1), (n2, s2) = q1, q2
    per_token = (s2 - s1) / (n2 - n1)
    return StepCostModel(s1 - per_token * n1, per_token, name, source)


PRESETS: dict[str, StepCostModel] = {
    "llama-1b": _gpu(
        "llama-1b", 0.003, 1.24e9, 1,
        "Llama 3.2 1B bf16 on 1 x H100, decode at batch 1 ~3 ms: derived, not a published number: 2.5 GB of "
        f"weights / 3.35 TB/s = 0.74 ms plus the {_FIXED}. per_token_s = 2 x 1.24e9 FLOPs / 989 TFLOPS "
        "(H100 SXM dense BF16 peak).",
    ),
    "llama-8b": _gpu(
        "llama-8b", 0.008, 8.03e9, 1,
        "Llama 3.1 8B bf16 on 1 x H100, decode at batch 1 ~8 ms: 16.1 GB / 3.35 TB/s = 4.8 ms plus the "
        f"{_FIXED}; vLLM CI latency_llama8B_tp1 on H200, batch 8, 32 in / 128 out: 833 ms = 6.5 ms per step "
        f"({_VLLM_CI}), ~9 ms at the H100's bandwidth. per_token_s = 2 x 8.03e9 FLOPs / 989 TFLOPS.",
    ),
    "llama-70b-tp4": _gpu(
        "llama-70b-tp4", 0.015, 70.6e9, 4,
        "Llama 3.1 70B bf16, tensor parallel 4 x H100, decode at batch 1 ~15 ms: 35 GB of weights per GPU / "
        f"3.35 TB/s = 10.5 ms plus fixed cost and all-reduces; NIM ({_NIM}) ITL at concurrency 1: "
        "Llama-3.1-70b-instruct 13.21 ms, Llama-3.3-70b-instruct fp8 TP2 on 2 x H100 (the same bytes per GPU) "
        f"18.58-18.91 ms; vLLM CI latency_llama70B_tp4 on H200, batch 8: 2078 ms / 128 = 16.2 ms ({_VLLM_CI}). "
        "per_token_s = 2 x 70.6e9 FLOPs / (4 x 989 TFLOPS).",
    ),
    "qwen-cpu-0.5b": _linear(
        "qwen-cpu-0.5b", (1, 0.131), (9, 0.200),
        f"{_README_S9}: the 0.5B ~131 ms per step (q = 1) and ~200 ms for 9 tokens; a line through those two.",
    ),
    "qwen-cpu-1.5b": _linear(
        "qwen-cpu-1.5b", (1, 0.350), (17, 0.600),
        f"{_README_S9}: the 1.5B ~330-370 ms per step (q = 1), ~450-520 ms for 9 tokens, ~600 ms for 17; a line "
        "through the middle of the first range and the last.",
    ),
    "h200-hf-1b": StepCostModel(
        0.01288, 2.42e-5, "h200-hf-1b",
        f"{_GPU_RUN}: random-weight Llama 3.2 1B shape, bf16, the hf backend's worker forward on one H200, timed "
        "with the device synchronised: least squares over 1,100 decode and draft forwards (median error 4%); "
        "medians 12.6 ms at batch 1 x 1 token, 22.9 ms at batch 64 x 4 tokens.",
    ),
    "h200-hf-8b": StepCostModel(
        0.02660, 7.9e-6, "h200-hf-8b",
        f"{_GPU_RUN}: random-weight Llama 3.1 8B shape, bf16, the hf backend's worker forward on one H200, timed "
        "with the device synchronised: least squares over its decode and verification forwards (median error "
        "5%); medians 25.5 ms at batch 1 x 1 token, 28.4 ms at batch 64 x 5 tokens. Host-bound (eager PyTorch "
        "launches ~1,200 kernels per step), so nearly flat in the tokens fed.",
    ),
}


class SimWorker(FakeWorker):
    """A `FakeWorker` whose protocol calls last as long as `cost` says the model's forwards would.

    propose / verify (prefills happen inside them): the real logic runs, every forward adds
    `cost.forward_s(tokens fed)`, then the call sleeps until its start + that sum (not at all if the Python
    already took longer). `batched_prefill` (default): a new prompt is fed in the call's batched forward with the
    other rows, as a GPU engine batches prefills, instead of `LogitsWorker`'s one-row prefill forwards.
    The busy interval of each call goes to `self.trace` and, with `trace_path`, to that file as a JSON line at the
    next `stats()` / `flush_trace()`.
    Create it in the process that uses it (threads: one call at a time per worker, as the protocol has it).
    """

    def __init__(
        self,
        name: str = "sim",
        cost: StepCostModel | None = None,
        *,
        vocab: int = 64,
        order: int = 2,
        table_seed: int = 0,
        noise: float = 0.0,
        noise_seed: int = 1,
        sharpness: float = 2.0,
        max_context: int = 4096,
        eos_token_ids: Sequence[int] = (),
        trace_path: str | None = None,
        batched_prefill: bool = True,
    ) -> None:
        super().__init__(name=name, vocab=vocab, order=order, table_seed=table_seed, noise=noise,
                         noise_seed=noise_seed, sharpness=sharpness, max_context=max_context,
                         eos_token_ids=eos_token_ids)
        self.cost = cost if cost is not None else StepCostModel(0.0, 0.0, "free")
        if batched_prefill:
            self.prefill_threshold = max_context + 1
        self.trace: list[dict[str, Any]] = []
        self.trace_path = trace_path
        self._trace_file = None
        self._written = 0  # records of self.trace already in the file
        self._local = threading.local()
        self._pid = os.getpid()

    # ----- timing ---------------------------------------------------------------------------------
    def _acc(self) -> threading.local:
        st = self._local
        if not hasattr(st, "cost"):
            st.cost, st.forwards, st.tokens = 0.0, 0, 0
        return st

    def _forward(self, seqs: Sequence[SeqState], inputs: Sequence[Sequence[int]], keep: Sequence[int],
                 parents: Sequence[Sequence[int]] | None = None) -> torch.Tensor:
        st = self._acc()
        fed = sum(len(x) for x in inputs)
        st.cost += self.cost.forward_s(fed)
        st.forwards += 1
        st.tokens += fed
        return super()._forward(seqs, inputs, keep, parents)

    def _timed(self, kind: str, batch: int, fn, *args, **kwargs):
        st = self._acc()
        st.cost, st.forwards, st.tokens = 0.0, 0, 0
        t0 = time.monotonic()
        out = fn(*args, **kwargs)
        logic = time.monotonic() - t0
        cost, forwards, tokens = st.cost, st.forwards, st.tokens
        wait = t0 + cost - time.monotonic()
        if wait > 0:
            time.sleep(wait)
        self._record(kind, t0, time.monotonic(), batch, forwards, tokens, cost, logic)
        return out

    def _record(self, kind: str, start: float, end: float, batch: int, forwards: int = 0, tokens: int = 0,
                cost: float = 0.0, logic: float = 0.0) -> None:
        rec = {"worker": self.name, "kind": kind, "start": start, "end": end, "batch": batch, "forwards": forwards,
               "tokens": tokens, "cost_s": cost, "logic_s": logic, "pid": self._pid}
        self.trace.append(rec)

    def flush_trace(self) -> None:
        """Append the records not written yet to `trace_path` (no-op without one)."""
        if not self.trace_path:
            return
        if self._trace_file is None or self._pid != os.getpid():
            self._pid = os.getpid()
            self._trace_file = open(self.trace_path, "a")  # noqa: SIM115 - kept open for appends
        new = self.trace[self._written:]
        self._trace_file.write("".join(json.dumps(rec) + "\n" for rec in new))
        self._trace_file.flush()
        self._written = len(self.trace)

    def clear_trace(self) -> None:
        """Forget the records (written ones stay in the file)."""
        self.flush_trace()
        self.trace.clear()
        self._written = 0

    def stats(self) -> WorkerStats:
        self.flush_trace()
        return super().stats()

    # ----- protocol -------------------------------------------------------------------------------
    def propose(self, seq_ids, *args, **kwargs):
        return self._timed("propose", len(seq_ids), super().propose, seq_ids, *args, **kwargs)

    def verify(self, seq_ids, *args, **kwargs):
        return self._timed("verify", len(seq_ids), super().verify, seq_ids, *args, **kwargs)

    def propose_tree(self, seq_ids, *args, **kwargs):
        return self._timed("propose_tree", len(seq_ids), super().propose_tree, seq_ids, *args, **kwargs)

    def score_tree(self, seq_ids, *args, **kwargs):
        return self._timed("score_tree", len(seq_ids), super().score_tree, seq_ids, *args, **kwargs)

    def add(self, seq_id: str, prompt_ids: Sequence[int]) -> None:
        t0 = time.monotonic()
        super().add(seq_id, prompt_ids)
        self._record("add", t0, time.monotonic(), 1)

    def free(self, seq_id: str) -> None:
        t0 = time.monotonic()
        super().free(seq_id)
        self._record("free", t0, time.monotonic(), 1)

    def rollback(self, seq_id: str, length: int) -> None:
        t0 = time.monotonic()
        super().rollback(seq_id, length)
        self._record("rollback", t0, time.monotonic(), 1)

    def __del__(self) -> None:
        f = getattr(self, "_trace_file", None)
        if f is not None:
            try:
                f.close()
            except Exception:
                pass


def sim_factory(name: str, cost: StepCostModel | str, **kwargs: Any) -> functools.partial:
    """A picklable zero-argument factory of a `SimWorker` (for `launch_levels(..., factories=[...])`); `cost` may
    be a `PRESETS` key."""
    if isinstance(cost, str):
        cost = PRESETS[cost]
    return functools.partial(SimWorker, name=name, cost=cost, **kwargs)


def read_trace(path: str, start: float | None = None, end: float | None = None) -> list[dict[str, Any]]:
    """The records of a trace file (JSON lines) whose interval lies within [start, end] (None: unbounded)."""
    out = []
    try:
        with open(path) as f:
            for line in f:
                line = line.strip()
                if not line:
                    continue
                rec = json.loads(line)
                if (start is None or rec["start"] >= start) and (end is None or rec["end"] <= end):
                    out.append(rec)
    except FileNotFoundError:
        return []
    return out


def union_length(intervals: Iterable[tuple[float, float]], lo: float | None = None, hi: float | None = None) -> float:
    """Length of the union of [start, end) intervals, clipped to [lo, hi] when given (overlaps count once)."""
    spans = []
    for s, e in intervals:
        if lo is not None:
            s = max(s, lo)
        if hi is not None:
            e = min(e, hi)
        if e > s:
            spans.append((s, e))
    spans.sort()
    total, cur_s, cur_e = 0.0, None, None
    for s, e in spans:
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        total += cur_e - cur_s
    return total
