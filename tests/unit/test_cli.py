"""`specray generate` and `specray models list` end to end on tiny models (no downloads)."""

from __future__ import annotations

import json

from specray.cli import main


def test_generate_prints_text_and_per_level_stats(tiny, capsys):
    rc = main(["generate", "--backend", "hf", "--model", str(tiny.target_dir), "--draft", str(tiny.draft_dirs["mid"]),
               "--ngram", "--dtype", "float32", "--max-tokens", "12", "--k", "3", "--k", "4", "def fibonacci(n):"])
    assert rc == 0
    out, err = capsys.readouterr()
    assert out.strip()
    assert "tok/s" in err and "accepted" in err and "mean acceptance length" in err
    assert str(tiny.target_dir) in err  # per-level lines are named after the levels


def test_generate_json_plain_equals_speculative(tiny, capsys):
    base = ["generate", "--backend", "hf", "--model", str(tiny.target_dir), "--dtype", "float32", "--max-tokens", "10",
            "--json"]
    main([*base, "--plain", "Hello world"])
    plain = json.loads(capsys.readouterr().out)
    main([*base, "--draft", str(tiny.draft_dirs["mid"]), "Hello world"])
    spec = json.loads(capsys.readouterr().out)
    assert plain["results"][0]["token_ids"] == spec["results"][0]["token_ids"]
    assert spec["tokens_per_s"] > 0
    assert spec["results"][0]["ttft_s"] > 0
    # confidence-stopped drafts of a real (tiny) transformers model, under an n-gram and drafting ahead
    main([*base, "--ngram", "--draft", str(tiny.draft_dirs["mid"]), "--k", "3", "--k", "6", "--confidence", "0.6",
          "--overlap", "Hello world"])
    sure = json.loads(capsys.readouterr().out)
    assert plain["results"][0]["token_ids"] == sure["results"][0]["token_ids"]


def test_models_list(capsys):
    assert main(["models", "list"]) == 0
    out = capsys.readouterr().out
    assert "qwen2.5-coder-0.5b-instruct" in out and "smollm2-135m-instruct" in out


def test_version_and_defaults_in_help(capsys):
    import pytest

    import specray

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"specray {specray.__version__} (torch ") and "vllm " in out
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    help_text = capsys.readouterr().out
    assert "(default: 128)" in help_text and "(default: bfloat16)" in help_text


def test_generate_streams_text_and_names_drafter_verifier_pairs(tiny, capsys):
    """The text printed while rounds accept it is the generated text; statistics are named drafter->verifier."""
    target, mid = str(tiny.target_dir), str(tiny.draft_dirs["mid"])
    base = ["generate", "--backend", "hf", "--model", target, "--draft", mid, "--ngram", "--dtype", "float32",
            "--max-tokens", "12", "--k", "3", "--k", "4"]
    assert main([*base, "--json", "def fibonacci(n):"]) == 0
    result = json.loads(capsys.readouterr().out)["results"][0]
    assert result["stats"][target]["drafter"] == mid and result["stats"][mid]["drafter"] == "ngram"
    assert main([*base, "--method", "coupled", "def fibonacci(n):"]) == 0  # --method: old name of --verify-method
    out, err = capsys.readouterr()
    assert out.split("\n" + "-" * 60)[0] == result["text"]
    assert f"  {mid}->{target}: drafts" in err and f"  ngram->{mid}:" in err


def test_generate_on_the_vllm_backend_equals_plain_decoding(rep_target, capsys):
    """`--backend vllm` (what `auto` picks where vLLM is installed): the target's engine verifies the n-gram's
    drafts inside its step; greedy output equals plain decoding on the same engine, and stdout stays pure JSON
    (vLLM's own logs go to stderr)."""
    base = ["generate", "--backend", "vllm", "--model", str(rep_target), "--dtype", "float32", "--max-tokens", "24",
            "--json", "--threads", "1"]
    assert main([*base, "--plain", "def fibonacci(n):"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main([*base, "--ngram", "--k", "6", "def fibonacci(n):"]) == 0
    spec = json.loads(capsys.readouterr().out)
    assert spec["results"][0]["token_ids"] == plain["results"][0]["token_ids"]
    stats = spec["results"][0]["stats"][str(rep_target)]
    assert stats["drafter"] == "ngram" and stats["draft_tokens"] > 0 and stats["accepted_tokens"] > 0
