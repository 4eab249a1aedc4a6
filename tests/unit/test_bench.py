"""`specray bench`: its options are documented, JSONL errors name the line, the shipped sets load, a tiny run of
two modes at batch 1 and 2 gives a report that validates against the schema, greedy outputs of every mode are
identical (and the check does catch a difference), a missing peer is skipped with its reason, plots are written,
and a run against a real server over HTTP reports the same way."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest

from specray.bench import peers as peers_mod
from specray.bench.cli import add_bench_arguments, run_bench
from specray.bench.report import Cell, build_report, validate
from specray.bench.runner import RequestResult
from specray.bench.workloads import load_prompts, load_workloads, shipped_names, shipped_path
from specray.cli import _Help
from specray.cli import main as cli_main

ROOT = Path(__file__).resolve().parents[2]

ROWS = [
    {"workload": "copy", "prompt": "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):"},
    {"workload": "copy", "prompt": "The river ran quietly past the old mill, and the miller's", "max_tokens": 10},
    {"workload": "chat", "messages": [{"role": "user", "content": "What is the capital of France?"}]},
]


@pytest.fixture
def workload(tmp_path) -> Path:
    path = tmp_path / "mine.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in ROWS) + "\n")
    return path


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(formatter_class=_Help)
    add_bench_arguments(p)
    return p


def _args(*argv: str) -> argparse.Namespace:
    return _parser().parse_args(list(argv))


def _tiny_flags(tiny, workload: Path, *extra: str) -> list[str]:
    return ["--model", str(tiny.target_dir), "--draft", str(tiny.draft_dirs["mid"]), "--dtype", "float32",
            "--backend", "hf",
            "--workload-file", str(workload), "--max-tokens", "12", "--quiet", *extra]


# ------------------------------------------------------------------------------------------ the command line


def test_help_documents_every_option(capsys):
    with pytest.raises(SystemExit) as exc:
        cli_main(["bench", "--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    for action in _parser()._actions:
        if not action.option_strings or action.dest == "help":
            continue
        assert action.help and len(action.help) > 10, f"{action.option_strings} has no help"
        for opt in action.option_strings:
            assert opt in text, f"{opt} missing from `specray bench --help`"
    for name in shipped_names():  # the shipped sets are named in the help
        assert name in text


def test_bad_input_exits_2_with_the_reason(tiny, workload, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n\n{"prompt": "x", "max_tokens": 0}\n')
    assert cli_main(["bench", "--workload-file", str(bad), "--model", str(tiny.target_dir), "--quiet"]) == 2
    assert f"{bad}:3: `max_tokens` must be a positive integer" in capsys.readouterr().err
    assert cli_main(["bench", "--workload", "nope", "--model", "m", "--quiet"]) == 2
    assert "unknown workload 'nope'" in capsys.readouterr().err
    assert cli_main(["bench", "--workload-file", str(workload), "--url", "http://127.0.0.1:9/v1", "--batch", "2",
                     "--quiet"]) == 2
    assert "--concurrency" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------ workloads


@pytest.mark.parametrize(("line", "message"), [
    ("{not json", "not JSON"),
    ('{"prompt": "a", "messages": [{"role": "user", "content": "b"}]}', "exactly one of `prompt`"),
    ('{"max_tokens": 4}', "exactly one of `prompt`"),
    ('["prompt"]', "expected a JSON object"),
    ('{"prompt": 3}', "`prompt` must be a string"),
    ('{"messages": []}', "non-empty list"),
    ('{"messages": [{"role": "user"}]}', "`messages[0]`"),
    ('{"prompt": "a", "max_tokens": "8"}', "`max_tokens` must be a positive integer"),
    ('{"prompt": "a", "max_tokens": true}', "`max_tokens` must be a positive integer"),
    ('{"prompt": "a", "workload": 7}', "`workload` must be a string"),
])
def test_jsonl_errors_name_the_line(tmp_path, line, message):
    path = tmp_path / "w.jsonl"
    path.write_text('{"prompt": "fine"}\n\n' + line + "\n")
    with pytest.raises(ValueError) as exc:
        load_prompts(path)
    assert str(exc.value).startswith(f"{path}:3: ") and message in str(exc.value)


def test_verify_and_bench_share_one_parser(tmp_path):
    import specray.verify_cli as verify

    assert verify.load_prompts is load_prompts
    empty = tmp_path / "e.jsonl"
    empty.write_text("\n\n")
    with pytest.raises(ValueError, match="no prompts"):
        load_prompts(empty)


def test_shipped_sets_load_and_are_package_data():
    assert {"code", "extraction", "chat", "screening"} <= set(shipped_names())
    rows = load_workloads(["code", "extraction", "chat", "screening"])
    assert {r["workload"] for r in rows} == {"code", "extraction", "chat", "screening"}
    for r in rows:
        assert r["max_tokens"] > 0 and r["messages"][0]["content"].strip()
    extraction = [r["messages"][0]["content"] for r in rows if r["workload"] == "extraction"]
    assert all("JOB DESCRIPTION" in t and "CANDIDATE PROFILE" in t for t in extraction)
    screening = [r["messages"][0]["content"] for r in rows if r["workload"] == "screening"]
    assert len(screening) >= 12
    shared = screening[0].split("CANDIDATE PROFILE")[0]  # one job description against many candidates
    assert len(shared) > 500 and all(t.startswith(shared) for t in screening) and len(set(screening)) == len(screening)
    assert '"specray.bench" = ["data/*.jsonl", "schema.json"]' in (ROOT / "pyproject.toml").read_text()
    assert shipped_path("code").parent.name == "data"
    with pytest.raises(ValueError, match="shipped sets are"):
        shipped_path("nope")


def test_a_files_lines_without_a_workload_take_its_stem(workload, tmp_path):
    plain = tmp_path / "plain-set.jsonl"
    plain.write_text('{"prompt": "a"}\n')
    rows = load_workloads(["chat"], [workload, plain])
    assert [r["workload"] for r in rows][-4:] == ["copy", "copy", "chat", "plain-set"]


# ----------------------------------------------------------------------------------------- tiny in-process runs


def test_two_modes_at_batch_1_and_2_report_validates_with_plots(tiny, workload, tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "out"
    assert cli_main(["bench", *_tiny_flags(tiny, workload, "--modes", "none", "cascade", "--batch", "1", "2",
                                           "--out", str(out))]) == 0
    report = json.loads((out / "report.json").read_text())
    validate(report)
    assert report["schema"] == "specray.bench/5" and report["target"]["kind"] == "in_process"
    assert report["settings"]["batches"] == [1, 2] and report["settings"]["workloads"] == {"copy": 2, "chat": 1}
    keys = {(r["workload"], r["batch"], r["name"]) for r in report["results"]}
    assert keys == {(w, b, m) for w in ("copy", "chat") for b in (1, 2) for m in ("none", "cascade")}
    for r in report["results"]:
        assert r["kind"] == "mode" and r["tokens"] > 0 and r["tokens_per_s"] > 0 and r["ttft_s"] > 0
        assert r["requests"] == (2 if r["workload"] == "copy" else max(1, r["batch"]))  # repeats fill a batch
        # each request on its own: the cell's totals are their sums, its mean TTFT their mean
        reqs = r["per_request"]
        assert len(reqs) == r["requests"] and sum(q["tokens"] for q in reqs) == r["tokens"]
        assert r["ttft_s"] == pytest.approx(sum(q["ttft_s"] for q in reqs) / len(reqs))
        assert all(0 < q["ttft_s"] <= q["seconds"] for q in reqs)
        if r["name"] == "none":
            assert r["speedup"] == pytest.approx(1.0) and r["bound"] == 1.0
            continue
        target = list(r["levels"].values())[-1]
        assert list(r["levels"]) == ["mid", "target"]  # model levels are named by their folders
        assert target["num_drafts"] > 0 and len(target["alphas"]) == len(target["accepted_per_pos"]) > 0
        # E[L] from per-position acceptance equals 1 + accepted / drafts: the HTTP report's formula
        assert r["bound"] == pytest.approx(1 + target["accepted_tokens"] / target["num_drafts"])
        assert r["fraction_of_bound"] == pytest.approx(r["speedup"] / r["bound"])
    assert report["outputs_identical"] is True and report["outputs_compared"] == 2 * (2 + 1)
    for name in ("throughput.png", "acceptance.png", "bound.png", "batch.png"):
        png = out / name
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000


def test_greedy_outputs_of_every_mode_are_identical(tiny, workload):
    report = run_bench(_args(*_tiny_flags(tiny, workload, "--batch", "1", "2")))
    validate(report)
    assert set(report["settings"]["modes"]) == {"none", "ngram", "draft", "cascade", "adaptive"}
    assert report["skipped"] == []
    assert report["outputs_identical"] is True, report["mismatches"]
    assert report["outputs_compared"] == 4 * 2 * 3  # 4 modes against none, 2 batch sizes, 3 prompts
    ngram = next(r for r in report["results"] if r["name"] == "ngram" and r["workload"] == "copy")
    assert list(ngram["levels"]) and ngram["levels"][list(ngram["levels"])[-1]]["num_drafts"] > 0


def test_seeded_samples_of_every_mode_are_identical_and_compared(tiny, workload):
    """A seed makes the scheduler verify by the coupled method, whose output depends on (seed, target) alone: every
    mode follows the same sample path at T > 0, and the report checks it (a paired comparison of plans)."""
    report = run_bench(_args(*_tiny_flags(tiny, workload, "--batch", "1", "2", "--temperature", "0.9", "--seed",
                                          "7")))
    validate(report)
    assert report["outputs_identical"] is True, report["mismatches"]
    assert report["outputs_compared"] == 4 * 2 * 3
    drafted = [r for r in report["results"] if r["name"] != "none"]
    assert any(list(r["levels"].values())[-1]["num_drafts"] > 0 for r in drafted)


def test_the_output_check_catches_a_difference():
    def cell(name: str, out: list[int]) -> Cell:
        c = Cell("w", 1, name, "mode")
        c.add(1.0, [RequestResult(0, len(out), 1.0, 0.1, out)])
        return c

    same = build_report([cell("none", [1, 2, 3]), cell("ngram", [1, 2, 3])], target={"kind": "in_process"},
                        settings={}, skipped=[], check_outputs=True, versions={}, created="now")
    assert same["outputs_identical"] is True and same["outputs_compared"] == 1
    diff = build_report([cell("none", [1, 2, 3]), cell("ngram", [1, 5, 3])], target={"kind": "in_process"},
                        settings={}, skipped=[], check_outputs=True, versions={}, created="now")
    assert diff["outputs_identical"] is False
    assert diff["mismatches"] == [{"workload": "w", "batch": 1, "index": 0, "name": "ngram", "reference": "none",
                                   "position": 1}]


def test_a_speculating_peer_gets_its_bound_from_its_own_counts():
    """vLLM's counters give a peer row the same E[L] a mode gets (1 + accepted / drafts, totals only), and its
    fraction of the bound is measured against its own plain loop, not specray's."""
    from specray.coordinator.stats import LevelStats

    def cell(name: str, kind: str, seconds: float, stats: dict | None = None) -> Cell:
        c = Cell("w", 1, name, kind, per_position=kind == "mode")
        c.add(seconds, [RequestResult(0, 12, seconds, 0.1, [1] * 12, stats=stats or {})])
        return c

    ngram = {"m": LevelStats(num_drafts=4, draft_tokens=20, accepted_tokens=6)}
    report = build_report([cell("none", "mode", 3.0), cell("vllm_plain", "peer", 4.0),
                           cell("vllm_ngram", "peer", 2.0, ngram)], target={"kind": "in_process"}, settings={},
                          skipped=[], check_outputs=False, versions={}, created="now")
    rows = {r["name"]: r for r in report["results"]}
    assert rows["vllm_plain"]["bound"] is None and rows["vllm_plain"]["levels"] == {}
    peer = rows["vllm_ngram"]
    assert peer["bound"] == pytest.approx(1 + 6 / 4)
    assert peer["levels"]["m"]["draft_tokens"] == 20 and peer["levels"]["m"]["accepted_per_pos"] is None
    assert peer["fraction_of_bound"] == pytest.approx((4.0 / 2.0) / 2.5)  # 2x its own plain over a bound of 2.5


