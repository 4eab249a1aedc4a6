"""The tiny offline models: tokenizer, four families, seeded determinism, controllable draft agreement."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from specray.testing import tiny


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tok") / "tokenizer"
    tiny.train_tokenizer(out)
    return out


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory, tok_dir: Path) -> Path:
    return tiny.build_tiny_model(tmp_path_factory.mktemp("llama") / "m", tok_dir, family="llama", seed=0)


def test_tokenizer_roundtrip_and_specials(tok_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tok_dir)
    assert 384 <= len(tok) <= 512
    for text in [
        "def fibonacci(n):\n    return n",
        "The river ran quietly.",
        "naïve café ✓ 你好",
        "  x\t= 1\n",
    ]:
        assert tok.decode(tok(text)["input_ids"]) == text
    for special in tiny.SPECIAL_TOKENS:
        assert len(tok(special)["input_ids"]) == 1
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id is not None
    assert tok.pad_token_id is not None


def test_chat_template(tok_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tok_dir)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert (
        text
        == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True)
    ids = ids["input_ids"] if not isinstance(ids, list) else ids
    assert tok.decode(ids) == text


def test_tokenizer_deterministic_and_variant_differs(tmp_path: Path, tok_dir: Path) -> None:
    again = tiny.train_tokenizer(tmp_path / "again")
    assert again.get_vocab() == AutoTokenizer.from_pretrained(tok_dir).get_vocab()
    other = tiny.train_tokenizer(tmp_path / "v1", variant=1)
    assert other.get_vocab() != again.get_vocab()


@pytest.mark.parametrize("family", tiny.FAMILIES)
def test_families_load_and_forward(tmp_path: Path, tok_dir: Path, family: str) -> None:
    path = tiny.build_tiny_model(tmp_path / family, tok_dir, family=family)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    tok = AutoTokenizer.from_pretrained(path)  # the tokenizer is saved next to the weights
    assert model.config.model_type == family
    assert model.dtype == torch.float32
    assert model.config.vocab_size == len(tok)
    assert model.config.max_position_embeddings >= 1024
    ids = torch.tensor([tok("def is_prime(n: int) -> bool:")["input_ids"]])
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert logits.shape == (1, ids.shape[1], len(tok))
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_greedy_is_far_from_ties(tmp_path: Path, tok_dir: Path, family: str) -> None:
    """fp32 batched-vs-unbatched round-off is ~1e-6: top-1/top-2 gaps must be orders of magnitude larger."""
    gaps = tiny.logit_gaps(tiny.build_tiny_model(tmp_path / family, tok_dir, family=family))
    assert gaps.numel() > 500
    assert gaps.median() > 0.3
    assert (gaps < 1e-4).float().mean() < 1e-3


def test_context_dependent_not_bigram(llama_dir: Path) -> None:
    """The next token must depend on more than the current one, or n-gram drafts would be trivially exact."""
    model, tok = tiny.load_tiny(llama_dir), AutoTokenizer.from_pretrained(llama_dir)
    ids = torch.tensor([tok(tiny.sample_texts()[0])["input_ids"]])
    with torch.no_grad():
        full = model(input_ids=ids).logits[0].argmax(-1)
        alone = model(input_ids=ids[0][:, None]).logits[:, 0].argmax(-1)
    assert (full == alone).float().mean() < 0.5


def test_tied_embeddings_variant(tmp_path: Path, tok_dir: Path) -> None:
    path = tiny.build_tiny_model(tmp_path / "tied", tok_dir, tie_embeddings=True)
    assert "lm_head.weight" not in load_file(path / "model.safetensors")
    model = tiny.load_tiny(path)
    assert model.get_output_embeddings().weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()


def test_same_seed_same_weights(tmp_path: Path, tok_dir: Path, llama_dir: Path) -> None:
    again = load_file(tiny.build_tiny_model(tmp_path / "a", tok_dir, seed=0) / "model.safetensors")
    ref = load_file(llama_dir / "model.safetensors")
    assert again.keys() == ref.keys()
    assert all(torch.equal(again[k], ref[k]) for k in ref)
    other = load_file(tiny.build_tiny_model(tmp_path / "b", tok_dir, seed=1) / "model.safetensors")
    assert not torch.equal(other["lm_head.weight"], ref["lm_head.weight"])


def test_draft_agreement_monotone_and_spans_range(llama_dir: Path) -> None:
    noises = [0.0, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.3]
    table = tiny.agreement_table(llama_dir, noises)
    values = [table[n] for n in noises]
    assert values[0] == 1.0
    assert all(b <= a + 0.02 for a, b in zip(values, values[1:], strict=False)), table
    assert max(values[1:]) >= 0.95 and min(values) <= 0.3, table
    # the documented table stays true for the default target
    for noise, expected in tiny.AGREEMENT_TABLE.items():
        assert table.get(noise, expected) == pytest.approx(expected, abs=0.02)


def test_make_draft_roundtrip(tmp_path: Path, llama_dir: Path) -> None:
    same = tiny.make_draft(llama_dir, tmp_path / "d0", noise=0.0)
    assert tiny.measure_agreement(llama_dir, same) == 1.0
    noisy = tiny.make_draft(llama_dir, tmp_path / "d1", noise=0.1, seed=3)
    again = tiny.make_draft(llama_dir, tmp_path / "d2", noise=0.1, seed=3)
    a, b = load_file(noisy / "model.safetensors"), load_file(again / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert 0.3 < tiny.measure_agreement(llama_dir, noisy) < 0.95
    assert (
        AutoTokenizer.from_pretrained(noisy).get_vocab()
        == AutoTokenizer.from_pretrained(llama_dir).get_vocab()
    )


def test_tiny_family_hits_targets_and_caches(tmp_path: Path) -> None:
    fam = tiny.tiny_family(tmp_path)
    assert set(fam.draft_dirs) == {"mid", "small"}
    assert fam.agreement["mid"] == pytest.approx(0.9, abs=0.04)
    assert fam.agreement["small"] == pytest.approx(0.6, abs=0.04)
    assert tiny.measure_agreement(fam.target_dir, fam.draft_dirs["mid"]) == pytest.approx(
        fam.agreement["mid"]
    )
    for d in [fam.tokenizer_dir, fam.target_dir, *fam.draft_dirs.values()]:
        assert (d / "tokenizer.json").is_file()
    t0 = time.monotonic()
    assert tiny.tiny_family(tmp_path) == fam
    assert time.monotonic() - t0 < 0.5
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temp dirs left


def test_regime_pair_draft_is_the_targets_first_layer_and_cheaper(tmp_path: Path) -> None:
    pair = tiny.regime_pair(tmp_path)
    target, draft = tiny.load_tiny(pair.target_dir), tiny.load_tiny(pair.draft_dir)
    assert (target.config.num_hidden_layers, draft.config.num_hidden_layers) == (6, 1)
    t, d = target.state_dict(), draft.state_dict()
    assert set(d) < set(t) and all(torch.equal(d[k], t[k]) for k in d)  # embeddings, first layer, norm, head
    assert sum(p.numel() for p in draft.parameters()) < 0.6 * sum(p.numel() for p in target.parameters())
    assert 0.7 <= pair.agreement <= 0.95  # the deep layers change the argmax sometimes, not often
    assert tiny.measure_agreement(pair.target_dir, pair.draft_dir) == pytest.approx(pair.agreement)
    for folder in (pair.target_dir, pair.draft_dir):
        assert AutoTokenizer.from_pretrained(folder).get_vocab() == AutoTokenizer.from_pretrained(
            pair.tokenizer_dir).get_vocab()
    t0 = time.monotonic()
    assert tiny.regime_pair(tmp_path) == pair
    assert time.monotonic() - t0 < 0.5
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temp dirs left
