"""The SLA experiment (specray/bench/sla.py): the arrivals are a seeded Poisson process, the metric maths on
synthetic timings, and a short real run against the tiny-model HTTP server (tests/e2e/conftest.py)."""

from __future__ import annotations

import json
import math
import random
from collections import Counter

import numpy as np
import pytest

from specray.bench.sla import SlaConfig, main, openai_base
from specray.bench.sla_stats import (
    MODES,
    RequestRecord,
    best_under_ceiling,
    default_ceiling,
    headline,
    percentile,
    poisson_arrivals,
    summarize,
    tpot,
)
from specray.cli import main as cli_main
from specray.testing.goodness import chi2_crit, chi2_stat
from tests.e2e.conftest import free_port

# ------------------------------------------------------------------------------------------ arrivals are Poisson


def _gaps(times: list[float]) -> list[float]:
    return [b - a for a, b in zip([0.0, *times], times)]


def _exponential_fit(gaps: list[float], rate: float) -> tuple[float, float, float, int]:
    """(KS statistic, its 1e-4 critical value, chi-square statistic, its dof) of `gaps` against Exp(rate)."""
    n = len(gaps)
    cdf = sorted(1 - math.exp(-rate * g) for g in gaps)
    d = max(max((i + 1) / n - f, f - i / n) for i, f in enumerate(cdf))
    crit = math.sqrt(-math.log(1e-4 / 2) / 2) / math.sqrt(n)  # Kolmogorov's asymptotic quantile
    bins = 20  # equal-probability cells of the exponential
    counts = Counter(min(int(f * bins), bins - 1) for f in cdf)
    stat, dof = chi2_stat(counts, {b: 1 / bins for b in range(bins)}, n)
    return d, crit, stat, dof


@pytest.mark.parametrize("rate", [0.5, 4.0])
def test_arrivals_are_a_poisson_process(rate):
    duration = 4000 / rate  # ~4000 arrivals
    times = poisson_arrivals(rate, duration, random.Random(7))
    n = len(times)
    assert times == sorted(times) and times[0] > 0 and times[-1] < duration
    assert abs(n - rate * duration) < 4 * math.sqrt(rate * duration)  # the count is Poisson(rate * duration)
    gaps = _gaps(times)
    assert abs(np.mean(gaps) - 1 / rate) < 4 * (1 / rate) / math.sqrt(n)  # exponential: sd = mean
    d, crit, stat, dof = _exponential_fit(gaps, rate)
    assert d < crit, f"KS {d:.4f} >= {crit:.4f}: inter-arrival times are not exponential"
    assert stat < chi2_crit(dof), f"chi-square {stat:.1f} over {dof} dof"


def test_the_fit_checks_reject_non_exponential_gaps():
    """The checks above can fail: evenly spread and uniform gaps with the right mean are rejected."""
    rate, n = 2.0, 4000
    rng = random.Random(3)
    for gaps in ([1 / rate] * n, [rng.uniform(0, 2 / rate) for _ in range(n)]):
        assert abs(np.mean(gaps) - 1 / rate) < 0.05
        d, crit, stat, dof = _exponential_fit(gaps, rate)
        assert d > crit and stat > chi2_crit(dof)


def test_arrivals_are_seeded_and_shared_by_both_modes():
    assert poisson_arrivals(2, 100, random.Random(1)) == poisson_arrivals(2, 100, random.Random(1))
    assert poisson_arrivals(2, 100, random.Random(1)) != poisson_arrivals(2, 100, random.Random(2))
    cfg = SlaConfig(url="http://x", rows=[{"prompt": "a"}, {"prompt": "b"}], rates=[1, 2], duration_s=50, seed=5)
    assert cfg.schedule(1) == cfg.schedule(1)  # each mode of a rate gets the same arrivals and prompts
    assert cfg.schedule(1) != cfg.schedule(2)
    assert SlaConfig(**{**vars(cfg), "seed": 6}).schedule(1) != cfg.schedule(1)
    with pytest.raises(ValueError, match="rate"):
        poisson_arrivals(0, 10, random.Random(0))
    with pytest.raises(ValueError, match="warmup_s"):
        SlaConfig(url="http://x", rows=[{"prompt": "a"}], rates=[1], duration_s=5, warmup_s=5)


