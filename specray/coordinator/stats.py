"""Per-level speculation statistics of a request or a batch (what `generate` returns and metrics count)."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["LevelStats"]


@dataclass
class LevelStats:
    """What one level saw as a verifier: drafts proposed to it and how many it accepted, per position."""

    num_drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    emitted_tokens: int = 0
    verify_calls: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def record(self, n_draft: int, n_acc: int, n_emitted: int) -> None:
        self.verify_calls += 1
        self.emitted_tokens += n_emitted
        if n_draft > 0:
            self.num_drafts += 1
            self.draft_tokens += n_draft
            self.accepted_tokens += n_acc
            if len(self.accepted_per_pos) < n_draft:
                self.accepted_per_pos.extend([0] * (n_draft - len(self.accepted_per_pos)))
            for j in range(n_acc):
                self.accepted_per_pos[j] += 1

    def merge(self, other: LevelStats) -> None:
        self.num_drafts += other.num_drafts
        self.draft_tokens += other.draft_tokens
        self.accepted_tokens += other.accepted_tokens
        self.emitted_tokens += other.emitted_tokens
        self.verify_calls += other.verify_calls
        if len(self.accepted_per_pos) < len(other.accepted_per_pos):
            self.accepted_per_pos.extend([0] * (len(other.accepted_per_pos) - len(self.accepted_per_pos)))
        for j, c in enumerate(other.accepted_per_pos):
            self.accepted_per_pos[j] += c

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per verification call (accepted + 1), vLLM's 'mean acceptance length'."""
        return self.emitted_tokens / self.verify_calls if self.verify_calls else 0.0

    def as_dict(self) -> dict:
        return {
            "num_drafts": self.num_drafts, "draft_tokens": self.draft_tokens,
            "accepted_tokens": self.accepted_tokens, "emitted_tokens": self.emitted_tokens,
            "verify_calls": self.verify_calls, "accepted_per_pos": list(self.accepted_per_pos),
            "acceptance_rate": round(self.acceptance_rate, 4),
            "mean_acceptance_length": round(self.mean_acceptance_length, 4),
        }
