"""The measuring loop of `specray bench`: speculation modes on a target (the in-process engine or a server over HTTP),
the same requests for every mode, interleaved, and what each request cost.

A target runs one *chunk* at a time: `batch` requests submitted together (in process: through the continuous-
batching `Scheduler` with `max_batch_size = batch`; over HTTP: `batch` concurrent streaming requests). A chunk of
more requests than `batch` (`--requests`) is a closed loop: at most `batch` in flight, a finished request's slot
taking the next at once (the scheduler queues the rest; over HTTP a semaphore holds them back). The
benchmark walks the workload chunk by chunk and runs every mode on a chunk before the next chunk starts, so load
that comes and goes on a shared machine hits every mode alike and their ratios stay comparable.

Modes: `none` (plain decoding: the target alone, same loop), `ngram` (n-gram level -> target), `draft` (the largest
draft model -> target), `cascade` (every level), `adaptive` (the live goodput planner picks levels and K every
round; over HTTP: the server's own policy, `speculation.method = "auto"`); and the lookup modes, each on an engine of
its own with its own suffix store: `suffix` (a suffix level -> target, chains), `suffix-tree` (the same with
`tree_width` > 1: a token tree per round, verified in one target forward), `hybrid` (per row the lookup level's
match, else the largest draft model's draft, in one verification; `speculation.method = "hybrid"`).

Streams: a target keeps one engine per mode for the whole run and runs a chunk's requests in the order given, so
at batch 1 a workload's requests run one after another in file order and a suffix store learns from the outputs
of the earlier ones. `new_stream()` empties the suffix stores (the run calls it before each workload and batch
size, so no mode draws on outputs of the same prompts from another pass).
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from specray.bench.workloads import prompt_ids
from specray.coordinator.stats import LevelStats
from specray.spec.params import SamplingParams

__all__ = ["DEFAULT_MODES", "MODES", "SUFFIX_MODES", "HTTPTarget", "InProcessTarget", "RequestResult", "Target",
           "stats_from_usage"]

MODES = ("none", "ngram", "draft", "cascade", "adaptive", "suffix", "suffix-tree", "hybrid")
#: what a run measures when --modes is not given (the lookup modes are asked for by name)
DEFAULT_MODES = ("none", "ngram", "draft", "cascade", "adaptive")
#: modes that run on a suffix store of their own (in process)
SUFFIX_MODES = ("suffix", "suffix-tree", "hybrid")
#: the per-request `speculation.method` of each mode (the scheduler's and the HTTP API's names); a suffix mode's
#: engine has the suffix level first, where the scheduler's `ngram` plan takes its lookup level
_METHOD = {"none": "none", "ngram": "ngram", "draft": "draft", "cascade": "cascade", "adaptive": "auto",
           "suffix": "ngram", "suffix-tree": "ngram", "hybrid": "hybrid"}


@dataclass
class RequestResult:
    """One request: what it produced and when."""

    index: int  # the row's index in its workload
    tokens: int
    seconds: float  # from submission to the last token
    ttft_s: float | None  # from submission to the first token
    output: list[int] | str  # token ids (in process) or text (over HTTP): compared across modes
    stats: dict[str, LevelStats] = field(default_factory=dict)  # per verifying level, by name


@dataclass
class Chunk:
    """One chunk of one mode: the wall time of the whole chunk and each request's result."""

    seconds: float
    requests: list[RequestResult]


class Target(Protocol):
    """Where a benchmark runs its modes."""

    #: "in_process" or "http"
    kind: str
    #: whether per-position acceptance counts come with each request (HTTP usage gives totals only)
    per_position: bool

    def unavailable(self, mode: str) -> str | None:
        """Why `mode` cannot run on this target (None: it can)."""

    def run(self, mode: str, rows: Sequence[tuple[int, dict[str, Any]]], batch: int, max_tokens: int | None
            ) -> Chunk:
        """Run `rows` ((index, row) pairs) together as one chunk of `batch` requests."""

    def describe(self) -> dict[str, Any]:
        """What the report says about the target (levels, model, URL)."""

    def new_stream(self) -> None:
        """The next requests start a new stream: nothing learnt from earlier requests' outputs carries over."""

    def close(self) -> None: ...


