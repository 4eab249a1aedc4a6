"""The draft -> verify round loop over a cascade of levels, for a batch of sequences.

Levels are ordered small -> large; the last is the target. Level i verifies what level i-1 proposes; a
middle level runs inner rounds (its drafter proposes, it verifies) until it has the K tokens it proposes
to the level above. Level i's accepted stream is an exact sample from level i, so the target's stream is
an exact sample from the target (lossless). Plain decoding is the same loop with the target alone.

The engine owns the canonical tokens of every sequence and a mirror of what each worker holds, and sends
each worker a `SeqSync` (keep n, append ...) with every call: one batched call per level per (inner)
round, and rollback is just a shorter `keep`. It talks to workers only through the protocol, so a fake
worker, an in-process `HFWorker` or a Ray actor proxy all fit.

Overlap (`overlap=True`: the levels below the target draft the next round while it verifies this one):
`specray.coordinator.lookahead`.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from specray.coordinator.lookahead import LookAhead, Until
from specray.coordinator.stats import LevelStats
from specray.engine.protocol import DraftMode, SeqSync, Worker
from specray.spec.ngram import NgramConfig
from specray.spec.params import SamplingParams, VerifyMethod


class LevelCallError(RuntimeError):
    """A worker call of one level failed; `level` is its index. Below the target the engine drops the level
    and retries the round without it (exact: drafts are only proposals); the target failing is fatal to the
    round's requests."""

    def __init__(self, level: int, name: str, cause: BaseException) -> None:
        super().__init__(f"level {name!r} failed: {type(cause).__name__}: {cause}")
        self.level, self.name, self.cause = level, name, cause


@dataclass
class Level:
    """One level of a cascade: an n-gram proposer (level 0 only) or a model worker.

    k: tokens this level proposes to the level above per round (unused for the target).
    method: how this level verifies the level below (unused for level 0).
    native_k: tokens the level's own engine speculates per step when it decodes without a specray draft (a
    native vLLM target, `specray.engine.vllm_native`); 0: none. Defaults to the worker's `native_k`.
    live_decode: the level decodes rows without a draft on a path of its own, cheaper than verification (a
    vllm worker's live requests); such calls are timed apart. Defaults to the worker's `live_decode`.
    engine_verify: the level verifies drafts of up to this many tokens per step on that path (inside a vLLM
    engine); 0: by a forward pass over the draft. Defaults to the worker's `engine_verify`.
    confidence: a model level below the target ends a row's draft after a token it gave a probability below
    this (0: off; HF's assisted generation uses 0.4): the target rejects such tokens often, and tokens drafted
    after them are mostly wasted work. Exact at any value: the draft's length depends only on the drafter.
    """

    name: str
    worker: Worker | None = None
    ngram: NgramConfig | None = None
    k: int = 4
    method: VerifyMethod = VerifyMethod.DETERMINISTIC
    native_k: int = 0
    live_decode: bool = False
    engine_verify: int = 0
    confidence: float = 0.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.confidence < 1.0:
            raise ValueError(f"level {self.name!r}: confidence must be in [0, 1)")
        if (self.worker is None) == (self.ngram is None):
            raise ValueError(f"level {self.name!r}: give exactly one of worker or ngram")
        if not self.native_k and self.worker is not None:
            self.native_k = int(getattr(self.worker, "native_k", 0) or 0)
        if not self.live_decode and self.worker is not None:
            self.live_decode = bool(getattr(self.worker, "live_decode", False))
        if not self.engine_verify and self.worker is not None:
            self.engine_verify = int(getattr(self.worker, "engine_verify", 0) or 0)
        if self.ngram is not None and self.k == 4:
            self.k = self.ngram.num_speculative_tokens
        self.method = VerifyMethod(self.method)

    @property
    def is_ngram(self) -> bool:
        return self.ngram is not None


log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Plan:
    """Which levels run this round (indices, ascending, always ending with the target) and K for each
    non-target active level. `Plan((top,), ())` is plain decoding."""

    levels: tuple[int, ...]
    k: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.k) != len(self.levels) - 1:
            raise ValueError("a plan needs one K per non-target level")
        if any(x < 0 for x in self.k) or list(self.levels) != sorted(set(self.levels)):
            raise ValueError(f"invalid plan {self}")

    @property
    def speculative(self) -> bool:
        return len(self.levels) > 1 and any(self.k)