#: vLLM's n-gram proposer's thread handling (vllm/v1/spec_decode/ngram_proposer.py): numba's count is saved, set
#: for the proposal and restored; then the model's next torch op runs with whatever OpenMP count that left
_NUMBA_PROPOSER = """
import torch
from numba import get_num_threads, njit, prange, set_num_threads, threading_layer
torch.set_num_threads(1)
torch.get_num_threads()  # the model has run: torch has set this thread's OpenMP count
@njit(parallel=True)
def propose(n):
    s = 0
    for i in prange(n):
        s += i
    return s
before = get_num_threads()
set_num_threads(1)
propose(64)
set_num_threads(before)
print(threading_layer(), torch.get_num_threads())
"""


def _after_a_proposal(env: dict[str, str]) -> tuple[str, int]:
    base = {k: v for k, v in os.environ.items() if k not in ("NUMBA_NUM_THREADS", "OMP_NUM_THREADS")}
    out = subprocess.run([sys.executable, "-c", _NUMBA_PROPOSER], env={**base, **env}, capture_output=True,
                         text=True, check=True).stdout.split()
    return out[-2], int(out[-1])


def test_a_one_thread_vllm_peer_stays_on_one_thread_after_its_ngram_proposals():
    """A 1-thread vLLM n-gram peer computed on every core once its proposer had run (numba's OpenMP layer shares
    the runtime with torch): the peer's environment holds numba to the peer's threads."""
    pytest.importorskip("numba")
    layer, threads = _after_a_proposal(peers_mod.thread_env(1))
    assert threads == 1
    if layer == "omp" and (os.cpu_count() or 1) > 1:  # the hazard the environment guards against, where it exists
        assert _after_a_proposal({"VLLM_CPU_OMP_THREADS_BIND": "0"})[1] == os.cpu_count()


