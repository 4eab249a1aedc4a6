"""Continuous batching with fake and tiny workers, no Ray: joins/leaves, cancellation, overrides, faults."""

from __future__ import annotations

import asyncio
import threading

import pytest

from specray.coordinator.cascade import CascadeEngine, Level
from specray.coordinator.generate import generate
from specray.coordinator.scheduler import Request, RequestError, Scheduler, Speculation
from specray.spec.ngram import NgramConfig
from specray.spec.params import SamplingParams
from specray.testing.fake import FakeWorker

PROMPTS = [[1, 2, 3], [4, 5], [6, 7, 8, 9, 1, 2], [3], [2, 2, 2, 2, 2], [9, 8, 7, 6], [5, 5, 1], [7, 1, 7, 1, 7]]
LENGTHS = [5, 17, 9, 30, 12, 3, 21, 8]


def levels():
    return [
        Level("ngram", ngram=NgramConfig(3, 1, 3)),
        Level("draft", worker=FakeWorker("draft", vocab=16, order=2, noise=0.6, noise_seed=3), k=4),
        Level("target", worker=FakeWorker("target", vocab=16, order=2)),
    ]


async def collect(sched: Scheduler, req: Request):
    toks, last = [], None
    async for ev in sched.generate(req):
        toks.extend(ev.token_ids)
        last = ev
    return toks, last


def alone(prompt, n):
    lv = [Level("target", worker=FakeWorker("target", vocab=16, order=2))]
    return generate(lv, [prompt], max_tokens=n, ignore_eos=True).results[0].token_ids


def test_eight_concurrent_requests_match_running_alone():
    lv = levels()
    sched = Scheduler(CascadeEngine(lv), max_batch_size=8)

    async def main():
        reqs = [Request(p, SamplingParams(), n) for p, n in zip(PROMPTS, LENGTHS)]
        out = await asyncio.gather(*[collect(sched, r) for r in reqs])
        await sched.close()
        return out

    out = asyncio.run(main())
    for (toks, last), p, n in zip(out, PROMPTS, LENGTHS):
        assert toks == alone(p, n)
        assert last.finished and last.finish_reason == "length" and last.completion_tokens == n
        assert last.stats["target"].verify_calls >= 1
    assert sched.stats.max_batch_observed > 1
    for level in lv:
        if level.worker is not None:
            assert level.worker.stats().live_sequences == 0


def test_requests_join_a_running_batch():
    sched = Scheduler(CascadeEngine(levels()), max_batch_size=4)

    async def main():
        first = asyncio.create_task(collect(sched, Request(PROMPTS[3], SamplingParams(), 40)))
        await asyncio.sleep(0.01)
        late = [asyncio.create_task(collect(sched, Request(p, SamplingParams(), n)))
                for p, n in zip(PROMPTS[:6], LENGTHS[:6])]
        res = await asyncio.gather(first, *late)
        await sched.close()
        return res

    res = asyncio.run(main())
    assert res[0][0] == alone(PROMPTS[3], 40)
    for (toks, _), p, n in zip(res[1:], PROMPTS, LENGTHS):
        assert toks == alone(p, n)
    assert sched.stats.max_batch_observed == 4  # capped, the rest waited


def test_cancellation_frees_every_level_within_a_round():
    lv = levels()
    sched = Scheduler(CascadeEngine(lv), max_batch_size=8)

    async def main():
        agen = sched.generate(Request([1, 2, 3], SamplingParams(), 500))
        other = asyncio.create_task(collect(sched, Request([4, 5], SamplingParams(), 60)))
        await agen.__anext__()
        assert lv[2].worker.stats().live_sequences >= 1
        await agen.aclose()  # the client went away
        rounds = sched.stats.rounds
        while sched.stats.rounds < rounds + 2:
            await asyncio.sleep(0.001)
        live = [w.worker.stats().live_sequences for w in lv if w.worker is not None]
        await other
        await sched.close()
        return live

    live = asyncio.run(main())
    assert all(n <= 1 for n in live)  # only the other request may still be live
    assert all(w.worker.stats().live_sequences == 0 for w in lv if w.worker is not None)


@pytest.mark.parametrize("method", ["none", "ngram", "draft", "cascade", "hybrid", "auto"])
def test_speculation_override_keeps_greedy_exact(method):
    sched = Scheduler(CascadeEngine(levels()))

    async def main():
        r = await collect(sched, Request([1, 2, 3], SamplingParams(), 25, speculation=Speculation(method, 2)))
        await sched.close()
        return r

    toks, last = asyncio.run(main())
    assert toks == alone([1, 2, 3], 25)
    if method == "none":
        assert last.stats["target"].draft_tokens == 0
    else:
        assert last.stats["target"].draft_tokens > 0