@dataclass
class Sequence_:
    """One sequence in the batch: canonical tokens and per-level bookkeeping."""

    seq_id: str
    prompt_len: int
    tokens: list[int]
    sampling: SamplingParams
    max_tokens: int
    stop_ids: frozenset[int] = frozenset()
    finished: bool = False
    finish_reason: str | None = None
    stats: dict[int, LevelStats] = field(default_factory=dict)
    rounds: int = 0
    # per level: mirror of the worker's tokens, and a length known to agree with the canonical tokens
    mirror: dict[int, list[int]] = field(default_factory=dict)
    agreed: dict[int, int] = field(default_factory=dict)
    epoch: dict[int, int] = field(default_factory=dict)  # the level's epoch when the mirror was made
    #: overlap: (plan it was drafted for, len(tokens) it continues, draft tokens) for the next round
    ahead: tuple[Plan, int, list[int]] | None = None

    @property
    def output(self) -> list[int]:
        return self.tokens[self.prompt_len :]

    @property
    def remaining(self) -> int:
        return self.max_tokens - (len(self.tokens) - self.prompt_len)


def _lcp(a: list[int], b: list[int], start: int) -> int:
    n = min(len(a), len(b))
    i = min(start, n)
    while i < n and a[i] == b[i]:
        i += 1
    return i