def test_a_report_off_the_schema_fails_validation(tiny, workload):
    report = run_bench(_args(*_tiny_flags(tiny, workload, "--modes", "none", "--no-warmup")))
    validate(report)
    broken = json.loads(json.dumps(report))
    broken["results"][0]["tokens_per_s"] = "fast"
    with pytest.raises(jsonschema.ValidationError):
        validate(broken)
    del broken["results"][0]["tokens_per_s"]
    with pytest.raises(jsonschema.ValidationError):
        validate(broken)


def test_missing_peers_are_skipped_with_the_reason(tiny, workload, monkeypatch):
    monkeypatch.setattr(peers_mod, "installed", lambda module: module != "vllm")
    args = _args("--model", str(tiny.target_dir), "--dtype", "float32", "--backend", "hf", "--workload-file",
                 str(workload),
                 "--max-tokens", "8", "--quiet", "--modes", "none", "ngram", "draft",
                 "--peers", "hf_plain", "hf_lookup", "hf_assisted", "vllm_plain", "vllm_draft")
    report = run_bench(args)
    validate(report)
    reasons = {s["name"]: s["reason"] for s in report["skipped"]}
    assert "no draft model" in reasons["draft"]
    assert "no draft model" in reasons["hf_assisted"]
    assert "vllm is not installed" in reasons["vllm_plain"] and "vllm is not installed" in reasons["vllm_draft"]
    assert set(reasons) == {"draft", "hf_assisted", "vllm_plain", "vllm_draft"}
    peers = {(r["workload"], r["name"]): r for r in report["results"] if r["kind"] == "peer"}
    assert set(peers) == {(w, p) for w in ("copy", "chat") for p in ("hf_plain", "hf_lookup")}
    for r in peers.values():
        assert r["tokens"] > 0 and r["speedup"] is not None and r["bound"] is None
    assert peers[("copy", "hf_plain")]["speedup_vs_own_plain"] == pytest.approx(1.0)
    # hf peers at batch 1 only
    report = run_bench(_args(*_tiny_flags(tiny, workload, "--modes", "none", "--batch", "2", "--no-warmup",
                                          "--peers", "hf_plain")))
    assert report["skipped"] == [{"name": "hf_plain", "reason": "hf peers run at batch 1 only: add 1 to --batch"}]


