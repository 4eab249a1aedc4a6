"""Every level of a cascade must use one tokenizer (same token -> id mapping and eos id), otherwise draft token
ids mean different things to the verifier: `check_tokenizers` enforces that at start-up in process, and the level
actors report `tokenizer_fingerprint` for the launcher to compare (`specray.serve.launch`)."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any


class TokenizerMismatchError(ValueError):
    """Two levels use different tokenizers, so their token ids are not interchangeable."""


def _vocab_of(tokenizer: Any) -> dict[str, int]:
    return dict(tokenizer.get_vocab())


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """sha256 over the sorted (token, id) pairs: equal fingerprints mean interchangeable token ids."""
    items = sorted(_vocab_of(tokenizer).items(), key=lambda kv: kv[1])
    h = hashlib.sha256()
    for token, idx in items:
        h.update(f"{idx}\t{token}\n".encode("utf-8", "surrogatepass"))
    return h.hexdigest()


def check_tokenizers(named: Sequence[tuple[str, Any]]) -> str:
    """Raise `TokenizerMismatchError` unless all tokenizers share vocab (token -> id) and eos id.

    Compares every tokenizer against the first; returns the common fingerprint. Only on a mismatch is the
    vocab diffed, to give a message that names both models and shows what differs.
    """
    if not named:
        raise ValueError("check_tokenizers needs at least one (name, tokenizer) pair")
    ref_name, ref_tok = named[0]
    ref_fp = tokenizer_fingerprint(ref_tok)
    for name, tok in named[1:]:
        problems: list[str] = []
        if tokenizer_fingerprint(tok) != ref_fp:
            problems.append(_describe_vocab_diff(_vocab_of(ref_tok), _vocab_of(tok), ref_name, name))
        if ref_tok.eos_token_id != tok.eos_token_id:
            problems.append(
                f"eos id differs: {ref_name!r} has {ref_tok.eos_token_id} ({ref_tok.eos_token!r}), "
                f"{name!r} has {tok.eos_token_id} ({tok.eos_token!r})"
            )
        if problems:
            raise TokenizerMismatchError(
                f"models {ref_name!r} and {name!r} do not share a tokenizer, so draft token ids cannot be "
                f"verified across them: " + "; ".join(problems)
            )
    return ref_fp


def _describe_vocab_diff(a: dict[str, int], b: dict[str, int], name_a: str, name_b: str) -> str:
    only_a = sorted(set(a) - set(b), key=a.__getitem__)
    moved = sorted((t for t in set(a) & set(b) if a[t] != b[t]), key=a.__getitem__)
    parts = [f"vocab differs ({name_a!r}: {len(a)} tokens, {name_b!r}: {len(b)} tokens"]
    if moved:
        t = moved[0]
        parts.append(f", {len(moved)} tokens have different ids, e.g. {t!r} is {a[t]} vs {b[t]}")
    if only_a:
        parts.append(f", {len(only_a)} tokens of {name_a!r} missing from {name_b!r}, e.g. {only_a[0]!r}")
    return "".join(parts) + ")"
