"""Test helpers shipped with the package: tiny offline models and tokenizers (`specray.testing.tiny`)."""

from specray.testing.tiny import (
    FAMILIES,
    RegimePair,
    TinyFamily,
    build_tiny_model,
    draft_for_acceptance,
    make_draft,
    measure_agreement,
    regime_pair,
    tiny_family,
    train_tokenizer,
)

__all__ = [
    "FAMILIES",
    "RegimePair",
    "TinyFamily",
    "build_tiny_model",
    "draft_for_acceptance",
    "make_draft",
    "measure_agreement",
    "regime_pair",
    "tiny_family",
    "train_tokenizer",
]