def test_vllm_peers_run_at_every_batch_size_on_the_modes_chunks(tiny, workload, monkeypatch):
    """A vLLM peer gets the same chunks of B requests as the modes, B per generate call, for each --batch."""
    from specray.bench.runner import Chunk

    monkeypatch.setattr(peers_mod, "installed", lambda module: True)
    calls = []

    def fake_run_vllm(peer, model, rows, *, batch=1, **kw):
        calls.append((peer, len(rows), batch))
        return Chunk(0.5, [RequestResult(i, 4, 0.5, 0.1, [1, 2, 3, 4]) for i, _, _ in rows])

    monkeypatch.setattr(peers_mod, "run_vllm", fake_run_vllm)
    report = run_bench(_args(*_tiny_flags(tiny, workload, "--modes", "none", "--batch", "1", "3", "--no-warmup",
                                          "--peers", "vllm_plain")))
    validate(report)
    n: dict[str, int] = {}
    for row in load_workloads(files=[str(workload)]):
        n[row["workload"]] = n.get(row["workload"], 0) + 1
    # a workload smaller than the batch repeats to fill it; the last chunk may be short
    assert sorted(calls) == sorted(("vllm_plain", max(k, b), b) for k in n.values() for b in (1, 3))
    cells = {(r["workload"], r["batch"]) for r in report["results"] if r["name"] == "vllm_plain"}
    assert cells == {(w, b) for w in n for b in (1, 3)}



def test_several_peer_thread_counts_run_each_vllm_peer_once_per_count(tiny, workload, monkeypatch):
    """--peer-threads 1 2: each vLLM peer runs once per count, named PEER@Nt, and its speedup over its own plain loop
    is against the plain loop on the same threads."""
    from specray.bench.runner import Chunk

    monkeypatch.setattr(peers_mod, "installed", lambda module: True)
    calls = []

    def fake_run_vllm(peer, model, rows, *, batch=1, threads=2, **kw):
        calls.append((peer, threads))
        seconds = {("vllm_plain", 1): 2.0, ("vllm_plain", 2): 1.0, ("vllm_ngram", 1): 1.0, ("vllm_ngram", 2): 0.25}
        s = seconds[(peer, threads)]
        return Chunk(s, [RequestResult(i, 4, s, 0.1, [1, 2, 3, 4]) for i, _, _ in rows])

    monkeypatch.setattr(peers_mod, "run_vllm", fake_run_vllm)
    report = run_bench(_args(*_tiny_flags(tiny, workload, "--modes", "none", "--no-warmup",
                                          "--peers", "vllm_plain", "vllm_ngram", "--peer-threads", "1", "2")))
    validate(report)
    assert set(calls) == {(p, t) for p in ("vllm_plain", "vllm_ngram") for t in (1, 2)}
    assert report["settings"]["peer_threads"] == [1, 2]
    assert report["settings"]["peers"] == ["vllm_plain@1t", "vllm_plain@2t", "vllm_ngram@1t", "vllm_ngram@2t"]
    peers = {(r["workload"], r["name"]): r for r in report["results"] if r["kind"] == "peer"}
    workloads = {w for w, _ in peers}
    assert set(peers) == {(w, f"{p}@{t}t") for w in workloads for p in ("vllm_plain", "vllm_ngram") for t in (1, 2)}
    for w in workloads:
        assert peers[(w, "vllm_ngram@1t")]["speedup_vs_own_plain"] == pytest.approx(2.0)
        assert peers[(w, "vllm_ngram@2t")]["speedup_vs_own_plain"] == pytest.approx(4.0)

