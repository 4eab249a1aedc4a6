"""Tiny offline models for tests: a trained byte-level BPE tokenizer, seeded random causal LMs, and drafts.

Nothing here downloads anything. Exactness tests need models that are (a) fast, (b) deterministic, and
(c) not full of near-ties: greedy decoding compares argmaxes, and batched vs unbatched fp32 forwards differ
by ~1e-6, so a top-1/top-2 logit gap of that size would flip a token and make a lossless algorithm look
lossy. Stock init (std 0.02) gives nearly flat logits; we therefore init with std ~1/sqrt(hidden) (every
layer contributes O(1) to the residual stream, so outputs depend on context, not just the last token) and
scale the lm_head so logits spread over several units (typical top-1/top-2 gap ~0.5, see `logit_gaps`).

Drafts are the target with every weight tensor perturbed by ``noise * rms(w) * N(0, 1)``: noise 0 is the
target itself (agreement 1.0) and agreement falls smoothly as noise grows, so acceptance rates are
controllable (`draft_for_acceptance` bisects noise for a wanted greedy agreement). `AGREEMENT_TABLE`
records measured values for the default llama target.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

FAMILIES = ("llama", "qwen2", "mistral", "gpt2")
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
#: Bump when the builders change in a way that alters outputs (invalidates tiny_family caches).
BUILD_VERSION = 1

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_PROSE = """\
The river ran quietly past the old mill, and the miller's daughter counted the boats as they went by.
Every morning she wrote the numbers in a small blue book, because her father said that good records
keep a business honest. On rainy days there were fewer boats, and on market days there were more than
she could count before breakfast. She learned that patterns hide in plain numbers if you are patient.
A speculative reader guesses the next word before the page turns. When the guess is right, the story
moves faster; when it is wrong, the reader simply reads the true word and carries on. Nothing is lost
by guessing, as long as every guess is checked against the page.
The committee met on Tuesday to discuss the budget for the new library. After a long debate about
shelves, lamps and chairs, they agreed to spend most of the money on books and the rest on a reading
room with large windows facing the garden. Children would have their own corner with soft cushions.
Weather report: cloudy in the morning, clearing by the afternoon, with light winds from the west and a
high of eighteen degrees. Tomorrow brings rain in the north and sunshine along the coast.
How do I bake bread? Mix flour, water, salt and yeast; knead the dough for ten minutes; let it rise
for an hour; shape it, let it rise again, and bake it in a hot oven until the crust is golden brown.
"""

_CODE = '''\
def fibonacci(n):
    """Return the n-th Fibonacci number."""
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a


def is_prime(n: int) -> bool:
    if n < 2:
        return False
    for d in range(2, int(n ** 0.5) + 1):
        if n % d == 0:
            return False
    return True


class Stack:
    def __init__(self):
        self.items = []

    def push(self, item):
        self.items.append(item)

    def pop(self):
        return self.items.pop()

    def __len__(self):
        return len(self.items)


def read_lines(path):
    with open(path, "r", encoding="utf-8") as handle:
        return [line.rstrip("\\n") for line in handle]


def word_count(text: str) -> dict[str, int]:
    counts = {}
    for word in text.lower().split():
        counts[word] = counts.get(word, 0) + 1
    return counts


for i in range(10):
    if i % 2 == 0:
        print(i, fibonacci(i))
    else:
        print(i, is_prime(i))
'''

_CHAT = """\
<|im_start|>system
You are a helpful assistant.<|im_end|>
<|im_start|>user
Write a function that returns the square of a number.<|im_end|>
<|im_start|>assistant
def square(x):
    return x * x<|im_end|>
<|im_start|>user
What is the capital of France?<|im_end|>
<|im_start|>assistant
The capital of France is Paris.<|im_end|>
"""

#: The training corpus of the tiny tokenizers (prose, Python and ChatML-formatted turns).
CORPUS = _PROSE + "\n" + _CODE + "\n" + _CHAT


def sample_texts() -> list[str]:
    """Paragraph-sized pieces of the corpus, for agreement measurements and test prompts."""
    pieces = [p.strip("\n") for p in (_PROSE + "\n\n" + _CODE).split("\n\n")]
    return [p for p in pieces if len(p) > 40]


# -------------------------------------------------------------------------------------------- tokenizer


def train_tokenizer(out_dir: str | os.PathLike[str], variant: int = 0) -> Any:
    """Train a small byte-level BPE on `CORPUS` offline, save it with save_pretrained, and return it.

    variant 0: 448 ids, special tokens first. variant 1: 400 ids, special tokens in another order, so ids
    differ from variant 0 (for tokenizer-mismatch tests). Training is deterministic.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = list(SPECIAL_TOKENS) if variant == 0 else list(reversed(SPECIAL_TOKENS))
    vocab_size = 448 if variant == 0 else 400
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([CORPUS], trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|endoftext|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
        model_max_length=1024,
    )
    fast.save_pretrained(out_dir)
    return fast