def row_max_tokens(row: dict[str, Any], override: int | None, default: int = 64) -> int:
    """The request's max_tokens: the command's override, else the line's, else `default`."""
    return override if override is not None else int(row.get("max_tokens", default))


class InProcessTarget:
    """The cascade's levels in this process, run through the same `Scheduler` the server uses."""

    kind = "in_process"
    per_position = True

    def __init__(self, levels: Sequence[Any], sampling: SamplingParams, *, overlap: bool = False, k_max: int = 8,
                 planner_kwargs: dict[str, Any] | None = None, suffix: Callable[[int], Any] | None = None,
                 tree_width: int = 4, hybrid_lookup: str = "suffix") -> None:
        """`levels`: the cascade (smallest first) of modes none..adaptive. `suffix(tree_width)` makes a fresh suffix
        `Level` (an empty store) for the suffix modes (None: they are unavailable); `tree_width` is suffix-tree's;
        `hybrid_lookup`: the lookup level of mode hybrid, `suffix` (a store of its own) or `ngram` (the cascade's
        n-gram level)."""
        from specray.coordinator.cascade import CascadeEngine

        if hybrid_lookup not in ("suffix", "ngram"):
            raise ValueError(f"hybrid_lookup must be 'suffix' or 'ngram', got {hybrid_lookup!r}")
        self.levels = list(levels)
        self.sampling = sampling
        self.tokenizer = self.levels[-1].worker.tokenizer
        self.stop_ids = tuple(getattr(self.levels[-1].worker, "eos_token_ids", ()) or ())
        self.engine = CascadeEngine(self.levels, overlap=overlap)
        self.overlap = overlap
        self.k_max = k_max
        self.planner_kwargs = dict(planner_kwargs or {})
        self.suffix = suffix
        self.tree_width = tree_width
        self.hybrid_lookup = hybrid_lookup
        self._adaptive: tuple[Any, Any] | None = None  # (engine, planner): one live planner for the whole run
        self._lookup: dict[str, Any] = {}  # suffix mode -> its engine, made on first use, emptied by new_stream

    def _draft_model(self) -> Any | None:
        """The largest draft model level of the cascade (None: there is none)."""
        return next((lv for lv in reversed(self.levels[:-1]) if lv.worker is not None), None)

    def _mode_levels(self, mode: str) -> list[Any]:
        """A suffix mode's levels: a fresh suffix level (hybrid: then the largest draft model), then the target."""
        if mode == "hybrid":
            return [self.suffix(1), self._draft_model(), self.levels[-1]]
        return [self.suffix(self.tree_width if mode == "suffix-tree" else 1), self.levels[-1]]

    def _engine(self, mode: str) -> Any:
        if mode not in SUFFIX_MODES or (mode == "hybrid" and self.hybrid_lookup == "ngram"):
            return self.engine
        if mode not in self._lookup:
            from specray.coordinator.cascade import CascadeEngine

            self._lookup[mode] = CascadeEngine(self._mode_levels(mode), overlap=self.overlap)
        return self._lookup[mode]

    def new_stream(self) -> None:
        """Start over with empty suffix stores and prefix caches: the next requests draw on no earlier output or
        prefill (each mode's pass over a workload starts cold, as a peer's fresh process does). The cascade's own
        suffix level too: it learns from every request it serves, plain ones included, so a mode after `none`
        would otherwise draft the very outputs `none` wrote for the same prompts."""
        self._lookup.clear()
        for lv in self.levels:
            lv.forget_cached()

    def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": self.kind, "levels": [lv.name for lv in self.levels], "overlap": self.overlap}
        if self.suffix is not None:
            shared = [self.levels[0], self._draft_model(), self.levels[-1]]  # hybrid over the cascade's n-gram
            out["mode_levels"] = {
                m: [lv.name for lv in (shared if m == "hybrid" and self.hybrid_lookup == "ngram"
                                       else self._mode_levels(m))]
                for m in SUFFIX_MODES if self.unavailable(m) is None}
            out["tree_width"] = self.tree_width
        return out

    def unavailable(self, mode: str) -> str | None:
        below = self.levels[:-1]
        if mode in SUFFIX_MODES:
            return self._lookup_unavailable(mode)
        if mode in ("cascade", "adaptive") and not below:
            return "the cascade has only the target"
        if mode == "ngram" and not (below and below[0].is_ngram):
            return "the cascade has no n-gram level"
        if mode == "draft" and all(lv.is_ngram for lv in below):
            return "the cascade has no draft model level"
        return None

    def _lookup_unavailable(self, mode: str) -> str | None:
        target = self.levels[-1]
        if mode == "hybrid":
            if self._draft_model() is None:
                return "the cascade has no draft model level"
            if self.hybrid_lookup == "ngram":
                return None if self.levels[0].is_ngram else "the cascade has no n-gram level (--hybrid-lookup ngram)"
        if self.suffix is None:
            return "no suffix level to build here"
        if mode == "suffix-tree":
            if self.tree_width < 2:
                return f"--tree-width {self.tree_width}: a tree needs at least 2 children per node"
            if target.caps is None or not target.caps.tree_verify:
                return (f"the target {target.name!r} verifies chains only (a vllm level): trees need an hf target "
                        "(--backend hf)")
        return None

    def _planner(self):
        if self._adaptive is None:
            from specray.coordinator.cascade import CascadeEngine
            from specray.policy.planner import Planner

            engine = CascadeEngine(self.levels, overlap=self.overlap)
            self._adaptive = (engine, Planner(self.levels, k_max=self.k_max, **self.planner_kwargs).attach(engine))
        return self._adaptive

    def run(self, mode: str, rows: Sequence[tuple[int, dict[str, Any]]], batch: int, max_tokens: int | None
            ) -> Chunk:
        return asyncio.run(self._run(mode, rows, batch, max_tokens))

    async def _run(self, mode, rows, batch, max_tokens) -> Chunk:
        from specray.coordinator.scheduler import Request, Scheduler, Speculation

        if mode == "adaptive":
            engine, planner = self._planner()
            spec = None
        else:
            engine, planner, spec = self._engine(mode), None, Speculation(_METHOD[mode])
        sched = Scheduler(engine, self.tokenizer, max_batch_size=batch, planner=planner, stop_token_ids=self.stop_ids)
        slots = asyncio.Semaphore(batch)  # a closed loop (more rows than the batch): timed from admission, as over HTTP

        async def one(index: int, row: dict[str, Any]) -> RequestResult:
            async with slots:
                return await send(index, row)

        async def send(index: int, row: dict[str, Any]) -> RequestResult:
            req = Request(prompt_ids(self.tokenizer, row), self.sampling, row_max_tokens(row, max_tokens),
                          speculation=spec)
            t0 = time.perf_counter()
            first, out, stats = None, [], {}
            async for ev in sched.generate(req):
                if ev.error is not None:
                    raise RuntimeError(f"mode {mode}: request {index} failed: {ev.error}") from ev.error
                if ev.token_ids and first is None:
                    first = time.perf_counter() - t0
                out.extend(ev.token_ids)
                if ev.finished:
                    stats = dict(ev.stats or {})
            return RequestResult(index, len(out), time.perf_counter() - t0, first, out, stats)

        t0 = time.perf_counter()
        try:
            # tasks start in list order, so the scheduler admits the requests in the order given (a stream's order)
            results = await asyncio.gather(*[one(i, r) for i, r in rows])
        finally:
            await sched.close()
        return Chunk(time.perf_counter() - t0, list(results))

    def close(self) -> None:
        pass