def test_requests_run_a_closed_loop_of_n_requests_at_most_b_in_flight(tiny, workload, monkeypatch):
    """--requests N: each pass is one chunk of N requests (the workload's, repeated in order), at most B of them in
    the scheduler at once, each timed from its admission; greedy outputs still equal plain decoding's, and a vLLM
    peer gets all N in one call with the batch as its engine's limit."""
    from specray.bench.runner import Chunk

    monkeypatch.setattr(peers_mod, "installed", lambda module: True)
    calls = []

    def fake_run_vllm(peer, model, rows, *, batch=1, closed_loop=False, **kw):
        calls.append((len(rows), batch, closed_loop))
        return Chunk(0.5, [RequestResult(i, 4, 0.5, 0.1, [1, 2, 3, 4]) for i, _, _ in rows])

    monkeypatch.setattr(peers_mod, "run_vllm", fake_run_vllm)
    running, peak = [0], [0]

    def counting(sched_cls):
        class Counting(sched_cls):
            async def generate(self, req):
                running[0] += 1
                peak[0] = max(peak[0], running[0])
                try:
                    async for ev in super().generate(req):
                        yield ev
                finally:
                    running[0] -= 1
        return Counting

    import specray.coordinator.scheduler as sched_mod
    monkeypatch.setattr(sched_mod, "Scheduler", counting(sched_mod.Scheduler))
    report = run_bench(_args(*_tiny_flags(tiny, workload, "--modes", "none", "cascade", "--batch", "2",
                                          "--requests", "5", "--no-warmup", "--peers", "vllm_plain")))
    validate(report)
    assert report["settings"]["requests"] == 5
    modes = [r for r in report["results"] if r["kind"] == "mode"]
    assert {(r["workload"], r["name"]) for r in modes} == {(w, m) for w in ("copy", "chat")
                                                           for m in ("none", "cascade")}
    assert all(r["requests"] == 5 and len(r["per_request"]) == 5 for r in modes)
    assert peak[0] == 2  # never more than the batch in flight, and the slots were used
    assert report["outputs_identical"] is True and report["outputs_compared"] == 3  # by prompt: 2 copy, 1 chat
    assert sorted(calls) == [(5, 2, True), (5, 2, True)]


def test_requests_over_http_hold_at_most_c_streams_open():
    """Over HTTP the closed loop's cap is the client's: at most C streams open at once, in the order given."""
    import asyncio

    from specray.bench.runner import HTTPTarget
    from specray.spec.params import SamplingParams

    opened, peak, order = [0], [0], []

    class Stream:
        def __init__(self, text):
            self.text, self.sent = text, False

        def __aiter__(self):
            return self

        async def __anext__(self):
            if self.sent:
                opened[0] -= 1
                raise StopAsyncIteration
            self.sent = True
            await asyncio.sleep(0.01)
            delta = argparse.Namespace(content=self.text)
            return argparse.Namespace(choices=[argparse.Namespace(delta=delta)], usage=None)

    class Completions:
        async def create(self, messages, **kw):
            opened[0] += 1
            peak[0] = max(peak[0], opened[0])
            order.append(messages[0]["content"])
            return Stream(messages[0]["content"])

    class Client:
        def __init__(self, **kw):
            self.chat = argparse.Namespace(completions=Completions())

        async def __aenter__(self):
            return self

        async def __aexit__(self, *exc):
            return False

    target = HTTPTarget.__new__(HTTPTarget)
    target._openai, target._args = argparse.Namespace(AsyncOpenAI=Client), {}
    target.sampling, target.model = SamplingParams(0.0), "m"
    rows = [(i, {"messages": [{"role": "user", "content": f"q{i}"}]}) for i in range(7)]
    chunk = target.run("none", rows, 3, 4)
    assert peak[0] == 3 and order == [f"q{i}" for i in range(7)]
    assert [r.output for r in chunk.requests] == [f"q{i}" for i in range(7)]


def test_samples_send_each_workloads_requests_over_again_each_a_path_of_its_own(tiny, workload, monkeypatch):
    """--samples N at T > 0: each workload's requests N times over, in file order per pass, for every mode and peer;
    a vLLM peer seeds each request by its index, so every sample of a prompt gets a seed of its own."""
    from specray.bench.runner import Chunk

    monkeypatch.setattr(peers_mod, "installed", lambda module: True)
    seen = []

    def fake_run_vllm(peer, model, rows, *, batch=1, temperature=0.0, **kw):
        seen.append([(i, tuple(ids)) for i, ids, _ in rows])
        return Chunk(0.5, [RequestResult(i, 4, 0.5, 0.1, [1, 2, 3, 4]) for i, _, _ in rows])

    monkeypatch.setattr(peers_mod, "run_vllm", fake_run_vllm)
    report = run_bench(_args(*_tiny_flags(tiny, workload, "--modes", "none", "ngram", "--no-warmup", "--temperature",
                                          "0.8", "--samples", "3", "--peers", "vllm_plain")))
    validate(report)
    n: dict[str, int] = {}
    for row in load_workloads(files=[str(workload)]):
        n[row["workload"]] = n.get(row["workload"], 0) + 1
    assert report["settings"]["samples"] == 3 and report["settings"]["workloads"] == {w: 3 * k for w, k in n.items()}
    for r in report["results"]:
        assert r["requests"] == 3 * n[r["workload"]]
    for rows in seen:  # one call per workload: its requests three times over, each with an index of its own
        k = len(rows) // 3
        assert len({i for i, _ in rows}) == len(rows)
        assert [ids for _, ids in rows] == [ids for _, ids in rows[:k]] * 3