def _as_tokenizer(tok: Any) -> Any:
    if isinstance(tok, (str, os.PathLike)):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(tok)
    return tok


# ---------------------------------------------------------------------------------------------- models


def tiny_config(
    family: str,
    vocab_size: int,
    num_layers: int = 2,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int | None = None,
    max_positions: int = 1024,
    bos_id: int | None = None,
    eos_id: int | None = None,
    pad_id: int | None = None,
    tie_embeddings: bool = False,
) -> Any:
    """A transformers config of `family`; untied by default so the lm_head can be scaled on its own."""
    from transformers import GPT2Config, LlamaConfig, MistralConfig, Qwen2Config

    ids = {"bos_token_id": bos_id, "eos_token_id": eos_id, "pad_token_id": pad_id}
    std = 1.0 / math.sqrt(hidden)
    if family == "gpt2":
        return GPT2Config(
            vocab_size=vocab_size, n_positions=max_positions, n_embd=hidden, n_layer=num_layers,
            n_head=heads, n_inner=intermediate, initializer_range=std,
            tie_word_embeddings=tie_embeddings, **ids,
        )  # fmt: skip
    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=intermediate or 2 * hidden,
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions,
        initializer_range=std,
        tie_word_embeddings=tie_embeddings,
        **ids,
    )
    if family == "llama":
        return LlamaConfig(**common)
    if family == "qwen2":
        return Qwen2Config(**common, use_sliding_window=False)
    if family == "mistral":
        return MistralConfig(**common, sliding_window=None)
    raise ValueError(f"unknown tiny model family {family!r}; choose from {FAMILIES}")


def _lm_head(model: Any) -> torch.nn.Module:
    return model.get_output_embeddings()


@torch.no_grad()
def _init_weights(model: Any, seed: int, hidden: int, logit_scale: float) -> None:
    """Seeded init that does not depend on transformers' init order: N(0, 1/fan_in) for matrices,
    N(0, 1) for embeddings, small biases, norms at 1, lm_head scaled to give logits of std ~logit_scale.

    With tied embeddings the head is the N(0, 1) embedding, whose logits already have std ~sqrt(hidden)."""
    gen = torch.Generator().manual_seed(seed)
    head = _lm_head(model)
    for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
        if p.ndim >= 2:
            is_embedding = "embed_tokens" in name or name.endswith(("wte.weight", "wpe.weight"))
            std = 1.0 if is_embedding else 1.0 / math.sqrt(p.shape[-1] if p.shape[-1] > 1 else hidden)
            if name.endswith("c_attn.weight") or name.endswith(("c_fc.weight", "c_proj.weight")):
                std = 1.0 / math.sqrt(p.shape[0])  # GPT-2 Conv1D stores [in, out]
            p.copy_(torch.randn(p.shape, generator=gen) * std)
        elif name.endswith("bias"):
            p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
        else:  # norm gains
            p.fill_(1.0)
    if head.weight is not model.get_input_embeddings().weight:
        head.weight.mul_(logit_scale)