def test_invalid_overrides_are_request_errors():
    sched = Scheduler(CascadeEngine([Level("target", worker=FakeWorker("target"))]))
    with pytest.raises(RequestError):
        sched.plan_for(Speculation("ngram"))
    with pytest.raises(RequestError):
        sched.plan_for(Speculation("draft"))
    with pytest.raises(RequestError):
        sched.plan_for(Speculation("hybrid"))
    with pytest.raises(RequestError):
        Speculation("bogus")


class Flaky(FakeWorker):
    def __init__(self, *a, fail_after: int, **kw):
        super().__init__(*a, **kw)
        self.fail_after = fail_after

    def verify(self, *a, **kw):
        self.fail_after -= 1
        if self.fail_after < 0:
            raise RuntimeError("device lost")
        return super().verify(*a, **kw)


def test_a_failing_round_ends_its_requests_with_an_error_and_serving_continues():
    target = Flaky("target", vocab=16, order=2, fail_after=3)
    sched = Scheduler(CascadeEngine([Level("target", worker=target)]))

    async def main():
        bad = await collect(sched, Request([1, 2], SamplingParams(), 50))
        target.fail_after = 10**9
        good = await collect(sched, Request([1, 2], SamplingParams(), 5))
        await sched.close()
        return bad, good

    (bad_toks, bad_last), (good_toks, good_last) = asyncio.run(main())
    assert bad_last.finish_reason == "error" and isinstance(bad_last.error, RuntimeError)
    assert good_last.finish_reason == "length" and good_toks == alone([1, 2], 5)


def test_a_planner_that_raises_fails_the_round_and_serving_continues():
    """A planner error ends the requests of that round with the error (it used to end the scheduler's loop, and
    every request then waited forever); the next requests are served once the planner answers again."""
    lv = [Level("target", worker=FakeWorker("target", vocab=16, order=2))]
    engine = CascadeEngine(lv)
    broken = [True]

    def planner(batch: int):
        if broken[0]:
            raise KeyError("no such plan")
        return engine.default_plan

    sched = Scheduler(engine, planner=planner)

    async def main():
        bad = await asyncio.wait_for(collect(sched, Request([1, 2], SamplingParams(), 5)), timeout=30)
        broken[0] = False
        good = await asyncio.wait_for(collect(sched, Request([1, 2], SamplingParams(), 5)), timeout=30)
        await sched.close()
        return bad, good

    (_, bad_last), (good_toks, good_last) = asyncio.run(main())
    assert bad_last.finish_reason == "error" and isinstance(bad_last.error, KeyError)
    assert good_last.finish_reason == "length" and good_toks == alone([1, 2], 5)


def test_text_streaming_and_stop_strings_with_a_real_tokenizer(tiny):
    from specray.engine.hf import HFWorker

    target = HFWorker(str(tiny.target_dir), name="t", dtype="float32")
    lv = [Level("ngram", ngram=NgramConfig(3, 1, 3)), Level("t", worker=target)]
    tok = target.tokenizer
    prompt = tok.encode("def fibonacci(n):")
    sched = Scheduler(CascadeEngine(lv), tok)

    async def run(stop=()):
        text, toks, last = "", [], None
        async for ev in sched.generate(Request(prompt, SamplingParams(), 30, stop=stop, ignore_eos=True)):
            text += ev.text
            toks += ev.token_ids
            last = ev
        return text, toks, last

    async def main():
        full = await run()
        stop_at = full[0][5:9]
        cut = await run(stop=[stop_at])
        await sched.close()
        return full, cut, stop_at

    (text, toks, last), (ctext, _, clast), stop_at = asyncio.run(main())
    assert text == tok.decode(toks, skip_special_tokens=True)
    assert clast.finish_reason == "stop"
    assert ctext == text[: text.index(stop_at)]


def test_a_planner_split_runs_a_probe_group_beside_the_held_plan_and_stays_exact():
    """A planner's plan_groups split (probe on 2 sequences, held plan on the rest) becomes two groups in the
    same round; outputs stay equal to running each request alone."""
    from specray.coordinator.cascade import Plan

    lv = levels()
    engine = CascadeEngine(lv)
    probe, held = Plan((1, 2), (3,)), Plan((2,), ())

    class Splitter:
        def __init__(self) -> None:
            self.calls = 0

        def __call__(self, batch: int) -> Plan:
            raise AssertionError("plan_groups must be used when the planner has it")

        def plan_groups(self, batch: int, backlog=None):
            self.calls += 1
            return [(probe, 2), (held, batch - 2)] if batch > 2 and self.calls % 2 else [(held, batch)]

    rounds: list[dict] = []
    sched = Scheduler(engine, max_batch_size=8, planner=Splitter(),
                      on_round=lambda b, sizes, dt: rounds.append(dict(sizes)))

    async def main():
        reqs = [Request(p, SamplingParams(), n) for p, n in zip(PROMPTS, LENGTHS)]
        out = await asyncio.gather(*[collect(sched, r) for r in reqs])
        await sched.close()
        return out

    out = asyncio.run(main())
    for (toks, _last), p, n in zip(out, PROMPTS, LENGTHS):
        assert toks == alone(p, n)
    split = [r for r in rounds if probe in r and held in r]
    assert split and all(r[probe] == 2 for r in split)
    assert lv[1].worker.stats().live_sequences == 0