# ------------------------------------------------------------------------------------------------ metric maths


def test_specray_bench_sla_help_documents_every_option(capsys):
    import argparse

    from specray.bench.sla import add_sla_arguments

    with pytest.raises(SystemExit) as exc:
        cli_main(["bench", "sla", "--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    parser = argparse.ArgumentParser()
    add_sla_arguments(parser)
    for action in parser._actions:
        if action.option_strings and action.dest != "help":
            assert action.help and len(action.help) > 10, f"{action.option_strings} has no help"
            assert all(opt in text for opt in action.option_strings)
    assert "(default: 60.0)" in text  # --duration-s


def test_bad_input_is_exit_code_2_naming_it(capsys):
    assert main(["--url", "http://127.0.0.1:9", "--workload", "nope"]) == 2
    assert "unknown workload 'nope'" in capsys.readouterr().err
    assert main(["--url", "http://127.0.0.1:9", "--duration-s", "5", "--warmup-s", "5"]) == 2
    assert "warmup_s" in capsys.readouterr().err
    assert openai_base("http://h:1") == openai_base("http://h:1/v1/") == "http://h:1/v1"
    assert main(["--url", f"http://127.0.0.1:{free_port()}", "--quiet"]) == 1  # nothing listens there
    assert "/v1/models: APIConnectionError" in capsys.readouterr().err


def test_tpot_is_over_the_decode_window():
    assert tpot(2.0, 0.5, 11) == pytest.approx(0.15)
    assert tpot(2.0, 0.5, 1) is None and tpot(None, 0.5, 5) is None and tpot(2.0, None, 5) is None


def test_bursty_streams_time_each_token_once():
    """A speculative stream of 4 chunks of 5 tokens, 0.1 s apart after a 0.3 s first chunk: the decode window is
    0.3 s for 19 tokens, where the gaps between chunks (0.1 s) would claim 5x too much per token."""
    rec = RequestRecord(rate=1, mode="speculation", index=0, arrival_s=0, ttft_s=0.3, e2e_s=0.6, output_tokens=20,
                        chunks=4)
    assert rec.tpot_s == pytest.approx(0.3 / 19)
    point = summarize([rec], 1, "speculation", 10)
    assert point["tpot_mean_s"] == pytest.approx(0.3 / 19)
    assert point["tokens_per_chunk"] == 5


def test_percentile_is_linear_interpolation():
    xs = list(range(1, 11))
    assert percentile(xs, 90) == pytest.approx(9.1)
    assert percentile(xs, 50) == pytest.approx(5.5)
    assert percentile([3.0], 99) == 3.0 and percentile([], 50) is None
    rng = np.random.default_rng(0)
    for n in (2, 7, 101):
        ys = rng.exponential(size=n).tolist()
        for q in (0, 50, 90, 99, 100):
            assert percentile(ys, q) == pytest.approx(np.percentile(ys, q))


def test_summarize_drops_warmup_and_counts_errors():
    recs = [
        RequestRecord(1, "plain", 0, arrival_s=0.1, sent_s=0.1, warmup=True, ttft_s=9, e2e_s=99, output_tokens=999),
        RequestRecord(1, "plain", 1, arrival_s=2.0, sent_s=2.0, ttft_s=0.2, e2e_s=1.0, output_tokens=10, chunks=10),
        RequestRecord(1, "plain", 2, arrival_s=3.0, sent_s=3.0, ttft_s=0.4, e2e_s=2.0, output_tokens=30, chunks=30),
        RequestRecord(1, "plain", 3, arrival_s=4.0, sent_s=4.0, error="APIError: boom"),
    ]
    p = summarize(recs, 1.0, "plain", 8.0)
    assert (p["requests"], p["completed"], p["errors"]) == (3, 2, 1)
    assert p["window_s"] == pytest.approx(3.0)  # first measured send 2.0 to last completion 5.0
    assert p["throughput_tok_s"] == pytest.approx(40 / 3) and p["throughput_req_s"] == pytest.approx(2 / 3)
    assert p["arrival_rps"] == pytest.approx(3 / 8)
    assert p["e2e_p90_s"] == pytest.approx(1.9) and p["ttft_p90_s"] == pytest.approx(0.38)
    assert p["tpot_mean_s"] == pytest.approx((0.8 / 9 + 1.6 / 29) / 2)
    assert p["draft_tokens"] == 0 and p["target_acceptance"] is None


def _pt(rate, mode, tok_s, p90, errors=0):
    return {"rate": rate, "mode": mode, "completed": 10, "errors": errors, "throughput_tok_s": tok_s,
            "throughput_req_s": tok_s / 50, "e2e_p90_s": p90, "ttft_p90_s": p90 / 4, "tpot_mean_s": 0.05}


def test_ceiling_search_takes_the_best_throughput_under_the_ceiling():
    points = [
        _pt(0.2, "plain", 10, 2.0), _pt(0.5, "plain", 25, 3.0), _pt(1, "plain", 30, 6.0),
        _pt(0.2, "speculation", 10, 1.0), _pt(0.5, "speculation", 25, 1.5), _pt(1, "speculation", 50, 4.0),
        _pt(2, "speculation", 70, 3.9, errors=1),  # a failed request disqualifies the point
    ]
    assert default_ceiling(points) == pytest.approx(4.0)  # 2 x plain's P90 at the lowest rate
    assert best_under_ceiling(points, "speculation", 4.0)["rate"] == 1  # at the ceiling counts
    assert best_under_ceiling(points, "plain", 4.0)["rate"] == 0.5
    assert best_under_ceiling(points, "plain", 1.0) is None
    h = headline(points, 4.0)
    assert h["throughput_ratio"] == pytest.approx(2.0)
    assert not h["plain"]["at_highest_rate"] and not h["speculation"]["at_highest_rate"]
    assert headline(points, 10.0)["plain"]["at_highest_rate"]
    assert h["speculation"]["throughput_tok_s"] == 50 and h["plain"]["e2e_p90_s"] == 3.0
    assert headline(points, 1.0)["throughput_ratio"] is None
    assert default_ceiling([p for p in points if p["mode"] == "speculation"]) == pytest.approx(2.0)


# --------------------------------------------------------------------------------------------------- a real run

POINT_FIELDS = {"rate", "mode", "requests", "completed", "errors", "arrival_rps", "window_s", "throughput_tok_s",
                "throughput_req_s", "output_tokens", "mean_output_tokens", "e2e_p50_s", "e2e_p90_s", "e2e_p99_s",
                "ttft_p50_s", "ttft_p90_s", "tpot_mean_s", "tpot_p90_s", "tokens_per_chunk", "draft_tokens",
                "target_acceptance"}
REQUEST_FIELDS = {"rate", "mode", "index", "arrival_s", "sent_s", "warmup", "ttft_s", "e2e_s", "output_tokens",
                  "chunks", "draft_tokens", "accepted_tokens", "error", "tpot_s"}


def test_a_short_run_against_the_tiny_server(server, tmp_path):
    rows = [
        {"workload": "copy", "messages": [{"role": "user", "content": "The river ran quietly past the old mill."}]},
        {"workload": "code", "prompt": "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):"},
    ]
    wl = tmp_path / "wl.jsonl"
    wl.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    out = tmp_path / "sla.json"
    assert cli_main(["bench", "sla", "--url", server.url + "/v1", "--rates", "4", "8", "--duration-s", "1.0",
                     "--warmup-s", "0.2", "--workload-file", str(wl), "--max-tokens", "12", "--ignore-eos",
                     "--seed", "1", "--out", str(out), "--quiet", "--all-rates",
                     "--speculation", '{"method": "cascade"}']) == 0  # cascade: never a plain round
    res = json.loads(out.read_text())
    assert set(res) == {"config", "ceiling", "points", "skipped", "headline", "requests"}
    assert res["skipped"] == []
    assert res["config"]["model"] == "tiny-cascade" and res["config"]["workloads"] == ["code", "copy"]
    assert [(p["rate"], p["mode"]) for p in res["points"]] == [(r, m) for r in (4.0, 8.0) for m in MODES]
    for p in res["points"]:
        assert set(p) == POINT_FIELDS
        assert p["requests"] >= 1 and p["errors"] == 0 and p["completed"] == p["requests"]
        assert p["mean_output_tokens"] == 12  # ignore_eos: every request runs to max_tokens
        assert p["throughput_tok_s"] > 0 and p["e2e_p50_s"] <= p["e2e_p90_s"] <= p["e2e_p99_s"]
        assert 0 < p["ttft_p90_s"] <= p["e2e_p99_s"] and p["tpot_mean_s"] > 0
        # the plain phase really is plain decoding, the other one speculates
        assert (p["draft_tokens"] > 0) == (p["mode"] == "speculation")
    for r in res["requests"]:
        assert set(r) == REQUEST_FIELDS and r["error"] is None
    # both phases of a rate had the same arrivals
    for rate in (4.0, 8.0):
        arr = {m: [r["arrival_s"] for r in res["requests"] if r["rate"] == rate and r["mode"] == m] for m in MODES}
        assert arr["speculation"] == arr["plain"] and arr["plain"]
    plain_low = next(p for p in res["points"] if p["mode"] == "plain" and p["rate"] == 4.0)
    assert res["ceiling"]["p90_e2e_s"] == pytest.approx(2 * plain_low["e2e_p90_s"])
    assert set(res["headline"]) == {"p90_ceiling_s", *MODES, "throughput_ratio"}
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_missed_ceiling_skips_higher_rates_and_the_drain_is_bounded(server, tmp_path):
    """Long requests (ignore_eos) under an impossible ceiling with no drain time: the requests still running at
    the last arrival are cancelled as errors, both modes miss the ceiling at the lower rate and skip the higher."""
    wl = tmp_path / "wl.jsonl"
    wl.write_text(json.dumps({"prompt": "The river ran quietly past the old mill."}) + "\n")
    out = tmp_path / "sla.json"
    assert main(["--url", server.url, "--rates", "6", "3", "--duration-s", "0.6", "--warmup-s", "0",
                 "--workload-file", str(wl), "--max-tokens", "400", "--ignore-eos", "--drain-s", "0",
                 "--p90-ceiling-s", "0.0001", "--out", str(out), "--quiet", "--no-plot"]) == 0
    res = json.loads(out.read_text())
    assert res["config"]["rates"] == [3.0, 6.0]  # lowest first
    assert [(p["rate"], p["mode"]) for p in res["points"]] == [(3.0, m) for m in MODES]
    assert sorted((s["rate"], s["mode"]) for s in res["skipped"]) == [(6.0, "plain"), (6.0, "speculation")]
    assert all("missed the ceiling at 3 req/s" in s["reason"] for s in res["skipped"])
    cancelled = [r for r in res["requests"] if r["error"]]
    assert cancelled and all(r["error"].startswith("cancelled") and r["e2e_s"] is None for r in cancelled)
    for p in res["points"]:
        assert p["errors"] == sum(1 for r in cancelled if r["mode"] == p["mode"]) > 0
    assert res["headline"]["speculation"] is None and res["headline"]["plain"] is None
    assert res["headline"]["throughput_ratio"] is None


def test_without_matplotlib_the_plot_is_skipped_with_a_message(tmp_path, monkeypatch, capsys):
    import sys

    from specray.bench.sla import plot_latency

    result = {"config": {"modes": list(MODES), "rates": [1.0]}, "ceiling": {"p90_e2e_s": 4.0},
              "points": [_pt(1.0, "plain", 30, 2.0), _pt(1.0, "speculation", 40, 1.5)]}
    pytest.importorskip("matplotlib")
    assert plot_latency(result, tmp_path / "ok.png") and (tmp_path / "ok.png").stat().st_size > 0
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    assert plot_latency(result, tmp_path / "p.png") is False
    assert "matplotlib is not installed" in capsys.readouterr().err and not (tmp_path / "p.png").exists()