def build_tiny_model(
    out_dir: str | os.PathLike[str],
    tokenizer_dir_or_tok: Any,
    family: str = "llama",
    seed: int = 0,
    num_layers: int = 2,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int | None = None,
    max_positions: int = 1024,
    logit_scale: float = 4.0,
    tie_embeddings: bool = False,
    residual_scale: float = 1.0,
) -> Path:
    """Build a seeded random fp32 causal LM of `family` over the tokenizer's vocab and save it (with the
    tokenizer) as safetensors. Same arguments -> bit-identical weights. `tie_embeddings=True` gives the
    tied layout of the official Qwen2.5/SmolLM2 checkpoints (no lm_head.weight key).

    `residual_scale` multiplies the output projection of every attention and MLP block. With tied embeddings
    the N(0, 1) embedding dominates the residual stream, so such a model mostly repeats recent tokens (text
    that prompt lookup drafts well); larger scales move it from pure repetition (runs of one token at 8, 512
    wide, 4 layers) towards noise (occasional repeats at 48), which sets how often an n-gram draft is accepted
    (llama family)."""
    tok = _as_tokenizer(tokenizer_dir_or_tok)
    config = tiny_config(
        family, len(tok), num_layers, hidden, heads, kv_heads, intermediate, max_positions,
        tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, tie_embeddings,
    )  # fmt: skip
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _init_weights(model, seed, hidden, logit_scale)
    if residual_scale != 1.0:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(("o_proj.weight", "down_proj.weight", "attn.c_proj.weight", "mlp.c_proj.weight")):
                    p.mul_(residual_scale)
    out = Path(out_dir)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def load_tiny(path: str | os.PathLike[str]) -> Any:
    """Load a tiny model in fp32, eval mode (what the tests want for exactness)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


# ---------------------------------------------------------------------------------------------- drafts


@torch.no_grad()
def _perturb_(model: Any, noise: float, seed: int) -> None:
    """w += noise * rms(w) * N(0, 1), tensor by tensor in name order (so it is seed-deterministic)."""
    gen = torch.Generator().manual_seed(seed)
    for _, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
        rms = p.detach().pow(2).mean().sqrt()
        p.add_(torch.randn(p.shape, generator=gen) * (noise * rms))


def make_draft(
    target_dir: str | os.PathLike[str], out_dir: str | os.PathLike[str], noise: float, seed: int = 1
) -> Path:
    """Save a copy of the target with every weight perturbed by `noise` (relative rms), same tokenizer."""
    model = load_tiny(target_dir)
    _perturb_(model, noise, seed)
    out = Path(out_dir)
    model.save_pretrained(out)
    _as_tokenizer(str(target_dir)).save_pretrained(out)
    return out


def _encode_texts(tok: Any, texts: Sequence[str], window: int = 128) -> list[torch.Tensor]:
    """Texts joined and cut into equal windows, one [N, window] batch (short leftovers kept as their own
    batch): one forward per measurement keeps noise bisection fast."""
    ids: list[int] = []
    for text in texts:
        ids.extend(tok(text)["input_ids"])
    n = len(ids) // window
    batches = [torch.tensor(ids[: n * window]).view(n, window)] if n else []
    if len(ids) - n * window >= 2:
        batches.append(torch.tensor([ids[n * window :]]))
    return batches


@torch.no_grad()
def _argmaxes(model: Any, encoded: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.cat([model(input_ids=ids).logits[:, :-1].argmax(-1).flatten() for ids in encoded])


def measure_agreement(
    target_dir: str | os.PathLike[str], draft_dir: str | os.PathLike[str], texts: Sequence[str] | None = None
) -> float:
    """Teacher-forced greedy agreement: fraction of positions where draft and target argmaxes are equal."""
    tok = _as_tokenizer(str(target_dir))
    encoded = _encode_texts(tok, sample_texts() if texts is None else texts)
    a = _argmaxes(load_tiny(target_dir), encoded)
    b = _argmaxes(load_tiny(draft_dir), encoded)
    return float((a == b).float().mean())


def _agreement_at(target: Any, base_state: Mapping[str, torch.Tensor], encoded: Sequence[torch.Tensor],
                  ref: torch.Tensor, noise: float, seed: int) -> float:  # fmt: skip
    target.load_state_dict(base_state)
    _perturb_(target, noise, seed)
    return float((_argmaxes(target, encoded) == ref).float().mean())


def find_noise(
    target_dir: str | os.PathLike[str],
    target_alpha: float,
    seed: int = 1,
    texts: Sequence[str] | None = None,
    iters: int = 10,
) -> tuple[float, float]:
    """Bisect (in log space) the noise whose draft has greedy agreement closest to `target_alpha`.

    Returns (noise, measured agreement). Agreement is not strictly monotone at a fixed seed, but close
    enough that bisection lands within a few percent.
    """
    if not 0.0 < target_alpha <= 1.0:
        raise ValueError("target_alpha must be in (0, 1]")
    tok = _as_tokenizer(str(target_dir))
    encoded = _encode_texts(tok, sample_texts() if texts is None else texts)
    model = load_tiny(target_dir)
    base = {k: v.clone() for k, v in model.state_dict().items()}
    ref = _argmaxes(model, encoded)
    lo, hi = 1e-3, 2.0
    best = (0.0, 1.0)
    for _ in range(iters):
        mid = math.sqrt(lo * hi)
        agree = _agreement_at(model, base, encoded, ref, mid, seed)
        if abs(agree - target_alpha) < abs(best[1] - target_alpha):
            best = (mid, agree)
        if agree > target_alpha:
            lo = mid
        else:
            hi = mid
    return best


def draft_for_acceptance(
    target_dir: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    target_alpha: float,
    seed: int = 1,
    texts: Sequence[str] | None = None,
) -> tuple[Path, float]:
    """Build a draft whose teacher-forced greedy agreement with the target is about `target_alpha`.

    Returns (draft folder, measured agreement). Useful range: ~0.3 to ~0.97.
    """
    noise, agree = find_noise(target_dir, target_alpha, seed, texts)
    return make_draft(target_dir, out_dir, noise, seed), agree


#: Measured on the default llama target (seed 0, 2 layers, hidden 64), draft seed 1, `sample_texts()`:
#: noise (relative rms perturbation) -> teacher-forced greedy agreement. Regenerate with `agreement_table`.
#: Noise for a wanted agreement (`find_noise`): 0.95 -> 0.0143, 0.9 -> 0.0247, 0.8 -> 0.0471, 0.7 -> 0.0752,
#: 0.6 -> 0.107, 0.5 -> 0.142, 0.3 -> 0.229. Acceptance along a greedy trajectory is close but not identical.
AGREEMENT_TABLE: dict[float, float] = {
    0.005: 0.985, 0.01: 0.964, 0.02: 0.921, 0.03: 0.883, 0.05: 0.792, 0.07: 0.726,
    0.1: 0.616, 0.15: 0.482, 0.2: 0.368, 0.3: 0.185, 0.5: 0.043,
}  # fmt: skip


def agreement_table(
    target_dir: str | os.PathLike[str],
    noises: Sequence[float],
    seed: int = 1,
    texts: Sequence[str] | None = None,
) -> dict[float, float]:
    """Agreement of drafts at each noise level (in-memory, nothing saved)."""
    tok = _as_tokenizer(str(target_dir))
    encoded = _encode_texts(tok, sample_texts() if texts is None else texts)
    model = load_tiny(target_dir)
    base = {k: v.clone() for k, v in model.state_dict().items()}
    ref = _argmaxes(model, encoded)
    return {n: _agreement_at(model, base, encoded, ref, n, seed) for n in noises}


@torch.no_grad()
def logit_gaps(model_dir: str | os.PathLike[str], texts: Sequence[str] | None = None) -> torch.Tensor:
    """Top-1 minus top-2 logit at every position of the texts (to check greedy is far from ties)."""
    tok = _as_tokenizer(str(model_dir))
    model = load_tiny(model_dir)
    gaps = []
    for ids in _encode_texts(tok, sample_texts() if texts is None else texts):
        top = model(input_ids=ids).logits.flatten(0, 1).topk(2, dim=-1).values
        gaps.append(top[:, 0] - top[:, 1])
    return torch.cat(gaps)


# ---------------------------------------------------------------------------------------------- family


def _cached_build(root: str | os.PathLike[str], prefix: str, manifest_name: str,
                  build: Callable[[Path], dict[str, Any]], inputs: Mapping[str, Any]) -> tuple[Path, dict[str, Any]]:
    """(folder, manifest) of what `build(folder)` makes, built once under `root` as `<prefix>-<hash of inputs>`.

    The build goes to a temporary folder that is renamed into place when complete (its manifest, what `build`
    returned, written last), so concurrent builders (pytest-xdist) and interrupted builds never leave a half-built
    folder behind; a builder that loses the race keeps the winner's."""
    key_src = json.dumps({"v": BUILD_VERSION, **inputs}, sort_keys=True)
    key = hashlib.sha256(key_src.encode()).hexdigest()[:16]
    root = Path(root)
    final = root / f"{prefix}-{key}"
    manifest = final / manifest_name
    if not manifest.is_file():
        tmp = root / f".{prefix}-{key}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            info = build(tmp)
            (tmp / manifest_name).write_text(json.dumps(info))
            try:
                os.replace(tmp, final)
            except OSError:  # another process finished first: keep theirs
                if not manifest.is_file():
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return final, json.loads(manifest.read_text())


