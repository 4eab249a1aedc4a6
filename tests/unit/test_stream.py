"""Incremental detokenization and stop strings: streamed text must equal the full decode, chunk by chunk."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from specray.coordinator.stream import REPLACEMENT_CHAR, IncrementalDetokenizer, StopChecker
from specray.testing.tiny import CORPUS, train_tokenizer

QWEN_DIR = Path.home() / ".cache/specray/models/qwen2.5-coder-0.5b-instruct"
MULTIBYTE = [
    "naïve café, déjà vu — crème brûlée",
    "你好，世界！这是一个测试。",
    "emoji 😀🚀👨‍👩‍👧 and flags 🇫🇷🇯🇵",
    "mixed: Ωμέγα ∑ ∫ ≠ ≤ → ✓ 日本語 한국어",
    "def f(x):\n    return x  # ü\n",
]
SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def byte_tok(tmp_path_factory: pytest.TempPathFactory) -> Any:
    out = tmp_path_factory.mktemp("tok") / "tokenizer"
    train_tokenizer(out)
    return AutoTokenizer.from_pretrained(out)


def _sentencepiece_like_tokenizer() -> PreTrainedTokenizerFast:
    """Llama-2 style: '▁' for spaces prepended to the text, byte-fallback tokens <0xNN> for unknown
    characters, and a decoder that strips the first leading space (the behaviour that breaks naive
    per-token decoding)."""
    from tokenizers import Tokenizer, models, normalizers, trainers

    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False)
    tok.train_from_iterator([line for line in CORPUS.splitlines() if line], trainer=trainer)
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    for b in range(256):  # byte-fallback tokens are ordinary (non-special) vocabulary entries
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    spec["decoder"] = {
        "type": "Sequence",
        "decoders": [
            {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
            {"type": "ByteFallback"},
            {"type": "Fuse"},
            {"type": "Strip", "content": " ", "start": 1, "stop": 0},
        ],
    }
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(json.dumps(spec)), unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )


@pytest.fixture(scope="module")
def sp_tok() -> PreTrainedTokenizerFast:
    return _sentencepiece_like_tokenizer()


@pytest.fixture(scope="module")
def qwen_tok() -> Any:
    if not (QWEN_DIR / "tokenizer.json").is_file():
        pytest.skip(f"{QWEN_DIR} not present")
    return AutoTokenizer.from_pretrained(QWEN_DIR)


def _split(ids: Sequence[int], cuts: Sequence[int]) -> list[list[int]]:
    points = sorted({c % (len(ids) + 1) for c in cuts} | {0, len(ids)})
    return [list(ids[a:b]) for a, b in zip(points, points[1:])]


def _stream(tok: Any, chunks: Sequence[Sequence[int]], prompt: Sequence[int] | None = None, skip: bool = True):
    detok = IncrementalDetokenizer(tok, prompt_ids=prompt, skip_special_tokens=skip)
    pieces = [detok.push(c) for c in chunks]
    pieces.append(detok.flush())
    return pieces


def _check(tok: Any, ids: list[int], cuts: Sequence[int], skip: bool = True) -> None:
    pieces = _stream(tok, _split(ids, cuts), skip=skip)
    full = tok.decode(ids, skip_special_tokens=skip)
    assert "".join(pieces) == full
    if REPLACEMENT_CHAR not in full:
        assert not any(REPLACEMENT_CHAR in p for p in pieces)


text_st = st.lists(st.sampled_from(MULTIBYTE) | st.text(max_size=30), min_size=1, max_size=4).map(" ".join)
cuts_st = st.lists(st.integers(0, 10_000), max_size=40)


@SETTINGS
@given(ids=st.lists(st.integers(0, 447), max_size=80), cuts=cuts_st, skip=st.booleans())
def test_random_ids_byte_level(byte_tok: Any, ids: list[int], cuts: list[int], skip: bool) -> None:
    """Arbitrary token streams, including invalid UTF-8 and special tokens, in arbitrary chunks."""
    _check(byte_tok, ids, cuts, skip)


@SETTINGS
@given(text=text_st, cuts=cuts_st)
def test_text_streams_byte_level(byte_tok: Any, text: str, cuts: list[int]) -> None:
    _check(byte_tok, byte_tok(text)["input_ids"], cuts)


@SETTINGS
@given(text=text_st, cuts=cuts_st)
def test_text_streams_sentencepiece(sp_tok: Any, text: str, cuts: list[int]) -> None:
    _check(sp_tok, sp_tok(text)["input_ids"], cuts)


@SETTINGS
@given(ids=st.lists(st.integers(0, 151_700), max_size=60), cuts=cuts_st)
def test_random_ids_qwen(qwen_tok: Any, ids: list[int], cuts: list[int]) -> None:
    _check(qwen_tok, ids, cuts)


@SETTINGS
@given(text=text_st, cuts=cuts_st)
def test_text_streams_qwen(qwen_tok: Any, text: str, cuts: list[int]) -> None:
    _check(qwen_tok, qwen_tok(text)["input_ids"], cuts)


@SETTINGS
@given(prompt=text_st, text=text_st, cuts=cuts_st)
def test_prompt_context_gives_the_continuation(sp_tok: Any, byte_tok: Any, prompt: str, text: str, cuts) -> None:
    """With the prompt as context the stream is decode(prompt + output) minus decode(prompt): the
    SentencePiece leading space of the first generated token is kept."""
    for tok in (sp_tok, byte_tok):
        p_ids = tok(prompt)["input_ids"]
        g_ids = tok(" " + text, add_special_tokens=False)["input_ids"]
        full, head = tok.decode(p_ids + g_ids), tok.decode(p_ids)
        pieces = _stream(tok, _split(g_ids, cuts), prompt=p_ids)
        if full.startswith(head):
            assert "".join(pieces) == full[len(head) :]


def test_sentencepiece_space_kept_after_prompt(sp_tok: Any) -> None:
    p_ids, g_ids = sp_tok("the river")["input_ids"], sp_tok("ran", add_special_tokens=False)["input_ids"]
    assert "".join(_stream(sp_tok, [[t] for t in g_ids], prompt=p_ids)) == " ran"
    assert "".join(_stream(sp_tok, [[t] for t in g_ids])) == sp_tok.decode(g_ids) == "ran"


def test_multibyte_char_is_held_until_complete(byte_tok: Any) -> None:
    ids = byte_tok("😀")["input_ids"]
    assert len(ids) > 1  # the tiny vocab splits the emoji into bytes
    detok = IncrementalDetokenizer(byte_tok)
    out = [detok.push([t]) for t in ids]
    assert out[:-1] == [""] * (len(ids) - 1) and out[-1] == "😀"


def test_invalid_bytes_are_not_held_forever(byte_tok: Any) -> None:
    """A run of stray continuation bytes is real U+FFFD output: it streams instead of waiting for flush."""
    stray = next(i for i in range(len(byte_tok)) if byte_tok.decode([i]) == REPLACEMENT_CHAR)
    detok = IncrementalDetokenizer(byte_tok)
    pieces = [detok.push([stray]) for _ in range(10)]
    assert "".join(pieces)  # something came out before flush
    assert "".join(pieces) + detok.flush() == byte_tok.decode([stray] * 10)


def test_skipped_special_tokens_do_not_grow_the_window(byte_tok: Any) -> None:
    detok = IncrementalDetokenizer(byte_tok)
    assert detok.push([byte_tok.eos_token_id] * 1000) == ""
    assert detok._ids == []


# ---------------------------------------------------------------------------------------------- stops


def _run_stops(stop: Sequence[str], chunks: Sequence[str]) -> tuple[str, bool]:
    checker = StopChecker(stop)
    out, stopped = [], False
    for c in chunks:
        text, stopped = checker.push(c)
        out.append(text)
        if stopped:
            break
    out.append(checker.flush())
    return "".join(out), stopped


def test_stop_split_across_chunks() -> None:
    assert _run_stops(["STOP"], ["abc S", "T", "OP tail"]) == ("abc ", True)
    assert _run_stops(["\n\n"], ["line\n", "\nnext"]) == ("line", True)


def test_partial_match_is_released_when_it_fails() -> None:
    checker = StopChecker(["STOP"])
    assert checker.push("abc ST") == ("abc ", False)
    assert checker.push("x") == ("STx", False)
    assert checker.push("ST") == ("", False)
    assert checker.flush() == "ST"


def test_first_completed_stop_wins_and_nothing_after_stop() -> None:
    checker = StopChecker(["world", "lo w"])
    assert checker.push("hello world") == ("hel", True)
    assert checker.matched == "lo w"
    assert checker.push("more") == ("", True)
    assert checker.flush() == ""


def test_no_stops_passes_through() -> None:
    checker = StopChecker([])
    assert checker.push("abc") == ("abc", False) and checker.flush() == ""
    assert StopChecker(["", "x"]).stop_strings == ("x",)


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(alphabet="abcST\n😀 ", max_size=60),
    stops=st.lists(st.text(alphabet="abcST\n😀 ", min_size=1, max_size=5), min_size=1, max_size=4),
    cuts=cuts_st,
)
def test_stop_checker_matches_reference(text: str, stops: list[str], cuts: list[int]) -> None:
    """Whatever the chunking: output is the text before the first stop string to complete (or all of it)."""
    points = sorted({c % (len(text) + 1) for c in cuts} | {0, len(text)})
    chunks = [text[a:b] for a, b in zip(points, points[1:])]
    hits = [(i + len(s), i) for s, i in ((s, text.find(s)) for s in stops) if i >= 0]
    expected = (text[: min(hits)[1]], True) if hits else (text, False)
    assert _run_stops(stops, chunks) == expected


class _Spy:
    """Wraps a tokenizer and records the longest id list it was asked to decode."""

    def __init__(self, tok: Any) -> None:
        self.tok, self.longest, self.calls = tok, 0, 0
        self.all_special_ids = tok.all_special_ids

    def decode(self, ids: list[int], **kw: Any) -> str:
        self.longest, self.calls = max(self.longest, len(ids)), self.calls + 1
        return self.tok.decode(ids, **kw)


def test_work_per_token_is_bounded(byte_tok: Any) -> None:
    """Decoding cost does not grow with the length of the output (a sliding window, not the whole text)."""
    ids = byte_tok(" ".join(MULTIBYTE * 20))["input_ids"]
    spy = _Spy(byte_tok)
    detok = IncrementalDetokenizer(spy, prompt_ids=ids[:50])
    text = "".join(detok.push([t]) for t in ids) + detok.flush()
    assert text == byte_tok.decode(ids)
    assert len(ids) > 1000 and spy.longest <= 16 and spy.calls <= 4 * len(ids)