def test_the_planner_is_told_each_round_it_planned_and_not_asked_for_overridden_ones():
    """A planner with `on_round` hears the wall time of every round it chose plans for (what an exploration
    probe really cost, catch-up included), and a round whose sequences all run their request's own plan does not
    ask it at all (a probe there would be spent on nobody)."""
    from specray.coordinator.cascade import Plan
    from specray.coordinator.scheduler import RoundTimed

    engine = CascadeEngine(levels())

    class Timed:
        def __init__(self) -> None:
            self.asked: list[int] = []
            self.rounds: list[tuple[int, float]] = []
            self.tokens: list[int | None] = []

        def __call__(self, batch: int) -> Plan:
            self.asked.append(batch)
            return Plan((2,), ())

        def on_round(self, batch: int, seconds: float, tokens: int | None = None) -> None:
            self.rounds.append((batch, seconds))
            self.tokens.append(tokens)

    planner = Timed()
    assert isinstance(planner, RoundTimed)
    rounds: list[tuple[int, float]] = []
    sched = Scheduler(engine, max_batch_size=8, planner=planner, on_round=lambda b, sizes, dt: rounds.append((b, dt)))

    async def run(spec):
        out = await collect(sched, Request([1, 2, 3], SamplingParams(), 6, speculation=spec))
        return out

    async def main():
        await run(Speculation("none"))
        overridden = len(rounds)
        await run(None)
        await sched.close()
        return overridden

    overridden = asyncio.run(main())
    assert overridden >= 1 and planner.asked == [1] * (len(rounds) - overridden)
    assert planner.rounds == rounds[overridden:] and all(dt > 0 for _, dt in planner.rounds)
    # the tokens of each round but the first (the prefill's), which says nothing about the plan
    assert planner.tokens[0] is None and all(t == 1 for t in planner.tokens[1:]) and len(planner.tokens) > 2


def test_stop_token_ids_end_the_text_before_the_stop_token(tiny):
    """vLLM's `stop_token_ids`: the completion ends at the first such token, which counts as generated but whose
    text is not part of the output; EOS still stops unless `ignore_eos`; speculation changes nothing."""
    from specray.engine.hf import HFWorker

    target = HFWorker(str(tiny.target_dir), name="t", dtype="float32")
    mid = HFWorker(str(tiny.draft_dirs["mid"]), name="mid", dtype="float32")
    lv = [Level("ngram", ngram=NgramConfig(3, 1, 3)), Level("mid", worker=mid, k=4), Level("t", worker=target)]
    tok = target.tokenizer
    prompt = tok.encode("def fibonacci(n):")
    sched = Scheduler(CascadeEngine(lv), tok)

    async def run(**kw):
        text, toks, last = "", [], None
        async for ev in sched.generate(Request(prompt, SamplingParams(), 30, ignore_eos=True, **kw)):
            text, toks, last = text + ev.text, toks + ev.token_ids, ev
        return text, toks, last

    async def main():
        full = await run()
        stop = full[1][6]
        cut = await run(stop_token_ids=(stop,))
        await sched.close()
        return full, cut, stop

    (_, toks, _), (ctext, ctoks, clast), stop = asyncio.run(main())
    j = toks.index(stop)
    assert ctoks == toks[: j + 1] and clast.finish_reason == "stop" and clast.completion_tokens == j + 1
    assert ctext == tok.decode(toks[:j], skip_special_tokens=True)


class ThreadRecorder(FakeWorker):
    """A FakeWorker that records the OS thread of every call."""

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.threads: set[int] = set()

    def verify(self, *a, **kw):
        self.threads.add(threading.get_ident())
        return super().verify(*a, **kw)

    def propose(self, *a, **kw):
        self.threads.add(threading.get_ident())
        return super().propose(*a, **kw)


def test_every_round_runs_in_one_thread():
    """An in-process worker's OpenMP team belongs to the OS thread that calls it: rounds handed to several threads
    leave teams spinning against each other on the same cores (a CPU engine's steps ran 18% slower on average).
    Requests one after another and side by side, many rounds: every worker call comes from one thread."""
    lv = [Level("draft", worker=ThreadRecorder("draft", vocab=16, order=2, noise=0.6, noise_seed=3), k=2),
          Level("target", worker=ThreadRecorder("target", vocab=16, order=2))]
    sched = Scheduler(CascadeEngine(lv), max_batch_size=4)

    async def main():
        for _ in range(40):
            await asyncio.gather(*[collect(sched, Request(p, SamplingParams(), 40)) for p in PROMPTS[:3]])
        await sched.close()

    asyncio.run(main())
    assert len(lv[0].worker.threads | lv[1].worker.threads) == 1