@dataclass(frozen=True)
class TinyFamily:
    """A tokenizer, a target and named drafts that all share it (a complete tiny cascade)."""

    tokenizer_dir: Path
    target_dir: Path
    draft_dirs: dict[str, Path]
    agreement: dict[str, float] = field(default_factory=dict)  # measured teacher-forced greedy agreement


def tiny_family(
    root: str | os.PathLike[str],
    family: str = "llama",
    seed: int = 0,
    drafts: Mapping[str, float] | None = None,
    **model_kwargs: Any,
) -> TinyFamily:
    """Build (or reuse) a target plus drafts under `root`, cached by a hash of all inputs.

    `drafts` maps a name to the wanted greedy agreement (default {"mid": 0.9, "small": 0.6}). Built in a
    temporary folder renamed into place when complete (`_cached_build`), so concurrent builders (pytest-xdist)
    and interrupted builds never leave a half-built family behind.
    """
    drafts = dict(drafts or {"mid": 0.9, "small": 0.6})

    def build(tmp: Path) -> dict[str, Any]:
        train_tokenizer(tmp / "tokenizer")
        build_tiny_model(tmp / "target", tmp / "tokenizer", family=family, seed=seed, **model_kwargs)
        agreement = {}
        for i, (name, alpha) in enumerate(sorted(drafts.items())):
            _, agreement[name] = draft_for_acceptance(tmp / "target", tmp / name, alpha, seed=seed + 1 + i)
        return {"drafts": sorted(drafts), "agreement": agreement}

    final, info = _cached_build(root, f"tiny-{family}", "family.json", build,
                                {"family": family, "seed": seed, "drafts": drafts, "kw": model_kwargs})
    return TinyFamily(
        tokenizer_dir=final / "tokenizer",
        target_dir=final / "target",
        draft_dirs={name: final / name for name in info["drafts"]},
        agreement=info["agreement"],
    )


