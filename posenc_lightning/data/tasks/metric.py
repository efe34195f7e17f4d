"""Exact-match accuracy on answer tokens, per evaluation length (torchmetrics)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor
from torchmetrics import Metric

from posenc_lightning.data.tasks.base import IGNORE


def exact_match(logits: Tensor, targets: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Per sequence: ``(all_correct [B] bool, correct_tokens [B], answer_tokens [B])``.

    A sequence is correct when the argmax at every answer position (``targets != IGNORE``) is the
    target: with teacher forcing this is exactly "greedy decoding reproduces the answer".

    Args:
        logits: ``[B, N, V]`` (or predicted ids ``[B, N]``).
        targets: ``[B, N]`` with ``IGNORE`` off the answer.
    """
    preds = logits.argmax(-1) if logits.dim() == 3 else logits
    if preds.shape != targets.shape:
        raise ValueError(f"exact_match: predictions {tuple(preds.shape)} and targets {tuple(targets.shape)} differ")
    scored = targets != IGNORE
    hit = (preds == targets) & scored
    n_ans = scored.sum(-1)
    n_hit = hit.sum(-1)
    return n_hit == n_ans, n_hit, n_ans


class ExactMatchByLength(Metric):
    """Exact-match accuracy (and answer-token accuracy) at each evaluation length.

    ``update(logits, targets, length)`` adds a batch evaluated at ``length``; `compute` returns
    ``{"exact_match": [L], "token_accuracy": [L]}`` in the order of ``lengths`` (NaN where a
    length got no sequence). Sequences without an answer token are not counted. Sums reduce over
    processes, so every rank may score its own share.

    Args:
        lengths: the evaluation lengths.
    """

    full_state_update = False

    def __init__(self, lengths: Sequence[int], **kwargs) -> None:
        super().__init__(**kwargs)
        self.lengths = [int(n) for n in lengths]
        if not self.lengths or len(set(self.lengths)) != len(self.lengths):
            raise ValueError(f"ExactMatchByLength: lengths={list(lengths)} must be distinct and not empty")
        k = len(self.lengths)
        for name in ("sequences", "correct", "tokens", "correct_tokens"):
            self.add_state(name, default=torch.zeros(k, dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, logits: Tensor, targets: Tensor, length: int) -> None:
        if int(length) not in self.lengths:
            raise ValueError(f"ExactMatchByLength: length={length} is not one of lengths={self.lengths}")
        i = self.lengths.index(int(length))
        ok, n_hit, n_ans = exact_match(logits, targets)
        has = n_ans > 0
        self.sequences[i] += has.sum()
        self.correct[i] += (ok & has).sum()
        self.tokens[i] += n_ans.sum()
        self.correct_tokens[i] += n_hit.sum()

    def compute(self) -> dict[str, Tensor]:
        nan = torch.tensor(float("nan"), dtype=torch.float64, device=self.sequences.device)
        em = torch.where(self.sequences > 0, self.correct / self.sequences.clamp(min=1), nan)
        tok = torch.where(self.tokens > 0, self.correct_tokens / self.tokens.clamp(min=1), nan)
        return {"exact_match": em, "token_accuracy": tok}