def stats_from_usage(spec: dict[str, Any] | None) -> dict[str, LevelStats]:
    """Per-level statistics from a response's `usage.speculation` (totals only: no per-position counts)."""
    out = {}
    for name, d in (spec or {}).items():
        out[name] = LevelStats(num_drafts=int(d.get("num_drafts", 0)), draft_tokens=int(d.get("draft_tokens", 0)),
                               accepted_tokens=int(d.get("accepted_tokens", 0)))
    return out


class HTTPTarget:
    """A running specray server (or any OpenAI-compatible one) over HTTP: streaming chat completions for rows with
    `messages`, completions for rows with `prompt`, each with the mode's `speculation` field."""

    kind = "http"
    per_position = False
    tokenizer = None  # the server tokenizes

    def __init__(self, url: str, sampling: SamplingParams, *, model: str | None = None, api_key: str | None = None,
                 timeout_s: float = 600.0) -> None:
        try:
            import openai
        except ImportError:
            raise ValueError("--url needs the openai client: pip install 'specray[bench]'") from None
        self.url = url.rstrip("/")
        self.sampling = sampling
        self._openai = openai
        self._args = dict(base_url=self.url, api_key=api_key or "unused", max_retries=0, timeout=timeout_s)
        if model is None:
            with openai.OpenAI(**self._args) as client:
                ids = [m.id for m in client.models.list().data]
            if not ids:
                raise ValueError(f"{self.url}/models lists no model: give --served-model")
            model = ids[0]
        self.model = model
        #: whether the server reset its prefix cache before every pass (None: no pass yet)
        self.prefix_cache_reset: bool | None = None

    def describe(self) -> dict[str, Any]:
        return {"kind": self.kind, "url": self.url, "model": self.model, "prefix_cache_reset": self.prefix_cache_reset}

    def new_stream(self) -> None:
        """Ask the server to forget its cached prompt prefixes (`POST /reset_prefix_cache`, as specray's and vLLM's
        servers take it), so that each mode's pass prefills its prompts as the first one did; a server's suffix
        store is its own. A server without the route is told about once: its later modes find the prompts cached."""
        import httpx

        root = self.url[: -len("/v1")] if self.url.endswith("/v1") else self.url
        headers = {"Authorization": f"Bearer {self._args['api_key']}"}
        try:
            r = httpx.post(f"{root}/reset_prefix_cache", headers=headers, timeout=60)
            ok, why = r.status_code == 200, f"HTTP {r.status_code}: {r.text[:200]}"
        except httpx.HTTPError as exc:
            ok, why = False, str(exc)
        if not ok and self.prefix_cache_reset is not False:
            print(f"note: {root}/reset_prefix_cache failed ({why}): the server's prefix cache carries over, so a mode "
                  "after the first finds its prompts already prefilled (a shorter time to first token)",
                  file=sys.stderr)
        self.prefix_cache_reset = ok and self.prefix_cache_reset is not False

    def unavailable(self, mode: str) -> str | None:
        if mode in ("suffix", "suffix-tree"):
            return "in process only (over HTTP, mode ngram measures the server's lookup level, suffix or n-gram)"
        return None  # the server answers 400 for a mode it cannot run; that request fails loudly

    def run(self, mode: str, rows: Sequence[tuple[int, dict[str, Any]]], batch: int, max_tokens: int | None
            ) -> Chunk:
        return asyncio.run(self._run(mode, rows, batch, max_tokens))

    async def _run(self, mode, rows, batch, max_tokens) -> Chunk:
        sp = self.sampling
        common: dict[str, Any] = {"model": self.model, "temperature": sp.temperature, "stream": True,
                                  "stream_options": {"include_usage": True},
                                  "extra_body": {"speculation": {"method": _METHOD[mode]}}}
        if sp.temperature > 0:
            common["top_p"] = sp.top_p
            if sp.seed is not None:
                common["seed"] = sp.seed
        slots = asyncio.Semaphore(batch)  # a closed loop (more rows than C): a finished request's slot takes the next
        async with self._openai.AsyncOpenAI(**self._args) as client:

            async def one(index: int, row: dict[str, Any]) -> RequestResult:
                async with slots:
                    return await send(index, row)

            async def send(index: int, row: dict[str, Any]) -> RequestResult:
                n = row_max_tokens(row, max_tokens)
                t0 = time.perf_counter()
                if "messages" in row:
                    stream = await client.chat.completions.create(messages=row["messages"], max_tokens=n, **common)
                else:
                    stream = await client.completions.create(prompt=row["prompt"], max_tokens=n, **common)
                first, parts, usage = None, [], None
                async for chunk in stream:
                    for choice in chunk.choices:
                        text = choice.delta.content if "messages" in row else choice.text
                        if text:
                            if first is None:
                                first = time.perf_counter() - t0
                            parts.append(text)
                    if chunk.usage is not None:
                        usage = chunk.usage.model_dump()
                dt = time.perf_counter() - t0
                tokens = int((usage or {}).get("completion_tokens") or 0)
                return RequestResult(index, tokens, dt, first, "".join(parts),
                                     stats_from_usage((usage or {}).get("speculation")))

            t0 = time.perf_counter()
            results = await asyncio.gather(*[one(i, r) for i, r in rows])
        return Chunk(time.perf_counter() - t0, list(results))

    def close(self) -> None:
        pass