def repetitive_target(root: str | os.PathLike[str]) -> Path:
    """A tiny fp32 target whose greedy text repeats itself, for n-gram speculation that really accepts (~0.9).

    Tied embeddings with block outputs scaled by 8 make the model copy its context; 2 heads of 32 because
    vLLM's CPU attention needs head_dim >= 32. Built once under `root` (reused when present).
    """
    fam = tiny_family(root, heads=2, kv_heads=1)
    out = Path(root) / "native-target-64x2-tied-r8"
    if not (out / "config.json").is_file():
        build_tiny_model(out, fam.tokenizer_dir, hidden=64, num_layers=2, heads=2, kv_heads=1, seed=3,
                         tie_embeddings=True, residual_scale=8.0)
    return out


@dataclass(frozen=True)
class RegimePair:
    """A target and a cheaper draft that agrees with it often (`regime_pair`), sharing one tokenizer."""

    tokenizer_dir: Path
    target_dir: Path
    draft_dir: Path
    agreement: float  # measured teacher-forced greedy agreement of the draft with the target


def regime_pair(
    root: str | os.PathLike[str], hidden: int = 512, num_layers: int = 6, deep_scale: float = 0.1, seed: int = 3
) -> RegimePair:
    """A target whose CPU step cost grows with batch x tokens, and a draft that is its own first layer.

    Perturbed drafts (`tiny_family`) cost as much as their target, so speculation with them can never pay. Here
    the target (`num_layers` x `hidden`, untied) has the output projections of every layer after the first
    scaled by `deep_scale`: those layers cost full compute but move the residual stream little, so the draft --
    the same model cut to its first layer (same embeddings, norm and head) -- agrees with the target often
    (~0.8 at the defaults; a smaller `deep_scale` agrees more) at ~1/4 of its step cost. A stand-in for a small
    and a large model of one family: speculation pays at batch 1 and stops paying as the batch grows
    (notebooks/regimes.ipynb). Built once under `root`, cached by its arguments like `tiny_family`.
    """
    def build(tmp: Path) -> dict[str, Any]:
        tok = train_tokenizer(tmp / "tokenizer")
        build_tiny_model(tmp / "target", tok, hidden=hidden, num_layers=num_layers, heads=8, kv_heads=4,
                         intermediate=2 * hidden, seed=seed)
        model = load_tiny(tmp / "target")
        with torch.no_grad():
            for layer in model.model.layers[1:]:
                layer.self_attn.o_proj.weight.mul_(deep_scale)
                layer.mlp.down_proj.weight.mul_(deep_scale)
        model.save_pretrained(tmp / "target")
        model.model.layers = model.model.layers[:1]
        model.config.num_hidden_layers = 1
        model.save_pretrained(tmp / "draft")
        tok.save_pretrained(tmp / "draft")
        return {"agreement": measure_agreement(tmp / "target", tmp / "draft")}

    final, info = _cached_build(root, "regime-pair", "pair.json", build,
                                {"hidden": hidden, "layers": num_layers, "deep_scale": deep_scale, "seed": seed})
    return RegimePair(final / "tokenizer", final / "target", final / "draft", info["agreement"])
