"""The `hf` backend: a transformers causal LM behind the worker protocol, exact at every temperature.

One forward pass serves a whole ragged batch: each row feeds its pending tokens (not yet in the KV cache)
plus its draft (a chain, or a token tree: `LogitsWorker.score_tree`), at explicit positions, into its own cache
slot (`SlotKVCache`). Verification runs here,
next to the logits (see `LogitsWorker`), so only token ids (and q when the drafter sampled) leave it.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Sequence
from typing import Any

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.overrides import TorchFunctionMode

from specray.engine.base import LogitsWorker
from specray.engine.kv_cache import SlotKVCache
from specray.engine.protocol import WorkerStats
from specray.engine.rows import SeqState
from specray.engine.tree_rows import tree_window

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return _DTYPES[dtype.lower()]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(_DTYPES)}") from None


#: the fewest prompt tokens a finished sequence's KV slot must share with a new prompt to be reused for it
MIN_PREFIX = 8

_CUDA_SDPA = (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH)


def attention_kernels(backends: Sequence[SDPBackend] | None) -> contextlib.AbstractContextManager:
    """Restrict scaled-dot-product attention to `backends` for the forward (None: PyTorch's own choice)."""
    return contextlib.nullcontext() if backends is None else sdpa_kernel(list(backends))


#: a forward whose linear layers take at least this many token rows is prompt-sized (`PromptUpcast`)
PROMPT_ROWS = 32


class PromptUpcast(TorchFunctionMode):
    """Runs the half-precision linear layers of a prompt-sized forward in float32: the weight is widened into one
    preallocated buffer, the product is float32, and the result is rounded back to the model's dtype.

    On some CPUs oneDNN's bf16 GEMM is the slower of the two once a forward feeds many tokens (a prefill, a
    catch-up: compute bound, where a decoding step is bound by reading the weights), and widening a weight costs a
    small share of such a product (`prompt_upcast_pays` measures both at load). Decoding steps and verifications
    never use it: their numerics stay those of the model's dtype, so only prefills change, the same for every
    plan."""

    def __init__(self, largest: int) -> None:
        """`largest`: elements of the largest weight to widen (a real model's larger output head keeps its dtype)."""
        super().__init__()
        self.buffer = torch.empty(largest, dtype=torch.float32)
        self.widened = 0  # linear calls run in float32 (`HFWorker.stats`)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _PACKED_LINEAR:  # a `PackedLinear`: its weight's dense form is widened
            x, w, b = args[0], args[1], args[2]
        elif func is torch.nn.functional.linear:
            x = args[0] if args else kwargs["input"]
            w = args[1] if len(args) > 1 else kwargs["weight"]
            b = args[2] if len(args) > 2 else kwargs.get("bias")
        else:
            return func(*args, **kwargs)
        if (x.dtype not in (torch.bfloat16, torch.float16) or w.numel() > self.buffer.numel()
                or x.numel() < PROMPT_ROWS * x.shape[-1]):
            return func(*args, **kwargs)
        wide = self.buffer[: w.numel()].view(w.shape)
        wide.copy_(w.to_dense() if w.is_mkldnn else w)
        self.widened += 1
        return torch.nn.functional.linear(x.float(), wide, None if b is None else b.float()).to(x.dtype)


def prompt_upcast_pays(dtype: torch.dtype, rows: int, features: int, out_features: int, repeats: int = 3) -> bool:
    """Whether a prompt-sized linear of this shape runs at least 10% faster widened to float32 (`PromptUpcast`)
    than in `dtype` on this CPU, with the threads this worker will use: a few timed GEMMs at load."""
    x = torch.randn(rows, features).to(dtype)
    w = torch.randn(out_features, features).to(dtype)
    wide = torch.empty(out_features, features)

    def half() -> None:
        torch.nn.functional.linear(x, w)

    def widened() -> None:
        wide.copy_(w)
        torch.nn.functional.linear(x.float(), wide).to(dtype)

    best = {}
    for name, fn in (("half", half), ("wide", widened)):
        fn()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        best[name] = min(times)
    return best["wide"] < 0.9 * best["half"]


def _eos_ids(model: torch.nn.Module, tokenizer) -> tuple[int, ...]:
    """End-of-sequence ids from the generation config and the tokenizer (instruct models often list two)."""
    ids: set[int] = set()
    gen = getattr(model, "generation_config", None)
    eos = getattr(gen, "eos_token_id", None) if gen is not None else None
    if isinstance(eos, int):
        ids.add(eos)
    elif eos:
        ids.update(int(e) for e in eos)
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    return tuple(sorted(ids))


#: the op a `PackedLinear` runs: a linear layer over a weight in oneDNN's layout (torch's own, as its CPU compiler
#: uses for frozen weights)
_PACKED_LINEAR = torch.ops.mkldnn._linear_pointwise


def packing_supported(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether `PackedLinear` can hold weights of `dtype` here: bfloat16 on a CPU whose oneDNN computes it."""
    if device.type != "cpu" or dtype != torch.bfloat16:
        return False
    try:
        return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


class PackedLinear(torch.nn.Module):
    """A bfloat16 nn.Linear whose weight is reordered once into oneDNN's blocked layout (CPU only).

    A decoding step or a verification reads every weight once and is bound by memory; torch's own bf16 linear
    prepares the weight for the GEMM on every call, which on these CPUs is a large share of a step. The product is
    the same oneDNN bf16 GEMM, in the model's dtype; the dense weight is given back by `weight.to_dense()` (a prompt
    run in float32 widens it from there: `PromptUpcast`). The module holds only the reordered copy; a weight tied
    to the input embedding (an output head) stays there too, so the head then takes its size in memory again."""

    def __init__(self, linear: torch.nn.Linear, rows: int = 1) -> None:
        """`rows`: the token rows the layout is chosen for (decoding: 1); any number of rows runs."""
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("weight", torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), rows))
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        y = _PACKED_LINEAR(x.reshape(-1, self.in_features), self.weight, self.bias, "none", [], "")
        return y.reshape(*lead, self.out_features)


def _linears(model: torch.nn.Module) -> list[tuple[torch.nn.Module, str, torch.nn.Linear]]:
    """(parent, attribute, layer) of every nn.Linear of `model`, in module order."""
    return [(module, name, child) for module in model.modules() for name, child in module.named_children()
            if isinstance(child, torch.nn.Linear)]


def pack_linears(model: torch.nn.Module, probe: bool = False, repeats: int = 3) -> int:
    """Swap the bfloat16 nn.Linear layers of a CPU model for `PackedLinear`s; returns how many (0 where `probe` finds
    no gain). `probe`: first time one decoding-sized pass (one token row) over the first layers' weights, at least
    64 MiB of them where the model has that much (more than a CPU's cache holds, as a step reads them), plain and
    packed, and pack only where packed takes under 0.9x the time."""
    found = [(m, n, lin) for m, n, lin in _linears(model) if lin.weight.dtype == torch.bfloat16]
    found.sort(key=lambda t: t[0] is model)  # the decoder's layers first, an output head last (the probe's sample)
    if not found:
        return 0
    packed: dict[int, PackedLinear] = {}
    if probe:
        sample, size = [], 0
        for _, _, lin in found:
            sample.append(lin)
            size += lin.weight.numel() * lin.weight.element_size()
            if size >= 64 << 20:
                break
        for lin in sample:
            packed[id(lin)] = PackedLinear(lin)
        xs = [torch.randn(1, lin.in_features, dtype=torch.bfloat16) for lin in sample]

        def timed(layers: list[torch.nn.Module]) -> float:
            best = float("inf")
            for _ in range(repeats + 1):  # the first pass warms oneDNN's kernel caches
                t0 = time.perf_counter()
                for layer, x in zip(layers, xs):
                    layer(x)
                best = min(best, time.perf_counter() - t0)
            return best

        with torch.inference_mode():
            dense, fast = timed(sample), timed([packed[id(lin)] for lin in sample])
        log.info("bf16 linears prepacked for oneDNN: %.2f ms, as they are: %.2f ms (a pass over %d layers)",
                 1000 * fast, 1000 * dense, len(sample))
        if fast >= 0.9 * dense:
            return 0
    for m, n, lin in found:
        setattr(m, n, packed.pop(id(lin), None) or PackedLinear(lin))
    return len(found)


class PrepackedLinear(torch.nn.Module):
    """An fp32 nn.Linear whose weight is reordered once for oneDNN (CPU only).

    On CPUs without bf16 matrix units a plain GEMM's cost grows almost linearly with the tokens fed, so a
    9-token verification costs ~3 decoding steps; with the prepacked weight it costs ~1.9 (1.5B, 1 thread,
    measured here), which is what makes speculation pay on such CPUs. Numerics stay fp32.
    """

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        from torch.utils.mkldnn import MkldnnLinear

        self.inner = MkldnnLinear(linear, torch.float32)
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        y = self.inner(x.reshape(-1, self.in_features).contiguous())
        return y.reshape(*lead, self.out_features)


def prepack_linears(model: torch.nn.Module) -> int:
    """Swap every nn.Linear of an fp32 CPU model for a `PrepackedLinear`; returns how many."""
    found = [(m, n, lin) for m, n, lin in _linears(model) if lin.weight.dtype == torch.float32]
    for m, n, lin in found:
        setattr(m, n, PrepackedLinear(lin))
    return len(found)


class HFWorker(LogitsWorker):
    """Worker over a transformers model folder, known name or hub id (Llama, Qwen2, Mistral, GPT-2, ...).

    num_threads: torch's intra-op threads of this worker's calls, in whatever thread makes them
    (`specray.engine.threads`), so in-process levels each keep their own; also the process default from here on
    (the model loads with it). prefill_chunk bounds the tokens of one prompt forward.
    prefix_caching: a new sequence takes the KV of a finished one whose tokens its prompt starts with (at least
    `MIN_PREFIX` of them), so its prefill feeds only the rest (`SlotKVCache`).
    cpu_prepack: reorder the linear weights once for oneDNN (`_prepack`): None (default) does so for bfloat16 where
    a probe at load finds it faster on this CPU, True forces it (float32 too), False never.
    `model` may also be a causal LM already built (random weights of a real shape, for step-time benchmarks on a
    machine that cannot download any); `tokenizer` is then optional (token-id prompts only without one).
    """

    tree_verify = True
    tree_propose = True

    def __init__(
        self,
        model: str | torch.nn.Module,
        *,
        name: str | None = None,
        tokenizer: Any = None,
        dtype: str | torch.dtype = "float32",
        device: str = "cpu",
        num_threads: int | None = None,
        attn_implementation: str = "sdpa",
        max_context: int | None = None,
        prefill_chunk: int = 512,
        initial_slots: int = 4,
        cpu_prepack: bool | None = None,
        prefix_caching: bool = True,
        prompt_upcast: bool | None = None,
    ) -> None:
        from transformers import AutoModelForCausalLM

        from specray.engine.models import load_tokenizer, resolve_model

        super().__init__()
        self.num_threads = num_threads
        if num_threads:
            torch.set_num_threads(num_threads)
        self.device = torch.device(device)
        self.dtype = parse_dtype(dtype)
        t0 = time.perf_counter()
        if isinstance(model, torch.nn.Module):
            self.name = name or type(model).__name__
            self.model = model.to(self.device, self.dtype).eval()
            self.tokenizer = tokenizer
        else:
            self.name = name or model
            path = resolve_model(model)
            self.model = AutoModelForCausalLM.from_pretrained(
                path, dtype=self.dtype, attn_implementation=attn_implementation
            ).to(self.device).eval()
            self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(path)
        self.eos_token_ids = _eos_ids(self.model, self.tokenizer)
        cfg = self.model.config.get_text_config()
        self.vocab_size = int(self.model.get_output_embeddings().weight.shape[0])
        self.upcast = self._prompt_upcast(prompt_upcast)
        self.packed = self._prepack(cpu_prepack)
        self.eager = getattr(self.model.config, "_attn_implementation", "sdpa") == "eager"
        heads = cfg.num_attention_heads
        kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        self.max_context = int(max_context or getattr(cfg, "max_position_embeddings", None) or 4096)
        self.cache = SlotKVCache(
            cfg.num_hidden_layers, kv_heads, head_dim, self.dtype, self.device,
            initial_slots=initial_slots, initial_capacity=256, max_capacity=self.max_context,
            min_prefix=MIN_PREFIX if prefix_caching else 0,
        )
        self.prefill_chunk = prefill_chunk
        # On CUDA, PyTorch may pick cuDNN's attention for our masked forwards, which sets up a plan on the host
        # for every new (batch, query, KV length) shape, i.e. on every decoding step; the flash and memory-efficient
        # kernels need no such setup, so they are the ones allowed there.
        self.sdpa_backends = _CUDA_SDPA if self.device.type == "cuda" else None
        self.forward_calls = 0
        self.forward_seconds = 0.0
        self.load_seconds = time.perf_counter() - t0
        log.info("loaded %s (%s) in %.1fs", self.name, self.dtype, self.load_seconds)

    def _prompt_upcast(self, wanted: bool | None) -> PromptUpcast | None:
        """The float32 mode of prompt-sized forwards (`PromptUpcast`): on a CPU with half-precision weights, where
        asked (`wanted`), or where unasked (None) and a probe at load says it pays on this CPU."""
        half = self.device.type == "cpu" and self.dtype in (torch.bfloat16, torch.float16)
        if wanted and not half:
            raise ValueError(f"{self.name}: prompt_upcast is for bfloat16 / float16 weights on a CPU device")
        if not half or wanted is False:
            return None
        head = self.model.get_output_embeddings()
        linears = [m for m in self.model.modules() if isinstance(m, torch.nn.Linear) and m is not head]
        if not linears:
            return None
        big = max(linears, key=lambda m: m.weight.numel())
        if wanted is None:
            wanted = prompt_upcast_pays(self.dtype, 256, big.in_features, big.out_features)
            log.info("%s: prompts run their linear layers in %s on this CPU (a probe at load)", self.name,
                     "float32" if wanted else self.dtype)
        return PromptUpcast(big.weight.numel()) if wanted else None

    def _prepack(self, wanted: bool | None) -> int:
        """Reorder the linear weights once for oneDNN on a CPU; returns how many. float32 (`PrepackedLinear`) where
        asked; bfloat16 (`PackedLinear`) where asked, or unasked (None) where this CPU's oneDNN computes bf16 and a
        probe at load finds the packed layers faster (logged)."""
        if wanted is False:
            return 0
        with torch.no_grad():
            if wanted and self.dtype == torch.float32 and self.device.type == "cpu":
                return prepack_linears(self.model)
            if packing_supported(self.dtype, self.device):
                n = pack_linears(self.model, probe=wanted is None)
                log.info("%s: %s", self.name, f"{n} linear layers prepacked for oneDNN" if n else
                         "linear layers left as they are (prepacked ones were not faster on this CPU)")
                return n
        if wanted:
            raise ValueError(f"{self.name}: cpu_prepack needs float32 or bfloat16 weights on a CPU device (bfloat16 "
                             "where this CPU's oneDNN computes it)")
        return 0

    def _prefill(self, seq: SeqState, chunk: Sequence[int]) -> None:
        if self.upcast is None or len(chunk) < PROMPT_ROWS:
            return super()._prefill(seq, chunk)
        with self.upcast:
            return super()._prefill(seq, chunk)

    def _allocate(self, prompt: Sequence[int]) -> tuple[int, int]:
        return self.cache.allocate(prompt)

    def _release(self, slot: int, tokens: Sequence[int]) -> None:
        self.cache.release(slot, tokens)

    def _cache_bytes(self) -> int:
        return self.cache.nbytes()

    def reset_prefix_cache(self) -> None:
        self.cache.forget_prefixes()

    def stats(self) -> WorkerStats:
        st = super().stats()
        st.extra.update(forward_calls=self.forward_calls, forward_seconds=self.forward_seconds,
                        prefix_cache_hits=self.cache.prefix_hits, prefix_cache_tokens=self.cache.prefix_tokens,
                        prompt_linears_fp32=self.upcast.widened if self.upcast is not None else 0,
                        linears_prepacked=self.packed)
        return st

    def _move_kv(self, slots: Sequence[int], src: Sequence[int], dst: Sequence[int]) -> None:
        self.cache.move(list(slots), list(src), list(dst))

    @torch.inference_mode()
    def _forward(
        self,
        seqs: Sequence[SeqState],
        inputs: Sequence[Sequence[int]],
        keep: Sequence[int],
        parents: Sequence[Sequence[int]] | None = None,
    ) -> torch.Tensor:
        bsz, q = len(seqs), max(len(x) for x in inputs)
        slots, starts = [s.slot for s in seqs], [s.kv_len for s in seqs]
        # Every per-token input in one host tensor and one copy to the device (each copy waits for the device):
        # per row the ids (right-padded with token 0), the storage indices, the slot, then which logits to keep:
        # the positions of the last keep[b] inputs when every row keeps as many (the logits then come out
        # [B, keep, V], rows in order, and nothing waits for the device), else a [B, q] 0/1 mask; for a tree, the
        # position ids (the row's start + each input's depth; padding: roots of their own).
        same = keep[0] if all(n == keep[0] for n in keep) else 0
        par = [[*pr, *[-1] * (q - len(pr))] for pr in parents] if parents is not None else None
        rows = []
        for b, (x, n, st, sl) in enumerate(zip(inputs, keep, starts, slots)):
            m = len(x)
            want = list(range(m - same, m)) if same else [0] * (m - n) + [1] * n + [0] * (q - m)
            rows.append([*x, *[0] * (q - m), *range(st, st + q), sl, *want])
            if par is not None:
                depth: list[int] = []
                for a in par[b]:
                    depth.append(0 if a < 0 else depth[a] + 1)
                rows[-1] += [st + d for d in depth]
        packed = torch.tensor(rows, dtype=torch.long, device=self.device).view(bsz, -1)  # [B, 2q + 1 + (keep|q) (+q)]
        ids, idx, row, want, *tree_pos = packed.split([q, q, 1, same or q] + ([q] if par is not None else []), dim=1)
        keep_logits = want if same else want.bool()
        index = (row.squeeze(1), idx)
        if par is None:
            pos, mask = self.cache.begin(slots, starts, q, eager=self.eager, index=index)
        else:
            _, window = tree_window(torch.tensor(par, dtype=torch.long).view(bsz, q))  # [B, q, q]
            pos, mask = self.cache.begin(slots, starts, q, eager=self.eager, positions=tree_pos[0], window=window,
                                         index=index)
        t0 = time.perf_counter()
        try:
            with attention_kernels(self.sdpa_backends):
                out = self.model(
                    input_ids=ids, position_ids=pos, attention_mask=mask,
                    past_key_values=self.cache, use_cache=True, logits_to_keep=keep_logits,
                )
        finally:
            self.cache.end()
        self.forward_calls += 1
        self.forward_seconds += time.perf_counter() - t0
        logits = out.logits.reshape(-1, out.logits.shape[-1])  # [sum(keep), V]
        return logits if logits.dtype == torch.float32 else logits.float()
