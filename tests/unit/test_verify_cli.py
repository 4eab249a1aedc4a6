"""`specray verify`: exit code 0 when speculation gives plain decoding's output on the user's prompts (greedy, and
seeded coupled sampling), 1 when a (deliberately inexact, test-only) verifier makes them differ, 2 on bad input;
the JSON report's schema."""

from __future__ import annotations

import json

import pytest
import torch

from specray.cli import main as cli_main
from specray.config import CascadeConfig
from specray.coordinator.cascade import Level
from specray.coordinator.generate import build_levels
from specray.engine.hf import HFWorker
from specray.verify_cli import add_verify_arguments, run_verify

ROWS = [
    {"prompt": "def fibonacci(n):", "workload": "code"},
    {"prompt": "The quick brown fox jumps over the lazy dog. The quick brown", "max_tokens": 12},
    {"messages": [{"role": "user", "content": "Hello"}], "workload": "chat"},
]


@pytest.fixture
def prompts(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in ROWS) + "\n")
    return path


def _flags(tiny, prompts, *extra: str) -> list[str]:
    return ["verify", str(prompts), "--model", str(tiny.target_dir), "--draft", str(tiny.draft_dirs["mid"]),
            "--ngram", "--dtype", "float32", "--max-tokens", "16", *extra]


def test_exact_cascade_passes_with_a_json_report(tiny, prompts, tmp_path, capsys):
    out = tmp_path / "report.json"
    assert cli_main(_flags(tiny, prompts, "--json-out", str(out))) == 0
    report = json.loads(out.read_text())
    assert set(report) == {"prompts", "identical", "temperature", "seed", "dtype", "divergences", "ok"}
    assert report["prompts"] == report["identical"] == 3 and report["ok"] and report["divergences"] == []
    assert report["dtype"] == "float32"
    assert "3/3 prompts token-identical" in capsys.readouterr().out


def test_seeded_sampling_is_checked_with_the_coupled_method(tiny, prompts):
    assert cli_main(_flags(tiny, prompts, "--temperature", "0.9", "--top-k", "20", "--seed", "7")) == 0


class InexactWorker(HFWorker):
    """A deliberately inexact verifier (tests only): when it scores drafts it shifts the logits toward the last
    draft token, so it accepts drafts plain decoding would not have produced."""

    def _forward(self, seqs, inputs, keep):  # -> [sum(keep), V]
        flat = super()._forward(seqs, inputs, keep)
        if max(keep) > 1:
            rows = torch.cat([torch.tensor(list(x[-k:])) for x, k in zip(inputs, keep)])
            flat = flat.clone()
            flat[torch.arange(len(rows)), rows] += 50.0  # the token just fed wins: drafts repeat themselves
        return flat


def test_an_inexact_verifier_fails_with_exit_code_1_and_the_first_divergence(tiny, prompts, tmp_path, capsys):
    import argparse

    parser = argparse.ArgumentParser()
    add_verify_arguments(parser)
    args = parser.parse_args(_flags(tiny, prompts)[1:] + ["--json-out", str(tmp_path / "r.json")])

    def build(cfg: CascadeConfig) -> list[Level]:
        levels = build_levels(cfg)
        bad = InexactWorker(str(tiny.target_dir), name="target", dtype="float32")
        return [*levels[:-1], Level("target", worker=bad, k=levels[-1].k)]

    report, code = run_verify(args, build=build)
    assert code == 1 and not report.ok
    assert report.divergences and report.identical < report.prompts
    for d in report.divergences:
        assert 0 <= d.position <= min(d.speculative_tokens, d.plain_tokens)
        assert d.speculative_text != d.plain_text
    assert report.divergences[0].workload in (None, "code", "chat")


def test_bad_input_exits_2_naming_the_line(tiny, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"text": "no prompt field"}\n')
    assert cli_main(_flags(tiny, bad)) == 2
    assert "bad.jsonl:2" in capsys.readouterr().err
    good = tmp_path / "good.jsonl"
    good.write_text('{"prompt": "ok"}\n')
    assert cli_main(["verify", str(good), "--model", str(tiny.target_dir)]) == 2  # nothing drafts
    assert "nothing drafts" in capsys.readouterr().err
