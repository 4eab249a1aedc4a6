"""Linear weights reordered once for oneDNN on a CPU (`cpu_prepack`, `PackedLinear` for bfloat16): the same
products as the layers they replace, speculation still exact on a packed target, prompts still widened to float32
where `prompt_upcast` says so, and configs that say where the option applies."""

from __future__ import annotations

import pytest
import torch

from specray.config import LevelConfig
from specray.coordinator.cascade import Level
from specray.coordinator.generate import generate
from specray.engine.hf import PROMPT_ROWS, HFWorker, PackedLinear, pack_linears, packing_supported
from specray.spec.ngram import NgramConfig
from specray.spec.params import SamplingParams

PROMPTS = ["def fibonacci(n):\n    if n < 2:\n        return n\n", "The quick brown fox", "for i in range(10):"]
G = [SamplingParams(seed=0)]

bf16_packing = pytest.mark.skipif(not packing_supported(torch.bfloat16, torch.device("cpu")),
                                  reason="this CPU's oneDNN does not compute bfloat16")


def _forward_logits(w: HFWorker, ids: list[int], draft: list[int]) -> torch.Tensor:
    """The logits of a prompt's prefill, then of a verification of `draft` after it: [1 + len(draft) + 1, V]."""
    w.add("x", ids)
    (s,) = w._prepare(["x"], None)
    out = [w._forward([s], [s.tokens[s.kv_len:]], [1])]
    s.kv_len = len(s.tokens)
    out.append(w._forward([s], [[*draft, 0]], [len(draft) + 1]))
    w.free("x")
    return torch.cat(out)


@bf16_packing
def test_a_packed_layer_computes_what_the_layer_did():
    torch.manual_seed(0)
    for bias in (False, True):
        lin = torch.nn.Linear(64, 96, bias=bias).to(torch.bfloat16)
        packed = PackedLinear(lin)
        assert torch.equal(packed.weight.to_dense(), lin.weight)  # the dense weight is still there to widen
        for rows in (1, 3, 9, 40):
            x = torch.randn(2, rows, 64, dtype=torch.bfloat16)
            y = packed(x)
            assert y.shape == (2, rows, 96) and y.dtype == torch.bfloat16
            torch.testing.assert_close(y.float(), lin(x).float(), atol=2e-2, rtol=1e-2)


@bf16_packing
def test_a_packed_target_keeps_its_logits_and_speculation_stays_exact(tiny):
    packed = HFWorker(str(tiny.target_dir), name="t", dtype="bfloat16", cpu_prepack=True, prompt_upcast=False)
    dense = HFWorker(str(tiny.target_dir), name="t", dtype="bfloat16", cpu_prepack=False, prompt_upcast=False)
    linears = sum(isinstance(m, torch.nn.Linear) for m in dense.model.modules())
    assert packed.packed == linears > 0 and packed.stats().extra["linears_prepacked"] == linears
    assert dense.packed == 0 and not any(isinstance(m, PackedLinear) for m in dense.model.modules())
    ids = packed.tokenizer.encode(PROMPTS[0] * 3)
    torch.testing.assert_close(_forward_logits(packed, ids, [5, 6, 7]), _forward_logits(dense, ids, [5, 6, 7]),
                               atol=0.05, rtol=0.02)

    def run(drafter: Level | None) -> list[list[int]]:
        levels = [*([drafter] if drafter else []), Level("t", worker=packed)]
        return [r.token_ids for r in generate(levels, PROMPTS, max_tokens=20, ignore_eos=True).results]

    plain = run(None)
    draft = HFWorker(str(tiny.draft_dirs["mid"]), name="mid", dtype="bfloat16", cpu_prepack=True)
    assert run(Level("ngram", ngram=NgramConfig(3, 1, 3), k=4)) == plain  # greedy == plain on the packed engine
    assert run(Level("mid", worker=draft, k=3)) == plain


@bf16_packing
def test_prompts_widen_packed_layers_to_float32(tiny):
    """`prompt_upcast` on a packed level: a prompt-sized forward runs in float32 from the packed weights' dense form,
    the same products as the unpacked level's upcast; decoding steps stay packed bf16."""
    up = HFWorker(str(tiny.target_dir), name="up", dtype="bfloat16", cpu_prepack=True, prompt_upcast=True)
    ref = HFWorker(str(tiny.target_dir), name="ref", dtype="bfloat16", cpu_prepack=False, prompt_upcast=True)
    assert up.packed > 0
    ids = up.tokenizer.encode(PROMPTS[0] * 8)[: PROMPT_ROWS + 20]
    out = []
    for w in (up, ref):
        w.add("p", ids)
        w.propose(["p"], [1], G)  # the prompt's prefill, in float32, then one bf16 step
        (s,) = w._prepare(["p"], None)
        out.append(w._forward([s], [s.tokens[s.kv_len:]], [1]))
        w.free("p")
    assert up.upcast.widened == ref.upcast.widened > 0
    torch.testing.assert_close(out[0], out[1], atol=0.05, rtol=0.02)


@bf16_packing
def test_the_probe_packs_or_leaves_a_model_whole(tiny):
    w = HFWorker(str(tiny.target_dir), name="t", dtype="bfloat16", cpu_prepack=False)
    before = [r.token_ids for r in generate([Level("t", worker=w)], PROMPTS, max_tokens=12, ignore_eos=True).results]
    n = pack_linears(w.model, probe=True)
    kinds = {type(m) for m in w.model.modules()}
    assert (n > 0 and torch.nn.Linear not in kinds) or (n == 0 and PackedLinear not in kinds)
    after = [r.token_ids for r in generate([Level("t", worker=w)], PROMPTS, max_tokens=12, ignore_eos=True).results]
    assert after == before


def test_cpu_prepack_says_where_it_applies(tiny):
    assert HFWorker(str(tiny.target_dir), dtype="float32").packed == 0  # unset: float32 stays as it is
    with pytest.raises(ValueError, match="cpu_prepack"):
        HFWorker(str(tiny.target_dir), dtype="float16", cpu_prepack=True)
    with pytest.raises(ValueError, match="cpu_prepack is for hf levels"):
        LevelConfig(kind="vllm", model="m", cpu_prepack=True)
    assert LevelConfig(kind="vllm", model="m", cpu_prepack=False).cpu_prepack is False  # nothing to turn off
    assert LevelConfig(kind="hf", model="m").cpu_prepack is None  # a probe at load decides

