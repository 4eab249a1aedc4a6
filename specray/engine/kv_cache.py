"""A slot-pool KV cache with position-indexed writes, so rollback only sets a length.

Stock transformers caches cannot write at different positions in different batch rows, and undoing a
rejected draft with them means copying KV. This cache is a
duck-typed stand-in: the model only ever calls `update(k, v, layer_idx)` and `get_seq_length()` when we
pass explicit `position_ids` and a 4D mask, which `begin()` builds.

Layout per layer: K and V pools of shape [S_slots, H_kv, capacity, D]. A sequence owns one slot; its
valid length is kept by the worker and passed to `begin()`. Rejected tokens stay in the pool past that
length and are hidden by the mask until a later write overwrites them, so rollback copies nothing.

Prefix caching works the same way: a released slot keeps its KV, and the cache remembers which tokens it holds.
A new sequence whose prompt starts with a released slot's tokens takes that slot and starts with those positions
already valid (a conversation's next turn, or another request with the same system prompt and document), so its
prefill feeds only the rest. Nothing is copied, and a slot that was never released keeps nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class SlotKVCache:
    """KV pools for `num_layers` layers, grown on demand (amortised doubling) in slots and length."""

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        initial_slots: int = 4,
        initial_capacity: int = 256,
        max_capacity: int | None = None,
        min_prefix: int = 0,
    ) -> None:
        """min_prefix: the fewest leading tokens a released slot must share with a new prompt to be reused for it
        (0: no prefix caching)."""
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        self.max_capacity = max_capacity
        self._slots = 0
        self._capacity = 0
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self._free: list[int] = []
        self.min_prefix = min_prefix
        #: released slot -> the tokens whose KV it still holds, least recently released first
        self._kept: dict[int, list[int]] = {}
        self.prefix_hits = 0
        self.prefix_tokens = 0
        self._grow(initial_slots, initial_capacity)
        # set by begin() for the forward in flight
        self._rows: torch.Tensor | None = None  # [B]
        self._idx: torch.Tensor | None = None  # [B, q] storage index of each new token
        self._kv_len = 0
        self._contiguous: tuple[int, int] | None = None
        self._block: int | None = None

    # ----- slot management -------------------------------------------------------------------
    def allocate(self, prompt: Sequence[int] = ()) -> tuple[int, int]:
        """Take a free slot for a sequence starting with `prompt`: (slot, positions of it whose KV the slot already
        holds). The released slot sharing the longest prefix with `prompt` (at least `min_prefix` tokens, and
        never the whole prompt: its last token is fed to get logits), else a slot that keeps nothing (lowest first:
        keeps active rows near-contiguous), else the least recently released one; the pool grows only when no
        slot is free."""
        best, best_n = -1, 0
        if self.min_prefix and len(prompt) > self.min_prefix:
            for slot, held in self._kept.items():
                n = _common_prefix(held, prompt, len(prompt) - 1)
                if n >= self.min_prefix and n > best_n:
                    best, best_n = slot, n
        if best < 0:
            if not self._free:
                self._grow(max(1, self._slots) * 2, self._capacity)
            empty = [s for s in self._free if s not in self._kept]
            best = empty[-1] if empty else next(iter(self._kept))
        self._free.remove(best)
        self._kept.pop(best, None)
        if best_n:
            self.prefix_hits += 1
            self.prefix_tokens += best_n
        return best, best_n

    def forget_prefixes(self) -> None:
        """Released slots keep nothing from now on (their KV stays until overwritten, unreachable)."""
        self._kept.clear()

    def release(self, slot: int, tokens: Sequence[int] = ()) -> None:
        """Free `slot`; `tokens`: those its first positions hold valid KV of (kept for prefix caching)."""
        self._free.append(slot)
        self._free.sort(reverse=True)  # hand out low slots first: keeps active rows near-contiguous
        if self.min_prefix and len(tokens) >= self.min_prefix:
            self._kept[slot] = list(tokens)

    @property
    def num_slots(self) -> int:
        return self._slots

    @property
    def capacity(self) -> int:
        return self._capacity

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def _grow(self, slots: int, capacity: int) -> None:
        if self.max_capacity is not None:
            capacity = min(capacity, self.max_capacity)
        slots, capacity = max(slots, self._slots), max(capacity, self._capacity)
        if (slots, capacity) == (self._slots, self._capacity):
            return
        shape = (slots, self.num_kv_heads, capacity, self.head_dim)
        # Pools grown inside a forward (under inference mode) would be inference tensors, which refuse the
        # in-place moves that compact an accepted tree path outside it; ordinary tensors take writes in both.
        with torch.inference_mode(False):
            self._grow_pools(shape)
        self._free.extend(range(slots - 1, self._slots - 1, -1))
        self._free.sort(reverse=True)
        self._slots, self._capacity = slots, capacity

    def _grow_pools(self, shape: tuple[int, int, int, int]) -> None:
        for store in (self.k, self.v):
            for i in range(self.num_layers):
                new = torch.zeros(shape, dtype=self.dtype, device=self.device)
                if store and i < len(store):
                    old = store[i]
                    new[: old.shape[0], :, : old.shape[2]] = old
                    store[i] = new
                else:
                    store.append(new)

    def ensure_capacity(self, length: int) -> None:
        if length > self._capacity:
            if self.max_capacity is not None and length > self.max_capacity:
                raise ValueError(f"sequence needs {length} KV positions, over the limit {self.max_capacity}")
            cap = self._capacity
            while cap < length:
                cap *= 2
            self._grow(self._slots, cap)

    # ----- one forward -----------------------------------------------------------------------
    def begin(
        self,
        rows: list[int],
        starts: list[int],
        q: int,
        eager: bool = False,
        positions: torch.Tensor | None = None,  # [B, q] long
        window: torch.Tensor | None = None,  # [B, q, q] bool
        index: tuple[torch.Tensor, torch.Tensor] | None = None,  # [B] long, [B, q] long, on the device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Prepare a forward of q new tokens for each row (slot); returns (position_ids [B,q], mask).

        New token j of row b is stored at index starts[b] + j (starts = the row's valid KV length) and sees the
        row's first starts[b] entries plus, among the new tokens, those `window[b, j]` marks (default: tokens
        0..j, a causal chain). Its position id is `positions[b, j]` (default: its storage index); a token tree
        passes positions by depth and its ancestor-or-self matrix as the window. The mask is bool
        [B,1,q,kv_len] for sdpa, or additive float for eager attention (a bool mask is silently wrong with eager).
        `index`: the rows and storage indices (`rows`, starts[b] + j) already on the device (a caller that moves
        them with its other inputs in one copy); the mask is then built there, from them.
        """
        b = len(rows)
        kv_len = max(starts) + q
        self.ensure_capacity(kv_len)
        if index is None:  # on the device once per forward: a host-to-device copy waits for the device
            index = (torch.tensor(rows, dtype=torch.long, device=self.device),
                     torch.tensor([[s + j for j in range(q)] for s in starts], dtype=torch.long,
                                  device=self.device).view(b, q))
        self._rows, self._idx = index
        self._kv_len = kv_len
        r0 = rows[0]
        self._contiguous = (r0, r0 + b) if rows == list(range(r0, r0 + b)) else None
        # every row writing at the same start into a run of slots (batch 1 always): a slice, not a scatter
        self._block = starts[0] if self._contiguous is not None and len(set(starts)) == 1 else None
        keys = torch.arange(kv_len, device=self.device)
        if window is None:
            mask = (keys <= self._idx.unsqueeze(-1)).unsqueeze(1)  # [B,1,q,kv_len]
        else:
            if window.shape != (b, q, q):
                raise ValueError(f"window must be [B, q, q] = {(b, q, q)}, got {tuple(window.shape)}")
            mask = (keys < self._idx[:, :1]).unsqueeze(1).expand(b, q, kv_len).clone()  # the prefix
            mask.scatter_(2, self._idx.unsqueeze(1).expand(b, q, q), window.to(self.device, torch.bool))  # the window
            mask = mask.unsqueeze(1)  # [B,1,q,kv_len]
        if eager:
            fmask = torch.zeros(mask.shape, dtype=self.dtype, device=self.device)
            mask = fmask.masked_fill(~mask, torch.finfo(self.dtype).min)
        if positions is None:
            pos = self._idx
        elif positions.device == self.device and positions.dtype == torch.long:
            pos = positions
        else:
            pos = positions.to(self.device, torch.long)
        return pos, mask

    def end(self) -> None:
        self._rows = self._idx = None
        self._contiguous = self._block = None

    def move(self, rows: list[int], src: list[int], dst: list[int]) -> None:
        """Copy entry src[m] of slot rows[m] to index dst[m] of the same slot, in every layer (K and V).

        Only the listed entries move; all sources are read before any destination is written, so the moves of
        one call may overlap (compaction of an accepted tree path: sources at or after their destinations)."""
        if not rows:
            return
        r = torch.tensor(rows, dtype=torch.long, device=self.device)
        s = torch.tensor(src, dtype=torch.long, device=self.device)
        d = torch.tensor(dst, dtype=torch.long, device=self.device)
        for store in (self.k, self.v):
            for pool in store:
                pool[r, :, d] = pool[r, :, s]  # the right side is gathered (a copy) first

    # --- the two methods a transformers model calls ---
    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args, **kwargs):
        """key/value [B, H_kv, q, D] -> the rows' K and V [B, H_kv, kv_len, D] including the new tokens."""
        assert self._rows is not None and self._idx is not None, "begin() must precede the forward"
        kp, vp = self.k[layer_idx], self.v[layer_idx]
        if self._block is not None:
            a, b = self._contiguous
            s, e = self._block, self._block + key.shape[2]
            kp[a:b, :, s:e] = key.to(self.dtype)
            vp[a:b, :, s:e] = value.to(self.dtype)
        else:
            rows, pos = self._rows[:, None], self._idx  # [B,1], [B,q], on the device
            kp[rows, :, pos] = key.transpose(1, 2).to(self.dtype)  # indexed view is [B, q, H, D]
            vp[rows, :, pos] = value.transpose(1, 2).to(self.dtype)
        if self._contiguous is not None:
            a, b = self._contiguous
            return kp[a:b, :, : self._kv_len], vp[a:b, :, : self._kv_len]
        n = self._kv_len
        return kp[:, :, :n].index_select(0, self._rows), vp[:, :, :n].index_select(0, self._rows)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._kv_len if self._rows is not None else 0

    # transformers may probe these on a cache object
    @property
    def is_compileable(self) -> bool:
        return False


def _common_prefix(a: Sequence[int], b: Sequence[int], limit: int) -> int:
    """Length of the common prefix of a and b, at most `limit`."""
    n = min(len(a), len(b), limit)
    if n == 0 or a[0] != b[0]:
        return 0
    if list(a[:n]) == list(b[:n]):
        return n
    lo, hi = 1, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]: bisect on slice equality (C-speed comparisons)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if list(a[:mid]) == list(b[:mid]):
            lo = mid
        else:
            hi = mid
    return lo
