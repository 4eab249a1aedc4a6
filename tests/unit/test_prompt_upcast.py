"""Prompt-sized forwards of a half-precision hf level in float32 (`prompt_upcast`, `PromptUpcast`): only prefills and
catch-ups widen their linear layers; decoding steps and verifications keep the model's dtype; the option is for hf
levels with bf16 / fp16 weights on a CPU, and configs say so."""

from __future__ import annotations

import pytest
import torch

from specray.config import LevelConfig
from specray.engine.hf import PROMPT_ROWS, HFWorker, prompt_upcast_pays
from specray.engine.protocol import DraftMode
from specray.spec.params import SamplingParams

G = [SamplingParams(seed=0)]


def _prompt(w: HFWorker, n: int) -> list[int]:
    ids = w.tokenizer.encode("def fibonacci(n):\n    if n < 2:\n        return n\n" * 8)
    assert len(ids) >= n
    return ids[:n]


@pytest.fixture(scope="module")
def pair(tiny):
    return (HFWorker(str(tiny.target_dir), name="up", dtype="bfloat16", prompt_upcast=True),
            HFWorker(str(tiny.target_dir), name="half", dtype="bfloat16", prompt_upcast=False))


def test_only_prompt_sized_forwards_widen_their_linears(pair):
    up, half = pair
    assert half.upcast is None and up.upcast is not None
    up.add("a", _prompt(up, PROMPT_ROWS + 20))
    first = up.propose(["a"], [1], G, mode=DraftMode.GREEDY)  # the prompt's prefill, then one step
    widened = up.upcast.widened
    assert widened > 0 and up.stats().extra["prompt_linears_fp32"] == widened
    up.propose(["a"], [4], G, mode=DraftMode.GREEDY)  # decoding steps
    up.verify(["a"], [[3, 4, 5]], None, G, "greedy")  # a verification
    assert up.upcast.widened == widened
    up.add("b", _prompt(up, PROMPT_ROWS - 4))  # a prompt below the size: the model's dtype
    up.propose(["b"], [1], G, mode=DraftMode.GREEDY)
    assert up.upcast.widened == widened
    half.add("a", _prompt(half, PROMPT_ROWS + 20))
    # the same first token; the prefill differs from bf16's only by where it rounds
    assert half.propose(["a"], [1], G, mode=DraftMode.GREEDY).token_ids == first.token_ids
    for w in pair:
        for sid in ("a", "b"):
            w.free(sid)


def test_prompt_logits_stay_close_to_the_half_precision_ones(pair):
    up, half = pair
    out = []
    for w in pair:
        w.add("c", _prompt(w, PROMPT_ROWS + 40))
        (s,) = w._prepare(["c"], None)  # the prompt's prefill (in float32 on `up`)
        out.append(w._forward([s], [s.tokens[s.kv_len:]], [1]))  # the next step's logits, [1, V]
        w.free("c")
    torch.testing.assert_close(out[0], out[1], atol=0.1, rtol=0.05)
    assert up.upcast.widened > 0


def test_prompt_upcast_is_for_half_precision_hf_levels_on_a_cpu(tiny):
    with pytest.raises(ValueError, match="prompt_upcast"):
        HFWorker(str(tiny.target_dir), dtype="float32", prompt_upcast=True)
    assert HFWorker(str(tiny.target_dir), dtype="float32").upcast is None  # nothing to widen
    probed = HFWorker(str(tiny.target_dir), dtype="bfloat16")  # unset: a probe at load decides
    assert (probed.upcast is not None) in (True, False)
    assert isinstance(prompt_upcast_pays(torch.bfloat16, 64, 32, 48), bool)
    with pytest.raises(ValueError, match="prompt_upcast is for hf levels"):
        LevelConfig(kind="vllm", model="m", prompt_upcast=True)
    with pytest.raises(ValueError, match="prompt_upcast is for hf levels"):
        LevelConfig(kind="ngram", prompt_upcast=False)
    assert LevelConfig(kind="hf", model="m", prompt_upcast=False).prompt_upcast is False
