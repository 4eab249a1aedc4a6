"""A fake model worker: an order-n Markov "language model" over a tiny vocabulary, no torch model.

It runs the real protocol logic (`LogitsWorker`: sync, propose, verify, rollback), so coordinator tests
need no weights and no Ray, and its exact output distribution is known in closed form
(`next_probs`), which lets tests check end-to-end exactness of whole cascades statistically.
Drafts are made by adding noise to the target's table (controllable acceptance). It scores token trees too
(`LogitsWorker.score_tree`) and drafts them (`LogitsWorker.propose_tree`): a node's context is the text plus its
ancestors; having no KV, keeping a path (`accept_paths`) is only the bookkeeping.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specray.engine.base import LogitsWorker
from specray.engine.rows import SeqState


class FakeWorker(LogitsWorker):
    """next-token logits = table[last `order` tokens]; table ~ sharpness * N(0, 1) (+ noise * N(0, 1))."""

    tree_verify = True
    tree_propose = True

    def __init__(
        self,
        name: str = "fake",
        vocab: int = 8,
        order: int = 1,
        table_seed: int = 0,
        noise: float = 0.0,
        noise_seed: int = 1,
        sharpness: float = 2.0,
        max_context: int = 4096,
        eos_token_ids: Sequence[int] = (),
    ) -> None:
        super().__init__()
        self.name = name
        self.vocab_size = vocab
        self.order = order
        self.max_context = max_context
        self.eos_token_ids = tuple(eos_token_ids)
        g = torch.Generator().manual_seed(table_seed)
        table = torch.randn(vocab**order, vocab, generator=g) * sharpness
        if noise:
            table = table + noise * torch.randn(table.shape, generator=torch.Generator().manual_seed(noise_seed))
        self.table = table  # [V**order, V]
        self.calls: list[tuple[str, int, int]] = []  # (kind, batch size, max new tokens) per forward
        self.tokenizer = None

    def _index(self, context: Sequence[int]) -> int:
        idx = 0
        for t in list(context)[-self.order :]:
            idx = idx * self.vocab_size + int(t)
        return idx

    def next_logits(self, context: Sequence[int]) -> torch.Tensor:
        return self.table[self._index(context)]

    def _forward(
        self,
        seqs: Sequence[SeqState],
        inputs: Sequence[Sequence[int]],
        keep: Sequence[int],
        parents: Sequence[Sequence[int]] | None = None,
    ) -> torch.Tensor:
        self.calls.append(("forward", len(seqs), max(len(x) for x in inputs)))
        rows = []
        for b, (s, x, n) in enumerate(zip(seqs, inputs, keep)):
            prefix = s.tokens[max(0, s.kv_len - self.order) : s.kv_len]
            for j in range(len(x) - n, len(x)):
                back: list[int] = []  # x[j] and its ancestors in the window, nearest first
                a = j
                while a >= 0 and len(back) < self.order:
                    back.append(int(x[a]))
                    a = (a - 1) if parents is None else parents[b][a]
                rows.append(self._index(prefix + back[::-1]))
        return self.table[torch.tensor(rows, dtype=torch.long)]