@pytest.mark.parametrize(("extra", "message"), [
    (["--samples", "2"], "--samples needs --temperature > 0"),
    (["--samples", "2", "--temperature", "0.7", "--seed", "3"], "the same seed"),
    (["--samples", "0", "--temperature", "0.7"], "--samples must be at least 1"),
])
def test_samples_refuses_what_would_repeat_one_path(tiny, workload, extra, message):
    with pytest.raises(ValueError, match=message):
        run_bench(_args(*_tiny_flags(tiny, workload, "--modes", "none", "--no-warmup", *extra)))


@pytest.mark.parametrize("temperature", ["0", "0.8"])
def test_repeat_runs_every_pass_again_in_reverse_order_and_sums_them(tiny, workload, monkeypatch, temperature):
    """--repeat 2: the modes' and peers' passes over each workload twice, the second time peers first and modes
    backwards (drift then hits every side alike); the report sums both. At T > 0 a vLLM peer's second pass seeds
    its requests anew (its seed is the request's index), and the report keeps the workload's own indices."""
    from specray.bench.runner import Chunk, InProcessTarget

    monkeypatch.setattr(peers_mod, "installed", lambda module: True)
    calls: list[tuple[str, str, tuple[int, ...]]] = []
    run_mode = InProcessTarget.run

    def spy_mode(self, mode, rows, batch, max_tokens):
        calls.append(("mode", mode, tuple(i for i, _ in rows)))
        return run_mode(self, mode, rows, batch, max_tokens)

    def fake_run_vllm(peer, model, rows, *, batch=1, temperature=0.0, **kw):
        calls.append(("peer", peer, tuple(i for i, _, _ in rows)))
        return Chunk(0.5, [RequestResult(i, 4, 0.5, 0.1, [1, 2, 3, 4]) for i, _, _ in rows])

    monkeypatch.setattr(InProcessTarget, "run", spy_mode)
    monkeypatch.setattr(peers_mod, "run_vllm", fake_run_vllm)
    report = run_bench(_args(*_tiny_flags(tiny, workload, "--modes", "none", "ngram", "--no-warmup", "--temperature",
                                          temperature, "--repeat", "2", "--peers", "vllm_plain", "vllm_ngram")))
    validate(report)
    assert report["settings"]["repeat"] == 2
    n: dict[str, int] = {}
    for row in load_workloads(files=[str(workload)]):
        n[row["workload"]] = n.get(row["workload"], 0) + 1
    for r in report["results"]:  # both passes in every cell
        assert r["requests"] == 2 * n[r["workload"]]
    expected = []
    for rep in range(2):
        for k in n.values():  # workloads in file order; batch 1: one mode call per request, one peer call
            modes = [("mode", m, (i,)) for m in ("none", "ngram") for i in range(k)]
            shift = rep * k if temperature != "0" else 0
            peers = [("peer", p, tuple(range(shift, shift + k))) for p in ("vllm_plain", "vllm_ngram")]
            if rep == 0:
                expected += modes + peers
            else:
                expected += peers[::-1] + [("mode", m, (i,)) for m in ("ngram", "none") for i in range(k)]
    assert calls == expected
    for r in report["results"]:  # the peers' results keep the workload's own indices
        assert r["requests"] == 2 * n[r["workload"]]