class CascadeEngine(LookAhead):
    """Runs rounds over a batch of sequences. Not thread-safe; one engine per coordinator loop."""

    def __init__(self, levels: Sequence[Level], max_context: int | None = None, *, overlap: bool = False) -> None:
        if not levels:
            raise ValueError("a cascade needs at least one level (the target)")
        levels = list(levels)
        for i, lvl in enumerate(levels):
            if lvl.is_ngram and i != 0:
                raise ValueError(f"level {lvl.name!r}: an n-gram proposer can only be the first (smallest) level")
        if levels[-1].is_ngram:
            raise ValueError("the last level (the target) must be a model")
        self.levels = levels
        self.top = len(levels) - 1
        limits = [lvl.worker.max_context for lvl in levels if lvl.worker is not None and
                  getattr(lvl.worker, "max_context", None)]
        self.max_context = min([*limits, *( [max_context] if max_context else [])], default=None)
        self.default_plan = Plan(tuple(range(len(levels))), tuple(lvl.k for lvl in levels[:-1]))
        self._ids = itertools.count()
        #: objects with on_call(level, kind, batch, tokens, seconds) and on_verify(level, lower, draft_lens,
        #: accepted) — live measurements for the planner (kind "propose": tokens = autoregressive steps;
        #: "verify": tokens = the longest draft + 1, fed in one forward; "native": a call of a native target
        #: in which every row was one step of its engine's own speculation, tokens = longest native draft + 1)
        #: — and optionally on_native(level, draft_lens, accepted) for those rows (cold rows left out)
        self.observers: list = []
        # failure handling: a level that fails is skipped until `retry_after_s` passed and it answers again;
        # its epoch is bumped so every sequence re-adds itself there (a restarted actor lost them all)
        self.retry_after_s = 2.0
        self.probe_wait_s = 0.05  # longest a round waits for a down level's health answer
        self._probing: set[int] = set()
        self.epoch = [0] * len(levels)
        self.down: dict[int, float] = {}  # level -> monotonic time of the next health probe
        self._lock = threading.Lock()
        self._init_lookahead(overlap)

    def plan_name(self, plan: Plan) -> str:
        """A short label, e.g. 'ngram:4>draft:4>target' or 'target' (plain decoding)."""
        parts = [f"{self.levels[i].name}:{k}" for i, k in zip(plan.levels, plan.k)]
        return ">".join([*parts, self.levels[plan.levels[-1]].name])

    # ----- sequence lifecycle --------------------------------------------------------------------
    def new_sequence(
        self, prompt_ids: Sequence[int], sampling: SamplingParams, max_tokens: int,
        stop_ids: Sequence[int] = (), seq_id: str | None = None,
    ) -> Sequence_:
        if not prompt_ids:
            raise ValueError("empty prompt")
        if max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        if self.max_context is not None:
            if len(prompt_ids) >= self.max_context:
                raise ValueError(f"prompt of {len(prompt_ids)} tokens does not fit the context {self.max_context}")
            max_tokens = min(max_tokens, self.max_context - len(prompt_ids))
        sid = seq_id if seq_id is not None else f"seq-{next(self._ids)}"
        return Sequence_(sid, len(prompt_ids), list(prompt_ids), sampling.with_seed(), max_tokens, frozenset(stop_ids))

    def release(self, seq: Sequence_) -> None:
        """Free the sequence on every level that has seen it (idempotent)."""
        for i in list(seq.mirror):
            worker = self.levels[i].worker
            if worker is not None:
                try:
                    worker.free(seq.seq_id)
                except Exception as exc:  # a dead or restarted level has lost the sequence anyway
                    log.debug("free of %s on %s failed: %s", seq.seq_id, self.levels[i].name, exc)
            del seq.mirror[i]

    # ----- one round -----------------------------------------------------------------------------
    def step(
        self, seqs: Sequence[Sequence_], plan: Plan | None = None, method: VerifyMethod | None = None
    ) -> list[list[int]]:
        """One round for the active sequences: returns the tokens newly committed to each.

        `method` overrides every level's verification method for this round (a per-request choice).
        Calls for disjoint sets of sequences may run concurrently from different threads when the
        workers are thread-safe (actor proxies): that is how pipelining overlaps levels.
        """
        plan = plan or self.default_plan
        if plan.levels[-1] != self.top:
            raise ValueError("a plan must end with the target level")
        active = [s for s in seqs if not s.finished]
        if not active:
            return [[] for _ in seqs]
        if method is None and all(s.sampling.greedy for s in active):
            # at temperature 0 every method verifies greedily (same tokens); saying so lets a greedy batch draft
            # ahead (overlap) and skip draft probabilities under a configured rejection method
            method = VerifyMethod.GREEDY
        for _ in range(len(self.levels)):
            try:
                new_by_id = self._round(active, self._available(plan), method)
                break
            except LevelCallError as exc:
                if exc.level == self.top:
                    raise
                self._mark_down(exc.level, exc)
        else:  # pragma: no cover - every draft level failed in turn; the target alone cannot fail over
            raise RuntimeError("no plan could run")
        return [new_by_id.get(s.seq_id, []) for s in seqs]

    def _available(self, plan: Plan) -> Plan:
        """The plan without levels that are down (probing those whose retry time has come)."""
        if not self.down:
            return plan
        keep = []
        for i, k in zip(plan.levels[:-1], plan.k):
            if i in self.down and not self._probe(i):
                continue
            keep.append((i, k))
        return Plan((*[i for i, _ in keep], self.top), tuple(k for _, k in keep))

    def _probe(self, i: int) -> bool:
        """Is down level `i` back? Its health call runs in a thread and is waited for only `probe_wait_s`:
        a level whose node is gone can leave the call pending for a long time, and the round loop (every
        other request) must not stall on it. A slow answer takes the level back at a later round."""
        with self._lock:
            if i not in self.down:
                return True
            if i in self._probing or time.monotonic() < self.down[i]:
                return False
            self._probing.add(i)
            self.down[i] = time.monotonic() + self.retry_after_s
        done = threading.Event()

        def check() -> None:
            try:
                self.levels[i].worker.stats()
                ok = True
            except Exception:
                ok = False
            with self._lock:
                self._probing.discard(i)
                if ok and self.down.pop(i, None) is not None:
                    log.warning("level %r is back in the cascade", self.levels[i].name)
                elif not ok and i in self.down:
                    self.down[i] = time.monotonic() + self.retry_after_s
            done.set()

        threading.Thread(target=check, name=f"specray-probe-{self.levels[i].name}", daemon=True).start()
        done.wait(self.probe_wait_s)
        with self._lock:
            return i not in self.down

    def _mark_down(self, i: int, exc: BaseException) -> None:
        with self._lock:
            self.epoch[i] += 1
            self.down[i] = time.monotonic() + self.retry_after_s
        log.warning("dropping level %r from the cascade until it answers again: %s", self.levels[i].name, exc)

    def level_status(self) -> dict[str, str]:
        return {lv.name: ("down" if i in self.down else "up") for i, lv in enumerate(self.levels)}

    def _call(self, i: int, fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except LevelCallError:
            raise
        except Exception as exc:
            raise LevelCallError(i, self.levels[i].name, exc) from exc

    def _round(self, active: list[Sequence_], plan: Plan, method: VerifyMethod | None) -> dict[str, list[int]]:
        chain = list(plan.levels)
        ks = dict(zip(chain[:-1], plan.k))
        bases = [s.tokens for s in active]
        lower = chain[-2] if len(chain) > 1 else None
        speculative = lower is not None and ks[lower] > 0
        overlap = speculative and self._overlaps(chain, method)
        cold: set[int] = set()
        if speculative:
            want = [max(0, min(ks[lower], s.remaining - 1)) for s in active]
            if overlap:  # rows the drafters have never seen: they prefill beside the target (lookahead.py)
                cold = self._cold_rows(chain, active, want, method)
                want = [0 if b in cold else w for b, w in enumerate(want)]
            until = self._until(chain, active, method) if overlap else None
            drafts, probs = self._drafts(chain, active, bases, want, ks, method, plan if overlap else None, until)
        else:
            want, drafts, probs, until = [0] * len(active), [[] for _ in active], None, None
        future = self._pool().submit(self._draft_ahead, chain, active, bases, drafts, want, ks, method, cold,
                                     until) if overlap else None
        try:
            res = self._verify(self.top, lower, active, bases, drafts, probs, False, method)
        finally:
            if until is not None:
                until.set()  # bounded rows of the look-ahead stop at their next step
            ahead = future.result() if future is not None else None  # never leave it running past the round
        native = _native_lens(res, drafts)
        new_by_id: dict[str, list[int]] = {}
        for b, (s, toks, nacc, n) in enumerate(zip(active, res.token_ids, res.num_accepted, native)):
            s.rounds += 1
            committed = self._commit(s, toks)
            new_by_id[s.seq_id] = committed
            s.stats.setdefault(self.top, LevelStats()).record(n, nacc, len(toks))
            self._keep_lookahead(s, plan, ahead.get(b) if ahead else None, len(drafts[b]), nacc, toks, committed)
        return new_by_id

    def _commit(self, s: Sequence_, toks: list[int]) -> list[int]:
        out = []
        for t in toks:
            if s.remaining <= 0:
                break
            s.tokens.append(t)
            out.append(t)
            if t in s.stop_ids:
                s.finished, s.finish_reason = True, "stop"
                break
        if not s.finished and s.remaining <= 0:
            s.finished, s.finish_reason = True, "length"
        return out

    def _sync(self, level: int, s: Sequence_, desired: list[int]) -> SeqSync:
        worker = self.levels[level].worker
        assert worker is not None
        mirror = s.mirror.get(level)
        if mirror is None or s.epoch.get(level) != self.epoch[level]:
            if mirror is not None:  # the level failed since: it may or may not still hold the sequence
                self._call(level, self._free_quietly, worker, s.seq_id)
            self._call(level, worker.add, s.seq_id, s.tokens[: s.prompt_len])
            mirror = s.mirror[level] = s.tokens[: s.prompt_len]
            s.agreed[level] = s.prompt_len
            s.epoch[level] = self.epoch[level]
        keep = _lcp(mirror, desired, s.agreed.get(level, 0))
        sync = SeqSync(keep, tuple(desired[keep:]))
        del mirror[keep:]
        mirror.extend(desired[keep:])
        s.agreed[level] = min(len(s.tokens), len(mirror))
        return sync

    @staticmethod
    def _free_quietly(worker: Worker, seq_id: str) -> None:
        try:
            worker.free(seq_id)
        except Exception:
            pass

    def _produce(
        self, chain: list[int], ci: int, seqs: list[Sequence_], bases: list[list[int]], want: list[int],
        ks: dict[int, int], override: VerifyMethod | None = None, until: Until | None = None,
    ) -> tuple[list[list[int]], torch.Tensor | None]:
        """Level chain[ci] proposes want[b] tokens beyond bases[b] to level chain[ci + 1].

        `until` (a bounded draft, `specray.coordinator.lookahead`): once it is set, the rows it marks stop at
        the next step boundary with the tokens they have (fewer than want[b]; at least one step runs); no
        probabilities then."""
        i = chain[ci]
        lvl = self.levels[i]
        if lvl.is_ngram:
            assert lvl.ngram is not None
            return [lvl.ngram.propose(base, w) if w > 0 else [] for base, w in zip(bases, want)], None
        assert lvl.worker is not None
        if ci == 0:
            if until is not None and any(until.rows):
                return self._propose_bounded(chain, seqs, bases, want, override, until), None
            prop = self._propose(chain, seqs, bases, want, override)
            return prop.token_ids, prop.probs
        # a middle level: inner rounds until each row has want[b] tokens
        need_probs = self._method(chain[ci + 1], i, override) == VerifyMethod.REJECTION
        outs: list[list[int]] = [[] for _ in seqs]
        prob_rows: list[list[torch.Tensor]] = [[] for _ in seqs]
        stopped = [False] * len(seqs)  # the level was unsure of a token it drafted for the row (`confidence`)
        while True:
            rows = [b for b in range(len(seqs)) if len(outs[b]) < want[b] and not stopped[b]]
            if not rows:
                break
            sub = [seqs[b] for b in rows]
            sub_bases = [bases[b] + outs[b] for b in rows]
            sub_want = [max(0, min(ks[chain[ci - 1]], want[b] - len(outs[b]) - 1)) for b in rows]
            if any(sub_want):
                d, dp = self._produce(chain, ci - 1, sub, sub_bases, sub_want, ks, override)
            else:
                d, dp = [[] for _ in rows], None
            res = self._verify(i, chain[ci - 1], sub, sub_bases, d, dp, need_probs, override, lvl.confidence > 0)
            native = _native_lens(res, d)
            for j, b in enumerate(rows):
                toks = res.token_ids[j]
                seqs[b].stats.setdefault(i, LevelStats()).record(native[j], res.num_accepted[j], len(toks))
                if res.confidence is not None:  # keep up to the first unsure token, then stop the row
                    unsure = next((n for n, c in enumerate(res.confidence[j]) if c < lvl.confidence), None)
                    if unsure is not None:
                        toks, stopped[b] = toks[: unsure + 1], True
                outs[b].extend(toks)
                if res.probs is not None:
                    prob_rows[b].append(res.probs[j, : len(toks)])
            if until is not None and until.is_set():  # bounded rows stop after this inner round
                stopped = [x or r for x, r in zip(stopped, until.rows)]
        outs = [o[:w] for o, w in zip(outs, want)]
        probs = None
        if need_probs:
            probs = torch.zeros(len(seqs), max(want, default=0), lvl.worker.vocab_size)
            for b, chunks in enumerate(prob_rows):
                if chunks:
                    cat = torch.cat(chunks)[: want[b]]
                    probs[b, : cat.shape[0]] = cat
        return outs, probs

    def _propose(
        self, chain: list[int], seqs: list[Sequence_], bases: list[list[int]], want: list[int],
        override: VerifyMethod | None,
    ):
        """The first (smallest) model level of the chain drafts want[b] tokens beyond bases[b] in one call."""
        i = chain[0]
        lvl = self.levels[i]
        syncs = [self._sync(i, s, base) for s, base in zip(seqs, bases)]
        t0 = time.perf_counter()
        extra = {"stop_below": lvl.confidence} if lvl.confidence > 0 else {}  # optional: only when used
        prop = self._call(
            i, lvl.worker.propose, [s.seq_id for s in seqs], want, [s.sampling for s in seqs],
            mode=DraftMode.for_method(self._method(chain[1], i, override)), salt=i, sync=syncs, **extra,
        )
        for ob in self.observers:
            ob.on_call(i, "propose", len(seqs), max(want, default=0), time.perf_counter() - t0)
        for s, toks in zip(seqs, prop.token_ids):
            s.mirror[i].extend(toks)
        return prop

    def _method(self, level: int, lower: int | None, override: VerifyMethod | None = None) -> VerifyMethod:
        """The verification method of `level` over drafts from `lower`; rejection over a deterministic
        drafter (n-gram) is the deterministic method (q = delta_x), so it is resolved to it."""
        method = VerifyMethod(override) if override is not None else self.levels[level].method
        if lower is not None and self.levels[lower].is_ngram and method == VerifyMethod.REJECTION:
            return VerifyMethod.DETERMINISTIC
        return method

    def _verify(
        self, i: int, lower: int | None, seqs: list[Sequence_], bases: list[list[int]],
        drafts: list[list[int]], probs: torch.Tensor | None, return_probs: bool,
        override: VerifyMethod | None = None, confidence: bool = False,
    ):
        worker = self.levels[i].worker
        assert worker is not None
        syncs = [self._sync(i, s, base) for s, base in zip(seqs, bases)]
        method = self._method(i, lower, override)
        extra = {"confidence": True} if confidence else {}  # an optional protocol argument: only when used
        t0 = time.perf_counter()
        res = self._call(
            i, worker.verify, [s.seq_id for s in seqs], drafts, probs if method == VerifyMethod.REJECTION else None,
            [s.sampling for s in seqs], method, salt=i, sync=syncs, return_probs=return_probs, **extra,
        )
        dt = time.perf_counter() - t0
        for s, toks in zip(seqs, res.token_ids):
            s.mirror[i].extend(toks)
        if self.observers:
            lens = [len(d) for d in drafts]
            fed = _native_lens(res, drafts)  # tokens fed per row: a native row's own draft counts
            tokens = max(fed, default=0) + 1
            # rows without a draft that the verifier speculated on by itself (a native target); on a target
            # without speculation of its own (live decoding) such a row is the drafter finding nothing, which
            # counts against its acceptance like on any other target
            own = res.native_drafts is not None and self.levels[i].native_k > 0
            nat = [b for b, d in enumerate(drafts) if not d] if own else []
            cold = res.native_cold or [False] * len(drafts)
            warm = [b for b in nat if not cold[b]]
            # a call made only of engine steps runs the engine's own (cheaper) path: timed apart
            kind = "native" if res.stepped or (nat and len(nat) == len(drafts)) else "verify"
            nat_set = set(nat)
            rows = [b for b in range(len(drafts)) if b not in nat_set]  # rows that verified a given draft
            # a stepped call in which a row's engine request started ran that row's prefill: its time says
            # nothing about a decode step (it would price plain decoding at a prefill's cost), so it is not timed
            timed = not (res.stepped and any(cold))
            for ob in self.observers:
                if timed:
                    ob.on_call(i, kind, len(seqs), tokens, dt)
                if lower is not None and rows:
                    ob.on_verify(i, lower, [lens[b] for b in rows], [res.num_accepted[b] for b in rows])
                if warm and hasattr(ob, "on_native"):
                    ob.on_native(i, [fed[b] for b in warm], [res.num_accepted[b] for b in warm])
        return res


def _native_lens(res, drafts: list[list[int]]) -> list[int]:
    """Draft tokens verified per row: the given draft, or for a row without one the verifier's own native
    speculation (`VerifyResult.native_drafts`)."""
    native = res.native_drafts
    if native is None:
        return [len(d) for d in drafts]
    return [len(d) if d else int(n) for d, n in zip(drafts, native)]


@dataclass
class GenerationResult:
    token_ids: list[int]
    text: str | None
    finish_reason: str
    rounds: int
    stats: dict[str, LevelStats]
    #: seconds from the start of the call to this sequence's first token (its prefill and first round)
    ttft_s: float | None = None


def run_to_completion(
    engine: CascadeEngine, seqs: list[Sequence_], plan: Plan | Callable[[int], Plan] | None = None,
    on_tokens: Callable[[Sequence_, list[int]], None] | None = None,
) -> None:
    """Step until every sequence finishes, then free them on every level.

    `plan` may be a callable (a planner): it is asked for the plan of every round with the batch size.
    """
    try:
        while any(not s.finished for s in seqs):
            this = plan(sum(not s.finished for s in seqs)) if callable(plan) else plan
            new = engine.step(seqs, this)
            if on_tokens is not None:
                for s, toks in zip(seqs, new):
                    if toks:
                        on_tokens(s, toks)
    finally:
        for s in seqs:
            engine.release(s)
