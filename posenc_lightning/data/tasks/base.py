"""The shape every synthetic task shares: a vocabulary, an exact-length example builder and the
split of an example into model inputs and answer-only targets."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch
from torch import Tensor

#: token ids every task shares: padding, start of sequence, separator between question and answer
PAD, BOS, SEP = 0, 1, 2
SPECIALS = ("<pad>", "<bos>", "<sep>")
#: the target of a token that is not an answer (``F.cross_entropy``'s default ``ignore_index``)
IGNORE = -100


@dataclass(frozen=True)
class Example:
    """One sequence of a task.

    Args:
        tokens: ``[n + 1]`` int64 token ids; the model reads ``tokens[:-1]`` (length ``n``) and
            predicts ``tokens[1:]``.
        answer: ``[n + 1]`` bool, True where a token is part of the answer (scored and trained
            on); never the first token.
        shown: ``[n + 1]`` int64, the tokens the model reads where they differ from ``tokens``
            (answers that are labels only, never read: Zoology's MQAR); None: the model reads
            ``tokens``.
    """

    tokens: np.ndarray
    answer: np.ndarray
    shown: np.ndarray | None = None

    @property
    def length(self) -> int:
        """The input length ``n`` the model reads."""
        return len(self.tokens) - 1

    def input_target(self, pad_to: int | None = None) -> tuple[Tensor, Tensor]:
        """``(input_ids [n], targets [n])`` with ``targets = IGNORE`` except at answer tokens,
        right-padded to ``pad_to`` (PAD inputs, IGNORE targets: a causal model's earlier
        predictions cannot see the padding). The inputs are ``shown`` where the task gives it."""
        x = torch.from_numpy((self.tokens if self.shown is None else self.shown)[:-1].copy())
        y = torch.from_numpy(np.where(self.answer[1:], self.tokens[1:], IGNORE))
        if pad_to is not None and pad_to > len(x):
            extra = pad_to - len(x)
            x = torch.cat((x, torch.full((extra,), PAD, dtype=x.dtype)))
            y = torch.cat((y, torch.full((extra,), IGNORE, dtype=y.dtype)))
        return x, y


class Task(ABC):
    """A synthetic sequence task: exact answers, any length from `min_len` on.

    A subclass sets ``name``, ``symbols`` (its tokens after the shared `SPECIALS`), ``min_len``
    and implements `_build`. `sample` makes an example of exactly the requested input length
    (structure that does not fill it is preceded by PAD tokens).
    """

    name: ClassVar[str]
    symbols: ClassVar[tuple[str, ...]]
    #: the shortest input length (tokens the model reads) the task can build
    min_len: ClassVar[int]

    @property
    def vocab(self) -> tuple[str, ...]:
        """Every token name, index = id."""
        return SPECIALS + self.symbols

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def id(self, symbol: str) -> int:
        """The id of a task token (e.g. ``'='``)."""
        return len(SPECIALS) + self.symbols.index(symbol)

    def decode(self, tokens: Any) -> list[str]:
        """Token names of ``tokens`` (ids), for reading examples."""
        return [self.vocab[int(t)] for t in tokens]

    def config(self) -> dict[str, Any]:
        """The task's arguments (recorded with results)."""
        return {}

    def sample(self, rng: np.random.Generator, n: int) -> Example:
        """An example whose input is exactly ``n`` tokens (``n + 1`` tokens in all).

        Raises:
            ValueError: ``n`` is shorter than the task's `min_len`.
        """
        if n < self.min_len:
            raise ValueError(f"{self.name}: length n={n} is shorter than the task's min_len={self.min_len}; "
                             f"use n >= {self.min_len}")
        toks, ans, *shown = self._build(rng, n + 1)
        pad = n + 1 - len(toks)
        if pad < 0:
            raise AssertionError(f"{self.name}: built {len(toks)} tokens for n + 1 = {n + 1}")

        def padded(values: list[int]) -> np.ndarray:
            return np.concatenate((np.full(pad, PAD, dtype=np.int64), np.asarray(values, dtype=np.int64)))

        answer = np.concatenate((np.zeros(pad, dtype=bool), np.asarray(ans, dtype=bool)))
        return Example(padded(toks), answer, padded(shown[0]) if shown else None)

    @abstractmethod
    def _build(self, rng: np.random.Generator,
               total: int) -> tuple[list[int], list[bool]] | tuple[list[int], list[bool], list[int]]:
        """At most ``total`` tokens (starting with BOS) and their answer flags; a task whose
        inputs differ from its tokens (answers the model never reads) adds the inputs, as long."""


def check_positive(task: str, **values: int) -> None:
    """A clear ValueError for a task argument that must be a positive integer."""
    for k, v in values.items():
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{task}: {k}={v!r} must be a positive integer")