def test_without_matplotlib_the_report_is_written_and_plots_skipped(tiny, workload, tmp_path, monkeypatch, capsys):
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    out = tmp_path / "out"
    assert cli_main(["bench", *_tiny_flags(tiny, workload, "--modes", "none", "--no-warmup", "--out",
                                           str(out))]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["report.json"]
    assert "matplotlib is not installed" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------ a server over HTTP


def test_against_a_running_server_over_http(tiny, workload):
    pytest.importorskip("openai")
    from specray.serve.replica import Coordinator
    from tests.e2e.conftest import Server, app_config

    srv = Server(Coordinator(app_config(tiny)))
    try:
        args = _args("--url", srv.url + "/v1", "--workload-file", str(workload), "--max-tokens", "10", "--quiet",
                     "--modes", "none", "cascade", "adaptive", "--concurrency", "1", "2", "--peers", "hf_plain")
        report = run_bench(args)
    finally:
        srv.stop()
    validate(report)
    # each mode's pass started with the server's prefix caches reset (POST /reset_prefix_cache)
    assert report["target"] == {"kind": "http", "url": srv.url + "/v1", "model": "tiny-cascade",
                                "prefix_cache_reset": True}
    assert report["settings"]["batch_kind"] == "concurrency"
    assert [s["name"] for s in report["skipped"]] == ["hf_plain"]
    assert report["outputs_identical"] is True and report["outputs_compared"] == 2 * 2 * 3
    cascade = [r for r in report["results"] if r["name"] == "cascade"]
    assert len(cascade) == 4
    for r in cascade:
        target = r["levels"]["target"]
        assert target["num_drafts"] > 0 and target["accepted_per_pos"] is None and target["alphas"] is None
        assert r["bound"] == pytest.approx(1 + target["accepted_tokens"] / target["num_drafts"])
        assert r["ttft_s"] > 0 and r["tokens"] > 0


def test_vllm_peers_beside_a_running_server_run_the_named_model(tiny, workload, monkeypatch):
    """Against --url the vllm_* peers run the model --model names (the served target's), on the same prompts
    tokenized with its chat template, C requests per generate call at concurrency C; without --model they are
    skipped with the reason, and the hf peers always are (they need the in-process target's loaded models)."""
    pytest.importorskip("openai")
    from specray.bench.runner import Chunk
    from specray.bench.workloads import prompt_ids
    from specray.engine.models import load_tokenizer
    from specray.serve.replica import Coordinator
    from tests.e2e.conftest import Server, app_config

    monkeypatch.setattr(peers_mod, "installed", lambda module: True)
    calls = []

    def fake_run_vllm(peer, model, rows, *, batch=1, dtype=None, **kw):
        calls.append((peer, model, dtype, batch, [ids for _, ids, _ in rows]))
        return Chunk(0.5, [RequestResult(i, 4, 0.5, 0.1, [1, 2, 3, 4]) for i, _, _ in rows])

    monkeypatch.setattr(peers_mod, "run_vllm", fake_run_vllm)
    srv = Server(Coordinator(app_config(tiny)))
    try:
        common = ["--url", srv.url + "/v1", "--workload-file", str(workload), "--max-tokens", "6", "--quiet",
                  "--modes", "none", "--no-warmup"]
        report = run_bench(_args(*common, "--concurrency", "1", "2", "--model", str(tiny.target_dir), "--dtype",
                                 "float32", "--peers", "vllm_plain", "hf_plain"))
        unnamed = run_bench(_args(*common, "--peers", "vllm_ngram"))
    finally:
        srv.stop()
    validate(report)
    reasons = {s["name"]: s["reason"] for s in report["skipped"]}
    assert set(reasons) == {"hf_plain"} and "in-process" in reasons["hf_plain"]
    tok = load_tokenizer(str(tiny.target_dir))
    by_workload: dict[str, list] = {}
    for row in load_workloads(files=[str(workload)]):
        by_workload.setdefault(row["workload"], []).append(prompt_ids(tok, row))
    assert len(calls) == 2 * len(by_workload)
    for peer, model, dtype, batch, ids in calls:
        assert (peer, model, dtype) == ("vllm_plain", str(tiny.target_dir), "float32")
        assert len(ids) >= batch  # a workload smaller than the batch repeats its rows to fill it
        assert any(ids[: len(rows)] == rows for rows in by_workload.values())
    assert sorted(c[3] for c in calls) == sorted([1, 2] * len(by_workload))
    assert {(r["workload"], r["batch"]) for r in report["results"] if r["name"] == "vllm_plain"} == {
        (w, b) for w in by_workload for b in (1, 2)}
    assert [s["name"] for s in unnamed["skipped"]] == ["vllm_ngram"]
    assert "--model" in unnamed["skipped"][0]["reason"]


def test_a_serve_config_file_gives_the_cascade_and_the_planners_policy(tiny, workload, tmp_path):
    import yaml

    trace = tmp_path / "trace.jsonl"

    cascade = {"levels": [
        {"kind": "ngram", "num_speculative_tokens": 3},
        {"kind": "hf", "model": str(tiny.draft_dirs["mid"]), "name": "mid", "dtype": "float32",
         "num_speculative_tokens": 4},
        {"kind": "hf", "model": str(tiny.target_dir), "name": "target", "dtype": "float32"},
    ]}
    serve = tmp_path / "serve.yaml"
    serve.write_text(yaml.safe_dump({"applications": [{"name": "specray", "import_path": "specray.serve.app:build_app",
                                                       "args": {"config": {"cascade": cascade,
                                                                           "policy": {"k_max": 3,
                                                                                      "trace_file": str(trace)}}}}]}))
    bare = tmp_path / "cascade.yaml"
    bare.write_text(yaml.safe_dump(cascade))
    traced = 0
    for path in (serve, bare):
        report = run_bench(_args("--config", str(path), "--workload-file", str(workload), "--max-tokens", "8",
                                 "--quiet", "--no-warmup", "--modes", "none", "ngram", "adaptive"))
        validate(report)
        assert report["target"]["levels"] == ["ngram", "mid", "target"]
        assert report["outputs_identical"] is True and report["skipped"] == []
        if path == serve:  # its policy's trace file got the adaptive pass's rounds, as a server's planner writes them
            rounds = [json.loads(line) for line in trace.read_text().splitlines()]
            traced = len(rounds)
            assert traced and {"batch", "plan", "reason"} <= set(rounds[0])
        else:
            assert len(trace.read_text().splitlines()) == traced
    bad = tmp_path / "bad.yaml"
    bad.write_text("- a list\n")
    assert cli_main(["bench", "--config", str(bad), "--workload-file", str(workload), "--quiet"]) == 2


@pytest.mark.slow  # a vLLM engine start in a fresh process (~30-80 s here)
def test_vllm_peer_child_batches_rows_and_greedy_does_not_depend_on_the_batch(rep_target):
    """The real vLLM child (a fresh process): rows go B per generate call; the same prompt greedy-decoded inside a
    batch of 2 and alone gives the same tokens."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(rep_target))
    a, b = tok.encode("def fibonacci(n):"), tok.encode("The river ran quietly past")
    res = peers_mod.run_vllm("vllm_plain", str(rep_target), [(0, a, 10), (1, b, 10), (2, a, 10)], threads=1,
                             dtype="float32", batch=2)
    by_index = {r.index: r for r in res.requests}
    assert sorted(by_index) == [0, 1, 2] and all(r.tokens == 10 for r in res.requests)
    assert by_index[0].output == by_index[2].output  # batch of 2 vs alone
    assert by_index[0].seconds == by_index[1].seconds  # one generate call: one wall time for the chunk
    assert res.seconds == pytest.approx(by_index[0].seconds + by_index[2].seconds)
    assert all(r.stats == {} for r in res.requests)  # plain: no speculation counts


@pytest.mark.slow  # a vLLM engine start in a fresh process (~30-80 s here)
def test_vllm_peer_child_runs_a_closed_loop_in_one_call(rep_target):
    """closed_loop: every row in one generate call (one wall time), at most `batch` running; the same greedy tokens."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(rep_target))
    a, b = tok.encode("def fibonacci(n):"), tok.encode("The river ran quietly past")
    rows = [(0, a, 10), (1, b, 10), (2, a, 10)]
    res = peers_mod.run_vllm("vllm_plain", str(rep_target), rows, threads=1, dtype="float32", batch=2,
                             closed_loop=True)
    by_index = {r.index: r for r in res.requests}
    assert sorted(by_index) == [0, 1, 2] and all(r.tokens == 10 for r in res.requests)
    assert by_index[0].output == by_index[2].output
    assert {r.seconds for r in res.requests} == {res.seconds}


@pytest.mark.slow  # a vLLM engine start in a fresh process (~30-80 s here)
def test_a_vllm_peer_kept_up_answers_run_after_run_as_a_fresh_one_does(rep_target):
    """`VllmPeer` (what bench_serve interleaves with the app's requests): one engine, several runs, the same greedy
    tokens as a fresh engine's single run; it says why when its engine cannot start, and ends with its block."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(rep_target))
    a, b = tok.encode("def fibonacci(n):"), tok.encode("The river ran quietly past")
    fresh = peers_mod.run_vllm("vllm_plain", str(rep_target), [(0, a, 10), (1, b, 10)], threads=1, dtype="float32")
    with peers_mod.VllmPeer("vllm_plain", str(rep_target), threads=1, dtype="float32") as engine:
        first, second = engine.run([(0, a, 10)]), engine.run([(1, b, 10)])
        again = engine.run([(0, a, 10)])
        emptied = engine.run([(0, a, 10)], reset_cache=True)  # its prefix cache emptied first: the same tokens
        proc = engine._proc
    assert proc.poll() is not None  # the process ended with the block
    assert [r.output for r in fresh.requests] == [first.requests[0].output, second.requests[0].output]
    assert again.requests[0].output == first.requests[0].output and again.requests[0].index == 0
    assert emptied.requests[0].output == first.requests[0].output
    assert all(r.tokens == 10 and r.seconds > 0 for c in (first, second) for r in c.requests)
    with pytest.raises(RuntimeError, match="vllm_plain: the vLLM process exited with code"):
        peers_mod.VllmPeer("vllm_plain", str(rep_target.parent / "no-such-model"), threads=1, dtype="float32")


@pytest.mark.slow  # a vLLM engine start in a fresh process (~30-80 s here)
def test_vllm_ngram_peer_reports_its_own_draft_and_accept_counts(rep_target):
    """The n-gram peer reads vLLM's own spec-decode counters around each generate call: a text that repeats
    itself gets drafts that accept; a chunk's counts go to its first row only (a report sums its rows)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(rep_target))
    a = tok.encode("def fibonacci(n):")
    res = peers_mod.run_vllm("vllm_ngram", str(rep_target), [(0, a, 24), (1, a, 24)], threads=1, dtype="float32",
                             batch=2)
    first, second = sorted(res.requests, key=lambda r: r.index)
    (name, st), = first.stats.items()
    assert name == rep_target.name
    assert st.num_drafts > 0 and 0 < st.accepted_tokens <= st.draft_tokens <= 5 * st.num_drafts
    assert second.stats[name].num_drafts == 0
